//! Analysis of recorded calls: per-process tables, outstanding allocations, and causal chains.
//! Pure functions over [`Event`] lists, so every rule is unit-tested on constructed data.

pub mod allocator;
mod host;
pub mod ranks;
mod replay;
mod rules;
mod scan;

use std::{
    borrow::Cow,
    collections::{BTreeMap, HashMap},
    ops::Range,
};

use serde::Serialize;
use tracer_common::{Op, OpClass};

use crate::model::{layout::AllocConf, Event, FastMap, Rank, SiteLabels, StackId, Window};
pub use host::Host;
pub use rules::Chain;
use rules::Proc;
use scan::Scan;

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
    /// The allocator's own figures, when PyTorch's probes were seen.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub allocator: Option<AllocatorFigures>,
}

/// Per op of one process's calls: count, errors, latency quantiles and bytes.
fn op_rows(scan: &mut Scan<'_>) -> Vec<OpRow> {
    Op::ALL
        .into_iter()
        .zip(scan.by_op.iter_mut())
        .filter(|(_, acc)| !acc.durations.is_empty())
        .map(|(op, acc)| {
            let d = &mut acc.durations;
            OpRow {
                op: op.name(),
                calls: d.len() as u64,
                errors: acc.errors,
                p50_ns: select_quantile(d, 0.5),
                p99_ns: select_quantile(d, 0.99),
                max_ns: d.iter().max().copied().unwrap_or(0),
                bytes: acc.bytes,
            }
        })
        .collect()
}

/// p99/p50 at which an allocation op's tail is called out.
pub const TAIL_RATIO_WARNING: f64 = 10.0;

/// One process's table (its outstanding allocations come from the replay, see [`analyze`]).
fn process_table(p: &Proc<'_>, scan: &mut Scan<'_>, comms: &HashMap<u32, String>) -> ProcessReport {
    let ops = op_rows(scan);
    let mut warnings = Vec::new();
    let (allocs, frees) = (scan.allocs_ok, scan.frees_ok);
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
        pid: p.pid,
        comm: comms.get(&p.pid).cloned(),
        ops,
        outstanding: Vec::new(),
        warnings,
        allocator: None,
    }
}

/// Allocations still live at the end, by op.
fn outstanding(live: &[&Event]) -> Vec<Outstanding> {
    let mut by_op: BTreeMap<Op, (u64, u64)> = BTreeMap::new();
    for e in live {
        let o = by_op.entry(e.op).or_default();
        o.0 += 1;
        o.1 += e.size;
    }
    by_op
        .into_iter()
        .map(|(op, (count, bytes))| Outstanding {
            op: op.name(),
            count,
            bytes,
        })
        .collect()
}

/// Calls grouped by process, and each process's range in them.
type Grouped<'a> = (Cow<'a, [Event]>, Vec<(u32, Range<usize>)>);

