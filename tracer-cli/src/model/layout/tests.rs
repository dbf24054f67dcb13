use super::*;
use crate::model::{policy::MIB, NO_DEVICE};

/// A block event of process 1 on device 0 (the model's tests build theirs from it).
pub(crate) fn ev(op: Op, ptr: u64, size: u64) -> Event {
    Event {
        ts_ns: 0,
        duration_ns: 0,
        size,
        ptr,
        aux0: 0,
        aux1: 0,
        pid: 1,
        tid: 1,
        ret: 0,
        device: 0,
        stack: None,
        op,
    }
}

const SEG: u64 = 0x7f00_0000_0000;

/// The free gaps counted as blocks come and go (only the spans beside each one) equal a
/// recount of every segment's gaps, through random allocations and frees in three segments
/// of both pools, healing overlaps included.
#[test]
fn free_gaps_counted_as_blocks_come_and_go_equal_a_recount() {
    let mut l = Layout::default();
    let segs = [
        (SEG, SMALL_SEGMENT),
        (SEG + (1 << 30), LARGE_SEGMENT),
        (SEG + (2 << 30), 64 << 20),
    ];
    for (a, size) in segs {
        l.apply(&ev(Op::CudaMalloc, a, size));
    }
    let mut held: Vec<u64> = Vec::new();
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    for step in 0..20_000 {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let (a, size) = segs[(x % 3) as usize];
        if x % 5 < 2 && !held.is_empty() {
            let ptr = held.swap_remove((x >> 8) as usize % held.len());
            l.apply(&ev(Op::TorchFree, ptr, 0));
        } else {
            let unit = if size == SMALL_SEGMENT { 512 } else { 1 << 20 };
            let ptr = a + (x >> 20) % (size / unit) * unit;
            let req = 1 + (x >> 40) % (4 * unit);
            l.apply(&ev(Op::TorchMalloc, ptr, req));
            held.push(ptr);
        }
        let mut counted: BTreeMap<(i32, Pool), (u64, u64)> = BTreeMap::new();
        for (&addr, seg) in &l.segments {
            if let Some(pool) = seg.pool {
                let c = counted.entry((seg.device, pool)).or_default();
                for g in free_gaps(addr, seg) {
                    c.0 += 1;
                    c.1 = c.1.max(g);
                }
            }
        }
        for (key, s) in l.stats() {
            let c = counted.get(key).copied().unwrap_or_default();
            assert_eq!((s.free_blocks, s.largest_free), c, "step {step}, {key:?}");
        }
    }
}

#[test]
fn small_pool_splits_and_merges_as_pytorch() {
    let mut l = Layout::default();
    l.apply(&ev(Op::CudaMalloc, SEG, SMALL_SEGMENT));
    assert_eq!(
        l.outside(0),
        SMALL_SEGMENT,
        "no block yet: outside the allocator"
    );
    l.apply(&ev(Op::TorchMalloc, SEG, 1000));
    assert_eq!(l.outside(0), 0);
    let s = l.stats()[&(0, Pool::Small)];
    assert_eq!((s.allocated, s.reserved), (1024, SMALL_SEGMENT));
    assert_eq!((s.free_blocks, s.largest_free), (1, SMALL_SEGMENT - 1024));
    l.apply(&ev(Op::TorchMalloc, SEG + 1024, 4096));
    l.apply(&ev(Op::TorchFree, SEG, 0));
    let s = l.stats()[&(0, Pool::Small)];
    assert_eq!(
        (s.allocated, s.free_blocks, s.largest_free),
        (4096, 2, SMALL_SEGMENT - 5120)
    );
    assert!(
        (s.fragmentation() - (1.0 - (SMALL_SEGMENT - 5120) as f64 / (SMALL_SEGMENT - 4096) as f64))
            .abs()
            < 1e-12
    );
    l.apply(&ev(Op::TorchFree, SEG + 1024, 0));
    let s = l.stats()[&(0, Pool::Small)];
    assert_eq!(
        (s.allocated, s.free_blocks, s.largest_free),
        (0, 1, SMALL_SEGMENT)
    );
    l.apply(&ev(Op::CudaFree, SEG, 0));
    assert_eq!(l.total(), PoolStats::default());
    assert_eq!(l.unexplained, Unexplained::default());
}

