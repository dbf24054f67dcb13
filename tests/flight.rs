//! The flight recorder, end to end: the job that dies after tracer evicted its first calls, was
//! restarted, or started late. A long training job on the simulated allocator with PyTorch's
//! probes (demos/workloads/long_job.py) ends with a fragmentation OOM and writes its own account
//! of its segments and blocks; tracer's layout at the OOM must equal it, and no verdict may rest
//! on state tracer did not see.

use std::{
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::Duration,
};

use crate::common::*;
use serde_json::Value;

/// Steps after which the job (seed 7) reserves no new segment.
const WARM: u32 = 20_000;

/// The simulated allocator's job, on a 512 MiB device.
struct Job {
    child: Child,
    dir: PathBuf,
}

impl Job {
    /// Starts the job: after `warmup` steps it is ready; its steps go on for `seconds`, then
    /// until [`Job::finish`].
    fn start(sim: &Path, dir: &Path, warmup: u32, seconds: f64) -> Job {
        let child = Command::new("python3")
            .arg(workspace().join("demos/workloads/long_job.py"))
            .arg("--cudart")
            .arg(sim.join("libcudart.so.12"))
            .args(["--seconds", &seconds.to_string()])
            .args(["--warmup-steps", &warmup.to_string()])
            .arg("--until")
            .arg(dir.join("until"))
            .arg("--account")
            .arg(dir.join("account.json"))
            .arg("--ready")
            .arg(dir.join("ready"))
            .env("SIMCUDA_MEM", "512MiB")
            .env("SIMCUDA_LATENCY", "default=0")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start long_job.py");
        let job = Job {
            child,
            dir: dir.to_owned(),
        };
        wait_until(Duration::from_secs(30), "the job's weights", || {
            dir.join("ready").exists()
        });
        job
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Ends the steps: the job fills the device and runs out of memory; its own account.
    fn finish(self) -> Value {
        std::fs::write(self.dir.join("until"), "").unwrap();
        let out = self.child.wait_with_output().unwrap();
        assert_eq!(
            out.status.code(),
            Some(1),
            "the job ends with PyTorch's OOM: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_slice(&std::fs::read(self.dir.join("account.json")).unwrap()).unwrap()
    }
}

fn libs(fx: &Fixture) -> Vec<String> {
    ["libcudart.so.12", "libsimtorch.so"]
        .iter()
        .flat_map(|l| ["--lib".to_owned(), fx.sim.join(l).display().to_string()])
        .collect()
}

/// Each segment as (address, size, its blocks as (address, size, allocated)).
type Map = Vec<(u64, u64, Vec<(u64, u64, bool)>)>;

fn account_map(account: &Value) -> Map {
    account["segments"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| {
            let blocks = s["blocks"]
                .as_array()
                .unwrap()
                .iter()
                .map(|b| {
                    (
                        b["ptr"].as_u64().unwrap(),
                        b["size"].as_u64().unwrap(),
                        b["allocated"].as_bool().unwrap(),
                    )
                })
                .collect();
            (
                s["ptr"].as_u64().unwrap(),
                s["size"].as_u64().unwrap(),
                blocks,
            )
        })
        .collect()
}

/// tracer's layout at the OOM, as the account has it.
fn layout_at_oom(db: &Path) -> Map {
    let layouts = tracer_json(db, &["layout", "--at", "oom", "--json"]);
    assert_eq!(layouts.as_array().unwrap().len(), 1, "{layouts:#}");
    layouts[0]["segments"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| {
            let runs = s["runs"]
                .as_array()
                .unwrap()
                .iter()
                .map(|r| {
                    (
                        r["addr"].as_u64().unwrap(),
                        r["size"].as_u64().unwrap(),
                        r["kind"] == "allocated",
                    )
                })
                .collect();
            (
                s["addr"].as_u64().unwrap(),
                s["size"].as_u64().unwrap(),
                runs,
            )
        })
        .collect()
}

/// tracer's map equals the allocator's own; else the first segment where they differ.
fn assert_same_map(rebuilt: &Map, own: &Map) {
    for (i, seg) in own.iter().enumerate() {
        assert_eq!(rebuilt.get(i), Some(seg), "segment {i} of {}", own.len());
    }
    assert_eq!(rebuilt.len(), own.len());
}

/// What the allocator's own blocks make of its OOM: fragmentation when the free blocks of the
/// pool the request goes to (small up to 1 MiB, as the job's allocator and PyTorch's) held its
/// bytes, capacity when they did not. The other pool's free blocks could not have served it.
fn true_verdict(account: &Value) -> &'static str {
    // By the OOM's arithmetic on the allocator's own figures (its message): short = what it
    // asked the device for less what the device had free after the flush; fragmentation when
    // the free bytes in its split blocks exceed that, else capacity (no other process here).
    let message = account["message"]
        .as_str()
        .expect("the allocator's message");
    let size = |before: &str, after: &str| -> f64 {
        let rest = message.split_once(before).unwrap().1;
        let text = rest.split(after).next().unwrap().trim();
        let (value, unit) = text.split_once(' ').unwrap();
        let unit = match unit.trim_end_matches('.') {
            "bytes" => 1.0,
            "KiB" => 1024.0,
            "MiB" => 1048576.0,
            "GiB" => 1073741824.0,
            u => panic!("unit {u} in {message}"),
        };
        value.parse::<f64>().unwrap() * unit
    };
    let asked = size("Tried to allocate ", ". ");
    let free = size(" of which ", " is free");
    let split = size(
        "is allocated by PyTorch, and ",
        " is reserved by PyTorch but unallocated",
    );
    // The segment the request needed (PyTorch's get_allocation_size).
    let mib = 1048576.0;
    let segment = if asked <= mib {
        2.0 * mib
    } else if asked < 10.0 * mib {
        20.0 * mib
    } else {
        (asked / (2.0 * mib)).ceil() * 2.0 * mib
    };
    if split >= segment - free {
        "fragmentation decided it"
    } else {
        "capacity: it does not fit"
    }
}

fn chains(report: &Value) -> Vec<&Value> {
    report["chains"].as_array().unwrap().iter().collect()
}

fn chain<'a>(report: &'a Value, rule: &str) -> Option<&'a Value> {
    chains(report).into_iter().find(|c| c["rule"] == rule)
}

