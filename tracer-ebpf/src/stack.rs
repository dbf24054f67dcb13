//! The call site of a call (--stack): the native user stack (frame pointers, by the kernel) and
//! the calling thread's CPython frames, walked here, at the call, because reading them later
//! from userspace races with the program.

use aya_ebpf::{
    bindings::{BPF_ANY, BPF_F_USER_STACK, BPF_RB_FORCE_WAKEUP, BPF_RB_NO_WAKEUP},
    helpers::{bpf_get_stack, bpf_probe_read_user},
    macros::{map, uretprobe},
    maps::{Array, HashMap, LruHashMap, PerCpuArray, ProgramArray},
    programs::RetProbeContext,
    EbpfContext,
};
use tracer_common::{
    maps as names,
    stack::{
        py_frame_flags, py_status, FRAME_OWNED_BY_CSTACK, MAX_NATIVE_FRAMES, MAX_PY_FRAMES,
        MAX_PY_THREADS,
    },
    CallEvent, CallStackEvent, EventHeader, PyFrame, PyOffsets, PyProcess, PyStack,
};

use crate::{counters::bump, maps::EVENTS};
use tracer_common::maps::Counter;

#[map(name = "PY_PROCS")]
pub static PY_PROCS: HashMap<u32, PyProcess> =
    HashMap::with_max_entries(names::PY_PROCS_ENTRIES, 0);

#[map(name = "PY_THREADS")]
static PY_THREADS: LruHashMap<u64, u64> =
    LruHashMap::with_max_entries(names::PY_THREADS_ENTRIES, 0);

/// Slot 0: [`call_site`], tail-called by the return program: a program of its own, so the
/// verifier checks the frame walk once rather than on every path of the return program.
#[map(name = "SITE_PROG")]
pub static SITE_PROG: ProgramArray = ProgramArray::with_max_entries(1, 0);

/// The call being returned from, handed to [`call_site`] (one per CPU: a tail call does not
/// migrate).
/// When the call-site program last woke the reader (monotonic ns; races between CPUs are
/// harmless: at worst one extra wake-up).
#[map(name = "SITE_WAKE")]
static SITE_WAKE: Array<u64> = Array::with_max_entries(1, 0);

/// A call site is woken for at most once a millisecond: its process may live only milliseconds
/// more (a short script's code objects are read from its memory), but a wake-up per call would
/// cost more than the frame walk (4-5 us a call measured with adaptive wake-ups).
const SITE_WAKE_EVERY_NS: u64 = 1_000_000;

#[map(name = "SITE_CALL")]
pub static SITE_CALL: PerCpuArray<CallEvent> = PerCpuArray::with_max_entries(1, 0);

/// The bytes of a frame's header: every field the walk needs lies in them (3.10's f_lasti ends
/// at 100, 3.11+'s fields at 72).
const FRAME_HEADER: usize = 104;

/// Bytes read at once below a frame of CPython 3.11+: its frames live in the thread's data
/// stack, each caller just below its callee, so one read of the page's bytes below a frame
/// (up to this many) usually holds the next ten or more frames too. Each read is a helper call
/// with its own fault handling; one read a frame cost about 100 ns a frame here.
const WINDOW: usize = 2048;

/// The copy's room: a frame's offset in it (< WINDOW) plus any field offset masked to 0..=127
/// plus an 8-byte field stays inside it, which lets the verifier accept a field read at an
/// offset it only knows from a map.
const WINDOW_ROOM: usize = WINDOW + 136;

const PAGE: u64 = 4096;

/// This CPU's copy of the process memory the walk is in.
#[map(name = "FRAME_HEADER")]
static FRAME_WINDOW_BUF: PerCpuArray<[u8; WINDOW_ROOM]> = PerCpuArray::with_max_entries(1, 0);

/// The process memory copied into the buffer: [start, end).
struct Window {
    buf: *mut [u8; WINDOW_ROOM],
    start: u64,
    end: u64,
    /// Frames lie in a data stack (3.11+): read below them; else (3.10's heap frames) read
    /// each frame's header alone.
    stacked: bool,
}