/// Calls in time order, grouped by process (pids ascending), each group still in time order.
/// Borrowed when there is only one process.
///
/// Otherwise a stable scatter, on every core: each takes a consecutive share of the calls, numbers
/// their processes, then writes each call into its share's part of its process's range.
fn group_by_pid(all: &[Event]) -> Grouped<'_> {
    let Some(first) = all.first() else {
        return (Cow::Borrowed(all), Vec::new());
    };
    if all.iter().all(|e| e.pid == first.pid) {
        return (Cow::Borrowed(all), vec![(first.pid, 0..all.len())]);
    }
    let threads = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .clamp(1, 8);
    let shares: Vec<&[Event]> = all.chunks(all.len().div_ceil(threads)).collect();
    // Per share: its processes in order of appearance, and each call's index among them.
    let numbered: Vec<(Vec<u32>, Vec<u32>)> = std::thread::scope(|scope| {
        let handles: Vec<_> = shares
            .iter()
            .map(|share| scope.spawn(move || number_processes(share)))
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|panic| std::panic::resume_unwind(panic))
            })
            .collect()
    });
    let mut pids: Vec<u32> = numbered
        .iter()
        .flat_map(|(p, _)| p.iter().copied())
        .collect();
    pids.sort_unstable();
    pids.dedup();
    // Per share: local process index -> rank in `pids`, and its calls per rank.
    let ranks: Vec<Vec<usize>> = numbered
        .iter()
        .map(|(local, _)| {
            local
                .iter()
                .map(|pid| pids.binary_search(pid).unwrap_or(0))
                .collect()
        })
        .collect();
    let counts: Vec<Vec<usize>> = numbered
        .iter()
        .zip(&ranks)
        .map(|((_, index), rank)| {
            let mut n = vec![0usize; pids.len()];
            for &i in index {
                n[rank[i as usize]] += 1;
            }
            n
        })
        .collect();
    let mut out: Vec<Event> = Vec::with_capacity(all.len());
    crate::model::advise_huge_pages(&mut out);
    // Process k's range is cut into one piece per share, in share order (which keeps time order).
    let mut pieces: Vec<Vec<&mut [std::mem::MaybeUninit<Event>]>> = (0..shares.len())
        .map(|_| Vec::with_capacity(pids.len()))
        .collect();
    let mut ranges = Vec::with_capacity(pids.len());
    let mut rest = &mut out.spare_capacity_mut()[..all.len()];
    let mut at = 0;
    for (k, pid) in pids.iter().enumerate() {
        let start = at;
        for (h, share_pieces) in pieces.iter_mut().enumerate() {
            let (piece, tail) = rest.split_at_mut(counts[h][k]);
            share_pieces.push(piece);
            rest = tail;
            at += counts[h][k];
        }
        ranges.push((*pid, start..at));
    }
    std::thread::scope(|scope| {
        for (((share, (_, index)), rank), mut share_pieces) in
            shares.iter().zip(&numbered).zip(&ranks).zip(pieces)
        {
            scope.spawn(move || {
                let mut next = vec![0usize; share_pieces.len()];
                for (e, &i) in share.iter().zip(index) {
                    let k = rank[i as usize];
                    share_pieces[k][next[k]].write(*e);
                    next[k] += 1;
                }
            });
        }
    });
    // SAFETY: the pieces tile 0..all.len() (their lengths are the shares' counts per process,
    // which sum to all.len()), and each share wrote every slot of its pieces exactly once: a
    // piece's length is the number of the share's calls of that process.
    unsafe { out.set_len(all.len()) };
    (Cow::Owned(out), ranges)
}

/// The processes of `calls` in order of appearance, and each call's index among them.
fn number_processes(calls: &[Event]) -> (Vec<u32>, Vec<u32>) {
    let mut index_of: FastMap<u32, u32> = FastMap::default();
    let mut pids = Vec::new();
    let mut last: Option<(u32, u32)> = None;
    let index = calls
        .iter()
        .map(|e| match last {
            Some((pid, i)) if pid == e.pid => i,
            _ => {
                let i = *index_of.entry(e.pid).or_insert_with(|| {
                    pids.push(e.pid);
                    pids.len() as u32 - 1
                });
                last = Some((e.pid, i));
                i
            }
        })
        .collect();
    (pids, index)
}

