//! What the allocator's own layout says (PyTorch's probes seen): fragmentation measured from
//! its blocks, the early warning before an out-of-memory, and the layout at each failure.
//! One replay of the process's calls through [`Layout`].

use std::collections::BTreeMap;

use serde::Serialize;
use tracer_common::{OpClass, Space};

pub use super::forensics::Forensics;
use super::{forensics::forensics, Event, FastMap, SiteLabels, Window};
use crate::{
    model::{
        attempts::{self, is_device_alloc, Attempt, Attempts, OUT_OF_MEMORY},
        layout::{scatters, AllocConf, Layout, Pool, PoolStats, RunKind, Unknown, SMALL_SEGMENT},
        policy::requests_for_segment,
        pressure::{pool_of, Alarm, Pressure},
        state::ProcessState,
    },
    units::format_bytes as b,
};

/// Samples of the figures over the window, for the fragmentation chain's timeline.
const SAMPLES: i64 = 8;

/// What an out-of-memory was, from the evidence.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum OomVerdict {
    /// The pool's free bytes could have served the request: no block fit.
    Fragmentation,
    /// The request was larger than everything the pool had free.
    Capacity,
    /// The evidence does not tell: why, and what would settle it.
    Unknown(String),
}

impl Forensics {
    fn pool(&self, pool: Pool) -> PoolStats {
        self.pools
            .iter()
            .find(|(p, _)| *p == pool)
            .map_or_else(PoolStats::default, |(_, s)| *s)
    }

    /// Fragmentation only when the free bytes of the pool the request goes to could have
    /// served it. The request is PyTorch's (`tried`, from its message); without it, a failed
    /// cudaMalloc's segment bounds it ([`requests_for_segment`]): fragmentation when the pool
    /// held the most it can be, capacity when it held less than the least, or when all its free
    /// bytes were one block (which did not fit).
    pub fn verdict(&self, tried: Option<u64>) -> OomVerdict {
        match self.verdict_from_seen(tried) {
            // Segments tracer did not see whole may hold the free bytes that would make it
            // fragmentation.
            OomVerdict::Capacity if self.unseen > 0 => OomVerdict::Unknown(format!(
                "{} of the device's segments were made before PyTorch's allocator probes were armed (--allocator auto): their free bytes are unknown; PyTorch's message says how much was reserved but unallocated, and `--allocator always` (or arming before they were made) shows where",
                b(self.unseen)
            )),
            verdict => verdict,
        }
    }

    /// The verdict from the segments tracer saw whole.
    fn verdict_from_seen(&self, tried: Option<u64>) -> OomVerdict {
        if let Some(request) = tried {
            let pool = self.pool(pool_of(request));
            return if pool.cached() >= request {
                OomVerdict::Fragmentation
            } else {
                OomVerdict::Capacity
            };
        }
        let (lowest, highest) = requests_for_segment(self.requested);
        let small = self.whole_segment && self.requested <= SMALL_SEGMENT;
        let pool = self.pool(if small { Pool::Small } else { Pool::Large });
        if self.whole_segment && pool.cached() >= highest {
            OomVerdict::Fragmentation
        } else if (self.whole_segment && pool.cached() < lowest)
            || pool.cached() <= pool.largest_free
        {
            OomVerdict::Capacity
        } else {
            OomVerdict::Unknown(format!(
                "the request itself is not known ({} asked the device for {}); the pool held {} free, largest block {}: PyTorch's out-of-memory message (its probe, libc10.so traced) names the request",
                if self.whole_segment { "cudaMalloc" } else { "the expandable segment" },
                b(self.requested),
                b(pool.cached()),
                b(pool.largest_free)
            ))
        }
    }

    /// The request, as far as the failed call tells it without PyTorch's message: a whole
    /// segment bounds it (rounded up to 2 MiB above 10 MiB), a page of an expandable segment
    /// does not.
    pub fn request_bounds(&self) -> Option<(u64, u64)> {
        self.whole_segment
            .then(|| requests_for_segment(self.requested))
    }
}

/// The state in which the next request of the sizes being made fails.
#[derive(Clone, Debug, Serialize)]
pub struct Warning {
    #[serde(flatten)]
    pub alarm: Alarm,
    /// Call sites of the blocks that pin the pool's partly free segments, most bytes first.
    pub pinning: Vec<(String, u64, u64)>,
}

