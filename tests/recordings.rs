//! tracer's answers on its own GPU check's recordings from a real NVIDIA H200 with PyTorch
//! 2.11 (tests/data/gpu-h200), held against what PyTorch said about itself in the same
//! processes: the device of every call, failures, retries and OOMs, the layout at the OOM,
//! the OOM chain's figures, the fragmentation verdict and whatif's replay. No root needed.

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::common::*;
use serde_json::Value;

/// One recording, unpacked into a folder of its own.
struct Recording {
    db: PathBuf,
    /// stats-*.json: what PyTorch said.
    stats: Value,
    _dir: tempfile::TempDir,
}

/// `gz` unpacked into `to`.
fn gunzip(gz: &Path, to: &Path) {
    let out = Command::new("gzip")
        .arg("-dc")
        .arg(gz)
        .output()
        .expect("gzip");
    assert!(out.status.success(), "gzip {}: {out:?}", gz.display());
    std::fs::write(to, out.stdout).unwrap();
}

fn recording(name: &str) -> Recording {
    let data = workspace().join("tests/data/gpu-h200");
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join(format!("{name}.db"));
    gunzip(&data.join(format!("trace-{name}.db.gz")), &db);
    let stats = std::fs::read(data.join(format!("stats-{name}.json"))).unwrap();
    Recording {
        db,
        stats: serde_json::from_slice(&stats).unwrap(),
        _dir: dir,
    }
}

/// Who held the GPU at the OOM of the recording's own process, in explain's report.
fn holders_of<'a>(report: &'a Value, r: &Recording) -> &'a Value {
    report["holders"]
        .as_array()
        .unwrap()
        .iter()
        .find(|h| h["pid"] == r.stats["pid"])
        .unwrap_or_else(|| panic!("no holders for pid {}: {report:#}", r.stats["pid"]))
}

fn explain(r: &Recording) -> Value {
    tracer_json(&r.db, &["explain", "--json"])
}

fn stat(r: &Recording, key: &str) -> u64 {
    r.stats["final"][key].as_u64().unwrap()
}

/// The size PyTorch's message writes right after `before` ("Tried to allocate " -> "139.62 GiB").
fn said_after(message: &str, before: &str) -> String {
    let rest = message.split_once(before).unwrap().1;
    let words: Vec<&str> = rest.split_whitespace().take(2).collect();
    words.join(" ").trim_end_matches('.').to_owned()
}

/// The size PyTorch's message writes right before `after`.
fn said_before(message: &str, after: &str) -> String {
    let head = message.split_once(after).unwrap().0;
    let words: Vec<&str> = head.split_whitespace().collect();
    words[words.len() - 2..].join(" ")
}

#[test]
fn every_call_is_on_the_device_cuda_ran_it_on() {
    // PyTorch on device 0 never calls cudaSetDevice: every call is on device 0, the default.
    for name in ["default", "expandable"] {
        let r = recording(name);
        let report = explain(&r);
        assert_eq!(
            report_devices(&report),
            [0],
            "{name}: {:#}",
            report["devices"]
        );
        let text = report["chains"].to_string();
        assert!(!text.contains("unknown device"), "{name}: {text}");
    }
}

#[test]
fn failures_retries_and_ooms_are_counted_as_pytorch_counts_them() {
    for name in ["default", "expandable"] {
        let r = recording(name);
        let report = explain(&r);
        let d = &report["devices"][0];
        let (retries, ooms) = (stat(&r, "num_alloc_retries"), stat(&r, "num_ooms"));
        assert_eq!(
            (
                d["failures"].as_u64(),
                d["retries"].as_u64(),
                d["ooms"].as_u64()
            ),
            (Some(retries + ooms), Some(retries), Some(ooms)),
            "{name}: {d:#}"
        );
        // The peak reserved the allocator reached, as PyTorch's statistics have it.
        assert_eq!(
            d["peak_reserved"].as_u64(),
            Some(stat(&r, "reserved_bytes.all.peak")),
            "{name}"
        );
    }
}

