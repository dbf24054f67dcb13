//! Failed allocations: the caching allocator's retry (rule 2) and the failure for good, with what
//! the process and the device held (rule 3).

use tracer_common::OpClass;

use super::{entry, Chain, Proc, Rule, Severity, FIX_EXPANDABLE, FIX_MAX_SPLIT};
use crate::{
    analysis::{
        replay::{self},
        Event, SiteLabels,
    },
    model::attempts::{self, Attempt, Outermost},
    units::{format_bytes as b, format_ns as t},
};

/// For a failed attempt: the next attempt of its thread, when it is the allocator's retry.
fn retry_of<'a>(failed: &Attempt, attempts: &'a [Attempt]) -> Option<&'a Attempt> {
    attempts
        .iter()
        .filter(|a| a.event.ts_ns > failed.event.ts_ns)
        .find(|a| a.event.pid == failed.event.pid && a.event.tid == failed.event.tid)
        .filter(|a| a.retry)
}

/// The memory the process gave back between two moments: each free once (a cudaFree and the
/// cuMemFree_v2 inside it are one).
fn frees_between(evs: &[Event], from: i64, to: i64) -> Vec<Event> {
    let lo = evs.partition_point(|e| e.ts_ns <= from);
    let mut outermost = Outermost::default();
    let mut frees = Vec::new();
    let mut keep = |e: Event| {
        if e.class() == OpClass::Free && e.ret == 0 && e.ts_ns < to {
            frees.push(e);
        }
    };
    for e in evs[lo..].iter().take_while(|e| e.ts_ns < to) {
        outermost.push(e, &mut keep);
    }
    outermost.finish(&mut keep);
    frees.sort_by_key(|e| e.ts_ns);
    frees
}

/// Rule 2: a failed allocation, the cache released, the same request succeeding: the caching
/// allocator flushed its cache and retried.
pub(super) fn allocator_retry(pid: u32, evs: &[Event], attempts: &[Attempt]) -> Option<Chain> {
    // Recovered by releasing cached memory: frees between the failure and its retry (a retry
    // that succeeded with nothing freed found the memory another process gave back).
    let recovered: Vec<(&Event, &Event, Vec<Event>)> = attempts
        .iter()
        .filter(|a| a.failed)
        .filter_map(|f| {
            retry_of(f, attempts)
                .filter(|ok| !ok.failed)
                .map(|ok| (f, ok))
        })
        .map(|(f, ok)| {
            let frees = frees_between(evs, f.event.ts_ns, ok.event.ts_ns);
            (&f.event, &ok.event, frees)
        })
        .filter(|(_, _, frees)| !frees.is_empty())
        .collect();
    let (f, ok, frees) = recovered.first()?;
    let (f, ok) = (*f, *ok);
    let freed: u64 = frees.iter().map(|e| e.size).sum();
    let mut timeline = vec![entry(
        f.ts_ns,
        format!("{} {} failed ({})", f.op.name(), b(f.size), f.ret),
    )];
    if let Some(first) = frees.first() {
        timeline.push(entry(
            first.ts_ns,
            format!("{} frees release {}", frees.len(), b(freed)),
        ));
    }
    timeline.push(entry(
        ok.ts_ns,
        format!("{} {} succeeds", ok.op.name(), b(ok.size)),
    ));
    Some(Chain {
        rule: Rule::AllocatorRetry,
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
        timeline,
        fix: vec![
            "reduce peak memory: smaller batch, activation checkpointing, mixed precision".into(),
            FIX_EXPANDABLE,
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

/// Rule 3: the out-of-memory the allocator raised (a failed attempt no retry followed: the
/// retry's own failure when it retried), with what the process and the device held and what
/// cudaMemGetInfo (nvidia-smi's view) last told the process.
pub(super) fn oom(
    p: &Proc<'_>,
    procs: &[Proc<'_>],
    attempts: &[Attempt],
    sites: &SiteLabels,
) -> Option<Chain> {
    let (pid, evs) = (p.pid, p.all);
    let raised = attempts::raised(attempts);
    let f = &raised.first()?.event;
    let counts = attempts::counts(attempts);
    // The request's first failed attempt, when the raised one is its retry.
    let first_try = attempts
        .iter()
        .rev()
        .filter(|a| a.failed && a.event.ts_ns < f.ts_ns && a.event.tid == f.tid)
        .find(|a| retry_of(a, attempts).is_some_and(|r| r.event.ts_ns == f.ts_ns));
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
    if let Some(first) = first_try {
        let e = &first.event;
        timeline.push(entry(
            e.ts_ns,
            format!("{} of {} fails ({})", e.op.name(), b(e.size), e.ret),
        ));
        let freed: u64 = frees_between(p.window, e.ts_ns, f.ts_ns)
            .iter()
            .map(|x| x.size)
            .sum();
        timeline.push(entry(
            e.ts_ns,
            format!(
                "the allocator releases its cache ({}) and retries",
                b(freed)
            ),
        ));
    }
    timeline.push(entry(
        f.ts_ns,
        format!(
            "{} of {} fails ({}): raised",
            f.op.name(),
            b(requested),
            f.ret
        ),
    ));
    Some(Chain {
        rule: Rule::Oom,
        severity: Severity::High,
        pid,
        title: format!("out of memory: {} of {} failed", f.op.name(), b(requested)),
        root: format!(
            "the allocator raised out of memory {} time(s): {} allocation(s) failed with out-of-memory, {} retried after releasing the cache; first raised: {} bytes requested{}",
            counts.ooms,
            counts.failures,
            counts.retries,
            requested,
            f.stack
                .and_then(|id| sites.get(&id))
                .map(|site| format!(" at {site}"))
                .unwrap_or_default()
        ),
        effect,
        compounding: Vec::new(),
        timeline,
        fix: vec![FIX_EXPANDABLE, FIX_MAX_SPLIT, "reduce the batch size or sequence length at this step".into()],
        evidence: format!(
            "{} failed allocation(s), {} retried, {} raised; memory info calls seen: {}",
            counts.failures,
            counts.retries,
            counts.ooms,
            info.is_some()
        ),
    })
}