/// New segments requested while the pool's cache held enough bytes, but no block that fit.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Forced {
    pub count: u64,
    pub bytes: u64,
    pub first_ns: Option<i64>,
    /// Where the pool's free bytes lay at those moments, summed.
    pub kinds: FragKinds,
}

impl Forced {
    fn add(&mut self, ts_ns: i64, bytes: u64, kinds: FragKinds) {
        self.count += 1;
        self.bytes += bytes;
        self.first_ns.get_or_insert(ts_ns);
        self.kinds.split += kinds.split;
        self.kinds.spread += kinds.spread;
        self.kinds.other_stream += kinds.other_stream;
        self.kinds.pending += kinds.pending;
    }
}

/// Where the free bytes of a pool lay when a request found no block that fit, summed over
/// those moments: each kind of fragmentation has its own fix.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct FragKinds {
    /// Free blocks in segments that also hold live blocks: remainders of split blocks, pinned
    /// by their neighbours (fix: max_split_size_mb, so large blocks are not cut).
    pub split: u64,
    /// Wholly free segments, each too small: free space spread over segments that cannot merge
    /// (fix: expandable segments, one segment that grows).
    pub spread: u64,
    /// Free blocks in segments of another stream, which serve only it (fix: allocate on the
    /// stream that uses the tensor).
    pub other_stream: u64,
    /// Blocks freed but held for another stream's work (record_stream) until its events
    /// complete.
    pub pending: u64,
}

impl FragKinds {
    /// The kinds with their bytes, the largest first.
    pub fn ranked(&self) -> Vec<(FragKind, u64)> {
        let mut v = vec![
            (FragKind::Split, self.split),
            (FragKind::Spread, self.spread),
            (FragKind::OtherStream, self.other_stream),
            (FragKind::Pending, self.pending),
        ];
        v.retain(|(_, b)| *b > 0);
        v.sort_by_key(|(_, b)| std::cmp::Reverse(*b));
        v
    }
}

/// One kind of fragmentation ([`FragKinds`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FragKind {
    Split,
    Spread,
    OtherStream,
    Pending,
}

/// The free bytes of `device`'s `pool` by kind, for a request on `stream`, leaving out the
/// segment at `new_segment` (just made for the request), and the largest free block the
/// request could have taken (one of its stream's).
fn frag_kinds(
    layout: &Layout,
    device: i32,
    pool: Pool,
    stream: u64,
    new_segment: u64,
) -> (FragKinds, u64, u64) {
    let mut k = FragKinds::default();
    let (mut usable, mut pool_free) = (0, 0);
    // A private pool's free blocks serve only its own requests, and the default pools' never
    // serve a private pool's.
    let private = layout
        .segment_of(new_segment)
        .and_then(|addr| layout.private.of(addr));
    for s in layout.segment_maps(false) {
        if s.device != device
            || s.pool != Some(pool)
            || s.pool_id != private
            || new_segment.wrapping_sub(s.addr) < s.size
        {
            continue;
        }
        let live = s
            .runs
            .iter()
            .any(|r| matches!(r.kind, RunKind::Allocated | RunKind::Pending));
        let same_stream = layout.segment_stream(s.addr).is_none_or(|st| st == stream);
        for r in &s.runs {
            match r.kind {
                RunKind::Pending => k.pending += r.size,
                RunKind::Free if !same_stream => k.other_stream += r.size,
                RunKind::Free if live => k.split += r.size,
                RunKind::Free => k.spread += r.size,
                _ => {}
            }
            if r.kind == RunKind::Free && same_stream {
                usable = usable.max(r.size);
            }
            if r.kind == RunKind::Free {
                pool_free += r.size;
            }
        }
    }
    (k, usable, pool_free)
}

