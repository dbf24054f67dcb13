//! The caching allocator's layout, rebuilt from what was traced: segments from the device
//! allocations (cudaMalloc/cudaFree, or the reserved ranges and mapped chunks of expandable
//! segments), blocks from PyTorch's own probes (pytorch:malloc/free) placed inside them with the
//! allocator's rounding and split rules. From it, per device and pool, the figures PyTorch
//! itself would report: allocated, reserved, the free blocks and the largest one.
//!
//! Feed events in the order they happened ([`Layout::apply`]); read [`Layout::stats`] at any
//! moment, or [`Layout::segments`] for the map.
//!
//! Over 700 lines because the layout's rules and their unit tests (about 400 lines) are kept beside
//! the code they pin.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use tracer_common::{Op, OpClass, Space};

use super::Event;

use super::policy::{serves, should_split};
pub use super::policy::{
    AllocConf, Pool, LARGE_SEGMENT, MIN_BLOCK, MIN_LARGE_ALLOC, ROUND_LARGE, SMALL_SEGMENT,
    SMALL_SIZE,
};

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

    fn add(&mut self, other: &PoolStats) {
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
struct Block {
    size: u64,
    requested: u64,
    stack: Option<u32>,
    ts_ns: i64,
    /// The block events seen before it (its age is counted in them).
    event: u64,
    /// Allocated before a gap in the trace and not seen since: believed still held.
    carried: bool,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
struct Segment {
    size: u64,
    device: i32,
    /// Expandable segments: the mapped ranges (start -> end); None for cudaMalloc'ed ones.
    mapped: Option<BTreeMap<u64, u64>>,
    /// Its pool, once known (a block or a mapping said).
    pool: Option<Pool>,
    blocks: BTreeMap<u64, Block>,
}

impl Segment {
    /// Its free gaps' sizes, as counted in its pool's multiset (once it has a pool).
    fn counted_gaps(&self, addr: u64) -> Vec<u64> {
        if self.pool.is_some() {
            free_gaps(addr, self)
        } else {
            Vec::new()
        }
    }

    /// The free span around [from, to) an unmapped segment's blocks leave (the blocks from
    /// `from` up to `to` not counted): from the end of the block before to the start of the one
    /// after. None where the blocks overlap it (the exact recount is needed).
    fn span_around(&self, addr: u64, from: u64, to: u64) -> Option<(u64, u64)> {
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
    pub pool_id: Option<super::pools::PoolId>,
    pub expandable: bool,
    pub runs: Vec<Run>,
}

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

/// Whether a process's block events are seen (`--allocator auto` arms PyTorch's probes only
/// while memory is tight).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum BlockSight {
    /// From the process's first call (`--allocator always`, and every session before the mode).
    #[default]
    Always,
    /// Armed at this time (wall ns): segments made before hold blocks tracer never saw.
    ArmedAt(i64),
    /// Not armed since this time (wall ns): what was known of the blocks is dropped.
    DisarmedAt(i64),
    /// Being armed since this time: the semaphores are being raised, so a segment made now
    /// may hold blocks made before they were up. New segments are of unknown contents until
    /// the armed mark (made once they are up); block events are taken.
    ArmingSince(i64),
}

/// A segment whose contents tracer did not see: made before the allocator's probes were
/// armed, or while they were not. Its free bytes are unknown until it is released; blocks
/// seen in it since are kept only so that their frees are recognised.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct UnseenSegment {
    pub size: u64,
    pub device: i32,
    /// Blocks seen allocated in it since arming (address -> requested bytes).
    blocks: BTreeMap<u64, u64>,
}

/// What the layout knows of the allocator's blocks (see [`BlockSight`]).
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct Sight {
    pub state: BlockSight,
    /// By address.
    unseen: BTreeMap<u64, UnseenSegment>,
    /// Frees of blocks allocated before arming: expected, not evidence of a gap.
    pub frees_before_arming: u64,
}

impl Sight {
    /// Segments made at `ts` have contents tracer does not see.
    fn hides(&self, ts: i64) -> bool {
        match self.state {
            BlockSight::Always => false,
            BlockSight::ArmedAt(at) => ts < at,
            BlockSight::DisarmedAt(_) | BlockSight::ArmingSince(_) => true,
        }
    }

    /// The unseen segment holding `ptr`, by its start address.
    fn segment_at(&self, ptr: u64) -> Option<u64> {
        let (&addr, seg) = self.unseen.range(..=ptr).next_back()?;
        (ptr < addr + seg.size).then_some(addr)
    }
}

/// A pytorch:malloc whose aux1 holds the size its block was split to: an imported snapshot's
/// block from before its trace (the probe itself sets no aux1). Its final size is known where
/// its split, decided before the trace, is not.
pub const SPLIT_SIZE_IN_AUX1: &str = "aux1 of an imported pytorch:malloc";

/// The size a block takes: its rounded request, or the size an imported block was split to.
fn split_size(e: &Event, rounded: u64) -> u64 {
    if e.op == tracer_common::Op::TorchMalloc && e.aux1 > rounded {
        e.aux1
    } else {
        rounded
    }
}

/// Blocks the program freed that the allocator keeps until other streams' work is done.
///
/// PyTorch's `pytorch:free` fires before its allocator looks at the block. A block used on
/// other streams (`Tensor.record_stream`) is not returned to its pool then: the allocator
/// records a CUDA event on each of those streams (cudaEventRecord, called from its own library,
/// right after the free on the same thread) and returns the block when the last one is found
/// complete (cudaEventQuery or cudaEventSynchronize succeeding). Such a block is not allocated
/// (PyTorch's allocated bytes dropped at the free) and not free either.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct PendingFrees {
    /// Block address -> its events not yet seen complete.
    blocks: BTreeMap<u64, u32>,
    /// Event handle -> the block it was recorded for.
    events: BTreeMap<u64, u64>,
    /// Per thread, the block it freed last (while events recorded next may be that free's).
    freeing: BTreeMap<u32, Freed>,
    /// Each cudaMalloc'ed segment's stream (a segment serves one), from its first block.
    segment_streams: BTreeMap<u64, u64>,
    /// New segments made while a free block of the same pool and stream that fit the request
    /// was believed free: the allocator did not have it, something held it unseen (blocks
    /// handed out without the probes: `torch.cuda.caching_allocator_alloc`, `raw_alloc`).
    pub held_unseen: u64,
}

