//! What every program shares: the ring, the pause switch, the globals userspace sets at load,
//! and the threads the scheduler programs follow. Below every program's module: it names only
//! the counters.

use aya_ebpf::{
    helpers::bpf_ktime_get_ns,
    macros::map,
    maps::{Array, LruHashMap, RingBuf},
};
use tracer_common::maps::{self as names, Counter};

use crate::counters::bump;

#[map(name = "EVENTS")]
pub static EVENTS: RingBuf = RingBuf::with_byte_size(names::DEFAULT_RING_BYTES, 0);

/// Slot 0: non-zero once userspace is stopping; new calls are then ignored (their returns
/// still complete, so the final drain sees every call that had started).
#[map(name = "CONTROL")]
pub static CONTROL: Array<u32> = Array::with_max_entries(1, 0);

/// Bytes waiting in the ring before the reader is woken; set by userspace at load.
#[unsafe(no_mangle)]
pub(crate) static WAKEUP_BYTES: u64 = 0;

/// Non-zero: the benchmark's floors, the same probes with no work: 1 counts entries only; 2 also
/// reads the clock at entry and return, as timing a call needs.
#[unsafe(no_mangle)]
pub(crate) static FLOOR_MODE: u32 = 0;

/// The floor's work: nothing, or one clock read (kept from being optimized away).
#[inline(always)]
fn floor_work(mode: u32) {
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

/// Whether new calls are ignored: userspace is stopping.
#[inline(always)]
pub fn paused() -> bool {
    CONTROL.get(0).is_some_and(|paused| *paused != 0)
}

/// The benchmark's floors: the same probes with no work. True when this run is one (its work
/// done here): the program then stops.
#[inline(always)]
pub fn floor_done() -> bool {
    let floor = global(&FLOOR_MODE);
    if floor != 0 {
        floor_work(floor);
    }
    floor != 0
}

/// Whether a program at a call's entry (or a USDT site) goes on: not while userspace is
/// stopping; counted as an entry; not on a floor run.
#[inline(always)]
pub fn entry_proceeds() -> bool {
    if paused() {
        return false;
    }
    bump(Counter::Entries);
    !floor_done()
}

/// Non-zero: capture call sites (set by userspace at load for --stack).
#[unsafe(no_mangle)]
pub(crate) static STACK_MODE: u32 = 0;

#[inline(always)]
pub fn stack_enabled() -> bool {
    global(&STACK_MODE) != 0
}

/// The threads the scheduler programs follow: a call's thread is added at its first event.
#[map(name = "SCHED_TIDS")]
pub static SCHED_TIDS: LruHashMap<u32, u32> =
    LruHashMap::with_max_entries(names::SCHED_TIDS_ENTRIES, 0);