/// Everything the replay found for one process.
#[derive(Clone, Debug, Default)]
pub struct Findings {
    /// PyTorch's probes were seen: the figures are the allocator's own.
    pub visible: bool,
    pub end: BTreeMap<(i32, Pool), PoolStats>,
    /// The worst moment: the highest fragmentation with at least a segment's worth cached, in
    /// a pool whose free blocks are scattered for its requests ([`scatters`]).
    pub worst: Option<(i64, i32, Pool, PoolStats)>,
    /// The same, per device and pool.
    pub worst_by_pool: BTreeMap<(i32, Pool), (i64, PoolStats)>,
    pub samples: Vec<(i64, PoolStats)>,
    pub forced: Forced,
    /// [`Findings::forced`] per device and pool (the pool of the request no block fit).
    pub forced_by_pool: BTreeMap<(i32, Pool), Forced>,
    pub warning: Option<Warning>,
    pub forensics: Vec<Forensics>,
    pub block_events: u64,
    /// Blocks allocated in the window and still held at its end, by call site: (label,
    /// blocks, bytes), most bytes first.
    pub live_in_window: Vec<(String, u64, u64)>,
    /// Block allocations in the window, and block frees.
    pub allocs_in_window: u64,
    pub frees_in_window: u64,
    /// Per device: the most the process held, and its failures, in the window.
    pub devices: BTreeMap<i32, DevicePeak>,
    /// What tracer did not see of the allocator, at the window's end.
    pub unknown: Unknown,
    /// Blocks held in segments tracer never saw, and blocks carried over a gap not seen since:
    /// (blocks, bytes).
    pub orphans: (u64, u64),
    pub carried: (u64, u64),
    /// New segments made while a free block that fit was believed free: blocks handed out
    /// without the probes (raw_alloc) hold memory the layout shows free.
    pub held_unseen: u64,
    /// PyTorch's expandable segments: the reserved ranges (start, end) its blocks landed in.
    pub expandable: Vec<(u64, u64)>,
    /// The window's failures, retries and OOMs raised, as PyTorch counts them.
    pub attempts: attempts::Counts,
    /// Requests served right after their failed attempt (a use_on_oom pool's block): seen only
    /// with PyTorch's block events, which the scanning rules do not read.
    pub rescued: Vec<Attempt>,
    /// A serving engine's start-up, where the process captured CUDA graphs.
    pub startup: Option<super::startup::Ledger>,
}

/// What one process did on one device in the window, for comparing ranks and devices.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct DevicePeak {
    /// The most device memory held at once: the allocator's segments and what was allocated
    /// outside them.
    pub held: u64,
    /// The most the allocator reserved and handed out (blocks view).
    pub reserved: u64,
    pub allocated: u64,
    /// The highest fragmentation (1 - largest free block / cached) with at least a small
    /// segment's worth cached (blocks view).
    pub fragmentation: f64,
    /// New segments reserved while the pool's cache held the bytes but no block that fit.
    pub forced_segments: u64,
    pub forced_bytes: u64,
    /// Failed device allocations, and the first one.
    pub failures: u64,
    pub first_failure_ns: Option<i64>,
    /// Failures, retries and the OOMs raised, as PyTorch counts them.
    pub counts: attempts::Counts,
}

impl DevicePeak {
    fn update(&mut self, layout: &Layout, device: i32) {
        let t = layout.device_total(device);
        self.held = self.held.max(t.reserved + layout.outside(device));
        self.reserved = self.reserved.max(t.reserved);
        self.allocated = self.allocated.max(t.allocated);
        self.fragmentation = self.fragmentation.max(layout.worst_fragmentation(device));
    }
}

/// A segment just reserved (when, how large), and the pools' figures before it.
type NewSegment = (i64, u64, BTreeMap<(i32, Pool), PoolStats>);

/// Measures the allocator's layout over the process's calls up to the window's end.
pub fn measure(all: &[Event], window: Window, conf: AllocConf, sites: &SiteLabels) -> Findings {
    let mut r = LayoutMeasure::new(None, window, conf, sites);
    for e in all {
        r.feed(e);
    }
    r.finish()
}

