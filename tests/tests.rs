//! tracer's integration tests: the real binary against real processes, one binary with a module
//! per area. tests/README.md says which need root and how a test without it shows.

mod allocator;
mod architecture;
mod arming;
mod common;
mod discovery;
mod e2e;
mod fleet;
mod flight;
mod graphs;
mod jobs;
mod lifecycle;
mod otlp;
mod recordings;
mod security;
mod snapshots;
mod views;
