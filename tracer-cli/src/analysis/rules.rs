//! Causal-chain rules. Each reads the events of one process and returns a chain only when its
//! evidence is in the data, with the numbers that support it.

use std::collections::BTreeMap;

use serde::Serialize;
use tracer_common::{Library, Op, OpClass, Space};

use super::{
    replay::{self, is_device_alloc_ok, Buckets, BUCKETS},
    scan::Scan,
    select_quantile, Event, FastMap, Host, SiteLabels, Window,
};
use crate::units::{format_bytes as b, format_ns as t};

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "UPPERCASE")]
pub enum Severity {
    Low,
    Medium,
    High,
}

#[derive(Clone, Debug, Serialize)]
pub struct TimelineEntry {
    pub ts_ns: i64,
    pub text: String,
}

#[derive(Clone, Debug, Serialize)]
pub struct Chain {
    /// Stable rule name (latency_growth, allocator_retry, oom, leak, churn,
    /// empty_cache_churn, driver_bypass, sync_stall, periodic_spike).
    pub rule: &'static str,
    pub severity: Severity,
    pub pid: u32,
    pub title: String,
    pub root: String,
    pub effect: String,
    pub compounding: Vec<String>,
    pub timeline: Vec<TimelineEntry>,
    pub fix: Vec<String>,
    /// How much data the chain rests on.
    pub evidence: String,
}

const FIX_EXPANDABLE: &str = "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (segments grow in place instead of fragmenting)";
const FIX_MAX_SPLIT: &str = "PYTORCH_CUDA_ALLOC_CONF=max_split_size_mb:128 (large cached blocks are not split for small tensors)";
const FIX_FRACTION: &str = "torch.cuda.set_per_process_memory_fraction(0.9) to leave headroom for allocations outside PyTorch";

fn entry(ts_ns: i64, text: String) -> TimelineEntry {
    TimelineEntry { ts_ns, text }
}

fn secs_between(a: i64, b: i64) -> f64 {
    (b - a) as f64 / 1e9
}

/// One process's calls: all of them up to the window's end, and those in the window (both in
/// time order).
#[derive(Clone, Copy, Debug)]
pub struct Proc<'a> {
    pub pid: u32,
    pub all: &'a [Event],
    pub window: &'a [Event],
    /// PyTorch's expandable segments: the reserved ranges its blocks landed in.
    pub expandable: &'a [(u64, u64)],
    /// The process's settings turn expandable segments on.
    pub expandable_setting: bool,
}

/// The chains of the rules that replay allocations (latency growth, leak, churn) for
/// each process, with what the replay left live at the window's end.
pub fn replayed<'a>(
    procs: &[Proc<'a>],
    window: Window,
    host: &Host,
    sites: &SiteLabels,
) -> Vec<(ReplayChains, Vec<&'a Event>)> {
    procs
        .iter()
        .map(|p| {
            let allocs = AllocTimes::of(p.window);
            let samples = leak_samples(window);
            let mut r = replay::replay(p.all, window, &samples, allocs.map(|a| a.buckets()));
            let chains = ReplayChains {
                fragmentation: allocs.and_then(|a| latency_growth(p, a, &mut r, host)),
                leak: leak(p, window, &samples, &r, sites),
                churn: churn(
                    p.pid,
                    allocator_pages_out(p, std::mem::take(&mut r.churn)),
                    window,
                ),
            };
            (chains, r.live)
        })
        .collect()
}

/// [`replayed`]'s chains of one process.
#[derive(Debug, Default)]
pub struct ReplayChains {
    fragmentation: Option<Chain>,
    leak: Option<Chain>,
    /// The chain, and the op whose cycles it counts.
    churn: Option<(Chain, Op)>,
}

impl ReplayChains {
    /// Puts what the allocator's own layout measured in place of what the segments suggest:
    /// fragmentation from its blocks, a leak in tensors rather than in its cache. Segments
    /// given back and taken again are then the allocator's doing, not the program's.
    pub fn replace_with_measured(&mut self, fragmentation: Option<Chain>, leak: Option<Chain>) {
        self.fragmentation = fragmentation;
        self.leak = leak;
        let segments = |op: Op| op.spec().space == Space::Device;
        if let Some((c, _)) = self.churn.as_mut().filter(|(_, op)| segments(*op)) {
            c.title = c.title.replace(
                "alloc/free churn",
                "the allocator's cache released and refilled",
            );
            c.effect = "PyTorch's caching allocator gave these segments back to the device and reserved them again: it releases cached blocks to retry a cudaMalloc the device refused (running near its limit), or torch.cuda.empty_cache() is called; each cycle pays cudaMalloc again".into();
            c.fix = vec![
                "leave the device headroom (a smaller batch or sequence length), or remove empty_cache() from the loop".into(),
                "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True: the cache grows in place instead".into(),
            ];
        }
    }
}

