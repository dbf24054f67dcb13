//! The chains drawn from the allocator's own layout (PyTorch's probes seen; analysis/allocator.rs
//! measures it): fragmentation measured from its blocks, a leak in tensors, the early warning
//! before an out-of-memory, the layout at the failure, and what is not known when the layout
//! is not exact.

use super::{Chain, Fix, Rule, Severity, TimelineEntry, EXPANDABLE, MAX_SPLIT};
use crate::analysis::oom::{pytorch_cached, pytorch_tried};
use crate::{
    analysis::{
        allocator::{Findings, Forced, FragKind, FragKinds, OomVerdict},
        Window,
    },
    model::layout::{Pool, PoolStats},
    units::{format_bytes as b, format_bytes_as_pytorch as pb, format_ns as t},
};

/// A leak measured in tensors: the bytes the allocator hands out (not its cache) growing
/// steadily, still growing in the second half of the window.
pub fn leak_chain(pid: u32, f: &Findings, window: Window) -> Option<Chain> {
    if !f.unknown.exact() {
        return None;
    }
    let held: Vec<(i64, u64)> = f.samples.iter().map(|(ts, s)| (*ts, s.allocated)).collect();
    if held.len() < 3 || f.allocs_in_window < 50 {
        return None;
    }
    let steps = held.windows(2);
    let up = steps.clone().filter(|w| w[1].1 > w[0].1).count();
    let big_drop = steps
        .clone()
        .any(|w| (w[1].1 as f64) < w[0].1 as f64 * 0.95);
    let (first, mid, last) = (held[0].1, held[held.len() / 2].1, held[held.len() - 1].1);
    // A working set that filled up and levelled off is not a leak.
    let still_growing = last.saturating_sub(mid) as f64 >= last as f64 * 0.1;
    let steady = window.secs() >= 5.0
        && up >= (held.len() - 1) * 3 / 4
        && !big_drop
        && last > first
        && still_growing;
    // However short the window: blocks only taken, hardly one given back.
    let never_freed = f.frees_in_window * 20 < f.allocs_in_window && last > first;
    if !steady && !never_freed {
        return None;
    }
    let per_min = (last - first) as f64 / window.secs() * 60.0;
    let sites: Vec<String> = f
        .live_in_window
        .iter()
        .map(|(site, n, bytes)| format!("{site} ({n} blocks, {})", b(*bytes)))
        .collect();
    Some(Chain {
        rule: Rule::Leak,
        severity: if last >= 2 * first.max(1) { Severity::High } else { Severity::Medium },
        pid,
        title: "tensors held grow steadily -> leak".into(),
        root: if steady {
            format!(
                "the allocator's allocated bytes grew from {} to {} over {:.0}s ({}/min), rising in {up} of {} intervals and still rising at the end",
                b(first),
                b(last),
                window.secs(),
                b(per_min as u64),
                held.len() - 1
            )
        } else {
            format!(
                "the allocator's allocated bytes only grew, from {} to {} in {:.1}s: {} blocks handed out, {} taken back (a leak, or memory kept on purpose: weights, a cache)",
                b(first),
                b(last),
                window.secs(),
                f.allocs_in_window,
                f.frees_in_window
            )
        },
        effect: if sites.is_empty() {
            "blocks allocated in the window are still held".into()
        } else {
            format!("blocks allocated in the window and still held: {}", sites.join(", "))
        },
        compounding: Vec::new(),
        timeline: held
            .iter()
            .map(|(ts, v)| TimelineEntry {
                ts_ns: *ts,
                text: format!("allocated {}", b(*v)),
            })
            .collect(),
        fix: vec![
            "look for tensors kept across iterations (losses appended without .item(), cached outputs, growing lists)".into(),
            "torch.cuda.memory._record_memory_history() around the loop shows who holds them".into(),
        ],
        evidence: format!(
            "{} samples of the allocator's allocated bytes (PyTorch's probes), not its cache",
            held.len()
        ),
    })
}

