//! Segments and the blocks in them: the figures of a pool, a segment's runs as `tracer layout`
//! draws them, and the arithmetic of free gaps and mapped ranges that placing a block rests on.

use super::*;

/// The figures of one pool (or of all pools) at a moment.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PoolStats {
    /// Bytes in blocks handed out (block sizes, as PyTorch counts them).
    pub allocated: u64,
    /// Bytes of device memory the allocator holds (segments, or mapped chunks).
    pub reserved: u64,
    /// Free blocks inside the reserved memory.
    pub free_blocks: u64,
    pub largest_free: u64,
}

impl PoolStats {
    pub fn is_empty(&self) -> bool {
        *self == PoolStats::default()
    }

    /// Reserved but not allocated: the allocator's cache.
    pub fn cached(&self) -> u64 {
        self.reserved.saturating_sub(self.allocated)
    }

    /// The community's ratio: (reserved - allocated) / reserved.
    pub fn slack_ratio(&self) -> f64 {
        if self.reserved == 0 {
            0.0
        } else {
            self.cached() as f64 / self.reserved as f64
        }
    }

    /// Fragmentation proper: 1 - largest free block / cached bytes (0 when the cache is one
    /// block, near 1 when it is dust).
    pub fn fragmentation(&self) -> f64 {
        if self.cached() == 0 {
            0.0
        } else {
            1.0 - self.largest_free as f64 / self.cached() as f64
        }
    }

    pub(super) fn add(&mut self, other: &PoolStats) {
        self.allocated += other.allocated;
        self.reserved += other.reserved;
        self.free_blocks += other.free_blocks;
        self.largest_free = self.largest_free.max(other.largest_free);
    }
}

