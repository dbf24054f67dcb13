//! One answer for a job across nodes: `tracer explain --dumps DIR` reads the `--dump-on-oom`
//! folders gathered from every node (a shared filesystem, `kubectl cp`), `--db` given more than
//! once reads every node's database (job/from_db.rs), and per-rank PyTorch snapshots are
//! imported beside them. The ranks of each job are matched by the job's name (model/job.rs),
//! split into runs where their start times say the name was used again, checked for agreement
//! (WORLD_SIZE); then: which rank ran out first and when the others followed, whether they died
//! at the same request (the job's shape) or one stood out, with a row for every rank.

use std::path::{Path, PathBuf};

use anyhow::{Context as _, Result};
use serde::Serialize;
use serde_json::Value;

use crate::model::job::job_key;

mod from_db;
pub use from_db::{from_db, measure_peers, DbPeer};

/// Folders below DIR searched for a dump (DIR/<uid>/<job>/<dump>/ as tracer writes them, one
/// level more for a node's folder gathered beside the others').
const DEPTH: usize = 4;
/// Two requests PyTorch asked for are "the same" within its 2 MiB rounding of large segments.
const SAME_REQUEST: u64 = 2 << 20;

/// One rank's folder, as its dump.json, layout.json and explain.json say.
#[derive(Clone, Debug, Serialize)]
pub struct RankDump {
    pub path: PathBuf,
    pub job: String,
    pub rank: Option<String>,
    pub node: Option<String>,
    pub pid: u32,
    /// "oom": this rank ran out; "peer": dumped at another rank's OOM.
    pub role: String,
    pub ts_ns: i64,
    /// The OOM's verdict and figures (the OOM's folder only).
    pub verdict: Option<String>,
    pub asked: Option<u64>,
    pub shortfall: Option<u64>,
    /// Bytes its allocator reserved then, over its devices.
    pub reserved: Option<u64>,
    /// The failed call's site (`--stack`): the line that asked.
    pub site: Option<String>,
    /// WORLD_SIZE as the rank's environment said, and when the process started (wall ns).
    pub world_size: Option<u32>,
    pub started_ns: Option<i64>,
}

/// What the ranks of one job add up to.
#[derive(Clone, Debug, Serialize)]
pub struct JobAnswer {
    pub job: String,
    pub nodes: Vec<String>,
    pub ranks: Vec<RankDump>,
    /// The rank whose OOM came first, and each later OOM's delay after it (ns).
    pub first: Option<usize>,
    pub followed: Vec<(usize, i64)>,
    pub shape: Shape,
    pub agreement: Agreement,
}

/// Whether the ranks gathered under one name are one run of one job.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Agreement {
    /// Every WORLD_SIZE the ranks' environments gave (more than one: they disagree).
    pub world_sizes: Vec<u32>,
    /// Distinct ranks seen, against WORLD_SIZE where one was given.
    pub ranks_seen: usize,
    /// The latest rank's start after the earliest's (ns), where every start is known.
    pub start_spread_ns: Option<i64>,
    /// Ranks seen with more than one process: restarted (torchelastic, a rescheduled pod).
    pub restarted: Vec<String>,
    /// This is run `run` of `runs` under the job's name, told apart by start time.
    pub run: usize,
    pub runs: usize,
}

#[derive(Clone, Debug, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Shape {
    /// Every rank that ran out asked for the same request: the job's size, not one rank's.
    SameRequest {
        ranks: usize,
        asked: u64,
        /// The line every one of them asked from, where `--stack` recorded the same one.
        site: Option<String>,
    },
    /// One rank ran out while the others did not, or asked for more than the others did.
    Outlier {
        rank: usize,
        asked: Option<u64>,
        reserved: Option<u64>,
        others_median_reserved: Option<u64>,
        site: Option<String>,
    },
    /// The ranks that ran out asked different sizes, none standing out alone.
    Different,
    /// One rank's dumps only, no other rank's to compare with.
    Alone,
    /// No rank ran out in these folders.
    NoOom,
}

