//! The caching allocator's layout, rebuilt from what was traced: segments from the device
//! allocations (cudaMalloc/cudaFree, or the reserved ranges and mapped chunks of expandable
//! segments), blocks from PyTorch's own probes (pytorch:malloc/free) placed inside them with the
//! allocator's rounding and split rules. From it, per device and pool, the figures PyTorch
//! itself would report: allocated, reserved, the free blocks and the largest one.
//!
//! Feed events in the order they happened ([`Layout::apply`]); read [`Layout::stats`] at any
//! moment, or [`Layout::segments`] for the map.
//!
//! The rules live beside it, a file each: `segments` (segments, blocks, runs and free gaps),
//! `blocks` (placing what the calls say), `pending` (blocks kept for other streams' work),
//! `sight` (what the armed probes let tracer see); private pools are model/pools.rs, the
//! allocator's rounding and split rules model/policy.rs.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use tracer_common::{Op, OpClass, Space};

use super::Event;

use super::policy::{serves, should_split};
pub use super::policy::{
    AllocConf, Pool, LARGE_SEGMENT, MIN_BLOCK, MIN_LARGE_ALLOC, ROUND_LARGE, SMALL_SEGMENT,
    SMALL_SIZE,
};

mod blocks;
mod pending;
mod segments;
mod sight;

use pending::Freed;
pub(crate) use pending::FREE_RECORDS_WITHIN_NS;
pub use pending::{PendingFrees, EVENT_FROM_ALLOCATOR};
use segments::{
    free_end, free_gaps, insert_range, is_segment_op, private_pools_of, remove_range, reserved_of,
    runs_of, split_size, Block, Segment,
};
pub use segments::{scatters, PoolStats, Run, RunKind, SegmentMap, SPLIT_SIZE_IN_AUX1};
pub use sight::{BlockSight, Sight, UnseenSegment};

/// What the layout cannot explain: said, never guessed over.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Unexplained {
    /// Blocks whose address lies in no segment seen (allocated before the trace began).
    pub blocks_outside_segments: u64,
    /// Frees of blocks never seen allocated.
    pub unmatched_frees: u64,
    /// Blocks overlapping one already there.
    pub overlapping_blocks: u64,
    /// Segments released while blocks were still allocated in them.
    pub segments_freed_with_blocks: u64,
}

/// A block found where no segment tracer saw lies: its segment was created before the trace
/// began, or while tracer was not running.
#[derive(Clone, Copy, Debug, Serialize, Deserialize)]
struct Orphan {
    size: u64,
    requested: u64,
    device: i32,
}

/// What tracer did not see of this allocator, and whether the layout is exact again.
///
/// Evidence that the layout differs from the allocator's: a block where no known segment lies,
/// a free of a block never seen allocated, an allocation over a block believed held (it was
/// freed unseen), or a gap in the trace (tracer restarted). From the first evidence the layout
/// is uncertain. It is exact again once no block event has contradicted it for twice the
/// longest life of a block seen freed since, counted in block events (at least
/// [`QUIET_EVENTS`]; counted in events, not time, so that a stalled job does not stretch it): a
/// block
/// allocated unseen and still held would have been freed (a free of a block never seen) and
/// one freed unseen reused (an allocation over it) within that time. Blocks carried over a gap
/// and not seen since are believed held, and said to be. Unless segments tracer never saw hold
/// blocks: their free space stays unknown while the process runs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Unknown {
    /// Since when the layout may differ from the allocator's (None: it never did).
    pub since_ns: Option<i64>,
    /// When it was exact again (None while it is not).
    pub exact_ns: Option<i64>,
    /// Segments tracer never saw created hold (or held) blocks.
    pub unseen_segments: bool,
    /// Blocks believed held that a later allocation overlapped: freed while tracer did not see.
    pub freed_unseen: u64,
    pub freed_unseen_bytes: u64,
    /// Gaps in the trace the state was carried over (tracer restarted).
    pub gaps: u32,
    /// The latest evidence (its time, and the block events seen by then), and the longest life
    /// of a block seen freed since, in block events.
    pub last_evidence_ns: i64,
    pub last_evidence_event: u64,
    pub longest_life_events: u64,
}