/// The chains of the rules that need no replay, for one process, from one scan of its calls.
pub fn direct(
    p: &Proc<'_>,
    everyone: &[Proc<'_>],
    scan: Scan<'_>,
    window: Window,
    host: &Host,
    sites: &SiteLabels,
) -> DirectChains {
    // Durations of every call only when CPU contention can be assessed.
    let cpu = host
        .recorded
        .then(|| cpu_contention(p.pid, p.window, scan.all_durations(), host))
        .flatten();
    DirectChains {
        retry: allocator_retry(p.pid, p.window, &scan.failed),
        oom: oom(p, everyone, &scan.failed, sites),
        empty_cache: empty_cache_churn(p.pid, p.window, scan.device_frees_ok),
        bypass: scan.driver_allocs.then(|| driver_bypass(p)).flatten(),
        sync: sync_stall(p.pid, &scan.syncs, window, host),
        periodic: periodic_spike(p.pid, p.window, scan.device_alloc_durations, host),
        cpu,
    }
}

/// [`direct`]'s chains of one process.
#[derive(Debug, Default)]
pub struct DirectChains {
    retry: Option<Chain>,
    oom: Option<Chain>,
    empty_cache: Option<Chain>,
    bypass: Option<Chain>,
    sync: Option<Chain>,
    periodic: Option<Chain>,
    cpu: Option<Chain>,
}

/// Every chain, process by process, each process's in the rules' order.
pub fn merge(replayed: Vec<ReplayChains>, direct: Vec<DirectChains>) -> Vec<Chain> {
    let mut chains = Vec::new();
    for (r, d) in replayed.into_iter().zip(direct) {
        chains.extend(
            [
                r.fragmentation,
                d.retry,
                d.oom,
                r.leak,
                r.churn.map(|(c, _)| c),
                d.empty_cache,
                d.bypass,
                d.sync,
                d.periodic,
                d.cpu,
            ]
            .into_iter()
            .flatten(),
        );
    }
    chains
}

/// The first and last successful device allocation of a window, which latency growth
/// divides into buckets.
#[derive(Clone, Copy, Debug)]
struct AllocTimes {
    start: i64,
    end: i64,
}

impl AllocTimes {
    fn of(evs: &[Event]) -> Option<AllocTimes> {
        Some(AllocTimes {
            start: evs.iter().find(|e| is_device_alloc_ok(e))?.ts_ns,
            end: evs.iter().rev().find(|e| is_device_alloc_ok(e))?.ts_ns,
        })
    }

    fn buckets(self) -> Buckets {
        Buckets {
            start: self.start,
            span: (self.end - self.start).max(1),
        }
    }
}

/// The median allocation latency of each time bucket with at least 3 allocations, as (bucket,
/// median); None when fewer than 4 buckets have one.
fn bucket_medians(durations: &mut [Vec<u64>]) -> Option<Vec<(usize, u64)>> {
    let medians: Vec<(usize, u64)> = durations
        .iter_mut()
        .enumerate()
        .filter(|(_, d)| d.len() >= 3)
        .map(|(i, d)| (i, select_quantile(d, 0.5)))
        .collect();
    (medians.len() >= 4).then_some(medians)
}

/// A trend, not an outlier: the last median at least twice the first, and rising in at least
/// three steps of five.
fn rising(medians: &[(usize, u64)]) -> bool {
    let (first, last) = (medians[0].1.max(1), medians[medians.len() - 1].1);
    let rises = medians.windows(2).filter(|w| w[1].1 > w[0].1).count();
    last as f64 >= 2.0 * first as f64 && rises * 5 >= (medians.len() - 1) * 3
}

/// Rule 1: allocation latency climbing over the window (bucket medians, not one outlier) while
/// the bytes held grow. Named as that and never as fragmentation: at the call level tracer
/// sees no device layout (the allocator's probes measure it, and the measured chain replaces
/// this one), and a hole between live allocations proves nothing of it.
fn latency_growth(
    p: &Proc<'_>,
    times: AllocTimes,
    r: &mut replay::Replayed<'_>,
    host: &Host,
) -> Option<Chain> {
    let buckets = times.buckets();
    let peaks = r.peaks;
    let allocs = &mut r.device_allocs;
    let (count, min_size, max_size) = (allocs.count, allocs.min_size, allocs.max_size);
    let ops: Vec<&str> = Op::ALL
        .into_iter()
        .filter(|op| allocs.ops & (1 << (*op as u32)) != 0)
        .map(Op::name)
        .collect();
    let durations = &mut allocs.durations;
    if count < 30 {
        return None;
    }
    let frees = p
        .window
        .iter()
        .filter(|e| e.class() == OpClass::Free && e.ret == 0 && e.space() == Space::Device)
        .count();
    let medians = bucket_medians(durations)?;
    let (first, last) = (medians[0].1.max(1), medians[medians.len() - 1].1);
    // Memory held, as the peak of each bucket (a point sample would catch a transient).
    let held_first = peaks[medians[0].0];
    let held_last = peaks[medians[medians.len() - 1].0];
    if !rising(&medians) || held_last <= held_first {
        return None;
    }
    let mut d: Vec<u64> = durations.concat();
    let growth = last as f64 / first as f64;
    let (start, end, span) = (times.start, times.end, buckets.span);
    Some(Chain {
        rule: "latency_growth",
        severity: if growth >= 4.0 {
            Severity::High
        } else {
            Severity::Medium
        },
        pid: p.pid,
        title: format!("{} latency climbs with the memory held", ops.join("/")),
        root: format!(
            "{} allocations in {:.0}s ({:.1}/s), sizes {}-{}; memory held grew from {} to {}",
            count,
            secs_between(start, end),
            count as f64 / secs_between(start, end).max(1e-9),
            b(min_size),
            b(max_size),
            b(held_first),
            b(held_last)
        ),
        effect: format!(
            "median allocation latency climbed from {} to {} ({:.1}x) over the run; p99 {}; {}",
            t(first),
            t(last),
            growth,
            t(select_quantile(&mut d, 0.99)),
            if frees * 20 < count {
                format!("the memory held only grew ({frees} frees for {count} allocations): a leak if it goes on")
            } else {
                "whether it is fragmentation is not known: tracer sees no device layout at the call level (PyTorch's probes, libc10_cuda.so traced, measure the allocator's)".into()
            }
        ),
        compounding: {
            let p90 = select_quantile(&mut d, 0.9);
            let slow: Vec<&Event> = p
                .window
                .iter()
                .filter(|e| is_device_alloc_ok(e) && e.duration_ns >= p90)
                .collect();
            host.compounding(&slow, "slowest allocations")
                .into_iter()
                .collect()
        },
        timeline: medians
            .iter()
            .map(|(i, m)| {
                entry(
                    start + span * *i as i64 / BUCKETS as i64,
                    format!("median allocation latency {}", t(*m)),
                )
            })
            .collect(),
        fix: vec![
            "trace the process's libc10_cuda.so too (PyTorch's allocator probes): the allocator's own layout says whether its cache is fragmented".into(),
            "if the memory held keeps growing: look for tensors kept across iterations".into(),
        ],
        evidence: format!(
            "{} successful allocations in {} time buckets",
            count,
            medians.len()
        ),
    })
}

const RETRY_WINDOW_NS: i64 = 2_000_000_000;

/// For a failed allocation: the frees that follow it and the successful retry of the same size.
fn recovery<'a>(failed: &Event, evs: &'a [Event]) -> Option<(Vec<&'a Event>, &'a Event)> {
    let from = evs.partition_point(|e| e.ts_ns <= failed.ts_ns);
    let later = evs[from..]
        .iter()
        .take_while(|e| e.ts_ns <= failed.ts_ns + RETRY_WINDOW_NS);
    let mut frees = Vec::new();
    for e in later {
        if e.class() == OpClass::Free && e.ret == 0 {
            frees.push(e);
        } else if e.class() == OpClass::Alloc && e.op == failed.op && e.size == failed.size {
            if e.ret == 0 && !frees.is_empty() {
                return Some((frees, e));
            }
            if e.ret != 0 {
                return None;
            }
        }
    }
    None
}