/// A frame's header, in the window's copy.
#[derive(Clone, Copy)]
struct Frame {
    header: *const u8,
}

impl Window {
    /// The frame at `addr`, from the copy when it holds the frame's header, else copied with
    /// the bytes of its page below it; None when it cannot be read (as a failed read of one of
    /// its fields was before).
    #[inline(always)]
    fn frame(&mut self, addr: u64) -> Option<Frame> {
        let end = addr.checked_add(FRAME_HEADER as u64)?;
        if !(addr >= self.start && end <= self.end) {
            let mut start = addr;
            if self.stacked {
                // Never below the frame's page: the read then cannot fault on a page the
                // process does not map.
                start = (end.saturating_sub(WINDOW as u64)).max(addr & !(PAGE - 1));
            }
            let size = end - start;
            if size > WINDOW as u64 {
                return None;
            }
            // SAFETY: the buffer is this CPU's map value, WINDOW_ROOM >= WINDOW >= size bytes;
            // bpf_probe_read_user validates the source and fails on a fault.
            let rc = unsafe {
                aya_ebpf::helpers::generated::bpf_probe_read_user(
                    self.buf as *mut _,
                    size as u32,
                    start as *const _,
                )
            };
            if rc != 0 {
                self.end = 0;
                return None;
            }
            self.start = start;
            self.end = end;
        }
        // The mask changes nothing (addr - start <= WINDOW - FRAME_HEADER) but bounds the
        // pointer for the verifier.
        // SAFETY: a read of a local.
        let at = unsafe { core::ptr::read_volatile(&(addr - self.start)) } as usize & (WINDOW - 1);
        Some(Frame {
            // SAFETY: at < WINDOW < WINDOW_ROOM: inside the buffer.
            header: unsafe { (self.buf as *const u8).add(at) },
        })
    }
}

impl Frame {
    /// The field at `offset`; None for an offset past the header (no supported CPython has one).
    #[inline(always)]
    fn field<T: Copy>(&self, offset: u32) -> Option<T> {
        let offset = offset as usize;
        if offset > FRAME_HEADER - core::mem::size_of::<T>() {
            return None;
        }
        // The mask changes nothing (offset <= 96 here) but bounds the pointer for the verifier;
        // the volatile read keeps the compiler from folding it away with the check above.
        // SAFETY: a read of a local.
        let masked = unsafe { core::ptr::read_volatile(&offset) } & 127;
        // SAFETY: the header lies below WINDOW in the buffer and masked + size_of::<T>() <=
        // 135, so the read stays inside WINDOW_ROOM; the field lies in the copied header since
        // masked == offset <= FRAME_HEADER - size_of::<T>().
        Some(unsafe { core::ptr::read_unaligned(self.header.add(masked) as *const T) })
    }
}

#[inline(always)]
fn read<T: Copy>(addr: u64) -> Option<T> {
    if addr == 0 {
        return None;
    }
    // SAFETY: bpf_probe_read_user validates the address; a fault returns an error.
    unsafe { bpf_probe_read_user(addr as *const T).ok() }
}

/// Whether `tstate` is the PyThreadState of kernel thread `tid`.
#[inline(always)]
fn is_thread(tstate: u64, tid: u32, o: &PyOffsets) -> bool {
    if o.tstate_native_tid != PyOffsets::NONE {
        return read::<u64>(tstate + o.tstate_native_tid as u64) == Some(tid as u64);
    }
    // 3.10: thread_id is pthread_self(), glibc's struct pthread, which holds the kernel tid.
    let Some(pthread) = read::<u64>(tstate + o.tstate_thread_id as u64) else {
        return false;
    };
    read::<u32>(pthread + o.pthread_tid as u64) == Some(tid)
}

