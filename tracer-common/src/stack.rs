//! The call site of a call (`tracer trace --stack`): the native user stack and the Python
//! frames of the calling thread, captured by the return program, plus what the kernel needs to
//! walk a CPython interpreter's frames.

use crate::{
    call::CallEvent,
    event::{EventHeader, EventKind},
};

/// Native frames kept per call (frame-pointer unwinding; deeper stacks are cut).
pub const MAX_NATIVE_FRAMES: usize = 32;
/// Python frames kept per call, innermost first.
pub const MAX_PY_FRAMES: usize = 32;
/// Threads of one interpreter searched for the calling thread's state.
pub const MAX_PY_THREADS: u32 = 64;

/// [`PyStack::status`] values.
pub mod py_status {
    /// The process is not a registered CPython interpreter (or tracer does not support it).
    pub const NOT_PYTHON: u32 = 0;
    /// Frames were read (possibly none: the thread is between Python calls).
    pub const OK: u32 = 1;
    /// The interpreter has no thread state for the calling thread (a C or C++ thread, such as
    /// PyTorch's autograd workers).
    pub const NO_THREAD_STATE: u32 = 2;
    /// Reading the interpreter's memory failed midway.
    pub const READ_FAILED: u32 = 3;
    /// More frames than [`super::MAX_PY_FRAMES`]: the outermost are missing.
    pub const TRUNCATED: u32 = 4;
}

/// Bits of [`PyFrame::flags`].
pub mod py_frame_flags {
    /// The frame was entered from C (an entry frame): native frames separate it from the next.
    pub const ENTRY: u32 = 1 << 0;
}

/// One interpreter frame as the kernel saw it; userspace reads the code object once.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PyFrame {
    /// Address of the PyCodeObject.
    pub code: u64,
    /// 3.11+: address of the instruction executing; 3.10: f_lasti (in code units).
    pub instr: u64,
    /// [`py_frame_flags`] bits.
    pub flags: u32,
    pub _pad: u32,
}

/// The Python part of a call's stack.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PyStack {
    /// A [`py_status`] value.
    pub status: u32,
    /// Valid entries of `frames`.
    pub depth: u32,
    /// The calling thread's PyThreadState (0: none found).
    pub tstate: u64,
    pub frames: [PyFrame; MAX_PY_FRAMES],
}

/// A call with its call site: sent instead of a [`CallEvent`] when tracing with --stack.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CallStackEvent {
    /// `call.header.kind` is [`EventKind::CallStack`] and `len` the size of this record.
    pub call: CallEvent,
    /// Valid entries of `native` (bpf_get_stack's byte count / 8).
    pub native_depth: u32,
    pub _pad: u32,
    /// User-space return addresses, innermost first (the first is the call's own return
    /// address in its caller).
    pub native: [u64; MAX_NATIVE_FRAMES],
    pub py: PyStack,
}

impl CallStackEvent {
    pub const LEN: u32 = core::mem::size_of::<Self>() as u32;
    pub const KIND: EventKind = EventKind::CallStack;

    pub fn header(&self) -> &EventHeader {
        &self.call.header
    }
}

/// A native user stack, kept once in [`crate::maps::NATIVE_STACKS`] under its id.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NativeStack {
    /// Valid entries of `ips`.
    pub depth: u32,
    pub _pad: u32,
    /// User-space return addresses, innermost first.
    pub ips: [u64; MAX_NATIVE_FRAMES],
}

impl NativeStack {
    /// The id the stack is kept under: a 63-bit FNV-1a over its depth and addresses (never
    /// negative, so -1 stays "none"). Two stacks may share an id; the program compares the
    /// stored stack before using one, so a shared id never names the wrong stack.
    #[inline(always)]
    pub fn id(&self) -> i64 {
        const PRIME: u64 = 0x100_0000_01b3;
        let mut h: u64 = 0xcbf2_9ce4_8422_2325 ^ self.depth as u64;
        let mut i = 0;
        while i < MAX_NATIVE_FRAMES {
            if i as u32 >= self.depth {
                break;
            }
            h = (h ^ self.ips[i]).wrapping_mul(PRIME);
            i += 1;
        }
        (h >> 1) as i64
    }

