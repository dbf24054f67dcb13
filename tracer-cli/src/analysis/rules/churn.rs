//! Memory given back and taken again: tight alloc/free cycles (rule 5a), bursts of frees and
//! re-allocations (rule 5b), and the expandable segments' own pages, which are neither.

use std::collections::BTreeMap;

use tracer_common::{Library, Op, OpClass, Space};

use super::{entry, Chain, Fix, Proc, Rule, Severity, EXPANDABLE};
use crate::{
    analysis::{select_quantile, Event, FastMap, Window},
    units::{format_bytes as b, format_ns as t},
};

/// Rule 5a: tight alloc/free cycles of the same size (found by the replay).
/// `measured`: the allocator's own layout is seen, so segments given back and taken again are
/// its doing, not the program's.
pub(super) fn churn(
    pid: u32,
    cycles: BTreeMap<(Op, u64), Vec<u64>>,
    window: Window,
    measured: bool,
) -> Option<(Chain, Op)> {
    let (mut chain, op) = churn_chain(pid, cycles, window)?;
    if measured && op.spec().space == Space::Device {
        cache_released(&mut chain);
    }
    Some((chain, op))
}

/// Churn of the allocator's segments: its cache released and refilled.
fn cache_released(c: &mut Chain) {
    c.title = c.title.replace(
        "alloc/free churn",
        "the allocator's cache released and refilled",
    );
    c.effect = "PyTorch's caching allocator gave these segments back to the device and reserved them again: it releases cached blocks to retry a cudaMalloc the device refused (running near its limit), or torch.cuda.empty_cache() is called; each cycle pays cudaMalloc again".into();
    c.fix = vec![
        "leave the device headroom (a smaller batch or sequence length), or remove empty_cache() from the loop".into(),
        Fix::setting(
            EXPANDABLE,
            "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True: the cache grows in place instead",
        ),
    ];
}

fn churn_chain(
    pid: u32,
    cycles: BTreeMap<(Op, u64), Vec<u64>>,
    window: Window,
) -> Option<(Chain, Op)> {
    // By op name, then size: the order ties are broken in.
    let cycles: BTreeMap<(&str, u64), (Op, Vec<u64>)> = cycles
        .into_iter()
        .map(|((op, size), lives)| ((op.name(), size), (op, lives)))
        .collect();
    let ((op, size), (which, lives)) = cycles.into_iter().max_by_key(|(_, v)| v.1.len())?;
    let rate = lives.len() as f64 / window.secs();
    if lives.len() < 50 || rate < 10.0 {
        return None;
    }
    let mut lives = lives;
    Some((Chain {
        rule: Rule::Churn,
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
    }, which))
}

