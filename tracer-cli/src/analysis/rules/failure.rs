//! Failed allocations: the caching allocator's retry (rule 2) and the failure for good, with what
//! the process and the device held (rule 3).

use tracer_common::OpClass;

use super::{entry, Chain, Proc, Severity, FIX_EXPANDABLE, FIX_MAX_SPLIT};
use crate::{
    analysis::{
        replay::{self},
        Event, SiteLabels,
    },
    units::{format_bytes as b, format_ns as t},
};

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
pub(super) fn allocator_retry(pid: u32, evs: &[Event], failed: &[&Event]) -> Option<Chain> {
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
pub(super) fn oom(
    p: &Proc<'_>,
    procs: &[Proc<'_>],
    failed: &[&Event],
    sites: &SiteLabels,
) -> Option<Chain> {
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
