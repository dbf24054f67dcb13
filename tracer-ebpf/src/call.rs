//! One entry and one return program serve every API in the probe table: the attach cookie says
//! which op fired, and `PLANS` says which argument means what. They do only what must be done
//! at the call: save the arguments, read the out-parameters, time it, send it. Joining a free
//! to its allocation's size and a call to its thread's device happens in userspace, from the
//! events themselves, which userspace puts back in the order they returned (each CPU's events
//! wait in its stage and reach the ring [`STAGE_EVENTS`] at a time).

use core::sync::atomic::{compiler_fence, Ordering as AtomicOrdering};

use aya_ebpf::{
    bindings::{BPF_ANY, BPF_RB_FORCE_WAKEUP, BPF_RB_NO_WAKEUP},
    helpers::{
        bpf_get_attach_cookie, bpf_get_current_comm, bpf_get_current_pid_tgid, bpf_ktime_get_ns,
        bpf_probe_read_user,
    },
    macros::{map, raw_tracepoint, uprobe, uretprobe},
    maps::{Array, LruHashMap, PerCpuArray, RingBuf},
    programs::{ProbeContext, RawTracePointContext, RetProbeContext},
    EbpfContext,
};
use tracer_common::{
    call::{flags, DEVICE_UNKNOWN},
    maps::{
        self as names, slot_index, Counter, FlushResult, Inflight, InflightKey, Slot, Stage,
        STAGE_EVENTS,
    },
    probes::{ALLOC_PROP_DEVICE_OFFSET, MAX_ARGS, NO_ARG, OP_COUNT},
    CallEvent, EventHeader, OpPlan, PLANS,
};

use crate::counters::bump;

#[map(name = "EVENTS")]
pub static EVENTS: RingBuf = RingBuf::with_byte_size(names::DEFAULT_RING_BYTES, 0);

// Indexed by a hash of (tid, op): a slot is reused in place from call to call.
#[map(name = "SLOTS")]
static SLOTS: Array<Slot> = Array::with_max_entries(names::SLOT_COUNT, 0);

// The fallback for a (tid, op) whose slot holds another pair's call in flight. LRU: entries of
// threads that are gone must not fill the map.
#[map(name = "INFLIGHT")]
static INFLIGHT: LruHashMap<InflightKey, Inflight> =
    LruHashMap::with_max_entries(names::INFLIGHT_ENTRIES, 0);

/// This CPU's call events not yet in the ring.
#[map(name = "STAGE")]
static STAGE: PerCpuArray<Stage> = PerCpuArray::with_max_entries(1, 0);

/// Slot 0: non-zero once userspace is stopping; new calls are then ignored (their returns
/// still complete, so the final drain sees every call that had started).
#[map(name = "CONTROL")]
pub static CONTROL: Array<u32> = Array::with_max_entries(1, 0);

/// Bytes waiting in the ring before the reader is woken; set by userspace at load.
#[unsafe(no_mangle)]
static WAKEUP_BYTES: u64 = 0;

/// Non-zero: the benchmark's floors, the same probes with no work: 1 counts entries only; 2 also
/// reads the clock at entry and return, as timing a call needs.
#[unsafe(no_mangle)]
pub(crate) static FLOOR_MODE: u32 = 0;

/// The floor's work: nothing, or one clock read (kept from being optimized away).
#[inline(always)]
pub(crate) fn floor_work(mode: u32) {
    // SAFETY: no preconditions.
    if mode == 2 && unsafe { bpf_ktime_get_ns() } == 0 {
        bump(Counter::UnmatchedReturns);
    }
}

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
    let floor = global(&FLOOR_MODE);
    if floor != 0 {
        floor_work(floor);
        return 0;
    }
    // SAFETY: the helper only reads the cookie of the perf link that fired.
    let cookie = unsafe { bpf_get_attach_cookie(ctx.as_ptr()) };
    let Some((op, plan)) = plan_for(cookie) else {
        return 0;
    };
    let tid = bpf_get_current_pid_tgid() as u32;
    let mut state = Inflight {
        // SAFETY: no preconditions.
        ts_ns: unsafe { bpf_ktime_get_ns() },
        args: [0; MAX_ARGS],
    };
    let mut i = 0;
    while i < MAX_ARGS {
        state.args[i] = ctx.arg::<u64>(i).unwrap_or(0);
        i += 1;
    }
    if (plan.caller_arg as usize) < MAX_ARGS {
        // At a function's first instruction the return address is on top of the stack.
        // SAFETY: `regs` is the probed thread's saved registers, valid for this program's run.
        let sp = unsafe { (*ctx.regs).rsp };
        state.args[plan.caller_arg as usize] = read_user_u64(sp).unwrap_or(0);
    }
    save_inflight(tid, op, &state);
    0
}