/// Rule 2: a failed allocation, a burst of frees, the same request succeeding: the caching
/// allocator flushed its cache and retried.
fn allocator_retry(pid: u32, evs: &[Event], failed: &[&Event]) -> Option<Chain> {
    let recovered: Vec<(&Event, Vec<&Event>, &Event)> = failed
        .iter()
        .copied()
        .filter_map(|f| recovery(f, evs).map(|(fr, ok)| (f, fr, ok)))
        .collect();
    let (f, frees, ok) = recovered.first()?;
    let freed: u64 = frees.iter().map(|e| e.size).sum();
    Some(Chain {
        rule: "allocator_retry",
        severity: if recovered.len() >= 3 { Severity::High } else { Severity::Medium },
        pid,
        title: format!("allocation failure -> cache flush -> {} retry", f.op.name()),
        root: format!(
            "{} failed allocation(s) recovered by releasing cached memory; first: {} of {} failed (error {}), \
             then {} frees released {}",
            recovered.len(),
            f.op.name(),
            b(f.size),
            f.ret,
            frees.len(),
            b(freed)
        ),
        effect: format!(
            "the retry succeeded {} later; every flush stalls the step and empties the cache, so later \
             allocations go back to the driver",
            t((ok.ts_ns - f.ts_ns).max(0) as u64)
        ),
        compounding: Vec::new(),
        timeline: vec![
            entry(f.ts_ns, format!("{} {} failed ({})", f.op.name(), b(f.size), f.ret)),
            entry(frees[0].ts_ns, format!("{} frees release {}", frees.len(), b(freed))),
            entry(ok.ts_ns, format!("{} {} succeeds", ok.op.name(), b(ok.size))),
        ],
        fix: vec![
            "reduce peak memory: smaller batch, activation checkpointing, mixed precision".into(),
            FIX_EXPANDABLE.into(),
        ],
        evidence: format!("{} failed allocation(s) followed by frees and a successful retry", recovered.len()),
    })
}