#[test]
fn the_layout_at_the_oom_is_the_allocators_own() {
    for name in ["default", "expandable"] {
        let r = recording(name);
        let layout = tracer_json(&r.db, &["layout", "--at", "oom", "--json"]);
        let total = &layout[0]["devices"][0]["total"];
        let said = &r.stats["layout"];
        for key in ["allocated", "reserved", "free_blocks", "largest_free"] {
            assert_eq!(total[key], said[key], "{name}: {key}: {layout:#}");
        }
        // Beside it, the GPU: the CUDA context's 624.56 MiB held by no traced process, as
        // explain's OOM chain says.
        let share = &layout[0]["devices"][0]["gpu_share"];
        assert_eq!(share["unattributed"], 654_899_200, "{name}: {share:#}");
        assert_eq!(share["others"], serde_json::json!([]));
    }
}

/// `tracer export --format pytorch-snapshot --at oom`: the snapshot PyTorch would have dumped
/// at the OOM has the allocator's own layout then, and PyTorch's own `_memory_viz.py` (from the
/// real wheels, run as a script) reads it: its segments' summary and the trace.
#[test]
fn the_snapshot_exported_at_the_oom_is_the_allocators_own_and_pytorch_reads_it() {
    for name in ["default", "expandable"] {
        let r = recording(name);
        let file = r.db.with_extension("pickle");
        export_snapshot(&r.db, &file, &["--at", "oom"]);
        let figures = snapshot_figures(&file);
        for key in ["allocated", "reserved", "free_blocks", "largest_free"] {
            assert_eq!(
                figures[key], r.stats["layout"][key],
                "{name}: {key}: {figures:#}"
            );
        }
        // PyTorch's own ring holds 100,000 entries by default: so does the export, and says
        // it overflowed (the recording made more).
        assert_eq!(figures["entries"], 100_000, "{figures:#}");
        assert_eq!(figures["overflowed"], true, "{figures:#}");
        for version in ["2.11.0", "2.15.0"] {
            for action in ["stats", "trace"] {
                let text = memory_viz(version, action, &file);
                let expect = if action == "stats" {
                    "allocated"
                } else {
                    "Device 0"
                };
                assert!(text.contains(expect), "{version} {action}: {text}");
            }
        }
    }
}

#[test]
fn the_oom_chain_states_the_figures_pytorchs_message_states() {
    let r = recording("default");
    let report = explain(&r);
    let oom = chain(&report, "oom");
    let effect = oom["effect"].as_str().unwrap();
    let message = r.stats["oom"]["message"].as_str().unwrap();
    let figures = [
        said_after(message, "Tried to allocate "),
        said_after(message, "Of the allocated memory "),
        said_before(message, "is reserved by PyTorch but unallocated"),
        said_before(message, "is free."),
    ];
    assert_eq!(figures[0], "139.62 GiB", "{message}");
    for f in &figures {
        assert!(effect.contains(f), "{f} not in {effect}");
    }
    // 139.62 GiB asked with 138.61 GiB free: 1 GiB short, far more than the cache's split
    // bytes, and no other process.
    assert!(
        effect.contains("capacity: it does not fit even with every split byte"),
        "{effect}"
    );
    // The memory outside the allocator, by the library that took it (the GPU check counted 6
    // cuMemAlloc_v2 calls from libcublas.so.13), and no co-tenant.
    let compounding = oom["compounding"].to_string();
    assert!(
        compounding.contains("libcublas.so.13 128.25 MiB (6 allocation(s))"),
        "{compounding}"
    );
    assert!(
        compounding.contains("no other traced process held memory on GPU 0"),
        "{compounding}"
    );
    // The same figures, as data: the allocator's own at the OOM, cuBLAS's, the memory no
    // traced process held (the CUDA context: no message was recorded to say whose), and the
    // verdict they give (the request was more than the whole device).
    let holders = &report["holders"][0];
    assert_eq!(holders["pid"], oom["pid"], "{holders:#}");
    assert_eq!(
        holders["allocated"], r.stats["layout"]["allocated"],
        "{holders:#}"
    );
    let reserved = r.stats["layout"]["reserved"].as_u64().unwrap();
    let allocated = r.stats["layout"]["allocated"].as_u64().unwrap();
    assert_eq!(holders["cached"], reserved - allocated, "{holders:#}");
    assert_eq!(holders["outside"][0]["library"], "libcublas.so.13");
    assert_eq!(holders["outside"][0]["allocations"], 6);
    assert_eq!(
        holders["held"],
        reserved + holders["outside"][0]["bytes"].as_u64().unwrap()
    );
    assert_eq!(holders["unattributed"], 654_899_200, "{holders:#}");
    assert_eq!(holders["verdict"], "beyond_device");
    assert_eq!(holders["others"], serde_json::json!([]));
    // With expandable segments a refused page does not tell the request, and no message was
    // recorded: said, with what would settle it.
    let r = recording("expandable");
    let report = explain(&r);
    let effect = chain(&report, "oom")["effect"].as_str().unwrap().to_owned();
    assert!(effect.contains("request unknown"), "{effect}");
    assert!(effect.contains("would settle it"), "{effect}");
}

