//! Decoder of [`tracer_common::SchedEvent`].

use tracer_common::SchedEvent;

use super::DecodeError;

/// A traced thread's interval off the CPU (CLOCK_MONOTONIC ns).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OffCpu {
    pub pid: u32,
    pub tid: u32,
    pub off_mono_ns: u64,
    pub on_mono_ns: u64,
    /// When it was woken, if it had blocked.
    pub wakeup_mono_ns: Option<u64>,
    /// It left the CPU runnable (preempted) rather than blocking.
    pub preempted: bool,
}

impl OffCpu {
    pub fn from_raw(raw: &SchedEvent) -> Result<Self, DecodeError> {
        if raw.on_ns < raw.header.ts_ns {
            return Err(DecodeError::BadField {
                field: "on_ns",
                value: raw.on_ns,
            });
        }
        Ok(OffCpu {
            pid: raw.header.pid,
            tid: raw.header.tid,
            off_mono_ns: raw.header.ts_ns,
            on_mono_ns: raw.on_ns,
            wakeup_mono_ns: (raw.wakeup_ns != 0).then_some(raw.wakeup_ns),
            preempted: raw.preempted != 0,
        })
    }
}