fn figures(s: &PoolStats) -> String {
    format!(
        "{} cached in {} free blocks, largest {} (fragmentation {:.0} %); reserved {}, allocated {}",
        b(s.cached()),
        s.free_blocks,
        b(s.largest_free),
        s.fragmentation() * 100.0,
        b(s.reserved),
        b(s.allocated)
    )
}

const FIX_EXPANDABLE: Fix = Fix::setting(
    EXPANDABLE,
    "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True: segments grow in place, so the free bytes stay in one block",
);
const FIX_MAX_SPLIT: Fix = Fix::setting(
    MAX_SPLIT,
    "PYTORCH_CUDA_ALLOC_CONF=max_split_size_mb:128: large cached blocks are not cut for small tensors",
);

/// Fragmentation inside the cached segments, measured, pool by pool against the requests
/// each pool serves: new segments the pool's cache could have held in bytes but not in one
/// block, and that pool's worst moment.
pub fn fragmentation_chain(pid: u32, f: &Findings) -> Option<Chain> {
    if !f.unknown.exact() {
        // Measured in a layout tracer did not see whole: [`unknown_chain`] says so.
        return None;
    }
    // The pool whose requests found no block the most: its segments and its worst moment.
    let forced_pool = f
        .forced_by_pool
        .iter()
        .max_by_key(|(_, forced)| forced.bytes)
        .map(|(&key, forced)| (key, forced.clone()));
    let worst = match &forced_pool {
        Some((key, _)) => f
            .worst_by_pool
            .get(key)
            .map(|&(ts, s)| (ts, key.0, key.1, s)),
        None => f.worst,
    };
    let forced = forced_pool
        .as_ref()
        .map(|(_, x)| x.clone())
        .unwrap_or_default();
    // Without a segment forced by it, fragmentation is only worth a chain when the scattered
    // cache is a real share of the memory held.
    let harmless = |w: &(i64, i32, Pool, PoolStats)| {
        w.3.fragmentation() < 0.5 || w.3.cached() * 10 < w.3.reserved
    };
    if forced.count == 0 && worst.as_ref().is_none_or(harmless) {
        return None;
    }
    let (ts, device, pool, s) = worst.or_else(|| {
        let ((d, p), _) = forced_pool.as_ref()?;
        Some((0, *d, *p, f.end.get(&(*d, *p)).copied().unwrap_or_default()))
    })?;
    let mut root = format!(
        "at the worst moment the {pool:?} pool of device {device} held {}",
        figures(&s)
    );
    if forced.count > 0 {
        root.push_str(&format!(
            "; {} new segment(s) ({}) were reserved for its requests while it held enough free bytes for the request but no block that fit",
            forced.count,
            b(forced.bytes)
        ));
        let kinds = forced.kinds.ranked();
        let all: u64 = kinds.iter().map(|(_, bytes)| bytes).sum();
        if all > 0 {
            let said: Vec<String> = kinds
                .iter()
                .map(|(kind, bytes)| {
                    format!(
                        "{:.0} % {}",
                        *bytes as f64 * 100.0 / all as f64,
                        kind_said(*kind)
                    )
                })
                .collect();
            root.push_str(&format!("; the free bytes then lay {}", said.join(", ")));
        }
    }
    let short = device_ran_short(f);
    let held = f
        .devices
        .get(&device)
        .map_or(s.reserved, |d| d.held.max(s.reserved));
    let mut effect = format!(
        "{} of reserved memory was free but scattered in {} blocks: requests larger than {} need new segments from the device, and fail when it has no room",
        b(s.cached()),
        s.free_blocks,
        b(s.largest_free)
    );
    if !short {
        effect.push_str(
            "; the device never ran short while the cache held the bytes (no warning, no failure the cache could have served): it cost memory, not a failure",
        );
    }
    Some(Chain {
        rule: Rule::Fragmentation,
        severity: fragmentation_severity(&forced, &s, held, short),
        pid,
        title: "fragmentation inside the allocator's cached segments".into(),
        root,
        effect,
        compounding: Vec::new(),
        timeline: sorted(f
            .samples
            .iter()
            .map(|(ts, s)| TimelineEntry {
                ts_ns: *ts,
                text: format!(
                    "reserved {}, allocated {}, cached {} in {} blocks, largest {}",
                    b(s.reserved),
                    b(s.allocated),
                    b(s.cached()),
                    s.free_blocks,
                    b(s.largest_free)
                ),
            })
            .chain(std::iter::once(TimelineEntry {
                ts_ns: ts,
                text: format!("worst: fragmentation {:.0} % in the {pool:?} pool", s.fragmentation() * 100.0),
            }))
            .collect()),
        fix: kind_fixes(&forced.kinds),
        evidence: format!(
            "the allocator's own layout, rebuilt from {} pytorch:malloc/free events and the device allocations",
            f.block_events
        ),
    })
}

