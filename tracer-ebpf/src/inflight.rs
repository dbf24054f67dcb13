//! Each (thread, op)'s call in flight between its entry and return programs: a slot of an
//! array, reused in place, or the fallback map when another pair holds the slot; and whether
//! the thread's name is still to be sent.

use aya_ebpf::{
    bindings::BPF_ANY,
    macros::map,
    maps::{Array, LruHashMap},
};
use tracer_common::{
    maps::{self as names, slot_index, Counter, Inflight, InflightKey, Slot},
    probes::OP_COUNT,
};

use crate::counters::bump;

// Indexed by a hash of (tid, op): a slot is reused in place from call to call.
#[map(name = "SLOTS")]
static SLOTS: Array<Slot> = Array::with_max_entries(names::SLOT_COUNT, 0);

// The fallback for a (tid, op) whose slot holds another pair's call in flight. LRU: entries of
// threads that are gone must not fill the map.
#[map(name = "INFLIGHT")]
static INFLIGHT: LruHashMap<InflightKey, Inflight> =
    LruHashMap::with_max_entries(names::INFLIGHT_ENTRIES, 0);

/// Keeps the entry state in the (tid, op)'s slot, written in place; when another pair's call is
/// in flight there, in the fallback map.
#[inline(always)]
pub fn save_inflight(tid: u32, op: u32, state: &Inflight) {
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

/// Takes the (tid, op)'s entry state, marking it consumed, with whether the thread's name is
/// still to be sent; counts a return without an entry.
#[inline(always)]
pub fn take_inflight(tid: u32, op: u32) -> Option<(Inflight, bool)> {
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

/// The thread's name goes with the pair's next event (its event was lost).
#[inline(always)]
pub fn comm_unsent(tid: u32, op: u32) {
    if let Some(slot) = SLOTS.get_ptr_mut(slot_index(tid, op)) {
        // SAFETY: as in save_inflight.
        unsafe {
            if (*slot).tid == tid && (*slot).op == op {
                (*slot).comm_sent = 0;
            }
        }
    }
}