/// [`measure`] a call at a time: the process's calls in time order, from its first or from a
/// keyframe's state.
pub struct LayoutMeasure<'a> {
    sites: &'a SiteLabels,
    layout: Layout,
    pressure: Pressure,
    window: Window,
    conf: AllocConf,
    f: Findings,
    /// A segment just reserved, and the pool's figures before it: settled at the next block.
    pending: Option<NewSegment>,
    next_sample: i64,
    /// Device allocations as PyTorch counts them (model/attempts.rs).
    tracker: Attempts,
    /// The attempts in the window.
    attempts: Vec<Attempt>,
    /// The layout at each out-of-memory return, until it is known to be an attempt's.
    candidates: Vec<Forensics>,
    /// Per thread: physical pages made (cuMemCreate) since its last mapping, which an
    /// expandable segment's request maps once it has them all and gives back when one fails.
    unmapped: FastMap<u32, u64>,
    /// A serving engine's start-up, phase by phase (where the process captured graphs).
    startup: super::startup::StartupWatch,
    budget: Option<super::startup::Budget>,
}

impl<'a> LayoutMeasure<'a> {
    /// From `start` (a keyframe's state of the process), else from nothing.
    pub fn new(
        start: Option<&ProcessState>,
        window: Window,
        conf: AllocConf,
        sites: &'a SiteLabels,
    ) -> LayoutMeasure<'a> {
        let (layout, pressure) = match start {
            Some(s) => (s.layout.clone(), s.pressure.clone()),
            None => (Layout::new(conf), Pressure::default()),
        };
        let conf = layout.conf();
        let f = Findings {
            visible: layout.blocks_seen > 0,
            ..Findings::default()
        };
        LayoutMeasure {
            sites,
            layout,
            pressure,
            window,
            conf,
            f,
            pending: None,
            next_sample: 0,
            tracker: Attempts::default(),
            attempts: Vec::new(),
            candidates: Vec::new(),
            unmapped: FastMap::default(),
            startup: Default::default(),
            budget: None,
        }
    }

    /// The engine's memory budget its command line gives, for the start-up ledger.
    pub fn with_budget(mut self, budget: Option<super::startup::Budget>) -> Self {
        self.budget = budget;
        self
    }

    fn sample_at(&self, i: i64) -> i64 {
        // In i128: a crafted window may span the whole i64 range.
        let (from, to) = (self.window.from_ns as i128, self.window.to_ns as i128);
        (from + (to - from) * i as i128 / SAMPLES as i128) as i64
    }

    pub fn feed(&mut self, e: &Event) {
        let window = self.window;
        while self.next_sample <= SAMPLES && e.ts_ns > self.sample_at(self.next_sample) {
            let at = self.sample_at(self.next_sample);
            // Not while the allocator's probes were disarmed: its figures were not seen then.
            if self.layout.blocks_known() {
                self.f.samples.push((at, self.layout.total()));
            }
            self.next_sample += 1;
        }
        let spec = e.op.spec();
        let class = spec.class;
        let (layout, f) = (&mut self.layout, &mut self.f);
        self.pressure.observe(e);
        let new_segment = class == OpClass::Alloc
            && e.ret == 0
            && e.size > 0
            && matches!(spec.space, Space::Device | Space::Handle);
        if new_segment {
            self.pending = Some((e.ts_ns, e.size, layout.stats().clone()));
        }
        if matches!(spec.space, Space::Handle | Space::Mapping) && e.ret == 0 {
            let unmapped = self.unmapped.entry(e.tid).or_default();
            match (class, spec.space) {
                (OpClass::Alloc, Space::Handle) => *unmapped += e.size,
                (OpClass::Free, Space::Handle) => *unmapped = unmapped.saturating_sub(e.size),
                (OpClass::Alloc, Space::Mapping) => *unmapped = 0,
                _ => {}
            }
        }
        if e.ret == OUT_OF_MEMORY && is_device_alloc(e.op) && window.contains(e.ts_ns) {
            // Taken before the layout applies the call; kept if it is an attempt of its own.
            let mut x = forensics(e, layout, self.pressure.device_free(e.device));
            if spec.space == Space::Handle {
                x.pages_unmapped = self.unmapped.get(&e.tid).copied().unwrap_or(0);
            }
            self.candidates.push(x);
        }
        let (attempts, candidates) = (&mut self.attempts, &mut self.candidates);
        self.tracker.push(e, &mut |a| {
            settle(a, window, candidates, attempts, f);
        });
        if class == OpClass::Free && spec.space == Space::AddressRange {
            // The range goes: remember it if it was the allocator's.
            f.expandable
                .extend(layout.expandable_segments().filter(|r| r.0 == e.ptr));
        }
        layout.apply(e);
        self.startup.feed(e, layout, &self.pressure);
        let holding = matches!(
            class,
            OpClass::Alloc | OpClass::Free | OpClass::BlockAlloc | OpClass::BlockFree
        );
        if holding && e.device().is_some() && window.contains(e.ts_ns) {
            f.devices
                .entry(e.device)
                .or_default()
                .update(layout, e.device);
        }
        if class == OpClass::BlockFree && window.contains(e.ts_ns) {
            f.frees_in_window += 1;
        }
        if class != OpClass::BlockAlloc {
            return;
        }
        f.block_events += 1;
        f.visible = true;
        if window.contains(e.ts_ns) {
            f.allocs_in_window += 1;
        }
        let rounded = self.conf.round_size(e.size);
        let key = (e.device, pool_of(rounded));
        if let Some((ts, size, before)) = self.pending.take() {
            let s = before.get(&key).copied().unwrap_or_default();
            // The cache held the bytes and no block of the request's stream fit: the new
            // segment is fragmentation's cost (kinds: where the free bytes lay).
            let forced = (s.cached() >= rounded && window.contains(ts))
                .then(|| frag_kinds(layout, e.device, key.1, e.aux0, e.ptr))
                .filter(|(_, usable, pool_free)| {
                    // Where private pools are known, only the request's own pool's bytes count.
                    *usable < rounded && (layout.private.is_empty() || *pool_free >= rounded)
                });
            if let Some((kinds, _, _)) = forced {
                f.forced.add(ts, size, kinds);
                f.forced_by_pool
                    .entry(key)
                    .or_default()
                    .add(ts, size, kinds);
                let peak = f.devices.entry(e.device).or_default();
                peak.forced_segments += 1;
                peak.forced_bytes += size;
            }
        }
        let alarm = self.pressure.after_block(e, self.conf, layout);
        let s = layout.stats().get(&key).copied().unwrap_or_default();
        if window.contains(e.ts_ns) && s.cached() >= SMALL_SEGMENT && scatters(key.1, &s) {
            if f.worst
                .as_ref()
                .is_none_or(|w| s.fragmentation() > w.3.fragmentation())
            {
                f.worst = Some((e.ts_ns, e.device, key.1, s));
            }
            let worst = f.worst_by_pool.entry(key).or_insert((e.ts_ns, s));
            if s.fragmentation() > worst.1.fragmentation() {
                *worst = (e.ts_ns, s);
            }
        }
        if let Some(alarm) = alarm.filter(|_| f.warning.is_none() && window.contains(e.ts_ns)) {
            f.warning = Some(Warning {
                pinning: pinning(layout, alarm.device, alarm.pool, self.sites),
                alarm,
            });
        }
    }

    /// Goes on from `state` (the keyframe after calls --max-db deleted): the layout and the
    /// early warning's state are the keyframe's, the findings so far stay.
    pub fn resume(&mut self, state: &ProcessState) {
        self.layout = state.layout.clone();
        self.pressure = state.pressure.clone();
        self.pending = None;
    }

    /// The findings at the window's end.
    pub fn finish(mut self) -> Findings {
        let (window, attempts, candidates, f) = (
            self.window,
            &mut self.attempts,
            &mut self.candidates,
            &mut self.f,
        );
        self.tracker
            .finish(&mut |a| settle(a, window, candidates, attempts, f));
        attempts.sort_by_key(|a| a.event.ts_ns);
        let raised = attempts::raised(attempts);
        for x in &mut f.forensics {
            x.raised = raised
                .iter()
                .any(|a| a.event.ts_ns == x.ts_ns && a.event.tid == x.tid);
        }
        for (&device, peak) in f.devices.iter_mut() {
            let on: Vec<Attempt> = attempts
                .iter()
                .filter(|a| a.event.device == device)
                .copied()
                .collect();
            peak.counts = attempts::counts(&on);
        }
        f.attempts = attempts::counts(attempts);
        f.rescued = attempts.iter().filter(|a| a.rescued).copied().collect();
        while self.next_sample <= SAMPLES {
            let at = self.sample_at(self.next_sample);
            // Not while the allocator's probes were disarmed: its figures were not seen then.
            if self.layout.blocks_known() {
                self.f.samples.push((at, self.layout.total()));
            }
            self.next_sample += 1;
        }
        let mut f = self.f;
        f.startup = self.startup.finish(self.budget);
        // Counted since the process's first block, through the keyframe the replay began at.
        f.block_events = self.layout.blocks_seen;
        f.end = self.layout.stats().clone();
        f.live_in_window = held_by_site(&self.layout, self.window, self.sites);
        f.unknown = self.layout.unknown;
        f.orphans = self.layout.orphans(None);
        f.carried = self.layout.carried();
        f.held_unseen = self.layout.held_unseen();
        f.expandable.extend(self.layout.expandable_segments());
        f.expandable.sort_unstable();
        f.expandable.dedup();
        f
    }

    /// The layout now.
    pub fn layout(&self) -> &Layout {
        &self.layout
    }
}

