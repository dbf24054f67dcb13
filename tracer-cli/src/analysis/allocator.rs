//! What the allocator's own layout says (PyTorch's probes seen): fragmentation measured from
//! its blocks, the early warning before an out-of-memory, and the layout at each failure.
//! One replay of the process's calls through [`Layout`].

use std::collections::BTreeMap;

use serde::Serialize;
use tracer_common::{OpClass, Space};

use super::{
    rules::{Chain, Severity, TimelineEntry},
    Event, SiteLabels, Window,
};
use crate::{
    model::{
        layout::{AllocConf, Layout, Pool, PoolStats, RunKind, Unknown, SMALL_SEGMENT},
        pressure::{pool_of, Alarm, DeviceFree, Pressure},
        state::ProcessState,
    },
    units::{format_bytes as b, format_ns as t},
};

/// Samples of the figures over the window, for the fragmentation chain's timeline.
const SAMPLES: i64 = 8;

/// The layout when an allocation failed.
#[derive(Clone, Debug, Serialize)]
pub struct Forensics {
    pub ts_ns: i64,
    pub device: i32,
    /// What the failed call asked the device for.
    pub requested: u64,
    pub total: PoolStats,
    pub outside: u64,
    /// The device's free memory (cudaMemGetInfo, kept current), when known.
    pub device_free: Option<u64>,
    /// The device's pools at the failure.
    pub pools: Vec<(Pool, PoolStats)>,
    /// The failed call asked for a whole segment (cudaMalloc), whose size bounds the request;
    /// not a chunk of an expandable segment (cuMemCreate), which says nothing of it.
    pub whole_segment: bool,
}

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
    /// cudaMalloc bounds it from above and the largest free block from below (it did not fit).
    pub fn verdict(&self, tried: Option<u64>) -> OomVerdict {
        if let Some(request) = tried {
            let pool = self.pool(pool_of(request));
            return if pool.cached() >= request {
                OomVerdict::Fragmentation
            } else {
                OomVerdict::Capacity
            };
        }
        let small = self.whole_segment && self.requested <= SMALL_SEGMENT;
        let pool = self.pool(if small { Pool::Small } else { Pool::Large });
        if self.whole_segment && pool.cached() >= self.requested {
            OomVerdict::Fragmentation
        } else if pool.cached() <= pool.largest_free {
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
}

/// Everything the replay found for one process.
#[derive(Clone, Debug, Default)]
pub struct Findings {
    /// PyTorch's probes were seen: the figures are the allocator's own.
    pub visible: bool,
    pub end: BTreeMap<(i32, Pool), PoolStats>,
    /// The worst moment: the highest fragmentation with at least a segment's worth cached.
    pub worst: Option<(i64, i32, Pool, PoolStats)>,
    pub samples: Vec<(i64, PoolStats)>,
    pub forced: Forced,
    pub warning: Option<Warning>,
    pub forensics: Vec<Forensics>,
    pub block_events: u64,
    /// Blocks allocated in the window and still held at its end, by call site: (label,
    /// blocks, bytes), most bytes first.
    pub live_in_window: Vec<(String, u64, u64)>,
    /// Block allocations in the window.
    pub allocs_in_window: u64,
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

/// Replays the process's calls up to the window's end.
pub fn replay(all: &[Event], window: Window, conf: AllocConf, sites: &SiteLabels) -> Findings {
    let mut r = Replay::new(None, window, conf, sites);
    for e in all {
        r.feed(e);
    }
    r.finish()
}

/// [`replay`] a call at a time: the process's calls in time order, from its first or from a
/// keyframe's state.
pub struct Replay<'a> {
    sites: &'a SiteLabels,
    layout: Layout,
    pressure: Pressure,
    window: Window,
    conf: AllocConf,
    f: Findings,
    /// A segment just reserved, and the pool's figures before it: settled at the next block.
    pending: Option<NewSegment>,
    next_sample: i64,
}

impl<'a> Replay<'a> {
    /// From `start` (a keyframe's state of the process), else from nothing.
    pub fn new(
        start: Option<&ProcessState>,
        window: Window,
        conf: AllocConf,
        sites: &'a SiteLabels,
    ) -> Replay<'a> {
        let (layout, pressure) = match start {
            Some(s) => (s.layout.clone(), s.pressure.clone()),
            None => (Layout::new(conf), Pressure::default()),
        };
        let conf = layout.conf();
        let f = Findings {
            visible: layout.blocks_seen > 0,
            ..Findings::default()
        };
        Replay {
            sites,
            layout,
            pressure,
            window,
            conf,
            f,
            pending: None,
            next_sample: 0,
        }
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
            self.f.samples.push((at, self.layout.total()));
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
        let failed = class == OpClass::Alloc
            && e.ret != 0
            && matches!(spec.space, Space::Device | Space::Handle)
            && window.contains(e.ts_ns);
        if failed {
            f.forensics
                .push(forensics(e, layout, self.pressure.device_free(e.device)));
            let peak = f.devices.entry(e.device).or_default();
            peak.failures += 1;
            peak.first_failure_ns.get_or_insert(e.ts_ns);
        }
        if class == OpClass::Free && spec.space == Space::AddressRange {
            // The range goes: remember it if it was the allocator's.
            f.expandable
                .extend(layout.expandable_segments().filter(|r| r.0 == e.ptr));
        }
        layout.apply(e);
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
            if s.cached() >= rounded && s.largest_free < rounded && window.contains(ts) {
                f.forced.count += 1;
                f.forced.bytes += size;
                f.forced.first_ns.get_or_insert(ts);
                let peak = f.devices.entry(e.device).or_default();
                peak.forced_segments += 1;
                peak.forced_bytes += size;
            }
        }
        let alarm = self.pressure.after_block(e, self.conf, layout);
        let s = layout.stats().get(&key).copied().unwrap_or_default();
        if window.contains(e.ts_ns)
            && s.cached() >= SMALL_SEGMENT
            && f.worst
                .as_ref()
                .is_none_or(|w| s.fragmentation() > w.3.fragmentation())
        {
            f.worst = Some((e.ts_ns, e.device, key.1, s));
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
        while self.next_sample <= SAMPLES {
            let at = self.sample_at(self.next_sample);
            self.f.samples.push((at, self.layout.total()));
            self.next_sample += 1;
        }
        let mut f = self.f;
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

/// The blocks allocated in the window and still held, by call site.
fn held_by_site(layout: &Layout, window: Window, sites: &SiteLabels) -> Vec<(String, u64, u64)> {
    let mut by_site: BTreeMap<String, (u64, u64)> = BTreeMap::new();
    for seg in layout.segments() {
        for r in seg.runs.iter().filter(|r| r.kind == RunKind::Allocated) {
            if !r.since_ns.is_some_and(|ts| window.contains(ts)) {
                continue;
            }
            let label = r
                .stack
                .and_then(crate::model::StackId::new)
                .and_then(|id| sites.get(&id).cloned())
                .unwrap_or_else(|| "(no call site: trace with --stack)".into());
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

/// A leak measured in tensors: the bytes the allocator hands out (not its cache) growing
/// steadily, still growing in the second half of the window.
pub fn leak_chain(pid: u32, f: &Findings, window: Window) -> Option<Chain> {
    if !f.unknown.exact() {
        return None;
    }
    let held: Vec<(i64, u64)> = f.samples.iter().map(|(ts, s)| (*ts, s.allocated)).collect();
    if held.len() < 3 || window.secs() < 5.0 || f.allocs_in_window < 50 {
        return None;
    }
    let steps = held.windows(2);
    let up = steps.clone().filter(|w| w[1].1 > w[0].1).count();
    let big_drop = steps
        .clone()
        .any(|w| (w[1].1 as f64) < w[0].1 as f64 * 0.95);
    let (first, mid, last) = (held[0].1, held[held.len() / 2].1, held[held.len() - 1].1);
    // A working set that filled up and levelled off is not a leak.
    let still_growing = last.saturating_sub(mid) as f64 >= last as f64 * 0.1;
    if up < (held.len() - 1) * 3 / 4 || big_drop || last <= first || !still_growing {
        return None;
    }
    let per_min = (last - first) as f64 / window.secs() * 60.0;
    let sites: Vec<String> = f
        .live_in_window
        .iter()
        .map(|(site, n, bytes)| format!("{site} ({n} blocks, {})", b(*bytes)))
        .collect();
    Some(Chain {
        rule: "leak",
        severity: if last >= 2 * first.max(1) { Severity::High } else { Severity::Medium },
        pid,
        title: "tensors held grow steadily -> leak".into(),
        root: format!(
            "the allocator's allocated bytes grew from {} to {} over {:.0}s ({}/min), rising in {up} of {} intervals and still rising at the end",
            b(first),
            b(last),
            window.secs(),
            b(per_min as u64),
            held.len() - 1
        ),
        effect: if sites.is_empty() {
            "blocks allocated in the window are still held".into()
        } else {
            format!("blocks allocated in the window and still held: {}", sites.join(", "))
        },
        compounding: Vec::new(),
        timeline: held
            .iter()
            .map(|(ts, v)| TimelineEntry {
                ts_ns: *ts,
                text: format!("allocated {}", b(*v)),
            })
            .collect(),
        fix: vec![
            "look for tensors kept across iterations (losses appended without .item(), cached outputs, growing lists)".into(),
            "torch.cuda.memory._record_memory_history() around the loop shows who holds them".into(),
        ],
        evidence: format!(
            "{} samples of the allocator's allocated bytes (PyTorch's probes), not its cache",
            held.len()
        ),
    })
}

fn forensics(e: &Event, layout: &Layout, free: Option<&DeviceFree>) -> Forensics {
    let total = layout.device_total(e.device);
    Forensics {
        ts_ns: e.ts_ns,
        device: e.device,
        requested: e.size,
        total,
        outside: layout.outside(e.device),
        device_free: free.map(|d| d.free.max(0) as u64),
        pools: layout
            .stats()
            .range((e.device, Pool::Small)..=(e.device, Pool::Large))
            .map(|(&(_, pool), s)| (pool, *s))
            .collect(),
        whole_segment: e.op.spec().space == Space::Device,
    }
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
            let label = r
                .stack
                .and_then(crate::model::StackId::new)
                .and_then(|id| sites.get(&id).cloned())
                .unwrap_or_else(|| "(no call site: trace with --stack)".into());
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

fn figures(s: &PoolStats) -> String {
    format!(
        "{} cached in {} free blocks, largest {} (fragmentation {:.0} %); reserved {}, allocated {}",
        b(s.cached()),
        s.free_blocks,
        b(s.largest_free),
        s.fragmentation() * 100.0,
        b(s.reserved),
        b(s.allocated)
    )
}

const FIX_EXPANDABLE: &str = "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True: segments grow in place, so the free bytes stay in one block";
const FIX_MAX_SPLIT: &str = "PYTORCH_CUDA_ALLOC_CONF=max_split_size_mb:128: large cached blocks are not cut for small tensors";

/// Fragmentation inside the cached segments, measured: new segments the cache could have held
/// in bytes but not in one block, and the worst moment's layout.
pub fn fragmentation_chain(pid: u32, f: &Findings) -> Option<Chain> {
    if !f.unknown.exact() {
        // Measured in a layout tracer did not see whole: [`unknown_chain`] says so.
        return None;
    }
    let worst = f.worst;
    // Without a segment forced by it, fragmentation is only worth a chain when the scattered
    // cache is a real share of the memory held.
    let harmless = |w: &(i64, i32, Pool, PoolStats)| {
        w.3.fragmentation() < 0.5 || w.3.cached() * 10 < w.3.reserved
    };
    if f.forced.count == 0 && worst.as_ref().is_none_or(harmless) {
        return None;
    }
    let (ts, device, pool, s) = worst.or_else(|| {
        f.end
            .iter()
            .max_by_key(|(_, s)| s.cached())
            .map(|((d, p), s)| (0, *d, *p, *s))
    })?;
    let mut root = format!(
        "at the worst moment the {pool:?} pool of device {device} held {}",
        figures(&s)
    );
    if f.forced.count > 0 {
        root.push_str(&format!(
            "; {} new segment(s) ({}) were reserved while the cache held enough free bytes for the request but no block that fit",
            f.forced.count,
            b(f.forced.bytes)
        ));
    }
    Some(Chain {
        rule: "fragmentation",
        severity: fragmentation_severity(&f.forced, &s),
        pid,
        title: "fragmentation inside the allocator's cached segments".into(),
        root,
        effect: format!(
            "{} of reserved memory was free but scattered in {} blocks: requests larger than {} need new segments from the device, and fail when it has no room",
            b(s.cached()),
            s.free_blocks,
            b(s.largest_free)
        ),
        compounding: Vec::new(),
        timeline: f
            .samples
            .iter()
            .map(|(ts, s)| TimelineEntry {
                ts_ns: *ts,
                text: format!(
                    "reserved {}, allocated {}, cached {} in {} blocks, largest {}",
                    b(s.reserved),
                    b(s.allocated),
                    b(s.cached()),
                    s.free_blocks,
                    b(s.largest_free)
                ),
            })
            .chain(std::iter::once(TimelineEntry {
                ts_ns: ts,
                text: format!("worst: fragmentation {:.0} % in the {pool:?} pool", s.fragmentation() * 100.0),
            }))
            .collect(),
        fix: vec![FIX_EXPANDABLE.into(), FIX_MAX_SPLIT.into()],
        evidence: format!(
            "the allocator's own layout, rebuilt from {} pytorch:malloc/free events and the device allocations",
            f.block_events
        ),
    })
}

/// How much fragmentation cost, in bytes against the memory held: new segments it forced
/// worth a real share of it, or a scattered cache that is a real share of reserved memory while
/// requests had to go past it. A high ratio of a tiny cache is not High (132 MiB in 13 blocks
/// of 78 GiB reserved is 0.2 %), nor is a scattered cache no request needed.
pub(super) fn fragmentation_severity(forced: &Forced, worst: &PoolStats) -> Severity {
    let reserved = worst.reserved.max(1) as f64;
    let scattered = worst.cached() as f64 / reserved * worst.fragmentation();
    let forced_share = forced.bytes as f64 / reserved;
    // High only when it cost memory: segments reserved because no cached block fit.
    let forced_some = forced.count > 0;
    if (forced.count >= 3 && forced_share >= 0.10) || (forced_some && scattered >= 0.15) {
        Severity::High
    } else if scattered >= 0.05 || forced_share >= 0.01 {
        Severity::Medium
    } else {
        Severity::Low
    }
}

/// The early warning: the layout in which the next request of the sizes being made fails;
/// none when it came no earlier than the out-of-memory (`first_failure`: the OOM chain tells).
pub fn warning_chain(pid: u32, f: &Findings, first_failure: Option<i64>) -> Option<Chain> {
    let warning = f.warning.as_ref().filter(|_| f.unknown.exact())?;
    let w = &warning.alarm;
    if first_failure.is_some_and(|fail| fail <= w.ts_ns) {
        // Not early: the failure came first (or with it); the OOM chain tells it.
        return None;
    }
    let mut timeline = vec![TimelineEntry {
        ts_ns: w.ts_ns,
        text: format!(
            "{:?} pool: largest free block {} < {} requested; the device has {} free, the new segment needs {}",
            w.pool,
            b(w.stats.largest_free),
            b(w.request),
            b(w.device_free),
            b(w.segment)
        ),
    }];
    if let Some(fail) = first_failure {
        timeline.push(TimelineEntry {
            ts_ns: fail,
            text: format!(
                "the out-of-memory came {} later",
                t((fail - w.ts_ns).max(0) as u64)
            ),
        });
    }
    let pinning: Vec<String> = warning
        .pinning
        .iter()
        .map(|(site, n, bytes)| format!("{site} ({n} blocks, {})", b(*bytes)))
        .collect();
    Some(Chain {
        rule: "early_warning",
        severity: Severity::High,
        pid,
        title: format!(
            "early warning: the next {} request on device {} will fail",
            b(w.request),
            w.device
        ),
        root: format!(
            "the {:?} pool holds {} but no block of {}, and the device has only {} free for the {} segment such a request needs",
            w.pool,
            figures(&w.stats),
            b(w.request),
            b(w.device_free),
            b(w.segment)
        ),
        effect: if pinning.is_empty() {
            "the free bytes are pinned between live blocks in partly used segments".into()
        } else {
            format!("the partly free segments are pinned by blocks from {}", pinning.join(", "))
        },
        compounding: Vec::new(),
        timeline,
        fix: vec![
            "checkpoint now, or free what the pinning blocks hold".into(),
            FIX_EXPANDABLE.into(),
            FIX_MAX_SPLIT.into(),
        ],
        evidence: "the allocator's layout at that moment and cudaMemGetInfo kept current with the segments since".into(),
    })
}

/// The layout at the out-of-memory that was not recovered (the failure at `fatal_ns`, or the
/// allocator's retry of it within a second: PyTorch's message describes the state after its
/// cache flush), and the fixes that fit it.
pub fn oom_forensics(
    f: &Findings,
    fatal_ns: i64,
    message: Option<&str>,
) -> Option<(String, Vec<String>)> {
    let x = f
        .forensics
        .iter()
        .rfind(|x| x.ts_ns >= fatal_ns && x.ts_ns - fatal_ns < 1_000_000_000)?;
    // "... Tried to allocate 46.00 MiB. GPU 0 has ...": the size PyTorch itself names.
    let tried = message
        .and_then(|m| m.split_once("Tried to allocate "))
        .and_then(|(_, rest)| rest.split(". ").next())
        .filter(|s| !s.is_empty())
        .map_or_else(|| b(x.requested), str::to_owned);
    let seen = if f.unknown.exact() {
        ""
    } else {
        " in the segments tracer saw"
    };
    let mut text = format!(
        "Tried to allocate {tried} (a {} {}){seen}: {} free inside cached segments in {} blocks, largest {}; reserved {}, allocated {}; {} outside PyTorch",
        b(x.requested),
        if x.whole_segment {
            "segment"
        } else {
            "page of an expandable segment"
        },
        b(x.total.cached()),
        x.total.free_blocks,
        b(x.total.largest_free),
        b(x.total.reserved),
        b(x.total.allocated),
        b(x.outside)
    );
    if let Some(free) = x.device_free {
        text.push_str(&format!("; the device had {} free", b(free)));
    }
    let verdict = if f.unknown.exact() {
        match x.verdict(message.and_then(pytorch_tried)) {
            OomVerdict::Fragmentation => Some(true),
            OomVerdict::Capacity => Some(false),
            OomVerdict::Unknown(why) => {
                text.push_str(&format!(": fragmentation or capacity is not known: {why}"));
                return Some((
                    text,
                    vec![
                        FIX_EXPANDABLE.into(),
                        "reduce peak memory: a smaller batch or sequence length, activation checkpointing, mixed precision".into(),
                    ],
                ));
            }
        }
    } else {
        // tracer's layout may differ from the allocator's here: only PyTorch's own figures
        // can tell.
        let said = message
            .and_then(pytorch_cached)
            .zip(message.and_then(pytorch_tried));
        match said {
            Some((cached, tried)) => {
                text.push_str(&format!(
                    "; tracer's layout is not exact here ({}), but PyTorch's message says {} reserved but unallocated",
                    unknown_said(f),
                    b(cached)
                ));
                Some(cached >= tried)
            }
            None => None,
        }
    };
    let fixes = if verdict.is_none() {
        text.push_str(&format!(
            ": whether the cache held the bytes is unknown: tracer's layout is not exact here ({}); PyTorch's out-of-memory message (its probe, libc10.so traced) or a trace from the job's start would settle it",
            unknown_said(f)
        ));
        vec![
            FIX_EXPANDABLE.into(),
            "reduce peak memory: a smaller batch or sequence length, activation checkpointing, mixed precision".into(),
        ]
    } else if verdict == Some(true) {
        text.push_str(": the cache held the bytes, not one block that fit (fragmentation)");
        vec![FIX_EXPANDABLE.into(), FIX_MAX_SPLIT.into()]
    } else {
        text.push_str(": the memory is in use, not lost to fragmentation (capacity)");
        vec![
            "reduce peak memory: a smaller batch or sequence length, activation checkpointing, mixed precision".into(),
            "leave the device to this job (other processes hold memory on it)".into(),
        ]
    };
    Some((text, fixes))
}

/// What is not known of the allocator's layout, in a few words.
pub fn unknown_said(f: &Findings) -> String {
    let u = &f.unknown;
    let mut parts = Vec::new();
    if f.orphans.0 > 0 || u.unseen_segments {
        parts.push(format!(
            "{} blocks ({}) lie in segments tracer never saw created",
            f.orphans.0,
            b(f.orphans.1)
        ));
    }
    if u.gaps > 0 {
        parts.push(format!(
            "{} gap(s) in the trace; {} blocks ({}) held since before are believed still held",
            u.gaps,
            f.carried.0,
            b(f.carried.1)
        ));
    }
    if u.freed_unseen > 0 {
        parts.push(format!(
            "{} blocks ({}) were freed while tracer did not see",
            u.freed_unseen,
            b(u.freed_unseen_bytes)
        ));
    }
    if f.held_unseen > 0 {
        parts.push(format!(
            "{} segment(s) were made while a free block of the same pool and stream that fit was believed free: blocks handed out without PyTorch's probes (torch.cuda.caching_allocator_alloc, raw_alloc) hold memory the layout shows free",
            f.held_unseen
        ));
    }
    if parts.is_empty() {
        parts.push("frees of blocks tracer never saw allocated".into());
    }
    parts.join("; ")
}

/// "... and 55.66 MiB is reserved by PyTorch but unallocated": the allocator's own cached bytes.
fn pytorch_cached(message: &str) -> Option<u64> {
    let before = message
        .split(" is reserved by PyTorch but unallocated")
        .next()?;
    pytorch_size(before.rsplit(", and ").next()?)
}

/// A size as PyTorch's format_size writes it ("55.66 MiB", "512 bytes").
fn pytorch_size(text: &str) -> Option<u64> {
    let compact = text.trim().replace("bytes", "B").replace(' ', "");
    if compact.trim_start_matches('0').starts_with(['B', '.']) || compact == "0" {
        return Some(0);
    }
    crate::units::parse_size(&compact).ok()
}

/// "Tried to allocate 22.00 MiB.": the request PyTorch names.
fn pytorch_tried(message: &str) -> Option<u64> {
    let rest = message.split_once("Tried to allocate ")?.1;
    pytorch_size(rest.split(". ").next()?)
}

/// What tracer did not see of the process's allocator, when that keeps its layout from being
/// exact: stated instead of a verdict (no rule concludes from it), with what would settle it.
pub fn unknown_chain(pid: u32, f: &Findings) -> Option<Chain> {
    let u = &f.unknown;
    if u.exact() || !f.visible {
        return None;
    }
    let since = u.since_ns.unwrap_or(0);
    let settle = if u.unseen_segments {
        "a trace that runs from the job's start (a DaemonSet running before jobs start), or the job restarted under trace; PyTorch's out-of-memory message, when it comes, gives the allocator's own figures"
    } else {
        "the job's next steps: the layout is exact again once no block event has contradicted it for twice the longest life of a block seen since, counted in block events (at least 1000)"
    };
    Some(Chain {
        rule: "unknown_state",
        severity: Severity::Low,
        pid,
        title: "the allocator's layout is not fully known: no verdict is drawn from it".into(),
        root: format!("since {}: {}", crate::units::format_utc(since), unknown_said(f)),
        effect: "fragmentation, capacity, the early warning, leaks and comparisons between ranks are not concluded from this process's layout".into(),
        compounding: Vec::new(),
        timeline: vec![TimelineEntry {
            ts_ns: since,
            text: "first evidence that tracer did not see everything".into(),
        }],
        fix: vec![format!("what would settle it: {settle}")],
        evidence: format!(
            "{} blocks outside known segments, {} allocations over blocks believed held, {} gap(s)",
            f.orphans.0, u.freed_unseen, u.gaps
        ),
    })
}
