//! Causal-chain rules, a file per family. Each reads the events of one process and returns a
//! chain only when its evidence is in the data, with the numbers that support it; this file
//! holds the chain's types and runs the rules: those over the allocation replay (`replayed`)
//! and those over one scan of the calls (`direct`).

mod bypass;
mod churn;
mod failure;
mod latency;
mod leak;
pub(super) mod measured;
mod ranks;
mod rule;
mod stalls;
mod tenants;

use bypass::driver_bypass;
use churn::{allocator_pages_out, churn, empty_cache_churn};
use failure::{allocator_retry, oom};
use latency::{latency_growth, periodic_spike, AllocTimes};
use leak::{leak, leak_samples};
use stalls::{cpu_contention, sync_stall};

pub use measured::{fragmentation_chain, leak_chain, oom_forensics, unknown_chain, warning_chain};
pub use ranks::outlier_chains;
pub use rule::Rule;
pub use tenants::{name_in_oom, Holders, Judged, Who};

use serde::Serialize;
use tracer_common::Op;

use super::{
    allocator::Findings,
    replay::{self},
    scan::Scan,
    Event, Host, SiteLabels, Window,
};

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "UPPERCASE")]
pub enum Severity {
    Low,
    Medium,
    High,
}

#[derive(Clone, Debug, Serialize)]
pub struct TimelineEntry {
    pub ts_ns: i64,
    pub text: String,
}

#[derive(Clone, Debug, Serialize)]
pub struct Chain {
    /// The rule that found it (its stable name in JSON: [`RULES`]).
    pub rule: Rule,
    pub severity: Severity,
    pub pid: u32,
    pub title: String,
    pub root: String,
    pub effect: String,
    pub compounding: Vec<String>,
    pub timeline: Vec<TimelineEntry>,
    pub fix: Vec<Fix>,
    /// How much data the chain rests on.
    pub evidence: String,
}

/// What to do, and the allocator setting it names (whatif cites those with its simulation).
/// In JSON, the text.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Fix {
    pub text: std::borrow::Cow<'static, str>,
    /// The PYTORCH_CUDA_ALLOC_CONF setting it names ("expandable_segments:True").
    pub setting: Option<&'static str>,
}

impl Fix {
    /// A fix naming allocator setting `setting`.
    pub const fn setting(setting: &'static str, text: &'static str) -> Fix {
        Fix {
            text: std::borrow::Cow::Borrowed(text),
            setting: Some(setting),
        }
    }
}

impl From<&'static str> for Fix {
    fn from(text: &'static str) -> Fix {
        Fix {
            text: text.into(),
            setting: None,
        }
    }
}

impl From<String> for Fix {
    fn from(text: String) -> Fix {
        Fix {
            text: text.into(),
            setting: None,
        }
    }
}

impl std::fmt::Display for Fix {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.text)
    }
}

impl Serialize for Fix {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.text)
    }
}

pub(crate) const EXPANDABLE: &str = "expandable_segments:True";
pub(crate) const MAX_SPLIT: &str = "max_split_size_mb:128";

const FIX_EXPANDABLE: Fix = Fix::setting(EXPANDABLE, "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (segments grow in place instead of fragmenting)");
const FIX_MAX_SPLIT: Fix = Fix::setting(MAX_SPLIT, "PYTORCH_CUDA_ALLOC_CONF=max_split_size_mb:128 (large cached blocks are not split for small tensors)");
const FIX_FRACTION: &str = "torch.cuda.set_per_process_memory_fraction(0.9) to leave headroom for allocations outside PyTorch";

fn entry(ts_ns: i64, text: String) -> TimelineEntry {
    TimelineEntry { ts_ns, text }
}

fn secs_between(a: i64, b: i64) -> f64 {
    (b - a) as f64 / 1e9
}