#[test]
fn large_remainders_of_a_mib_or_less_are_not_split() {
    let mut l = Layout::default();
    l.apply(&ev(Op::CudaMalloc, SEG, LARGE_SEGMENT));
    // 19.5 MiB in a 20 MiB segment: 0.5 MiB left, not split: the block is the whole segment.
    l.apply(&ev(Op::TorchMalloc, SEG, 19 * MIB + MIB / 2));
    let s = l.stats()[&(0, Pool::Large)];
    assert_eq!((s.allocated, s.free_blocks), (LARGE_SEGMENT, 0));
    l.apply(&ev(Op::TorchFree, SEG, 0));
    l.apply(&ev(Op::TorchMalloc, SEG, 8 * MIB));
    let s = l.stats()[&(0, Pool::Large)];
    assert_eq!((s.allocated, s.largest_free), (8 * MIB, 12 * MIB));
    // max_split_size: a block at or above it is never split.
    let mut l = Layout::new(AllocConf::parse("max_split_size_mb:4"));
    l.apply(&ev(Op::CudaMalloc, SEG, LARGE_SEGMENT));
    l.apply(&ev(Op::TorchMalloc, SEG, 8 * MIB));
    assert_eq!(l.stats()[&(0, Pool::Large)].allocated, LARGE_SEGMENT);
}

#[test]
fn expandable_segments_map_in_chunks_and_split_any_512_bytes() {
    let mut l = Layout::default();
    let va = 0x6000_0000_0000;
    l.apply(&ev(Op::CuMemAddressReserve, va, 1 << 34));
    for i in 0..2 {
        l.apply(&ev(Op::CuMemMap, va + i * LARGE_SEGMENT, LARGE_SEGMENT));
    }
    l.apply(&ev(Op::TorchMalloc, va, 39 * MIB + MIB / 2));
    let s = l.stats()[&(0, Pool::Large)];
    assert_eq!(
        (s.reserved, s.allocated),
        (2 * LARGE_SEGMENT, 39 * MIB + MIB / 2)
    );
    assert_eq!((s.free_blocks, s.largest_free), (1, MIB / 2));
    l.apply(&ev(Op::TorchFree, va, 0));
    l.apply(&ev(Op::CuMemUnmap, va + LARGE_SEGMENT, LARGE_SEGMENT));
    let s = l.stats()[&(0, Pool::Large)];
    assert_eq!(
        (s.reserved, s.allocated, s.largest_free),
        (LARGE_SEGMENT, 0, LARGE_SEGMENT)
    );
    let map = l.segments();
    assert_eq!(
        map[0].runs.iter().map(|r| r.kind).collect::<Vec<_>>(),
        [RunKind::Free, RunKind::Unmapped]
    );
}

#[test]
fn what_cannot_be_seen_is_counted() {
    let mut l = Layout::default();
    l.apply(&ev(Op::TorchMalloc, SEG, 4096));
    l.apply(&ev(Op::TorchFree, SEG + 8192, 0));
    assert_eq!(l.unexplained.blocks_outside_segments, 1);
    assert_eq!(l.unexplained.unmatched_frees, 1);
    let mut e = ev(Op::CudaMalloc, SEG, LARGE_SEGMENT);
    e.device = NO_DEVICE;
    l.apply(&e);
    assert_eq!(l.outside(NO_DEVICE), LARGE_SEGMENT);
}

#[test]
fn rounding_follows_round_size() {
    let plain = AllocConf::default();
    assert_eq!(plain.round_size(1), 512);
    assert_eq!(plain.round_size(513), 1024);
    assert_eq!(plain.round_size(3 * MIB + 1), 3 * MIB + 512);
    let p2 = AllocConf::parse("roundup_power2_divisions:4");
    assert_eq!(p2.round_size(5 * MIB), 5 * MIB);
    assert_eq!(p2.round_size(5 * MIB + 1), 6 * MIB);
}

fn at(op: Op, ptr: u64, size: u64, ts_ms: i64) -> Event {
    Event {
        ts_ns: ts_ms * 1_000_000,
        ..ev(op, ptr, size)
    }
}

