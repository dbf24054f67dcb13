//! The allocator's state just before an imported snapshot's trace began, as memory_snapshot.rs
//! rebuilds it backwards from the final segments: the segments and blocks live then, and the
//! pages of expandable segments mapped then, each reservation bounded by the next.

use std::collections::BTreeMap;

use crate::decode::memory_snapshot::{Action, MemorySnapshot, TraceEntry};

/// What the allocator held just before the trace's first entry.
#[derive(Default)]
pub(super) struct Before {
    /// Segments by address: (size, expandable).
    pub(super) segments: BTreeMap<u64, (u64, bool)>,
    /// Expandable segments of the small pool (2 MiB pages; the large pool's are 20 MiB).
    pub(super) small: std::collections::BTreeSet<u64>,
    /// Live blocks by address: (requested size, stream, the block's size where the final
    /// state says it: a block keeps the size it was split to).
    pub(super) blocks: BTreeMap<u64, (u64, u64, Option<u64>)>,
    /// Expandable segments' mapped ranges: start -> end, disjoint and merged.
    pub(super) mapped: BTreeMap<u64, u64>,
}

/// The pages mapped before the trace, as PyTorch mapped them: each reservation's mapped ranges
/// clipped to it, a page of its pool at a time (2 MiB small, 20 MiB large), so that each
/// segment takes its pool from its first page as it did.
pub(super) fn before_maps(
    before: &Before,
    snap: &MemorySnapshot,
    entries: &[TraceEntry],
) -> Vec<(u64, u64)> {
    let mut out = Vec::new();
    let expandable: Vec<(u64, u64)> = before
        .segments
        .iter()
        .filter(|(_, &(_, e))| e)
        .map(|(&a, &(size, _))| (a, size))
        .collect();
    for &(addr, size) in &expandable {
        let next = before.segments.range(addr + 1..).next().map(|(&a, _)| a);
        let end = addr + reserved_extent(addr, size, snap, entries, next);
        let page: u64 = if before.small.contains(&addr) {
            2 << 20
        } else {
            20 << 20
        };
        for (&from, &to) in before.mapped.range(..end) {
            let (from, to) = (from.max(addr), to.min(end));
            let mut at = from;
            while at < to {
                let len = page.min(to - at);
                out.push((at, len));
                at += len;
            }
        }
    }
    out
}

/// Maps (or unmaps) [start, end) in a set of disjoint merged ranges; true when the change is
/// consistent with it (nothing mapped twice, nothing unmapped that was not mapped).
pub(super) fn map_range(
    ranges: &mut BTreeMap<u64, u64>,
    start: u64,
    end: u64,
    mapped: bool,
) -> bool {
    let overlapping: Vec<(u64, u64)> = ranges
        .range(..end)
        .filter(|&(_, &e)| e > start)
        .map(|(&s, &e)| (s, e))
        .collect();
    let covered: u64 = overlapping
        .iter()
        .map(|&(s, e)| e.min(end) - s.max(start))
        .sum();
    for (s, _) in &overlapping {
        ranges.remove(s);
    }
    let (mut lo, mut hi) = (start, end);
    for &(s, e) in &overlapping {
        if mapped {
            (lo, hi) = (lo.min(s), hi.max(e));
        } else {
            if s < start {
                ranges.insert(s, start);
            }
            if e > end {
                ranges.insert(end, e);
            }
        }
    }
    if mapped {
        // Join the neighbours it touches.
        if let Some((&s, &e)) = ranges.range(..lo).next_back().filter(|(_, &e)| e == lo) {
            ranges.remove(&s);
            lo = s.min(lo);
            hi = hi.max(e);
        }
        if let Some(e) = ranges.remove(&hi) {
            hi = e;
        }
        ranges.insert(lo, hi);
        covered == 0
    } else {
        covered == end - start
    }
}

/// An expandable segment's reserved range: it grows upward as chunks are mapped at its end,
/// up to the next segment the snapshot or the rebuilt state knows of (reservations never
/// overlap; PyTorch's snapshot lists each mapped stretch of one reservation as a segment).
pub(super) fn reserved_extent(
    addr: u64,
    size: u64,
    snap: &MemorySnapshot,
    entries: &[TraceEntry],
    next: Option<u64>,
) -> u64 {
    let limit = next.unwrap_or(u64::MAX);
    let final_end = snap
        .segments
        .iter()
        .filter(|s| s.address >= addr && s.address < limit && s.expandable)
        .map(|s| s.address + s.total_size)
        .max()
        .unwrap_or(addr + size);
    let mapped_end = entries
        .iter()
        .filter(|e| {
            matches!(e.action, Action::SegmentMap | Action::SegmentUnmap)
                && e.addr >= addr
                && e.addr < limit
        })
        .map(|e| e.addr + e.size)
        .max()
        .unwrap_or(0);
    final_end.max(mapped_end).min(limit) - addr
}