    /// Whether `other` holds the same stack (only the valid entries count).
    #[inline(always)]
    pub fn same(&self, other: &NativeStack) -> bool {
        if self.depth != other.depth {
            return false;
        }
        let mut i = 0;
        while i < MAX_NATIVE_FRAMES {
            if i as u32 >= self.depth {
                break;
            }
            if self.ips[i] != other.ips[i] {
                return false;
            }
            i += 1;
        }
        true
    }
}

/// A call with its Python frames (--stack): `call.stack_id` names its native stack (or -1, when
/// it had none to keep). Only the first `py.depth` frames are sent:
/// `call.header.len` is [`CallPyEvent::len_for`] of that depth.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CallPyEvent {
    pub call: CallEvent,
    pub py: PyStack,
}

impl CallPyEvent {
    pub const KIND: EventKind = EventKind::CallPy;
    /// The record with no frame.
    pub const BASE_LEN: u32 =
        (core::mem::size_of::<CallEvent>() + core::mem::offset_of!(PyStack, frames)) as u32;
    pub const MAX_LEN: u32 = core::mem::size_of::<Self>() as u32;

    /// The record's length with `depth` frames.
    #[inline(always)]
    pub const fn len_for(depth: u32) -> u32 {
        Self::BASE_LEN + depth * core::mem::size_of::<PyFrame>() as u32
    }
}

/// Where a CPython interpreter keeps what the kernel walks, for one process (x86-64, GIL
/// builds). Offsets in bytes; [`PyOffsets::NONE`] marks a field a version lacks.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PyOffsets {
    /// `_PyRuntime.interpreters.head`.
    pub runtime_interp_head: u32,
    /// `PyInterpreterState.threads.head`.
    pub interp_threads_head: u32,
    /// `PyThreadState.next`.
    pub tstate_next: u32,
    /// `PyThreadState.native_thread_id` (3.11+), or NONE.
    pub tstate_native_tid: u32,
    /// `PyThreadState.thread_id` (pthread_self()).
    pub tstate_thread_id: u32,
    /// Offset of the kernel tid inside glibc's `struct pthread` (used where native_thread_id
    /// is missing: 3.10).
    pub pthread_tid: u32,
    /// The current frame: `*(tstate + frame_1)`, then, unless `frame_2` is NONE,
    /// `*(that + frame_2)` (3.11 and 3.12 go through `cframe`).
    pub tstate_frame_1: u32,
    pub tstate_frame_2: u32,
    /// The previous (calling) frame.
    pub frame_previous: u32,
    /// The code object.
    pub frame_code: u32,
    /// The instruction: a pointer (3.11+) or f_lasti, an int (3.10; `instr_is_lasti` = 1).
    pub frame_instr: u32,
    pub instr_is_lasti: u32,
    /// The frame's owner byte (3.12+; 3 = a C-stack shim to skip), or NONE.
    pub frame_owner: u32,
    /// `_PyInterpreterFrame.is_entry` (3.11), or NONE.
    pub frame_is_entry: u32,
}

impl PyOffsets {
    pub const NONE: u32 = u32::MAX;
}

/// `_PyInterpreterFrame.owner` of a shim frame owned by the C stack (3.12+).
pub const FRAME_OWNED_BY_CSTACK: u8 = 3;

/// A registered interpreter: set by userspace per process (`tgid`) before the kernel walks it.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PyProcess {
    /// Address of `_PyRuntime` in the process.
    pub runtime: u64,
    pub offsets: PyOffsets,
    /// PY_VERSION_HEX >> 16 (0x030b for 3.11), for userspace.
    pub version: u32,
    pub _pad: u32,
}

#[cfg(feature = "user")]
// SAFETY: repr(C), only integers, explicit padding.
unsafe impl aya::Pod for PyProcess {}

#[cfg(feature = "user")]
// SAFETY: repr(C), only integers and arrays of them, explicit padding (checked by a test).
unsafe impl aya::Pod for CallStackEvent {}

#[cfg(feature = "user")]
// SAFETY: repr(C), only integers and arrays of them, explicit padding (checked by a test).
unsafe impl aya::Pod for CallPyEvent {}

#[cfg(feature = "user")]
// SAFETY: repr(C), only integers and an array of them, explicit padding.
unsafe impl aya::Pod for NativeStack {}