/// What the process, and every traced process, held on the failed call's device.
fn held_at_failure(f: &Event, evs: &[Event], procs: &[Proc<'_>]) -> String {
    let held = replay::held_bytes_at(evs, f.ts_ns);
    let held_on_device =
        replay::held_bytes_at(evs.iter().filter(|e| e.device == f.device), f.ts_ns);
    let device_held: u64 = procs
        .iter()
        .map(|other| {
            replay::held_bytes_at(
                other
                    .all
                    .iter()
                    .filter(|e| e.device == f.device || f.device().is_none()),
                f.ts_ns,
            )
        })
        .sum();
    let device = f
        .device()
        .map_or("an unknown device".to_string(), |d| format!("device {d}"));
    format!(
        "the process held {} on {device} ({} on all devices); all traced processes held {} on {device}",
        b(held_on_device),
        b(held),
        b(device_held),
    )
}

/// What the last memory-info call told the process before the failure `f`, and whether that
/// was enough for the request (then one contiguous block was missing).
fn memory_info_said(f: &Event, info: &Event) -> String {
    let (free, total) = (info.aux0, info.aux1);
    let mut said = format!(
        "; {} last reported {} free of {} ({} before the failure) - what nvidia-smi would show",
        info.op.name(),
        b(free),
        b(total),
        t((f.ts_ns - info.ts_ns).max(0) as u64)
    );
    if free >= f.size {
        said.push_str(&format!(
            "; that was enough for the {} request, so it failed for want of one contiguous block (fragmentation)",
            b(f.size)
        ));
    }
    said
}

/// Rule 3: an allocation that failed for good, with what the process and the device held and
/// what cudaMemGetInfo (nvidia-smi's view) last told the process.
fn oom(p: &Proc<'_>, procs: &[Proc<'_>], failed: &[&Event], sites: &SiteLabels) -> Option<Chain> {
    let (pid, evs) = (p.pid, p.all);
    let fatal: Vec<&Event> = failed
        .iter()
        .copied()
        .filter(|f| recovery(f, p.window).is_none())
        .collect();
    let f = *fatal.first()?;
    let requested = f.size;
    let info = evs
        .iter()
        .rev()
        .find(|e| e.ts_ns < f.ts_ns && e.class() == OpClass::MemInfo && e.ret == 0);
    let mut effect = held_at_failure(f, evs, procs);
    let mut timeline = Vec::new();
    if let Some(i) = info {
        let (free, total) = (i.aux0, i.aux1);
        timeline.push(entry(
            i.ts_ns,
            format!("{} reports {} free of {}", i.op.name(), b(free), b(total)),
        ));
        effect.push_str(&memory_info_said(f, i));
    }
    timeline.push(entry(
        f.ts_ns,
        format!("{} of {} fails ({})", f.op.name(), b(requested), f.ret),
    ));
    Some(Chain {
        rule: "oom",
        severity: Severity::High,
        pid,
        title: format!("out of memory: {} of {} failed", f.op.name(), b(requested)),
        root: format!(
            "{} allocation(s) failed with out-of-memory and were not recovered; first: {} bytes requested{}",
            fatal.len(),
            requested,
            f.stack
                .and_then(|id| sites.get(&id))
                .map(|site| format!(" at {site}"))
                .unwrap_or_default()
        ),
        effect,
        compounding: Vec::new(),
        timeline,
        fix: vec![FIX_EXPANDABLE.into(), FIX_MAX_SPLIT.into(), "reduce the batch size or sequence length at this step".into()],
        evidence: format!("{} failed allocation(s); memory info calls seen: {}", fatal.len(), info.is_some()),
    })
}

const LEAK_SAMPLES: i64 = 8;

/// The times at which leak samples the bytes held: the window's ends and 7 points between.
fn leak_samples(window: Window) -> Vec<i64> {
    (0..=LEAK_SAMPLES)
        .map(|i| window.from_ns + (window.to_ns - window.from_ns) * i / LEAK_SAMPLES)
        .collect()
}

/// The allocations made in the window and never freed, by op and by their top call sites.
fn unfreed(live: &[&Event], window: Window, sites: &SiteLabels) -> String {
    let mut by_op: BTreeMap<&str, (u64, u64)> = BTreeMap::new();
    let mut by_site: BTreeMap<&str, (u64, u64)> = BTreeMap::new();
    for e in live.iter().filter(|e| window.contains(e.ts_ns)) {
        let o = by_op.entry(e.op.name()).or_default();
        o.0 += 1;
        o.1 += e.size;
        if let Some(site) = e.stack.and_then(|id| sites.get(&id)) {
            let s = by_site.entry(site.as_str()).or_default();
            s.0 += 1;
            s.1 += e.size;
        }
    }
    let mut top_sites: Vec<(&str, (u64, u64))> = by_site.into_iter().collect();
    top_sites.sort_by_key(|(_, (_, bytes))| std::cmp::Reverse(*bytes));
    let ops: Vec<String> = by_op
        .iter()
        .map(|(op, (n, bytes))| format!("{op}: {n} allocations, {}", b(*bytes)))
        .collect();
    format!(
        "allocations made in the window and never freed: {}{}",
        ops.join("; "),
        if top_sites.is_empty() {
            String::new()
        } else {
            format!(
                "; from {}",
                top_sites
                    .iter()
                    .take(3)
                    .map(|(site, (n, bytes))| format!("{site} ({n} allocations, {})", b(*bytes)))
                    .collect::<Vec<_>>()
                    .join(", ")
            )
        }
    )
}

