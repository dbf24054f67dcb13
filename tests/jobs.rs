//! One answer for a job across nodes: two simulated nodes (each a tracer in a host name of its
//! own, tracing only its own copy of the simulated runtime and so only its ranks, with its own
//! database and `--dump-on-oom` folder), ranks of one job split across them; `tracer explain
//! --dumps` over the folders gathered from both.

use std::{
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::Duration,
};

use crate::common::*;
use serde_json::Value;

/// A copy of the simulated runtime for one node (its own files: another node's probes never
/// see its calls).
fn node_sim(fx: &Fixture, node: &str) -> PathBuf {
    let dir = fx.sim.parent().unwrap().join(node);
    std::fs::create_dir_all(&dir).unwrap();
    for f in ["libcudart.so.12", "libcuda.so.1", "libsimtorch.so"] {
        std::fs::copy(fx.sim.join(f), dir.join(f)).unwrap();
    }
    dir
}

fn trace_node(sim: &Path, db: &Path, dumps: &Path, node: &str) -> Trace {
    trace_node_with(sim, db, dumps, node, &[])
}

fn trace_node_with(sim: &Path, db: &Path, dumps: &Path, node: &str, extra: &[&str]) -> Trace {
    let libs: Vec<String> = ["libcudart.so.12", "libcuda.so.1", "libsimtorch.so"]
        .iter()
        .map(|f| sim.join(f).to_str().unwrap().to_owned())
        .collect();
    let mut args = vec!["--dump-on-oom", dumps.to_str().unwrap()];
    for l in &libs {
        args.extend(["--lib", l.as_str()]);
    }
    args.extend_from_slice(extra);
    Trace::start_on_node(db, &args, node)
}

/// Rank `rank` of job `job` running `scenario` on the node whose runtime is `sim`.
fn rank(sim: &Path, job: &str, rank: &str, scenario: &str) -> Child {
    Command::new("python3")
        .arg(workspace().join("demos/workloads/train.py"))
        .args([scenario, "--speed", "5", "--duration", "20", "--cudart"])
        .arg(sim.join("libcudart.so.12"))
        .env("SIMCUDA_MEM", "1GiB")
        .env("RANK", rank)
        .env("WORLD_SIZE", "4")
        .env("TORCHELASTIC_RUN_ID", job)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap()
}

/// The dump folders under `dir` (each has its dump.json).
fn folders(dir: &Path) -> usize {
    if dir.join("dump.json").is_file() {
        return 1;
    }
    std::fs::read_dir(dir)
        .map(|d| {
            d.flatten()
                .filter(|e| e.path().is_dir())
                .map(|e| folders(&e.path()))
                .sum()
        })
        .unwrap_or(0)
}

