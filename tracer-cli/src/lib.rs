//! tracer: eBPF tracing of CUDA memory allocation calls, stored in SQLite and explained.
//!
//! The data path reads one way (ARCHITECTURE.md): probe tables (tracer-common) -> eBPF programs
//! (tracer-ebpf) -> [`decode`] -> [`record`] -> [`store`] -> [`model`] / [`analysis`] ->
//! [`present`].

pub mod analysis;
pub mod decode;
pub mod demo;
pub mod exit;
pub mod model;
pub mod paths;
pub mod perf_event;
pub mod present;
pub mod probe;
pub mod query;
pub mod record;
pub mod serve;
pub mod store;
pub mod traced;
pub mod units;

#[cfg(test)]
mod fuzz_tests;