/// The fewest block events without contradiction after which the layout is exact again.
pub const QUIET_EVENTS: u64 = 1000;

impl Unknown {
    /// The layout is the allocator's as far as evidence goes.
    pub fn exact(&self) -> bool {
        self.since_ns.is_none() || self.exact_ns.is_some()
    }
}

/// The layout of one process.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct Layout {
    conf: AllocConf,
    segments: BTreeMap<u64, Segment>,
    /// Per (device, pool): free gap sizes -> count.
    gaps: BTreeMap<(i32, Pool), BTreeMap<u64, u64>>,
    totals: BTreeMap<(i32, Pool), PoolStats>,
    /// Blocks seen at all: the allocator's probes are visible.
    pub blocks_seen: u64,
    /// Block events (allocations and frees) seen.
    block_events: u64,
    pub unexplained: Unexplained,
    /// Device bytes allocated that belong to no segment of the allocator (yet): libraries'
    /// own cudaMalloc (cuBLAS workspaces, NCCL), or a segment no block has landed in.
    outside: BTreeMap<i32, u64>,
    /// Blocks held in segments tracer never saw, by address.
    orphans: BTreeMap<u64, Orphan>,
    pub unknown: Unknown,
    /// Expandable segments a block landed in since this layout was built or restored (a
    /// restored one also knows those holding blocks now): not kept in keyframes.
    #[serde(skip)]
    expandable_used: std::collections::BTreeSet<u64>,
    /// Blocks freed while other streams' work may still use them. Kept in keyframes after the
    /// state (model/state.rs), so that keyframes written before it existed still decode.
    #[serde(skip)]
    pub(crate) pending: PendingFrees,
    /// Whether PyTorch's allocator probes are seen, and the segments made while they were not.
    /// Kept in keyframes after the state (format 3).
    #[serde(skip)]
    pub(crate) sight: Sight,
    /// Each segment's private pool, where tracer knows it (model/pools.rs). Kept in keyframes
    /// after the state (format 4).
    #[serde(skip)]
    pub(crate) private: super::pools::PrivatePools,
    /// What the process's CUDA graph captures route where (model/pools.rs). Kept in keyframes
    /// after the pools (format 5).
    #[serde(skip)]
    pub(crate) captures: super::pools::Captures,
}

impl Layout {
    pub fn new(conf: AllocConf) -> Layout {
        Layout {
            conf,
            ..Default::default()
        }
    }

    pub fn conf(&self) -> AllocConf {
        self.conf
    }

