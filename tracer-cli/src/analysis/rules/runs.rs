//! What each rule reads and the function the table ([`super::RULES`]) runs for it: the facts of
//! one process at each stage of the analysis, and one function per rule over them. Each returns
//! its chain final: nothing edits a chain after its rule.

use std::collections::BTreeMap;

use super::{
    bypass, churn, failure, latency, leak, measured, replay, stalls, tenants, Chain, Findings,
    Host, Proc, Scan, SiteLabels, Window,
};
use crate::model::MessageRow;

/// Where a rule runs, and the function that finds its chain.
#[derive(Clone, Copy, Debug)]
pub enum Runs {
    /// Over the process's allocation replay (or the allocator's layout, where it was measured).
    Replay(fn(&mut Replaying<'_, '_>) -> Option<Chain>),
    /// Over one scan of the process's calls in the window.
    Scan(fn(&mut Scanning<'_, '_>) -> Option<Chain>),
    /// Over the allocator's measured layout, once the process's other chains are made.
    Layout(fn(&Laid<'_>) -> Option<Chain>),
    /// Across every process's devices.
    Devices(fn(&[crate::analysis::ranks::DeviceRow], i64) -> Vec<Chain>),
}

/// One process at the replay stage.
pub struct Replaying<'a, 'r> {
    pub p: &'r Proc<'a>,
    pub window: Window,
    pub host: &'r Host,
    pub sites: &'r SiteLabels,
    /// The allocator's own layout, where its probes were seen.
    pub measured: Option<&'r Findings>,
    pub(super) allocs: Option<latency::AllocTimes>,
    pub(super) samples: Vec<i64>,
    pub(super) replay: replay::Replayed<'a>,
}

/// One process at the scan stage.
pub struct Scanning<'a, 'r> {
    pub p: &'r Proc<'a>,
    pub everyone: &'r [Proc<'a>],
    pub scan: Scan<'a>,
    pub window: Window,
    pub host: &'r Host,
    pub sites: &'r SiteLabels,
    pub measured: Option<&'r Findings>,
    /// PyTorch's out-of-memory messages.
    pub messages: &'r [MessageRow],
    pub who: &'r tenants::Who<'r>,
    /// Who held the GPU at each out-of-memory: what the OOM rule found beside its chain.
    pub holders: &'r mut Vec<tenants::Holders>,
}

/// One process at the layout stage.
pub struct Laid<'r> {
    pub pid: u32,
    pub findings: &'r Findings,
    /// The out-of-memory its OOM chain raised for (that chain's last entry).
    pub fatal_ns: Option<i64>,
}

pub(super) fn latency_growth(f: &mut Replaying<'_, '_>) -> Option<Chain> {
    // Where the layout was measured, the fragmentation rule says what this one infers.
    if f.measured.is_some() {
        return None;
    }
    latency::latency_growth(f.p, f.allocs?, &mut f.replay, f.host)
}

pub(super) fn fragmentation(f: &mut Replaying<'_, '_>) -> Option<Chain> {
    measured::fragmentation_chain(f.p.pid, f.measured?)
}

pub(super) fn leak(f: &mut Replaying<'_, '_>) -> Option<Chain> {
    match f.measured {
        Some(m) => measured::leak_chain(f.p.pid, m, f.window),
        None => leak::leak(f.p, f.window, &f.samples, &f.replay, f.sites),
    }
}

pub(super) fn churn(f: &mut Replaying<'_, '_>) -> Option<Chain> {
    let cycles: BTreeMap<_, _> = std::mem::take(&mut f.replay.churn);
    let cycles = churn::allocator_pages_out(f.p, cycles);
    churn::churn(f.p.pid, cycles, f.window, f.measured.is_some()).map(|(c, _)| c)
}

/// `attempts` with the rescues among them, in time order.
fn with_rescued(
    attempts: &[crate::model::attempts::Attempt],
    rescued: &[crate::model::attempts::Attempt],
) -> Vec<crate::model::attempts::Attempt> {
    let mut all: Vec<_> = attempts.iter().chain(rescued).copied().collect();
    all.sort_by_key(|a| a.event.ts_ns);
    all
}

pub(super) fn allocator_retry(f: &mut Scanning<'_, '_>) -> Option<Chain> {
    failure::allocator_retry(f.p.pid, f.p.window, &f.scan.attempts)
}

