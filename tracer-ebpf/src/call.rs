//! One entry and one return program serve every API in the probe table: the attach cookie says
//! which op fired, and `PLANS` says which argument means what.

use aya_ebpf::{
    bindings::{BPF_ANY, BPF_RB_FORCE_WAKEUP, BPF_RB_NO_WAKEUP},
    helpers::{
        bpf_get_attach_cookie, bpf_get_current_comm, bpf_get_current_pid_tgid, bpf_ktime_get_ns,
        bpf_probe_read_user,
    },
    macros::{map, uprobe, uretprobe},
    maps::{Array, HashMap, LruHashMap, RingBuf},
    programs::{ProbeContext, RetProbeContext},
    EbpfContext,
};
use tracer_common::{
    call::{flags, DEVICE_UNKNOWN},
    maps::{self as names, AllocInfo, AllocKey, Counter, Inflight, InflightKey, ThreadState},
    probes::{ALLOC_PROP_DEVICE_OFFSET, MAX_ARGS, NO_ARG, OP_COUNT},
    CallEvent, EventHeader, OpClass, OpPlan, PLANS,
};

use crate::counters::bump;

#[map(name = "EVENTS")]
pub static EVENTS: RingBuf = RingBuf::with_byte_size(names::DEFAULT_RING_BYTES, 0);

// LRU: slots of threads that are gone must not fill the map.
#[map(name = "INFLIGHT")]
static INFLIGHT: LruHashMap<InflightKey, Inflight> =
    LruHashMap::with_max_entries(names::INFLIGHT_ENTRIES, 0);

#[map(name = "ALLOCS")]
static ALLOCS: HashMap<AllocKey, AllocInfo> = HashMap::with_max_entries(names::ALLOCS_ENTRIES, 0);

// Keyed by pid and tid, so a tid reused by another process does not inherit the state.
#[map(name = "THREADS")]
static THREADS: LruHashMap<u64, ThreadState> =
    LruHashMap::with_max_entries(names::THREADS_ENTRIES, 0);

/// Slot 0: non-zero once userspace is stopping; new calls are then ignored (their returns
/// still complete, so the final drain sees every call that had started).
#[map(name = "CONTROL")]
pub static CONTROL: Array<u32> = Array::with_max_entries(1, 0);

/// Bytes waiting in the ring before the reader is woken; set by userspace at load.
#[unsafe(no_mangle)]
static WAKEUP_BYTES: u64 = 0;

/// Non-zero: count entries only (the benchmark's floor: same probes, empty work).
#[unsafe(no_mangle)]
static FLOOR_MODE: u32 = 0;

#[inline(always)]
pub fn global<T: Copy>(value: &T) -> T {
    // SAFETY: a read of a global that the loader may have rewritten; volatile keeps the compiler
    // from folding the compile-time value.
    unsafe { core::ptr::read_volatile(value) }
}

#[inline(always)]
fn plan_for(cookie: u64) -> Option<(u32, &'static OpPlan)> {
    let op = cookie as usize;
    if op >= OP_COUNT {
        return None;
    }
    Some((op as u32, &PLANS[op]))
}

#[inline(always)]
fn arg_at(args: &[u64; MAX_ARGS], idx: u8) -> Option<u64> {
    if idx == NO_ARG || idx as usize >= MAX_ARGS {
        None
    } else {
        Some(args[idx as usize])
    }
}

#[inline(always)]
fn read_user_u64(addr: u64) -> Option<u64> {
    if addr == 0 {
        return None;
    }
    // SAFETY: bpf_probe_read_user validates the address; a fault returns an error.
    unsafe { bpf_probe_read_user(addr as *const u64).ok() }
}

/// (process id, thread id) of the caller.
#[inline(always)]
fn current_ids() -> (u32, u32) {
    let pid_tgid = bpf_get_current_pid_tgid();
    ((pid_tgid >> 32) as u32, pid_tgid as u32)
}

#[uprobe]
pub fn call_entry(ctx: ProbeContext) -> u32 {
    if CONTROL.get(0).is_some_and(|paused| *paused != 0) {
        return 0;
    }
    bump(Counter::Entries);
    if global(&FLOOR_MODE) != 0 {
        return 0;
    }
    // SAFETY: the helper only reads the cookie of the perf link that fired.
    let cookie = unsafe { bpf_get_attach_cookie(ctx.as_ptr()) };
    let Some((op, plan)) = plan_for(cookie) else {
        return 0;
    };
    let (pid, tid) = current_ids();

    let mut state = Inflight {
        // SAFETY: no preconditions.
        ts_ns: unsafe { bpf_ktime_get_ns() },
        args: [0; MAX_ARGS],
        freed_size: 0,
        freed_device: DEVICE_UNKNOWN,
        freed_found: 0,
    };
    let mut i = 0;
    while i < MAX_ARGS {
        state.args[i] = ctx.arg::<u64>(i).unwrap_or(0);
        i += 1;
    }
    // Look the size up at entry: a nested free of the same pointer (runtime -> driver) removes
    // it before the outer call returns.
    if plan.class == OpClass::Free as u32 {
        if let Some(ptr) = arg_at(&state.args, plan.ptr_arg) {
            let key = AllocKey {
                pid,
                space: plan.space,
                ptr,
            };
            // SAFETY: the value is copied out at once.
            if let Some(info) = unsafe { ALLOCS.get(&key) } {
                state.freed_size = info.size;
                state.freed_device = info.device;
                state.freed_found = 1;
            }
        }
    }
    // A thread's slot is reused from call to call: writing in place is cheaper than a map
    // update, and the return marks it consumed (ts_ns = 0) instead of deleting it.
    let key = InflightKey { tid, op };
    match INFLIGHT.get_ptr_mut(&key) {
        // SAFETY: only this thread uses the (tid, op) slot, and the pointer is valid for this
        // program run.
        Some(slot) => unsafe { *slot = state },
        None => {
            if INFLIGHT.insert(&key, &state, BPF_ANY as u64).is_err() {
                bump(Counter::InflightFull);
            }
        }
    }
    0
}

