//! Analysis of recorded calls: per-process tables, outstanding allocations, and causal chains.
//! Pure functions over [`Event`] lists, so every rule is unit-tested on constructed data.

mod host;
mod rules;

use std::collections::{BTreeMap, HashMap};

use serde::Serialize;
use tracer_common::{Op, OpClass, Space};

pub use host::{Host, OffSlice};

/// The hash map of the replays: keys are our own pointers and ids, not attacker-chosen, and
/// SipHash was a tenth of explain's time over millions of calls.
pub type FastMap<K, V> = HashMap<K, V, foldhash::fast::FixedState>;
pub use rules::Chain;

/// One stored call, as analysis needs it.
#[derive(Clone, Debug, PartialEq)]
pub struct Event {
    /// Wall clock at entry, ns since the epoch.
    pub ts_ns: i64,
    pub pid: u32,
    pub tid: u32,
    pub op: Op,
    pub device: Option<i32>,
    pub size: Option<u64>,
    pub ptr: Option<u64>,
    pub ret: i32,
    pub duration_ns: u64,
    /// Op-specific (free bytes of a MemGetInfo, ...).
    pub aux0: Option<u64>,
    /// Op-specific (total bytes of a MemGetInfo, ...).
    pub aux1: Option<u64>,
    /// The call site (stacks.id), when traced with --stack.
    pub stack: Option<i64>,
}

impl Event {
    pub fn class(&self) -> OpClass {
        self.op.spec().class
    }

    pub fn space(&self) -> Space {
        self.op.spec().space
    }

    pub fn end_ns(&self) -> i64 {
        self.ts_ns + self.duration_ns as i64
    }
}

/// The time range analysed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Window {
    pub from_ns: i64,
    pub to_ns: i64,
}

impl Window {
    pub fn contains(&self, ts: i64) -> bool {
        ts >= self.from_ns && ts <= self.to_ns
    }

    pub fn secs(&self) -> f64 {
        (self.to_ns - self.from_ns).max(1) as f64 / 1e9
    }
}

/// Entry time of the first call and end time of the last one to end, of calls in time order.
pub fn span(events: &[Event]) -> Option<(i64, i64)> {
    let first = events.first()?.ts_ns;
    Some((first, events.iter().map(Event::end_ns).max()?))
}

/// Exact quantile of sorted values (nearest rank): the reference for [`select_quantile`].
#[cfg(test)]
pub fn quantile(sorted: &[u64], q: f64) -> u64 {
    if sorted.is_empty() {
        return 0;
    }
    let rank = ((q * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
    sorted[rank - 1]
}

/// The same nearest-rank quantile as [`quantile`], in linear time: reorders `values` in place
/// (a full sort of millions of durations per rule was most of explain's analysis time).
pub fn select_quantile(values: &mut [u64], q: f64) -> u64 {
    if values.is_empty() {
        return 0;
    }
    let rank = ((q * values.len() as f64).ceil() as usize).clamp(1, values.len());
    *values.select_nth_unstable(rank - 1).1
}

#[derive(Clone, Debug, Serialize)]
pub struct OpRow {
    pub op: &'static str,
    pub calls: u64,
    pub errors: u64,
    pub p50_ns: u64,
    pub p99_ns: u64,
    pub max_ns: u64,
    /// Bytes of successful allocations or frees.
    pub bytes: u64,
}

#[derive(Clone, Debug, Serialize)]
pub struct Outstanding {
    pub op: &'static str,
    pub count: u64,
    pub bytes: u64,
}

#[derive(Clone, Debug, Serialize)]
pub struct ProcessReport {
    pub pid: u32,
    pub comm: Option<String>,
    pub ops: Vec<OpRow>,
    /// Allocations made (since the session began) and not freed by the end of the window.
    pub outstanding: Vec<Outstanding>,
    pub warnings: Vec<String>,
}

fn op_rows(events: &[&Event]) -> Vec<OpRow> {
    let mut by_op: BTreeMap<Op, Vec<&Event>> = BTreeMap::new();
    for e in events {
        by_op.entry(e.op).or_default().push(e);
    }
    by_op
        .into_iter()
        .map(|(op, evs)| {
            let mut d: Vec<u64> = evs.iter().map(|e| e.duration_ns).collect();
            let counts_bytes = matches!(op.spec().class, OpClass::Alloc | OpClass::Free);
            OpRow {
                op: op.name(),
                calls: evs.len() as u64,
                errors: evs.iter().filter(|e| e.ret != 0).count() as u64,
                p50_ns: select_quantile(&mut d, 0.5),
                p99_ns: select_quantile(&mut d, 0.99),
                max_ns: d.iter().max().copied().unwrap_or(0),
                bytes: if counts_bytes {
                    evs.iter()
                        .filter(|e| e.ret == 0)
                        .filter_map(|e| e.size)
                        .sum()
                } else {
                    0
                },
            }
        })
        .collect()
}

/// Live allocations after replaying `events` (in time order): (pid, space, ptr) -> event.
pub fn live_allocations<'a>(
    events: impl IntoIterator<Item = &'a Event>,
) -> FastMap<(u32, u32, u64), &'a Event> {
    let mut live = FastMap::default();
    for e in events {
        let (Some(ptr), true) = (e.ptr, e.ret == 0) else {
            continue;
        };
        let key = (e.pid, e.space() as u32, ptr);
        match e.class() {
            OpClass::Alloc => {
                live.insert(key, e);
            }
            OpClass::Free => {
                live.remove(&key);
            }
            _ => {}
        }
    }
    live
}