/// The out-of-memory, told from the allocator's layout at the failure where it was measured
/// (its figures and PyTorch's message), with who else held the GPU then.
pub(super) fn oom(f: &mut Scanning<'_, '_>) -> Option<Chain> {
    // The scan reads no block events: the requests served after their failure (use_on_oom)
    // come from the layout's measure.
    let merged: Vec<_>;
    let attempts = match f.measured.filter(|m| !m.rescued.is_empty()) {
        Some(m) => {
            merged = with_rescued(&f.scan.attempts, &m.rescued);
            &merged
        }
        None => &f.scan.attempts,
    };
    let Some(mut chain) = failure::oom(f.p, f.everyone, attempts, f.sites) else {
        // PyTorch raised with no failed device call: its message alone tells the failure, when
        // it lies in the window and the trace saw the process's calls up to it (a window whose
        // calls were evicted draws nothing).
        let seen_up_to = |ts: i64| {
            f.p.all
                .iter()
                .any(|e| e.ts_ns <= ts && ts - e.ts_ns < 1_000_000_000)
        };
        return f
            .messages
            .iter()
            .filter(|m| f.window.contains(m.ts_ns) && seen_up_to(m.ts_ns))
            .find(|m| m.pid == f.p.pid && m.op == tracer_common::Op::TorchOom.name())
            .map(|m| super::arithmetic::from_message(f.p.pid, m));
    };
    let fatal_ns = chain.timeline.last().map(|t| t.ts_ns)?;
    let judged = f
        .measured
        .and_then(|m| judge(&mut chain, m, fatal_ns, f.messages));
    let message = f
        .messages
        .iter()
        .find(|m| m.pid == f.p.pid && m.op == tracer_common::Op::TorchOom.name())
        .map(|m| m.text.as_str());
    let mut holders = tenants::name_in_oom(&mut chain, f.p, f.everyone, f.who, message, judged);
    if let Some(h) = holders.as_mut() {
        // The failed call's own site (`--stack`): the line that asked, to set beside other ranks'.
        h.site =
            f.p.all
                .iter()
                .rev()
                .find(|e| e.ts_ns == h.at_ns && e.ret != 0)
                .and_then(|e| e.stack)
                .and_then(|id| f.sites.get(&id))
                .cloned();
    }
    f.holders.extend(holders);
    Some(chain)
}

/// The OOM chain's effect and fixes from the layout at the failure (`fatal_ns`) and PyTorch's
/// message after it; what that judged of the failure.
fn judge<'f>(
    chain: &mut Chain,
    m: &'f Findings,
    fatal_ns: i64,
    messages: &[MessageRow],
) -> Option<tenants::Judged<'f>> {
    let message = messages
        .iter()
        .find(|x| {
            x.pid == chain.pid && x.op == tracer_common::Op::TorchOom.name() && x.ts_ns >= fatal_ns
        })
        .map(|x| x.text.as_str());
    let forensic = measured::oom_forensics(m, fatal_ns, message)?;
    chain.effect = forensic.text;
    if let Some(text) = message {
        chain
            .evidence
            .push_str(&format!("; PyTorch raised: {text}"));
    }
    Some(tenants::Judged {
        failure: m
            .forensics
            .iter()
            .rfind(|x| x.ts_ns >= fatal_ns && x.ts_ns - fatal_ns < 1_000_000_000)?,
        fragmentation: forensic.fragmentation,
        split: forensic.split,
        clause: forensic.clause,
        fixes: forensic.fixes,
    })
}

pub(super) fn early_warning(l: &Laid<'_>) -> Option<Chain> {
    if !l.findings.visible {
        return None;
    }
    measured::warning_chain(l.pid, l.findings, l.fatal_ns)
}

pub(super) fn unknown_state(l: &Laid<'_>) -> Option<Chain> {
    measured::unknown_chain(l.pid, l.findings)
}

pub(super) fn startup_ledger(l: &Laid<'_>) -> Option<Chain> {
    super::startup::startup_chain(l.pid, l.findings.startup.as_ref()?)
}

pub(super) fn empty_cache_churn(f: &mut Scanning<'_, '_>) -> Option<Chain> {
    churn::empty_cache_churn(f.p.pid, f.p.window, f.scan.device_frees_ok)
}

pub(super) fn driver_bypass(f: &mut Scanning<'_, '_>) -> Option<Chain> {
    f.scan
        .driver_allocs
        .then(|| bypass::driver_bypass(f.p))
        .flatten()
}

pub(super) fn sync_stall(f: &mut Scanning<'_, '_>) -> Option<Chain> {
    stalls::sync_stall(f.p.pid, &f.scan.syncs, f.window, f.host)
}

pub(super) fn periodic_spike(f: &mut Scanning<'_, '_>) -> Option<Chain> {
    let durations = std::mem::take(&mut f.scan.device_alloc_durations);
    latency::periodic_spike(f.p.pid, f.p.window, durations, f.host)
}

pub(super) fn cpu_contention(f: &mut Scanning<'_, '_>) -> Option<Chain> {
    // Durations of every call only when CPU contention can be assessed.
    f.host
        .recorded
        .then(|| stalls::cpu_contention(f.p.pid, f.p.window, f.scan.all_durations(), f.host))
        .flatten()
}