    /// Applies one event (the process's events in time order).
    pub fn apply(&mut self, e: &Event) {
        let spec = e.op.spec();
        let disarmed = matches!(self.sight.state, BlockSight::DisarmedAt(_));
        match (spec.class, spec.space) {
            (OpClass::Probes, _) if e.op == Op::AllocatorArming => self.arming(e.ts_ns),
            (OpClass::Probes, _) if e.op == Op::AllocatorArmed => self.arm(e.ts_ns),
            (OpClass::Probes, _) => self.disarm(e.ts_ns),
            // Made before the disarm and read after it: their state is dropped.
            (OpClass::BlockAlloc | OpClass::BlockFree | OpClass::EventRecord, _) if disarmed => {}
            (OpClass::BlockAlloc, _) if e.ptr != 0 => self.block_alloc(e),
            (OpClass::BlockFree, _) if e.ptr != 0 => self.block_free(e),
            (OpClass::EventRecord, _) if e.ret == 0 && e.aux1 == EVENT_FROM_ALLOCATOR => {
                self.captures.apply(e);
                self.event_recorded(e)
            }
            (OpClass::EventWait, _) if e.ret == 0 => self.event_complete(e.ptr),
            (OpClass::EventRecord, _) => {
                self.captures.apply(e);
            }
            _ if self.captures.apply(e) => {}
            (OpClass::Alloc, Space::Device) if e.ret == 0 && e.ptr != 0 && is_segment_op(e.op) => {
                self.private.made(e.ptr, e.aux1);
                self.segment_alloc(e.ptr, e.size, e.device, None, e.ts_ns)
            }
            (OpClass::Free, Space::Device) if e.ret == 0 && is_segment_op(e.op) => {
                self.private.released(e.ptr);
                self.segment_free(e.ptr)
            }
            (OpClass::Alloc, Space::AddressRange) if e.ret == 0 && e.ptr != 0 => {
                self.private.made(e.ptr, e.aux1);
                self.segment_alloc(e.ptr, e.size, e.device, Some(BTreeMap::new()), e.ts_ns)
            }
            (OpClass::Free, Space::AddressRange) if e.ret == 0 => {
                self.private.released(e.ptr);
                self.segment_free(e.ptr)
            }
            (OpClass::Alloc, Space::Mapping) if e.ret == 0 => self.map(e.ptr, e.size, true),
            (OpClass::Free, Space::Mapping) if e.ret == 0 => self.map(e.ptr, e.size, false),
            _ => {}
        }
    }

    /// Per device and pool.
    pub fn stats(&self) -> &BTreeMap<(i32, Pool), PoolStats> {
        &self.totals
    }

    /// The device's small and large default pools: the layout's totals, less the segments of
    /// private pools where it knows any (counted from their runs).
    pub fn default_pools(&self, device: i32) -> Vec<(Pool, PoolStats)> {
        let mut pools: Vec<(Pool, PoolStats)> = self
            .stats()
            .range((device, Pool::Small)..=(device, Pool::Large))
            .map(|(&(_, pool), s)| (pool, *s))
            .collect();
        if self.private.is_empty() {
            return pools;
        }
        let segments = self.segments();
        for (pool, stats) in &mut pools {
            let of_pool = segments
                .iter()
                .filter(|s| s.device == device && s.pool == Some(*pool));
            for r in of_pool
                .clone()
                .filter(|s| s.pool_id.is_some())
                .flat_map(|s| &s.runs)
            {
                match r.kind {
                    RunKind::Free => stats.free_blocks = stats.free_blocks.saturating_sub(1),
                    RunKind::Allocated | RunKind::Pending => {
                        stats.allocated = stats.allocated.saturating_sub(r.size)
                    }
                    RunKind::Unmapped => continue,
                }
                stats.reserved = stats.reserved.saturating_sub(r.size);
            }
            // The largest free block of the default segments only.
            stats.largest_free = of_pool
                .filter(|s| s.pool_id.is_none())
                .flat_map(|s| &s.runs)
                .filter(|r| r.kind == RunKind::Free)
                .map(|r| r.size)
                .max()
                .unwrap_or(0);
        }
        pools
    }

    /// The private pools (CUDA graphs', MemPools') where tracer knows a segment's pool.
    pub fn private_pools(&self) -> Vec<super::pools::PrivatePool> {
        if self.private.is_empty() {
            return Vec::new();
        }
        self.private_pools_in(&self.segments())
    }

    /// [`Layout::private_pools`] from segment maps already walked ([`Layout::segments`]).
    pub fn private_pools_in(&self, maps: &[SegmentMap]) -> Vec<super::pools::PrivatePool> {
        let mut pools = private_pools_of(maps);
        for p in &mut pools {
            p.captures = self.captures.pool(p.id);
        }
        pools
    }

    /// Memory held on no known device: a keyframe stored before devices were learned.
    pub fn has_unknown_device(&self) -> bool {
        self.totals
            .keys()
            .any(|(d, _)| *d == crate::model::NO_DEVICE)
            || self
                .outside
                .get(&crate::model::NO_DEVICE)
                .is_some_and(|&b| b > 0)
    }