/// Each process's calls up to the window's end and those in the window.
fn processes<'a>(
    grouped: &'a [Event],
    ranges: &[(u32, Range<usize>)],
    window: Window,
) -> Vec<Proc<'a>> {
    ranges
        .iter()
        .map(|(pid, range)| {
            let evs = &grouped[range.clone()];
            let end = evs.partition_point(|e| e.ts_ns <= window.to_ns);
            let start = evs[..end].partition_point(|e| e.ts_ns < window.from_ns);
            Proc {
                pid: *pid,
                all: &evs[..end],
                window: &evs[start..end],
            }
        })
        .collect()
}

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
fn call_sites(procs: &[Proc<'_>], labels: &SiteLabels) -> Vec<CallSiteRow> {
    if labels.is_empty() {
        return Vec::new();
    }
    // By stack first (a hash per call), then by label: stacks that differ below the user's
    // frame share a label.
    let mut by_stack: FastMap<(Op, u32, StackId), (Vec<u64>, u64)> = FastMap::default();
    for p in procs {
        for e in p.window {
            if let Some(id) = e.stack {
                let (d, bytes) = by_stack.entry((e.op, e.pid, id)).or_default();
                d.push(e.duration_ns);
                if e.ret == 0 {
                    *bytes += e.size;
                }
            }
        }
    }
    let mut groups: BTreeMap<(Op, u32, &str), (Vec<u64>, u64)> = BTreeMap::new();
    for ((op, pid, id), (d, bytes)) in by_stack {
        if let Some(label) = labels.get(&id) {
            let g = groups.entry((op, pid, label.as_str())).or_default();
            g.0.extend(d);
            g.1 += bytes;
        }
    }
    let mut rows: Vec<CallSiteRow> = groups
        .into_iter()
        .map(|((op, pid, site), (mut d, bytes))| CallSiteRow {
            op: op.name(),
            pid,
            site: site.to_string(),
            calls: d.len() as u64,
            bytes,
            avg_ns: d.iter().sum::<u64>() / d.len().max(1) as u64,
            p99_ns: select_quantile(&mut d, 0.99),
        })
        .collect();
    rows.sort_by(|a, b| {
        (a.op, a.pid, std::cmp::Reverse(a.calls)).cmp(&(b.op, b.pid, std::cmp::Reverse(b.calls)))
    });
    let mut kept: HashMap<(&str, u32), usize> = HashMap::new();
    rows.retain(|r| {
        let n = kept.entry((r.op, r.pid)).or_default();
        *n += 1;
        *n <= TOP_SITES
    });
    rows
}

/// The allocator's figures at the window's end, per device and pool (PyTorch's probes seen).
#[derive(Clone, Debug, Serialize)]
pub struct AllocatorFigures {
    pub pools: Vec<PoolFigures>,
    /// New segments reserved while the cache held the bytes but no block that fit.
    pub forced_segments: u64,
    pub forced_bytes: u64,
}

#[derive(Clone, Debug, Serialize)]
pub struct PoolFigures {
    pub device: i32,
    pub pool: crate::model::layout::Pool,
    pub allocated: u64,
    pub reserved: u64,
    pub free_blocks: u64,
    pub largest_free: u64,
    pub fragmentation: f64,
    pub slack: f64,
}

fn allocator_figures(f: &allocator::Findings) -> AllocatorFigures {
    AllocatorFigures {
        pools: f
            .end
            .iter()
            .map(|((device, pool), s)| PoolFigures {
                device: *device,
                pool: *pool,
                allocated: s.allocated,
                reserved: s.reserved,
                free_blocks: s.free_blocks,
                largest_free: s.largest_free,
                fragmentation: s.fragmentation(),
                slack: s.slack_ratio(),
            })
            .collect(),
        forced_segments: f.forced.count,
        forced_bytes: f.forced.bytes,
    }
}

/// The early warning, and the OOM chain told from the layout at the failure.
fn allocator_chains(
    p: &Proc<'_>,
    f: &allocator::Findings,
    messages: &[crate::model::MessageRow],
    chains: &mut Vec<Chain>,
) {
    if !f.visible {
        return;
    }
    // The failure that was not recovered: the OOM chain's last timeline entry.
    let oom = chains
        .iter()
        .position(|c| c.rule == "oom" && c.pid == p.pid);
    let fatal_ns = oom.and_then(|i| chains[i].timeline.last()).map(|t| t.ts_ns);
    chains.extend(allocator::warning_chain(p.pid, f, fatal_ns));
    let (Some(i), Some(fatal_ns)) = (oom, fatal_ns) else {
        return;
    };
    let message = messages
        .iter()
        .find(|m| {
            m.pid == p.pid && m.op == tracer_common::Op::TorchOom.name() && m.ts_ns >= fatal_ns
        })
        .map(|m| m.text.as_str());
    let Some((forensics, fixes)) = allocator::oom_forensics(f, fatal_ns, message) else {
        return;
    };
    let c = &mut chains[i];
    c.effect = forensics;
    c.fix = fixes;
    if let Some(m) = message {
        c.evidence.push_str(&format!("; PyTorch raised: {m}"));
    }
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
    /// Each process on each device it used: its peaks and failures, to compare ranks.
    pub devices: Vec<ranks::DeviceRow>,
}

/// What explain knows of a session beside its calls.
pub struct Inputs<'a> {
    pub comms: &'a HashMap<u32, String>,
    pub sites: &'a SiteLabels,
    /// Each process's allocator settings (PYTORCH_CUDA_ALLOC_CONF).
    pub confs: &'a HashMap<u32, AllocConf>,
    /// PyTorch's out-of-memory messages.
    pub messages: &'a [crate::model::MessageRow],
    /// Each process's rank in a distributed job (RANK, LOCAL_RANK, WORLD_SIZE).
    pub ranks: &'a HashMap<u32, Rank>,
}

