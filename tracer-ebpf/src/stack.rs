//! The call site of a call (--stack): the native user stack (frame pointers, by the kernel) and
//! the calling thread's CPython frames, walked here, at the call, because reading them later
//! from userspace races with the program.

use aya_ebpf::{
    bindings::{
        BPF_ANY, BPF_F_NO_PREALLOC, BPF_F_USER_STACK, BPF_NOEXIST, BPF_RB_FORCE_WAKEUP,
        BPF_RB_NO_WAKEUP,
    },
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
    stack::{CallPyEvent, NativeStack},
    CallEvent, CallStackEvent, EventHeader, PyFrame, PyOffsets, PyProcess, PyStack,
};

use crate::{
    counters::bump,
    maps::EVENTS,
    stage::{claimed_stage, release_stage, send_event, stage_event},
};
use tracer_common::maps::Counter;

#[map(name = "PY_PROCS")]
pub static PY_PROCS: HashMap<u32, PyProcess> =
    HashMap::with_max_entries(names::PY_PROCS_ENTRIES, 0);

#[map(name = "PY_THREADS")]
static PY_THREADS: LruHashMap<u64, u64> =
    LruHashMap::with_max_entries(names::PY_THREADS_ENTRIES, 0);

/// [`call_site`], tail-called by the return program (a program of its own, so the verifier
/// checks the frame walk once rather than on every path of the return program), and
/// [`site_send`], tail-called by it.
#[map(name = "SITE_PROG")]
pub static SITE_PROG: ProgramArray = ProgramArray::with_max_entries(2, 0);

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
pub static SITE_CALL: PerCpuArray<CallPyEvent> = PerCpuArray::with_max_entries(1, 0);

/// Whether the program that tail-called [`call_site`] holds this CPU's stage (1) or not (0).
#[map(name = "SITE_CLAIMED")]
static SITE_CLAIMED: PerCpuArray<u32> = PerCpuArray::with_max_entries(1, 0);

/// This CPU's native stack, read before it is looked up among those kept.
#[map(name = "SITE_NATIVE")]
static SITE_NATIVE: PerCpuArray<NativeStack> = PerCpuArray::with_max_entries(1, 0);

/// Each distinct native stack once, under its id (names::NATIVE_STACKS). Entries are never
/// replaced or deleted: an id read by userspace names the same stack for the whole session, and
/// two programs inserting different stacks under one id at once cannot both win (BPF_NOEXIST).
/// Allocated as stacks arrive (a job has hundreds to thousands of distinct ones).
#[map(name = "NATIVE_STACKS")]
static NATIVE_STACKS: HashMap<i64, NativeStack> =
    HashMap::with_max_entries(names::NATIVE_STACKS_ENTRIES, BPF_F_NO_PREALLOC);

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
/// interpreter's thread list. 0 when none is found. A function of its own: the frame walk then
/// starts from one state, not from each way the search can end.
#[inline(never)]
fn thread_state(proc_: &PyProcess, pid: u32, tid: u32) -> u64 {
    find_thread_state(proc_, pid, tid).unwrap_or(0)
}

