//! Allocation latency: climbing over the window (rule 1) or spiking at a regular interval
//! (rule 8).

use tracer_common::{Op, OpClass, Space};

use super::{entry, secs_between, Chain, Proc, Rule, Severity, FIX_EXPANDABLE};
use crate::{
    analysis::{
        replay::{self, is_device_alloc_ok, Buckets, BUCKETS},
        select_quantile, Event, Host,
    },
    units::{format_bytes as b, format_ns as t},
};

/// The first and last successful device allocation of a window, which latency growth
/// divides into buckets.
#[derive(Clone, Copy, Debug)]
pub(super) struct AllocTimes {
    start: i64,
    end: i64,
}

impl AllocTimes {
    pub(super) fn of(evs: &[Event]) -> Option<AllocTimes> {
        Some(AllocTimes {
            start: evs.iter().find(|e| is_device_alloc_ok(e))?.ts_ns,
            end: evs.iter().rev().find(|e| is_device_alloc_ok(e))?.ts_ns,
        })
    }

    pub(super) fn buckets(self) -> Buckets {
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
pub(super) fn latency_growth(
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
        rule: Rule::LatencyGrowth,
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

/// Rule 8: allocation latency spikes at a regular interval.
pub(super) fn periodic_spike(
    pid: u32,
    evs: &[Event],
    mut d: Vec<u64>,
    host: &Host,
) -> Option<Chain> {
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
        rule: Rule::PeriodicSpike,
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
            FIX_EXPANDABLE,
        ],
        evidence: format!("{} spikes among {} allocations", spikes.len(), allocs),
    })
}
