//! CUDA graphs' private pools seen from outside: the simulated allocator captures as PyTorch
//! does (demos/workloads/train.py `graphs`: a step captured at four batch sizes into one shared
//! pool, then an eager request the device cannot hold while the pool holds free blocks), and
//! tracer follows each capture from the runtime's calls and PyTorch's CUDAGraph methods.

use std::process::Command;

use crate::common::*;
use serde_json::Value;

/// `tracer trace` of the simulated runtime, driver and PyTorch probes, with every block event
/// (and `extra`).
fn trace_sim(fx: &Fixture, extra: &[&str]) -> Trace {
    let mut args = vec!["--allocator", "always"];
    args.extend_from_slice(extra);
    fx.trace(
        &["libcudart.so.12", "libcuda.so.1", "libsimtorch.so"],
        &args,
    )
}

/// Runs `body` as Python with `a`, the simulated caching allocator on a 1 GiB device, and its
/// names (Graph, MIB, OutOfMemoryError) at hand.
fn run_allocator(fx: &Fixture, body: &str) -> std::process::Output {
    let script = format!(
        "import sys\nsys.path.insert(0, {dir:?})\nfrom caching_allocator import CachingAllocator, Graph, MIB, OutOfMemoryError\na = CachingAllocator({cudart:?})\n{body}",
        dir = workspace().join("demos/workloads").to_str().unwrap(),
        cudart = fx.lib("libcudart.so.12"),
    );
    Command::new("python3")
        .args(["-c", &script])
        .env("SIMCUDA_MEM", "1GiB")
        .output()
        .unwrap()
}

/// The graphs workload on a 1 GiB simulated device, its allocator writing its own layout after
/// every block event; (its stderr, its truth lines).
fn run_graphs(fx: &Fixture, truth: &std::path::Path, conf: Option<&str>) -> (String, Vec<Value>) {
    let mut cmd = Command::new("python3");
    cmd.arg(workspace().join("demos/workloads/train.py"))
        .args(["graphs", "--speed", "100", "--cudart"])
        .arg(fx.sim.join("libcudart.so.12"))
        .env("SIMCUDA_MEM", "1GiB")
        .env("SIMTORCH_TRUTH", truth);
    if let Some(conf) = conf {
        cmd.env("PYTORCH_CUDA_ALLOC_CONF", conf);
    }
    let out = cmd.output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    let lines = std::fs::read_to_string(truth)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    (stderr, lines)
}

/// A private pool's figures as the allocator and tracer's layout both give them.
fn pool_figures(p: &Value) -> Vec<i64> {
    [
        "segments",
        "reserved",
        "allocated",
        "free",
        "free_blocks",
        "largest_free",
    ]
    .iter()
    .map(|k| p[k].as_i64().unwrap())
    .chain(
        p["id"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_i64().unwrap()),
    )
    .collect()
}

fn default_pool_figures(v: &Value) -> [i64; 4] {
    ["allocated", "reserved", "free_blocks", "largest_free"].map(|k| v[k].as_i64().unwrap_or(0))
}

