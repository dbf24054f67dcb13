//! Causal-chain rules. Each reads the events of one process and returns a chain only when its
//! evidence is in the data, with the numbers that support it.

use std::collections::{BTreeMap, BTreeSet};

use serde::Serialize;
use tracer_common::{Library, Op, OpClass, Space};

use super::{live_allocations, select_quantile, Event, FastMap, Host, SiteLabels, Window};
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
    /// Stable rule name (fragmentation_pressure, allocator_retry, oom, leak, churn,
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

pub fn all(events: &[Event], host: &Host, window: Window, sites: &SiteLabels) -> Vec<Chain> {
    let mut by_pid: BTreeMap<u32, Vec<&Event>> = BTreeMap::new();
    for e in events {
        by_pid.entry(e.pid).or_default().push(e);
    }
    let mut chains = Vec::new();
    for (pid, evs) in &by_pid {
        let in_window: Vec<&Event> = evs
            .iter()
            .copied()
            .filter(|e| window.contains(e.ts_ns))
            .collect();
        if in_window.is_empty() {
            continue;
        }
        chains.extend(fragmentation_pressure(*pid, evs, &in_window, host));
        chains.extend(allocator_retry(*pid, &in_window));
        chains.extend(oom(*pid, events, evs, &in_window, sites));
        chains.extend(leak(*pid, evs, window, sites));
        chains.extend(churn(*pid, &in_window, window));
        chains.extend(empty_cache_churn(*pid, &in_window));
        chains.extend(driver_bypass(*pid, &in_window));
        chains.extend(sync_stall(*pid, &in_window, window, host));
        chains.extend(periodic_spike(*pid, &in_window, host));
        chains.extend(cpu_contention(*pid, &in_window, host));
    }
    chains
}

fn device_allocs<'a>(evs: &[&'a Event]) -> Vec<&'a Event> {
    evs.iter()
        .copied()
        .filter(|e| e.class() == OpClass::Alloc && e.space() == Space::Device)
        .collect()
}

/// Bytes held (live device allocations and physical handles), replayed call by call.
#[derive(Default)]
struct Held {
    live: FastMap<(u32, u64), u64>,
    bytes: u64,
}

impl Held {
    fn apply(&mut self, e: &Event) {
        let (Some(ptr), true) = (e.ptr, e.ret == 0) else {
            return;
        };
        if !matches!(e.space(), Space::Device | Space::Handle) {
            return;
        }
        let key = (e.space() as u32, ptr);
        match e.class() {
            OpClass::Alloc => {
                let size = e.size.unwrap_or(0);
                self.bytes += size;
                if let Some(old) = self.live.insert(key, size) {
                    self.bytes -= old;
                }
            }
            OpClass::Free => self.bytes -= self.live.remove(&key).unwrap_or(0),
            _ => {}
        }
    }
}

/// Bytes held at each of `times` (ascending), in one pass.
fn held_at(evs: &[&Event], times: &[i64]) -> Vec<u64> {
    let mut held = Held::default();
    let mut out = Vec::with_capacity(times.len());
    for e in evs {
        while out.len() < times.len() && e.ts_ns > times[out.len()] {
            out.push(held.bytes);
        }
        if out.len() == times.len() {
            break;
        }
        held.apply(e);
    }
    out.resize(times.len(), held.bytes);
    out
}

fn live_bytes_at(evs: &[&Event], ts: i64) -> u64 {
    live_allocations(evs.iter().copied().filter(|e| e.ts_ns <= ts))
        .values()
        .filter(|e| matches!(e.space(), Space::Device | Space::Handle))
        .filter_map(|e| e.size)
        .sum()
}

const BUCKETS: usize = 6;

/// Which of BUCKETS equal intervals from `start` over `span` holds `ts`.
fn bucket_of(ts: i64, start: i64, span: i64) -> usize {
    (((ts - start) as i128 * BUCKETS as i128 / (span as i128 + 1)) as usize).min(BUCKETS - 1)
}

