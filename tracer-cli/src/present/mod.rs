//! Presenters: how results reach people and programs, one module per output form. They take
//! what the other rooms computed and only render it.

pub mod check;
pub mod diff;
pub mod explain;
pub mod job;
pub mod json;
pub mod layout;
pub mod live;
pub mod metrics;
pub mod otlp;
pub mod perfetto;
pub mod pickle;
pub mod pytorch_snapshot;
pub mod report;
pub mod rows;
pub mod stacks;
pub mod summary;
pub mod whatif;
