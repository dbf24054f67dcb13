//! Causal-chain rules, a file per family. Each reads the events of one process and returns a
//! chain only when its evidence is in the data, with the numbers that support it. The table
//! (rule.rs [`RULES`]) names each rule's stage and function (runs.rs); this file holds the
//! chain's types and runs the table's rows stage by stage: over the allocation replay
//! (`replayed`), over one scan of the calls (`scanned`), over the measured layout (`laid`) and
//! across the processes' devices (`across`).

mod arithmetic;
mod bypass;
mod churn;
mod failure;
mod holders;
mod latency;
mod leak;
pub(super) mod measured;
mod ranks;
mod rule;
mod runs;
mod stalls;
mod startup;
mod tenants;

use latency::AllocTimes;
use leak::leak_samples;

use ranks::outlier_chains;
pub use rule::{Rule, RULES};
use runs::Replaying;
pub use runs::{Laid, Runs, Scanning};
pub use tenants::{Holders, Who};

use serde::Serialize;

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

/// The replay stage's rules ([`Runs::Replay`]) of each process, in the table's order, with what
/// the replay left live at the window's end. Where the allocator's own layout was measured
/// (`measured`, per process), its rules stand in place of the inference from latencies and
/// segments.
pub fn replayed<'a>(
    procs: &[Proc<'a>],
    measured: &[Option<&Findings>],
    window: Window,
    host: &Host,
    sites: &SiteLabels,
) -> Vec<(Vec<Chain>, Vec<&'a Event>)> {
    procs
        .iter()
        .zip(measured)
        .map(|(p, measured)| {
            let allocs = AllocTimes::of(p.window);
            let samples = leak_samples(window);
            let replay = replay::replay(p.all, window, &samples, allocs.map(|a| a.buckets()));
            let mut facts = Replaying {
                p,
                window,
                host,
                sites,
                measured: *measured,
                allocs,
                samples,
                replay,
            };
            let chains = RULES
                .iter()
                .filter_map(|row| match row.runs {
                    Runs::Replay(run) => run(&mut facts),
                    _ => None,
                })
                .collect();
            (chains, facts.replay.live)
        })
        .collect()
}

/// The scan stage's rules ([`Runs::Scan`]) of one process, in the table's order.
pub fn scanned(facts: &mut Scanning<'_, '_>) -> Vec<Chain> {
    RULES
        .iter()
        .filter_map(|row| match row.runs {
            Runs::Scan(run) => run(facts),
            _ => None,
        })
        .collect()
}

/// The layout stage's rules ([`Runs::Layout`]) of one process, in the table's order.
pub fn laid(facts: &Laid<'_>) -> Vec<Chain> {
    RULES
        .iter()
        .filter_map(|row| match row.runs {
            Runs::Layout(run) => run(facts),
            _ => None,
        })
        .collect()
}

/// The rules across every process's devices ([`Runs::Devices`]).
pub fn across(rows: &[crate::analysis::ranks::DeviceRow], window_from_ns: i64) -> Vec<Chain> {
    RULES
        .iter()
        .flat_map(|row| match row.runs {
            Runs::Devices(run) => run(rows, window_from_ns),
            _ => Vec::new(),
        })
        .collect()
}

/// The replay and scan stages' chains, process by process, each process's in the table's order.
pub fn merge(replayed: Vec<Vec<Chain>>, scanned: Vec<Vec<Chain>>) -> Vec<Chain> {
    let mut chains = Vec::new();
    for (mut mine, scanned) in replayed.into_iter().zip(scanned) {
        mine.extend(scanned);
        mine.sort_by_key(|c| c.rule);
        chains.extend(mine);
    }
    chains
}