/// The calling thread's PyThreadState: cached per thread, re-checked, else found in the main
/// interpreter's thread list.
#[inline(always)]
fn thread_state(proc_: &PyProcess, pid: u32, tid: u32) -> Option<u64> {
    let o = &proc_.offsets;
    let key = ((pid as u64) << 32) | tid as u64;
    // SAFETY: the value is copied out at once.
    if let Some(cached) = unsafe { PY_THREADS.get(&key) }.copied() {
        if is_thread(cached, tid, o) {
            return Some(cached);
        }
    }
    let interp = read::<u64>(proc_.runtime + o.runtime_interp_head as u64)?;
    let mut ts = read::<u64>(interp + o.interp_threads_head as u64)?;
    for _ in 0..MAX_PY_THREADS {
        if ts == 0 {
            return None;
        }
        if is_thread(ts, tid, o) {
            if PY_THREADS.insert(&key, &ts, BPF_ANY as u64).is_err() {
                crate::counters::bump(tracer_common::maps::Counter::MapInsertFailed);
            }
            return Some(ts);
        }
        ts = read::<u64>(ts + o.tstate_next as u64)?;
    }
    None
}

/// Walks the thread's frames into `py`, innermost first.
#[inline(always)]
fn python_frames(py: &mut PyStack, pid: u32, tid: u32) {
    py.depth = 0;
    py.tstate = 0;
    // SAFETY: the value is copied out at once.
    let Some(proc_) = (unsafe { PY_PROCS.get(&pid) }).copied() else {
        py.status = py_status::NOT_PYTHON;
        return;
    };
    let o = proc_.offsets;
    let Some(tstate) = thread_state(&proc_, pid, tid) else {
        py.status = py_status::NO_THREAD_STATE;
        return;
    };
    py.tstate = tstate;
    py.status = py_status::READ_FAILED;
    let Some(mut frame) = read::<u64>(tstate + o.tstate_frame_1 as u64) else {
        return;
    };
    if o.tstate_frame_2 != PyOffsets::NONE {
        let Some(f) = read::<u64>(frame + o.tstate_frame_2 as u64) else {
            return;
        };
        frame = f;
    }
    let Some(buf) = FRAME_WINDOW_BUF.get_ptr_mut(0) else {
        return;
    };
    let mut window = Window {
        buf,
        start: 0,
        end: 0,
        // 3.10 is the version whose frames record f_lasti, and the one whose frames are heap
        // objects.
        stacked: o.instr_is_lasti == 0,
    };
    // One frame kept per iteration, so the depth is the loop index: the verifier then sees one
    // state per iteration instead of one per possible depth.
    for i in 0..MAX_PY_FRAMES {
        py.depth = i as u32;
        if frame == 0 {
            py.status = py_status::OK;
            return;
        }
        let Some(mut f) = window.frame(frame) else {
            return;
        };
        if o.frame_owner != PyOffsets::NONE {
            let Some(owner) = f.field::<u8>(o.frame_owner) else {
                return;
            };
            if owner == FRAME_OWNED_BY_CSTACK {
                // A shim (3.12+): the frame before it was entered from C. Shims never follow
                // one another, so one skip per iteration suffices.
                if i > 0 {
                    if let Some(f) = py.frames.get_mut(i - 1) {
                        f.flags |= py_frame_flags::ENTRY;
                    }
                }
                let Some(prev) = f.field::<u64>(o.frame_previous) else {
                    return;
                };
                frame = prev;
                if frame == 0 {
                    py.status = py_status::OK;
                    return;
                }
                let Some(shimmed) = window.frame(frame) else {
                    return;
                };
                f = shimmed;
            }
        }
        let Some(code) = f.field::<u64>(o.frame_code) else {
            return;
        };
        let instr = if o.instr_is_lasti != 0 {
            f.field::<i32>(o.frame_instr).map(|l| l as u32 as u64)
        } else {
            f.field::<u64>(o.frame_instr)
        };
        let Some(instr) = instr else {
            return;
        };
        let entry = if o.frame_is_entry != PyOffsets::NONE {
            f.field::<u8>(o.frame_is_entry).unwrap_or(0) != 0
        } else {
            // 3.10: every Python frame runs in its own C call of the eval loop.
            o.instr_is_lasti != 0
        };
        if let Some(f) = py.frames.get_mut(i) {
            *f = PyFrame {
                code,
                instr,
                flags: if entry { py_frame_flags::ENTRY } else { 0 },
                _pad: 0,
            };
        }
        let Some(prev) = f.field::<u64>(o.frame_previous) else {
            py.depth = i as u32 + 1;
            return;
        };
        frame = prev;
    }
    py.depth = MAX_PY_FRAMES as u32;
    py.status = if frame == 0 {
        py_status::OK
    } else {
        py_status::TRUNCATED
    };
}

