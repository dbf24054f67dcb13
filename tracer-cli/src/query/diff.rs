//! `tracer diff A B`: what changed between two runs of a job (two sessions: traces, or an
//! imported snapshot against a trace), one walk each: the allocator's peaks, the worst
//! fragmentation, when the first early warning and the first OOM came, the settings, and the
//! call sites whose peak held bytes changed most.

use std::{collections::HashMap, path::Path};

use anyhow::Result;
use serde::Serialize;
use tracer_common::{Op, OpClass};

use crate::{
    exit::user_error,
    model::{
        attempts::{self, Attempt, Attempts},
        layout::AllocConf,
        state::ProcessState,
        Event, StackId,
    },
    store::{events, Access, Store},
};

/// Call sites listed, most changed first.
const SITES_SHOWN: usize = 10;

/// One run's figures.
#[derive(Clone, Debug, Default, Serialize)]
pub struct RunFigures {
    pub session: i64,
    pub pid: u32,
    pub command: String,
    pub conf: String,
    pub requests: u64,
    pub peak_allocated: u64,
    pub peak_reserved: u64,
    /// The most reserved but not allocated at once.
    pub peak_cached: u64,
    /// The highest fragmentation of a pool caching at least a small segment (1 - largest free
    /// block / cached).
    pub worst_fragmentation: f64,
    /// Seconds from the run's first call to its first early warning, and to its first OOM.
    pub first_warning_s: Option<f64>,
    pub first_oom_s: Option<f64>,
    /// The call sites' peak held bytes (sessions with call sites: --stack, a snapshot's frames).
    #[serde(skip)]
    sites: HashMap<String, u64>,
}

/// A call site's peak held bytes in each run.
#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
pub struct SiteChange {
    pub site: String,
    pub a: u64,
    pub b: u64,
}

#[derive(Clone, Debug, Serialize)]
pub struct Diff {
    pub a: RunFigures,
    pub b: RunFigures,
    /// The call sites whose peak held bytes changed most (when both runs have call sites).
    pub sites: Vec<SiteChange>,
}

/// The process of `session` to compare: `pid`, else the one with the most block events.
fn busiest(conn: &rusqlite::Connection, session: i64) -> Result<u32> {
    let begin = super::begin(conn, session, i64::MIN, None)?;
    let mut counts: HashMap<u32, u64> = HashMap::new();
    super::walk_calls(conn, session, &begin, i64::MAX, None, |e| {
        if matches!(e.class(), OpClass::BlockAlloc | OpClass::Alloc) {
            *counts.entry(e.pid).or_default() += 1;
        }
    })?;
    counts
        .into_iter()
        .max_by_key(|&(pid, n)| (n, pid))
        .map(|(pid, _)| pid)
        .ok_or_else(|| {
            user_error(format!(
                "session {session} holds no allocation: nothing to compare (trace the job, or import its snapshot)"
            ))
        })
}