/// Rule 4: bytes held growing steadily over the window.
fn leak(
    p: &Proc<'_>,
    window: Window,
    samples: &[i64],
    r: &replay::Replayed<'_>,
    sites: &SiteLabels,
) -> Option<Chain> {
    const SAMPLES: i64 = LEAK_SAMPLES;
    let pid = p.pid;
    let points: Vec<(i64, u64)> = samples
        .iter()
        .copied()
        .zip(r.held_at.iter().copied())
        .collect();
    let steps = points.windows(2);
    let up = steps.clone().filter(|w| w[1].1 > w[0].1).count();
    let big_drop = steps
        .clone()
        .any(|w| (w[1].1 as f64) < w[0].1 as f64 * 0.95);
    let (first, last) = (points[0].1, points[points.len() - 1].1);
    if up < 6 || big_drop || last <= first {
        return None;
    }
    // A start-up ramp is not a leak: ask for a few seconds and a few dozen allocations.
    let allocs = p
        .window
        .iter()
        .filter(|e| e.class() == OpClass::Alloc)
        .count();
    if window.secs() < 5.0 || allocs < 50 {
        return None;
    }
    let per_min = (last - first) as f64 / window.secs() * 60.0;
    Some(Chain {
        rule: "leak",
        severity: if last >= 2 * first.max(1) { Severity::High } else { Severity::Medium },
        pid,
        title: "memory held grows steadily -> leak".into(),
        root: format!(
            "memory held grew from {} to {} over {:.0}s ({}/min), rising in {up} of {} intervals",
            b(first),
            b(last),
            window.secs(),
            b(per_min as u64),
            SAMPLES
        ),
        effect: unfreed(&r.live, window, sites),
        compounding: Vec::new(),
        timeline: points.iter().map(|(ts, v)| entry(*ts, format!("held {}", b(*v)))).collect(),
        fix: vec![
            "look for tensors kept across iterations (losses appended without .item(), cached outputs, growing lists)".into(),
            "torch.cuda.memory._record_memory_history() around the loop shows who holds them".into(),
        ],
        evidence: format!("{} samples of live allocations", SAMPLES + 1),
    })
}

/// Rule 5a: tight alloc/free cycles of the same size (found by the replay).
fn churn(pid: u32, cycles: BTreeMap<(Op, u64), Vec<u64>>, window: Window) -> Option<(Chain, Op)> {
    // By op name, then size: the order ties are broken in.
    let cycles: BTreeMap<(&str, u64), (Op, Vec<u64>)> = cycles
        .into_iter()
        .map(|((op, size), lives)| ((op.name(), size), (op, lives)))
        .collect();
    let ((op, size), (which, lives)) = cycles.into_iter().max_by_key(|(_, v)| v.1.len())?;
    let rate = lives.len() as f64 / window.secs();
    if lives.len() < 50 || rate < 10.0 {
        return None;
    }
    let mut lives = lives;
    Some((Chain {
        rule: "churn",
        severity: if rate >= 1000.0 { Severity::Medium } else { Severity::Low },
        pid,
        title: format!("alloc/free churn -> {op} on the hot path"),
        root: format!(
            "{} cycles of {op} + free of {} ({:.0}/s), median lifetime {}",
            lives.len(),
            b(size),
            rate,
            t(select_quantile(&mut lives, 0.5))
        ),
        effect: "every cycle goes to the CUDA runtime instead of reusing a cached block".into(),
        compounding: Vec::new(),
        timeline: Vec::new(),
        fix: vec![
            "keep the buffer across iterations (allocate once, reuse), or let PyTorch's caching allocator own it".into(),
        ],
        evidence: format!("{} alloc/free pairs with lifetimes under 10 ms", lives.len()),
    }, which))
}