#[test]
fn fragmentation_is_judged_per_pool_and_by_what_it_cost() {
    // A small pool's free block of 1 MiB serves every request it takes, and the device never
    // ran short while the cache held the bytes: no High fragmentation.
    for name in ["default", "expandable"] {
        let report = explain(&recording(name));
        for c in report["chains"].as_array().unwrap() {
            if c["rule"] == "fragmentation" {
                assert_ne!(c["severity"], "HIGH", "{name}: {c:#}");
                assert!(!c["root"].as_str().unwrap().contains("Small pool"), "{c:#}");
            }
        }
    }
}

fn whatif(db: &Path, conf: &[&str]) -> Value {
    let mut args = vec!["whatif", "--no-search", "--json"];
    for c in conf {
        args.extend(["--conf", c]);
    }
    tracer_json(db, &args)
}

#[test]
fn whatif_reproduces_both_runs_and_predicts_expandable_segments() {
    let default = recording("default");
    let expandable = recording("expandable");
    for r in [&default, &expandable] {
        let w = whatif(&r.db, &[]);
        let f = &w["fidelity"];
        assert_eq!(f["holds"], true, "{w:#}");
        assert_eq!(f["placements_matched"], f["placements"], "{f:#}");
        assert_eq!(w["recorded_ooms"], r.stats["final"]["num_ooms"], "{w:#}");
        // The capacity is the device's, not the provoked request's.
        let capacity = w["capacity"].as_u64().unwrap();
        assert!(capacity < r.stats["device"]["total_bytes"].as_u64().unwrap());
    }
    // The expandable run's peak reserved, predicted from the default run's requests.
    let w = whatif(&default.db, &["expandable_segments:True"]);
    let row = w["rows"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["conf"] == "expandable_segments:True")
        .unwrap();
    let predicted = row["peak_reserved"].as_f64().unwrap();
    let real = stat(&expandable, "reserved_bytes.all.peak") as f64;
    assert!(
        (predicted - real).abs() <= 0.05 * real,
        "predicted {predicted}, PyTorch reserved {real} at its peak"
    );
}

