//! The record for one interval a traced thread spent off the CPU (host context for explain).

use crate::event::{EventHeader, EventKind};

/// `header.ts_ns` is when the thread left the CPU; `on_ns` when it came back.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SchedEvent {
    pub header: EventHeader,
    /// CLOCK_MONOTONIC ns when the thread ran again.
    pub on_ns: u64,
    /// When it was woken (0: it never slept, it was preempted while runnable).
    pub wakeup_ns: u64,
    /// 1 when it left the CPU runnable (preempted), 0 when it blocked.
    pub preempted: u32,
    pub _pad: u32,
}

impl SchedEvent {
    pub const LEN: u32 = core::mem::size_of::<Self>() as u32;
    pub const KIND: EventKind = EventKind::Sched;
}

/// A followed process ended: its leader thread (`header.tid == header.pid`) exited. Userspace
/// forgets what it kept for the pid, so a process that reuses it starts afresh.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ExitEvent {
    pub header: EventHeader,
}

impl ExitEvent {
    pub const LEN: u32 = core::mem::size_of::<Self>() as u32;
    pub const KIND: EventKind = EventKind::Exit;
}

/// Off-CPU state kept per thread between sched_switch events.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct OffCpu {
    pub off_ns: u64,
    pub wakeup_ns: u64,
    pub pid: u32,
    pub preempted: u32,
}

#[cfg(feature = "user")]
// SAFETY: repr(C), only integers, explicit padding.
unsafe impl aya::Pod for SchedEvent {}

#[cfg(feature = "user")]
// SAFETY: repr(C), the header only.
unsafe impl aya::Pod for ExitEvent {}

#[cfg(feature = "user")]
// SAFETY: repr(C), only integers, no implicit padding (24 bytes, 8-aligned).
unsafe impl aya::Pod for OffCpu {}