/// Peak bytes held (live device allocations and physical handles) in each of BUCKETS equal
/// intervals from `start` over `span`.
fn peak_held_per_bucket(all: &[&Event], start: i64, span: i64) -> [u64; BUCKETS] {
    let mut held = Held::default();
    let mut peaks = [0u64; BUCKETS];
    for e in all.iter().take_while(|e| e.ts_ns <= start + span) {
        held.apply(e);
        if e.ts_ns >= start {
            let i = bucket_of(e.ts_ns, start, span);
            peaks[i] = peaks[i].max(held.bytes);
        }
    }
    peaks
}

/// Rule 1: allocation latency climbing over the window (bucket medians, not one outlier) while
/// the bytes held grow.
fn fragmentation_pressure(pid: u32, all: &[&Event], evs: &[&Event], host: &Host) -> Option<Chain> {
    let allocs: Vec<&Event> = device_allocs(evs)
        .into_iter()
        .filter(|e| e.ret == 0)
        .collect();
    if allocs.len() < 30 {
        return None;
    }
    let (start, end) = (allocs[0].ts_ns, allocs[allocs.len() - 1].ts_ns);
    let span = (end - start).max(1);
    let mut buckets: Vec<Vec<u64>> = vec![Vec::new(); BUCKETS];
    for e in &allocs {
        buckets[bucket_of(e.ts_ns, start, span)].push(e.duration_ns);
    }
    let medians: Vec<(usize, u64)> = buckets
        .iter_mut()
        .enumerate()
        .filter(|(_, d)| d.len() >= 3)
        .map(|(i, d)| {
            (i, select_quantile(d, 0.5))
        })
        .collect();
    if medians.len() < 4 {
        return None;
    }
    let (first, last) = (medians[0].1.max(1), medians[medians.len() - 1].1);
    let rises = medians.windows(2).filter(|w| w[1].1 > w[0].1).count();
    let rising = last as f64 >= 2.0 * first as f64 && rises * 5 >= (medians.len() - 1) * 3;
    // Memory held, as the peak of each bucket (a point sample would catch a transient).
    let peaks = peak_held_per_bucket(all, start, span);
    let held_first = peaks[medians[0].0];
    let held_last = peaks[medians[medians.len() - 1].0];
    if !rising || held_last <= held_first {
        return None;
    }
    let mut d: Vec<u64> = allocs.iter().map(|e| e.duration_ns).collect();
    let sizes: Vec<u64> = allocs.iter().filter_map(|e| e.size).collect();
    let (min_size, max_size) = (
        sizes.iter().min().copied().unwrap_or(0),
        sizes.iter().max().copied().unwrap_or(0),
    );
    let ops: Vec<&str> = allocs
        .iter()
        .map(|e| e.op)
        .collect::<BTreeSet<Op>>()
        .into_iter()
        .map(Op::name)
        .collect();
    let growth = last as f64 / first as f64;
    Some(Chain {
        rule: "fragmentation_pressure",
        severity: if growth >= 4.0 {
            Severity::High
        } else {
            Severity::Medium
        },
        pid,
        title: format!("memory fragmentation -> {} latency spike", ops.join("/")),
        root: format!(
            "{} allocations in {:.0}s ({:.1}/s), sizes {}-{}; memory held grew from {} to {}",
            allocs.len(),
            secs_between(start, end),
            allocs.len() as f64 / secs_between(start, end).max(1e-9),
            b(min_size),
            b(max_size),
            b(held_first),
            b(held_last)
        ),
        effect: format!(
            "median allocation latency climbed from {} to {} ({:.1}x) over the run; p99 {}",
            t(first),
            t(last),
            growth,
            t(select_quantile(&mut d, 0.99))
        ),
        compounding: {
            let p90 = select_quantile(&mut d, 0.9);
            let slow: Vec<&Event> = allocs
                .iter()
                .copied()
                .filter(|e| e.duration_ns >= p90)
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
            FIX_EXPANDABLE.into(),
            FIX_MAX_SPLIT.into(),
            FIX_FRACTION.into(),
        ],
        evidence: format!(
            "{} successful allocations in {} time buckets",
            allocs.len(),
            medians.len()
        ),
    })
}

const RETRY_WINDOW_NS: i64 = 2_000_000_000;