/// The co-tenant recording (tests/data/gpu-h200/*-co-tenant*, the GPU check of 2026-11-27):
/// another process took all but 3 GiB of the H200 once the trace ran, and the training loop
/// ran to a natural OOM. Who held the device is what PyTorch's out-of-memory observer (its
/// snapshot and message at that instant) and the other process itself said.
#[test]
fn who_held_the_device_at_a_co_tenants_oom_is_who_pytorch_and_the_other_process_say() {
    let r = recording("co-tenant");
    let data = workspace().join("tests/data/gpu-h200/holder-co-tenant.json");
    let other: Value = serde_json::from_slice(&std::fs::read(data).unwrap()).unwrap();
    let seen = &r.stats["natural_oom"];
    let report = explain(&r);
    let h = holders_of(&report, &r);
    // 256 MiB asked, 227.50 MiB free after the flush: 28.50 MiB short; the split blocks
    // (203.86 MiB) and the other process (136.28 GiB) each cover it alone.
    assert_eq!(h["verdict"], "fragmentation_and_other_processes", "{h:#}");
    assert_eq!(h["requested"], seen["alloc"], "{h:#}");
    assert_eq!(h["device_total"], seen["device_total"], "{h:#}");
    assert_eq!(h["device_free"], seen["device_free"], "{h:#}");
    assert_arithmetic_is_pytorchs(h, seen);
    let (allocated, reserved) = (
        seen["layout"]["allocated"].as_u64().unwrap(),
        seen["layout"]["reserved"].as_u64().unwrap(),
    );
    assert_eq!(h["allocated"], allocated, "{h:#}");
    assert_eq!(h["cached"], reserved - allocated, "{h:#}");
    // The other process by its traced cudaMalloc, to the byte its allocator reserved; beside
    // it, its CUDA context: what PyTorch's message says it had ("Process 854 has 136.28 GiB")
    // less what tracer saw it take, to the message's two decimals.
    let tenant = &h["others"][0];
    assert_eq!(tenant["pid"], other["pid"], "{h:#}");
    assert_eq!(tenant["bytes"], other["reserved"], "{h:#}");
    assert_eq!(tenant["from_message"], false);
    let message = seen["message"].as_str().unwrap();
    let said = said_after(message, &format!("Process {} has ", other["pid"]));
    let gib: f64 = said.strip_suffix(" GiB").unwrap().parse().unwrap();
    let total = tenant["bytes"].as_u64().unwrap() + tenant["untraced"].as_u64().unwrap();
    let off = (total as f64 / (1u64 << 30) as f64 - gib).abs();
    assert!(off <= 0.005, "{total} B against the message's {said}");
    // What is left held by no one: under the rounding of the message's figures and what the
    // driver keeps, never the other process's context again.
    assert!(h["unattributed"].as_u64().unwrap_or(0) < 32 << 20, "{h:#}");
    // `layout --at oom` of the loop: the allocator's own layout at the instant.
    let pid = r.stats["pid"].to_string();
    let layout = tracer_json(&r.db, &["layout", "--at", "oom", "--pid", &pid, "--json"]);
    let total = &layout[0]["devices"][0]["total"];
    assert_eq!(total["allocated"], allocated, "{layout:#}");
    assert_eq!(total["reserved"], reserved, "{layout:#}");
}

/// `tracer explain` reads a session through one connection, in one read transaction, and walks
/// its calls once: also with `--pid` (its span read from the blocks at either end of its calls)
/// and with the fixes it cites whatif's simulation in (the runs replayed taken from the same
/// walk). A recording by a tracer that did not store the devices it learned needs a look ahead
/// too: the co-tenant recording is by one that did.
#[test]
fn explain_opens_one_connection_and_walks_the_session_once() {
    let r = recording("co-tenant");
    let pid = r.stats["pid"].to_string();
    for args in [vec![], vec!["--pid", pid.as_str()], vec!["--since", "2s"]] {
        let out = Command::new(TRACER)
            .arg("explain")
            .args(&args)
            .arg("--db")
            .arg(&r.db)
            .env("TRACER_TIMING", "1")
            .output()
            .unwrap();
        let (stdout, stderr) = (
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr),
        );
        assert!(out.status.success(), "{args:?}: {stderr}");
        assert!(
            stdout.contains("[simulated from the"),
            "{args:?}: no fix cited: {stdout}"
        );
        assert!(
            stderr.contains(", 1 connection(s), 1 walk(s)"),
            "{args:?}: {stderr}"
        );
    }
}

/// The OOM's arithmetic in `h` (explain's holders) against what PyTorch's out-of-memory
/// observer saw at that instant (`seen`: its request, cudaMemGetInfo, and the snapshot's layout
/// where it took one): what the device could give is the observer's reading, never above the
/// refused size; the shortfall is the request less it; the split bytes are the snapshot's.
fn assert_arithmetic_is_pytorchs(h: &Value, seen: &Value) {
    let a = &h["arithmetic"];
    let (asked, free) = (
        seen["alloc"].as_u64().unwrap(),
        seen["device_free"].as_u64().unwrap(),
    );
    assert_eq!(a["could_give"], free, "{a:#}");
    // Read after the failure, the free bytes also hold the pages a refused page's request
    // gave back as it failed (at most the request).
    let given_back = if a["page"] == true { asked } else { 0 };
    assert!(
        a["could_give"].as_u64() < a["refused"].as_u64().map(|r| r + given_back),
        "{a:#}"
    );
    assert_eq!(a["shortfall"], asked - free, "{a:#}");
    if let Some(layout) = seen.get("layout") {
        let split = layout["reserved"].as_u64().unwrap() - layout["allocated"].as_u64().unwrap();
        assert_eq!(a["split"], split, "{a:#}");
    }
}

