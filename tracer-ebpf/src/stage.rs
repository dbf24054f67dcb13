//! Each CPU's stage: call events wait there and reach the ring [`STAGE_EVENTS`] at a time, in
//! one record; userspace empties the stages that hold events old enough each round
//! (`flush_stage`, run on that CPU; [`STAGE_OLDEST`] says which).

use core::sync::atomic::{compiler_fence, Ordering as AtomicOrdering};

use aya_ebpf::{
    bindings::{BPF_F_MMAPABLE, BPF_RB_FORCE_WAKEUP, BPF_RB_NO_WAKEUP},
    helpers::bpf_get_smp_processor_id,
    macros::{map, raw_tracepoint},
    maps::{Array, PerCpuArray},
    programs::RawTracePointContext,
};
use tracer_common::{
    maps::{Counter, FlushResult, Stage, STAGE_CLAIMED, STAGE_EVENTS, STAGE_OLDEST_CPUS},
    CallEvent,
};

use crate::{
    counters::bump,
    inflight::comm_unsent,
    maps::{global, EVENTS, WAKEUP_BYTES},
};

/// This CPU's call events not yet in the ring.
#[map(name = "STAGE")]
static STAGE: PerCpuArray<Stage> = PerCpuArray::with_max_entries(1, 0);

/// When each CPU's oldest staged event was sent, for the reader (maps::STAGE_OLDEST): it
/// interrupts only the CPUs that hold events it can hand over, and an idle machine not at all.
#[map(name = "STAGE_OLDEST")]
static STAGE_OLDEST: Array<u64> = Array::with_max_entries(STAGE_OLDEST_CPUS, BPF_F_MMAPABLE);

/// Records this CPU's [`STAGE_OLDEST`].
#[inline(always)]
fn mark_oldest(value: u64) {
    // SAFETY: no preconditions.
    let cpu = unsafe { bpf_get_smp_processor_id() };
    if let Some(slot) = STAGE_OLDEST.get_ptr_mut(cpu) {
        // SAFETY: this CPU's slot, valid for this run; only this CPU's programs write it, one
        // at a time (the stage's busy mark), and an aligned u64 store is never seen torn.
        unsafe { core::ptr::write_volatile(slot, value) };
    }
}

/// The time an event was sent: its return (as the reader orders events).
#[inline(always)]
fn sent_ns(event: &CallEvent) -> u64 {
    event.header.ts_ns.wrapping_add(event.duration_ns)
}

/// Events a CPU submits between two looks at how much waits in the ring.
const WAKEUP_CHECK_EVERY: u64 = 64;

/// The ring's wake-up flag for the `submitted`-th event of this CPU: waking the reader costs
/// about a third of a traced call and even asking how much waits costs a tenth, so every 64th
/// event looks, and wakes the reader when a batch waits (it also looks every 50 ms by itself).
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

/// This CPU's stage, marked busy; None when a program this one interrupted or preempted holds
/// it (this event then goes to the ring by itself).
#[inline(always)]
pub fn claim_stage() -> Option<*mut Stage> {
    let stage = STAGE.get_ptr_mut(0)?;
    // SAFETY: this CPU's value, valid for this run; only programs of this CPU touch it, and
    // the busy mark keeps one from writing it while another is halfway through.
    unsafe {
        if core::ptr::read_volatile(&(*stage).busy) != 0 {
            return None;
        }
        core::ptr::write_volatile(&mut (*stage).busy, 1);
        // Before the clock is read: a reader that sees the stage empty after its round began
        // knows every event this program makes is later than the round.
        if (*stage).len == 0 {
            mark_oldest(STAGE_CLAIMED);
        }
    }
    compiler_fence(AtomicOrdering::SeqCst);
    Some(stage)
}

/// Appends the event to the claimed stage, sends the stage when full, and frees it. A thread's
/// first call of an op (it carries the thread's name) goes at once with the stage, the reader
/// woken: a new process's first calls reach the registry in milliseconds, while the process
/// still runs and its /proc entry can be read (a short one could end before the next round).
#[inline(always)]
pub fn stage_event(stage: *mut Stage, event: &CallEvent) {
    match next_slot(stage) {
        // SAFETY: the slot is the claimed stage's next free one.
        Some(slot) => unsafe { *slot = *event },
        // Never: a full stage is sent at once. Should it be, the event still goes.
        None => send_event(event, false),
    }
    commit_slot(stage, event.comm[0] != 0);
}

/// The claimed stage's next free slot, for a program to write its event in place (then
/// [`commit_slot`]); None when full (never: a full stage is sent at once).
#[inline(always)]
pub fn next_slot(stage: *mut Stage) -> Option<*mut CallEvent> {
    // SAFETY: claimed by this program (claim_stage).
    unsafe {
        let len = (*stage).len as usize;
        (*stage)
            .events
            .get_mut(len)
            .map(|slot| slot as *mut CallEvent)
    }
}

/// Counts the event written in [`next_slot`] (if there was room), sends the stage when full
/// (or `urgent`, waking the reader), and frees it.
#[inline(always)]
pub fn commit_slot(stage: *mut Stage, urgent: bool) {
    // SAFETY: claimed by this program (claim_stage).
    unsafe {
        if ((*stage).len as usize) < STAGE_EVENTS {
            (*stage).len += 1;
        }
        let full = (*stage).len as usize >= STAGE_EVENTS;
        if full || urgent {
            let flags = if full {
                stage_wakeup_flag()
            } else {
                BPF_RB_FORCE_WAKEUP as u64
            };
            send_stage(stage, flags);
        }
        match (*stage).len {
            0 => mark_oldest(0),
            1 => mark_oldest(sent_ns(&(*stage).events[0])),
            _ => {}
        }
    }
    compiler_fence(AtomicOrdering::SeqCst);
    // SAFETY: as above; the last write of the claim.
    unsafe { core::ptr::write_volatile(&mut (*stage).busy, 0) };
}

/// Frees a claimed stage without adding to it (the event went to the ring by itself).
#[inline(always)]
pub fn release_stage(stage: *mut Stage) {
    // SAFETY: claimed by this program (claim_stage).
    unsafe {
        if (*stage).len == 0 {
            mark_oldest(0);
        }
    }
    compiler_fence(AtomicOrdering::SeqCst);
    // SAFETY: as above; the last write of the claim.
    unsafe { core::ptr::write_volatile(&mut (*stage).busy, 0) };
}

/// This CPU's stage, already claimed by the program that tail-called the running one.
#[inline(always)]
pub fn claimed_stage() -> Option<*mut Stage> {
    STAGE.get_ptr_mut(0)
}

/// One event straight to the ring, when the stage is held or the call site is wanted.
#[inline(always)]
pub fn send_event(event: &CallEvent, send_comm: bool) {
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
        let result = send_stage(stage, BPF_RB_NO_WAKEUP as u64) as i32;
        mark_oldest(0);
        result
    }
}