    /// All pools of all devices together.
    pub fn total(&self) -> PoolStats {
        let mut t = PoolStats::default();
        for s in self.totals.values() {
            t.add(s);
        }
        t
    }

    /// One device's pools together.
    pub fn device_total(&self, device: i32) -> PoolStats {
        let mut t = PoolStats::default();
        for (_, s) in self.device_pools(device) {
            t.add(s);
        }
        t
    }

    /// The device's two default pools' totals, where it has them (two look-ups: cheaper than a
    /// range of the map, and this runs after every memory event).
    fn device_pools(&self, device: i32) -> impl Iterator<Item = (Pool, &PoolStats)> {
        [Pool::Small, Pool::Large]
            .into_iter()
            .filter_map(move |pool| Some((pool, self.totals.get(&(device, pool))?)))
    }

    /// The highest fragmentation among the device's pools that cache at least a small
    /// segment's worth (a request is served by one pool: their free blocks do not add up).
    pub fn worst_fragmentation(&self, device: i32) -> f64 {
        self.device_pools(device)
            .filter(|(pool, s)| s.cached() >= SMALL_SEGMENT && scatters(*pool, s))
            .map(|(_, s)| s.fragmentation())
            .fold(0.0, f64::max)
    }

    /// [`Layout::worst_fragmentation`] of the default pools alone: a private pool's free blocks
    /// serve only its own requests (counted from the segments where private pools are known,
    /// so for views, not for every event).
    pub fn default_fragmentation(&self, device: i32) -> f64 {
        if self.private.is_empty() {
            return self.worst_fragmentation(device);
        }
        self.default_pools(device)
            .iter()
            .filter(|(pool, s)| s.cached() >= SMALL_SEGMENT && scatters(*pool, s))
            .map(|(_, s)| s.fragmentation())
            .fold(0.0, f64::max)
    }

    /// Device memory allocated outside the allocator's segments, per device.
    pub fn outside(&self, device: i32) -> u64 {
        self.outside.get(&device).copied().unwrap_or(0)
    }

