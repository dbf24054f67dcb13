//! Analysis of recorded calls: per-process tables, outstanding allocations, and causal chains.
//! Pure functions over [`Event`] lists, so every rule is unit-tested on constructed data. The
//! one pass that fills explain's answer is here; the answer's types are in answer.rs, the
//! rules in rules/.

pub mod allocator;
mod answer;
mod collect;
mod forensics;
mod host;
pub mod oom;
pub mod ranks;
mod replay;
mod rules;
mod scan;
pub mod startup;

use std::{
    borrow::Cow,
    collections::{BTreeMap, HashMap},
    ops::Range,
};

use tracer_common::{Op, OpClass};

use crate::model::{layout::AllocConf, Event, FastMap, Rank, SiteLabels, StackId, Window};
pub use answer::*;
pub use collect::{is_block_event, BlockTally, Collected, Collector, OpTally};
pub use host::Host;
use rules::Proc;
pub use rules::{Chain, Fix, Rule};
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

/// [`select_quantile`] of `values` and `zeros` more zeros (counted, not kept).
pub fn select_quantile_with_zeros(values: &mut [u64], zeros: u64, q: f64) -> u64 {
    let n = values.len() as u64 + zeros;
    if n == 0 {
        return 0;
    }
    let rank = ((q * n as f64).ceil() as u64).clamp(1, n);
    if rank <= zeros {
        return 0;
    }
    *values.select_nth_unstable((rank - zeros - 1) as usize).1
}

/// Per op of one process's calls: count, errors, latency quantiles and bytes (its block events
/// from their tally).
fn op_rows(scan: &mut Scan<'_>, blocks: Option<&mut BlockTally>) -> Vec<OpRow> {
    let mut blocks = blocks.map(|b| &mut b.ops);
    Op::ALL
        .into_iter()
        .zip(scan.by_op.iter_mut())
        .filter_map(|(op, acc)| {
            if let Some(t) = blocks.as_mut().and_then(|b| b.get_mut(&op)) {
                return Some(OpRow {
                    op: op.name(),
                    calls: t.calls,
                    errors: t.errors,
                    p50_ns: select_quantile_with_zeros(&mut t.durations, t.zero_durations, 0.5),
                    p99_ns: select_quantile_with_zeros(&mut t.durations, t.zero_durations, 0.99),
                    max_ns: t.durations.iter().max().copied().unwrap_or(0),
                    bytes: t.bytes,
                });
            }
            if acc.durations.is_empty() {
                return None;
            }
            let d = &mut acc.durations;
            Some(OpRow {
                op: op.name(),
                calls: d.len() as u64,
                errors: acc.errors,
                p50_ns: select_quantile(d, 0.5),
                p99_ns: select_quantile(d, 0.99),
                max_ns: d.iter().max().copied().unwrap_or(0),
                bytes: acc.bytes,
            })
        })
        .collect()
}

/// p99/p50 at which an allocation op's tail is called out.
pub const TAIL_RATIO_WARNING: f64 = 10.0;

/// One process's table (its outstanding allocations come from the replay, see [`analyze`]).
fn process_table(
    p: &Proc<'_>,
    scan: &mut Scan<'_>,
    blocks: Option<&mut BlockTally>,
    comms: &HashMap<u32, String>,
) -> ProcessReport {
    let ops = op_rows(scan, blocks);
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
                    "{} p99 ({}) is {:.0}x p50 ({}) - a slow tail",
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

/// Each process's calls up to the window's end and those in the window (a process with block
/// events only has none).
fn processes<'a>(
    grouped: &'a [Event],
    ranges: &[(u32, Range<usize>)],
    window: Window,
    blocks: &BTreeMap<u32, BlockTally>,
) -> Vec<Proc<'a>> {
    let mut out: Vec<Proc<'a>> = ranges
        .iter()
        .map(|(pid, range)| {
            let evs = &grouped[range.clone()];
            let end = evs.partition_point(|e| e.ts_ns <= window.to_ns);
            let start = evs[..end].partition_point(|e| e.ts_ns < window.from_ns);
            Proc {
                pid: *pid,
                all: &evs[..end],
                window: &evs[start..end],
                expandable: &[],
                expandable_setting: false,
            }
        })
        .collect();
    for &pid in blocks.keys() {
        if !ranges.iter().any(|(p, _)| *p == pid) {
            out.push(Proc {
                pid,
                all: &[],
                window: &[],
                expandable: &[],
                expandable_setting: false,
            });
        }
    }
    out.sort_by_key(|p| p.pid);
    out
}