/// One walk over a session's process: its figures.
fn figures(db: &Path, session: i64, pid: Option<u32>) -> Result<RunFigures> {
    let store = Store::open(db, Access::ReadOnly)?;
    let conn = store.conn();
    let info = events::session(conn, Some(session))?;
    let pid = match pid {
        Some(p) => p,
        None => busiest(conn, info.id)?,
    };
    let conf = events::alloc_confs(conn, info.id)?
        .remove(&pid)
        .unwrap_or_default();
    let labels = events::site_labels(conn, info.id, &[])?;
    let begin = super::begin(conn, info.id, i64::MIN, Some(pid))?;
    let mut state = begin
        .states
        .iter()
        .find(|s| s.pid == pid)
        .cloned()
        .unwrap_or_else(|| fresh_state(pid, AllocConf::parse(&conf)));
    let mut f = RunFigures {
        session: info.id,
        pid,
        command: events::comms(conn, info.id)?
            .remove(&pid)
            .unwrap_or_default(),
        conf,
        ..RunFigures::default()
    };
    let mut first_ns = None;
    // Device allocations as PyTorch counts them: the OOM is the failed attempt no retry
    // followed, not a failure its allocator recovered from.
    let mut tracker = Attempts::default();
    let mut attempts: Vec<Attempt> = Vec::new();
    let mut held: HashMap<StackId, u64> = HashMap::new();
    let mut live: HashMap<u64, (StackId, u64)> = HashMap::new();
    super::walk_calls(conn, info.id, &begin, i64::MAX, Some(pid), |e| {
        let first = *first_ns.get_or_insert(e.ts_ns);
        let since = |ts: i64| (ts - first) as f64 / 1e9;
        let alarm = state.apply_memory(e);
        if alarm.is_some() && f.first_warning_s.is_none() {
            f.first_warning_s = Some(since(e.ts_ns));
        }
        tracker.push(e, &mut |a| attempts.push(a));
        if e.class() == OpClass::BlockAlloc {
            f.requests += 1;
        }
        track_site(e, &labels, &mut held, &mut live, &mut f.sites);
        if let Some(device) = e.device() {
            let t = state.layout.device_total(device);
            f.peak_allocated = f.peak_allocated.max(t.allocated);
            f.peak_reserved = f.peak_reserved.max(t.reserved);
            f.peak_cached = f.peak_cached.max(t.cached());
            f.worst_fragmentation = f
                .worst_fragmentation
                .max(state.layout.worst_fragmentation(device));
        }
    })?;
    tracker.finish(&mut |a| attempts.push(a));
    attempts.sort_by_key(|a| a.event.ts_ns);
    // PyTorch's own OOM message, where the probe saw it, is the OOM.
    let message = events::messages(conn, info.id)?
        .into_iter()
        .find(|m| m.pid == pid && m.op == Op::TorchOom.name())
        .map(|m| m.ts_ns);
    if let (Some(first), Some(at)) = (first_ns, attempts::oom_instant(&attempts, message)) {
        f.first_oom_s = Some((at - first) as f64 / 1e9);
    }
    Ok(f)
}

fn fresh_state(pid: u32, conf: AllocConf) -> ProcessState {
    ProcessState {
        pid,
        layout: crate::model::layout::Layout::new(conf),
        ..Default::default()
    }
}

/// Each call site's bytes held, and their peak under its label.
fn track_site(
    e: &Event,
    labels: &crate::model::SiteLabels,
    held: &mut HashMap<StackId, u64>,
    live: &mut HashMap<u64, (StackId, u64)>,
    peaks: &mut HashMap<String, u64>,
) {
    match e.class() {
        OpClass::BlockAlloc => {
            let Some(stack) = e.stack else { return };
            let now = held.entry(stack).or_default();
            *now += e.size;
            live.insert(e.ptr, (stack, e.size));
            if let Some(label) = labels.get(&stack) {
                let peak = peaks.entry(label.clone()).or_default();
                *peak = (*peak).max(*now);
            }
        }
        OpClass::BlockFree => {
            if let Some((stack, size)) = live.remove(&e.ptr) {
                if let Some(now) = held.get_mut(&stack) {
                    *now = now.saturating_sub(size);
                }
            }
        }
        _ => {}
    }
}

/// Compares session `a` with session `b` (each's process `pid_a`/`pid_b`, else its busiest).
pub fn diff(db: &Path, a: i64, b: i64, pid_a: Option<u32>, pid_b: Option<u32>) -> Result<Diff> {
    let (fa, fb) = (figures(db, a, pid_a)?, figures(db, b, pid_b)?);
    let mut sites: Vec<SiteChange> = fa
        .sites
        .keys()
        .chain(fb.sites.keys())
        .collect::<std::collections::BTreeSet<_>>()
        .into_iter()
        .map(|site| SiteChange {
            site: site.clone(),
            a: fa.sites.get(site).copied().unwrap_or(0),
            b: fb.sites.get(site).copied().unwrap_or(0),
        })
        .filter(|s| s.a != s.b)
        .collect();
    sites.sort_by_key(|s| std::cmp::Reverse(s.a.abs_diff(s.b)));
    sites.truncate(SITES_SHOWN);
    Ok(Diff {
        a: fa,
        b: fb,
        sites,
    })
}
