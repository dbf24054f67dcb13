//! Ranks and devices compared: a distributed job dies when one of its ranks runs out, so the
//! one that stands out (the first to fail, or the one holding far more than the others) is
//! named, with how far it stands out and why (its cache fragments, or it holds more tensors).

use super::{Chain, Fix, Rule, Severity, TimelineEntry, EXPANDABLE};
use crate::{analysis::ranks::DeviceRow, units::format_bytes as b};

/// How far the outlier's peak must stand above the others' median to be named without a failure.
pub const OUTLIER_RATIO: f64 = 1.25;
/// ... and by at least this much (small jobs differ by noise).
pub const OUTLIER_MIN_BYTES: u64 = 64 << 20;
/// Segments forced by fragmentation explain an outlier when it reserved at least this much so,
/// and twice the others' median.
const FORCED_MIN_BYTES: u64 = 64 << 20;

fn median_u64(mut v: Vec<u64>) -> u64 {
    v.sort_unstable();
    v.get(v.len() / 2).copied().unwrap_or(0)
}

fn median_f64(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(0.0)
}

/// The row that stands out among two or more: the first to fail while another did not, else
/// the one whose peak stands well above the others' median.
fn outlier(rows: &[DeviceRow]) -> Option<usize> {
    if rows.len() < 2 {
        return None;
    }
    let failed = rows.iter().filter(|r| r.failures > 0).count();
    if failed > 0 && failed < rows.len() {
        return rows
            .iter()
            .enumerate()
            .filter(|(_, r)| r.failures > 0)
            .min_by_key(|(_, r)| r.first_failure_ns.unwrap_or(i64::MAX))
            .map(|(i, _)| i);
    }
    if failed == rows.len() {
        return None;
    }
    let (i, top) = rows.iter().enumerate().max_by_key(|(_, r)| r.peak_held)?;
    let others = median_u64(others(rows, i).map(|r| r.peak_held).collect());
    let stands_out = top.peak_held as f64 >= others as f64 * OUTLIER_RATIO
        && top.peak_held >= others + OUTLIER_MIN_BYTES;
    stands_out.then_some(i)
}

fn others(rows: &[DeviceRow], i: usize) -> impl Iterator<Item = &DeviceRow> {
    rows.iter()
        .enumerate()
        .filter(move |(j, _)| *j != i)
        .map(|(_, r)| r)
}

/// The chains naming the outlier of each job's ranks and devices, where one stands out. Only
/// rows of one job are compared (its rendezvous, else the one process): another job's process
/// on the same GPU is a co-tenant, named by the OOM chain, never a rank.
pub fn outlier_chains(rows: &[DeviceRow], window_from_ns: i64) -> Vec<Chain> {
    let mut jobs: Vec<&str> = rows.iter().map(|r| r.job.as_str()).collect();
    jobs.sort_unstable();
    jobs.dedup();
    jobs.into_iter()
        .filter_map(|job| {
            let mine: Vec<DeviceRow> = rows.iter().filter(|r| r.job == job).cloned().collect();
            outlier_chain(&mine, window_from_ns)
        })
        .collect()
}

/// The chain naming the outlier among one job's ranks and devices, if one stands out.
fn outlier_chain(rows: &[DeviceRow], window_from_ns: i64) -> Option<Chain> {
    // Only devices known by number, with something held or failed; none at all when a process
    // in the comparison was not seen whole (it may be the outlier).
    let rows: Vec<DeviceRow> = rows
        .iter()
        .filter(|r| r.device >= 0 && (r.peak_held > 0 || r.failures > 0))
        .cloned()
        .collect();
    if rows.iter().any(|r| r.unknown) {
        return None;
    }
    let rows = rows.as_slice();
    let i = outlier(rows)?;
    let top = &rows[i];
    let rest: Vec<&DeviceRow> = others(rows, i).collect();
    let held = median_u64(rest.iter().map(|r| r.peak_held).collect());
    let frag = median_f64(rest.iter().map(|r| r.fragmentation).collect());
    let forced = median_u64(rest.iter().map(|r| r.forced_bytes).collect());
    let allocated = median_u64(rest.iter().map(|r| r.peak_allocated).collect());
    let ratio = top.peak_held as f64 / held.max(1) as f64;
    let fragments =
        top.blocks() && top.forced_bytes >= FORCED_MIN_BYTES && top.forced_bytes >= 2 * forced;
    let n = rows.len();
    let title = format!(
        "{} is the outlier of {n} ranks and devices: peak {} held, {ratio:.1}x the others' median {}",
        top.who(),
        b(top.peak_held),
        b(held)
    );
    let root = if fragments {
        format!(
            "its cache fragments: {} new segments ({}) were reserved while its cache held the bytes but no block that fit (the others' median {}); fragmentation up to {:.0}% (the others' median {:.0}%)",
            top.forced_segments,
            b(top.forced_bytes),
            b(forced),
            top.fragmentation * 100.0,
            frag * 100.0
        )
    } else if top.blocks() && top.peak_allocated > allocated {
        format!(
            "it holds more tensors: up to {} allocated against the others' median {} (uneven data or model shards)",
            b(top.peak_allocated),
            b(allocated)
        )
    } else {
        format!(
            "it holds more device memory than the others ({} against a median {})",
            b(top.peak_held),
            b(held)
        )
    };
    let effect = match top.first_failure_ns {
        Some(_) => format!(
            "it failed ({} failed allocations) while the other {} did not: one rank's OOM ends the whole job",
            top.failures,
            n - 1
        ),
        None => "it is the first to run out of memory: one rank's OOM ends the whole job".into(),
    };
    let mut fix: Vec<Fix> = Vec::new();
    if fragments {
        fix.push(Fix::setting(EXPANDABLE, "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True on every rank (segments grow in place instead of fragmenting)"));
        fix.push(
            format!(
                "give {} batches of even shapes (bucket sequences by length), as the others get",
                top.who()
            )
            .into(),
        );
    } else {
        fix.push(
            format!(
                "balance what {} gets (data shard, sequence lengths, pipeline stage) against the others",
                top.who()
            )
            .into(),
        );
    }
    fix.push(
        "size the job for its largest rank, not the average: the others' headroom does not help it"
            .into(),
    );
    let mut timeline = Vec::new();
    if let Some(ts) = top.first_failure_ns {
        timeline.push(TimelineEntry {
            ts_ns: ts,
            text: format!("{}: first failed allocation", top.who()),
        });
    }
    Some(Chain {
        rule: Rule::RankOutlier,
        severity: if top.failures > 0 {
            Severity::High
        } else {
            Severity::Medium
        },
        pid: top.pid,
        title,
        root,
        effect,
        compounding: Vec::new(),
        timeline: timeline_or_start(timeline, window_from_ns),
        fix,
        evidence: format!(
            "{n} process-device pairs of {} compared; {}",
            top.job,
            rows.iter()
                .map(|r| format!("{}: {}", r.who(), b(r.peak_held)))
                .collect::<Vec<_>>()
                .join(", ")
        ),
    })
}