/// Every dump folder below `dir` (no link followed), by its dump.json.
pub fn read_dumps(dir: &Path) -> Result<Vec<RankDump>> {
    if !dir.is_dir() {
        return Err(crate::exit::user_error(format!(
            "--dumps {}: no such folder: give the folder --dump-on-oom wrote, or where every node's were gathered",
            dir.display()
        )));
    }
    let mut found = Vec::new();
    walk(dir, DEPTH, &mut found)
        .with_context(|| format!("read the dump folders under {}", dir.display()))?;
    let mut dumps: Vec<RankDump> = found.iter().filter_map(|p| read_one(p)).collect();
    dumps.sort_by(|a, b| (&a.job, a.ts_ns, &a.rank).cmp(&(&b.job, b.ts_ns, &b.rank)));
    Ok(dumps)
}

fn walk(dir: &Path, depth: usize, found: &mut Vec<PathBuf>) -> std::io::Result<()> {
    if dir.join("dump.json").is_file() {
        found.push(dir.to_owned());
        return Ok(());
    }
    if depth == 0 {
        return Ok(());
    }
    for entry in std::fs::read_dir(dir)? {
        let entry = entry?;
        // A link is not followed: a folder gathered from elsewhere is read where it lies.
        if entry.file_type()?.is_dir() {
            walk(&entry.path(), depth - 1, found)?;
        }
    }
    Ok(())
}

/// Per-rank PyTorch memory snapshots below `dir` (torchtitan's `rankK_memory_snapshot.pickle`,
/// any `_dump_snapshot()` output whose name says `rank<K>`), with their rank; dump folders' own
/// snapshots are theirs, not listed.
pub fn rank_snapshots(dir: &Path) -> Result<Vec<(PathBuf, String)>> {
    let mut found = Vec::new();
    snapshots_in(dir, DEPTH, &mut found)
        .with_context(|| format!("look for rank snapshots under {}", dir.display()))?;
    found.sort();
    Ok(found)
}

fn snapshots_in(
    dir: &Path,
    depth: usize,
    found: &mut Vec<(PathBuf, String)>,
) -> std::io::Result<()> {
    if dir.join("dump.json").is_file() {
        return Ok(());
    }
    for entry in std::fs::read_dir(dir)? {
        let entry = entry?;
        let kind = entry.file_type()?;
        let name = entry.file_name().to_string_lossy().into_owned();
        if kind.is_dir() && depth > 0 {
            snapshots_in(&entry.path(), depth - 1, found)?;
        } else if kind.is_file() && (name.ends_with(".pickle") || name.ends_with(".pickle.gz")) {
            if let Some(rank) = rank_in(&name) {
                found.push((entry.path(), rank));
            }
        }
    }
    Ok(())
}

/// The rank a file's name says: the digits after "rank".
fn rank_in(name: &str) -> Option<String> {
    let at = name.find("rank")? + 4;
    let digits: String = name[at..]
        .chars()
        .take_while(char::is_ascii_digit)
        .collect();
    (!digits.is_empty()).then_some(digits)
}

/// A rank's snapshot as a row: imported and explained (by the caller) into `explained` and
/// `layout`; its job is the folder it lies in (torchtitan's `iteration_N_exit`).
pub fn snapshot_rank(
    file: &Path,
    rank: String,
    pid: u32,
    explained: &Value,
    layout: &Value,
    last_ns: i64,
) -> RankDump {
    let holder = explained["holders"]
        .as_array()
        .and_then(|h| h.first())
        .cloned();
    let reserved = reserved_of(layout);
    let job = file
        .parent()
        .and_then(|p| p.file_name())
        .map_or("snapshots".into(), |n| {
            format!("snapshots-{}", n.to_string_lossy())
        });
    let (verdict, asked, shortfall) = judged(holder.as_ref());
    RankDump {
        path: file.to_owned(),
        job,
        rank: Some(rank),
        node: None,
        pid,
        role: if holder.is_some() { "oom" } else { "peer" }.into(),
        ts_ns: holder
            .as_ref()
            .and_then(|h| h["at_ns"].as_i64())
            .unwrap_or(last_ns),
        verdict,
        asked,
        shortfall,
        reserved,
        site: holder
            .as_ref()
            .and_then(|h| h["site"].as_str().map(str::to_owned)),
        world_size: None,
        started_ns: None,
    }
}