/// One of the GPU check's recorded cases (tests/data/gpu-h200/cases): its database unpacked,
/// PyTorch's account of the run, and the co-tenant's own figures where one ran.
fn case(name: &str) -> (Recording, Option<Value>) {
    let data = workspace().join("tests/data/gpu-h200/cases");
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join(format!("{name}.db"));
    gunzip(&data.join(format!("{name}-trace.db.gz")), &db);
    let read = |file: String| {
        std::fs::read(data.join(file))
            .ok()
            .map(|b| serde_json::from_slice::<Value>(&b).unwrap())
    };
    let stats = read(format!("{name}-stats.json")).unwrap();
    let holder = read(format!("{name}-holder.json"));
    (
        Recording {
            db,
            stats,
            _dir: dir,
        },
        holder,
    )
}

/// The last phase of a recorded case (where its OOM is).
fn last_phase(r: &Recording) -> &Value {
    r.stats["phases"].as_array().unwrap().last().unwrap()
}

/// `set_per_process_memory_fraction(0.02)` on the H200: PyTorch refused a 192 MiB tensor with
/// no cudaMalloc ("2.80 GiB allowed;"). explain says so, with the sum PyTorch checked.
#[test]
fn a_memory_fraction_refusal_is_its_own_verdict() {
    let (r, _) = case("fraction");
    let message = last_phase(&r)["message"].as_str().unwrap();
    assert!(message.contains("2.80 GiB allowed;"), "{message}");
    let report = explain(&r);
    let oom = chain(&report, "oom");
    let title = oom["title"].as_str().unwrap();
    assert!(
        title.contains("refused 192.00 MiB without asking the device"),
        "{title}"
    );
    let effect = oom["effect"].as_str().unwrap();
    assert!(
        effect.contains("the process's memory fraction decided it: 2.80 GiB allowed"),
        "{effect}"
    );
    assert!(
        effect.contains("make 2.81 GiB, more than the 2.80 GiB allowed"),
        "{effect}"
    );
    // No failed device call in the recording: the refusal never reached the device.
    let failed = tracer_json(
        &r.db,
        &[
            "query",
            "--format",
            "json",
            "SELECT count(*) AS n FROM events WHERE ret != 0",
        ],
    );
    assert_eq!(failed[0]["n"], 0, "{failed:#}");
}

/// The training loop traced from a step well after its start, run to an OOM beside a
/// co-tenant, with each allocator: the arithmetic is PyTorch's own at the instant (its
/// observer's reading and request), the verdict follows from it by the stated rules, and no
/// figure of free memory exceeds what the device refused.
#[test]
fn the_oom_arithmetic_of_a_trace_begun_mid_run_is_pytorchs() {
    for (name, verdict) in [
        // 256 MiB asked, 57.56 MiB free: 198.44 MiB short; split 239.86 MiB covers it, and so
        // does the other process.
        ("ring-oom-default", "fragmentation_and_other_processes"),
        // The same shortfall; expandable segments leave 124.14 MiB split: only the other
        // process covers it.
        ("ring-oom-expandable", "other_processes"),
    ] {
        let (r, holder) = case(name);
        let seen = &last_phase(&r)["natural_oom"];
        let report = explain(&r);
        let h = holders_of(&report, &r);
        assert_eq!(h["verdict"], verdict, "{name}: {h:#}");
        assert_arithmetic_is_pytorchs(h, seen);
        let a = &h["arithmetic"];
        let (asked, free) = (
            seen["alloc"].as_u64().unwrap(),
            seen["device_free"].as_u64().unwrap(),
        );
        let other = holder.unwrap();
        assert!(
            a["others"].as_u64().unwrap() >= other["requested"].as_u64().unwrap(),
            "{name}: {a:#}"
        );
        let text = chain(&report, "oom")["effect"].to_string();
        assert!(
            text.contains(&format!("short by {}", pytorch_bytes(asked - free))),
            "{name}: {text}"
        );
    }
}

