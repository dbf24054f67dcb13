//! Types shared by the eBPF programs and the `tracer` binary.
//!
//! Everything that crosses the kernel/user boundary is `#[repr(C)]`, made of fixed-width integers
//! with explicit padding, so both sides agree on the layout without a serializer.
#![no_std]

pub mod call;
pub mod event;
pub mod libwatch;
pub mod maps;
pub mod probes;
pub mod sched;
pub mod stack;
pub mod usdt;

pub use call::CallEvent;
pub use event::{EventHeader, EventKind};
pub use probes::{
    ArgRole, Library, Op, OpClass, OpPlan, ProbeSpec, Space, OP_COUNT, PLANS, PROBES,
};
pub use sched::SchedEvent;
pub use stack::{CallStackEvent, PyFrame, PyOffsets, PyProcess, PyStack};