/// What the return program learns of a call beyond its arguments.
struct Outcome {
    size: u64,
    ptr: u64,
    aux0: u64,
    aux1: u64,
    device: i32,
    flags: u32,
}

/// Takes the thread's in-flight slot for `op` (marking it consumed), or counts an unmatched
/// return.
#[inline(always)]
fn take_inflight(tid: u32, op: u32) -> Option<Inflight> {
    let Some(slot) = INFLIGHT.get_ptr_mut(&InflightKey { tid, op }) else {
        bump(Counter::UnmatchedReturns);
        return None;
    };
    // SAFETY: as in call_entry: the slot is this thread's; copy it, then mark it consumed.
    let state = unsafe { *slot };
    if state.ts_ns == 0 {
        bump(Counter::UnmatchedReturns);
        return None;
    }
    // SAFETY: as above.
    unsafe { (*slot).ts_ns = 0 };
    Some(state)
}

/// Reads a user-space u64 out-parameter into `dst`, or flags the failed read.
#[inline(always)]
fn read_out(addr: Option<u64>, dst: &mut u64, flags_out: &mut u32) -> bool {
    let Some(out) = addr else {
        return false;
    };
    match read_user_u64(out) {
        Some(v) => {
            *dst = v;
            true
        }
        None => {
            *flags_out |= flags::READ_FAILED;
            false
        }
    }
}

/// Size, pointer, auxiliary values and device from the arguments and, for a successful call,
/// its out-parameters.
#[inline(always)]
fn outcome(args: &[u64; MAX_ARGS], plan: &OpPlan, ok: bool, thread_device: i32) -> Outcome {
    let mut o = Outcome {
        size: 0,
        ptr: 0,
        aux0: arg_at(args, plan.aux0_arg).unwrap_or(0),
        aux1: arg_at(args, plan.aux1_arg).unwrap_or(0),
        device: thread_device,
        flags: 0,
    };
    if let Some(s) = arg_at(args, plan.size_arg) {
        o.size = s;
        o.flags |= flags::SIZE_KNOWN;
    }
    if let Some(p) = arg_at(args, plan.ptr_arg) {
        o.ptr = p;
        o.flags |= flags::PTR_KNOWN;
    }
    if !ok {
        if let Some(d) = arg_at(args, plan.device_arg) {
            // A failed cudaSetDevice still says which device was asked for.
            o.aux0 = d;
        }
        return o;
    }
    if read_out(arg_at(args, plan.ptr_out_arg), &mut o.ptr, &mut o.flags) {
        o.flags |= flags::PTR_KNOWN;
    }
    let mut pitch = 0;
    if read_out(arg_at(args, plan.pitch_out_arg), &mut pitch, &mut o.flags) {
        o.aux0 = pitch;
        o.size = pitch.wrapping_mul(arg_at(args, plan.height_arg).unwrap_or(0));
        o.flags |= flags::SIZE_KNOWN;
    }
    read_out(arg_at(args, plan.free_out_arg), &mut o.aux0, &mut o.flags);
    read_out(arg_at(args, plan.total_out_arg), &mut o.aux1, &mut o.flags);
    if let Some(d) = arg_at(args, plan.device_arg) {
        o.device = d as i32;
    }
    // cuMemCreate names the device in its properties, whatever the thread's context.
    if let Some(prop) = arg_at(args, plan.prop_arg).filter(|&p| p != 0) {
        let at = (prop + ALLOC_PROP_DEVICE_OFFSET) as *const i32;
        // SAFETY: bpf_probe_read_user validates the address; a fault returns an error.
        match unsafe { bpf_probe_read_user(at) } {
            Ok(d) => o.device = d,
            Err(_) => o.flags |= flags::READ_FAILED,
        }
    }
    o
}