/// A block a thread freed last: where, when, and what it was.
#[derive(Clone, Debug, Serialize, Deserialize)]
struct Freed {
    ptr: u64,
    ts_ns: i64,
    block: Block,
}

/// The longest a free's own event records follow it (they are made inside the same call, a
/// few microseconds later; the allocator's later records are for blocks freed during a CUDA
/// graph capture, long before).
pub(crate) const FREE_RECORDS_WITHIN_NS: i64 = 10_000_000;

/// `aux1` of a cudaEventRecord called from the library that holds PyTorch's allocator probes
/// (the recording tells so from the call's return address).
pub const EVENT_FROM_ALLOCATOR: u64 = 1;

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
        let mut pools = private_pools_of(&self.segments());
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
        for (_, s) in self
            .totals
            .range((device, Pool::Small)..=(device, Pool::Large))
        {
            t.add(s);
        }
        t
    }

    /// The highest fragmentation among the device's pools that cache at least a small
    /// segment's worth (a request is served by one pool: their free blocks do not add up).
    pub fn worst_fragmentation(&self, device: i32) -> f64 {
        self.totals
            .range((device, Pool::Small)..=(device, Pool::Large))
            .filter(|((_, pool), s)| s.cached() >= SMALL_SEGMENT && scatters(*pool, s))
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

    /// The segment holding `ptr`, by its start address.
    fn segment_at(&self, ptr: u64) -> Option<u64> {
        let (&addr, seg) = self.segments.range(..=ptr).next_back()?;
        (ptr < addr + seg.size).then_some(addr)
    }

    fn segment_alloc(
        &mut self,
        addr: u64,
        size: u64,
        device: i32,
        mapped: Option<BTreeMap<u64, u64>>,
        ts: i64,
    ) {
        if self.segments.contains_key(&addr) {
            // A driver allocation nested in the runtime's, for the same segment.
            return;
        }
        self.forget_stale(addr, size, ts);
        if self.sight.hides(ts) {
            self.sight.unseen.insert(
                addr,
                UnseenSegment {
                    size,
                    device,
                    blocks: BTreeMap::new(),
                },
            );
            return;
        }
        let expandable = mapped.is_some();
        self.segments.insert(
            addr,
            Segment {
                size,
                device,
                mapped,
                pool: None,
                blocks: BTreeMap::new(),
            },
        );
        if !expandable {
            // Outside the allocator until a block lands in it.
            *self.outside.entry(device).or_default() += size;
        }
    }

    fn segment_free(&mut self, addr: u64) {
        if self.sight.unseen.remove(&addr).is_some() {
            return;
        }
        let Some(seg) = self.segments.remove(&addr) else {
            return;
        };
        self.pending.segment_streams.remove(&addr);
        if !seg.blocks.is_empty() {
            self.unexplained.segments_freed_with_blocks += 1;
        }
        match seg.pool {
            Some(pool) => {
                let key = (seg.device, pool);
                self.count_gaps(key, &seg.counted_gaps(addr), false);
                let held: u64 = seg
                    .blocks
                    .iter()
                    .filter(|(b, _)| !self.pending.blocks.contains_key(b))
                    .map(|(_, b)| b.size)
                    .sum();
                for b in seg.blocks.keys() {
                    self.forget_pending(*b);
                }
                let t = self.totals.entry(key).or_default();
                t.reserved = t.reserved.saturating_sub(reserved_of(&seg));
                t.allocated = t.allocated.saturating_sub(held);
                self.refresh_largest(key);
            }
            None if seg.mapped.is_none() => {
                let o = self.outside.entry(seg.device).or_default();
                *o = o.saturating_sub(seg.size);
            }
            None => {}
        }
    }

    /// A chunk mapped into (or unmapped from) an expandable segment.
    fn map(&mut self, ptr: u64, size: u64, mapped: bool) {
        let Some(addr) = self.segment_at(ptr) else {
            return;
        };
        let Some(seg) = self.segments.get_mut(&addr) else {
            return;
        };
        let before = seg.counted_gaps(addr);
        let Some(ranges) = seg.mapped.as_mut() else {
            return;
        };
        if mapped {
            insert_range(ranges, ptr, ptr + size);
            if seg.pool.is_none() {
                seg.pool = Some(if size <= SMALL_SEGMENT {
                    Pool::Small
                } else {
                    Pool::Large
                });
            }
        } else {
            remove_range(ranges, ptr, ptr + size);
        }
        if let Some(pool) = seg.pool {
            let key = (seg.device, pool);
            let delta = size as i64 * if mapped { 1 } else { -1 };
            let t = self.totals.entry(key).or_default();
            t.reserved = (t.reserved as i64 + delta).max(0) as u64;
            self.regap(addr, &before);
        }
    }

    fn block_alloc(&mut self, e: &Event) {
        self.blocks_seen += 1;
        self.block_events += 1;
        let Some(addr) = self.segment_at(e.ptr) else {
            match self.sight.segment_at(e.ptr) {
                Some(unseen) => {
                    if let Some(seg) = self.sight.unseen.get_mut(&unseen) {
                        seg.blocks.insert(e.ptr, e.size);
                    }
                }
                None => self.orphan_alloc(e),
            }
            return;
        };
        self.heal_overlap(addr, e);
        let conf = self.conf;
        let Some(seg) = self.segments.get_mut(&addr) else {
            return;
        };
        let rounded = split_size(e, conf.round_size(e.size));
        if seg.mapped.is_some() {
            self.expandable_used.insert(addr);
        }
        let fresh = seg.pool.is_none() && seg.mapped.is_none();
        if seg.pool.is_none() {
            // cudaMalloc'ed: 2 MiB segments serve the small pool; expandable: the first
            // mapping said, else the request's size does.
            let small = match seg.mapped {
                None => seg.size == SMALL_SEGMENT,
                Some(_) => rounded <= SMALL_SIZE,
            };
            seg.pool = Some(if small { Pool::Small } else { Pool::Large });
            if seg.mapped.is_none() {
                let o = self.outside.entry(seg.device).or_default();
                *o = o.saturating_sub(seg.size);
            }
            if seg.device < 0 && e.device >= 0 {
                // Allocated by a thread whose cudaSetDevice tracer did not see: PyTorch's
                // probe names the device.
                seg.device = e.device;
            }
            let key = (seg.device, seg.pool.unwrap_or(Pool::Large));
            self.totals.entry(key).or_default().reserved += reserved_of(seg);
            self.regap(addr, &[]);
        }
        let first_block = self
            .segments
            .get(&addr)
            .is_some_and(|s| s.blocks.is_empty());
        if first_block && self.private.of(addr).is_none() {
            // A segment serves one pool for life: a capture routes its first block.
            if let Some(id) = self.captures.route(e.aux0) {
                self.private.routed(addr, id);
            }
        }
        if fresh {
            self.new_segment_for(addr, e, rounded);
        }
        let Some(seg) = self.segments.get_mut(&addr) else {
            return;
        };
        let key = (seg.device, seg.pool.unwrap_or(Pool::Large));
        let gap_end = free_end(addr, seg, e.ptr);
        let Some(gap_end) = gap_end else {
            self.unexplained.overlapping_blocks += 1;
            return;
        };
        let remaining = gap_end.saturating_sub(e.ptr).saturating_sub(rounded);
        let split = should_split(key.1, seg.mapped.is_some(), conf, rounded, remaining);
        let size = if split {
            rounded
        } else {
            gap_end.saturating_sub(e.ptr).max(rounded)
        };
        let block = Block {
            size,
            requested: e.size,
            stack: e.stack.map(|s| s.get()),
            ts_ns: e.ts_ns,
            event: self.block_events,
            carried: false,
        };
        self.insert_block(addr, key, e.ptr, block);
        self.settle(e.ts_ns);
        self.totals.entry(key).or_default().allocated += size;
    }

    /// Puts a block into free space of segment `addr`, counting its pool's free gaps.
    fn insert_block(&mut self, addr: u64, key: (i32, Pool), ptr: u64, block: Block) {
        let Some(seg) = self.segments.get_mut(&addr) else {
            return;
        };
        let size = block.size;
        let span = seg.span_around(addr, ptr, ptr.saturating_add(size));
        let before = if span.is_some() {
            Vec::new()
        } else {
            seg.counted_gaps(addr)
        };
        seg.blocks.insert(ptr, block);
        match span {
            // The span it landed in is cut in two (either may be empty).
            Some((lo, hi)) => {
                let end = ptr + size;
                let after: Vec<u64> = [ptr - lo, hi - end]
                    .into_iter()
                    .filter(|&g| g > 0)
                    .collect();
                self.swap_gaps(key, &[hi - lo], &after);
            }
            None => self.regap(addr, &before),
        }
    }

    /// A block where no known segment lies: its segment was created unseen.
    fn orphan_alloc(&mut self, e: &Event) {
        self.unexplained.blocks_outside_segments += 1;
        self.unknown.unseen_segments = true;
        let size = self.conf.round_size(e.size);
        if let Some(old) = self.orphans.insert(
            e.ptr,
            Orphan {
                size,
                requested: e.size,
                device: e.device,
            },
        ) {
            self.unknown.freed_unseen += 1;
            self.unknown.freed_unseen_bytes += old.size;
        }
        self.evidence(e.ts_ns);
    }

    /// Blocks the new allocation at `e.ptr` overlaps were freed while tracer did not see:
    /// they go, counted.
    fn heal_overlap(&mut self, addr: u64, e: &Event) {
        let rounded = self.conf.round_size(e.size);
        let Some(seg) = self.segments.get_mut(&addr) else {
            return;
        };
        let end = e.ptr.saturating_add(rounded);
        let mut stale: Vec<u64> = seg.blocks.range(e.ptr..end).map(|(&b, _)| b).collect();
        if let Some((&b, block)) = seg.blocks.range(..e.ptr).next_back() {
            if b + block.size > e.ptr {
                stale.push(b);
            }
        }
        if stale.is_empty() {
            return;
        }
        let before = seg.counted_gaps(addr);
        let key = (seg.device, seg.pool.unwrap_or(Pool::Large));
        let mut bytes = 0;
        let mut allocated = 0;
        for b in &stale {
            if let Some(block) = seg.blocks.remove(b) {
                bytes += block.size;
                if !self.pending.blocks.contains_key(b) {
                    allocated += block.size;
                }
            }
        }
        for b in &stale {
            self.forget_pending(*b);
        }
        self.unexplained.overlapping_blocks += 1;
        self.unknown.freed_unseen += stale.len() as u64;
        self.unknown.freed_unseen_bytes += bytes;
        let t = self.totals.entry(key).or_default();
        t.allocated = t.allocated.saturating_sub(allocated);
        self.regap(addr, &before);
        self.evidence(e.ts_ns);
    }

    /// A new segment at [addr, addr + size): what tracer believed there (blocks of unseen
    /// segments, a segment whose free it missed) was released unseen.
    fn forget_stale(&mut self, addr: u64, size: u64, ts: i64) {
        let end = addr.saturating_add(size);
        // Unseen segments there were released before arming, or while not armed.
        let mut gone: Vec<u64> = self
            .sight
            .unseen
            .range(addr..end)
            .map(|(&a, _)| a)
            .collect();
        gone.extend(self.sight.segment_at(addr));
        for a in gone {
            self.sight.unseen.remove(&a);
        }
        let orphans: Vec<u64> = self.orphans.range(addr..end).map(|(&a, _)| a).collect();
        for a in orphans {
            if let Some(o) = self.orphans.remove(&a) {
                self.unknown.freed_unseen += 1;
                self.unknown.freed_unseen_bytes += o.size;
            }
        }
        let mut stale: Vec<u64> = self.segments.range(addr..end).map(|(&a, _)| a).collect();
        if let Some((&a, seg)) = self.segments.range(..addr).next_back() {
            if a + seg.size > addr {
                stale.push(a);
            }
        }
        if stale.is_empty() {
            return;
        }
        self.evidence(ts);
        for a in stale {
            self.segment_free(a);
        }
    }

    /// Evidence that the layout differs from the allocator's, at `ts`.
    fn evidence(&mut self, ts: i64) {
        if self.unknown.exact() {
            self.unknown.since_ns = Some(ts);
            self.unknown.longest_life_events = 0;
        }
        self.unknown.exact_ns = None;
        self.unknown.last_evidence_ns = self.unknown.last_evidence_ns.max(ts);
        self.unknown.last_evidence_event = self.block_events;
    }

    /// After a call that did not contradict the layout: exact again once nothing has for long
    /// enough (see [`Unknown`]).
    fn settle(&mut self, ts: i64) {
        let u = &mut self.unknown;
        if u.exact() || u.unseen_segments {
            return;
        }
        let quiet = (2 * u.longest_life_events).max(QUIET_EVENTS);
        if self.block_events - u.last_evidence_event >= quiet {
            u.exact_ns = Some(ts);
        }
    }

    /// PyTorch's allocator probes were armed in this process at `ts`: block events are seen
    /// from then on; segments made before hold blocks tracer never saw.
    pub fn arm(&mut self, ts: i64) {
        // Armed already, or seen from the first call: nothing was missed.
        if let BlockSight::DisarmedAt(_) | BlockSight::ArmingSince(_) = self.sight.state {
            self.sight.state = BlockSight::ArmedAt(ts);
        }
    }

    /// tracer began raising the probes' semaphores at `ts` (the armed mark follows once they
    /// are up): block events are taken from now, but a segment made before that mark may hold
    /// blocks made before the semaphores were up, so its contents stay unknown.
    pub fn arming(&mut self, ts: i64) {
        if let BlockSight::DisarmedAt(_) = self.sight.state {
            self.sight.state = BlockSight::ArmingSince(ts);
        }
    }

    /// The probes were disarmed at `ts`: what was known of the blocks is dropped, and every
    /// segment's contents become unknown until it is released.
    pub fn disarm(&mut self, ts: i64) {
        if !matches!(self.sight.state, BlockSight::DisarmedAt(_)) {
            self.drop_blocks();
            self.sight.state = BlockSight::DisarmedAt(ts);
        }
    }

    /// Moves every segment to the unseen ones and forgets every block.
    fn drop_blocks(&mut self) {
        for (addr, seg) in std::mem::take(&mut self.segments) {
            let unseen = UnseenSegment {
                size: seg.size,
                device: seg.device,
                blocks: BTreeMap::new(),
            };
            self.sight.unseen.insert(addr, unseen);
        }
        for seg in self.sight.unseen.values_mut() {
            seg.blocks.clear();
        }
        self.gaps.clear();
        self.totals.clear();
        self.outside.clear();
        self.orphans.clear();
        self.pending = PendingFrees {
            held_unseen: self.pending.held_unseen,
            ..PendingFrees::default()
        };
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

    /// Whether the segment at `addr` holds blocks tracer did not see (made before the
    /// allocator's probes were armed).
    pub fn contents_unseen(&self, addr: u64) -> bool {
        self.sight.unseen.contains_key(&addr)
    }

    /// The segments whose contents tracer did not see: (address, size).
    pub fn unseen_segments(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        self.sight.unseen.iter().map(|(&a, s)| (a, s.size))
    }

    pub fn blocks_known(&self) -> bool {
        matches!(
            self.sight.state,
            BlockSight::Always | BlockSight::ArmedAt(_)
        )
    }

    /// Whether block events are seen now, and since when.
    pub fn block_sight(&self) -> BlockSight {
        self.sight.state
    }

    /// Segments whose contents tracer did not see, on `device` (all: None): (segments,
    /// bytes). Their free bytes and largest free block are unknown: the pools' figures count
    /// only the segments seen whole.
    pub fn unseen_contents(&self, device: Option<i32>) -> (u64, u64) {
        let mut out = (0, 0);
        for seg in self.sight.unseen.values() {
            if device.is_none_or(|d| d == seg.device) {
                out.0 += 1;
                out.1 += seg.size;
            }
        }
        out
    }

    /// The devices with segments of unseen contents.
    pub fn unseen_devices(&self) -> impl Iterator<Item = i32> + '_ {
        self.sight.unseen.values().map(|s| s.device)
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

    fn for_each_block(&mut self, mut f: impl FnMut(&mut Block)) {
        for seg in self.segments.values_mut() {
            for b in seg.blocks.values_mut() {
                f(b);
            }
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

    fn block_free(&mut self, e: &Event) {
        self.block_events += 1;
        if self.forget_pending(e.ptr) {
            // Freed again while believed kept for other streams: their events completed unseen.
            self.remove_block(e.ptr);
            self.unexplained.unmatched_frees += 1;
            self.evidence(e.ts_ns);
            return;
        }
        let Some((key, block)) = self.remove_block(e.ptr) else {
            if let Some(unseen) = self.sight.segment_at(e.ptr) {
                let seen = self
                    .sight
                    .unseen
                    .get_mut(&unseen)
                    .and_then(|seg| seg.blocks.remove(&e.ptr));
                if seen.is_none() {
                    self.sight.frees_before_arming += 1;
                }
            } else if self.orphans.remove(&e.ptr).is_none() {
                self.unexplained.unmatched_frees += 1;
                self.evidence(e.ts_ns);
            }
            return;
        };
        let t = self.totals.entry(key).or_default();
        t.allocated = t.allocated.saturating_sub(block.size);
        if !block.carried && !self.unknown.exact() {
            let life = self.block_events - block.event;
            self.unknown.longest_life_events = self.unknown.longest_life_events.max(life);
        }
        self.settle(e.ts_ns);
        self.pending.freeing.insert(
            e.tid,
            Freed {
                ptr: e.ptr,
                ts_ns: e.ts_ns,
                block,
            },
        );
    }

    /// Takes the block at `ptr` out of its segment, its space counted free again: its pool and
    /// the block, or None where no known segment holds a block there.
    fn remove_block(&mut self, ptr: u64) -> Option<((i32, Pool), Block)> {
        let addr = self.segment_at(ptr)?;
        let seg = self.segments.get_mut(&addr)?;
        let size = seg.blocks.get(&ptr)?.size;
        let span = seg.span_around(addr, ptr, ptr.saturating_add(size));
        let before = if span.is_some() {
            Vec::new()
        } else {
            seg.counted_gaps(addr)
        };
        let block = seg.blocks.remove(&ptr)?;
        let key = (seg.device, seg.pool.unwrap_or(Pool::Large));
        match span {
            // The spans on either side of it (either may be empty) become one.
            Some((lo, hi)) => {
                let end = ptr + block.size;
                let old: Vec<u64> = [ptr - lo, hi - end]
                    .into_iter()
                    .filter(|&g| g > 0)
                    .collect();
                self.swap_gaps(key, &old, &[hi - lo]);
            }
            None => self.regap(addr, &before),
        }
        Some((key, block))
    }

    /// The allocator recorded an event for the block its thread just freed: the block is kept
    /// out of its pool until the event completes.
    fn event_recorded(&mut self, e: &Event) {
        if self.pending.events.contains_key(&e.ptr) {
            // The pool hands an event out again only once it completed: its completion was
            // not seen.
            self.event_complete(e.ptr);
        }
        let Some(freed) = self.pending.freeing.get(&e.tid) else {
            return;
        };
        if e.ts_ns.saturating_sub(freed.ts_ns) > FREE_RECORDS_WITHIN_NS {
            return;
        }
        let ptr = freed.ptr;
        if let Some(n) = self.pending.blocks.get_mut(&ptr) {
            *n += 1;
        } else {
            let Some(addr) = self.segment_at(ptr) else {
                return;
            };
            let seg = &self.segments[&addr];
            let fits = free_end(addr, seg, ptr).is_some_and(|end| end >= ptr + freed.block.size);
            if !fits {
                // Its space was handed out since: not this block's event.
                return;
            }
            let key = (seg.device, seg.pool.unwrap_or(Pool::Large));
            let block = freed.block.clone();
            self.insert_block(addr, key, ptr, block);
            self.pending.blocks.insert(ptr, 1);
        }
        self.pending.events.insert(e.ptr, ptr);
    }

    /// An event found complete: the block it was recorded for returns to its pool with its
    /// last one.
    fn event_complete(&mut self, event: u64) {
        let Some(ptr) = self.pending.events.remove(&event) else {
            return;
        };
        let Some(n) = self.pending.blocks.get_mut(&ptr) else {
            return;
        };
        *n = n.saturating_sub(1);
        if *n == 0 {
            self.pending.blocks.remove(&ptr);
            self.remove_block(ptr);
        }
    }

    /// The allocator made segment `addr` for a request of `rounded` bytes on `e`'s stream. It
    /// does so only when no free block of that pool and stream fits; one believed free that
    /// would have is held by something tracer did not see.
    fn new_segment_for(&mut self, addr: u64, e: &Event, rounded: u64) {
        let stream = e.aux0;
        let Some(seg) = self.segments.get(&addr) else {
            return;
        };
        let key = (seg.device, seg.pool.unwrap_or(Pool::Large));
        let conf = self.conf;
        // PyTorch's get_free_block: an oversize block serves only requests near its size.
        let serves = |gap: u64| serves(key.1, conf, rounded, gap);
        let private = self.private.of(addr);
        let unseen = self.segments.iter().any(|(&a, s)| {
            a != addr
                && s.mapped.is_none()
                && (s.device, s.pool) == (key.0, Some(key.1))
                && self.private.of(a) == private
                && self.pending.segment_streams.get(&a) == Some(&stream)
                && free_gaps(a, s).into_iter().any(serves)
        });
        self.pending.segment_streams.insert(addr, stream);
        if unseen {
            self.pending.held_unseen += 1;
            self.evidence(e.ts_ns);
        }
    }

    /// Blocks made without PyTorch's probes: new segments made while a free block that fit
    /// was believed free.
    pub fn held_unseen(&self) -> u64 {
        self.pending.held_unseen
    }

    /// Forgets that the block at `ptr` waits for events; whether it did.
    fn forget_pending(&mut self, ptr: u64) -> bool {
        if self.pending.blocks.remove(&ptr).is_none() {
            return false;
        }
        self.pending.events.retain(|_, b| *b != ptr);
        true
    }

    /// Recounts a segment's free gaps into its pool's multiset, where they were `before`.
    fn regap(&mut self, addr: u64, before: &[u64]) {
        let Some(seg) = self.segments.get(&addr) else {
            return;
        };
        let Some(pool) = seg.pool else {
            return;
        };
        let key = (seg.device, pool);
        let new = free_gaps(addr, seg);
        self.swap_gaps(key, before, &new);
    }

    /// Takes the pool's free gaps `old` out of its multiset and counts `new` in.
    fn swap_gaps(&mut self, key: (i32, Pool), old: &[u64], new: &[u64]) {
        self.tally_gaps(key, old, false);
        self.tally_gaps(key, new, true);
        self.refresh_largest(key);
    }

    fn count_gaps(&mut self, key: (i32, Pool), gaps: &[u64], add: bool) {
        self.tally_gaps(key, gaps, add);
        self.refresh_largest(key);
    }

    /// Counts `gaps` into (or out of) the pool's multiset and free-block count.
    fn tally_gaps(&mut self, key: (i32, Pool), gaps: &[u64], add: bool) {
        let set = self.gaps.entry(key).or_default();
        let mut counted = 0u64;
        for &g in gaps {
            if add {
                *set.entry(g).or_default() += 1;
                counted += 1;
            } else if let Some(n) = set.get_mut(&g) {
                *n -= 1;
                counted += 1;
                if *n == 0 {
                    set.remove(&g);
                }
            }
        }
        let t = self.totals.entry(key).or_default();
        t.free_blocks = if add {
            t.free_blocks + counted
        } else {
            t.free_blocks.saturating_sub(counted)
        };
    }

    fn refresh_largest(&mut self, key: (i32, Pool)) {
        let largest = self
            .gaps
            .get(&key)
            .and_then(|s| s.keys().next_back().copied())
            .unwrap_or(0);
        self.totals.entry(key).or_default().largest_free = largest;
    }
}

/// The sizes of a segment's free runs in address order ([`runs_of`]'s free runs, without
/// building the runs: this is done at every block event).
fn free_gaps(addr: u64, seg: &Segment) -> Vec<u64> {
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
fn is_segment_op(op: Op) -> bool {
    matches!(
        op,
        Op::CudaMalloc | Op::CuMemAlloc | Op::CudaFree | Op::CuMemFree
    )
}

fn reserved_of(seg: &Segment) -> u64 {
    match &seg.mapped {
        Some(ranges) => ranges.iter().map(|(s, e)| e - s).sum(),
        None => seg.size,
    }
}

/// Where the free run starting at `ptr` ends: the next block, the segment's end, or the end of
/// the mapped range holding it. None when `ptr` is inside a block or not mapped.
fn free_end(addr: u64, seg: &Segment, ptr: u64) -> Option<u64> {
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
fn private_pools_of(maps: &[SegmentMap]) -> Vec<super::pools::PrivatePool> {
    let mut pools: BTreeMap<(i32, super::pools::PoolId), super::pools::PrivatePool> =
        BTreeMap::new();
    for m in maps {
        let Some(id) = m.pool_id else { continue };
        let p = pools
            .entry((m.device, id))
            .or_insert(super::pools::PrivatePool {
                id,
                device: m.device,
                ..super::pools::PrivatePool::default()
            });
        p.segments += 1;
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
fn runs_of(addr: u64, seg: &Segment, pending: &BTreeMap<u64, u32>) -> Vec<Run> {
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

fn run(addr: u64, size: u64, kind: RunKind) -> Run {
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
fn insert_range(ranges: &mut BTreeMap<u64, u64>, mut s: u64, mut e: u64) {
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
fn remove_range(ranges: &mut BTreeMap<u64, u64>, s: u64, e: u64) {
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
    pool != Pool::Small || s.largest_free < super::policy::SMALL_SIZE
}

#[cfg(test)]
pub(crate) mod tests {
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
            (s.fragmentation()
                - (1.0 - (SMALL_SEGMENT - 5120) as f64 / (SMALL_SEGMENT - 4096) as f64))
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
}

#[cfg(test)]
pub(crate) mod pending_tests {
    use super::*;

    const SEG: u64 = 0x7f00_0000_0000;
    pub(crate) const EVENT: u64 = 0x5555_0000;

    pub(crate) fn ev(op: Op, ptr: u64, size: u64, ts_ns: i64) -> Event {
        Event {
            ts_ns,
            ..super::tests::ev(op, ptr, size)
        }
    }

    pub(crate) fn record(ts_ns: i64, from_allocator: bool) -> Event {
        Event {
            aux1: from_allocator as u64,
            ..ev(Op::CudaEventRecord, EVENT, 0, ts_ns)
        }
    }

    /// A 20 MiB segment with two 4 MiB blocks; the first freed at t=1000.
    pub(crate) fn freed_first() -> Layout {
        let mut l = Layout::default();
        l.apply(&ev(Op::CudaMalloc, SEG, LARGE_SEGMENT, 0));
        l.apply(&ev(Op::TorchMalloc, SEG, 4 << 20, 10));
        l.apply(&ev(Op::TorchMalloc, SEG + (4 << 20), 4 << 20, 20));
        l.apply(&ev(Op::TorchFree, SEG, 0, 1000));
        l
    }

    #[test]
    fn a_block_whose_free_recorded_events_is_kept_until_the_last_completes() {
        let mut l = freed_first();
        assert_eq!(l.total().free_blocks, 2);
        l.apply(&record(1500, true));
        l.apply(&Event {
            ptr: EVENT + 1,
            ..record(1600, true)
        });
        // Kept: not allocated (PyTorch's figure dropped at the free), not free either.
        assert_eq!(l.pending(None), (1, 4 << 20));
        assert_eq!(l.total().allocated, 4 << 20);
        assert_eq!(l.total().free_blocks, 1);
        let runs = &l.segments()[0].runs;
        assert_eq!(runs[0].kind, RunKind::Pending);
        // Not ready yet: nothing changes.
        l.apply(&Event {
            ret: 600,
            ..ev(Op::CudaEventQuery, EVENT, 0, 2000)
        });
        l.apply(&ev(Op::CudaEventQuery, EVENT, 0, 3000));
        assert_eq!(l.pending(None), (1, 4 << 20));
        l.apply(&ev(Op::CudaEventSynchronize, EVENT + 1, 0, 4000));
        assert_eq!(l.pending(None), (0, 0));
        assert_eq!(l.total().free_blocks, 2);
        assert_eq!(l.total().allocated, 4 << 20);
        assert!(l.unknown.exact());
    }

    #[test]
    fn events_the_program_records_or_recorded_long_after_a_free_keep_nothing() {
        let mut l = freed_first();
        l.apply(&record(1500, false));
        assert_eq!(l.pending(None), (0, 0));
        l.apply(&record(1000 + FREE_RECORDS_WITHIN_NS + 1, true));
        assert_eq!(l.pending(None), (0, 0));
        assert_eq!(l.total().free_blocks, 2);
    }
}

#[cfg(test)]
mod held_unseen_tests {
    use super::*;

    const SEG: u64 = 0x7f00_0000_0000;

    fn ev(op: Op, ptr: u64, size: u64, stream: u64) -> Event {
        Event {
            ts_ns: 1,
            aux0: stream,
            ..super::tests::ev(op, ptr, size)
        }
    }

    /// A 4 MiB block in a 20 MiB segment; then a new segment for an 8 MiB request on `stream`.
    fn second_segment_for(stream: u64) -> Layout {
        let mut l = Layout::default();
        l.apply(&ev(Op::CudaMalloc, SEG, LARGE_SEGMENT, 0));
        l.apply(&ev(Op::TorchMalloc, SEG, 4 << 20, 7));
        l.apply(&ev(Op::CudaMalloc, SEG + (1 << 30), LARGE_SEGMENT, 0));
        l.apply(&ev(Op::TorchMalloc, SEG + (1 << 30), 8 << 20, stream));
        l
    }

    #[test]
    fn a_new_segment_while_a_fitting_block_looked_free_means_blocks_held_unseen() {
        let l = second_segment_for(7);
        assert_eq!(l.held_unseen(), 1);
        assert!(!l.unknown.exact());
    }

    #[test]
    fn a_new_segment_for_another_stream_is_the_allocators_rule() {
        let l = second_segment_for(8);
        assert_eq!(l.held_unseen(), 0);
        assert!(l.unknown.exact());
    }
}