/// Keeps the entry state in the (tid, op)'s slot, written in place; when another pair's call is
/// in flight there, in the fallback map.
#[inline(always)]
fn save_inflight(tid: u32, op: u32, state: &Inflight) {
    let Some(slot) = SLOTS.get_ptr_mut(slot_index(tid, op)) else {
        return;
    };
    // SAFETY: a pointer into the array, valid for this run. Only the thread whose pair holds
    // the slot writes it while its call is in flight (ts_ns != 0); a pair takes a slot only
    // when it is free or already its own.
    unsafe {
        let mine = (*slot).tid == tid && (*slot).op == op;
        if mine || (*slot).state.ts_ns == 0 {
            if !mine {
                (*slot).tid = tid;
                (*slot).op = op;
                (*slot).comm_sent = 0;
            }
            (*slot).state = *state;
            return;
        }
    }
    if INFLIGHT
        .insert(&InflightKey { tid, op }, state, BPF_ANY as u64)
        .is_err()
    {
        bump(Counter::InflightFull);
    }
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

/// Takes the (tid, op)'s entry state, marking it consumed, with whether the thread's name is
/// still to be sent; counts a return without an entry.
#[inline(always)]
fn take_inflight(tid: u32, op: u32) -> Option<(Inflight, bool)> {
    if let Some(slot) = SLOTS.get_ptr_mut(slot_index(tid, op)) {
        // SAFETY: as in save_inflight: the slot is this pair's while its call is in flight.
        unsafe {
            if (*slot).tid == tid && (*slot).op == op && (*slot).state.ts_ns != 0 {
                let state = (*slot).state;
                let send_comm = (*slot).comm_sent == 0;
                (*slot).state.ts_ns = 0;
                (*slot).comm_sent = 1;
                return Some((state, send_comm));
            }
        }
    }
    let Some(entry) = INFLIGHT.get_ptr_mut(&InflightKey { tid, op }) else {
        bump(Counter::UnmatchedReturns);
        return None;
    };
    // SAFETY: the entry is this thread's; copy it, then mark it consumed.
    let state = unsafe { *entry };
    if state.ts_ns == 0 {
        bump(Counter::UnmatchedReturns);
        return None;
    }
    // SAFETY: as above.
    unsafe { (*entry).ts_ns = 0 };
    Some((state, true))
}

/// Forgets an exited thread's per-op state: its slots (a thread that reuses the tid sends its
/// name again) and its fallback entries; a call it left in flight is counted as abandoned.
#[inline(always)]
pub fn forget_thread(tid: u32) {
    let mut op = 0u32;
    while op < OP_COUNT as u32 {
        if let Some(slot) = SLOTS.get_ptr_mut(slot_index(tid, op)) {
            // SAFETY: a pointer into the array; the thread that owned the pair is exiting.
            unsafe {
                if (*slot).tid == tid && (*slot).op == op {
                    if (*slot).state.ts_ns != 0 {
                        bump(Counter::CallsAbandoned);
                    }
                    (*slot).state.ts_ns = 0;
                    (*slot).comm_sent = 0;
                    (*slot).tid = 0;
                }
            }
        }
        let key = InflightKey { tid, op };
        if let Some(entry) = INFLIGHT.get_ptr(&key) {
            // SAFETY: read at once.
            if unsafe { (*entry).ts_ns } != 0 {
                bump(Counter::CallsAbandoned);
            }
            // Just read, so present.
            let _ = INFLIGHT.remove(&key);
        }
        op += 1;
    }
}

#[inline(always)]
fn comm_unsent(tid: u32, op: u32) {
    if let Some(slot) = SLOTS.get_ptr_mut(slot_index(tid, op)) {
        // SAFETY: as in save_inflight.
        unsafe {
            if (*slot).tid == tid && (*slot).op == op {
                (*slot).comm_sent = 0;
            }
        }
    }
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

/// Size, pointer, auxiliary values and the device the call names, from the arguments and, for
/// a successful call, its out-parameters.
#[inline(always)]
fn outcome(args: &[u64; MAX_ARGS], plan: &OpPlan, ok: bool) -> Outcome {
    let mut o = Outcome {
        size: 0,
        ptr: 0,
        aux0: arg_at(args, plan.aux0_arg).unwrap_or(0),
        aux1: arg_at(args, plan.aux1_arg).unwrap_or(0),
        device: DEVICE_UNKNOWN,
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

/// Events a CPU submits between two looks at how much waits in the ring.
const WAKEUP_CHECK_EVERY: u64 = 64;

/// The ring's wake-up flag for the `submitted`-th event of this CPU: waking the reader costs
/// about a third of a traced call and even asking how much waits costs a tenth, so every 64th
/// event looks, and wakes the reader when a batch waits (it also looks every 10 ms by itself).
#[inline(always)]
fn wakeup_flag(submitted: u64) -> u32 {
    let wakeup = global(&WAKEUP_BYTES);
    if wakeup == 0
        || (submitted % WAKEUP_CHECK_EVERY == WAKEUP_CHECK_EVERY - 1 && EVENTS.query(0) >= wakeup)
    {
        BPF_RB_FORCE_WAKEUP
    } else {
        BPF_RB_NO_WAKEUP
    }
}

/// The wake-up flag for a full stage (32 events in one write): looking at how much waits is
/// cheap at that rate, so every write looks.
#[inline(always)]
fn stage_wakeup_flag() -> u64 {
    let wakeup = global(&WAKEUP_BYTES);
    if wakeup == 0 || EVENTS.query(0) >= wakeup {
        BPF_RB_FORCE_WAKEUP as u64
    } else {
        BPF_RB_NO_WAKEUP as u64
    }
}

#[uretprobe]
pub fn call_return(ctx: RetProbeContext) -> u32 {
    let floor = global(&FLOOR_MODE);
    if floor != 0 {
        floor_work(floor);
        return 0;
    }
    // SAFETY: as in call_entry.
    let cookie = unsafe { bpf_get_attach_cookie(ctx.as_ptr()) };
    let Some((op, plan)) = plan_for(cookie) else {
        return 0;
    };
    let (pid, tid) = current_ids();
    let Some((state, send_comm)) = take_inflight(tid, op) else {
        return 0;
    };
    let stack = crate::stack::enabled();
    // Claimed before the clock is read: a flush that finds the stage free knows that every
    // event of this CPU that returned before it is in the ring (see `flush_stage`).
    let stage = if stack { None } else { claim_stage() };
    // SAFETY: no preconditions.
    let now = unsafe { bpf_ktime_get_ns() };
    let ret: i32 = ctx.ret::<u64>() as i32;
    let o = outcome(&state.args, plan, ret == 0);
    let comm = if send_comm {
        // First event of this (thread, op): let the scheduler programs follow the thread.
        if crate::sched::SCHED_TIDS
            .insert(&tid, &pid, BPF_ANY as u64)
            .is_err()
        {
            bump(Counter::MapInsertFailed);
        }
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
    if stack {
        // call_site sends the event (and counts it), waking the reader its own way.
        crate::stack::tail_call_site(&ctx, &event);
        // Only a failed tail call gets here: the event is lost, and counted as such.
        bump(Counter::TailCallFailed);
        return 0;
    }
    match stage {
        Some(stage) => stage_event(stage, &event),
        None => send_event(&event, send_comm),
    }
    0
}

/// This CPU's stage, marked busy; None when a program this one interrupted or preempted holds
/// it (this event then goes to the ring by itself).
#[inline(always)]
pub(crate) fn claim_stage() -> Option<*mut Stage> {
    let stage = STAGE.get_ptr_mut(0)?;
    // SAFETY: this CPU's value, valid for this run; only programs of this CPU touch it, and
    // the busy mark keeps one from writing it while another is halfway through.
    unsafe {
        if core::ptr::read_volatile(&(*stage).busy) != 0 {
            return None;
        }
        core::ptr::write_volatile(&mut (*stage).busy, 1);
    }
    compiler_fence(AtomicOrdering::SeqCst);
    Some(stage)
}

/// Appends the event to the claimed stage, sends the stage when full, and frees it.
#[inline(always)]
pub(crate) fn stage_event(stage: *mut Stage, event: &CallEvent) {
    // SAFETY: claimed by this program (claim_stage).
    unsafe {
        let len = (*stage).len as usize;
        match (*stage).events.get_mut(len) {
            Some(slot) => {
                *slot = *event;
                (*stage).len = len as u32 + 1;
            }
            // Never: a full stage is sent at once. Should it be, the event still goes.
            None => send_event(event, false),
        }
        if (*stage).len as usize >= STAGE_EVENTS {
            send_stage(stage, stage_wakeup_flag());
        }
    }
    compiler_fence(AtomicOrdering::SeqCst);
    // SAFETY: as above; the last write of the claim.
    unsafe { core::ptr::write_volatile(&mut (*stage).busy, 0) };
}

/// One event straight to the ring, when the stage is held or the call site is wanted.
#[inline(always)]
pub(crate) fn send_event(event: &CallEvent, send_comm: bool) {
    let submitted = crate::counters::slot(Counter::Submitted);
    // SAFETY: this CPU's counter slot, valid for this run.
    let flag = wakeup_flag(submitted.map_or(0, |n| unsafe { *n }));
    if EVENTS.output::<CallEvent>(event, flag as u64).is_err() {
        bump(Counter::RingFull);
        if send_comm {
            // The thread's name goes with the pair's next event instead.
            comm_unsent(event.header.tid, event.op);
        }
        return;
    }
    if let Some(n) = submitted {
        // SAFETY: as above; a CPU runs one program at a time, so the increment is race-free.
        unsafe { *n += 1 };
    }
}

/// Writes what the stage holds to the ring in one record (events back to back) and empties
/// it; a full ring loses them, counted, and their threads' names go with their next events.
///
/// # Safety
/// `stage` must be this CPU's stage, claimed or in a context nothing of this CPU interrupts.
#[inline(always)]
unsafe fn send_stage(stage: *mut Stage, flags: u64) -> FlushResult {
    // SAFETY: per the contract.
    let len = unsafe { (*stage).len } as usize;
    if len == 0 {
        return FlushResult::Sent;
    }
    // SAFETY: per the contract.
    let Some(events) = (unsafe { (*stage).events.get(..len.min(STAGE_EVENTS)) }) else {
        return FlushResult::Sent;
    };
    let sent = EVENTS.output::<[CallEvent]>(events, flags).is_ok();
    if sent {
        crate::counters::bump_by(Counter::Submitted, len as u64);
    } else {
        crate::counters::bump_by(Counter::RingFull, len as u64);
        let mut i = 0;
        while i < STAGE_EVENTS && i < len {
            if let Some(event) = events.get(i) {
                if event.comm[0] != 0 {
                    comm_unsent(event.header.tid, event.op);
                }
            }
            i += 1;
        }
    }
    // SAFETY: per the contract.
    unsafe { (*stage).len = 0 };
    if sent {
        FlushResult::Sent
    } else {
        FlushResult::RingFull
    }
}

/// Run by userspace on each CPU in turn (never attached): sends what waits in that CPU's
/// stage. It runs in an interrupt of that CPU (or with its preemption off), so no program of
/// the CPU runs until it ends; a stage found busy was claimed by a program it interrupted,
/// whose event and everything before it will be sent later. A stage found free therefore
/// holds every event of this CPU whose return read the clock before now, and all of them
/// are in the ring when this returns.
#[raw_tracepoint(tracepoint = "sys_enter")]
pub fn flush_stage(_ctx: RawTracePointContext) -> i32 {
    let Some(stage) = STAGE.get_ptr_mut(0) else {
        return FlushResult::Sent as i32;
    };
    // SAFETY: this CPU's value; see above for why nothing of this CPU writes it meanwhile.
    unsafe {
        if core::ptr::read_volatile(&(*stage).busy) != 0 {
            return FlushResult::Busy as i32;
        }
        // The reader drains right after: no wake-up needed.
        send_stage(stage, BPF_RB_NO_WAKEUP as u64) as i32
    }
}