/// PyTorch's format_size (two decimals).
fn pytorch_bytes(b: u64) -> String {
    format!("{:.2} MiB", b as f64 / (1 << 20) as f64)
}

/// A serving engine's start-up whose KV cache left too little for its graph captures: the OOM
/// during capture, with PyTorch's figures.
#[test]
fn an_oom_during_graph_capture_is_told_with_pytorchs_figures() {
    let (r, _) = case("engine-oom");
    let phase = last_phase(&r);
    assert_eq!(phase["phase"], "capture failed");
    let message = phase["message"].as_str().unwrap();
    let report = explain(&r);
    let effect = chain(&report, "oom")["effect"].as_str().unwrap().to_owned();
    for figure in [
        said_after(message, "Tried to allocate "),
        said_before(message, "is free."),
    ] {
        assert!(effect.contains(&figure), "{figure} not in {effect}");
    }
    // 64 MiB asked with 39.12 MiB free and nothing split: capacity.
    assert!(effect.contains("capacity: it does not fit"), "{effect}");
}

/// What tests/python/mcp_client.py (a real MCP client) saw of `tracer mcp` over `db` in `mode`.
fn mcp_client(db: &Path, mode: &str) -> Value {
    python_json(&[
        workspace().join("tests/python/mcp_client.py").as_os_str(),
        Path::new(TRACER).as_os_str(),
        db.as_os_str(),
        mode.as_ref(),
    ])
}

/// The data `tracer report` embeds in its page for `db` (written beside it).
fn report_data(db: &Path) -> Value {
    let html = db.with_extension("html");
    let out = Command::new(TRACER)
        .args(["report", "-o"])
        .arg(&html)
        .arg("--db")
        .arg(db)
        .output()
        .unwrap();
    assert_ok(&out);
    embedded_data(&std::fs::read_to_string(&html).unwrap())
}

/// Every recording in tests/data with an out-of-memory: tracer's own GPU recordings, the GPU
/// check's cases that ran out, and `tracer demo incident`'s.
fn recordings_with_an_oom() -> Vec<Recording> {
    let mut all: Vec<Recording> = ["default", "expandable", "co-tenant"]
        .into_iter()
        .map(recording)
        .collect();
    for name in [
        "engine-oom",
        "fraction",
        "ring-oom-default",
        "ring-oom-expandable",
    ] {
        all.push(case(name).0);
    }
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("demo.db");
    gunzip(&workspace().join("tests/data/demo-incident.db.gz"), &db);
    all.push(Recording {
        db,
        stats: Value::Null,
        _dir: dir,
    });
    all
}

