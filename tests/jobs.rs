//! One answer for a job across nodes: two simulated nodes (each a tracer in a host name of its
//! own, tracing only its own copy of the simulated runtime and so only its ranks, with its own
//! database and `--dump-on-oom` folder), ranks of one job split across them; `tracer explain
//! --dumps` over the folders gathered from both.

use std::{
    os::unix::fs::{MetadataExt as _, PermissionsExt as _},
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

/// Rank `rank` of job `job` running `scenario` on the node whose runtime is `sim`, as nobody.
fn rank(sim: &Path, job: &str, rank: &str, scenario: &str) -> Child {
    rank_with(sim, rank, scenario, &[("TORCHELASTIC_RUN_ID", job)])
}

fn rank_with(sim: &Path, rank: &str, scenario: &str, env: &[(&str, &str)]) -> Child {
    use std::os::unix::process::CommandExt as _;
    Command::new("/usr/bin/python3")
        .arg(workspace().join("demos/workloads/train.py"))
        .args([scenario, "--speed", "5", "--duration", "20", "--cudart"])
        .arg(sim.join("libcudart.so.12"))
        .env_clear()
        .env("SIMCUDA_MEM", "1GiB")
        .env("RANK", rank)
        .env("WORLD_SIZE", "4")
        .envs(env.iter().copied())
        .uid(NOBODY)
        .gid(NOBODY)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap()
}

const NOBODY: u32 = 65534;

/// Every folder from `dir` down to each dump's is nobody's, mode 0700.
fn owned_by_nobody(dir: &Path) {
    for e in std::fs::read_dir(dir).unwrap().flatten() {
        let meta = std::fs::symlink_metadata(e.path()).unwrap();
        if meta.is_dir() {
            assert_eq!(
                (meta.uid(), meta.mode() & 0o7777),
                (NOBODY, 0o700),
                "{}",
                e.path().display()
            );
            owned_by_nobody(&e.path());
        }
    }
}

/// The snapshots under `dir`.
fn snapshots(dir: &Path) -> usize {
    if dir.join("snapshot.pickle").is_file() {
        return 1;
    }
    std::fs::read_dir(dir)
        .map(|d| {
            d.flatten()
                .filter(|e| e.path().is_dir())
                .map(|e| snapshots(&e.path()))
                .sum()
        })
        .unwrap_or(0)
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
    // The job runs as nobody: it reaches the runtime; the dumps' root is sticky, as /tmp.
    for d in [fx.sim.parent().unwrap(), fx.sim.as_path()] {
        std::fs::set_permissions(d, std::fs::Permissions::from_mode(0o755)).unwrap();
    }
    for d in [&dumps_a, &dumps_b] {
        std::fs::create_dir(d).unwrap();
        std::fs::set_permissions(d, std::fs::Permissions::from_mode(0o1777)).unwrap();
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
    // until the device is full: all four run out at the same request. Beside it, one
    // single-node job on each node with torchrun's defaults (run id "none", 127.0.0.1:29500).
    let defaults = [
        ("TORCHELASTIC_RUN_ID", "none"),
        ("MASTER_ADDR", "127.0.0.1"),
        ("MASTER_PORT", "29500"),
    ];
    let began = std::time::Instant::now();
    let mut same: Vec<Child> = vec![
        rank(&sim_a, "same", "0", "oom"),
        rank(&sim_a, "same", "1", "oom"),
        rank(&sim_b, "same", "2", "oom"),
        rank(&sim_b, "same", "3", "oom"),
        rank_with(&sim_a, "0", "oom", &defaults),
        rank_with(&sim_b, "0", "oom", &defaults),
    ];
    for c in &mut same {
        assert_eq!(c.wait().unwrap().code(), Some(1));
    }
    // Each OOM's snapshot within 5 s of the last rank's end.
    wait_until(Duration::from_secs(5), "the first six snapshots", || {
        snapshots(&dumps_a) + snapshots(&dumps_b) >= 6
    });
    eprintln!(
        "six OOMs dumped {:?} after the ranks began",
        began.elapsed()
    );
    // Job "one": rank 0 on node-a runs out; ranks 1 (node-a), 2 and 3 (node-b) train on.
    let mut steady = vec![
        rank(&sim_a, "one", "1", "leak"),
        rank(&sim_b, "one", "2", "leak"),
        rank(&sim_b, "one", "3", "leak"),
    ];
    std::thread::sleep(Duration::from_secs(2));
    let mut out = rank(&sim_a, "one", "0", "oom");
    assert_eq!(out.wait().unwrap().code(), Some(1));
    // Its OOM's folder and rank 1's (node-a's other rank of the job) at it.
    let one_on_a = dumps_a.join(NOBODY.to_string()).join("run-one");
    wait_until(Duration::from_secs(10), "job one's dumps", || {
        folders(&one_on_a) >= 2
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
    wait_until(Duration::from_secs(10), "four verdicts on the page", || {
        verdict_lines().len() == 4
    });
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
        ["none:0", "one:0", "one:1", "same:0", "same:1"]
    );
    assert_eq!(
        ranks_in(&top.path().join("b.db")),
        ["none:0", "one:2", "one:3", "same:2", "same:3"]
    );

    owned_by_nobody(&dumps_a);
    owned_by_nobody(&dumps_b);
    // Gathered from both nodes, as folders or as databases: one answer per job.
    let jobs = tracer_json(
        &top.path().join("a.db"),
        &["explain", "--json", "--dumps", top.path().to_str().unwrap()],
    );
    let (db_a, db_b) = (top.path().join("a.db"), top.path().join("b.db"));
    // (The helper gives node-b's --db after node-a's; node-a's twice is read once.)
    let from_dbs = tracer_json(
        &db_b,
        &[
            "explain",
            "--json",
            "--db",
            db_a.to_str().unwrap(),
            "--db",
            db_a.to_str().unwrap(),
        ],
    );
    for jobs in [&jobs, &from_dbs] {
        answered_as_one(jobs);
    }
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
    assert!(text.contains("All 4 ranks of WORLD_SIZE 4 seen"), "{text}");
    let missing = Command::new(TRACER)
        .args(["explain", "--dumps"])
        .arg(top.path().join("nowhere"))
        .output()
        .unwrap();
    assert_eq!(missing.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&missing.stderr).contains("nowhere: no such folder"));
}

/// The answers both ways of gathering give: job "same" died at one request on both nodes, job
/// "one"'s rank 0 stood out, and the two torchrun-default jobs are one on each node.
fn answered_as_one(jobs: &Value) {
    let job = |name: &str| -> &Value {
        jobs.as_array()
            .unwrap()
            .iter()
            .find(|j| j["job"] == name)
            .unwrap_or_else(|| panic!("no job {name} in {jobs:#}"))
    };
    for node in ["node-a", "node-b"] {
        let local = job(&format!("local-29500 on {node}"));
        assert_eq!(local["nodes"], serde_json::json!([node]), "{local:#}");
        assert_eq!(local["shape"]["kind"], "alone", "{local:#}");
    }
    let same_job = job("run-same");
    assert_eq!(
        same_job["nodes"],
        serde_json::json!(["node-a", "node-b"]),
        "{same_job:#}"
    );
    assert_eq!(same_job["shape"]["kind"], "same_request", "{same_job:#}");
    assert_eq!(same_job["shape"]["ranks"], 4, "{same_job:#}");
    assert_eq!(
        same_job["followed"].as_array().unwrap().len(),
        3,
        "{same_job:#}"
    );
    assert_eq!(same_job["agreement"]["world_sizes"], serde_json::json!([4]));
    assert_eq!(same_job["agreement"]["ranks_seen"], 4);
    let one = job("run-one");
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

/// PyTorch's probes not attached (only the CUDA libraries traced): no OOM message comes, and
/// the OOM is the failed device allocation its retry did not mend. It is dumped all the same,
/// said so, with explain's verdict on that failure and what NVML's absence leaves unknown.
#[test]
fn an_oom_without_pytorchs_message_is_dumped_from_its_failed_attempt() {
    let Some(fx) = Fixture::new() else { return };
    let dumps = tempfile::tempdir().unwrap();
    let trace = fx.trace(
        &["libcudart.so.12", "libcuda.so.1"],
        &["--dump-on-oom", dumps.path().to_str().unwrap()],
    );
    let out = Command::new("python3")
        .arg(workspace().join("demos/workloads/train.py"))
        .args(["oom", "--speed", "5", "--duration", "20", "--cudart"])
        .arg(fx.sim.join("libcudart.so.12"))
        .env("SIMCUDA_MEM", "1GiB")
        .env("RANK", "5")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    // Dumped once PyTorch's retry time (2 s) has passed with no allocation after the failure.
    wait_until(Duration::from_secs(8), "the failed attempt's dump", || {
        folders(dumps.path()) == 1
    });
    let stopped = trace.stop(SIGINT);
    assert_eq!(stopped.summary["dumps"]["failed"], serde_json::json!([]));
    let written = stopped.summary["dumps"]["written"]
        .as_array()
        .unwrap()
        .clone();
    assert_eq!(written.len(), 1, "{}", stopped.summary);
    let dir = PathBuf::from(written[0].as_str().unwrap());
    let read = |name: &str| -> Value {
        serde_json::from_slice(&std::fs::read(dir.join(name)).unwrap()).unwrap()
    };
    let about = read("dump.json");
    assert_eq!(about["seen"], "failed_attempt", "{about:#}");
    assert_eq!(about["rank"], "5", "{about:#}");
    assert_eq!(about["job"], "no-job", "{about:#}");
    // The verdict is on that failure: the dump's instant is the failed call's.
    let explained = read("explain.json");
    let holder = &explained["holders"][0];
    assert_eq!(holder["pid"], about["pid"], "{explained:#}");
    assert!(
        holder["at_ns"].as_i64().unwrap() <= about["oom_ts_ns"].as_i64().unwrap(),
        "{holder:#} {about:#}"
    );
    assert!(holder["arithmetic"]["asked"].as_u64().unwrap() > 0);
    assert!(dir.join("snapshot.pickle").is_file());
    let gpu = read("gpu.json");
    assert!(
        gpu["gpus"].as_array().unwrap().is_empty()
            && gpu["said"].as_str().unwrap().contains("NVML was not read"),
        "{gpu:#}"
    );
}

/// `tracer demo multi-node`: two simulated nodes, each its own database (its session's host the
/// node), ranks 0-1 on node-a and 2-3 on node-b; rank 2's fragmented cache ends the job. The
/// answer across both databases names rank 2 on node-b the first to die and the outlier, and
/// `tracer explain --db A --db B` gives the same answer.
#[test]
fn the_multi_node_demo_answers_the_job_across_both_databases() {
    // Its workloads load the demos' shared runtime, which a traced demo probes.
    let _turn = demo_turn(false);
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("demo.db");
    let out = Command::new(TRACER)
        .args([
            "demo",
            "multi-node",
            "--duration",
            "20s",
            "--speed",
            "2",
            "--db",
        ])
        .arg(&db)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains("First: rank 2 on node-b")
            && stdout.contains("rank 2 on node-b stood out")
            && stdout.contains("All 4 ranks of WORLD_SIZE 4 seen"),
        "{stdout}"
    );
    let (a, b) = (
        dir.path().join("demo-node-a.db"),
        dir.path().join("demo-node-b.db"),
    );
    for (node_db, node) in [(&a, "node-a"), (&b, "node-b")] {
        let host = query(node_db, "SELECT host FROM sessions");
        assert_eq!(host[0]["host"], node, "{host:?}");
    }
    let jobs = tracer_json(&a, &["explain", "--json", "--db", b.to_str().unwrap()]);
    let job = &jobs[0];
    assert_eq!(jobs.as_array().unwrap().len(), 1, "{jobs:#}");
    assert_eq!(job["nodes"], serde_json::json!(["node-a", "node-b"]));
    assert_eq!(job["shape"]["kind"], "outlier", "{job:#}");
    let first = &job["ranks"][job["first"].as_u64().unwrap() as usize];
    assert_eq!(
        (&first["rank"], &first["node"]),
        (&"2".into(), &"node-b".into())
    );
    assert_eq!(first["verdict"], "fragmentation", "{job:#}");
    let peers = job["ranks"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|r| r["role"] == "peer")
        .count();
    assert_eq!(peers, 3, "{job:#}");
}