/// Hands `call` to [`call_site`]; returns only if the tail call failed (then nothing was sent).
#[inline(always)]
pub fn tail_call_site<C: EbpfContext>(ctx: &C, call: &CallEvent) {
    if SITE_CALL.set(0, call, 0).is_err() {
        return;
    }
    // SAFETY: the context is the one this program was called with; slot 0 holds call_site.
    unsafe { SITE_PROG.tail_call(ctx, 0) };
}

/// Sends the call in SITE_CALL with its native and Python call site.
#[uretprobe]
pub fn call_site(ctx: RetProbeContext) -> u32 {
    let Some(call) = SITE_CALL.get_ptr(0) else {
        return 0;
    };
    // SAFETY: this CPU's slot, written just before the tail call that brought us here.
    let call = unsafe { *call };
    let Some(mut entry) = EVENTS.reserve::<CallStackEvent>(0) else {
        bump(Counter::RingFull);
        return 0;
    };
    let ev = entry.as_mut_ptr();
    // SAFETY: `ev` points to the reserved record, valid and exclusively ours until submit.
    unsafe {
        (*ev).call = call;
        (*ev).call.header = EventHeader {
            kind: CallStackEvent::KIND as u32,
            len: CallStackEvent::LEN,
            ..call.header
        };
        (*ev)._pad = 0;
        let bytes = bpf_get_stack(
            ctx.as_ptr(),
            (*ev).native.as_mut_ptr() as *mut _,
            (MAX_NATIVE_FRAMES * 8) as u32,
            BPF_F_USER_STACK as u64,
        );
        (*ev).native_depth = if bytes > 0 { (bytes / 8) as u32 } else { 0 };
        python_frames(&mut (*ev).py, call.header.pid, call.header.tid);
    }
    entry.submit(site_wakeup(
        call.header.ts_ns.wrapping_add(call.duration_ns),
    ));
    bump(Counter::Submitted);
    0
}

/// The ring's wake-up flag for a call site that returned at `now`: see [`SITE_WAKE_EVERY_NS`].
#[inline(always)]
fn site_wakeup(now: u64) -> u64 {
    let Some(last) = SITE_WAKE.get_ptr_mut(0) else {
        return BPF_RB_NO_WAKEUP as u64;
    };
    // SAFETY: a pointer into the map's one element, valid for this run; a torn or raced
    // value only moves one wake-up.
    unsafe {
        if now.wrapping_sub(*last) >= SITE_WAKE_EVERY_NS {
            *last = now;
            return BPF_RB_FORCE_WAKEUP as u64;
        }
    }
    BPF_RB_NO_WAKEUP as u64
}

/// An exited thread's cached interpreter state goes (a thread reusing the tid finds its own).
#[inline(always)]
pub fn forget_thread(pid: u32, tid: u32) {
    // Absent for threads that never made a call from Python: nothing to remove then.
    let _ = PY_THREADS.remove(&(((pid as u64) << 32) | tid as u64));
}

/// An exited process's interpreter registration goes (a process reusing the pid is looked at
/// afresh by userspace).
#[inline(always)]
pub fn forget_process(pid: u32) {
    // Absent for processes that run no interpreter.
    let _ = PY_PROCS.remove(&pid);
}