    /// The devices with memory outside the allocator's segments.
    pub fn outside_devices(&self) -> impl Iterator<Item = i32> + '_ {
        self.outside
            .iter()
            .filter(|(_, &bytes)| bytes > 0)
            .map(|(&d, _)| d)
    }

    /// The segments as maps of runs.
    pub fn segments(&self) -> Vec<SegmentMap> {
        self.segment_maps(false)
    }

    /// The segments as maps; `unused` adds the device allocations no block was seen in (their
    /// pool unknown: the allocator's only if every device allocation is, as in a snapshot).
    pub fn segment_maps(&self, unused: bool) -> Vec<SegmentMap> {
        self.segments
            .iter()
            .filter(|(_, s)| unused || s.pool.is_some())
            .map(|(&addr, s)| SegmentMap {
                addr,
                size: s.size,
                device: s.device,
                pool: s.pool,
                pool_id: self.private.of(addr),
                expandable: s.mapped.is_some(),
                runs: runs_of(addr, s, &self.pending.blocks),
            })
            .collect()
    }

    /// The runs of the segment starting at `addr` (whatever its pool), where the layout knows
    /// one.
    pub fn runs_of_segment(&self, addr: u64) -> Option<Vec<Run>> {
        let seg = self.segments.get(&addr)?;
        Some(runs_of(addr, seg, &self.pending.blocks))
    }

    /// The addresses of the blocks freed and kept for other streams' work.
    pub fn pending_blocks(&self) -> impl Iterator<Item = u64> + '_ {
        self.pending.blocks.keys().copied()
    }

    /// The stream a segment serves, when tracer saw the allocation that made it.
    pub fn segment_stream(&self, addr: u64) -> Option<u64> {
        self.pending.segment_streams.get(&addr).copied()
    }

    /// Blocks freed and kept for other streams' work (`record_stream`), on `device` (all:
    /// None): (blocks, bytes).
    pub fn pending(&self, device: Option<i32>) -> (u64, u64) {
        let mut out = (0, 0);
        for &ptr in self.pending.blocks.keys() {
            let Some(addr) = self.segment_at(ptr) else {
                continue;
            };
            let seg = &self.segments[&addr];
            if let Some(b) = seg.blocks.get(&ptr) {
                if device.is_none_or(|d| d == seg.device) {
                    out.0 += 1;
                    out.1 += b.size;
                }
            }
        }
        out
    }

    /// Expandable segments the allocator's blocks landed in, as (start, end) of the reserved
    /// range: PyTorch's own, not another library's use of the driver.
    pub fn expandable_segments(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        self.segments
            .iter()
            .filter(|(addr, s)| {
                s.mapped.is_some() && (!s.blocks.is_empty() || self.expandable_used.contains(addr))
            })
            .map(|(&addr, s)| (addr, addr + s.size))
    }

    /// Whether the allocator's blocks are seen now (not disarmed).
    /// Whether the block at `addr` was freed and waits for other streams' work (PyTorch's
    /// active_pending_free).
    pub fn is_pending(&self, addr: u64) -> bool {
        self.pending.blocks.contains_key(&addr)
    }

    /// The address of the segment holding `addr`, where the layout knows one.
    pub fn segment_of(&self, addr: u64) -> Option<u64> {
        let (&start, seg) = self.segments.range(..=addr).next_back()?;
        (addr < start + seg.size).then_some(start)
    }

    /// The trace had a gap from `from_ns` to `to_ns` (tracer restarted): what the state holds
    /// is carried over it, believed until an allocation overlaps it or it is freed.
    pub fn mark_gap(&mut self, from_ns: Option<i64>, to_ns: i64) {
        self.for_each_block(|b| b.carried = true);
        self.unknown.gaps += 1;
        self.evidence(to_ns);
        if let Some(from) = from_ns {
            self.unknown.since_ns = Some(self.unknown.since_ns.map_or(from, |s| s.min(from)));
        }
    }

    /// Renames the blocks' call sites (a recording's own ids to the stored ones; a site with no
    /// stored id is dropped).
    pub fn map_stacks(&mut self, f: impl Fn(u32) -> Option<u32>) {
        self.for_each_block(|b| b.stack = b.stack.and_then(&f));
    }

    /// Blocks held now, in known segments and unseen ones.
    pub fn blocks_held(&self) -> u64 {
        self.segments
            .values()
            .map(|s| s.blocks.len() as u64)
            .sum::<u64>()
            + self.orphans.len() as u64
    }

    /// Blocks carried over a gap and not seen since: (blocks, bytes).
    pub fn carried(&self) -> (u64, u64) {
        let mut out = (0, 0);
        for b in self.segments.values().flat_map(|s| s.blocks.values()) {
            if b.carried {
                out.0 += 1;
                out.1 += b.size;
            }
        }
        out
    }

    /// The devices of blocks seen in segments tracer never saw made.
    pub fn orphan_devices(&self) -> impl Iterator<Item = i32> + '_ {
        self.orphans.values().map(|o| o.device)
    }

    /// Blocks held in segments tracer never saw, on `device` (all devices: None): (blocks,
    /// bytes).
    pub fn orphans(&self, device: Option<i32>) -> (u64, u64) {
        let mut out = (0, 0);
        for o in self.orphans.values() {
            if device.is_none_or(|d| d == o.device) {
                out.0 += 1;
                out.1 += o.size;
            }
        }
        out
    }

    /// Blocks made without PyTorch's probes: new segments made while a free block that fit
    /// was believed free.
    pub fn held_unseen(&self) -> u64 {
        self.pending.held_unseen
    }
}

#[cfg(test)]
pub(crate) mod tests;

#[cfg(test)]
pub(crate) mod pending_tests;

#[cfg(test)]
mod held_unseen_tests;