/// Keeps the (process, pointer) -> size map: an allocation adds its pointer, a free takes the
/// size found at entry and removes the pointer.
#[inline(always)]
fn track_allocation(pid: u32, plan: &OpPlan, ok: bool, state: &Inflight, o: &mut Outcome) {
    let key = AllocKey {
        pid,
        space: plan.space,
        ptr: o.ptr,
    };
    if plan.class == OpClass::Free as u32 {
        if state.freed_found != 0 {
            o.size = state.freed_size;
            o.device = state.freed_device;
            o.flags |= flags::SIZE_KNOWN;
        } else if o.ptr != 0 {
            o.flags |= flags::FREE_UNMATCHED;
        }
        if ok && o.ptr != 0 {
            let _ = ALLOCS.remove(&key);
        }
    } else if plan.class == OpClass::Alloc as u32 && ok && o.ptr != 0 {
        let info = AllocInfo {
            size: o.size,
            device: o.device,
            _pad: 0,
        };
        if ALLOCS.insert(&key, &info, BPF_ANY as u64).is_err() {
            bump(Counter::AllocMapFull);
        }
    }
}

/// Remembers the thread's device after a successful cudaSetDevice, and that its name was sent;
/// a thread's first event also makes the scheduler programs follow it.
#[inline(always)]
fn update_thread(
    pid: u32,
    tid: u32,
    thread: Option<*mut ThreadState>,
    known: Option<ThreadState>,
    set_device: Option<u64>,
    first_event: bool,
) {
    if first_event {
        let _ = crate::sched::SCHED_TIDS.insert(&tid, &pid, BPF_ANY as u64);
    }
    if !first_event && set_device.is_none() {
        return;
    }
    let next = ThreadState {
        device: set_device.map_or(known.map_or(DEVICE_UNKNOWN, |t| t.device), |d| d as i32),
        comm_sent: 1,
    };
    match thread {
        // SAFETY: a pointer into the map, valid for this run; only this thread writes its slot.
        Some(slot) => unsafe { *slot = next },
        None => {
            let thread_key = ((pid as u64) << 32) | tid as u64;
            let _ = THREADS.insert(&thread_key, &next, BPF_ANY as u64);
        }
    }
}

/// The ring's wake-up flag: waking the reader costs about a third of a traced call, so it is
/// woken only when a batch waits.
#[inline(always)]
fn wakeup_flag() -> u32 {
    let wakeup = global(&WAKEUP_BYTES);
    if wakeup == 0 || EVENTS.query(0) >= wakeup {
        BPF_RB_FORCE_WAKEUP
    } else {
        BPF_RB_NO_WAKEUP
    }
}

#[uretprobe]
pub fn call_return(ctx: RetProbeContext) -> u32 {
    if global(&FLOOR_MODE) != 0 {
        return 0;
    }
    // SAFETY: as in call_entry.
    let cookie = unsafe { bpf_get_attach_cookie(ctx.as_ptr()) };
    let Some((op, plan)) = plan_for(cookie) else {
        return 0;
    };
    let (pid, tid) = current_ids();
    let Some(state) = take_inflight(tid, op) else {
        return 0;
    };
    // SAFETY: no preconditions.
    let now = unsafe { bpf_ktime_get_ns() };
    let ret: i32 = ctx.ret::<u64>() as i32;
    let ok = ret == 0;
    let thread_key = ((pid as u64) << 32) | tid as u64;
    let thread = THREADS.get_ptr_mut(&thread_key);
    // SAFETY: a pointer into the map, valid for this run; only this thread writes its slot.
    let known = thread.map(|t| unsafe { *t });
    let send_comm = known.is_none_or(|t| t.comm_sent == 0);
    let mut o = outcome(
        &state.args,
        plan,
        ok,
        known.map_or(DEVICE_UNKNOWN, |t| t.device),
    );
    track_allocation(pid, plan, ok, &state, &mut o);

    let comm = if send_comm {
        bpf_get_current_comm().unwrap_or([0; 16])
    } else {
        [0; 16]
    };
    let event = CallEvent {
        header: EventHeader {
            kind: CallEvent::KIND as u32,
            len: CallEvent::LEN,
            ts_ns: state.ts_ns,
            pid,
            tid,
        },
        op,
        device: o.device,
        ret,
        flags: o.flags,
        duration_ns: now.wrapping_sub(state.ts_ns),
        size: o.size,
        ptr: o.ptr,
        aux0: o.aux0,
        aux1: o.aux1,
        stack_id: -1,
        comm,
    };
    let flag = wakeup_flag();
    let stack_mode = crate::stack::enabled();
    if !stack_mode {
        let Some(mut entry) = EVENTS.reserve::<CallEvent>(0) else {
            // The thread's name is sent again with its next event.
            bump(Counter::RingFull);
            return 0;
        };
        entry.write(event);
        entry.submit(flag as u64);
        bump(Counter::Submitted);
    }
    let set_device = if ok {
        arg_at(&state.args, plan.device_arg)
    } else {
        None
    };
    update_thread(pid, tid, thread, known, set_device, send_comm);
    if stack_mode {
        // call_site sends the event (and counts it); the wake-up flag rides in stack_id.
        crate::stack::tail_call_site(
            &ctx,
            &CallEvent {
                stack_id: flag as i64,
                ..event
            },
        );
        // Only a failed tail call gets here: the event is lost, and counted with the drops.
        bump(Counter::RingFull);
    }
    0
}