/// For a failed allocation: the frees that follow it and the successful retry of the same size.
fn recovery<'a>(failed: &Event, evs: &[&'a Event]) -> Option<(Vec<&'a Event>, &'a Event)> {
    let from = evs.partition_point(|e| e.ts_ns <= failed.ts_ns);
    let later = evs[from..]
        .iter()
        .copied()
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

fn failed_allocs<'a>(evs: &[&'a Event]) -> Vec<&'a Event> {
    evs.iter()
        .copied()
        .filter(|e| e.class() == OpClass::Alloc && e.ret == 2)
        .collect()
}

/// Rule 2: a failed allocation, a burst of frees, the same request succeeding: the caching
/// allocator flushed its cache and retried.
fn allocator_retry(pid: u32, evs: &[&Event]) -> Option<Chain> {
    let recovered: Vec<(&Event, Vec<&Event>, &Event)> = failed_allocs(evs)
        .into_iter()
        .filter_map(|f| recovery(f, evs).map(|(fr, ok)| (f, fr, ok)))
        .collect();
    let (f, frees, ok) = recovered.first()?;
    let freed: u64 = frees.iter().filter_map(|e| e.size).sum();
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
            b(f.size.unwrap_or(0)),
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
            entry(f.ts_ns, format!("{} {} failed ({})", f.op.name(), b(f.size.unwrap_or(0)), f.ret)),
            entry(frees[0].ts_ns, format!("{} frees release {}", frees.len(), b(freed))),
            entry(ok.ts_ns, format!("{} {} succeeds", ok.op.name(), b(ok.size.unwrap_or(0)))),
        ],
        fix: vec![
            "reduce peak memory: smaller batch, activation checkpointing, mixed precision".into(),
            FIX_EXPANDABLE.into(),
        ],
        evidence: format!("{} failed allocation(s) followed by frees and a successful retry", recovered.len()),
    })
}

/// Rule 3: an allocation that failed for good, with what the process and the device held and
/// what cudaMemGetInfo (nvidia-smi's view) last told the process.
fn oom(
    pid: u32,
    everyone: &[Event],
    evs: &[&Event],
    in_window: &[&Event],
    sites: &SiteLabels,
) -> Option<Chain> {
    let fatal: Vec<&Event> = failed_allocs(in_window)
        .into_iter()
        .filter(|f| recovery(f, in_window).is_none())
        .collect();
    let f = *fatal.first()?;
    let requested = f.size.unwrap_or(0);
    let held = live_bytes_at(evs, f.ts_ns);
    let own_on_device: Vec<&Event> = evs
        .iter()
        .copied()
        .filter(|e| e.device == f.device)
        .collect();
    let held_on_device = live_bytes_at(&own_on_device, f.ts_ns);
    let all_refs: Vec<&Event> = everyone
        .iter()
        .filter(|e| e.device == f.device || f.device.is_none())
        .collect();
    let device_held = live_bytes_at(&all_refs, f.ts_ns);
    let info = evs
        .iter()
        .rev()
        .find(|e| e.ts_ns < f.ts_ns && e.class() == OpClass::MemInfo && e.ret == 0);
    let device = f
        .device
        .map_or("an unknown device".to_string(), |d| format!("device {d}"));
    let mut effect = format!(
        "the process held {} on {device} ({} on all devices); all traced processes held {} on {device}",
        b(held_on_device),
        b(held),
        b(device_held),
    );
    let mut timeline = Vec::new();
    if let Some(i) = info {
        let (free, total) = (i.aux0.unwrap_or(0), i.aux1.unwrap_or(0));
        timeline.push(entry(
            i.ts_ns,
            format!("{} reports {} free of {}", i.op.name(), b(free), b(total)),
        ));
        effect.push_str(&format!(
            "; {} last reported {} free of {} ({} before the failure) - what nvidia-smi would show",
            i.op.name(),
            b(free),
            b(total),
            t((f.ts_ns - i.ts_ns).max(0) as u64)
        ));
        if free >= requested {
            effect.push_str(&format!(
                "; that was enough for the {} request, so it failed for want of one contiguous block (fragmentation)",
                b(requested)
            ));
        }
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

/// Rule 4: bytes held growing steadily over the window.
fn leak(pid: u32, evs: &[&Event], window: Window, sites: &SiteLabels) -> Option<Chain> {
    const SAMPLES: i64 = 8;
    let times: Vec<i64> = (0..=SAMPLES)
        .map(|i| window.from_ns + (window.to_ns - window.from_ns) * i / SAMPLES)
        .collect();
    let points: Vec<(i64, u64)> = times.iter().copied().zip(held_at(evs, &times)).collect();
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
    let allocs = evs
        .iter()
        .filter(|e| window.contains(e.ts_ns) && e.class() == OpClass::Alloc)
        .count();
    if window.secs() < 5.0 || allocs < 50 {
        return None;
    }
    let live = live_allocations(evs.iter().copied().filter(|e| e.ts_ns <= window.to_ns));
    let mut by_op: BTreeMap<&str, (u64, u64)> = BTreeMap::new();
    let mut by_site: BTreeMap<&str, (u64, u64)> = BTreeMap::new();
    for e in live.values().filter(|e| window.contains(e.ts_ns)) {
        let o = by_op.entry(e.op.name()).or_default();
        o.0 += 1;
        o.1 += e.size.unwrap_or(0);
        if let Some(site) = e.stack.and_then(|id| sites.get(&id)) {
            let s = by_site.entry(site.as_str()).or_default();
            s.0 += 1;
            s.1 += e.size.unwrap_or(0);
        }
    }
    let mut top_sites: Vec<(&str, (u64, u64))> = by_site.into_iter().collect();
    top_sites.sort_by_key(|(_, (_, bytes))| std::cmp::Reverse(*bytes));
    let per_min = (last - first) as f64 / window.secs() * 60.0;
    let ops: Vec<String> = by_op
        .iter()
        .map(|(op, (n, bytes))| format!("{op}: {n} allocations, {}", b(*bytes)))
        .collect();
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
        effect: format!(
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
        ),
        compounding: Vec::new(),
        timeline: points.iter().map(|(ts, v)| entry(*ts, format!("held {}", b(*v)))).collect(),
        fix: vec![
            "look for tensors kept across iterations (losses appended without .item(), cached outputs, growing lists)".into(),
            "torch.cuda.memory._record_memory_history() around the loop shows who holds them".into(),
        ],
        evidence: format!("{} samples of live allocations", SAMPLES + 1),
    })
}