/// One process's calls: all of them up to the window's end, and those in the window (both in
/// time order).
#[derive(Clone, Copy, Debug)]
pub struct Proc<'a> {
    pub pid: u32,
    pub all: &'a [Event],
    pub window: &'a [Event],
    /// PyTorch's expandable segments: the reserved ranges its blocks landed in.
    pub expandable: &'a [(u64, u64)],
    /// The process's settings turn expandable segments on.
    pub expandable_setting: bool,
}

/// The chains of the rules that replay allocations (latency growth, leak, churn) for
/// each process, with what the replay left live at the window's end. Where the allocator's own
/// layout was measured (`measured`, per process), its fragmentation and leak chains stand in
/// place of the inference from latencies and segments, and segments given back and taken
/// again are the allocator's doing.
pub fn replayed<'a>(
    procs: &[Proc<'a>],
    measured: &[Option<&Findings>],
    window: Window,
    host: &Host,
    sites: &SiteLabels,
) -> Vec<(ReplayChains, Vec<&'a Event>)> {
    procs
        .iter()
        .zip(measured)
        .map(|(p, measured)| {
            let allocs = AllocTimes::of(p.window);
            let samples = leak_samples(window);
            let mut r = replay::replay(p.all, window, &samples, allocs.map(|a| a.buckets()));
            let (fragmentation, leak) = match measured {
                Some(f) => (fragmentation_chain(p.pid, f), leak_chain(p.pid, f, window)),
                None => {
                    let inferred = allocs.and_then(|a| latency_growth(p, a, &mut r, host));
                    (inferred, leak(p, window, &samples, &r, sites))
                }
            };
            let cycles = allocator_pages_out(p, std::mem::take(&mut r.churn));
            let chains = ReplayChains {
                fragmentation,
                leak,
                churn: churn(p.pid, cycles, window, measured.is_some()),
            };
            (chains, r.live)
        })
        .collect()
}

/// [`replayed`]'s chains of one process.
#[derive(Debug, Default)]
pub struct ReplayChains {
    fragmentation: Option<Chain>,
    leak: Option<Chain>,
    /// The chain, and the op whose cycles it counts.
    churn: Option<(Chain, Op)>,
}

/// The chains of the rules that need no replay, for one process, from one scan of its calls.
pub fn direct(
    p: &Proc<'_>,
    everyone: &[Proc<'_>],
    scan: Scan<'_>,
    window: Window,
    host: &Host,
    sites: &SiteLabels,
) -> DirectChains {
    // Durations of every call only when CPU contention can be assessed.
    let cpu = host
        .recorded
        .then(|| cpu_contention(p.pid, p.window, scan.all_durations(), host))
        .flatten();
    DirectChains {
        retry: allocator_retry(p.pid, p.window, &scan.attempts),
        oom: oom(p, everyone, &scan.attempts, sites),
        empty_cache: empty_cache_churn(p.pid, p.window, scan.device_frees_ok),
        bypass: scan.driver_allocs.then(|| driver_bypass(p)).flatten(),
        sync: sync_stall(p.pid, &scan.syncs, window, host),
        periodic: periodic_spike(p.pid, p.window, scan.device_alloc_durations, host),
        cpu,
    }
}

/// [`direct`]'s chains of one process.
#[derive(Debug, Default)]
pub struct DirectChains {
    retry: Option<Chain>,
    oom: Option<Chain>,
    empty_cache: Option<Chain>,
    bypass: Option<Chain>,
    sync: Option<Chain>,
    periodic: Option<Chain>,
    cpu: Option<Chain>,
}

/// Every chain, process by process, each process's in the rules' order.
pub fn merge(replayed: Vec<ReplayChains>, direct: Vec<DirectChains>) -> Vec<Chain> {
    let mut chains = Vec::new();
    for (r, d) in replayed.into_iter().zip(direct) {
        chains.extend(
            [
                r.fragmentation,
                d.retry,
                d.oom,
                r.leak,
                r.churn.map(|(c, _)| c),
                d.empty_cache,
                d.bypass,
                d.sync,
                d.periodic,
                d.cpu,
            ]
            .into_iter()
            .flatten(),
        );
    }
    chains
}