/// explain's verdict on an OOM, the bytes asked and the bytes short (its `holders` entry).
fn judged(holder: Option<&Value>) -> (Option<String>, Option<u64>, Option<u64>) {
    let Some(h) = holder else {
        return (None, None, None);
    };
    (
        h["verdict"].as_str().map(str::to_owned),
        h["arithmetic"]["asked"].as_u64(),
        h["arithmetic"]["shortfall"].as_u64(),
    )
}

/// What a process's allocator reserved over its devices, from `layout --json`'s output.
fn reserved_of(layout: &Value) -> Option<u64> {
    let devices = layout.as_array()?.first()?["devices"].as_array()?;
    Some(
        devices
            .iter()
            .filter_map(|d| d["total"]["reserved"].as_u64())
            .sum(),
    )
}

fn json(path: &Path) -> Option<Value> {
    serde_json::from_slice(&std::fs::read(path).ok()?).ok()
}

fn read_one(dir: &Path) -> Option<RankDump> {
    let about = json(&dir.join("dump.json"))?;
    let explained = json(&dir.join("explain.json"));
    let holder = explained
        .as_ref()
        .and_then(|e| e["holders"].as_array()?.first().cloned());
    let reserved = json(&dir.join("layout.json")).and_then(|l| reserved_of(&l));
    let (verdict, asked, shortfall) = judged(holder.as_ref());
    Some(RankDump {
        path: dir.to_owned(),
        job: about["job"].as_str()?.to_owned(),
        rank: about["rank"].as_str().map(str::to_owned),
        node: about["node"].as_str().map(str::to_owned),
        pid: about["pid"].as_u64()? as u32,
        role: about["role"].as_str()?.to_owned(),
        ts_ns: about["oom_ts_ns"].as_i64()?,
        verdict,
        asked,
        shortfall,
        reserved,
        site: holder
            .as_ref()
            .and_then(|h| h["site"].as_str().map(str::to_owned)),
        world_size: about["world_size"].as_u64().map(|w| w as u32),
        started_ns: about["started_ns"].as_i64(),
    })
}

/// Ranks of one name that started this far apart are two runs of it (a job id used again, a
/// restart of every rank); torchrun starts a run's ranks within seconds of its rendezvous.
const NEW_RUN_NS: i64 = 120_000_000_000;

/// The answer for each job among `dumps`.
pub fn answer(dumps: Vec<RankDump>) -> Vec<JobAnswer> {
    let mut jobs: Vec<JobAnswer> = Vec::new();
    for mut d in dumps {
        d.job = job_key(&d.job, d.node.as_deref(), d.pid);
        match jobs.iter_mut().find(|j| j.job == d.job) {
            Some(j) => j.ranks.push(d),
            None => jobs.push(JobAnswer {
                job: d.job.clone(),
                nodes: Vec::new(),
                ranks: vec![d],
                first: None,
                followed: Vec::new(),
                shape: Shape::NoOom,
                agreement: Agreement::default(),
            }),
        }
    }
    let mut jobs: Vec<JobAnswer> = jobs.into_iter().flat_map(split_runs).collect();
    for j in &mut jobs {
        settle(j);
    }
    jobs
}

/// A job's ranks as runs: where every start is known, sorted by it and cut where the next
/// started more than [`NEW_RUN_NS`] after the one before.
fn split_runs(mut j: JobAnswer) -> Vec<JobAnswer> {
    if j.ranks.iter().any(|r| r.started_ns.is_none()) {
        return vec![j];
    }
    j.ranks.sort_by_key(|r| r.started_ns);
    let mut runs: Vec<Vec<RankDump>> = Vec::new();
    let mut last: Option<i64> = None;
    for r in j.ranks.drain(..) {
        let start = r.started_ns.unwrap_or_default();
        if last.is_none_or(|l| start - l > NEW_RUN_NS) {
            runs.push(Vec::new());
        }
        last = Some(start);
        if let Some(run) = runs.last_mut() {
            run.push(r);
        }
    }
    let n = runs.len();
    runs.into_iter()
        .enumerate()
        .map(|(i, ranks)| JobAnswer {
            job: if n > 1 {
                format!("{} (run {} of {n})", j.job, i + 1)
            } else {
                j.job.clone()
            },
            ranks,
            agreement: Agreement {
                run: i + 1,
                runs: n,
                ..Agreement::default()
            },
            ..j.clone()
        })
        .collect()
}

