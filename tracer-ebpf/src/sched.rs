//! Host context: when a followed thread (one that makes CUDA calls, or another thread of its
//! process tree) leaves the CPU, and when it comes back (and whether it was preempted or woken),
//! so explain can tie a slow call to the time its own thread spent off the CPU and count the
//! threads that competed with it for the cores.

use aya_ebpf::{
    bindings::BPF_ANY,
    helpers::bpf_ktime_get_ns,
    macros::{map, tracepoint},
    maps::HashMap,
    programs::TracePointContext,
};
use tracer_common::{
    maps::{self as names, Counter},
    sched::{ExitEvent, OffCpu},
    EventHeader, SchedEvent,
};

use crate::{
    counters::bump,
    maps::{global, paused, EVENTS, SCHED_TIDS},
};

#[map(name = "OFFCPU")]
static OFFCPU: HashMap<u32, OffCpu> = HashMap::with_max_entries(names::SCHED_TIDS_ENTRIES, 0);

/// The processes followed now when [`SCHED_ARMED_ONLY`] is set (userspace arms and disarms).
#[map(name = "SCHED_ARMED")]
static SCHED_ARMED: HashMap<u32, u32> = HashMap::with_max_entries(names::SCHED_ARMED_ENTRIES, 0);

/// Non-zero (`--allocator auto`): a process's threads are followed only while its allocator
/// probes are armed, so that outside pressure their switches cost one lookup more, no event.
#[unsafe(no_mangle)]
static SCHED_ARMED_ONLY: u32 = 0;

/// Offsets of the tracepoint fields, from tracefs (set by userspace at load).
#[unsafe(no_mangle)]
static PREV_PID_OFF: u32 = 24;
#[unsafe(no_mangle)]
static PREV_STATE_OFF: u32 = 32;
#[unsafe(no_mangle)]
static NEXT_PID_OFF: u32 = 56;
#[unsafe(no_mangle)]
static WAKEUP_PID_OFF: u32 = 24;
#[unsafe(no_mangle)]
static FORK_PARENT_PID_OFF: u32 = 12;
#[unsafe(no_mangle)]
static FORK_CHILD_PID_OFF: u32 = 20;

/// The task-state bits the tracepoint reports for a task that has exited (EXIT_DEAD,
/// EXIT_ZOMBIE): its last switch out.
const EXITED: i64 = 0x10 | 0x20;

#[tracepoint]
pub fn sched_switch(ctx: TracePointContext) -> u32 {
    if paused() {
        return 0;
    }
    // SAFETY: reads within the tracepoint record at offsets taken from its format file.
    let prev: i32 = unsafe { ctx.read_at(global(&PREV_PID_OFF) as usize) }.unwrap_or(0);
    let prev = prev as u32;
    // The clock is read only where a followed thread leaves or comes back: most switches on a
    // node are other processes', and a clock read is a good part of this program's time.
    // SAFETY: the value is copied out at once.
    let Some(pid) = unsafe { SCHED_TIDS.get(&prev) }.copied() else {
        return forward_next(&ctx, None);
    };
    // SAFETY: the value is only tested.
    if global(&SCHED_ARMED_ONLY) != 0 && unsafe { SCHED_ARMED.get(&pid) }.is_none() {
        return forward_next(&ctx, None);
    }
    // SAFETY: no preconditions.
    let now = unsafe { bpf_ktime_get_ns() };
    // SAFETY: as above.
    let state: i64 = unsafe { ctx.read_at(global(&PREV_STATE_OFF) as usize) }.unwrap_or(1);
    if state & EXITED != 0 {
        // Its last switch: forget it (userspace may have followed it after its exit
        // program ran, while it was still finishing).
        let _ = SCHED_TIDS.remove(&prev);
        let _ = OFFCPU.remove(&prev);
        return forward_next(&ctx, Some(now));
    }
    let off = OffCpu {
        off_ns: now,
        wakeup_ns: 0,
        pid,
        // The tracepoint reports a preempted task as TASK_REPORT_MAX (0x100), whatever its
        // state; a task that yielded while runnable as 0. Any of the low bits: it blocked.
        preempted: (state & 0xff == 0) as u32,
    };
    if OFFCPU.insert(&prev, &off, BPF_ANY as u64).is_err() {
        bump(Counter::MapInsertFailed);
    }
    forward_next(&ctx, Some(now))
}