/// Rule 5a: tight alloc/free cycles of the same size.
fn churn(pid: u32, evs: &[&Event], window: Window) -> Option<Chain> {
    let mut open: FastMap<(u32, u64), &Event> = FastMap::default();
    let mut cycles: BTreeMap<(&str, u64), Vec<u64>> = BTreeMap::new();
    for e in evs
        .iter()
        .copied()
        .filter(|e| e.ret == 0 && e.ptr.is_some())
    {
        let key = (e.space() as u32, e.ptr.unwrap_or(0));
        match e.class() {
            OpClass::Alloc => {
                open.insert(key, e);
            }
            OpClass::Free => {
                if let Some(a) = open.remove(&key) {
                    let life = (e.ts_ns - a.ts_ns).max(0) as u64;
                    if life < 10_000_000 {
                        cycles
                            .entry((a.op.name(), a.size.unwrap_or(0)))
                            .or_default()
                            .push(life);
                    }
                }
            }
            _ => {}
        }
    }
    let ((op, size), lives) = cycles.into_iter().max_by_key(|(_, v)| v.len())?;
    let rate = lives.len() as f64 / window.secs();
    if lives.len() < 50 || rate < 10.0 {
        return None;
    }
    let mut lives = lives;
    Some(Chain {
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
    })
}