/// A decided attempt in the window: counted on its device, and a failed one's layout kept.
fn settle(
    a: Attempt,
    window: Window,
    candidates: &mut Vec<Forensics>,
    attempts: &mut Vec<Attempt>,
    f: &mut Findings,
) {
    let e = &a.event;
    if !a.notable() || !window.contains(e.ts_ns) {
        return;
    }
    attempts.push(a);
    if !a.failed {
        return;
    }
    let peak = f.devices.entry(e.device).or_default();
    peak.failures += 1;
    peak.first_failure_ns.get_or_insert(e.ts_ns);
    if let Some(i) = candidates
        .iter()
        .position(|x| x.ts_ns == e.ts_ns && x.tid == e.tid)
    {
        let mut x = candidates.swap_remove(i);
        x.retry = a.retry;
        f.forensics.push(x);
        f.forensics.sort_by_key(|x| x.ts_ns);
    }
    // Candidates older than this one were nested calls: never attempts of their own.
    candidates.retain(|x| x.ts_ns > e.ts_ns || x.tid != e.tid);
}

/// The blocks allocated in the window and still held, by call site.
fn held_by_site(layout: &Layout, window: Window, sites: &SiteLabels) -> Vec<(String, u64, u64)> {
    let mut by_site: BTreeMap<String, (u64, u64)> = BTreeMap::new();
    for seg in layout.segments() {
        for r in seg.runs.iter().filter(|r| r.kind == RunKind::Allocated) {
            if !r.since_ns.is_some_and(|ts| window.contains(ts)) {
                continue;
            }
            let label = site_label(r.stack, sites);
            let entry = by_site.entry(label).or_default();
            entry.0 += 1;
            entry.1 += r.size;
        }
    }
    let mut out: Vec<(String, u64, u64)> =
        by_site.into_iter().map(|(s, (n, b))| (s, n, b)).collect();
    out.sort_by_key(|(_, _, bytes)| std::cmp::Reverse(*bytes));
    out.truncate(5);
    out
}

