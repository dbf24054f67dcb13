//! Bytes held growing steadily over the window (rule 4), seen from the calls.

use std::collections::BTreeMap;

use tracer_common::OpClass;

use super::{entry, Chain, Proc, Rule, Severity};
use crate::{
    analysis::{
        replay::{self},
        Event, SiteLabels, Window,
    },
    units::format_bytes as b,
};

const LEAK_SAMPLES: i64 = 8;

/// The times at which leak samples the bytes held: the window's ends and 7 points between.
pub(super) fn leak_samples(window: Window) -> Vec<i64> {
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
pub(super) fn leak(
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
    if last <= first {
        return None;
    }
    let count = |class: OpClass| {
        p.window
            .iter()
            .filter(|e| e.class() == class && e.ret == 0)
            .count()
    };
    let (allocs, frees) = (count(OpClass::Alloc), count(OpClass::Free));
    // Steady growth over a few seconds (a start-up ramp is not a leak), or, however short
    // the window, allocations hardly ever given back.
    let steady = up >= 6 && !big_drop && window.secs() >= 5.0;
    let never_freed = frees * 20 < allocs;
    if allocs < 50 || !(steady || never_freed) {
        return None;
    }
    let per_min = (last - first) as f64 / window.secs() * 60.0;
    Some(Chain {
        rule: Rule::Leak,
        severity: if last >= 2 * first.max(1) { Severity::High } else { Severity::Medium },
        pid,
        title: "memory held grows steadily -> leak".into(),
        root: if steady {
            format!(
                "memory held grew from {} to {} over {:.0}s ({}/min), rising in {up} of {} intervals",
                b(first),
                b(last),
                window.secs(),
                b(per_min as u64),
                SAMPLES
            )
        } else {
            format!(
                "memory held only grew, from {} to {} in {:.1}s: {allocs} allocations, {frees} freed (a leak, or memory kept on purpose)",
                b(first),
                b(last),
                window.secs()
            )
        },
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