/// Call sites shown per op.
pub const TOP_SITES: usize = 5;

/// The busiest call sites of each op in the window (by calls), per process: the CUDA calls'
/// and the block events' tallies.
fn call_sites(
    procs: &[Proc<'_>],
    blocks: &BTreeMap<u32, BlockTally>,
    labels: &SiteLabels,
) -> Vec<CallSiteRow> {
    if labels.is_empty() {
        return Vec::new();
    }
    // By stack first (a hash per call), then by label: stacks that differ below the user's
    // frame share a label.
    let mut by_stack: FastMap<(Op, u32, StackId), OpTally> = FastMap::default();
    for p in procs {
        for e in p.window {
            if let Some(id) = e.stack {
                let t = by_stack.entry((e.op, e.pid, id)).or_default();
                t.calls += 1;
                t.durations.push(e.duration_ns);
                if e.ret == 0 {
                    t.bytes += e.size;
                }
            }
        }
    }
    let mut groups: BTreeMap<(Op, u32, &str), OpTally> = BTreeMap::new();
    let tallied = blocks.iter().flat_map(|(&pid, b)| {
        b.sites
            .iter()
            .map(move |(&(op, id), t)| ((op, pid, id), t.clone()))
    });
    for ((op, pid, id), t) in by_stack.into_iter().chain(tallied) {
        if let Some(label) = labels.get(&id) {
            let g = groups.entry((op, pid, label.as_str())).or_default();
            g.calls += t.calls;
            g.durations.extend(t.durations);
            g.zero_durations += t.zero_durations;
            g.bytes += t.bytes;
        }
    }
    let mut rows: Vec<CallSiteRow> = groups
        .into_iter()
        .map(|((op, pid, site), mut t)| CallSiteRow {
            op: op.name(),
            pid,
            site: site.to_string(),
            calls: t.calls,
            bytes: t.bytes,
            avg_ns: t.durations.iter().sum::<u64>() / t.calls.max(1),
            p99_ns: select_quantile_with_zeros(&mut t.durations, t.zero_durations, 0.99),
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
    /// Each process's job and the physical GPU behind its device numbers.
    pub placements: &'a HashMap<u32, crate::model::Placement>,
    /// The library that made each call site's call (`--stack`).
    pub owners: &'a HashMap<crate::model::StackId, String>,
    /// What NVML said of each GPU, in time order.
    pub gpu_samples: &'a [crate::model::GpuSample],
    /// The processes whose settings turn on PyTorch's expandable segments.
    pub expandable: &'a std::collections::HashSet<u32>,
    /// The session's times give only the order of its calls.
    pub untimed: bool,
    /// Each process's memory budget, where its command line gives one (a serving engine's).
    pub budgets: &'a HashMap<u32, startup::Budget>,
}

impl<'a> Inputs<'a> {
    /// Names and call sites only: default allocator settings, no messages.
    pub fn new(comms: &'a HashMap<u32, String>, sites: &'a SiteLabels) -> Inputs<'a> {
        static NO_CONFS: std::sync::OnceLock<HashMap<u32, AllocConf>> = std::sync::OnceLock::new();
        static NO_RANKS: std::sync::OnceLock<HashMap<u32, Rank>> = std::sync::OnceLock::new();
        static NO_PLACEMENTS: std::sync::OnceLock<HashMap<u32, crate::model::Placement>> =
            std::sync::OnceLock::new();
        static NO_OWNERS: std::sync::OnceLock<HashMap<crate::model::StackId, String>> =
            std::sync::OnceLock::new();
        static NO_EXPANDABLE: std::sync::OnceLock<std::collections::HashSet<u32>> =
            std::sync::OnceLock::new();
        static NO_BUDGETS: std::sync::OnceLock<HashMap<u32, startup::Budget>> =
            std::sync::OnceLock::new();
        Inputs {
            comms,
            sites,
            confs: NO_CONFS.get_or_init(HashMap::new),
            messages: &[],
            ranks: NO_RANKS.get_or_init(HashMap::new),
            placements: NO_PLACEMENTS.get_or_init(HashMap::new),
            owners: NO_OWNERS.get_or_init(HashMap::new),
            gpu_samples: &[],
            expandable: NO_EXPANDABLE.get_or_init(Default::default),
            untimed: false,
            budgets: NO_BUDGETS.get_or_init(HashMap::new),
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
) -> Explanation {
    let mut c = Collector::new(window, inputs, Vec::new());
    for e in all {
        c.feed(e);
    }
    analyze_collected(session, c.finish(), host, window, inputs)
}

/// The report from one pass's gatherings ([`Collector`]).
pub fn analyze_collected(
    session: i64,
    collected: Collected,
    host: &Host,
    window: Window,
    inputs: &Inputs<'_>,
) -> Explanation {
    let (comms, sites) = (inputs.comms, inputs.sites);
    let Collected {
        calls,
        processes: gathered,
    } = collected;
    let (mut findings, mut blocks): (
        BTreeMap<u32, allocator::Findings>,
        BTreeMap<u32, BlockTally>,
    ) = gathered
        .into_iter()
        .map(|(pid, (f, b))| ((pid, f), (pid, b)))
        .unzip();
    let (grouped, ranges) = group_by_pid(&calls);
    let everyone = processes(&grouped, &ranges, window, &blocks);
    let active: Vec<Proc<'_>> = everyone
        .iter()
        .copied()
        .filter(|p| !p.window.is_empty() || blocks.get(&p.pid).is_some_and(|b| b.in_window > 0))
        .collect();
    let layouts: Vec<allocator::Findings> = active
        .iter()
        .map(|p| findings.remove(&p.pid).unwrap_or_default())
        .collect();
    let active: Vec<Proc<'_>> = active
        .into_iter()
        .zip(&layouts)
        .map(|(p, f)| Proc {
            expandable: &f.expandable,
            expandable_setting: inputs.expandable.contains(&p.pid),
            ..p
        })
        .collect();
    let who = rules::Who {
        placements: inputs.placements,
        comms,
        owners: inputs.owners,
        gpu_samples: inputs.gpu_samples,
    };
    let measured: Vec<Option<&allocator::Findings>> =
        layouts.iter().map(|f| f.visible.then_some(f)).collect();
    // The replaying rules on this core; the tables, the scanning rules and the call sites on
    // the other (they read the same calls independently).
    let (replayed, (mut processes, scanned, holders, call_sites)) = std::thread::scope(|scope| {
        let blocks = &mut blocks;
        let (everyone, active, measured, who) = (&everyone, &active, &measured, &who);
        let others = scope.spawn(move || {
            let mut tables = Vec::with_capacity(active.len());
            let mut scanned = Vec::with_capacity(active.len());
            let mut holders = Vec::new();
            for (p, measured) in active.iter().zip(measured) {
                let mut scan = Scan::of(p.window, blocks.get(&p.pid));
                tables.push(process_table(p, &mut scan, blocks.get_mut(&p.pid), comms));
                scanned.push(rules::scanned(&mut rules::Scanning {
                    p,
                    everyone,
                    scan,
                    window,
                    host,
                    sites,
                    measured: *measured,
                    messages: inputs.messages,
                    who,
                    holders: &mut holders,
                }));
            }
            (tables, scanned, holders, call_sites(active, blocks, sites))
        });
        let replayed = rules::replayed(active, measured, window, host, sites);
        let others = others
            .join()
            .unwrap_or_else(|panic| std::panic::resume_unwind(panic));
        (replayed, others)
    });
    let mut replay_chains = Vec::with_capacity(replayed.len());
    for ((table, (chains, live)), findings) in processes.iter_mut().zip(replayed).zip(&layouts) {
        table.outstanding = outstanding(&live);
        if findings.visible {
            table.allocator = Some(allocator_figures(findings));
        }
        replay_chains.push(chains);
    }
    let mut chains = rules::merge(replay_chains, scanned);
    if inputs.untimed {
        // Rules that read rates, durations or intervals say nothing of a session whose times
        // give only the order of its calls.
        chains.retain(|c| !c.rule.timed());
    }
    for (p, findings) in active.iter().zip(&layouts) {
        // The failure that was not recovered: the OOM chain's last timeline entry.
        let fatal_ns = chains
            .iter()
            .find(|c| c.rule == Rule::Oom && c.pid == p.pid)
            .and_then(|c| c.timeline.last())
            .map(|t| t.ts_ns);
        chains.extend(rules::laid(&rules::Laid {
            pid: p.pid,
            findings,
            fatal_ns,
        }));
    }
    let devices = device_rows(&active, &layouts, inputs.ranks, &who);
    let states = active
        .iter()
        .zip(&layouts)
        .filter_map(|(p, f)| {
            Some(StateNote {
                pid: p.pid,
                since_ns: f.unknown.since_ns?,
                exact_ns: f.unknown.exact_ns,
                last_evidence_ns: f.unknown.last_evidence_ns,
                longest_life_events: f.unknown.longest_life_events,
                gaps: f.unknown.gaps,
                freed_unseen: (f.unknown.freed_unseen, f.unknown.freed_unseen_bytes),
                carried: f.carried,
                orphans: f.orphans,
            })
        })
        .collect();
    chains.extend(rules::across(&devices, window.from_ns));
    chains.sort_by_key(|c| std::cmp::Reverse(c.severity));
    let events_in_window = active
        .iter()
        .map(|p| p.window.len() as u64 + blocks.get(&p.pid).map_or(0, |b| b.in_window))
        .sum();
    Explanation {
        session,
        window,
        events_in_window,
        host_context: host.recorded,
        host_while_armed: host.recorded && host.while_armed(),
        processes,
        chains,
        call_sites,
        devices,
        holders,
        coverage: Coverage {
            states,
            ..Coverage::default()
        },
        untimed: inputs.untimed,
        arming: Vec::new(),
        startups: active
            .iter()
            .zip(&layouts)
            .filter_map(|(p, f)| {
                Some(startup::Startup {
                    pid: p.pid,
                    ledger: f.startup.clone()?,
                })
            })
            .collect(),
    }
}

/// Each process on each device, for comparing ranks.
fn device_rows(
    active: &[Proc<'_>],
    layouts: &[allocator::Findings],
    ranks: &HashMap<u32, Rank>,
    who: &rules::Who<'_>,
) -> Vec<ranks::DeviceRow> {
    let mut rows = Vec::new();
    for (p, f) in active.iter().zip(layouts) {
        let place = who.placement(p.pid);
        for (&device, peak) in &f.devices {
            let rank = ranks.get(&p.pid).copied();
            let mut row = ranks::DeviceRow::new(p.pid, rank, device, f.visible, peak);
            row.unknown = !f.unknown.exact();
            row.place(&place);
            rows.push(row);
        }
    }
    rows
}

#[cfg(test)]
mod tests;