/// Rule 5b: bursts of frees followed by re-allocation of the same sizes (empty_cache in a loop).
fn empty_cache_churn(pid: u32, evs: &[Event], device_frees: u64) -> Option<Chain> {
    const BURST_NS: i64 = 50_000_000;
    const MIN_BURST: usize = 4;
    // A release phase: consecutive successful frees with no allocation between them (what
    // empty_cache() does), within BURST_NS; then the same sizes are allocated again.
    let is_free =
        |e: &Event| e.class() == OpClass::Free && e.ret == 0 && e.space() == Space::Device;
    let is_alloc = |e: &Event| e.class() == OpClass::Alloc && e.ret == 0;
    // Against the process's usual pace: a burst's frees come at least ten times faster.
    if device_frees < MIN_BURST as u64 * 2 {
        return None;
    }
    let free_count = device_frees as i64;
    let span = evs.last().map_or(0, |l| l.ts_ns) - evs.first().map_or(0, |f| f.ts_ns);
    let usual_gap = span / free_count;
    let mut bursts = Vec::new();
    // One buffer for every run: most runs are a single free.
    let mut run: Vec<&Event> = Vec::new();
    let mut i = 0;
    while i < evs.len() {
        if !is_free(&evs[i]) {
            i += 1;
            continue;
        }
        let start = i;
        run.clear();
        run.push(&evs[i]);
        i += 1;
        while i < evs.len() && !is_alloc(&evs[i]) && evs[i].ts_ns - evs[start].ts_ns <= BURST_NS {
            if is_free(&evs[i]) {
                run.push(&evs[i]);
            }
            i += 1;
        }
        let run_gap = (run[run.len() - 1].ts_ns - run[0].ts_ns) / (run.len() as i64 - 1).max(1);
        if run.len() < MIN_BURST || run_gap * 10 > usual_gap {
            continue;
        }
        let sizes: Vec<u64> = run.iter().map(|e| e.size).collect();
        let end = run[run.len() - 1].ts_ns;
        let realloc = evs[i..]
            .iter()
            .take_while(|e| e.ts_ns <= end + 1_000_000_000)
            .filter(|e| is_alloc(e) && sizes.contains(&e.size))
            .take(sizes.len())
            .count();
        if realloc >= MIN_BURST {
            bursts.push((run[0].ts_ns, run.len(), sizes.iter().sum::<u64>(), realloc));
        }
    }
    if bursts.len() < 2 {
        return None;
    }
    let total: u64 = bursts.iter().map(|b| b.2).sum();
    Some(Chain {
        rule: "empty_cache_churn",
        severity: Severity::Medium,
        pid,
        title: "release-then-reallocate bursts -> empty_cache() in the loop".into(),
        root: format!(
            "{} bursts of at least {MIN_BURST} frees within 50 ms, each followed within 1 s by allocations of the same sizes; {} released and taken back",
            bursts.len(),
            b(total)
        ),
        effect: "the cache is emptied and refilled: every refill pays cudaMalloc's latency again".into(),
        compounding: Vec::new(),
        timeline: bursts
            .iter()
            .take(5)
            .map(|(ts, n, bytes, re)| entry(*ts, format!("{n} frees release {}, {re} re-allocations follow", b(*bytes))))
            .collect(),
        fix: vec!["remove torch.cuda.empty_cache() from the training loop".into()],
        evidence: format!("{} bursts", bursts.len()),
    })
}

/// The process runs PyTorch's expandable segments: by its settings, or its blocks seen in a
/// reserved range.
fn expandable(p: &Proc<'_>) -> bool {
    p.expandable_setting || !p.expandable.is_empty()
}

/// Churn of the allocator's own pages (expandable segments mapping and unmapping chunks as it
/// grows, or releases them to retry) is the allocator at work, not the program's churn.
fn allocator_pages_out(
    p: &Proc<'_>,
    mut cycles: BTreeMap<(Op, u64), Vec<u64>>,
) -> BTreeMap<(Op, u64), Vec<u64>> {
    if expandable(p) {
        cycles.retain(|(op, _), _| {
            !matches!(
                op.spec().space,
                Space::Mapping | Space::Handle | Space::AddressRange
            )
        });
    }
    cycles
}

/// The driver calls of PyTorch's expandable segments, by index in `evs`: the reserved ranges
/// its blocks landed in (or, when its settings turn them on, ranges mapped in whole 2 MiB
/// pages, its granularity), the chunks mapped into and unmapped from them, each chunk's
/// cuMemCreate (the thread's next driver call maps it there), and the creations the device
/// refused.
fn expandable_calls(p: &Proc<'_>) -> std::collections::HashSet<usize> {
    let evs = p.window;
    let mut out = std::collections::HashSet::new();
    if !expandable(p) {
        return out;
    }
    const PAGE: u64 = 2 << 20;
    let in_range =
        |ranges: &[(u64, u64)], ptr: u64| ranges.iter().any(|&(s, e)| ptr >= s && ptr < e);
    let reserves: Vec<(u64, u64)> = evs
        .iter()
        .filter(|e| e.op == Op::CuMemAddressReserve && e.ret == 0)
        .map(|e| (e.ptr, e.ptr.saturating_add(e.size)))
        .collect();
    let maps_whole_pages = |r: &(u64, u64)| {
        evs.iter()
            .filter(|e| e.space() == Space::Mapping && in_range(std::slice::from_ref(r), e.ptr))
            .all(|e| e.size % PAGE == 0)
    };
    let ranges: Vec<(u64, u64)> = reserves
        .into_iter()
        .filter(|r| {
            p.expandable.iter().any(|&(s, _)| s >= r.0 && s < r.1)
                || (p.expandable_setting && maps_whole_pages(r))
        })
        .chain(p.expandable.iter().copied())
        .collect();
    let mut last_create: FastMap<u32, usize> = FastMap::default();
    for (i, e) in evs.iter().enumerate() {
        let spec = e.op.spec();
        if spec.library != Library::Driver {
            continue;
        }
        match spec.space {
            Space::AddressRange if in_range(&ranges, e.ptr) => {
                out.insert(i);
            }
            Space::Mapping if in_range(&ranges, e.ptr) => {
                out.insert(i);
                if let Some(create) = last_create.remove(&e.tid) {
                    out.insert(create);
                }
            }
            // A page the device refused: the allocator growing, the out-of-memory's call.
            Space::Handle if e.class() == OpClass::Alloc && e.ret != 0 => {
                out.insert(i);
            }
            Space::Handle if e.class() == OpClass::Alloc => {
                last_create.insert(e.tid, i);
            }
            _ => {
                last_create.remove(&e.tid);
            }
        }
    }
    out
}