/// Rule 5b: bursts of frees followed by re-allocation of the same sizes (empty_cache in a loop).
pub(super) fn empty_cache_churn(pid: u32, evs: &[Event], device_frees: u64) -> Option<Chain> {
    const BURST_NS: i64 = 50_000_000;
    const MIN_BURST: usize = 4;
    // A release phase: consecutive successful frees with no allocation between them (what
    // empty_cache() does), within BURST_NS; then the same sizes are allocated again.
    let is_free =
        |e: &Event| e.class() == OpClass::Free && e.ret == 0 && e.space() == Space::Device;
    let is_alloc = |e: &Event| e.class() == OpClass::Alloc && e.ret == 0;
    // Against the process's usual pace: a burst's frees come at least ten times faster.
    if device_frees < MIN_BURST as u64 * 2 {
        return None;
    }
    let free_count = device_frees as i64;
    let span = evs.last().map_or(0, |l| l.ts_ns) - evs.first().map_or(0, |f| f.ts_ns);
    let usual_gap = span / free_count;
    let mut bursts = Vec::new();
    // One buffer for every run: most runs are a single free.
    let mut run: Vec<&Event> = Vec::new();
    let mut i = 0;
    while i < evs.len() {
        if !is_free(&evs[i]) {
            i += 1;
            continue;
        }
        let start = i;
        run.clear();
        run.push(&evs[i]);
        i += 1;
        while i < evs.len() && !is_alloc(&evs[i]) && evs[i].ts_ns - evs[start].ts_ns <= BURST_NS {
            if is_free(&evs[i]) {
                run.push(&evs[i]);
            }
            i += 1;
        }
        let run_gap = (run[run.len() - 1].ts_ns - run[0].ts_ns) / (run.len() as i64 - 1).max(1);
        if run.len() < MIN_BURST || run_gap * 10 > usual_gap {
            continue;
        }
        let sizes: Vec<u64> = run.iter().map(|e| e.size).collect();
        let end = run[run.len() - 1].ts_ns;
        let realloc = evs[i..]
            .iter()
            .take_while(|e| e.ts_ns <= end + 1_000_000_000)
            .filter(|e| is_alloc(e) && sizes.contains(&e.size))
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
        rule: Rule::EmptyCacheChurn,
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

/// The process runs PyTorch's expandable segments: by its settings, or its blocks seen in a
/// reserved range.
fn expandable(p: &Proc<'_>) -> bool {
    p.expandable_setting || !p.expandable.is_empty()
}

/// Churn of the allocator's own pages (expandable segments mapping and unmapping chunks as it
/// grows, or releases them to retry) is the allocator at work, not the program's churn.
pub(super) fn allocator_pages_out(
    p: &Proc<'_>,
    mut cycles: BTreeMap<(Op, u64), Vec<u64>>,
) -> BTreeMap<(Op, u64), Vec<u64>> {
    if expandable(p) {
        cycles.retain(|(op, _), _| {
            !matches!(
                op.spec().space,
                Space::Mapping | Space::Handle | Space::AddressRange
            )
        });
    }
    cycles
}

/// The driver calls of PyTorch's expandable segments, by index in `evs`: the reserved ranges
/// its blocks landed in (or, when its settings turn them on, ranges mapped in whole 2 MiB
/// pages, its granularity), the chunks mapped into and unmapped from them, each chunk's
/// cuMemCreate (the thread's next driver call maps it there), and the creations the device
/// refused.
pub(super) fn expandable_calls(p: &Proc<'_>) -> std::collections::HashSet<usize> {
    let evs = p.window;
    let mut out = std::collections::HashSet::new();
    if !expandable(p) {
        return out;
    }
    const PAGE: u64 = 2 << 20;
    let in_range =
        |ranges: &[(u64, u64)], ptr: u64| ranges.iter().any(|&(s, e)| ptr >= s && ptr < e);
    let reserves: Vec<(u64, u64)> = evs
        .iter()
        .filter(|e| e.op == Op::CuMemAddressReserve && e.ret == 0)
        .map(|e| (e.ptr, e.ptr.saturating_add(e.size)))
        .collect();
    let maps_whole_pages = |r: &(u64, u64)| {
        evs.iter()
            .filter(|e| e.space() == Space::Mapping && in_range(std::slice::from_ref(r), e.ptr))
            .all(|e| e.size % PAGE == 0)
    };
    let ranges: Vec<(u64, u64)> = reserves
        .into_iter()
        .filter(|r| {
            p.expandable.iter().any(|&(s, _)| s >= r.0 && s < r.1)
                || (p.expandable_setting && maps_whole_pages(r))
        })
        .chain(p.expandable.iter().copied())
        .collect();
    let mut last_create: FastMap<u32, usize> = FastMap::default();
    for (i, e) in evs.iter().enumerate() {
        let spec = e.op.spec();
        if spec.library != Library::Driver {
            continue;
        }
        match spec.space {
            Space::AddressRange if in_range(&ranges, e.ptr) => {
                out.insert(i);
            }
            Space::Mapping if in_range(&ranges, e.ptr) => {
                out.insert(i);
                if let Some(create) = last_create.remove(&e.tid) {
                    out.insert(create);
                }
            }
            // A page the device refused: the allocator growing, the out-of-memory's call.
            Space::Handle if e.class() == OpClass::Alloc && e.ret != 0 => {
                out.insert(i);
            }
            Space::Handle if e.class() == OpClass::Alloc => {
                last_create.insert(e.tid, i);
            }
            _ => {
                last_create.remove(&e.tid);
            }
        }
    }
    out
}