/// A timeline in time order (the worst moment among the samples, not after them).
fn sorted(mut timeline: Vec<TimelineEntry>) -> Vec<TimelineEntry> {
    timeline.sort_by_key(|e| e.ts_ns);
    timeline
}

/// How a kind of fragmentation reads in a chain.
fn kind_said(kind: FragKind) -> &'static str {
    match kind {
        FragKind::Split => "in remainders of split blocks, between live ones",
        FragKind::Spread => "in whole free segments, each too small, that cannot merge",
        FragKind::OtherStream => "in segments of another stream, which serve only it",
        FragKind::Pending => "in blocks held for another stream's work (record_stream)",
    }
}

/// The fixes, the one for the kind that held the most free bytes first.
fn kind_fixes(kinds: &FragKinds) -> Vec<Fix> {
    let mut fixes: Vec<Fix> = Vec::new();
    for (kind, _) in kinds.ranked() {
        let fix = match kind {
            FragKind::Split => FIX_MAX_SPLIT,
            FragKind::Spread => FIX_EXPANDABLE,
            FragKind::OtherStream => "allocate each tensor on the stream that uses it (each stream's cache serves only that stream)".into(),
            FragKind::Pending => "synchronize the other stream before freeing, or avoid Tensor.record_stream: blocks stay held until its work is done".into(),
        };
        if !fixes.contains(&fix) {
            fixes.push(fix);
        }
    }
    for fix in [FIX_EXPANDABLE, FIX_MAX_SPLIT] {
        if !fixes.contains(&fix) {
            fixes.push(fix);
        }
    }
    fixes
}

/// The device ran short while the cache held the bytes: the early warning fired, or a failed
/// allocation's pool held enough free bytes for it.
fn device_ran_short(f: &Findings) -> bool {
    f.warning.is_some()
        || f.forensics
            .iter()
            .any(|x| x.verdict(None) == OomVerdict::Fragmentation)
}

/// How much fragmentation cost, in bytes against the memory held (`held`: the device's peak
/// for the process): new segments it forced worth a real share of it, or a scattered cache
/// that is a real share of reserved memory while requests had to go past it. High only when
/// the device ran short while the cache held the bytes (`short`): otherwise it cost memory the
/// device had to spare. A high ratio of a tiny cache is not High (132 MiB in 13 blocks of
/// 78 GiB reserved is 0.2 %), nor is a scattered cache no request needed.
pub fn fragmentation_severity(
    forced: &Forced,
    worst: &PoolStats,
    held: u64,
    short: bool,
) -> Severity {
    let reserved = worst.reserved.max(1) as f64;
    let scattered = worst.cached() as f64 / reserved * worst.fragmentation();
    let forced_share = forced.bytes as f64 / held.max(1) as f64;
    // High only when it cost memory: segments reserved because no cached block fit.
    let forced_some = forced.count > 0;
    let costly = (forced.count >= 3 && forced_share >= 0.10) || (forced_some && scattered >= 0.15);
    if costly && short {
        Severity::High
    } else if costly || scattered >= 0.05 || forced_share >= 0.01 {
        Severity::Medium
    } else {
        Severity::Low
    }
}

