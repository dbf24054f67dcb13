//! Per-CPU counters: every event is either submitted or counted as lost, in the kernel.

use aya_ebpf::{macros::map, maps::PerCpuArray};
use tracer_common::maps::Counter;

#[map(name = "COUNTERS")]
static COUNTERS: PerCpuArray<u64> = PerCpuArray::with_max_entries(Counter::COUNT, 0);

/// The counter's slot of this CPU.
#[inline(always)]
pub fn slot(counter: Counter) -> Option<*mut u64> {
    COUNTERS.get_ptr_mut(counter as u32)
}

#[inline(always)]
pub fn bump_by(counter: Counter, n: u64) {
    if let Some(slot) = COUNTERS.get_ptr_mut(counter as u32) {
        // SAFETY: as in bump.
        unsafe { *slot += n };
    }
}

#[inline(always)]
pub fn bump(counter: Counter) {
    if let Some(slot) = COUNTERS.get_ptr_mut(counter as u32) {
        // SAFETY: per-CPU slot, and a BPF program is not preempted by another on the same CPU
        // for the uprobe program type, so a plain increment is race-free.
        unsafe { *slot += 1 };
    }
}