/// Rule 6: driver allocations not made inside a runtime call of the same thread, nor by
/// PyTorch's expandable segments. Bytes are counted once: physical memory (cuMemCreate,
/// cuMemAlloc), not the address ranges it is mapped into.
fn driver_bypass(p: &Proc<'_>) -> Option<Chain> {
    let (pid, evs) = (p.pid, p.window);
    let allocator = expandable_calls(p);
    let driver_alloc =
        |e: &Event| e.op.spec().library == Library::Driver && e.class() == OpClass::Alloc;
    if !evs.iter().any(driver_alloc) {
        return None;
    }
    // Runtime calls of one thread do not overlap (but for nesting), so the enclosing one, if
    // any, is the last that started before the driver call.
    let mut runtime: FastMap<u32, Vec<&Event>> = FastMap::default();
    for e in evs
        .iter()
        .filter(|e| e.op.spec().library == Library::Runtime)
    {
        runtime.entry(e.tid).or_default().push(e);
    }
    let nested = |d: &Event| {
        runtime.get(&d.tid).is_some_and(|calls| {
            let i = calls.partition_point(|r| r.ts_ns <= d.ts_ns);
            i > 0 && d.end_ns() <= calls[i - 1].end_ns()
        })
    };
    let bypass: Vec<&Event> = evs
        .iter()
        .enumerate()
        .filter(|(i, e)| driver_alloc(e) && !allocator.contains(i))
        .map(|(_, e)| e)
        .filter(|d| !nested(d))
        .collect();
    if bypass.is_empty() {
        return None;
    }
    let bytes: u64 = bypass
        .iter()
        .filter(|e| e.ret == 0 && matches!(e.space(), Space::Device | Space::Handle))
        .map(|e| e.size)
        .sum();
    let mut ops: BTreeMap<&str, u64> = BTreeMap::new();
    for e in &bypass {
        *ops.entry(e.op.name()).or_default() += 1;
    }
    let listing: Vec<String> = ops.iter().map(|(op, n)| format!("{op} x{n}")).collect();
    Some(Chain {
        rule: "driver_bypass",
        severity: Severity::Low,
        pid,
        title: "allocations bypass the CUDA runtime".into(),
        root: format!(
            "{} driver allocation(s) ({}) made outside any libcudart call, {} of device memory",
            bypass.len(),
            listing.join(", "),
            b(bytes)
        ),
        effect: "memory taken this way is invisible to PyTorch's allocator statistics and competes with its cache".into(),
        compounding: Vec::new(),
        timeline: Vec::new(),
        fix: vec![
            "account for it (NCCL, cuBLAS workspaces, custom extensions, expandable segments)".into(),
            FIX_FRACTION.into(),
        ],
        evidence: format!("{} driver allocations", bypass.len()),
    })
}

/// Rule 7: time spent waiting in synchronisation calls.
fn sync_stall(pid: u32, syncs: &[&Event], window: Window, host: &Host) -> Option<Chain> {
    if syncs.len() < 5 {
        return None;
    }
    let total: u64 = syncs.iter().map(|e| e.duration_ns).sum();
    let mut d: Vec<u64> = syncs.iter().map(|e| e.duration_ns).collect();
    let share = total as f64 / (window.secs() * 1e9);
    let p99 = select_quantile(&mut d, 0.99);
    if share < 0.10 && p99 < 10_000_000 {
        return None;
    }
    let worst = syncs.iter().max_by_key(|e| e.duration_ns)?;
    Some(Chain {
        rule: "sync_stall",
        severity: if share >= 0.25 { Severity::High } else { Severity::Medium },
        pid,
        title: "host waits on the GPU -> synchronisation stalls".into(),
        root: format!(
            "{} synchronisation calls took {} ({:.0}% of the window), p50 {}, p99 {}",
            syncs.len(),
            t(total),
            share * 100.0,
            t(select_quantile(&mut d, 0.5)),
            t(p99)
        ),
        effect: "the training loop is blocked while the GPU drains its queue".into(),
        compounding: host.compounding(syncs, "synchronisation calls").into_iter().collect(),
        timeline: vec![entry(worst.ts_ns, format!("longest: {} {}", worst.op.name(), t(worst.duration_ns)))],
        fix: vec!["avoid host syncs in the loop (.item(), .cpu(), printing tensors); use non_blocking copies".into()],
        evidence: format!("{} synchronisation calls", syncs.len()),
    })
}