/// The early warning: the layout in which the next request of the sizes being made fails;
/// none when it came no earlier than the out-of-memory (`first_failure`: the OOM chain tells).
pub fn warning_chain(pid: u32, f: &Findings, first_failure: Option<i64>) -> Option<Chain> {
    let warning = f.warning.as_ref().filter(|_| f.unknown.exact())?;
    let w = &warning.alarm;
    if first_failure.is_some_and(|fail| fail <= w.ts_ns) {
        // Not early: the failure came first (or with it); the OOM chain tells it.
        return None;
    }
    let mut timeline = vec![TimelineEntry {
        ts_ns: w.ts_ns,
        text: format!(
            "{:?} pool: largest free block {} < {} requested; the device has {} free, the new segment needs {}",
            w.pool,
            b(w.stats.largest_free),
            b(w.request),
            b(w.device_free),
            b(w.segment)
        ),
    }];
    if let Some(fail) = first_failure {
        timeline.push(TimelineEntry {
            ts_ns: fail,
            text: format!(
                "the out-of-memory came {} later",
                t((fail - w.ts_ns).max(0) as u64)
            ),
        });
    }
    let pinning: Vec<String> = warning
        .pinning
        .iter()
        .map(|(site, n, bytes)| format!("{site} ({n} blocks, {})", b(*bytes)))
        .collect();
    Some(Chain {
        rule: Rule::EarlyWarning,
        severity: Severity::High,
        pid,
        title: format!(
            "early warning: the next {} request on device {} will fail",
            b(w.request),
            w.device
        ),
        root: format!(
            "the {:?} pool holds {} but no block of {}, and the device has only {} free for the {} segment such a request needs",
            w.pool,
            figures(&w.stats),
            b(w.request),
            b(w.device_free),
            b(w.segment)
        ),
        effect: if pinning.is_empty() {
            "the free bytes are pinned between live blocks in partly used segments".into()
        } else {
            format!("the partly free segments are pinned by blocks from {}", pinning.join(", "))
        },
        compounding: Vec::new(),
        timeline,
        fix: vec![
            "checkpoint now, or free what the pinning blocks hold".into(),
            FIX_EXPANDABLE,
            FIX_MAX_SPLIT,
        ],
        evidence: "the allocator's layout at that moment and cudaMemGetInfo kept current with the segments since".into(),
    })
}