/// What the ranks say of themselves: WORLD_SIZE, how many, started how far apart, restarted.
fn agreement(j: &JobAnswer) -> Agreement {
    let mut world_sizes: Vec<u32> = j.ranks.iter().filter_map(|r| r.world_size).collect();
    world_sizes.sort();
    world_sizes.dedup();
    let mut by_rank: std::collections::BTreeMap<&str, Vec<u32>> = Default::default();
    for r in &j.ranks {
        if let Some(rank) = r.rank.as_deref() {
            let pids = by_rank.entry(rank).or_default();
            if !pids.contains(&r.pid) {
                pids.push(r.pid);
            }
        }
    }
    let starts: Option<Vec<i64>> = j.ranks.iter().map(|r| r.started_ns).collect();
    Agreement {
        world_sizes,
        ranks_seen: by_rank.len(),
        start_spread_ns: starts
            .filter(|s| !s.is_empty())
            .map(|s| s.iter().max().unwrap_or(&0) - s.iter().min().unwrap_or(&0)),
        restarted: by_rank
            .iter()
            .filter(|(_, pids)| pids.len() > 1)
            .map(|(r, _)| (*r).to_owned())
            .collect(),
        run: j.agreement.run.max(1),
        runs: j.agreement.runs.max(1),
    }
}

fn settle(j: &mut JobAnswer) {
    j.ranks.sort_by_key(|r| (r.ts_ns, rank_number(r)));
    let mut nodes: Vec<String> = j.ranks.iter().filter_map(|r| r.node.clone()).collect();
    nodes.sort();
    nodes.dedup();
    j.nodes = nodes;
    let ooms: Vec<usize> = (0..j.ranks.len())
        .filter(|&i| j.ranks[i].role == "oom")
        .collect();
    j.first = ooms.first().copied();
    if let Some(first) = j.first {
        let t0 = j.ranks[first].ts_ns;
        j.followed = ooms[1..]
            .iter()
            .map(|&i| (i, j.ranks[i].ts_ns - t0))
            .collect();
    }
    j.shape = shape(&j.ranks, &ooms);
    j.agreement = agreement(j);
}

fn rank_number(r: &RankDump) -> i64 {
    r.rank
        .as_deref()
        .and_then(|r| r.parse().ok())
        .unwrap_or(i64::MAX)
}

