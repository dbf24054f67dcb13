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
pub use tenants::{name_in_oom, Holders, Judged, Who};

use serde::Serialize;
use tracer_common::{Op, Space};

use super::{
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
    /// Stable rule name (latency_growth, allocator_retry, oom, leak, churn,
    /// empty_cache_churn, driver_bypass, sync_stall, periodic_spike).
    pub rule: &'static str,
    pub severity: Severity,
    pub pid: u32,
    pub title: String,
    pub root: String,
    pub effect: String,
    pub compounding: Vec<String>,
    pub timeline: Vec<TimelineEntry>,
    pub fix: Vec<String>,
    /// How much data the chain rests on.
    pub evidence: String,
}

const FIX_EXPANDABLE: &str = "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (segments grow in place instead of fragmenting)";
const FIX_MAX_SPLIT: &str = "PYTORCH_CUDA_ALLOC_CONF=max_split_size_mb:128 (large cached blocks are not split for small tensors)";
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
/// each process, with what the replay left live at the window's end.
pub fn replayed<'a>(
    procs: &[Proc<'a>],
    window: Window,
    host: &Host,
    sites: &SiteLabels,
) -> Vec<(ReplayChains, Vec<&'a Event>)> {
    procs
        .iter()
        .map(|p| {
            let allocs = AllocTimes::of(p.window);
            let samples = leak_samples(window);
            let mut r = replay::replay(p.all, window, &samples, allocs.map(|a| a.buckets()));
            let chains = ReplayChains {
                fragmentation: allocs.and_then(|a| latency_growth(p, a, &mut r, host)),
                leak: leak(p, window, &samples, &r, sites),
                churn: churn(
                    p.pid,
                    allocator_pages_out(p, std::mem::take(&mut r.churn)),
                    window,
                ),
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

impl ReplayChains {
    /// Puts what the allocator's own layout measured in place of what the segments suggest:
    /// fragmentation from its blocks, a leak in tensors rather than in its cache. Segments
    /// given back and taken again are then the allocator's doing, not the program's.
    pub fn replace_with_measured(&mut self, fragmentation: Option<Chain>, leak: Option<Chain>) {
        self.fragmentation = fragmentation;
        self.leak = leak;
        let segments = |op: Op| op.spec().space == Space::Device;
        if let Some((c, _)) = self.churn.as_mut().filter(|(_, op)| segments(*op)) {
            c.title = c.title.replace(
                "alloc/free churn",
                "the allocator's cache released and refilled",
            );
            c.effect = "PyTorch's caching allocator gave these segments back to the device and reserved them again: it releases cached blocks to retry a cudaMalloc the device refused (running near its limit), or torch.cuda.empty_cache() is called; each cycle pays cudaMalloc again".into();
            c.fix = vec![
                "leave the device headroom (a smaller batch or sequence length), or remove empty_cache() from the loop".into(),
                "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True: the cache grows in place instead".into(),
            ];
        }
    }
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