/// The thread switched in: when it is a followed thread coming back, its interval off the CPU
/// (`now` is the switch's time where the caller read it already).
#[inline(always)]
fn forward_next(ctx: &TracePointContext, now: Option<u64>) -> u32 {
    // SAFETY: as in sched_switch.
    let next: i32 = unsafe { ctx.read_at(global(&NEXT_PID_OFF) as usize) }.unwrap_or(0);
    let next = next as u32;
    // SAFETY: the value is copied out at once, before the entry is removed.
    let Some(off) = (unsafe { OFFCPU.get(&next) }).copied() else {
        return 0;
    };
    // SAFETY: no preconditions.
    let now = now.unwrap_or_else(|| unsafe { bpf_ktime_get_ns() });
    // Just read, so present: a failure cannot leave it behind.
    let _ = OFFCPU.remove(&next);
    let Some(mut entry) = EVENTS.reserve::<SchedEvent>(0) else {
        bump(Counter::SchedRingFull);
        return 0;
    };
    entry.write(SchedEvent {
        header: EventHeader {
            kind: SchedEvent::KIND as u32,
            len: SchedEvent::LEN,
            ts_ns: off.off_ns,
            pid: off.pid,
            tid: next,
        },
        on_ns: now,
        wakeup_ns: off.wakeup_ns,
        preempted: off.preempted,
        _pad: 0,
    });
    entry.submit(aya_ebpf::bindings::BPF_RB_NO_WAKEUP as u64);
    bump(Counter::SchedSubmitted);
    0
}

#[tracepoint]
pub fn sched_wakeup(ctx: TracePointContext) -> u32 {
    // SAFETY: as in sched_switch.
    let tid: i32 = unsafe { ctx.read_at(global(&WAKEUP_PID_OFF) as usize) }.unwrap_or(0);
    if let Some(off) = OFFCPU.get_ptr_mut(&(tid as u32)) {
        // SAFETY: a pointer into the map for this run; only the wakeup path writes this field.
        unsafe { (*off).wakeup_ns = bpf_ktime_get_ns() };
    }
    0
}

/// New threads and processes of a followed thread are followed too (DataLoader workers started
/// after tracing began), under the same traced process.
#[tracepoint]
pub fn sched_process_fork(ctx: TracePointContext) -> u32 {
    // SAFETY: as in sched_switch.
    let parent: i32 = unsafe { ctx.read_at(global(&FORK_PARENT_PID_OFF) as usize) }.unwrap_or(0);
    // SAFETY: the value is copied out at once.
    let Some(pid) = (unsafe { SCHED_TIDS.get(&(parent as u32)) }).copied() else {
        return 0;
    };
    // SAFETY: as in sched_switch.
    let child: i32 = unsafe { ctx.read_at(global(&FORK_CHILD_PID_OFF) as usize) }.unwrap_or(0);
    if child > 0
        && SCHED_TIDS
            .insert(&(child as u32), &pid, BPF_ANY as u64)
            .is_err()
    {
        bump(Counter::MapInsertFailed);
    }
    0
}

/// A thread exits: every kernel map forgets it (a thread that reuses its tid starts afresh),
/// and when a followed process's leader exits, userspace is told to forget the pid.
#[tracepoint]
pub fn sched_process_exit(_ctx: TracePointContext) -> u32 {
    let pid_tgid = aya_ebpf::helpers::bpf_get_current_pid_tgid();
    let (pid, tid) = ((pid_tgid >> 32) as u32, pid_tgid as u32);
    // SAFETY: the value is only tested.
    let followed = unsafe { SCHED_TIDS.get(&tid) }.is_some();
    // Removals of absent keys fail harmlessly: most exiting threads were never followed.
    let _ = SCHED_TIDS.remove(&tid);
    let _ = OFFCPU.remove(&tid);
    crate::inflight::forget_thread(tid);
    crate::stack::forget_thread(pid, tid);
    if tid != pid {
        return 0;
    }
    crate::stack::forget_process(pid);
    if !followed {
        return 0;
    }
    let Some(mut entry) = EVENTS.reserve::<ExitEvent>(0) else {
        bump(Counter::SchedRingFull);
        return 0;
    };
    entry.write(ExitEvent {
        header: EventHeader {
            kind: ExitEvent::KIND as u32,
            len: ExitEvent::LEN,
            // SAFETY: no preconditions.
            ts_ns: unsafe { bpf_ktime_get_ns() },
            pid,
            tid,
        },
    });
    entry.submit(aya_ebpf::bindings::BPF_RB_NO_WAKEUP as u64);
    bump(Counter::SchedSubmitted);
    0
}