fn timeline_or_start(timeline: Vec<TimelineEntry>, from_ns: i64) -> Vec<TimelineEntry> {
    if timeline.is_empty() {
        vec![TimelineEntry {
            ts_ns: from_ns,
            text: "the window analysed begins".into(),
        }]
    } else {
        timeline
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Rank;

    const MIB: u64 = 1 << 20;

    fn row(pid: u32, held_mib: u64, frag: f64, failed_at: Option<i64>) -> DeviceRow {
        // A fragmenting rank forces segments: a tenth of what it holds, here.
        let forced = if frag > 0.3 { held_mib * MIB / 10 } else { 0 };
        DeviceRow {
            pid,
            rank: Some(Rank {
                rank: Some(pid - 100),
                local_rank: Some(pid - 100),
                world_size: Some(4),
            }),
            device: (pid - 100) as i32,
            gpu: format!("GPU {}", pid - 100),
            job: "torchelastic run t".into(),
            gpu_key: format!("GPU {}", pid - 100),
            view: "blocks",
            peak_held: held_mib * MIB,
            peak_reserved: held_mib * MIB,
            peak_allocated: held_mib * MIB / 2,
            fragmentation: frag,
            forced_segments: forced / (20 * MIB),
            forced_bytes: forced,
            failures: failed_at.map_or(0, |_| 1),
            retries: 0,
            ooms: failed_at.map_or(0, |_| 1),
            unknown: false,
            first_failure_ns: failed_at,
        }
    }

    #[test]
    fn the_rank_that_failed_is_the_outlier() {
        let rows = [
            row(100, 1800, 0.02, None),
            row(101, 1850, 0.03, None),
            row(102, 2900, 0.45, Some(5)),
            row(103, 1790, 0.01, None),
        ];
        let c = outlier_chain(&rows, 0).expect("an outlier");
        assert_eq!(c.pid, 102);
        assert_eq!(c.severity, Severity::High);
        assert!(
            c.title
                .starts_with("rank 2/4 (pid 102, GPU 2) is the outlier of 4"),
            "{}",
            c.title
        );
        assert!(c.title.contains("1.6x"), "{}", c.title);
        assert!(
            c.root
                .starts_with("its cache fragments: 14 new segments (290.0 MiB)"),
            "{}",
            c.root
        );
        assert!(
            c.root
                .contains("fragmentation up to 45% (the others' median 2%)"),
            "{}",
            c.root
        );
        assert!(c.fix[0].text.contains("expandable_segments"));
    }

    #[test]
    fn a_rank_far_above_the_others_stands_out_without_failing() {
        let rows = [row(100, 1000, 0.02, None), row(101, 1700, 0.05, None)];
        let c = outlier_chain(&rows, 0).expect("an outlier");
        assert_eq!(c.pid, 101);
        assert_eq!(c.severity, Severity::Medium);
        assert!(c.root.starts_with("it holds more tensors"), "{}", c.root);
    }

    #[test]
    fn even_ranks_have_no_outlier() {
        let even = [
            row(100, 1000, 0.02, None),
            row(101, 1100, 0.05, None),
            row(102, 1050, 0.0, None),
        ];
        assert!(outlier_chain(&even, 0).is_none());
        assert!(outlier_chain(&even[..1], 0).is_none());
        let all_failed = [row(100, 1000, 0.0, Some(1)), row(101, 1000, 0.0, Some(2))];
        assert!(outlier_chain(&all_failed, 0).is_none());
    }

    #[test]
    fn processes_of_other_jobs_are_never_ranks() {
        // Two unrelated processes on one GPU, one holding 14x the other: no rank chain.
        let mut a = row(100, 9_000, 0.0, None);
        let mut b = row(101, 130_000, 0.0, None);
        a.job = "pid 100".into();
        b.job = "pid 101".into();
        assert!(outlier_chains(&[a.clone(), b.clone()], 0).is_empty());
        // The same two as ranks of one job: compared.
        b.job = a.job.clone();
        assert_eq!(outlier_chains(&[a, b], 0).len(), 1);
    }
}