/// Rule 5b: bursts of frees followed by re-allocation of the same sizes (empty_cache in a loop).
fn empty_cache_churn(pid: u32, evs: &[&Event]) -> Option<Chain> {
    const BURST_NS: i64 = 50_000_000;
    const MIN_BURST: usize = 4;
    // A release phase: consecutive successful frees with no allocation between them (what
    // empty_cache() does), within BURST_NS; then the same sizes are allocated again.
    let is_free =
        |e: &Event| e.class() == OpClass::Free && e.ret == 0 && e.space() == Space::Device;
    let is_alloc = |e: &Event| e.class() == OpClass::Alloc && e.ret == 0;
    // Against the process's usual pace: a burst's frees come at least ten times faster.
    let free_count = evs.iter().filter(|e| is_free(e)).count().max(1) as i64;
    let span = evs.last().map_or(0, |l| l.ts_ns) - evs.first().map_or(0, |f| f.ts_ns);
    let usual_gap = span / free_count;
    let mut bursts = Vec::new();
    let mut i = 0;
    while i < evs.len() {
        if !is_free(evs[i]) {
            i += 1;
            continue;
        }
        let start = i;
        let mut run = vec![evs[i]];
        i += 1;
        while i < evs.len() && !is_alloc(evs[i]) && evs[i].ts_ns - evs[start].ts_ns <= BURST_NS {
            if is_free(evs[i]) {
                run.push(evs[i]);
            }
            i += 1;
        }
        let run_gap = (run[run.len() - 1].ts_ns - run[0].ts_ns) / (run.len() as i64 - 1).max(1);
        if run.len() < MIN_BURST || run_gap * 10 > usual_gap {
            continue;
        }
        let sizes: Vec<u64> = run.iter().filter_map(|e| e.size).collect();
        let end = run[run.len() - 1].ts_ns;
        let realloc = evs[i..]
            .iter()
            .take_while(|e| e.ts_ns <= end + 1_000_000_000)
            .filter(|e| is_alloc(e) && e.size.is_some_and(|s| sizes.contains(&s)))
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

/// Rule 6: driver allocations not made inside a runtime call of the same thread.
fn driver_bypass(pid: u32, evs: &[&Event]) -> Option<Chain> {
    // Runtime calls of one thread do not overlap (but for nesting), so the enclosing one, if
    // any, is the last that started before the driver call.
    let mut runtime: FastMap<u32, Vec<&Event>> = FastMap::default();
    for e in evs
        .iter()
        .copied()
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
        .copied()
        .filter(|e| e.op.spec().library == Library::Driver && e.class() == OpClass::Alloc)
        .filter(|d| !nested(d))
        .collect();
    if bypass.is_empty() {
        return None;
    }
    let bytes: u64 = bypass
        .iter()
        .filter(|e| e.ret == 0)
        .filter_map(|e| e.size)
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
            "{} driver allocation(s) ({}) made outside any libcudart call, {} in all",
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
fn sync_stall(pid: u32, evs: &[&Event], window: Window, host: &Host) -> Option<Chain> {
    let syncs: Vec<&Event> = evs
        .iter()
        .copied()
        .filter(|e| e.class() == OpClass::Sync)
        .collect();
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
        compounding: host.compounding(&syncs, "synchronisation calls").into_iter().collect(),
        timeline: vec![entry(worst.ts_ns, format!("longest: {} {}", worst.op.name(), t(worst.duration_ns)))],
        fix: vec!["avoid host syncs in the loop (.item(), .cpu(), printing tensors); use non_blocking copies".into()],
        evidence: format!("{} synchronisation calls", syncs.len()),
    })
}

/// Rule 8: allocation latency spikes at a regular interval.
fn periodic_spike(pid: u32, evs: &[&Event], host: &Host) -> Option<Chain> {
    let allocs: Vec<&Event> = device_allocs(evs)
        .into_iter()
        .filter(|e| e.ret == 0)
        .collect();
    if allocs.len() < 20 {
        return None;
    }
    let mut d: Vec<u64> = allocs.iter().map(|e| e.duration_ns).collect();
    let median = select_quantile(&mut d, 0.5);
    let threshold = (median * 5).max(100_000);
    let spikes: Vec<&Event> = allocs
        .iter()
        .copied()
        .filter(|e| e.duration_ns >= threshold)
        .collect();
    if spikes.len() < 4 || spikes.len() * 2 > allocs.len() {
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
        evidence: format!("{} spikes among {} allocations", spikes.len(), allocs.len()),
    })
}

/// Host context: the process's slow CUDA calls spent a large share of their time waiting for a
/// CPU (their own threads runnable but not running), measured where the calls ran.
fn cpu_contention(pid: u32, evs: &[&Event], host: &Host) -> Option<Chain> {
    if !host.recorded || evs.len() < 20 {
        return None;
    }
    let mut d: Vec<u64> = evs.iter().map(|e| e.duration_ns).collect();
    let threshold = select_quantile(&mut d, 0.95).max(100_000);
    let slow: Vec<&Event> = evs
        .iter()
        .copied()
        .filter(|e| e.duration_ns >= threshold)
        .collect();
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