/// A run of a segment: allocated block, free block, or unmapped address space.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum RunKind {
    Allocated,
    /// Freed by the program but used on other streams (`record_stream`): the allocator keeps it
    /// until the events it recorded on them complete.
    Pending,
    Free,
    Unmapped,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Run {
    pub addr: u64,
    pub size: u64,
    pub kind: RunKind,
    /// For allocated blocks: the size requested.
    pub requested: u64,
    /// For allocated blocks: the call site of the pytorch:malloc (--stack).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stack: Option<u32>,
    /// For allocated blocks: when they were handed out.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub since_ns: Option<i64>,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub(super) struct Block {
    pub(super) size: u64,
    pub(super) requested: u64,
    pub(super) stack: Option<u32>,
    pub(super) ts_ns: i64,
    /// The block events seen before it (its age is counted in them).
    pub(super) event: u64,
    /// Allocated before a gap in the trace and not seen since: believed still held.
    pub(super) carried: bool,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub(super) struct Segment {
    pub(super) size: u64,
    pub(super) device: i32,
    /// Expandable segments: the mapped ranges (start -> end); None for cudaMalloc'ed ones.
    pub(super) mapped: Option<BTreeMap<u64, u64>>,
    /// Its pool, once known (a block or a mapping said).
    pub(super) pool: Option<Pool>,
    pub(super) blocks: BTreeMap<u64, Block>,
}

impl Block {
    /// The block a pytorch:malloc hands out, of `size`, the `event`-th block event seen.
    pub(super) fn new(e: &Event, size: u64, event: u64) -> Block {
        Block {
            size,
            requested: e.size,
            stack: e.stack.map(|s| s.get()),
            ts_ns: e.ts_ns,
            event,
            carried: false,
        }
    }
}

impl Segment {
    /// Its free gaps' sizes, as counted in its pool's multiset (once it has a pool).
    pub(super) fn counted_gaps(&self, addr: u64) -> Vec<u64> {
        if self.pool.is_some() {
            free_gaps(addr, self)
        } else {
            Vec::new()
        }
    }

    /// The free span the block at `ptr` sits in, as [`Segment::span_around`] says it, in two
    /// walks of the blocks; None where no block starts at `ptr`.
    pub(super) fn span_of_block(&self, addr: u64, ptr: u64) -> Option<Option<(u64, u64)>> {
        let mut from_it = self.blocks.range(ptr..);
        let (&at, block) = from_it.next()?;
        if at != ptr {
            return None;
        }
        let size = block.size;
        if self.mapped.is_some() || self.pool.is_none() {
            return Some(None);
        }
        let lo = match self.blocks.range(..ptr).next_back() {
            Some((&b, block)) => b + block.size,
            None => addr,
        };
        let hi = match from_it.next() {
            Some((&b, _)) => b,
            None => addr + self.size,
        };
        Some((lo <= ptr && ptr.saturating_add(size) <= hi).then_some((lo, hi)))
    }

    /// The free span around [from, to) an unmapped segment's blocks leave (the blocks from
    /// `from` up to `to` not counted): from the end of the block before to the start of the one
    /// after. None where the blocks overlap it (the exact recount is needed).
    pub(super) fn span_around(&self, addr: u64, from: u64, to: u64) -> Option<(u64, u64)> {
        if self.mapped.is_some() || self.pool.is_none() {
            return None;
        }
        let lo = match self.blocks.range(..from).next_back() {
            Some((&b, block)) => b + block.size,
            None => addr,
        };
        let hi = match self.blocks.range(from.saturating_add(1)..).next() {
            Some((&b, _)) => b,
            None => addr + self.size,
        };
        (lo <= from && to <= hi).then_some((lo, hi))
    }
}

/// One segment as a map, for `tracer layout`.
#[derive(Clone, Debug, Serialize)]
pub struct SegmentMap {
    pub addr: u64,
    pub size: u64,
    pub device: i32,
    pub pool: Option<Pool>,
    /// The private pool it belongs to (a CUDA graph's, a MemPool), where tracer knows it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pool_id: Option<crate::model::pools::PoolId>,
    pub expandable: bool,
    pub runs: Vec<Run>,
}

/// A pytorch:malloc whose aux1 holds the size its block was split to: an imported snapshot's
/// block from before its trace (the probe itself sets no aux1). Its final size is known where
/// its split, decided before the trace, is not.
pub const SPLIT_SIZE_IN_AUX1: &str = "aux1 of an imported pytorch:malloc";

/// The size a block takes: its rounded request, or the size an imported block was split to.
pub(super) fn split_size(e: &Event, rounded: u64) -> u64 {
    if e.op == tracer_common::Op::TorchMalloc && e.aux1 > rounded {
        e.aux1
    } else {
        rounded
    }
}

/// The sizes of a segment's free runs in address order ([`runs_of`]'s free runs, without
/// building the runs: this is done at every block event).
pub(super) fn free_gaps(addr: u64, seg: &Segment) -> Vec<u64> {
    let mut gaps = Vec::new();
    let mut free = |from: u64, to: u64| match &seg.mapped {
        None => gaps.push(to - from),
        Some(ranges) => {
            for (&s, &e) in ranges.range(..to) {
                let (s, e) = (s.max(from), e.min(to));
                if s < e {
                    gaps.push(e - s);
                }
            }
        }
    };
    let mut at = addr;
    for (&b, block) in &seg.blocks {
        if b > at {
            free(at, b);
        }
        at = at.max(b + block.size);
    }
    let end = addr + seg.size;
    if at < end {
        free(at, end);
    }
    gaps
}

/// The runtime's and driver's device allocations (and frees) that can be the allocator's
/// segments (not the async pools', nor managed memory).
pub(super) fn is_segment_op(op: Op) -> bool {
    matches!(
        op,
        Op::CudaMalloc | Op::CuMemAlloc | Op::CudaFree | Op::CuMemFree
    )
}

pub(super) fn reserved_of(seg: &Segment) -> u64 {
    match &seg.mapped {
        Some(ranges) => ranges.iter().map(|(s, e)| e - s).sum(),
        None => seg.size,
    }
}

/// Where the free run starting at `ptr` ends: the next block, the segment's end, or the end of
/// the mapped range holding it. None when `ptr` is inside a block or not mapped.
pub(super) fn free_end(addr: u64, seg: &Segment, ptr: u64) -> Option<u64> {
    if let Some((&b, block)) = seg.blocks.range(..=ptr).next_back() {
        if ptr < b + block.size {
            return None;
        }
    }
    let mut end = addr + seg.size;
    if let Some(ranges) = &seg.mapped {
        let (_, &range_end) = ranges.range(..=ptr).next_back().filter(|(_, &e)| ptr < e)?;
        end = end.min(range_end);
    }
    if let Some((&next, _)) = seg.blocks.range(ptr + 1..).next() {
        end = end.min(next);
    }
    Some(end)
}

/// The private pools of `maps` (segments with a pool id), by device and id.
pub(super) fn private_pools_of(maps: &[SegmentMap]) -> Vec<crate::model::pools::PrivatePool> {
    let mut pools: BTreeMap<(i32, crate::model::pools::PoolId), crate::model::pools::PrivatePool> =
        BTreeMap::new();
    for m in maps {
        let Some(id) = m.pool_id else { continue };
        let p = pools
            .entry((m.device, id))
            .or_insert(crate::model::pools::PrivatePool {
                id,
                device: m.device,
                ..crate::model::pools::PrivatePool::default()
            });
        p.segments += 1;
        p.mapped_segments += u64::from(m.expandable);
        for r in &m.runs {
            match r.kind {
                // A block kept for other streams' work is not free yet.
                RunKind::Allocated | RunKind::Pending => {
                    p.reserved += r.size;
                    p.allocated += r.size;
                }
                RunKind::Free => {
                    p.reserved += r.size;
                    p.free += r.size;
                    p.free_blocks += 1;
                    p.largest_free = p.largest_free.max(r.size);
                }
                _ => {}
            }
        }
    }
    pools.into_values().collect()
}

/// The segment's runs in address order.
pub(super) fn runs_of(addr: u64, seg: &Segment, pending: &BTreeMap<u64, u32>) -> Vec<Run> {
    let end = addr + seg.size;
    // Mapped ranges (the whole segment when not expandable).
    let mapped: Vec<(u64, u64)> = match &seg.mapped {
        Some(r) => r.iter().map(|(&s, &e)| (s, e)).collect(),
        None => vec![(addr, end)],
    };
    let mut runs = Vec::new();
    let mut at = addr;
    let push_free = |runs: &mut Vec<Run>, from: u64, to: u64| {
        // Free space between `from` and `to`, split where it is not mapped.
        let mut cur = from;
        for &(s, e) in &mapped {
            let (s, e) = (s.max(from), e.min(to));
            if s >= e {
                continue;
            }
            if s > cur {
                runs.push(run(cur, s - cur, RunKind::Unmapped));
            }
            runs.push(run(s, e - s, RunKind::Free));
            cur = e;
        }
        if cur < to {
            runs.push(run(cur, to - cur, RunKind::Unmapped));
        }
    };
    for (&b, block) in &seg.blocks {
        if b > at {
            push_free(&mut runs, at, b);
        }
        runs.push(Run {
            addr: b,
            size: block.size,
            kind: if pending.contains_key(&b) {
                RunKind::Pending
            } else {
                RunKind::Allocated
            },
            requested: block.requested,
            stack: block.stack,
            since_ns: Some(block.ts_ns),
        });
        at = at.max(b + block.size);
    }
    if at < end {
        push_free(&mut runs, at, end);
    }
    runs
}

pub(super) fn run(addr: u64, size: u64, kind: RunKind) -> Run {
    Run {
        addr,
        size,
        kind,
        requested: 0,
        stack: None,
        since_ns: None,
    }
}

/// Adds [s, e) to disjoint ranges, merging neighbours.
pub(super) fn insert_range(ranges: &mut BTreeMap<u64, u64>, mut s: u64, mut e: u64) {
    let touching: Vec<(u64, u64)> = ranges
        .range(..=e)
        .filter(|(&rs, &re)| re >= s && rs <= e)
        .map(|(&rs, &re)| (rs, re))
        .collect();
    for (rs, re) in touching {
        ranges.remove(&rs);
        s = s.min(rs);
        e = e.max(re);
    }
    ranges.insert(s, e);
}

/// Removes [s, e) from disjoint ranges.
pub(super) fn remove_range(ranges: &mut BTreeMap<u64, u64>, s: u64, e: u64) {
    let overlapping: Vec<(u64, u64)> = ranges
        .range(..e)
        .filter(|(_, &re)| re > s)
        .map(|(&rs, &re)| (rs, re))
        .collect();
    for (rs, re) in overlapping {
        ranges.remove(&rs);
        if rs < s {
            ranges.insert(rs, s);
        }
        if re > e {
            ranges.insert(e, re);
        }
    }
}

/// Whether a pool's free blocks are scattered for the requests it serves: a small pool's
/// requests are at most 1 MiB, so a free block of that size serves every one of them however
/// the rest lies.
pub fn scatters(pool: Pool, s: &PoolStats) -> bool {
    pool != Pool::Small || s.largest_free < crate::model::policy::SMALL_SIZE
}