/// The layout at the out-of-memory that was not recovered (the failure at `fatal_ns`, or the
/// allocator's retry of it within a second: PyTorch's message describes the state after its
/// cache flush), and the fixes that fit it.
pub fn oom_forensics(f: &Findings, fatal_ns: i64, message: Option<&str>) -> Option<Forensic> {
    let x = f
        .forensics
        .iter()
        .rfind(|x| x.ts_ns >= fatal_ns && x.ts_ns - fatal_ns < 1_000_000_000)?;
    // "... Tried to allocate 46.00 MiB. GPU 0 has ...": the size PyTorch itself names.
    let tried = message
        .and_then(|m| m.split_once("Tried to allocate "))
        .and_then(|(_, rest)| rest.split(". ").next())
        .filter(|s| !s.is_empty());
    let asked = match (tried, x.request_bounds()) {
        (Some(t), _) => format!("Tried to allocate {t}"),
        // PyTorch names the segment it asked for (the request rounded up to 2 MiB).
        (None, Some((lowest, highest))) if highest - lowest < 2 << 20 => format!(
            "Tried to allocate {} (the segment cudaMalloc asked for)",
            pb(x.requested)
        ),
        (None, Some((lowest, highest))) => format!(
            "Tried to allocate {} to {} (what a {} segment is made for)",
            pb(lowest),
            pb(highest),
            pb(x.requested)
        ),
        (None, None) => format!(
            "request unknown: the expandable segment asked the device for a {} page, which does not say how much PyTorch tried to allocate (PyTorch's out-of-memory message, its probe at c10::Error's constructor in libc10.so, would settle it)",
            pb(x.requested)
        ),
    };
    let seen = if x.unseen > 0 {
        format!(
            " in the segments tracer saw whole ({} more in segments made before PyTorch's allocator probes were armed, contents unknown)",
            pb(x.unseen)
        )
    } else if f.unknown.exact() {
        String::new()
    } else {
        " in the segments tracer saw".to_owned()
    };
    // PyTorch's own figures: a private pool's free blocks are "allocated in private pools",
    // not "reserved but unallocated" (the request may not use them).
    let private = if x.private_free > 0 {
        format!(
            ", with {} allocated in private pools (e.g., CUDA Graphs: free blocks inside CUDA graphs' and MemPools' pools, for requests routed there only{})",
            pb(x.private_free),
            if x.use_on_oom {
                "; the use_on_oom pools' were tried as a last resort, and none fit"
            } else {
                ""
            }
        )
    } else {
        String::new()
    };
    let default_free = x.pools.iter().map(|(_, s)| s.free_blocks).sum::<u64>();
    let default_largest = x
        .pools
        .iter()
        .map(|(_, s)| s.largest_free)
        .max()
        .unwrap_or(0);
    let mut text = format!(
        "{asked}{seen}: {} is allocated by PyTorch{private}, and {} is reserved by PyTorch but unallocated ({} free blocks, largest {}); {} outside PyTorch's allocator",
        pb(x.total.allocated + x.private_free),
        pb(x.total.cached().saturating_sub(x.private_free)),
        default_free,
        pb(default_largest),
        pb(x.outside)
    );
    // The layout at the raised failure is after the flush: exact where tracer saw it whole,
    // else PyTorch's message (two decimals).
    let split = if f.unknown.exact() && x.unseen == 0 {
        Some(x.total.cached().saturating_sub(x.private_free))
    } else {
        message.and_then(pytorch_cached)
    };
    let verdict = if f.unknown.exact() {
        match x.verdict(message.and_then(pytorch_tried)) {
            OomVerdict::Fragmentation => Some(true),
            OomVerdict::Capacity => Some(false),
            OomVerdict::Unknown(why) => {
                return Some(Forensic {
                    text,
                    clause: format!(": fragmentation or capacity is not known: {why}"),
                    fixes: vec![
                        FIX_EXPANDABLE,
                        "reduce peak memory: a smaller batch or sequence length, activation checkpointing, mixed precision".into(),
                    ],
                    fragmentation: None,
                    split,
                });
            }
        }
    } else {
        // tracer's layout may differ from the allocator's here: only PyTorch's own figures
        // can tell.
        let said = message
            .and_then(pytorch_cached)
            .zip(message.and_then(pytorch_tried));
        match said {
            Some((cached, tried)) => {
                text.push_str(&format!(
                    "; tracer's layout is not exact here ({}), but PyTorch's message says {} reserved but unallocated",
                    unknown_said(f),
                    b(cached)
                ));
                Some(cached >= tried)
            }
            None => None,
        }
    };
    let (clause, fixes) = if verdict.is_none() {
        (
            format!(
                ": whether the cache held the bytes is unknown: tracer's layout is not exact here ({}); PyTorch's out-of-memory message (its probe, libc10.so traced) or a trace from the job's start would settle it",
                unknown_said(f)
            ),
            vec![
                FIX_EXPANDABLE,
                "reduce peak memory: a smaller batch or sequence length, activation checkpointing, mixed precision".into(),
            ],
        )
    } else if verdict == Some(true) {
        (
            ": the cache held the bytes, not one block that fit (fragmentation)".to_owned(),
            vec![FIX_EXPANDABLE, FIX_MAX_SPLIT],
        )
    } else {
        (
            ": the memory is in use, not lost to fragmentation (capacity)".to_owned(),
            fixes_for_capacity(),
        )
    };
    Some(Forensic {
        text,
        clause,
        fixes,
        fragmentation: verdict,
        split,
    })
}

