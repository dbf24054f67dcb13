//! Explain's answer: the types `tracer explain --json` serializes (per-process tables, call
//! sites, the allocator's figures, what the answer covers), filled by the pass in mod.rs.

use serde::Serialize;

use super::{ranks, rules, Chain};
use crate::model::Window;
use crate::units::{format_bytes, format_utc};

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

/// What --max-db evicted of a session.
#[derive(Clone, Copy, Debug, Default, Serialize)]
pub struct Evicted {
    pub events: u64,
    pub calls: u64,
    pub block_events: u64,
    pub offcpu: u64,
    /// The latest call evicted (its entry time).
    pub until_ns: Option<i64>,
}

/// One process on one device over a span whose detail was evicted: the whole-run series'
/// figures there.
#[derive(Clone, Debug, Default, Serialize)]
pub struct SpanFigures {
    pub pid: u32,
    pub device: i32,
    pub from_ns: i64,
    pub to_ns: i64,
    pub peak_allocated: u64,
    pub peak_reserved: u64,
    pub peak_cached: u64,
    pub max_fragmentation: f64,
    pub calls: u64,
    pub errors: u64,
    pub failures: u64,
    pub ooms: u64,
    pub retries: u64,
    pub warnings: u64,
}

impl SpanFigures {
    /// Adds one interval of the series.
    pub fn absorb(&mut self, r: &crate::model::run_series::SeriesRow) {
        self.from_ns = if self.calls == 0 {
            r.start_ns
        } else {
            self.from_ns.min(r.start_ns)
        };
        self.to_ns = self.to_ns.max(r.end_ns);
        self.peak_allocated = self.peak_allocated.max(r.allocated);
        self.peak_reserved = self.peak_reserved.max(r.reserved);
        self.peak_cached = self.peak_cached.max(r.cached);
        self.max_fragmentation = self.max_fragmentation.max(r.fragmentation);
        self.calls += r.calls;
        self.errors += r.errors;
        self.failures += r.failures;
        self.ooms += r.ooms;
        self.retries += r.retries;
        self.warnings += r.warnings;
    }
}

/// What an answer covers beside the window's calls.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Coverage {
    /// The walk began at a keyframe (the time of its latest call) rather than at the session's
    /// first call.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub keyframe_ns: Option<i64>,
    /// The window asked for began here, before the calls --max-db left: it begins at the
    /// keyframe.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub window_clipped_from_ns: Option<i64>,
    /// Every call of the window asked for was evicted: only the whole-run series is left of it.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub window_evicted: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub evicted: Option<Evicted>,
    /// What tracer did not see of the processes: they ran before the trace, or it restarted.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub gaps: Vec<crate::model::run_series::GapRow>,
    /// Where the detail was evicted: the whole-run series' figures, per process and device.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub before_detail: Vec<SpanFigures>,
    /// Evicted spans the walk passed between kept parts (it resumed from the keyframe after
    /// each).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub holes: Vec<crate::model::run_series::Hole>,
    /// The detail kept from eviction around incidents.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub kept: Vec<crate::model::run_series::KeptRow>,
    /// Processes whose allocator state was not (or is not) exactly known in the window.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub states: Vec<StateNote>,
    /// Processes that opened a CUDA library and ended before any call of theirs reached
    /// tracer's probes (record/discovery.rs).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub never_traced: Vec<crate::model::discovery::DiscoveryRow>,
}