impl<'a> Inputs<'a> {
    /// Names and call sites only: default allocator settings, no messages.
    pub fn new(comms: &'a HashMap<u32, String>, sites: &'a SiteLabels) -> Inputs<'a> {
        static NO_CONFS: std::sync::OnceLock<HashMap<u32, AllocConf>> = std::sync::OnceLock::new();
        static NO_RANKS: std::sync::OnceLock<HashMap<u32, Rank>> = std::sync::OnceLock::new();
        Inputs {
            comms,
            sites,
            confs: NO_CONFS.get_or_init(HashMap::new),
            messages: &[],
            ranks: NO_RANKS.get_or_init(HashMap::new),
        }
    }
}

/// `all` holds the session's events up to the window's end, in time order (earlier events are
/// needed to know which allocations are live).
pub fn analyze(
    session: i64,
    all: &[Event],
    host: &Host,
    window: Window,
    inputs: &Inputs<'_>,
) -> Report {
    let (comms, sites) = (inputs.comms, inputs.sites);
    let (grouped, ranges) = group_by_pid(all);
    let everyone = processes(&grouped, &ranges, window);
    let active: Vec<Proc<'_>> = everyone
        .iter()
        .copied()
        .filter(|p| !p.window.is_empty())
        .collect();
    // The replaying rules on this core; the tables, the other rules and the call sites on the
    // other (they read the same calls independently).
    let (replayed, (mut processes, direct, call_sites)) = std::thread::scope(|scope| {
        let others = scope.spawn(|| {
            let mut tables = Vec::with_capacity(active.len());
            let mut direct = Vec::with_capacity(active.len());
            for p in &active {
                let mut scan = Scan::of(p.window);
                tables.push(process_table(p, &mut scan, comms));
                direct.push(rules::direct(p, &everyone, scan, window, host, sites));
            }
            (tables, direct, call_sites(&active, sites))
        });
        let replayed = rules::replayed(&active, window, host, sites);
        let layouts: Vec<allocator::Findings> = active
            .iter()
            .map(|p| {
                let conf = inputs.confs.get(&p.pid).copied().unwrap_or_default();
                allocator::replay(p.all, window, conf, sites)
            })
            .collect();
        let others = others
            .join()
            .unwrap_or_else(|panic| std::panic::resume_unwind(panic));
        ((replayed, layouts), others)
    });
    let (replayed, layouts) = replayed;
    let mut replay_chains = Vec::with_capacity(replayed.len());
    for ((table, (mut chains, live)), findings) in processes.iter_mut().zip(replayed).zip(&layouts)
    {
        table.outstanding = outstanding(&live);
        if findings.visible {
            // The allocator's own layout replaces the inference from latencies.
            chains.replace_with_measured(
                allocator::fragmentation_chain(table.pid, findings),
                allocator::leak_chain(table.pid, findings, window),
            );
            table.allocator = Some(allocator_figures(findings));
        }
        replay_chains.push(chains);
    }
    let mut chains = rules::merge(replay_chains, direct);
    for (p, findings) in active.iter().zip(&layouts) {
        allocator_chains(p, findings, inputs.messages, &mut chains);
    }
    let devices = device_rows(&active, &layouts, inputs.ranks);
    chains.extend(ranks::outlier_chain(&devices, window.from_ns));
    chains.sort_by_key(|c| std::cmp::Reverse(c.severity));
    Report {
        session,
        window,
        events_in_window: active.iter().map(|p| p.window.len() as u64).sum(),
        host_context: host.recorded,
        processes,
        chains,
        call_sites,
        devices,
    }
}

/// Each process on each device, for comparing ranks.
fn device_rows(
    active: &[Proc<'_>],
    layouts: &[allocator::Findings],
    ranks: &HashMap<u32, Rank>,
) -> Vec<ranks::DeviceRow> {
    let mut rows = Vec::new();
    for (p, f) in active.iter().zip(layouts) {
        for (&device, peak) in &f.devices {
            let rank = ranks.get(&p.pid).copied();
            rows.push(ranks::DeviceRow::new(p.pid, rank, device, f.visible, peak));
        }
    }
    rows
}

#[cfg(test)]
mod tests;