/// `layout --timeline` of the recording: one point per block event, each private pool and the
/// default pools as the simulated allocator had them then (its `truth` lines); the points.
fn pools_as_the_allocator_had_them(db: &std::path::Path, truth: &[Value]) -> Vec<Value> {
    let timeline = Command::new(TRACER)
        .args(["layout", "--timeline", "--db"])
        .arg(db)
        .output()
        .unwrap();
    assert_ok(&timeline);
    let rebuilt: Vec<Value> = String::from_utf8_lossy(&timeline.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(rebuilt.len(), truth.len(), "one point per block event");
    for (i, (r, t)) in rebuilt.iter().zip(truth).enumerate() {
        let theirs: Vec<Vec<i64>> = t["private_pools"]
            .as_array()
            .unwrap()
            .iter()
            .map(pool_figures)
            .collect();
        let ours: Vec<Vec<i64>> = r["private_pools"]
            .as_array()
            .map_or(Vec::new(), |a| a.iter().map(pool_figures).collect());
        assert_eq!(ours, theirs, "event {i} ({}): {r} vs {t}", t["op"]);
        for pool in ["small", "large"] {
            assert_eq!(
                r["pools"].get(pool).map_or([0; 4], default_pool_figures),
                default_pool_figures(&t["pools"][pool]),
                "event {i}, {pool} default pool"
            );
        }
    }
    rebuilt
}

#[test]
fn each_capture_puts_its_segments_in_its_pool_as_the_allocator_did() {
    let Some(fx) = Fixture::new() else { return };
    let dir = tempfile::tempdir().unwrap();
    let truth_file = dir.path().join("truth.jsonl");
    let trace = trace_sim(&fx, &["--stack"]);
    let (stderr, truth) = run_graphs(&fx, &truth_file, None);
    assert!(
        stderr.contains("with 188.00 MiB allocated in private pools"),
        "{stderr}"
    );
    let stopped = trace.stop(SIGINT);
    assert_eq!(stopped.counter("dropped_ring_full"), 0);

    // At every block event, each private pool and the default pools as the allocator had them.
    pools_as_the_allocator_had_them(&fx.db, &truth);
    let pooled: usize = truth
        .iter()
        .map(|t| t["private_pools"].as_array().unwrap().len())
        .sum();
    assert!(pooled > 10, "{pooled} points with a private pool");
    let end = truth.last().unwrap();

    // The layout names the pool's captures and where the first was made.
    let layouts = tracer_json(&fx.db, &["layout", "--json"]);
    let pool = &layouts[0]["devices"][0]["private_pools"][0];
    assert_eq!(pool["id"], serde_json::json!([0, 1]), "{pool}");
    assert_eq!(pool["captures"]["captures"], 4, "{pool}");
    assert_eq!(pool["captures"]["graphs"], 4, "{pool}");
    assert_eq!(pool["captures"]["numbered"], false, "{pool}");
    let at = pool["captured_at"].as_str().unwrap_or_default();
    assert!(at.contains(".py:"), "{pool}");

    // The report's map draws the pool apart: its line, and each of its segments labelled.
    let html = dir.path().join("report.html");
    let out = Command::new(TRACER)
        .args(["report", "--db"])
        .arg(&fx.db)
        .arg("-o")
        .arg(&html)
        .output()
        .unwrap();
    assert_ok(&out);
    let profile = tempfile::tempdir().unwrap();
    let (browser, png) = (
        workspace().join("tests/python/report_browser.py"),
        dir.path().join("report.png"),
    );
    let seen = python_json(&[
        browser.as_os_str(),
        html.as_os_str(),
        png.as_os_str(),
        profile.path().as_os_str(),
    ]);
    assert_eq!(seen["console"], serde_json::json!([]), "{seen:#}");
    let notes: Vec<&str> = seen["segmap_notes"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(Value::as_str)
        .collect();
    assert!(
        notes.iter().any(
            |n| n.starts_with("private pool (0, 1) (CUDA graphs', 4 capture(s)")
                && n.contains("188 MiB free in 4 blocks")
        ),
        "{notes:?}"
    );
    let pooled = seen["segment_labels"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|l| l.as_str().unwrap_or("").contains("pool (0, 1)"))
        .count();
    assert_eq!(pooled, 3, "{seen:#}");

    // explain: the pool's free blocks decided it, not fragmentation, with PyTorch's figures.
    let report = tracer_json(&fx.db, &["explain", "--json"]);
    let holder = &report["holders"][0];
    let a = &holder["arithmetic"];
    assert_eq!(holder["verdict"], "private_pools", "{holder}");
    assert_eq!(a["cause"]["kind"], "private_pools", "{a}");
    assert_eq!(a["private"], end["private_pools"][0]["free"], "{a}");
    assert_eq!(a["split"], 0, "{a}");
    // The segment with no live block is what a flush returns once the pool is released.
    assert_eq!(
        a["private_idle"], end["private_pools"][0]["largest_free"],
        "{a}"
    );
    assert_eq!(a["cause"]["idle_enough"], true, "{a}");
    let chain = chain(&report, "oom");
    let fixes: Vec<&str> = chain["fix"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| f.as_str().unwrap())
        .collect();
    assert!(fixes[0].contains("reset()"), "{fixes:?}");
    assert!(
        !fixes.iter().any(|f| f.contains("expandable_segments")),
        "{fixes:?}"
    );

    // whatif replays the captures as run: the same decisions and the OOM at the same request.
    let w = tracer_json(&fx.db, &["whatif", "--json"]);
    assert_eq!(w["fidelity"]["holds"], true, "{w}");
    assert_eq!(
        w["rows"][0]["oom_request"],
        w["fidelity"]["refused_recorded"][0]
    );
    // Without the graphs (an estimate, said so): the weights and the prefill alone, no OOM.
    let without = &w["without_graphs"];
    assert!(without["oom_request"].is_null(), "{without}");
    assert_eq!(
        without["peak_reserved"].as_u64().unwrap(),
        truth[0]["reserved"].as_u64().unwrap() + (256 << 20),
        "{without}"
    );
    let expandable = w["rows"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["conf"] == "expandable_segments:True")
        .unwrap()
        .clone();

    // The export writes each segment's pool as the allocator had it; the import reads it back.
    let file = fx.db.with_extension("pickle");
    export_snapshot(&fx.db, &file, &[]);
    let figures = snapshot_figures(&file);
    let mut exported: Vec<(u64, Value)> = figures["segment_pools"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| (s[0].as_u64().unwrap(), s[1].clone()))
        .filter(|(_, id)| id != &serde_json::json!([0, 0]))
        .collect();
    exported.sort_by_key(|(a, _)| *a);
    let expected: Vec<(u64, Value)> = end["private_pools"][0]["segment_ptrs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| (p.as_u64().unwrap(), serde_json::json!([0, 1])))
        .collect();
    assert_eq!(exported, expected);
    let imported = dir.path().join("imported.db");
    let out = Command::new(TRACER)
        .args(["import", "--snapshot"])
        .arg(&file)
        .arg("--db")
        .arg(&imported)
        .output()
        .unwrap();
    assert_ok(&out);
    let back = tracer_json(&imported, &["layout", "--json"]);
    let back_pool = &back[0]["devices"][0]["private_pools"][0];
    assert_eq!(
        pool_figures(back_pool),
        pool_figures(&end["private_pools"][0])
    );

    // With expandable segments the allocator runs out too, at whatif's peak: a private pool
    // keeps its pages at a flush.
    let (_, expandable_truth) = run_graphs(
        &fx,
        &dir.path().join("expandable.jsonl"),
        Some("expandable_segments:True"),
    );
    let reserved_then = expandable_truth.last().unwrap()["reserved"].clone();
    assert_eq!(
        expandable["oom_request"], w["rows"][0]["oom_request"],
        "{expandable}"
    );
    assert_eq!(expandable["peak_reserved"], reserved_then, "{expandable}");
}

/// A request during a capture that the device cannot hold while the cache holds a whole free
/// segment: PyTorch flushes nothing during a capture, so it raises at once (no retry). explain
/// says so, not fragmentation, and offers the flush before capturing with its figure; whatif
/// replays the run with the same no-flush rule.
#[test]
fn an_oom_during_a_capture_is_the_unflushed_cache_not_fragmentation() {
    let Some(fx) = Fixture::new() else { return };
    let trace = trace_sim(&fx, &[]);
    // 600 MiB of weights, a 300 MiB segment freed whole, then inside a capture 60 MiB and a
    // 200 MiB request: 64 MiB free on the device, 300 MiB cached and never flushed.
    let out = run_allocator(
        &fx,
        "w = a.malloc(600 * MIB)\nt = a.malloc(300 * MIB)\na.free(t)\nside = a.new_stream()\ng = Graph()\na.capture_begin(g, side)\nx = a.malloc(60 * MIB, side)\ntry:\n    a.malloc(200 * MIB, side)\nexcept OutOfMemoryError:\n    print(a.memory_stats()['num_alloc_retries'])\n    sys.exit(1)\n",
    );
    assert_eq!(
        out.status.code(),
        Some(1),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        "0",
        "no retry during a capture"
    );
    trace.stop(SIGINT);
    let report = tracer_json(&fx.db, &["explain", "--json"]);
    let a = &report["holders"][0]["arithmetic"];
    assert_eq!(a["cause"]["kind"], "capture_underway", "{a}");
    assert_eq!(a["cause"]["idle_enough"], true, "{a}");
    assert_eq!(a["capture_idle"], 300 << 20, "{a}");
    assert_eq!(a["shortfall"], 136 << 20, "{a}");
    let rules = rule_names(&report);
    assert!(
        !rules.iter().any(|r| r.starts_with("fragmentation")),
        "{rules:?}"
    );
    let chain = chain(&report, "oom");
    let fix = chain["fix"][0].as_str().unwrap();
    assert!(
        fix.starts_with("call torch.cuda.empty_cache() before capturing"),
        "{fix}"
    );
    let w = tracer_json(&fx.db, &["whatif", "--json"]);
    assert_eq!(w["fidelity"]["holds"], true, "{w}");
    assert_eq!(w["rows"][0]["retries"], 0, "{w}");
}

/// The engine-shaped start-up (train.py `engine`, in vLLM's order: weights, a profiling pass and
/// empty_cache(), the KV cache from --gpu-memory-utilization less the profiled peak, then four
/// captures into one pool after warm-up runs) on a 4 GiB simulated device, at `utilization`;
/// (its exit code, its `phase` lines).
fn run_engine(fx: &Fixture, utilization: &str) -> (Option<i32>, Vec<Value>) {
    let out = Command::new("python3")
        .arg(workspace().join("demos/workloads/train.py"))
        .args([
            "engine",
            "--speed",
            "100",
            "--gpu-memory-utilization",
            utilization,
        ])
        .arg("--cudart")
        .arg(fx.sim.join("libcudart.so.12"))
        .env("SIMCUDA_MEM", "4GiB")
        .output()
        .unwrap();
    let phases = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(|v| v["phase"].is_string())
        .collect();
    (out.status.code(), phases)
}

fn phase<'a>(phases: &'a [Value], name: &str) -> &'a Value {
    phases.iter().rfind(|p| p["phase"] == name).unwrap()
}

/// The start-up ledger equals the engine's own account phase by phase; where the KV cache
/// leaves the captures too little, it says by how much to lower the budget, and the engine run
/// again at that budget starts.
#[test]
fn the_start_up_ledger_is_the_engines_own_account_and_its_budget_move_works() {
    let Some(fx) = Fixture::new() else { return };
    let trace = trace_sim(&fx, &[]);
    let (code, phases) = run_engine(&fx, "0.9");
    assert_eq!(code, Some(0), "{phases:?}");
    trace.stop(SIGINT);
    let report = tracer_json(&fx.db, &["explain", "--json"]);
    let s = &report["startups"][0];
    let last = phase(&phases, "capture");
    assert_eq!(s["resident"], phase(&phases, "profile")["reserved"], "{s}");
    assert_eq!(
        s["peak_before_flush"],
        phase(&phases, "profile")["profiled_peak"],
        "{s}"
    );
    let kv = phase(&phases, "kv cache");
    let kv_made = s["allocated_before_captures"].as_u64().unwrap()
        - s["resident_allocated"].as_u64().unwrap();
    assert_eq!(Value::from(kv_made), kv["kv_bytes"], "{s}");
    assert_eq!(
        s["resident_allocated"],
        phase(&phases, "profile")["allocated"],
        "{s}"
    );
    // The first warm-up run's freed block stays cached beside the KV cache.
    assert!(
        s["before_captures"].as_u64() > kv["reserved"].as_u64(),
        "{s}"
    );
    assert_eq!(s["pools"], last["private_reserved"], "{s}");
    assert_eq!(s["after"], last["reserved"], "{s}");
    assert_eq!(s["captures"].as_array().unwrap().len(), 4, "{s}");
    assert_eq!(s["budget"]["option"], "--gpu-memory-utilization", "{s}");
    assert_eq!(s["budget"]["fraction"], 0.9, "{s}");
    assert!(s["failed_in_capture"].is_null(), "{s}");
    assert!(rule_names(&report).contains(&"startup_ledger"));

    // At 0.95 the KV cache leaves the captures too little.
    std::fs::remove_file(&fx.db).unwrap();
    let trace = trace_sim(&fx, &[]);
    let (code, phases) = run_engine(&fx, "0.95");
    assert_eq!(code, Some(1), "{phases:?}");
    trace.stop(SIGINT);
    let report = tracer_json(&fx.db, &["explain", "--json"]);
    let s = &report["startups"][0];
    assert_eq!(s["resident"], phase(&phases, "profile")["reserved"], "{s}");
    // The capture's request the device refused, with what it had free then (PyTorch's message:
    // "Tried to allocate 162.00 MiB ... of which 42.00 MiB is free").
    assert_eq!(s["failed_in_capture"], 162 << 20, "{s}");
    assert_eq!(s["device_free"], 42 << 20, "{s}");
    let chain = chain(&report, "startup_ledger");
    assert_eq!(chain["severity"], "HIGH", "{chain}");
    let fix = chain["fix"][0].as_str().unwrap();
    let lowered = fix
        .split("--gpu-memory-utilization ")
        .nth(1)
        .and_then(|rest| rest.split_whitespace().next())
        .unwrap_or_else(|| panic!("{fix}"));
    assert!(lowered.parse::<f64>().unwrap() < 0.95, "{fix}");
    // The move, run: the engine starts.
    let (code, phases) = run_engine(&fx, lowered);
    assert_eq!(code, Some(0), "at {lowered}: {phases:?}");
}

/// A graph reset lets go of its pool; the next empty_cache() gives the pool's segments back, as
/// PyTorch does. The layout then holds no private pool, and whatif replays the release: a
/// 1000 MiB request after it fits the 1 GiB device only because the pool's 40 MiB went back.
#[test]
fn a_pool_goes_back_at_the_flush_after_its_graph_resets() {
    let Some(fx) = Fixture::new() else { return };
    let trace = trace_sim(&fx, &[]);
    let out = run_allocator(
        &fx,
        "a.mem_get_info()\nside = a.new_stream()\ng = Graph()\na.capture_begin(g, side)\nx = a.malloc(40 * MIB, side)\na.free(x)\na.capture_end(g)\na.empty_cache()\nheld = a.stats()['reserved']\na.reset(g)\na.empty_cache()\nprint(held, a.stats()['reserved'], a.memory_stats()['num_device_free'])\ny = a.malloc(1000 * MIB)\n",
    );
    assert_ok(&out);
    let said = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        said.trim(),
        format!("{} 0 1", 40u64 << 20),
        "held by the graph, then freed"
    );
    trace.stop(SIGINT);
    let layouts = tracer_json(&fx.db, &["layout", "--json"]);
    let pools = layouts[0]["devices"]
        .get(0)
        .map_or(Value::Null, |d| d["private_pools"].clone());
    assert!(pools.as_array().is_none_or(|p| p.is_empty()), "{layouts}");
    let w = tracer_json(&fx.db, &["whatif", "--json"]);
    assert_eq!(w["fidelity"]["holds"], true, "{w}");
    assert_eq!(w["rows"][0]["device_allocs"], 2, "{w}");
    assert!(w["rows"][0]["oom_request"].is_null(), "{w}");
}