impl Coverage {
    /// What the answer covers, as lines: what --max-db evicted (and the whole-run series in its
    /// place), the keyframe the calls were read from, what tracer did not see and when each
    /// process's layout was exact again.
    pub fn lines(&self, window: Window) -> Vec<String> {
        let c = self;
        let mut lines = Vec::new();
        if let Some(e) = &c.evicted {
            lines.push(format!(
            "Evicted by --max-db: {} events ({} CUDA calls, {} allocator block events, {} off-CPU intervals){}; what they built is kept in keyframes",
            e.events,
            e.calls,
            e.block_events,
            e.offcpu,
            e.until_ns
                .map(|t| format!(", up to {}", format_utc(t)))
                .unwrap_or_default()
        ));
        }
        if c.window_evicted {
            lines.push(
                "Every call of this window was evicted: the whole-run series below is what is kept of it (a larger --max-db keeps the detail)"
                    .into(),
            );
        } else if let Some(k) = c.keyframe_ns {
            lines.push(format!(
                "Read from the keyframe at {} onwards (the state there, then every call after it)",
                format_utc(k)
            ));
        }
        if let Some(from) = c.window_clipped_from_ns.filter(|_| !c.window_evicted) {
            lines.push(format!(
            "The window asked for began at {}: its calls before {} were evicted, so the window begins there",
            format_utc(from),
            format_utc(window.from_ns)
        ));
        }
        for k in &c.kept {
            lines.push(format!(
                "Kept from eviction around {}: {} .. {} (`tracer explain --from {} --to {}`)",
                k.reason,
                format_utc(k.from_ns),
                format_utc(k.to_ns),
                k.from_ns,
                k.to_ns
            ));
        }
        for h in &c.holes {
            lines.push(format!(
                "Evicted within the window: {} events from {} to {}; the state after them was read from a keyframe",
                h.calls,
                format_utc(h.from_ns),
                format_utc(h.to_ns)
            ));
        }
        if c.window_evicted {
            lines.push("The window, from the whole-run series (which eviction keeps):".into());
        } else if !c.before_detail.is_empty() {
            lines.push("Before the detail (the whole-run series, which eviction keeps):".into());
        }
        for f in &c.before_detail {
            lines.push(format!(
            "  pid {} on {}: {} .. {}: peak allocated {}, reserved {}, cached {}, fragmentation up to {:.0}%; {} calls, {} errors, {} failed allocations, {} OOMs, {} retries, {} early warnings",
            f.pid,
            if f.device < 0 { "no known device".to_owned() } else { format!("GPU {}", f.device) },
            format_utc(f.from_ns),
            format_utc(f.to_ns),
            format_bytes(f.peak_allocated),
            format_bytes(f.peak_reserved),
            format_bytes(f.peak_cached),
            f.max_fragmentation * 100.0,
            f.calls,
            f.errors,
            f.failures,
            f.ooms,
            f.retries,
            f.warnings
        ));
        }
        for n in &c.states {
            let until = match n.exact_ns {
                Some(t) => format!("exact again at {}", format_utc(t)),
                None => "not exact at the window's end".to_owned(),
            };
            lines.push(format!(
            "Allocator state of pid {}: uncertain from {}, {until}; {} blocks ({}) freed unseen, {} ({}) carried over {} gap(s) and believed held, {} ({}) in segments tracer never saw",
            n.pid,
            format_utc(n.since_ns),
            n.freed_unseen.0,
            format_bytes(n.freed_unseen.1),
            n.carried.0,
            format_bytes(n.carried.1),
            n.gaps,
            n.orphans.0,
            format_bytes(n.orphans.1)
        ));
        }
        for g in &c.gaps {
            lines.push(format!(
                "Not seen: pid {} from {} to {} ({}): {}",
                g.pid,
                g.from_ns.map_or_else(|| "its start".to_owned(), format_utc),
                format_utc(g.to_ns),
                g.kind,
                g.detail
            ));
        }
        for r in &c.never_traced {
            lines.push(format!(
                "Never traced: pid {} ({}) opened {} at {} and ended before any call of it reached tracer's probes{}",
                r.pid,
                r.comm.as_deref().unwrap_or("?"),
                r.library,
                format_utc(r.opened_ns),
                r.why.as_deref().map(|w| format!(" ({w})")).unwrap_or_default()
            ));
        }
        lines
    }
}

/// What tracer did not see of one process's allocator, and when its layout was exact again.
#[derive(Clone, Debug, Default, Serialize)]
pub struct StateNote {
    pub pid: u32,
    /// Uncertain since (the first evidence, or the gap's start).
    pub since_ns: i64,
    /// Exact again then (None: still not, at the window's end).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub exact_ns: Option<i64>,
    /// The latest contradiction, and the longest life of a block seen freed since the first,
    /// in block events: exact again once twice that (at least 1000) pass without another.
    pub last_evidence_ns: i64,
    pub longest_life_events: u64,
    pub gaps: u32,
    /// Blocks believed held that a later allocation overlapped: freed unseen.
    pub freed_unseen: (u64, u64),
    /// Blocks carried over a gap and not seen since: believed held.
    pub carried: (u64, u64),
    /// Blocks in segments tracer never saw created.
    pub orphans: (u64, u64),
}

/// Everything explain shows.
#[derive(Clone, Debug, Serialize)]
pub struct Explanation {
    pub session: i64,
    pub window: Window,
    pub events_in_window: u64,
    /// The scheduler was traced: CPU contention can be tied to the calls it slowed.
    pub host_context: bool,
    /// The scheduler followed a process only while its allocator probes were armed
    /// (`--allocator auto`): CPU contention is assessed only for calls made then.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub host_while_armed: bool,
    pub processes: Vec<ProcessReport>,
    pub chains: Vec<Chain>,
    /// Top call sites per op (--stack sessions).
    pub call_sites: Vec<CallSiteRow>,
    /// Each process on each device it used: its peaks and failures, to compare ranks.
    pub devices: Vec<ranks::DeviceRow>,
    /// At each process's out-of-memory: who held its GPU (rules/tenants.rs).
    pub holders: Vec<rules::Holders>,
    /// What the answer covers: evictions, the series in their place, gaps.
    pub coverage: Coverage,
    /// The session's times give only the calls' order (an older PyTorch snapshot): no rule
    /// that reads rates, durations or intervals was applied.
    pub untimed: bool,
    /// Each arming and disarming of PyTorch's allocator probes in the window
    /// (`--allocator auto`), in time order.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub arming: Vec<crate::model::arming::ArmingRow>,
    /// Each process that captured CUDA graphs: its start-up, phase by phase
    /// (analysis/startup.rs).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub startups: Vec<super::startup::Startup>,
}