/// p99/p50 at which an allocation op's tail is called out.
pub const TAIL_RATIO_WARNING: f64 = 10.0;

pub fn per_process(
    all: &[Event],
    window: Window,
    comms: &HashMap<u32, String>,
) -> Vec<ProcessReport> {
    let mut pids: Vec<u32> = all
        .iter()
        .filter(|e| window.contains(e.ts_ns))
        .map(|e| e.pid)
        .collect();
    pids.sort_unstable();
    pids.dedup();
    let live = live_allocations(all.iter().filter(|e| e.ts_ns <= window.to_ns));
    pids.into_iter()
        .map(|pid| {
            let events: Vec<&Event> = all
                .iter()
                .filter(|e| e.pid == pid && window.contains(e.ts_ns))
                .collect();
            let ops = op_rows(&events);
            let mut outstanding: BTreeMap<Op, (u64, u64)> = BTreeMap::new();
            for ((p, _, _), e) in &live {
                if *p == pid {
                    let o = outstanding.entry(e.op).or_default();
                    o.0 += 1;
                    o.1 += e.size.unwrap_or(0);
                }
            }
            let mut warnings = Vec::new();
            let (allocs, frees) =
                events
                    .iter()
                    .fold((0u64, 0u64), |(a, f), e| match (e.class(), e.ret) {
                        (OpClass::Alloc, 0) => (a + 1, f),
                        (OpClass::Free, 0) => (a, f + 1),
                        _ => (a, f),
                    });
            if allocs > frees {
                warnings.push(format!(
                    "malloc/free imbalance: {} allocations without a matching free in the window",
                    allocs - frees
                ));
            }
            for row in &ops {
                let op = Op::ALL.iter().find(|o| o.name() == row.op).copied();
                let is_alloc = op.is_some_and(|o| o.spec().class == OpClass::Alloc);
                if is_alloc && row.calls >= 20 && row.p50_ns > 0 {
                    let ratio = row.p99_ns as f64 / row.p50_ns as f64;
                    if ratio >= TAIL_RATIO_WARNING {
                        warnings.push(format!(
                            "{} p99 ({}) is {:.0}x p50 ({}) - fragmentation pressure",
                            row.op,
                            crate::units::format_ns(row.p99_ns),
                            ratio,
                            crate::units::format_ns(row.p50_ns)
                        ));
                    }
                }
            }
            ProcessReport {
                pid,
                comm: comms.get(&pid).cloned(),
                ops,
                outstanding: outstanding
                    .into_iter()
                    .map(|(op, (count, bytes))| Outstanding {
                        op: op.name(),
                        count,
                        bytes,
                    })
                    .collect(),
                warnings,
            }
        })
        .collect()
}