/// torch.cuda.MemPool as PyTorch runs it (train.py `mempool`): a pool filled under
/// use_mem_pool, its largest block freed, an eager request beside it; a use_on_oom pool that
/// serves a request the device could not; then an OOM while the first pool holds more free
/// bytes than the request was short. tracer follows the allocator's own pool calls
/// (NativeCachingAllocator's, local symbols found in the library's symbol table): every pool
/// as the allocator had it at every block event, each pool's kind and its line, the OOM
/// explained by the pool's share with PyTorch's figures, and whatif's replay as run.
#[test]
fn mem_pools_route_by_thread_and_use_on_oom_serves_before_the_oom() {
    let Some(fx) = Fixture::new() else { return };
    let dir = tempfile::tempdir().unwrap();
    let truth_file = dir.path().join("truth.jsonl");
    let trace = trace_sim(&fx, &["--stack"]);
    let out = Command::new("python3")
        .arg(workspace().join("demos/workloads/train.py"))
        .args(["mempool", "--speed", "100", "--cudart"])
        .arg(fx.sim.join("libcudart.so.12"))
        .env("SIMCUDA_MEM", "1GiB")
        .env("SIMTORCH_TRUTH", &truth_file)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("with 174.00 MiB allocated in private pools"),
        "{stderr}"
    );
    let stopped = trace.stop(SIGINT);
    assert_eq!(stopped.counter("dropped_ring_full"), 0);
    let truth: Vec<Value> = std::fs::read_to_string(&truth_file)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();

    // Every block event: each pool and the default pools as the allocator had them.
    pools_as_the_allocator_had_them(&fx.db, &truth);
    let end = truth.last().unwrap();
    assert_eq!(end["private_pools"].as_array().unwrap().len(), 2, "{end}");

    // Each pool's kind, its making and its line.
    let layouts = tracer_json(&fx.db, &["layout", "--json"]);
    let pools = layouts[0]["devices"][0]["private_pools"]
        .as_array()
        .unwrap();
    let user = &pools[0];
    assert_eq!(user["id"], serde_json::json!([0, 1]), "{user}");
    let u = &user["captures"];
    assert_eq!(
        (
            &u["made"],
            &u["routed"],
            &u["uses"],
            &u["use_on_oom"],
            &u["captures"]
        ),
        (
            &Value::Bool(true),
            &1.into(),
            &1.into(),
            &Value::Bool(false),
            &0.into()
        ),
        "{user}"
    );
    // (The simulated allocator's own file is the innermost Python frame, where PyTorch's
    // torch/cuda/memory.py, skipped as a library frame, would be.)
    assert!(
        user["captured_at"].as_str().unwrap_or("").contains(".py:"),
        "{user}"
    );
    let on_oom = &pools[1];
    assert_eq!(on_oom["id"], serde_json::json!([0, 2]), "{on_oom}");
    assert_eq!(on_oom["captures"]["use_on_oom"], true, "{on_oom}");
    let text = tracer_text(&fx.db, &["layout"]);
    assert!(
        text.contains("private pool (0, 1) (a MemPool's, made at"),
        "{text}"
    );
    assert!(text.contains("use_on_oom"), "{text}");

    // One OOM (the request the use_on_oom pool served is none), explained by the pool's share.
    let report = tracer_json(&fx.db, &["explain", "--json"]);
    let holders = report["holders"].as_array().unwrap();
    assert_eq!(holders.len(), 1, "{report:#}");
    let a = &holders[0]["arithmetic"];
    assert_eq!(holders[0]["verdict"], "private_pools", "{:#}", holders[0]);
    assert_eq!(
        a["private"],
        end["private_pools"][0]["free"].as_u64().unwrap()
            + end["private_pools"][1]["free"].as_u64().unwrap(),
        "{a}"
    );
    assert_eq!(a["asked"], 122u64 << 20, "{a}");
    let oom = chain(&report, "oom");
    let fixes: Vec<&str> = oom["fix"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| f.as_str().unwrap())
        .collect();
    // A MemPool's advice, not a graph's: drop it (its idle segments cover the shortfall), and
    // use_on_oom, whose 152 MiB free block fits the 122 MiB request.
    assert!(
        fixes[0].starts_with("free the MemPool's tensors"),
        "{fixes:?}"
    );
    assert!(
        fixes.iter().any(|f| f.contains("use_on_oom=True")
            && f.contains("152.00 MiB free block fits this 122.00 MiB")),
        "{fixes:?}"
    );
    assert!(!fixes.iter().any(|f| f.contains("reset()")), "{fixes:?}");
    let said = oom["effect"].to_string();
    assert!(
        said.contains("the use_on_oom pools' were tried as a last resort, and none fit"),
        "{said}"
    );

    // whatif replays the pools as run: the rescue from the use_on_oom pool, then the OOM.
    let w = tracer_json(&fx.db, &["whatif", "--json"]);
    assert_eq!(w["fidelity"]["holds"], true, "{:#}", w["fidelity"]);
    assert_eq!(
        w["rows"][0]["oom_request"],
        w["fidelity"]["refused_recorded"][0]
    );
    assert_eq!(
        w["rows"][0]["peak_reserved"], end["reserved"],
        "{:#}",
        w["rows"][0]
    );
}