/// One story from every command on every recording in tests/data with an OOM: explain, `layout`
/// at the OOM (without `--pid`, the process that ran out first, every process at that instant)
/// and at the end, the HTML report's embedded data and its map at the OOM, `tracer mcp`'s
/// explain and layout, and the memory snapshot exported at the OOM all name the same process,
/// device and GPU, the same bytes held by no one traced or named (the CUDA contexts PyTorch's
/// message names counted in all) and the device's free bytes at the failure.
#[test]
fn every_command_tells_one_story() {
    for r in recordings_with_an_oom() {
        let name = r.db.file_name().unwrap().to_string_lossy().into_owned();
        let report = explain(&r);
        let layout = tracer_json(&r.db, &["layout", "--at", "oom", "--json"]);
        let first = &layout[0];
        if report["holders"][0].is_null() {
            // A refusal that never reached the device (a memory fraction): no one held the
            // GPU against it; the layout still shows the process that ran out first.
            assert_eq!(first["pid"], chain(&report, "oom")["pid"], "{name}");
            continue;
        }
        let h = &report["holders"][0];
        let pid = h["pid"].to_string();

        // layout at the OOM, then at the end, for the process that ran out.
        assert_eq!(first["pid"], h["pid"], "{name}: {layout:#}");
        let device = &first["devices"][0];
        assert_eq!(device["device"], h["device"], "{name}: {layout:#}");
        assert_eq!(device["gpu"], h["gpu"], "{name}: {layout:#}");
        assert_eq!(
            device["gpu_share"]["unattributed"], h["unattributed"],
            "{name}: {layout:#} {h:#}"
        );
        let at = first["at_ns"].as_i64().unwrap();
        for p in layout.as_array().unwrap() {
            assert_eq!(
                p["at_ns"], at,
                "{name}: every process at the OOM: {layout:#}"
            );
        }
        // At the end the process may hold nothing; what it holds is on a device CUDA named.
        let end = tracer_json(&r.db, &["layout", "--pid", &pid, "--json"]);
        for d in end[0]["devices"].as_array().unwrap() {
            assert_eq!(d["device"], h["device"], "{name}: {end:#}");
            assert_eq!(d["gpu"], h["gpu"], "{name}: {end:#}");
        }

        // The report: explain's answer, and its map at the OOM is the layout's.
        let data = report_data(&r.db);
        assert_eq!(data["explain"]["holders"], report["holders"], "{name}");
        let map = data["snapshots"]
            .as_array()
            .unwrap()
            .iter()
            .find(|m| m["label"] == "oom")
            .unwrap_or_else(|| panic!("{name}: no map at the OOM"));
        let p = map["processes"]
            .as_array()
            .unwrap()
            .iter()
            .find(|p| p["pid"] == h["pid"])
            .unwrap_or_else(|| panic!("{name}: {map:#}"));
        assert_eq!(p["devices"][0]["device"], h["device"], "{name}");
        assert_eq!(p["devices"][0]["gpu"], h["gpu"], "{name}");
        assert_eq!(
            p["devices"][0]["gpu_share"]["unattributed"], h["unattributed"],
            "{name}"
        );

        // mcp, as an assistant asks it.
        let mcp = mcp_client(&r.db, "story");
        let who = &mcp["explain"]["structured"]["who"][0];
        assert_eq!(who["pid"], h["pid"], "{name}: {who:#}");
        assert_eq!(who["d"], h["device"], "{name}: {who:#}");
        assert_eq!(who["gpu"], h["gpu"], "{name}: {who:#}");
        assert_eq!(who["untraced"], h["untraced"], "{name}: {who:#}");
        assert_eq!(who["unattributed"], h["unattributed"], "{name}: {who:#}");
        assert_eq!(who["free"], h["device_free"], "{name}: {who:#}");
        assert_eq!(
            who["short"], h["arithmetic"]["shortfall"],
            "{name}: {who:#}"
        );
        let seen = &mcp["layout_oom"]["structured"]["procs"][0];
        assert_eq!(seen["pid"], h["pid"], "{name}: {seen:#}");
        let d = &seen["devs"][0];
        assert_eq!(
            (&d["d"], &d["gpu"], &d["unattributed"]),
            (&h["device"], &h["gpu"], &h["unattributed"]),
            "{name}: {seen:#}"
        );

        // The memory snapshot at the OOM: its segments on that device, the failure's free bytes
        // as the arithmetic read them.
        let pickle = r.db.with_extension("pickle");
        export_snapshot(&r.db, &pickle, &["--at", "oom", "--pid", &pid]);
        let figures = python_json(&[
            workspace()
                .join("tests/python/snapshot_compare.py")
                .as_os_str(),
            "--figures".as_ref(),
            pickle.as_os_str(),
        ]);
        // (Segments tracer never saw made are left out, not guessed.)
        for d in figures["segment_devices"].as_array().unwrap() {
            assert_eq!(d, &h["device"], "{name}: {figures:#}");
        }
        let oom = &figures["ooms"][0];
        assert_eq!(oom[0], h["device"], "{name}: {figures:#}");
        if h["arithmetic"]["source"]["kind"] == "after_failure" {
            assert_eq!(oom[1], h["arithmetic"]["could_give"], "{name}: {figures:#}");
        }
    }
}