/// The call sites of the allocated blocks in the pool's segments that have free space.
fn pinning(
    layout: &Layout,
    device: i32,
    pool: Pool,
    sites: &SiteLabels,
) -> Vec<(String, u64, u64)> {
    let mut by_site: BTreeMap<String, (u64, u64)> = BTreeMap::new();
    for seg in layout.segments() {
        if seg.device != device || seg.pool != Some(pool) {
            continue;
        }
        if !seg.runs.iter().any(|r| r.kind == RunKind::Free) {
            continue;
        }
        for r in seg.runs.iter().filter(|r| r.kind == RunKind::Allocated) {
            let label = site_label(r.stack, sites);
            let entry = by_site.entry(label).or_default();
            entry.0 += 1;
            entry.1 += r.size;
        }
    }
    let mut out: Vec<(String, u64, u64)> = by_site
        .into_iter()
        .map(|(s, (n, bytes))| (s, n, bytes))
        .collect();
    out.sort_by_key(|(_, _, bytes)| std::cmp::Reverse(*bytes));
    out.truncate(5);
    out
}

/// The call site a block was handed out from, or how to learn it.
fn site_label(stack: Option<u32>, sites: &SiteLabels) -> String {
    stack
        .and_then(crate::model::StackId::new)
        .and_then(|id| sites.get(&id).cloned())
        .unwrap_or_else(|| "(no call site: trace with --stack)".into())
}