#[test]
fn an_allocation_over_a_block_believed_held_heals_the_layout() {
    let mut l = Layout::default();
    l.apply(&at(Op::CudaMalloc, SEG, LARGE_SEGMENT, 0));
    l.apply(&at(Op::TorchMalloc, SEG, 4 * MIB, 1));
    l.apply(&at(Op::TorchMalloc, SEG + 4 * MIB, 4 * MIB, 2));
    assert!(l.unknown.exact());
    // Both blocks were freed unseen; a new 6 MiB block lands over them.
    l.apply(&at(Op::TorchMalloc, SEG, 6 * MIB, 3));
    let s = l.stats()[&(0, Pool::Large)];
    assert_eq!(s.allocated, 6 * MIB);
    assert_eq!(
        (l.unknown.freed_unseen, l.unknown.freed_unseen_bytes),
        (2, 8 * MIB)
    );
    assert_eq!(l.unknown.since_ns, Some(3_000_000));
    assert!(!l.unknown.exact());
    // A thousand block events without contradiction (twice the longest life seen since is
    // less): exact again.
    for i in 0..499 {
        l.apply(&at(Op::TorchMalloc, SEG + 6 * MIB, MIB, 500 + i));
        l.apply(&at(Op::TorchFree, SEG + 6 * MIB, 0, 500 + i));
    }
    assert!(!l.unknown.exact());
    l.apply(&at(Op::TorchMalloc, SEG + 6 * MIB, MIB, 2000));
    l.apply(&at(Op::TorchFree, SEG + 6 * MIB, 0, 2001));
    assert_eq!(l.unknown.exact_ns, Some(2_001_000_000));
    assert_eq!(l.unknown.longest_life_events, 1);
}

#[test]
fn blocks_of_segments_never_seen_keep_the_layout_uncertain() {
    let mut l = Layout::default();
    l.apply(&at(Op::TorchMalloc, SEG, 4096, 0));
    assert_eq!(l.orphans(None), (1, 4096));
    assert!(l.unknown.unseen_segments && !l.unknown.exact());
    l.apply(&at(Op::TorchFree, SEG, 0, 1));
    assert_eq!(l.orphans(None), (0, 0));
    assert_eq!(l.unexplained.unmatched_frees, 0, "a free of a block it saw");
    // Quiet for long after: still not exact, the unseen segment's free space is unknown.
    l.apply(&at(
        Op::CudaMalloc,
        SEG + LARGE_SEGMENT,
        LARGE_SEGMENT,
        5000,
    ));
    l.apply(&at(Op::TorchMalloc, SEG + LARGE_SEGMENT, MIB, 9000));
    assert!(!l.unknown.exact());
    // A segment created over a block believed in an unseen one: that block was freed.
    l.apply(&at(Op::TorchMalloc, SEG + 3 * LARGE_SEGMENT, 4096, 9001));
    l.apply(&at(
        Op::CudaMalloc,
        SEG + 3 * LARGE_SEGMENT,
        LARGE_SEGMENT,
        9002,
    ));
    assert_eq!(l.orphans(None), (0, 0));
}

#[test]
fn a_gap_carries_blocks_as_believed_held_and_counts_them() {
    let mut l = Layout::default();
    l.apply(&at(Op::CudaMalloc, SEG, LARGE_SEGMENT, 0));
    l.apply(&at(Op::TorchMalloc, SEG, 4 * MIB, 1));
    l.apply(&at(Op::TorchMalloc, SEG + 4 * MIB, 2 * MIB, 2));
    l.mark_gap(Some(2_000_000), 10_000_000_000);
    assert_eq!(l.carried(), (2, 6 * MIB));
    assert_eq!((l.unknown.gaps, l.unknown.since_ns), (1, Some(2_000_000)));
    l.apply(&at(Op::TorchFree, SEG + 4 * MIB, 0, 10_001));
    assert_eq!(l.carried(), (1, 4 * MIB));
    // Serialized as a keyframe keeps it, and the figures.
    let back: Layout = postcard::from_bytes(&postcard::to_stdvec(&l).unwrap()).unwrap();
    assert_eq!(
        (back.carried(), back.unknown, back.total()),
        (l.carried(), l.unknown, l.total())
    );
}