/// The GPU check's cases that ran without an OOM (CUDA graphs, torch.compile, a MemPool, an
/// engine's start-up): explain, `layout`, the report's last map and mcp's layout put each
/// process on the same devices and GPUs.
#[test]
fn every_command_names_the_same_devices_without_an_oom() {
    for name in ["graphs", "graph-reset", "compiled", "mempool", "engine"] {
        let (r, _) = case(name);
        let report = explain(&r);
        let devices = |pid: &Value| -> Vec<(Value, Value)> {
            let mut d: Vec<(Value, Value)> = report["devices"]
                .as_array()
                .unwrap()
                .iter()
                .filter(|d| &d["pid"] == pid)
                .map(|d| (d["device"].clone(), d["gpu"].clone()))
                .collect();
            d.sort_by_key(|x| x.0.as_i64());
            d
        };
        let layout = tracer_json(&r.db, &["layout", "--json"]);
        let data = report_data(&r.db);
        let end = data["snapshots"]
            .as_array()
            .unwrap()
            .last()
            .unwrap()
            .clone();
        let mcp = mcp_client(&r.db, "devices");
        let seen = &mcp["layout_end"]["structured"]["procs"];
        for p in layout.as_array().unwrap() {
            let laid: Vec<(Value, Value)> = p["devices"]
                .as_array()
                .unwrap()
                .iter()
                .map(|d| (d["device"].clone(), d["gpu"].clone()))
                .collect();
            assert!(!laid.is_empty(), "{name}: {p:#}");
            assert_eq!(laid, devices(&p["pid"]), "{name}: {p:#}");
            let mapped = end["processes"]
                .as_array()
                .unwrap()
                .iter()
                .find(|q| q["pid"] == p["pid"])
                .unwrap_or_else(|| panic!("{name}: {} not in the report's map", p["pid"]));
            assert_eq!(mapped["devices"], p["devices"], "{name}");
            let m = seen
                .as_array()
                .unwrap()
                .iter()
                .find(|q| q["pid"] == p["pid"])
                .unwrap_or_else(|| panic!("{name}: {} not in mcp's layout", p["pid"]));
            for (a, b) in m["devs"]
                .as_array()
                .unwrap()
                .iter()
                .zip(p["devices"].as_array().unwrap())
            {
                assert_eq!((&a["d"], &a["gpu"]), (&b["device"], &b["gpu"]), "{name}");
            }
        }
    }
}

/// No fix is offered that its own replay disproves: on `tracer demo incident`'s recording and on
/// every H200 recording, a setting whose replay still runs out of memory is said as no fix,
/// after those that help, never cited as one.
#[test]
fn no_fix_is_offered_that_its_replay_disproves() {
    let dir = tempfile::tempdir().unwrap();
    let demo = dir.path().join("demo.db");
    gunzip(&workspace().join("tests/data/demo-incident.db.gz"), &demo);
    let kept: Vec<Recording> = ["default", "expandable", "co-tenant"]
        .into_iter()
        .map(recording)
        .collect();
    let mut dbs = vec![demo];
    dbs.extend(kept.iter().map(|r| r.db.clone()));
    let mut disproved = 0;
    for db in &dbs {
        let report = tracer_json(db, &["explain", "--json"]);
        for c in report["chains"].as_array().unwrap() {
            let fixes: Vec<&str> = c["fix"]
                .as_array()
                .unwrap()
                .iter()
                .map(|f| f.as_str().unwrap())
                .collect();
            for (i, text) in fixes.iter().enumerate() {
                if let Some(cited) = text.split_once("[simulated from the ") {
                    let outcome = cited.1.split(";").next().unwrap();
                    assert!(
                        outcome.contains(": no OOM,"),
                        "{}: a fix its replay disproves: {text}",
                        db.display()
                    );
                }
                if text.starts_with("not a fix: ") {
                    disproved += 1;
                    assert!(
                        text.contains("would not have avoided it (replayed from the"),
                        "{text}"
                    );
                    // Said after every fix that helps.
                    assert!(
                        fixes[i..].iter().all(|f| f.starts_with("not a fix: ")),
                        "{fixes:?}"
                    );
                }
            }
        }
    }
    // max_split_size_mb:128 on the demo and the co-tenant OOM, at least.
    assert!(disproved >= 2, "{disproved}");
}