/// On the real wheels (the 2.11 the GPU check ran and the newest), the allocator's pool methods
/// are local symbols of libc10_cuda.so: tracer finds every one in the library's symbol table
/// and attaches to it beside PyTorch's USDT sites.
#[test]
fn the_real_libc10_cudas_pool_methods_are_probed() {
    let Some(fx) = Fixture::new() else { return };
    for version in ["2.11.0", "2.15.0"] {
        let _ = std::fs::remove_file(&fx.db);
        let lib = torch_lib(version, "libc10_cuda.so");
        let trace = Trace::start(&fx.db, &["--lib", lib.to_str().unwrap()]);
        let stopped = trace.stop(SIGINT);
        let probed = &stopped.summary["libraries"][0];
        assert_eq!(probed["path"], lib.to_str().unwrap(), "{version}");
        let symbols: Vec<&str> = probed["symbols"]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(Value::as_str)
            .collect();
        for name in [
            "pytorch:pool_begin",
            "pytorch:pool_end",
            "pytorch:pool_release",
            "pytorch:pool_create",
            "pytorch:pool_use_on_oom",
        ] {
            assert!(symbols.contains(&name), "{version}: {name} in {probed}");
        }
        assert!(
            symbols.iter().any(|s| s.starts_with("pytorch:malloc")),
            "{version}: {probed}"
        );
        assert_eq!(
            probed["failed"],
            serde_json::json!([]),
            "{version}: {probed}"
        );
    }
}