/// Where private pools' free blocks decided an OOM: releasing the pools is offered only where
/// the flush rule, applied to the layout at the failure, returns enough (their segments holding
/// no live block cover the shortfall); use_on_oom only where a MemPool's free block fits the
/// request at the failure (PyTorch's last resort would have served it); capturing fewer shapes
/// stands where graphs' pools held some, without a figure (the eager requests a graph replaces
/// were never made: no replay can say what they take).
pub fn fixes_for_private_pools(
    a: &crate::analysis::oom::Arithmetic,
    x: Option<&crate::analysis::allocator::Forensics>,
) -> Vec<Fix> {
    let mut fixes: Vec<Fix> = Vec::new();
    let mem_free = x.map_or(0, |x| x.mem_pool_free);
    // Every private free byte lay in MemPools: no graph's advice applies.
    let all_mem = x.is_some_and(|x| mem_free > 0 && mem_free >= x.private_free);
    let short = a.shortfall.map_or("request".into(), pb);
    if let (crate::analysis::oom::Cause::PrivatePools { idle_enough: true }, Some(idle)) =
        (&a.cause, a.private_idle)
    {
        fixes.push(if all_mem {
            format!(
                "free the MemPool's tensors and drop the pool (its destructor releases it and empties its cache): its {} of segments holding no live block go back, more than the {short} short",
                pb(idle)
            )
            .into()
        } else {
            format!(
                "release the graphs no longer replayed (reset() them, or drop them) and call torch.cuda.empty_cache(): once no graph holds their pool, a flush returns its {} of segments holding no live block, more than the {short} short",
                pb(idle)
            )
            .into()
        });
    }
    if let Some(x) = x.filter(|x| x.mem_pool_free > 0) {
        let asked = a.asked.unwrap_or(x.requested);
        if x.mem_pool_largest >= asked {
            fixes.push(
                format!(
                    "make the MemPool with use_on_oom=True: after the retry PyTorch looks in such pools' free blocks before it raises, and its {} free block fits this {} request (on the same stream)",
                    pb(x.mem_pool_largest),
                    pb(asked)
                )
                .into(),
            );
        }
        fixes.push(
            "make the request inside `with torch.cuda.use_mem_pool(pool):` where it may share the pool's free blocks, or free and drop the MemPools no longer used"
                .into(),
        );
    }
    if !all_mem {
        fixes.push(
            "capture fewer shapes (batch sizes), and have the graphs share one pool (torch.cuda.graph_pool_handle()) where they do not yet, so that the graphs hold less apart from eager requests; leave room for the largest eager request beside the graphs (serving engines: lower the graph memory budget or the KV-cache fraction)"
                .into(),
        );
    }
    fixes
}

/// Where a capture in progress kept the cache from being flushed: a flush before the capture is
/// offered only where the flush rule, applied to the layout at the failure, returns enough (the
/// cache's segments holding no live block cover the shortfall).
pub fn fixes_for_capture(a: &crate::analysis::oom::Arithmetic) -> Vec<Fix> {
    let mut fixes: Vec<Fix> = Vec::new();
    if let (crate::analysis::oom::Cause::CaptureUnderway { idle_enough: true }, Some(idle)) =
        (&a.cause, a.capture_idle)
    {
        fixes.push(
            format!(
                "call torch.cuda.empty_cache() before capturing: its {} of segments holding no live block go back to the device, more than the {} short (no flush runs during the capture)",
                pb(idle),
                a.shortfall.map_or("request".into(), pb)
            )
            .into(),
        );
    }
    fixes.push(
        "capture with less memory left to the eager pass: warm up and capture before the cache grows, or leave the capture more room (serving engines: a lower KV-cache fraction or graph memory budget)"
            .into(),
    );
    fixes
}

