//! The record for one CUDA call: arguments seen at entry, results seen at return.

use crate::event::{EventHeader, EventKind};

/// `device` when the calling thread's device is not known (no cudaSetDevice seen).
pub const DEVICE_UNKNOWN: i32 = -1;

/// Bits of [`CallEvent::flags`].
pub mod flags {
    /// `size` is known (from an argument or an out-parameter; frees get theirs in userspace).
    pub const SIZE_KNOWN: u32 = 1 << 0;
    /// `ptr` is known.
    pub const PTR_KNOWN: u32 = 1 << 1;
    /// A free whose pointer was not in the allocation map (allocated before the trace, or invalid).
    pub const FREE_UNMATCHED: u32 = 1 << 2;
    /// Reading an out-parameter from the process's memory failed.
    pub const READ_FAILED: u32 = 1 << 3;
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CallEvent {
    pub header: EventHeader,
    /// An [`crate::Op`] value.
    pub op: u32,
    /// CUDA device ordinal when the call names it (cudaSetDevice, cuMemCreate's properties), or
    /// [`DEVICE_UNKNOWN`]: userspace fills in the thread's device and a free's allocation's.
    pub device: i32,
    /// cudaError_t / CUresult returned by the call.
    pub ret: i32,
    /// [`flags`] bits.
    pub flags: u32,
    /// Return time minus entry time, measured in the kernel.
    pub duration_ns: u64,
    /// Bytes requested (allocations); frees get the size of what they release in userspace.
    pub size: u64,
    /// Device/host pointer or handle returned or passed.
    pub ptr: u64,
    /// Op-specific: the stream, the free bytes of a MemGetInfo, the pitch of cudaMallocPitch,
    /// the alignment of cuMemAddressReserve, the handle of cuMemMap.
    pub aux0: u64,
    /// Op-specific: the total bytes of a MemGetInfo, the allocation flags.
    pub aux1: u64,
    /// Under --stack, the id of the call's native stack in [`crate::maps::NATIVE_STACKS`]
    /// (>= 0); -1 when it has none there (plain tracing, or the stack travels inline in a
    /// [`crate::CallStackEvent`]). Python frames, when read, follow in a
    /// [`crate::stack::CallPyEvent`].
    pub stack_id: i64,
    /// The calling thread's name (task comm), NUL-padded; sent with the first event of each
    /// (thread, op) only (all zero afterwards).
    pub comm: [u8; 16],
}

impl CallEvent {
    pub const LEN: u32 = core::mem::size_of::<Self>() as u32;
    pub const KIND: EventKind = EventKind::Call;
}

#[cfg(feature = "user")]
// SAFETY: repr(C), only integers and byte arrays, no implicit padding (checked by a test).
unsafe impl aya::Pod for CallEvent {}
