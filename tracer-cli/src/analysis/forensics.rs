//! The allocator's layout when an allocation failed, as the OOM's arithmetic reads it: the
//! pools then, the private pools' free bytes apart, what a flush would return, and whether a
//! capture was underway (PyTorch flushes nothing then).

use serde::Serialize;
use tracer_common::Space;

use crate::model::{
    layout::{Layout, Pool, PoolStats, RunKind, SegmentMap},
    pressure::DeviceFree,
    Event,
};

/// The layout when an allocation failed.
#[derive(Clone, Debug, Serialize)]
pub struct Forensics {
    pub ts_ns: i64,
    pub tid: u32,
    /// The allocator's retry of a failed attempt (after releasing its cache).
    pub retry: bool,
    /// No retry followed: the allocator raised out-of-memory (model/attempts.rs).
    pub raised: bool,
    /// When cudaMemGetInfo last said what [`Forensics::device_free`] was kept current from.
    pub device_free_reported_ns: Option<i64>,
    /// A refused page of an expandable segment: the pages the same request had made before it
    /// (held at the failure, given back as it fails).
    pub pages_unmapped: u64,
    pub device: i32,
    /// What the failed call asked the device for.
    pub requested: u64,
    pub total: PoolStats,
    pub outside: u64,
    /// Bytes of segments whose contents tracer did not see (`--allocator auto` armed after
    /// they were made): not in `total` nor `pools`.
    pub unseen: u64,
    /// The device's free memory (cudaMemGetInfo, kept current), when known.
    pub device_free: Option<u64>,
    /// The device's default pools at the failure (a private pool's segments left out: the
    /// request may not use their free blocks).
    pub pools: Vec<(Pool, PoolStats)>,
    /// Free bytes inside private pools (CUDA graphs', MemPools'): PyTorch's message counts them
    /// "allocated in private pools".
    pub private_free: u64,
    /// Of those, the bytes in private-pool segments holding no live block.
    pub private_idle: u64,
    /// A CUDA graph capture, or another routing to a private pool (`use_mem_pool`), was underway
    /// in the process: PyTorch runs no cache flush then.
    pub capture_underway: bool,
    /// MemPools marked use_on_oom were in use: PyTorch looked in their free blocks for the
    /// request, as a last resort, before it raised.
    pub use_on_oom: bool,
    /// Of `private_free`, the bytes inside MemPools (not CUDA graphs' pools), and the largest
    /// free block of a MemPool not marked use_on_oom (what marking it would have offered).
    pub mem_pool_free: u64,
    pub mem_pool_largest: u64,
    /// Bytes of the default pools' segments holding no live block: what a flush returns.
    pub default_idle: u64,
    /// The failed call asked for a whole segment (cudaMalloc), whose size bounds the request;
    /// not a chunk of an expandable segment (cuMemCreate), which says nothing of it.
    pub whole_segment: bool,
}

pub(super) fn forensics(e: &Event, layout: &Layout, free: Option<&DeviceFree>) -> Forensics {
    let total = layout.device_total(e.device);
    // Walked once for the private pools and both kinds of idle segments (an OOM-time cost).
    let maps = layout.segments();
    let private: Vec<_> = layout
        .private_pools_in(&maps)
        .into_iter()
        .filter(|p| p.device == e.device)
        .collect();
    let mem_pools = || {
        private
            .iter()
            .filter(|p| p.captures.is_some_and(|c| c.mem_pool()))
    };
    Forensics {
        ts_ns: e.ts_ns,
        tid: e.tid,
        retry: false,
        raised: false,
        device_free_reported_ns: free.map(|d| d.reported_ns),
        pages_unmapped: 0,
        device: e.device,
        requested: e.size,
        total,
        outside: layout.outside(e.device),
        unseen: layout.unseen_contents(Some(e.device)).1,
        device_free: free.map(|d| d.free.max(0) as u64),
        pools: layout.default_pools(e.device),
        private_free: private.iter().map(|p| p.free).sum(),
        mem_pool_free: mem_pools().map(|p| p.free).sum(),
        mem_pool_largest: mem_pools()
            .filter(|p| !p.captures.is_some_and(|c| c.use_on_oom))
            .map(|p| p.largest_free)
            .max()
            .unwrap_or(0),
        capture_underway: layout.captures.underway(),
        use_on_oom: !layout.captures.use_on_oom().is_empty(),
        default_idle: idle_bytes(&maps, e.device, false),
        private_idle: idle_bytes(&maps, e.device, true),
        whole_segment: e.op.spec().space == Space::Device,
    }
}

/// Bytes of the device's segments (of private pools, or of the default pools) holding no live
/// block: what a cache flush returns (a private pool's only once no graph holds it).
fn idle_bytes(maps: &[SegmentMap], device: i32, private: bool) -> u64 {
    maps.iter()
        .filter(|s| s.device == device && s.pool_id.is_some() == private)
        .filter(|s| {
            s.runs
                .iter()
                .all(|r| !matches!(r.kind, RunKind::Allocated | RunKind::Pending))
        })
        .flat_map(|s| &s.runs)
        .filter(|r| r.kind == RunKind::Free)
        .map(|r| r.size)
        .sum()
}
