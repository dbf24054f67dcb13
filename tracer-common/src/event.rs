//! The envelope every ring-buffer record starts with.

/// What follows the header. Values are stable: they are decoded by older and newer tracers.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EventKind {
    /// A CUDA runtime or driver call, entry and return paired ([`crate::CallEvent`]).
    Call = 1,
    /// A traced thread's time off the CPU ([`crate::SchedEvent`]).
    Sched = 2,
    /// A call with its native and Python call site ([`crate::CallStackEvent`], --stack).
    CallStack = 3,
    /// A text the traced program produced, e.g. PyTorch's out-of-memory message
    /// ([`crate::usdt::MessageEvent`]).
    Message = 4,
    /// A followed process ended ([`crate::sched::ExitEvent`]): what was kept for its pid goes.
    Exit = 5,
    /// A call with its Python frames, its native stack by id ([`crate::stack::CallPyEvent`],
    /// --stack); only the frames read are sent, so its length varies.
    CallPy = 6,
}

impl EventKind {
    pub const fn from_u32(value: u32) -> Option<Self> {
        match value {
            1 => Some(Self::Call),
            2 => Some(Self::Sched),
            3 => Some(Self::CallStack),
            4 => Some(Self::Message),
            5 => Some(Self::Exit),
            6 => Some(Self::CallPy),
            _ => None,
        }
    }
}

/// First field of every record: the decoder checks `kind` and `len` before reading the rest.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EventHeader {
    /// An [`EventKind`] value.
    pub kind: u32,
    /// Size in bytes of the whole record, header included.
    pub len: u32,
    /// CLOCK_MONOTONIC nanoseconds (bpf_ktime_get_ns) when the event began.
    pub ts_ns: u64,
    /// Process id (the kernel's tgid).
    pub pid: u32,
    /// Thread id (the kernel's pid).
    pub tid: u32,
}

#[cfg(feature = "user")]
// SAFETY: repr(C), only integers, no implicit padding (24 bytes, 8-aligned).
unsafe impl aya::Pod for EventHeader {}