#[test]
fn a_job_across_two_nodes_is_answered_as_one() {
    let Some(fx) = Fixture::new() else { return };
    let top = tempfile::tempdir().unwrap();
    let (sim_a, sim_b) = (node_sim(&fx, "node-a"), node_sim(&fx, "node-b"));
    let (dumps_a, dumps_b) = (top.path().join("a"), top.path().join("b"));
    for d in [&dumps_a, &dumps_b] {
        std::fs::create_dir(d).unwrap();
    }
    let a = trace_node_with(
        &sim_a,
        &top.path().join("a.db"),
        &dumps_a,
        "node-a",
        &["--metrics", "127.0.0.1:0"],
    );
    let metrics: std::net::SocketAddr = a.started["metrics"].as_str().unwrap().parse().unwrap();
    let b = trace_node(&sim_b, &top.path().join("b.db"), &dumps_b, "node-b");

    // Job "same": ranks 0 and 1 on node-a, 2 and 3 on node-b, every one growing its batch
    // until the device is full: all four run out at the same request.
    let mut same: Vec<Child> = vec![
        rank(&sim_a, "same", "0", "oom"),
        rank(&sim_a, "same", "1", "oom"),
        rank(&sim_b, "same", "2", "oom"),
        rank(&sim_b, "same", "3", "oom"),
    ];
    for c in &mut same {
        assert_eq!(c.wait().unwrap().code(), Some(1));
    }
    // Job "one": rank 0 on node-a runs out; ranks 1 (node-a), 2 and 3 (node-b) train on.
    let mut steady = vec![
        rank(&sim_a, "one", "1", "leak"),
        rank(&sim_b, "one", "2", "leak"),
        rank(&sim_b, "one", "3", "leak"),
    ];
    std::thread::sleep(Duration::from_secs(2));
    let mut out = rank(&sim_a, "one", "0", "oom");
    assert_eq!(out.wait().unwrap().code(), Some(1));
    wait_until(Duration::from_secs(10), "the dumps", || {
        folders(&dumps_a) + folders(&dumps_b) >= 6
    });
    for c in &mut steady {
        let _ = c.kill();
        let _ = c.wait();
    }
    // Each OOM's verdict on node-a's metrics page, beside tracer_oom_total.
    let verdict_lines = || -> Vec<String> {
        get(metrics, "/metrics")
            .map(|(_, page)| {
                page.lines()
                    .filter(|l| l.starts_with("tracer_oom_verdicts_total{"))
                    .map(str::to_owned)
                    .collect()
            })
            .unwrap_or_default()
    };
    wait_until(
        Duration::from_secs(10),
        "three verdicts on the page",
        || verdict_lines().len() == 3,
    );
    let verdicts = verdict_lines();
    assert!(
        verdicts
            .iter()
            .all(|l| l.contains("verdict=\"") && l.ends_with(" 1")),
        "{verdicts:?}"
    );
    let (sa, sb) = (a.stop(SIGINT), b.stop(SIGINT));
    for s in [&sa, &sb] {
        assert_eq!(
            s.summary["dumps"]["failed"],
            serde_json::json!([]),
            "{}",
            s.summary
        );
    }
    // Each node's database holds only its own ranks.
    let ranks_in = |db: &Path| -> Vec<String> {
        let mut r: Vec<String> = query(db, "SELECT env FROM processes")
            .iter()
            .filter_map(|row| row["env"].as_str())
            .filter_map(|e| serde_json::from_str::<Value>(e).ok())
            .map(|e| {
                format!(
                    "{}:{}",
                    e["TORCHELASTIC_RUN_ID"].as_str().unwrap(),
                    e["RANK"].as_str().unwrap()
                )
            })
            .collect();
        r.sort();
        r
    };
    assert_eq!(
        ranks_in(&top.path().join("a.db")),
        ["one:0", "one:1", "same:0", "same:1"]
    );
    assert_eq!(
        ranks_in(&top.path().join("b.db")),
        ["one:2", "one:3", "same:2", "same:3"]
    );

    // Gathered from both nodes: one answer per job.
    let jobs = tracer_json(
        &top.path().join("a.db"),
        &["explain", "--json", "--dumps", top.path().to_str().unwrap()],
    );
    let job = |name: &str| -> &Value {
        jobs.as_array()
            .unwrap()
            .iter()
            .find(|j| j["job"] == format!("run-{name}"))
            .unwrap_or_else(|| panic!("no job {name} in {jobs:#}"))
    };
    let same_job = job("same");
    assert_eq!(
        same_job["nodes"],
        serde_json::json!(["node-a", "node-b"]),
        "{same_job:#}"
    );
    assert_eq!(same_job["shape"]["kind"], "same_request", "{same_job:#}");
    assert_eq!(same_job["shape"]["ranks"], 4, "{same_job:#}");
    assert_eq!(same_job["followed"].as_array().unwrap().len(), 3);
    let one = job("one");
    assert_eq!(one["shape"]["kind"], "outlier", "{one:#}");
    let outlier = &one["ranks"][one["shape"]["rank"].as_u64().unwrap() as usize];
    assert_eq!(
        (&outlier["rank"], &outlier["node"]),
        (&"0".into(), &"node-a".into()),
        "{one:#}"
    );
    assert!(
        one["shape"]["reserved"].as_u64().unwrap()
            > one["shape"]["others_median_reserved"].as_u64().unwrap(),
        "{one:#}"
    );
    let missing = Command::new(TRACER)
        .args(["explain", "--dumps"])
        .arg(top.path().join("nowhere"))
        .output()
        .unwrap();
    assert_eq!(missing.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&missing.stderr).contains("nowhere: no such folder"));
    let text = tracer_text(
        &top.path().join("a.db"),
        &["explain", "--dumps", top.path().to_str().unwrap()],
    );
    assert!(
        text.contains("Every rank that ran out (4) asked for"),
        "{text}"
    );
    assert!(text.contains("rank 0 on node-a stood out"), "{text}");
    assert!(text.contains("clocks' offset"), "{text}");
}

/// Per-rank PyTorch snapshots gathered as torchtitan writes them
/// (`iteration_N_exit/rankK_memory_snapshot.pickle`): two ranks that ran out at the same request
/// (the H200's real OOM snapshot) and one that did not, answered as one job.
#[test]
fn per_rank_pytorch_snapshots_are_answered_as_one_job() {
    let dir = tempfile::tempdir().unwrap();
    let exit = dir.path().join("iteration_40_exit");
    std::fs::create_dir(&exit).unwrap();
    let shared = workspace().join("../shared/snapshots");
    let oom = shared.join("h200-torch2.11-gpt2-expandable-oom.pickle.gz");
    for r in ["0", "1"] {
        std::fs::copy(
            &oom,
            exit.join(format!("rank{r}_memory_snapshot.pickle.gz")),
        )
        .unwrap();
    }
    std::fs::copy(
        shared.join("kkaitlyn111-cs336-a2-systems-c1272e18-memory_ctx128_fullstep_.pickle"),
        exit.join("rank2_memory_snapshot.pickle"),
    )
    .unwrap();
    let jobs = tracer_json(
        &dir.path().join("unused.db"),
        &["explain", "--json", "--dumps", dir.path().to_str().unwrap()],
    );
    let job = &jobs[0];
    assert_eq!(job["job"], "snapshots-iteration_40_exit", "{job:#}");
    assert_eq!(job["ranks"].as_array().unwrap().len(), 3, "{job:#}");
    assert_eq!(job["shape"]["kind"], "same_request", "{job:#}");
    assert_eq!(job["shape"]["ranks"], 2, "{job:#}");
    // The request the snapshot's own oom entry names (1.51 GiB, the same in both ranks).
    assert_eq!(job["shape"]["asked"], 1_621_350_154u64, "{job:#}");
    let peer = job["ranks"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["rank"] == "2")
        .unwrap();
    assert_eq!(peer["role"], "peer", "{job:#}");
    assert!(peer["ts_ns"].as_i64().unwrap() > 0, "{job:#}");
}