/// Call sites by stacks.id: the first frame in the user's own code, as "train.py:74 (step)".
pub type SiteLabels = HashMap<i64, String>;

/// The calls of one op from one call site.
#[derive(Clone, Debug, Serialize)]
pub struct CallSiteRow {
    pub op: &'static str,
    pub pid: u32,
    pub site: String,
    pub calls: u64,
    /// Bytes of the successful calls.
    pub bytes: u64,
    pub avg_ns: u64,
    pub p99_ns: u64,
}

/// Call sites shown per op.
pub const TOP_SITES: usize = 5;

/// The busiest call sites of each op in the window (by calls), per process.
pub fn call_sites(all: &[Event], window: Window, labels: &SiteLabels) -> Vec<CallSiteRow> {
    if labels.is_empty() {
        return Vec::new();
    }
    let mut groups: BTreeMap<(Op, u32, &str), Vec<&Event>> = BTreeMap::new();
    for e in all.iter().filter(|e| window.contains(e.ts_ns)) {
        if let Some(label) = e.stack.and_then(|id| labels.get(&id)) {
            groups.entry((e.op, e.pid, label.as_str())).or_default().push(e);
        }
    }
    let mut rows: Vec<CallSiteRow> = groups
        .into_iter()
        .map(|((op, pid, site), evs)| {
            let mut d: Vec<u64> = evs.iter().map(|e| e.duration_ns).collect();
            CallSiteRow {
                op: op.name(),
                pid,
                site: site.to_string(),
                calls: evs.len() as u64,
                bytes: evs.iter().filter(|e| e.ret == 0).filter_map(|e| e.size).sum(),
                avg_ns: d.iter().sum::<u64>() / d.len().max(1) as u64,
                p99_ns: select_quantile(&mut d, 0.99),
            }
        })
        .collect();
    rows.sort_by(|a, b| (a.op, a.pid, std::cmp::Reverse(a.calls)).cmp(&(b.op, b.pid, std::cmp::Reverse(b.calls))));
    let mut kept: HashMap<(&str, u32), usize> = HashMap::new();
    rows.retain(|r| {
        let n = kept.entry((r.op, r.pid)).or_default();
        *n += 1;
        *n <= TOP_SITES
    });
    rows
}

/// Everything explain shows.
#[derive(Clone, Debug, Serialize)]
pub struct Report {
    pub session: i64,
    pub window: Window,
    pub events_in_window: u64,
    /// The scheduler was traced: CPU contention can be tied to the calls it slowed.
    pub host_context: bool,
    pub processes: Vec<ProcessReport>,
    pub chains: Vec<Chain>,
    /// Top call sites per op (--stack sessions).
    pub call_sites: Vec<CallSiteRow>,
}

/// `all` holds the session's events up to the window's end, in time order (earlier events are
/// needed to know which allocations are live).
pub fn analyze(
    session: i64,
    all: &[Event],
    host: &Host,
    window: Window,
    comms: &HashMap<u32, String>,
    sites: &SiteLabels,
) -> Report {
    // The tables and the rules read the same events independently: one core each.
    let (mut chains, processes) = std::thread::scope(|scope| {
        let tables = scope.spawn(|| per_process(all, window, comms));
        let chains = rules::all(all, host, window, sites);
        let processes = tables
            .join()
            .unwrap_or_else(|panic| std::panic::resume_unwind(panic));
        (chains, processes)
    });
    chains.sort_by_key(|c| std::cmp::Reverse(c.severity));
    Report {
        session,
        window,
        events_in_window: all.iter().filter(|e| window.contains(e.ts_ns)).count() as u64,
        host_context: host.recorded,
        processes,
        chains,
        call_sites: call_sites(all, window, sites),
    }
}

#[cfg(test)]
mod tests;