/// A MemPool whose segments come from NCCL's ncclMemAlloc (PyTorch's NCCL MemPool for
/// symmetric memory: the driver's virtual memory calls from libnccl, no cudaMalloc): the blocks
/// PyTorch's probes place land in those segments, the pool is the allocator's at every block
/// event, `layout` says where its segments came from, and they are gone when the pool is
/// dropped (ncclMemFree).
#[test]
fn an_nccl_mem_pools_segments_hold_its_blocks() {
    let Some(fx) = Fixture::new() else { return };
    let dir = tempfile::tempdir().unwrap();
    let truth_file = dir.path().join("truth.jsonl");
    let trace = trace_sim(&fx, &[]);
    let script = format!(
        "import sys\nsys.path.insert(0, {dir:?})\nfrom caching_allocator import CachingAllocator, MIB\n\
         a = CachingAllocator({cudart:?})\nw = a.malloc(100 * MIB)\npool = a.mem_pool(nccl=True)\n\
         with a.use_mem_pool(pool):\n    xs = [a.malloc(n * MIB) for n in (30, 3, 50)]\n\
         a.free(xs[2])\neager = a.malloc(40 * MIB)\nimport json, os\n\
         print(json.dumps({{'pid': os.getpid(), 'pools': a.private_pools()}}), flush=True)\n\
         import time\ntime.sleep(0.2)\na.free(xs[0])\na.free(xs[1])\na.drop_mem_pool(pool)\n",
        dir = workspace().join("demos/workloads").to_str().unwrap(),
        cudart = fx.lib("libcudart.so.12"),
    );
    let out = Command::new("python3")
        .args(["-c", &script])
        .env("SIMCUDA_MEM", "1GiB")
        .env("SIMTORCH_TRUTH", &truth_file)
        .output()
        .unwrap();
    assert_ok(&out);
    let said: Value = serde_json::from_slice(&out.stdout).unwrap();
    trace.stop(SIGINT);
    let truth: Vec<Value> = std::fs::read_to_string(&truth_file)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let rebuilt = pools_as_the_allocator_had_them(&fx.db, &truth);
    // No cudaMalloc made the pool's segments: the driver's calls from libsimnccl.so did.
    let made = query(
        &fx.db,
        &format!(
            "SELECT op, count(*) AS n FROM events WHERE pid = {} AND op IN ('cudaMalloc', 'cuMemAddressReserve') AND ret = 0 GROUP BY op ORDER BY op",
            said["pid"]
        ),
    );
    assert_eq!(made.len(), 2, "{made:?}");
    assert_eq!(
        (&made[0]["op"], &made[0]["n"]),
        (&"cuMemAddressReserve".into(), &3.into())
    );
    // At the eager request (the 6th block event): the pool, its three mapped segments, said so.
    let at = rebuilt[5]["ts_ns"].as_i64().unwrap().to_string();
    let text = tracer_text(&fx.db, &["layout", "--at", &at]);
    assert!(
        text.contains("3 of its segments mapped with the driver's virtual memory calls"),
        "{text}"
    );
    let pool_then = &said["pools"][0];
    assert!(
        text.contains("private pool (0, 1) (a MemPool's, made at"),
        "{text}"
    );
    assert_eq!(pool_then["segments"], 3, "{pool_then}");
    // Dropped: ncclMemFree gave every segment back.
    let end = tracer_json(&fx.db, &["layout", "--json"]);
    assert_eq!(
        end[0]["devices"][0]["private_pools"],
        serde_json::json!([]),
        "{end:#}"
    );
}