/// Rule 8: allocation latency spikes at a regular interval.
fn periodic_spike(pid: u32, evs: &[Event], mut d: Vec<u64>, host: &Host) -> Option<Chain> {
    let allocs = d.len();
    if allocs < 20 {
        return None;
    }
    let median = select_quantile(&mut d, 0.5);
    let threshold = (median * 5).max(100_000);
    // A spike is rare by definition: more than half the allocations cannot be spikes.
    let spike_count = d.iter().filter(|&&v| v >= threshold).count();
    if spike_count < 4 || spike_count * 2 > allocs {
        return None;
    }
    let spikes: Vec<&Event> = evs
        .iter()
        .filter(|e| is_device_alloc_ok(e) && e.duration_ns >= threshold)
        .collect();
    if spikes.len() < 4 {
        return None;
    }
    let gaps: Vec<f64> = spikes
        .windows(2)
        .map(|w| (w[1].ts_ns - w[0].ts_ns) as f64)
        .collect();
    let mean = gaps.iter().sum::<f64>() / gaps.len() as f64;
    let sd = (gaps.iter().map(|g| (g - mean).powi(2)).sum::<f64>() / gaps.len() as f64).sqrt();
    if mean <= 0.0 || sd / mean > 0.3 {
        return None;
    }
    let mut spike_d: Vec<u64> = spikes.iter().map(|e| e.duration_ns).collect();
    Some(Chain {
        rule: "periodic_spike",
        severity: Severity::Medium,
        pid,
        title: format!("periodic allocation spikes every {:.1}s", mean / 1e9),
        root: format!(
            "{} allocation spikes (median {} against a normal {}), every {:.2}s (+/- {:.0}%)",
            spikes.len(),
            t(select_quantile(&mut spike_d, 0.5)),
            t(median),
            mean / 1e9,
            sd / mean * 100.0
        ),
        effect: "a step at that period stalls on allocation".into(),
        compounding: host.compounding(&spikes, "spikes").into_iter().collect(),
        timeline: spikes.iter().take(6).map(|e| entry(e.ts_ns, format!("{} took {}", e.op.name(), t(e.duration_ns)))).collect(),
        fix: vec![
            "find the periodic task (checkpointing, evaluation, logging every N steps) and pre-allocate its buffers".into(),
            FIX_EXPANDABLE.into(),
        ],
        evidence: format!("{} spikes among {} allocations", spikes.len(), allocs),
    })
}

/// Host context: the process's slow CUDA calls spent a large share of their time waiting for a
/// CPU (their own threads runnable but not running), measured where the calls ran.
fn cpu_contention(
    pid: u32,
    evs: &[Event],
    durations: (Vec<u64>, u64),
    host: &Host,
) -> Option<Chain> {
    let (mut d, zeros) = durations;
    if !host.recorded || d.len() as u64 + zeros < 20 {
        return None;
    }
    let threshold = super::select_quantile_with_zeros(&mut d, zeros, 0.95).max(100_000);
    let slow: Vec<&Event> = evs.iter().filter(|e| e.duration_ns >= threshold).collect();
    let o = host.during(&slow);
    if slow.len() < 10 || o.call_ns == 0 || o.run_queue_ns * 5 < o.call_ns {
        return None;
    }
    let share = o.run_queue_ns as f64 / o.call_ns as f64;
    let mut ops: BTreeMap<&str, u64> = BTreeMap::new();
    for e in &slow {
        *ops.entry(e.op.name()).or_default() += 1;
    }
    let listing: Vec<String> = ops.iter().map(|(op, n)| format!("{op} x{n}")).collect();
    Some(Chain {
        rule: "cpu_contention",
        severity: if share >= 0.5 { Severity::High } else { Severity::Medium },
        pid,
        title: "CPU contention -> slow CUDA calls".into(),
        root: format!(
            "the calling threads waited {} for a CPU during the {} slowest calls ({}; at least {} each): {:.0}% of their {}",
            t(o.run_queue_ns),
            slow.len(),
            listing.join(", "),
            t(threshold),
            share * 100.0,
            t(o.call_ns)
        ),
        effect: format!("{} off the CPU in all while inside those calls; the GPU work behind them waits on the host", t(o.off_cpu_ns)),
        compounding: host
            .crowding_text(pid, &slow)
            .map(|c| format!("competing for the cores during those calls: {c}"))
            .into_iter()
            .collect(),
        timeline: Vec::new(),
        fix: vec![
            "fewer DataLoader workers (num_workers) than free cores, or pin them away from the training thread (taskset, cgroups)".into(),
            "torch.set_num_threads() so intra-op threads do not oversubscribe the cores".into(),
        ],
        evidence: format!("{} slow calls and the scheduler's record of their threads", slow.len()),
    })
}