/// The OOM chain's verdict is the allocator's own, and no chain names an unknown device or
/// compares peaks of nothing.
fn assert_oom_verdict(report: &Value, account: &Value) {
    let oom = chain(report, "oom").expect("an OOM chain");
    let effect = oom["effect"].as_str().unwrap();
    assert!(effect.contains(true_verdict(account)), "{effect}");
    no_empty_comparisons(report);
}

/// No chain names an unknown device or compares peaks of nothing.
fn no_empty_comparisons(report: &Value) {
    for c in chains(report) {
        let text = c.to_string();
        assert!(!text.contains("GPU -1"), "{c:#}");
        assert!(!text.contains("peak 0 B"), "{c:#}");
    }
}

#[test]
fn after_eviction_the_oom_layout_is_the_allocators_own() {
    evicted_oom_layout("2");
}

/// The same answer when the reader waits 20 ms for records before handing them over (a vCPU
/// held off longer): the OOM instant and the layout there must not depend on delivery timing.
#[test]
fn after_eviction_the_oom_layout_is_the_allocators_own_at_a_20ms_reader_margin() {
    evicted_oom_layout("20");
}

fn evicted_oom_layout(margin_ms: &str) {
    let Some(fx) = Fixture::new() else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let mut args = libs(&fx);
    args.extend(["--max-db".to_owned(), "3MiB".to_owned()]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let trace = Trace::start_with_env(&fx.db, &args, &[("TRACER_ROUND_MARGIN_MS", margin_ms)]);
    let job = Job::start(&fx.sim, dir.path(), 0, 6.0);
    let account = job.finish();
    // Readers while tracer still holds the database (each opens, reads and closes it): the
    // writer keeps its locks on the database's shared memory, so none truncates it under the
    // writer (which died of SIGBUS when tracer's own descriptors of the files had dropped
    // SQLite's locks).
    for _ in 0..3 {
        tracer_json(&fx.db, &["explain", "--json"]);
    }
    let stopped = trace.stop(SIGINT);
    assert_eq!(stopped.counter("dropped_ring_full"), 0);
    let s = &query(
        &fx.db,
        "SELECT evicted_events, evicted_calls, evicted_block_events, events_stored FROM sessions",
    )[0];
    // Keyframes made and what they cost, counted by the threads that made them: eviction
    // removed the older ones.
    let made = &stopped.summary["keyframes"];
    let kept = scalar(&fx.db, "SELECT count(*) FROM keyframes");
    assert!(
        kept >= 1 && made["written"].as_i64().unwrap() > kept,
        "{made} vs {kept} kept"
    );
    assert!(made["cpu_s"].as_f64().unwrap() > 0.0, "{made}");
    let evicted = s["evicted_block_events"].as_i64().unwrap();
    assert!(
        evicted > s["events_stored"].as_i64().unwrap() / 2,
        "most of the block events were evicted: {s}"
    );
    assert_eq!(
        s["evicted_events"].as_i64().unwrap(),
        evicted + s["evicted_calls"].as_i64().unwrap()
    );
    // The database, its log included, stays under --max-db.
    let size = |suffix: &str| {
        std::fs::metadata(format!("{}{suffix}", fx.db.display())).map_or(0, |m| m.len())
    };
    assert!(
        size("") + size("-wal") <= 3 << 20,
        "{} + {}",
        size(""),
        size("-wal")
    );
    // The weights were allocated in the job's first moments, long evicted: still in the map.
    assert_same_map(&layout_at_oom(&fx.db), &account_map(&account));
    let report = tracer_json(&fx.db, &["explain", "--json"]);
    let coverage = &report["coverage"];
    assert_eq!(coverage["evicted"]["block_events"], evicted);
    assert!(coverage["keyframe_ns"].is_i64(), "{coverage:#}");
    assert!(
        !coverage["before_detail"].as_array().unwrap().is_empty(),
        "the whole-run series stands where the detail was evicted: {coverage:#}"
    );
    assert_oom_verdict(&report, &account);
    // A window whose every call was evicted is answered from the series, and no chain is drawn
    // from it.
    let start = scalar(&fx.db, "SELECT started_ns FROM sessions");
    let keyframe = coverage["keyframe_ns"].as_i64().unwrap();
    let (from, to) = (
        start.to_string(),
        (start + (keyframe - start) / 2).to_string(),
    );
    let early = tracer_json(&fx.db, &["explain", "--json", "--from", &from, "--to", &to]);
    let c = &early["coverage"];
    assert_eq!(c["window_evicted"], true, "{c:#}");
    assert!(!c["before_detail"].as_array().unwrap().is_empty(), "{c:#}");
    assert_eq!(early["chains"], serde_json::json!([]), "{early:#}");
}

#[test]
fn a_tracer_killed_and_restarted_takes_the_job_up() {
    let Some(fx) = Fixture::scoped() else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let args = libs(&fx);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let first = Trace::start(&fx.db, &args);
    // A warm cache: the job reserves no new segment while tracer is away (one it did could
    // only be inferred from the blocks found in it, and the layout would stay not exact).
    let job = Job::start(&fx.sim, dir.path(), WARM, 3.0);
    std::thread::sleep(Duration::from_secs(2));
    let mut first = first;
    first.child.kill().unwrap();
    first.child.wait().unwrap();
    let second = Trace::start(&fx.db, &args);
    // Several of the job's steps under the new tracer, then its OOM.
    std::thread::sleep(Duration::from_secs(3));
    let pid = job.pid();
    let account = job.finish();
    let stopped = second.stop(SIGINT);
    assert_eq!(stopped.counter("dropped_ring_full"), 0, "every event kept");
    assert!(
        stopped
            .stderr
            .contains("took up the state of 1 running process(es) from session 1"),
        "{}",
        stopped.stderr
    );
    let sessions = query(
        &fx.db,
        "SELECT id, status, restored_from FROM sessions ORDER BY id",
    );
    assert_eq!(sessions[0]["status"], "crashed");
    assert_eq!(sessions[1]["restored_from"], 1);
    let gaps = query(&fx.db, "SELECT pid, from_ns, to_ns, kind FROM gaps");
    assert_eq!(gaps.len(), 1, "{gaps:?}");
    assert_eq!(
        (gaps[0]["pid"].as_u64(), &gaps[0]["kind"]),
        (Some(u64::from(pid)), &Value::from("restart"))
    );
    let _ = std::fs::copy(&fx.db, "/tmp/flight-restart.db");
    let _ = std::fs::write("/tmp/flight-restart.json", account.to_string());
    assert_same_map(&layout_at_oom(&fx.db), &account_map(&account));
    let report = tracer_json(&fx.db, &["explain", "--json"]);
    let state = &report["coverage"]["states"][0];
    assert_eq!(state["gaps"], 1, "{state:#}");
    let exact = state["exact_ns"].as_i64().unwrap_or_else(|| {
        let _ = std::fs::copy(&fx.db, "/tmp/flight-fail.db");
        panic!(
            "not exact again after the job's next steps: {:#}",
            report["coverage"]
        )
    });
    assert!(exact > gaps[0]["to_ns"].as_i64().unwrap());
    assert_eq!(report["coverage"]["gaps"][0]["kind"], "restart");
    assert_oom_verdict(&report, &account);
}

#[test]
fn a_tracer_started_after_the_job_draws_no_verdict_from_what_it_did_not_see() {
    let Some(fx) = Fixture::scoped() else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let job = Job::start(&fx.sim, dir.path(), WARM, 1.0);
    let args = libs(&fx);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let trace = Trace::start(&fx.db, &args);
    std::thread::sleep(Duration::from_secs(2));
    let pid = job.pid();
    let account = job.finish();
    let stopped = trace.stop(SIGINT);
    assert_eq!(stopped.counter("dropped_ring_full"), 0, "every event kept");
    let gaps = query(&fx.db, "SELECT pid, kind FROM gaps");
    assert_eq!(gaps.len(), 1, "{gaps:?}");
    assert_eq!(gaps[0]["pid"].as_u64(), Some(u64::from(pid)));
    assert_eq!(gaps[0]["kind"], "before_trace");
    let report = tracer_json(&fx.db, &["explain", "--json"]);
    let unknown = chain(&report, "unknown_state").expect("the unknown stated");
    assert!(
        unknown["fix"][0]
            .as_str()
            .unwrap()
            .contains("what would settle it"),
        "{unknown:#}"
    );
    for rule in ["fragmentation", "early_warning", "leak", "rank_outlier"] {
        assert!(
            chain(&report, rule).is_none(),
            "{rule} drawn from unknown state: {report:#}"
        );
    }
    // The OOM's verdict is PyTorch's own figures', said to be.
    let effect = chain(&report, "oom").unwrap()["effect"]
        .as_str()
        .unwrap()
        .to_owned();
    assert!(
        effect.contains("tracer's layout is not exact here"),
        "{effect}"
    );
    assert!(effect.contains("PyTorch's message says"), "{effect}");
    assert!(effect.contains(true_verdict(&account)), "{effect}");
    no_empty_comparisons(&report);
}