#[inline(always)]
fn find_thread_state(proc_: &PyProcess, pid: u32, tid: u32) -> Option<u64> {
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

/// Walks the thread's frames into `py`, innermost first. A function of its own (a BPF-to-BPF
/// call): the verifier then continues after it from one state, not from each of the many ways
/// the walk can end (the walk alone is most of what the verifier may check).
#[inline(never)]
fn python_frames(py: &mut PyStack, pid: u32, tid: u32) {
    py.depth = 0;
    py.tstate = 0;
    // SAFETY: the value is copied out at once.
    let Some(proc_) = (unsafe { PY_PROCS.get(&pid) }).copied() else {
        py.status = py_status::NOT_PYTHON;
        return;
    };
    let o = proc_.offsets;
    let tstate = thread_state(&proc_, pid, tid);
    if tstate == 0 {
        py.status = py_status::NO_THREAD_STATE;
        return;
    }
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
    // One frame kept per iteration, so the depth is the loop index.
    for i in 0..MAX_PY_FRAMES {
        py.depth = i as u32;
        if frame == 0 {
            py.status = py_status::OK;
            return;
        }
        frame = walk_frame(&mut window, py, &o, i as u32, frame);
        if frame == WALK_STOPPED {
            return;
        }
    }
    py.depth = MAX_PY_FRAMES as u32;
    py.status = if frame == 0 {
        py_status::OK
    } else {
        py_status::TRUNCATED
    };
}

/// [`walk_frame`]'s answer when the walk ends there (py's status and depth then say how).
const WALK_STOPPED: u64 = u64::MAX;

/// Keeps frame `i` of the walk (at `frame`, skipping a shim) in `py`; returns the next frame's
/// address (0: none), or [`WALK_STOPPED`]. A function of its own: the verifier checks it once
/// per depth and goes on from one state, not from each of its paths.
#[inline(never)]
fn walk_frame(window: &mut Window, py: &mut PyStack, o: &PyOffsets, i: u32, frame: u64) -> u64 {
    let i = i as usize;
    let Some(mut f) = window.frame(frame) else {
        return WALK_STOPPED;
    };
    if o.frame_owner != PyOffsets::NONE {
        let Some(owner) = f.field::<u8>(o.frame_owner) else {
            return WALK_STOPPED;
        };
        if owner == FRAME_OWNED_BY_CSTACK {
            // A shim (3.12+): the frame before it was entered from C. Shims never follow
            // one another, so one skip per frame suffices.
            if i > 0 {
                if let Some(f) = py.frames.get_mut(i - 1) {
                    f.flags |= py_frame_flags::ENTRY;
                }
            }
            let Some(prev) = f.field::<u64>(o.frame_previous) else {
                return WALK_STOPPED;
            };
            if prev == 0 {
                py.status = py_status::OK;
                return WALK_STOPPED;
            }
            let Some(shimmed) = window.frame(prev) else {
                return WALK_STOPPED;
            };
            f = shimmed;
        }
    }
    let Some(code) = f.field::<u64>(o.frame_code) else {
        return WALK_STOPPED;
    };
    let instr = if o.instr_is_lasti != 0 {
        f.field::<i32>(o.frame_instr).map(|l| l as u32 as u64)
    } else {
        f.field::<u64>(o.frame_instr)
    };
    let Some(instr) = instr else {
        return WALK_STOPPED;
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
        return WALK_STOPPED;
    };
    prev
}

/// Hands `call` to [`call_site`] (`claimed`: the caller holds this CPU's stage, which
/// call_site then fills or frees); returns only if the tail call failed (then nothing was sent).
#[inline(always)]
pub fn tail_call_site<C: EbpfContext>(ctx: &C, call: &CallEvent, claimed: bool) {
    let Some(slot) = SITE_CALL.get_ptr_mut(0) else {
        return;
    };
    if SITE_CLAIMED.set(0, &(claimed as u32), 0).is_err() {
        return;
    }
    // SAFETY: this CPU's slot, valid for this run.
    unsafe { (*slot).call = *call };
    // SAFETY: the context is the one this program was called with; the slot holds call_site.
    unsafe { SITE_PROG.tail_call(ctx, names::SITE_SLOT_READ) };
}

/// The id `stack` is kept under, inserting it if new; None when its id holds another stack or
/// the map is full (the stack then travels inline).
#[inline(always)]
fn keep_native(stack: &NativeStack) -> Option<i64> {
    let id = stack.id();
    // SAFETY: the value is only read; kept stacks are never written again.
    if let Some(kept) = unsafe { NATIVE_STACKS.get(&id) } {
        return kept.same(stack).then_some(id);
    }
    if NATIVE_STACKS.insert(&id, stack, BPF_NOEXIST as u64).is_ok() {
        return Some(id);
    }
    // Another CPU kept a stack under this id meanwhile (or the map is full: then absent).
    // SAFETY: as above.
    let kept = unsafe { NATIVE_STACKS.get(&id) }?;
    kept.same(stack).then_some(id)
}

/// Reads the call site of the call in SITE_CALL, its native stack and its Python frames, for
/// [`site_send`].
#[uretprobe]
pub fn call_site(ctx: RetProbeContext) -> u32 {
    read_native(&ctx);
    let Some(site) = SITE_CALL.get_ptr_mut(0) else {
        release_claimed();
        return 0;
    };
    // SAFETY: this CPU's slot, valid for this run; the call was written before the tail call
    // that brought us here.
    let (pid, tid) = unsafe { ((*site).call.header.pid, (*site).call.header.tid) };
    // SAFETY: as above.
    python_frames(unsafe { &mut (*site).py }, pid, tid);
    // SAFETY: the context is the one this program was called with; the slot holds site_send.
    unsafe { SITE_PROG.tail_call(&ctx, names::SITE_SLOT_SEND) };
    release_claimed();
    bump(Counter::TailCallFailed);
    0
}

/// The calling thread's native stack, into SITE_NATIVE.
#[inline(never)]
fn read_native(ctx: &RetProbeContext) {
    let Some(native) = SITE_NATIVE.get_ptr_mut(0) else {
        return;
    };
    // SAFETY: this CPU's scratch value, valid for this run.
    unsafe {
        let bytes = bpf_get_stack(
            ctx.as_ptr(),
            (*native).ips.as_mut_ptr() as *mut _,
            (MAX_NATIVE_FRAMES * 8) as u32,
            BPF_F_USER_STACK as u64,
        );
        (*native).depth = if bytes > 0 { (bytes / 8) as u32 } else { 0 };
    }
}

/// Sends the call in SITE_CALL with the site [`call_site`] read, its native stack kept by id: a
/// call from a process that is not Python to the stage like a plain call, one with frames to
/// the ring with only the frames read; one whose native stack could not be kept goes with the
/// whole stack inline.
#[uretprobe]
pub fn site_send(_ctx: RetProbeContext) -> u32 {
    let (Some(site), Some(native)) = (SITE_CALL.get_ptr_mut(0), SITE_NATIVE.get_ptr(0)) else {
        release_claimed();
        return 0;
    };
    // SAFETY: this CPU's values, written by call_site just before.
    let (ev, native) = unsafe { (&mut *site, &*native) };
    let Some(id) = keep_native(native) else {
        release_claimed();
        send_inline(ev, native);
        return 0;
    };
    ev.call.stack_id = id;
    if ev.py.status == py_status::NOT_PYTHON {
        match claimed() {
            Some(stage) => stage_event(stage, &ev.call),
            None => send_event(&ev.call, false),
        }
        return 0;
    }
    release_claimed();
    send_with_frames(site);
    0
}

/// This CPU's stage, when the program that tail-called [`call_site`] claimed it.
#[inline(always)]
fn claimed() -> Option<*mut tracer_common::maps::Stage> {
    match SITE_CLAIMED.get(0) {
        Some(1) => claimed_stage(),
        _ => None,
    }
}

/// Frees the stage the tail-calling program claimed, if it did (the event goes to the ring).
#[inline(always)]
fn release_claimed() {
    if let Some(stage) = claimed() {
        release_stage(stage);
    }
}

/// The call and the Python frames read, as a [`CallPyEvent`] as long as they are.
#[inline(always)]
fn send_with_frames(site: *mut CallPyEvent) {
    // SAFETY: this CPU's slot, valid for this run.
    let ev = unsafe { &mut *site };
    let depth = ev.py.depth.min(MAX_PY_FRAMES as u32);
    let len = CallPyEvent::len_for(depth);
    ev.call.header.kind = CallPyEvent::KIND as u32;
    ev.call.header.len = len;
    let sent_at = ev.call.header.ts_ns.wrapping_add(ev.call.duration_ns);
    // The verifier needs the length bounded by the value's size.
    if len > CallPyEvent::MAX_LEN || len < CallPyEvent::BASE_LEN {
        return;
    }
    // SAFETY: `len` bytes from the start of this CPU's slot lie inside it (checked above).
    let bytes = unsafe { core::slice::from_raw_parts(site as *const u8, len as usize) };
    if EVENTS.output::<[u8]>(bytes, site_wakeup(sent_at)).is_err() {
        bump(Counter::RingFull);
        return;
    }
    bump(Counter::Submitted);
}

/// The call with its whole stack in the record (its native stack could not be kept by id).
#[inline(always)]
fn send_inline(site: &CallPyEvent, native: &NativeStack) {
    let Some(mut entry) = EVENTS.reserve::<CallStackEvent>(0) else {
        bump(Counter::RingFull);
        return;
    };
    let ev = entry.as_mut_ptr();
    let call = &site.call;
    // SAFETY: `ev` points to the reserved record, valid and exclusively ours until submit.
    unsafe {
        (*ev).call = *call;
        (*ev).call.header = EventHeader {
            kind: CallStackEvent::KIND as u32,
            len: CallStackEvent::LEN,
            ..call.header
        };
        (*ev).call.stack_id = -1;
        (*ev)._pad = 0;
        (*ev).native_depth = native.depth;
        (*ev).native = native.ips;
        (*ev).py = site.py;
    }
    entry.submit(site_wakeup(
        call.header.ts_ns.wrapping_add(call.duration_ns),
    ));
    bump(Counter::Submitted);
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