fn shape(ranks: &[RankDump], ooms: &[usize]) -> Shape {
    let Some(&first) = ooms.first() else {
        return Shape::NoOom;
    };
    let peers: Vec<&RankDump> = ranks.iter().filter(|r| r.role == "peer").collect();
    let asked: Vec<u64> = ooms.iter().filter_map(|&i| ranks[i].asked).collect();
    let same =
        asked.len() == ooms.len() && asked.iter().all(|&a| a.abs_diff(asked[0]) < SAME_REQUEST);
    // Ranks are told apart by rank (a restarted rank's second OOM is the same rank).
    let distinct = |idx: &[usize]| {
        let mut r: Vec<i64> = idx.iter().map(|&i| rank_number(&ranks[i])).collect();
        r.sort();
        r.dedup();
        r.len()
    };
    if same && distinct(ooms) > 1 {
        let sites: Vec<Option<&String>> = ooms.iter().map(|&i| ranks[i].site.as_ref()).collect();
        return Shape::SameRequest {
            ranks: distinct(ooms),
            asked: asked[0],
            site: sites
                .iter()
                .all(|s| s.is_some() && *s == sites[0])
                .then(|| sites[0].cloned())
                .flatten(),
        };
    }
    if distinct(ooms) == 1 && peers.is_empty() {
        return Shape::Alone;
    }
    if distinct(ooms) == 1 {
        let mut theirs: Vec<u64> = peers.iter().filter_map(|p| p.reserved).collect();
        theirs.sort();
        return Shape::Outlier {
            rank: first,
            asked: ranks[first].asked,
            reserved: ranks[first].reserved,
            others_median_reserved: theirs.get(theirs.len() / 2).copied(),
            site: ranks[first].site.clone(),
        };
    }
    Shape::Different
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dump(job: &str, rank: &str, node: &str, pid: u32, ts_ns: i64, asked: u64) -> RankDump {
        RankDump {
            path: PathBuf::from(format!("/d/{pid}")),
            job: job.into(),
            rank: Some(rank.into()),
            node: Some(node.into()),
            pid,
            role: "oom".into(),
            ts_ns,
            verdict: Some("this_process".into()),
            asked: Some(asked),
            shortfall: Some(1),
            reserved: Some(asked * 4),
            site: None,
            world_size: Some(2),
            started_ns: Some(0),
        }
    }

    #[test]
    fn a_snapshots_rank_is_in_its_name() {
        assert_eq!(
            rank_in("rank13_memory_snapshot.pickle").as_deref(),
            Some("13")
        );
        assert_eq!(rank_in("snap-rank2.pickle.gz").as_deref(), Some("2"));
        assert_eq!(rank_in("memory_snapshot.pickle"), None);
        assert_eq!(rank_in("ranking.pickle"), None);
    }

    #[test]
    fn two_single_node_jobs_with_torchruns_defaults_are_two_jobs() {
        // Both ran with run id "none" at 127.0.0.1:29500: each is its node's "local-29500".
        let jobs = answer(vec![
            dump("local-29500", "0", "node-a", 10, 1, 64 << 20),
            dump("local-29500", "1", "node-a", 11, 1, 64 << 20),
            dump("local-29500", "0", "node-b", 10, 2, 64 << 20),
        ]);
        assert_eq!(jobs.len(), 2, "{jobs:#?}");
        assert_eq!(jobs[0].ranks.len(), 2, "{jobs:#?}");
        assert!(matches!(jobs[1].shape, Shape::Alone));
        assert_ne!(jobs[0].job, jobs[1].job);
    }

    #[test]
    fn ranks_that_died_at_the_same_request_are_the_jobs_shape() {
        let jobs = answer(vec![
            dump("run-x", "1", "node-b", 20, 5, 96 << 20),
            dump("run-x", "0", "node-a", 10, 3, 96 << 20),
        ]);
        let j = &jobs[0];
        assert!(
            matches!(j.shape, Shape::SameRequest { ranks: 2, .. }),
            "{j:#?}"
        );
        assert_eq!(j.ranks[j.first.unwrap()].rank.as_deref(), Some("0"));
        assert_eq!(j.followed, vec![(1, 2)]);
        assert_eq!(j.nodes, ["node-a", "node-b"]);
    }

    #[test]
    fn a_name_used_again_later_is_another_run_and_disagreement_is_said() {
        let mut later = dump("run-x", "0", "node-a", 30, 900_000_000_000, 96 << 20);
        later.started_ns = Some(800_000_000_000);
        let mut restarted = dump("run-x", "1", "node-a", 12, 6, 96 << 20);
        restarted.world_size = Some(4);
        let jobs = answer(vec![
            dump("run-x", "0", "node-a", 10, 5, 96 << 20),
            dump("run-x", "1", "node-b", 11, 6, 96 << 20),
            restarted,
            later,
        ]);
        assert_eq!(jobs.len(), 2, "{jobs:#?}");
        assert_eq!(jobs[0].job, "run-x (run 1 of 2)");
        assert_eq!(jobs[0].ranks.len(), 3);
        assert_eq!(jobs[0].agreement.world_sizes, vec![2, 4]);
        assert_eq!(jobs[0].agreement.restarted, vec!["1".to_owned()]);
        assert_eq!(jobs[0].agreement.start_spread_ns, Some(0));
        assert_eq!((jobs[1].agreement.run, jobs[1].agreement.runs), (2, 2));
        assert!(matches!(jobs[1].shape, Shape::Alone));
    }
}
