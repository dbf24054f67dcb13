//! The rules as data: each verdict's identity, its wire name, what the analysis and whatif
//! need to know of it, and the function the analysis runs for it. A new rule is a variant, a
//! row of [`RULES`] and its function (runs.rs, over its family file).

use serde::{Serialize, Serializer};

use super::runs::{self, Runs};

/// A verdict rule.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Rule {
    // In the order of [`RULES`], whose row each indexes.
    LatencyGrowth,
    Fragmentation,
    AllocatorRetry,
    Oom,
    EarlyWarning,
    Leak,
    Churn,
    EmptyCacheChurn,
    DriverBypass,
    SyncStall,
    PeriodicSpike,
    CpuContention,
    RankOutlier,
    UnknownState,
    StartupLedger,
}

/// What is known of a rule.
#[derive(Clone, Copy, Debug)]
pub struct RuleSpec {
    pub rule: Rule,
    /// Stable name, in JSON and the report (never changed: users' alerts match on it).
    pub name: &'static str,
    /// Reads rates, durations or intervals: not applied to a session whose times give only
    /// the order of its calls (an imported snapshot without times).
    pub timed: bool,
    /// Its fixes may name allocator settings, which explain cites with whatif's simulation.
    pub cites_settings: bool,
    /// What it finds, in a line.
    pub finds: &'static str,
    /// Where it runs and its function (runs.rs): the analysis runs every row, in this order.
    pub runs: Runs,
}

/// Every rule, in the order chains of one process are listed.
pub const RULES: [RuleSpec; 15] = [
    spec(
        Rule::LatencyGrowth,
        "latency_growth",
        true,
        false,
        "allocation latency growing with the segments held (fragmentation inferred from timing)",
        Runs::Replay(runs::latency_growth),
    ),
    spec(
        Rule::Fragmentation,
        "fragmentation",
        false,
        true,
        "free bytes scattered in the allocator's own blocks (measured)",
        Runs::Replay(runs::fragmentation),
    ),
    spec(
        Rule::AllocatorRetry,
        "allocator_retry",
        false,
        false,
        "a device allocation refused, then retried after the cache was released",
        Runs::Scan(runs::allocator_retry),
    ),
    spec(
        Rule::Oom,
        "oom",
        false,
        true,
        "an allocation that failed for good, with why",
        Runs::Scan(runs::oom),
    ),
    spec(
        Rule::EarlyWarning,
        "early_warning",
        false,
        true,
        "memory tight before a failure: the largest free block below what was asked",
        Runs::Layout(runs::early_warning),
    ),
    spec(
        Rule::Leak,
        "leak",
        true,
        false,
        "memory held growing step after step",
        Runs::Replay(runs::leak),
    ),
    spec(
        Rule::Churn,
        "churn",
        true,
        false,
        "device allocations freed and made again in a loop",
        Runs::Replay(runs::churn),
    ),
    spec(
        Rule::EmptyCacheChurn,
        "empty_cache_churn",
        true,
        false,
        "the cache released and refilled (empty_cache in a loop)",
        Runs::Scan(runs::empty_cache_churn),
    ),
    spec(
        Rule::DriverBypass,
        "driver_bypass",
        false,
        false,
        "device memory allocated outside PyTorch's allocator",
        Runs::Scan(runs::driver_bypass),
    ),
    spec(
        Rule::SyncStall,
        "sync_stall",
        true,
        false,
        "allocations waiting on a device synchronization",
        Runs::Scan(runs::sync_stall),
    ),
    spec(
        Rule::PeriodicSpike,
        "periodic_spike",
        true,
        false,
        "slow device allocations recurring at a period",
        Runs::Scan(runs::periodic_spike),
    ),
    spec(
        Rule::CpuContention,
        "cpu_contention",
        true,
        false,
        "slow calls whose threads waited for a CPU",
        Runs::Scan(runs::cpu_contention),
    ),
    spec(
        Rule::RankOutlier,
        "rank_outlier",
        false,
        true,
        "one rank of a job holding more than the others",
        Runs::Devices(super::outlier_chains),
    ),
    spec(
        Rule::UnknownState,
        "unknown_state",
        false,
        false,
        "what tracer did not see of the allocator, and what would settle it",
        Runs::Layout(runs::unknown_state),
    ),
    spec(
        Rule::StartupLedger,
        "startup_ledger",
        false,
        false,
        "a serving engine's start-up: what the weights, a profiling pass, the KV cache and each graph capture took, against its budget",
        Runs::Layout(runs::startup_ledger),
    ),
];

#[allow(clippy::too_many_arguments)] // reason: one row of the table, named by its fields
const fn spec(
    rule: Rule,
    name: &'static str,
    timed: bool,
    cites_settings: bool,
    finds: &'static str,
    runs: Runs,
) -> RuleSpec {
    RuleSpec {
        rule,
        name,
        timed,
        cites_settings,
        finds,
        runs,
    }
}

impl Rule {
    pub fn spec(self) -> &'static RuleSpec {
        // Each variant's row is at its place (tests::the_table_covers_every_rule...).
        &RULES[self as usize]
    }

    pub fn name(self) -> &'static str {
        self.spec().name
    }

    pub fn timed(self) -> bool {
        self.spec().timed
    }

    pub fn cites_settings(self) -> bool {
        self.spec().cites_settings
    }

    /// The rule of a wire name.
    pub fn named(name: &str) -> Option<Rule> {
        RULES.iter().find(|s| s.name == name).map(|s| s.rule)
    }
}

impl std::fmt::Display for Rule {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl PartialEq<&str> for Rule {
    fn eq(&self, other: &&str) -> bool {
        self.name() == *other
    }
}

impl Serialize for Rule {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each variant's place, by an exhaustive match: a new variant does not compile here
    /// until it has one.
    fn ordinal(r: Rule) -> usize {
        match r {
            Rule::LatencyGrowth => 0,
            Rule::Fragmentation => 1,
            Rule::AllocatorRetry => 2,
            Rule::Oom => 3,
            Rule::EarlyWarning => 4,
            Rule::Leak => 5,
            Rule::Churn => 6,
            Rule::EmptyCacheChurn => 7,
            Rule::DriverBypass => 8,
            Rule::SyncStall => 9,
            Rule::PeriodicSpike => 10,
            Rule::CpuContention => 11,
            Rule::RankOutlier => 12,
            Rule::UnknownState => 13,
            Rule::StartupLedger => 14,
        }
    }
    const VARIANTS: usize = 15;

    #[test]
    fn the_table_covers_every_rule_once_with_a_name_of_its_own() {
        let mut seen = [false; VARIANTS];
        for (i, row) in RULES.iter().enumerate() {
            let at = ordinal(row.rule);
            assert_eq!(
                (at, row.rule as usize),
                (i, i),
                "{:?} out of place",
                row.rule
            );
            assert!(!seen[at], "{:?} has two rows", row.rule);
            seen[at] = true;
            assert_eq!(Rule::named(row.name), Some(row.rule));
            assert_eq!(row.rule.spec().name, row.name);
        }
        assert!(seen.iter().all(|&s| s), "a rule without a row: {seen:?}");
        let mut names: Vec<&str> = RULES.iter().map(|s| s.name).collect();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), RULES.len());
    }
}
