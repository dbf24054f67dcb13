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
    let key = InflightKey { tid, op };
    let Some(slot) = INFLIGHT.get_ptr_mut(&key) else {
        bump(Counter::UnmatchedReturns);
        return 0;
    };
    // SAFETY: as in call_entry: the slot is this thread's; copy it, then mark it consumed.
    let state = unsafe { *slot };
    if state.ts_ns == 0 {
        bump(Counter::UnmatchedReturns);
        return 0;
    }
    // SAFETY: as above.
    unsafe { (*slot).ts_ns = 0 };
    // SAFETY: no preconditions.
    let now = unsafe { bpf_ktime_get_ns() };
    let ret: i32 = ctx.ret::<u64>() as i32;
    let ok = ret == 0;
    let args = &state.args;

    let mut ev_flags = 0u32;
    let mut size = 0u64;
    let mut ptr = 0u64;
    let mut aux0 = arg_at(args, plan.aux0_arg).unwrap_or(0);
    let mut aux1 = arg_at(args, plan.aux1_arg).unwrap_or(0);
    let thread_key = ((pid as u64) << 32) | tid as u64;
    let thread = THREADS.get_ptr_mut(&thread_key);
    // SAFETY: a pointer into the map, valid for this run; only this thread writes its slot.
    let known = thread.map(|t| unsafe { *t });
    let mut device = known.map_or(DEVICE_UNKNOWN, |t| t.device);
    let send_comm = known.is_none_or(|t| t.comm_sent == 0);

    if let Some(s) = arg_at(args, plan.size_arg) {
        size = s;
        ev_flags |= flags::SIZE_KNOWN;
    }
    if let Some(p) = arg_at(args, plan.ptr_arg) {
        ptr = p;
        ev_flags |= flags::PTR_KNOWN;
    }
    if ok {
        if let Some(out) = arg_at(args, plan.ptr_out_arg) {
            match read_user_u64(out) {
                Some(p) => {
                    ptr = p;
                    ev_flags |= flags::PTR_KNOWN;
                }
                None => ev_flags |= flags::READ_FAILED,
            }
        }
        if let Some(out) = arg_at(args, plan.pitch_out_arg) {
            match read_user_u64(out) {
                Some(pitch) => {
                    aux0 = pitch;
                    size = pitch.wrapping_mul(arg_at(args, plan.height_arg).unwrap_or(0));
                    ev_flags |= flags::SIZE_KNOWN;
                }
                None => ev_flags |= flags::READ_FAILED,
            }
        }
        if let Some(out) = arg_at(args, plan.free_out_arg) {
            match read_user_u64(out) {
                Some(v) => aux0 = v,
                None => ev_flags |= flags::READ_FAILED,
            }
        }
        if let Some(out) = arg_at(args, plan.total_out_arg) {
            match read_user_u64(out) {
                Some(v) => aux1 = v,
                None => ev_flags |= flags::READ_FAILED,
            }
        }
        if let Some(d) = arg_at(args, plan.device_arg) {
            device = d as i32;
        }
        // cuMemCreate names the device in its properties, whatever the thread's context.
        if let Some(prop) = arg_at(args, plan.prop_arg).filter(|&p| p != 0) {
            let at = (prop + ALLOC_PROP_DEVICE_OFFSET) as *const i32;
            // SAFETY: bpf_probe_read_user validates the address; a fault returns an error.
            match unsafe { bpf_probe_read_user(at) } {
                Ok(d) => device = d,
                Err(_) => ev_flags |= flags::READ_FAILED,
            }
        }
    } else if let Some(d) = arg_at(args, plan.device_arg) {
        // A failed cudaSetDevice still says which device was asked for.
        aux0 = d;
    }

    if plan.class == OpClass::Free as u32 {
        if state.freed_found != 0 {
            size = state.freed_size;
            device = state.freed_device;
            ev_flags |= flags::SIZE_KNOWN;
        } else if ptr != 0 {
            ev_flags |= flags::FREE_UNMATCHED;
        }
        if ok && ptr != 0 {
            let _ = ALLOCS.remove(&AllocKey {
                pid,
                space: plan.space,
                ptr,
            });
        }
    } else if plan.class == OpClass::Alloc as u32 && ok && ptr != 0 {
        let info = AllocInfo {
            size,
            device,
            _pad: 0,
        };
        if ALLOCS
            .insert(
                &AllocKey {
                    pid,
                    space: plan.space,
                    ptr,
                },
                &info,
                BPF_ANY as u64,
            )
            .is_err()
        {
            bump(Counter::AllocMapFull);
        }
    }

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
        device,
        ret,
        flags: ev_flags,
        duration_ns: now.wrapping_sub(state.ts_ns),
        size,
        ptr,
        aux0,
        aux1,
        stack_id: -1,
        comm,
    };
    // Waking the reader costs about a third of a traced call: wake it only when a batch waits.
    let wakeup = global(&WAKEUP_BYTES);
    let flag = if wakeup == 0 || EVENTS.query(0) >= wakeup {
        BPF_RB_FORCE_WAKEUP
    } else {
        BPF_RB_NO_WAKEUP
    };
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
        arg_at(args, plan.device_arg)
    } else {
        None
    };
    if send_comm {
        // First event of this thread: let the scheduler programs follow it.
        let _ = crate::sched::SCHED_TIDS.insert(&tid, &pid, BPF_ANY as u64);
    }
    if send_comm || set_device.is_some() {
        let next = ThreadState {
            device: set_device.map_or(known.map_or(DEVICE_UNKNOWN, |t| t.device), |d| d as i32),
            comm_sent: 1,
        };
        match thread {
            // SAFETY: as above.
            Some(slot) => unsafe { *slot = next },
            None => {
                let _ = THREADS.insert(&thread_key, &next, BPF_ANY as u64);
            }
        }
    }
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