/// What to do when the request does not fit the device even with the cache given back.
pub fn fixes_for_capacity() -> Vec<Fix> {
    vec![
        "reduce peak memory: a smaller batch or sequence length, activation checkpointing, mixed precision".into(),
        "leave the device to this job (other processes hold memory on it)".into(),
    ]
}

/// The layout at an out-of-memory in words, and what it alone says of the failure; the OOM's
/// arithmetic (analysis/oom.rs) decides with the device's figures beside it.
pub struct Forensic {
    /// What was asked and what the allocator held, with what tracer did not see.
    pub text: String,
    /// The verdict from the cache alone (fragmentation, capacity, or unknown), as a clause.
    pub clause: String,
    pub fixes: Vec<Fix>,
    /// The cache held the bytes (fragmentation), did not (capacity), or that is not known.
    pub fragmentation: Option<bool>,
    /// Free bytes in blocks inside live segments after the flush: PyTorch's "reserved but
    /// unallocated" from its message, else tracer's layout where it is exact.
    pub split: Option<u64>,
}

/// What is not known of the allocator's layout, in a few words.
pub fn unknown_said(f: &Findings) -> String {
    let u = &f.unknown;
    let mut parts = Vec::new();
    if f.orphans.0 > 0 || u.unseen_segments {
        parts.push(format!(
            "{} blocks ({}) lie in segments tracer never saw created",
            f.orphans.0,
            b(f.orphans.1)
        ));
    }
    if u.gaps > 0 {
        parts.push(format!(
            "{} gap(s) in the trace; {} blocks ({}) held since before are believed still held",
            u.gaps,
            f.carried.0,
            b(f.carried.1)
        ));
    }
    if u.freed_unseen > 0 {
        parts.push(format!(
            "{} blocks ({}) were freed while tracer did not see",
            u.freed_unseen,
            b(u.freed_unseen_bytes)
        ));
    }
    if f.held_unseen > 0 {
        parts.push(format!(
            "{} segment(s) were made while a free block of the same pool and stream that fit was believed free: blocks handed out without PyTorch's probes (torch.cuda.caching_allocator_alloc, raw_alloc) hold memory the layout shows free",
            f.held_unseen
        ));
    }
    if parts.is_empty() {
        parts.push("frees of blocks tracer never saw allocated".into());
    }
    parts.join("; ")
}

/// What tracer did not see of the process's allocator, when that keeps its layout from being
/// exact: stated instead of a verdict (no rule concludes from it), with what would settle it.
pub fn unknown_chain(pid: u32, f: &Findings) -> Option<Chain> {
    let u = &f.unknown;
    if u.exact() || !f.visible {
        return None;
    }
    let since = u.since_ns.unwrap_or(0);
    let settle = if u.unseen_segments {
        "a trace that runs from the job's start (a DaemonSet running before jobs start), or the job restarted under trace; PyTorch's out-of-memory message, when it comes, gives the allocator's own figures"
    } else {
        "the job's next steps: the layout is exact again once no block event has contradicted it for twice the longest life of a block seen since, counted in block events (at least 1000)"
    };
    Some(Chain {
        rule: Rule::UnknownState,
        severity: Severity::Low,
        pid,
        title: "the allocator's layout is not fully known: no verdict is drawn from it".into(),
        root: format!("since {}: {}", crate::units::format_utc(since), unknown_said(f)),
        effect: "fragmentation, capacity, the early warning, leaks and comparisons between ranks are not concluded from this process's layout".into(),
        compounding: Vec::new(),
        timeline: vec![TimelineEntry {
            ts_ns: since,
            text: "first evidence that tracer did not see everything".into(),
        }],
        fix: vec![format!("what would settle it: {settle}").into()],
        evidence: format!(
            "{} blocks outside known segments, {} allocations over blocks believed held, {} gap(s)",
            f.orphans.0, u.freed_unseen, u.gaps
        ),
    })
}
