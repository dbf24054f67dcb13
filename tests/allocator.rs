//! End-to-end tests of what tracer learns from PyTorch's own probes: the USDT sites of the
//! simulated allocator (built with sys/sdt.h, as libc10_cuda's), the layout rebuilt from them
//! against the allocator's own account at every block event, and what a workload that only
//! grows is (and is not) called.

use std::{path::Path, process::Command};

use crate::common::*;
use serde_json::Value;

fn workspace_file(rel: &str) -> std::path::PathBuf {
    workspace().join(rel)
}

/// Traces the simulated allocator's training loop (scripts/gpu_check/sim_workload.py) with its
/// probes, the allocator writing its own layout after every block event; returns (what tracer
/// rebuilt, what the allocator said), one JSON value per block event each.
fn rebuilt_and_truth(fx: &Fixture, expandable: bool, streams: bool) -> (Vec<Value>, Vec<Value>) {
    let dir = tempfile::tempdir().unwrap();
    let trace = fx.trace(&["libcudart.so.12", "libcuda.so.1", "libsimtorch.so"], &[]);
    let truth = dir.path().join("truth.jsonl");
    std::fs::write(dir.path().join("go"), "").unwrap();
    let mut cmd = Command::new("python3");
    cmd.arg(workspace_file("scripts/gpu_check/sim_workload.py"))
        .arg("--cudart")
        .arg(fx.sim.join("libcudart.so.12"))
        .args(["--steps", "80", "--oom", "--ready"])
        .arg(dir.path().join("ready"))
        .arg("--go")
        .arg(dir.path().join("go"))
        .arg("--stats")
        .arg(dir.path().join("stats.json"))
        .env("SIMTORCH_TRUTH", &truth);
    if expandable {
        cmd.arg("--expandable");
    }
    if streams {
        // Side-stream work of about 0.1 ms per MiB: some of it is still running at the
        // allocator's next malloc (its events not ready), all of it done a few steps later.
        cmd.arg("--streams").env("SIMCUDA_MEMSET_BPS", "1e10");
    }
    let out = cmd.output().unwrap();
    assert_ok(&out);
    let stopped = trace.stop(SIGINT);
    assert_eq!(stopped.counter("dropped_ring_full"), 0);
    let timeline = Command::new(TRACER)
        .args(["layout", "--timeline", "--db"])
        .arg(&fx.db)
        .output()
        .unwrap();
    assert_ok(&timeline);
    let parse = |text: &str| -> Vec<Value> {
        text.lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect()
    };
    (
        parse(&String::from_utf8_lossy(&timeline.stdout)),
        parse(&std::fs::read_to_string(&truth).unwrap()),
    )
}

fn figures(v: &Value) -> [i64; 4] {
    ["allocated", "reserved", "free_blocks", "largest_free"].map(|k| v[k].as_i64().unwrap_or(0))
}

fn check_every_block_event(expandable: bool, streams: bool) -> Vec<Value> {
    let Some(fx) = Fixture::new() else {
        return Vec::new();
    };
    let (rebuilt, truth) = rebuilt_and_truth(&fx, expandable, streams);
    assert!(truth.len() > 500, "{} block events", truth.len());
    assert_eq!(
        rebuilt.len(),
        truth.len(),
        "one rebuilt layout per block event"
    );
    for (i, (r, t)) in rebuilt.iter().zip(&truth).enumerate() {
        // A block back in its pool when its last stream event completed: tracer's point names
        // the event, the allocator's the block.
        let completed = t["op"] == "free_completed";
        assert_eq!(
            r["op"] == "free_completed",
            completed,
            "event {i}: {r} vs {t}"
        );
        if !completed {
            assert_eq!(r["ptr"], t["ptr"], "event {i}");
        }
        assert_eq!(
            figures(&r["total"]),
            figures(t),
            "event {i} ({}): {r} vs {t}",
            t["op"]
        );
        for pool in ["small", "large"] {
            let rebuilt_pool = r["pools"].get(pool).map_or([0; 4], figures);
            assert_eq!(
                rebuilt_pool,
                figures(&t["pools"][pool]),
                "event {i}, {pool} pool"
            );
        }
    }
    // The layout at the end, as a map: every segment's runs tile it.
    let layouts = tracer_json(&fx.db, &["layout", "--json"]);
    let p = &layouts[0];
    assert_eq!(p["view"], "allocator");
    for seg in p["segments"].as_array().unwrap() {
        let runs = seg["runs"].as_array().unwrap();
        let covered: i64 = runs.iter().map(|r| r["size"].as_i64().unwrap()).sum();
        assert_eq!(covered, seg["size"].as_i64().unwrap(), "{seg}");
    }
    let text = Command::new(TRACER)
        .args(["layout", "--db"])
        .arg(&fx.db)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&text.stdout);
    assert!(
        text.contains("(allocator view)") && text.contains("] "),
        "{text}"
    );
    // Exported as PyTorch's memory snapshot, the trace makes the allocator's block events in
    // its order: a free no other stream used completes at once, one kept for other streams
    // when its last event completes.
    let file = fx.db.with_extension("pickle");
    export_snapshot(&fx.db, &file, &[]);
    let expected: Vec<(String, u64)> = truth
        .iter()
        .flat_map(|t| {
            let ptr = t["ptr"].as_u64().unwrap();
            match t["op"].as_str().unwrap() {
                "malloc" => vec![("alloc", ptr)],
                "free" => vec![("free_requested", ptr), ("free_completed", ptr)],
                op => vec![(
                    if op == "free_requested" {
                        "free_requested"
                    } else {
                        "free_completed"
                    },
                    ptr,
                )],
            }
        })
        .map(|(a, p)| (a.to_owned(), p))
        .collect();
    assert_eq!(snapshot_block_actions(&file), expected);
    truth
}

#[test]
fn the_layout_rebuilt_from_pytorchs_probes_equals_the_allocators_own_at_every_block_event() {
    check_every_block_event(false, false);
}

/// Blocks used on a side stream (record_stream) are freed, kept out of the pool while the side
/// stream's work runs, and returned when the allocator finds its events complete: tracer's
/// layout (from cudaEventRecord made by the allocator's library, and cudaEventQuery and
/// cudaEventSynchronize succeeding) equals the allocator's own at every step, kept blocks
/// neither allocated nor free.
#[test]
fn a_block_used_on_another_stream_is_not_free_before_its_events_complete() {
    let truth = check_every_block_event(false, true);
    if truth.is_empty() {
        return;
    }
    let count = |op: &str| truth.iter().filter(|t| t["op"] == op).count();
    assert!(
        count("free_requested") >= 100,
        "{}",
        count("free_requested")
    );
    assert_eq!(count("free_requested"), count("free_completed"));
    // Some were still kept at a later block event: the case a layout that freed them at once
    // gets wrong.
    let kept_at_malloc = truth
        .iter()
        .filter(|t| t["op"] == "malloc" && t["pending"].as_u64().unwrap_or(0) > 0)
        .count();
    assert!(
        kept_at_malloc >= 20,
        "{kept_at_malloc} mallocs saw blocks kept"
    );
}

#[test]
fn with_expandable_segments_too() {
    check_every_block_event(true, false);
}

/// The file offset of `symbol` in `lib`, from its section (nm for the address, readelf for
/// where its section lies in the file).
fn symbol_file_offset(lib: &Path, symbol: &str) -> u64 {
    let nm = Command::new("nm").arg(lib).output().unwrap();
    let nm = String::from_utf8_lossy(&nm.stdout);
    let addr = nm
        .lines()
        .find(|l| l.ends_with(&format!(" {symbol}")))
        .and_then(|l| u64::from_str_radix(l.split_whitespace().next()?, 16).ok())
        .unwrap_or_else(|| panic!("no {symbol} in {nm}"));
    let sections = Command::new("readelf")
        .args(["-SW"])
        .arg(lib)
        .output()
        .unwrap();
    let sections = String::from_utf8_lossy(&sections.stdout);
    for line in sections.lines() {
        let f: Vec<&str> = line.split_whitespace().collect();
        let Some(at) = f.iter().position(|w| w.starts_with('.')) else {
            continue;
        };
        let (Some(a), Some(o), Some(s)) = (f.get(at + 2), f.get(at + 3), f.get(at + 4)) else {
            continue;
        };
        let (Ok(a), Ok(o), Ok(s)) = (
            u64::from_str_radix(a, 16),
            u64::from_str_radix(o, 16),
            u64::from_str_radix(s, 16),
        ) else {
            continue;
        };
        if a != 0 && addr >= a && addr < a + s {
            return addr - a + o;
        }
    }
    panic!("no section holds {symbol} at {addr:#x}");
}

#[test]
fn usdt_notes_of_a_library_built_with_sys_sdt_h_are_read_exactly() {
    // The simulated allocator's probes: compiled by demos/simcuda/build.sh with sys/sdt.h.
    let lib = sim().join("libsimtorch.so");
    let sites = tracer_cli::probe::usdt::read_sites(&lib).unwrap();
    let names: Vec<(&str, &str)> = sites
        .iter()
        .map(|s| (s.provider.as_str(), s.name.as_str()))
        .collect();
    assert_eq!(
        names,
        [("pytorch", "malloc"), ("pytorch", "free")],
        "{sites:?}"
    );
    let bytes = std::fs::read(&lib).unwrap();
    for site in &sites {
        // Each site is the `nop` sys/sdt.h planted, found at its file offset.
        assert_eq!(bytes[site.offset as usize], 0x90, "{site:?}");
        let semaphore = format!("{}_{}_semaphore", site.provider, site.name);
        assert_eq!(
            site.semaphore,
            symbol_file_offset(&lib, &semaphore),
            "{site:?}"
        );
        // A plan for the probe table's meaning of every argument.
        let plan = site.plan().unwrap().unwrap();
        assert_eq!(
            plan.nargs as usize,
            if site.name == "malloc" { 4 } else { 1 }
        );
    }
    // An executable without semaphores or notes: none.
    assert!(
        tracer_cli::probe::usdt::read_sites(&sim().join("simdriver"))
            .unwrap()
            .is_empty()
    );
}

#[test]
fn a_workload_that_only_grows_is_growth_or_a_leak_never_fragmentation() {
    let Some(fx) = Fixture::new() else { return };
    let lib = fx.sim.join("libcudart.so.12");
    let trace = Trace::start(&fx.db, &["--lib", lib.to_str().unwrap()]);
    // 600 allocations of 1 MiB, never freed, each slower as live allocations pile up.
    let script = format!(
        "import ctypes, time\nrt = ctypes.CDLL({lib:?})\np = ctypes.c_void_p()\nfor i in range(600):\n    assert rt.cudaMalloc(ctypes.byref(p), ctypes.c_size_t(1 << 20)) == 0\n    time.sleep(0.01)\n",
        lib = lib.to_str().unwrap()
    );
    let out = Command::new("python3")
        .args(["-c", &script])
        .env("SIMCUDA_LATENCY", "cudaMalloc=50us,default=1us")
        .env("SIMCUDA_LATENCY_PER_LIVE_NS", "2000")
        .output()
        .unwrap();
    assert_ok(&out);
    trace.stop(SIGINT);
    let report = tracer_json(&fx.db, &["explain", "--json"]);
    let rules = rule_names(&report);
    assert!(
        !rules.iter().any(|r| r.starts_with("fragmentation")),
        "{rules:?}"
    );
    assert!(rules.contains(&"leak"), "{rules:?}");
}

fn env_value(env: &str, key: &str) -> u64 {
    env.lines()
        .find_map(|l| l.strip_prefix(&format!("{key}=")))
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no {key} in {env}"))
}

#[test]
fn the_early_warning_runs_the_on_warning_command_as_the_user_before_the_oom() {
    let Some(fx) = Fixture::new() else { return };
    let libs = [
        "--lib".to_owned(),
        fx.lib("libcudart.so.12"),
        "--lib".to_owned(),
        fx.lib("libsimtorch.so"),
    ];
    // As root with nobody on whose behalf: refused before anything is attached.
    let refused = Command::new(TRACER)
        .args(["trace", "--db"])
        .arg(&fx.db)
        .args(&libs)
        .args(["--on-warning", "true"])
        .env_remove("SUDO_UID")
        .env_remove("SUDO_GID")
        .output()
        .unwrap();
    assert_eq!(refused.status.code(), Some(2));
    assert!(
        String::from_utf8_lossy(&refused.stderr).contains("never runs its command as root"),
        "{}",
        String::from_utf8_lossy(&refused.stderr)
    );

    let dir = dir_with_mode(0o777);
    let hook = format!(
        "env > {0}/warned.env; id -u > {0}/warned.uid",
        dir.path().display()
    );
    let mut args: Vec<&str> = libs.iter().map(String::as_str).collect();
    args.extend(["--on-warning", &hook, "--on-warning-user", "nobody"]);
    let trace = Trace::start(&fx.db, &args);
    let out = incident_workload(&fx.sim).output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("OutOfMemoryError"), "{stderr}");
    let stopped = trace.stop(SIGINT);

    // One run, as nobody, with the figures of a pool in which the next request fails.
    let runs = stopped.summary["on_warning"].as_array().unwrap();
    assert_eq!(runs.len(), 1, "{:#}", stopped.summary);
    assert_eq!(runs[0]["exit_code"], 0, "{:#}", runs[0]);
    let uid = std::fs::read_to_string(dir.path().join("warned.uid")).unwrap();
    assert_ne!(uid.trim(), "0");
    let env = std::fs::read_to_string(dir.path().join("warned.env")).unwrap();
    let pid = env_value(&env, "TRACER_PID");
    let request = env_value(&env, "TRACER_REQUEST_BYTES");
    let largest = env_value(&env, "TRACER_LARGEST_FREE_BYTES");
    let cached = env_value(&env, "TRACER_CACHED_BYTES");
    let device_free = env_value(&env, "TRACER_DEVICE_FREE_BYTES");
    let segment = env_value(&env, "TRACER_SEGMENT_BYTES");
    assert!(largest < request && request <= cached, "{env}");
    assert!(device_free < segment, "{env}");
    let result = workload_result(&out.stdout);
    assert_eq!(result["pid"].as_u64(), Some(pid));

    // The same warning explain finds afterwards, with the same request; it came before the OOM.
    let report = tracer_json(&fx.db, &["explain", "--json"]);
    let chains = report["chains"].as_array().unwrap();
    let warning = chains
        .iter()
        .find(|c| c["rule"] == "early_warning")
        .unwrap();
    let mib = request as f64 / (1 << 20) as f64;
    assert!(
        warning["title"]
            .as_str()
            .unwrap()
            .contains(&format!("the next {mib:.1} MiB request")),
        "{warning:#} vs {env}"
    );
    assert!(chains.iter().any(|c| c["rule"] == "oom"), "{report:#}");
    // The run is in the session's notes.
    let notes = query(&fx.db, "SELECT note FROM sessions")[0]["note"]
        .as_str()
        .unwrap()
        .to_owned();
    assert!(
        notes.contains(&format!("for pid {pid} (device 0) exited 0")),
        "{notes}"
    );
    // The live figures at the end are the allocator's own (its result line).
    let rows = stopped.summary["allocators"].as_array().unwrap();
    let row = rows
        .iter()
        .find(|r| r["pid"].as_u64() == Some(pid))
        .unwrap();
    assert_eq!(row["view"], "blocks");
    for key in ["allocated", "reserved"] {
        assert_eq!(row[key], result["result"][key], "{key}: {row} vs {result}");
    }
    assert_eq!(
        row["largest_free"], result["result"]["largest_free_block"],
        "{row} vs {result}"
    );
}

/// Decodes a Perfetto trace with Perfetto's own protos (PyPI perfetto) into a summary: slices
/// and instants per name (interned names resolved as the trace processor does), each counter
/// track's last value, and the format's invariants.
const PERFETTO_SUMMARY: &str = r#"
import json, sys
from collections import Counter
from perfetto.protos.perfetto.trace import perfetto_trace_pb2 as p
t = p.Trace(); t.ParseFromString(open(sys.argv[1], 'rb').read())
tracks, slices, instants, last, problems = {}, Counter(), Counter(), {}, []
names, arg_names, clock = {}, {}, None
for i, pk in enumerate(t.packet):
    if pk.trusted_packet_sequence_id != 1: problems.append(f'packet {i}: sequence {pk.trusted_packet_sequence_id}')
    if pk.HasField('trace_packet_defaults'): clock = pk.trace_packet_defaults.timestamp_clock_id
    for n in pk.interned_data.event_names: names[n.iid] = n.name
    for n in pk.interned_data.debug_annotation_names: arg_names[n.iid] = n.name
    if pk.HasField('clock_snapshot'):
        if i != 0: problems.append('clock snapshot not first')
        if pk.clock_snapshot.primary_trace_clock != 1: problems.append('primary clock not REALTIME')
    elif pk.HasField('track_descriptor'):
        d = pk.track_descriptor
        tracks[d.uuid] = d.name or (f'process {d.process.pid}' if d.HasField('process') else f'thread {d.thread.tid}')
    elif pk.HasField('track_event'):
        e = pk.track_event
        c = pk.timestamp_clock_id if pk.HasField('timestamp_clock_id') else clock
        if c != 1: problems.append(f'packet {i}: clock {c}')
        if e.track_uuid not in tracks: problems.append(f'packet {i}: track {e.track_uuid} used before described')
        name = e.name if e.HasField('name') else names.get(e.name_iid)
        if e.type != e.TYPE_SLICE_END and e.type != e.TYPE_COUNTER and name is None: problems.append(f'packet {i}: name {e.name_iid} not interned')
        for a in e.debug_annotations:
            if not a.HasField('name') and a.name_iid not in arg_names: problems.append(f'packet {i}: argument {a.name_iid} not interned')
        if e.type == e.TYPE_SLICE_BEGIN: slices[name] += 1
        elif e.type == e.TYPE_INSTANT: instants[name] += 1
        elif e.type == e.TYPE_COUNTER: last[tracks.get(e.track_uuid)] = e.counter_value
print(json.dumps({'slices': slices, 'instants': instants, 'counters': last, 'problems': problems[:5]}))
"#;

#[test]
fn the_perfetto_export_holds_every_call_the_counters_and_the_oom() {
    let Some(fx) = Fixture::new() else { return };
    let result = record_incident(&fx, &[], || {});
    let file = fx.db.with_file_name("t.perfetto");
    let export = Command::new(TRACER)
        .args(["export", "--format", "perfetto", "-o"])
        .arg(&file)
        .arg("--db")
        .arg(&fx.db)
        .output()
        .unwrap();
    assert_ok(&export);
    let summary = python_json(&["-c".as_ref(), PERFETTO_SUMMARY.as_ref(), file.as_os_str()]);
    assert_eq!(summary["problems"], serde_json::json!([]), "{summary:#}");
    // A slice per call, an instant per allocator block event: the session's counts.
    for row in query(&fx.db, "SELECT op, count(*) AS n FROM events GROUP BY op") {
        let op = row["op"].as_str().unwrap();
        assert_eq!(summary["slices"][op], row["n"], "{op}: {summary:#}");
    }
    for row in query(
        &fx.db,
        "SELECT op, count(*) AS n FROM tensor_events GROUP BY op",
    ) {
        let op = row["op"].as_str().unwrap();
        assert_eq!(summary["instants"][op], row["n"], "{op}");
    }
    let r = &result["result"];
    assert_eq!(summary["instants"]["CUDA out of memory"], r["num_ooms"]);
    assert_eq!(
        summary["instants"]["allocation retried"],
        r["num_alloc_retries"]
    );
    let failed = scalar(
        &fx.db,
        "SELECT count(*) FROM events WHERE op = 'cudaMalloc' AND ret != 0",
    );
    assert_eq!(summary["instants"]["allocation failed"], failed);
    assert!(
        summary["instants"]["early warning: the next request fails"]
            .as_i64()
            .unwrap()
            >= 1
    );
    // The counters end where the allocator's own account ends.
    let counters = &summary["counters"];
    assert_eq!(
        counters["allocated (device 0)"], r["allocated"],
        "{counters:#}"
    );
    assert_eq!(counters["reserved (device 0)"], r["reserved"]);
    assert_eq!(
        counters["largest free block (device 0)"],
        r["largest_free_block"]
    );
}

/// A block handed out without PyTorch's probes (torch.cuda.caching_allocator_alloc: raw_alloc)
/// takes space tracer cannot see. When the allocator then makes a new segment although the
/// layout shows a free block that fits, that space was held: the layout says so, shows itself
/// not exact, and explain draws no verdict from it.
#[test]
fn blocks_handed_out_without_probes_show_as_held_unseen_never_as_free() {
    let Some(fx) = Fixture::new() else { return };
    let trace = fx.trace(&["libcudart.so.12", "libsimtorch.so"], &[]);
    // A 4 MiB tensor in a 20 MiB segment; 12 MiB raw_alloc'ed beside it (no probe); an 8 MiB
    // tensor then needs a new segment: the 16 MiB tracer sees free holds only 4.
    let script = format!(
        "import sys\nsys.path.insert(0, {dir:?})\nfrom caching_allocator import CachingAllocator, MIB\na = CachingAllocator({cudart:?})\nt = a.malloc(4 * MIB)\nr = a.raw_alloc(12 * MIB)\nu = a.malloc(8 * MIB)\nassert len(a.segments) == 2, len(a.segments)\nprint(a.stats()['largest_free_block'])\n",
        dir = workspace_file("demos/workloads").to_str().unwrap(),
        cudart = fx.lib("libcudart.so.12"),
    );
    let out = Command::new("python3")
        .args(["-c", &script])
        .output()
        .unwrap();
    assert_ok(&out);
    trace.stop(SIGINT);
    let layouts = tracer_json(&fx.db, &["layout", "--json"]);
    let p = &layouts[0];
    assert_eq!(p["held_unseen"], 1, "{p}");
    assert!(p["unknown"]["since_ns"].is_i64(), "{p}");
    assert!(p["unknown"]["exact_ns"].is_null(), "{p}");
    let text = Command::new(TRACER)
        .args(["layout", "--db"])
        .arg(&fx.db)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&text.stdout);
    assert!(text.contains("without PyTorch's probes"), "{text}");
    let report = tracer_json(&fx.db, &["explain", "--json"]);
    let rules = rule_names(&report);
    assert!(rules.contains(&"unknown_state"), "{rules:?}");
    assert!(
        !rules.iter().any(|r| r.starts_with("fragmentation")),
        "{rules:?}"
    );
}

/// whatif on the incident: with the settings it ran with, the simulator makes the run's own
/// decisions (every device allocation, every block where the allocator put it, the OOM at the
/// same request, the same peak reserved); and the incident run again with the setting whatif
/// says avoids the OOM ends as simulated (OOM or not, peak reserved within 2 %).
#[test]
fn whatif_reproduces_the_run_and_predicts_it_under_expandable_segments() {
    let Some(fx) = Fixture::new() else { return };
    let incident = |conf: &str, final_request: Option<u64>| {
        let mut cmd = incident_workload(&fx.sim);
        cmd.args(["--steps", "200", "--speed", "100"])
            .env("PYTORCH_CUDA_ALLOC_CONF", conf);
        if let Some(bytes) = final_request {
            cmd.arg("--final-request").arg(bytes.to_string());
        }
        cmd.output().unwrap()
    };
    let trace = fx.trace(&["libcudart.so.12", "libsimtorch.so"], &["--quiet"]);
    let out = incident("", None);
    trace.stop(2);
    assert!(String::from_utf8_lossy(&out.stderr).contains("OutOfMemoryError"));
    let recorded = workload_result(&out.stdout);

    let w = tracer_json(
        &fx.db,
        &["whatif", "--json", "--conf", "expandable_segments:True"],
    );
    let f = &w["fidelity"];
    assert_eq!(f["holds"], true, "{f:#}");
    assert_eq!(f["placements_matched"], f["placements"], "{f:#}");
    assert_eq!(
        f["device_allocs_recorded"],
        recorded["memory_stats"]["num_device_alloc"]
    );
    assert_eq!(w["recorded_ooms"], 1);
    let as_run = &w["rows"][0];
    assert_eq!(as_run["recorded_settings"], true);
    assert!(as_run["oom_request"].is_u64(), "{as_run:#}");
    assert_eq!(
        as_run["peak_reserved"],
        recorded["memory_stats"]["reserved_bytes.all.peak"]
    );
    assert_eq!(
        as_run["retries"],
        recorded["memory_stats"]["num_alloc_retries"]
    );

    // explain's fixes that name the setting say what the simulator found.
    let report = tracer_json(&fx.db, &["explain", "--json"]);
    let cited: Vec<&str> = report["chains"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|c| c["fix"].as_array().unwrap())
        .filter_map(|f| f.as_str())
        .filter(|f| f.contains("expandable_segments:True") && f.contains("[simulated from the"))
        .collect();
    assert!(
        cited
            .iter()
            .any(|f| f.contains("no OOM") && f.contains("as run: an OOM at request")),
        "{:#}",
        report["chains"]
    );

    let predicted = &w["rows"][1];
    assert_eq!(predicted["conf"], "expandable_segments:True");
    let again = incident(
        "expandable_segments:True",
        recorded["final_request"].as_u64(),
    );
    let result = workload_result(&again.stdout);
    assert_eq!(
        predicted["oom_request"].is_null(),
        again.status.success(),
        "{predicted:#} vs {}",
        String::from_utf8_lossy(&again.stderr)
    );
    let simulated = predicted["peak_reserved"].as_f64().unwrap();
    let real = result["memory_stats"]["reserved_bytes.all.peak"]
        .as_f64()
        .unwrap();
    eprintln!(
        "expandable_segments: simulated OOM {}, peak reserved {simulated}; the run: exit {:?}, peak reserved {real}",
        predicted["oom_request"], again.status.code()
    );
    assert!(
        (simulated - real).abs() <= 0.02 * real,
        "peak reserved: simulated {simulated}, run {real}"
    );
}

/// `--allocator auto`: a process is first seen with PyTorch's allocator probes not armed; a
/// device allocation after warm-up (a cache miss) arms them in that process, its block events
/// are recorded from then on, a quiet period disarms them (no block event after), and the
/// layout never shows as free the segments whose contents tracer did not see.
#[test]
fn auto_arms_at_a_cache_miss_disarms_when_quiet_and_never_shows_unseen_memory_free() {
    let Some(fx) = Fixture::new() else { return };
    let trace = fx.trace(
        &["libcudart.so.12", "libsimtorch.so"],
        &[
            "--quiet",
            "--allocator",
            "auto",
            "--arm-warmup",
            "500ms",
            "--arm-quiet",
            "2s",
            "--arm-min",
            "2s",
        ],
    );
    let script = format!(
        "import sys, time\nsys.path.insert(0, {dir:?})\nfrom caching_allocator import CachingAllocator, MIB\na = CachingAllocator({cudart:?})\nt = a.malloc(4 * MIB)\ntime.sleep(1.0)\nu = a.malloc(30 * MIB)\ntime.sleep(0.8)\nv = a.malloc(6 * MIB)\na.free(v)\ntime.sleep(0.9)\ntime.sleep(3.6)\nw = a.malloc(2 * MIB)\n",
        dir = workspace_file("demos/workloads").to_str().unwrap(),
        cudart = fx.lib("libcudart.so.12"),
    );
    let out = Command::new("python3")
        .args(["-c", &script])
        .output()
        .unwrap();
    assert_ok(&out);
    trace.stop(SIGINT);
    let marks = query(
        &fx.db,
        "SELECT o.name, c.ret FROM calls c JOIN ops o ON o.id = c.op_id WHERE o.name LIKE 'tracer:%' ORDER BY c.ts_ns",
    );
    let marks: Vec<(String, i64)> = marks
        .iter()
        .map(|m| {
            (
                m["name"].as_str().unwrap().to_owned(),
                m["ret"].as_i64().unwrap(),
            )
        })
        .collect();
    let said = |name: &str, ret: i64| (format!("tracer:allocator_{name}"), ret);
    // Not armed yet (1), arming and armed at the cache miss (3), disarmed when quiet (7).
    assert_eq!(
        marks,
        [
            said("disarmed", 1),
            said("arming", 3),
            said("armed", 3),
            said("disarmed", 7)
        ]
    );
    let blocks = query(&fx.db, "SELECT op, size FROM tensor_events ORDER BY ts_ns");
    let blocks: Vec<(&str, u64)> = blocks
        .iter()
        .map(|b| (b["op"].as_str().unwrap(), b["size"].as_u64().unwrap()))
        .collect();
    assert_eq!(
        blocks,
        [("pytorch:malloc", 6 << 20), ("pytorch:free", 6 << 20)],
        "only the blocks made while armed"
    );
    let layouts = tracer_json(&fx.db, &["layout", "--json"]);
    let p = &layouts[0];
    assert!(p["block_sight"]["DisarmedAt"].is_i64(), "{p}");
    assert_eq!(
        p["unseen_contents"],
        serde_json::json!([2, 50 << 20]),
        "{p}"
    );
    for d in p["devices"].as_array().unwrap() {
        assert_eq!(d["total"]["largest_free"], 0, "nothing unseen is free: {d}");
    }
    // Exported as PyTorch's memory snapshot, the unseen segments are left out whole (never
    // written as inactive blocks), with their entries, and said.
    let file = fx.db.with_extension("pickle");
    let said = export_snapshot(&fx.db, &file, &[]);
    assert!(
        said.contains("2 segments (50.0 MiB) whose blocks tracer did not see"),
        "{said}"
    );
    let figures = snapshot_figures(&file);
    // Both segments were made before the arming (v was placed in t's): nothing is left that
    // tracer saw whole, so nothing is written, and their entries went with them.
    assert_eq!(figures["reserved"], 0, "{figures}");
    assert_eq!(figures["entries"], 0, "{figures}");
    assert!(said.contains("entries of theirs"), "{said}");
    let text = explain_text(&fx.db);
    assert!(
        text.contains("armed at a device allocation after warm-up"),
        "{text}"
    );
    // Host context only while armed: the script's 1 s sleep before the arming left no off-CPU
    // interval; its 0.9 s sleep while armed did (the one begun as it was armed may not, and
    // the one the disarming cut short is dropped: its end was not seen).
    let host = query(&fx.db, "SELECT host_context FROM sessions");
    assert!(
        host[0]["host_context"]
            .as_str()
            .unwrap()
            .ends_with("; followed=while-armed"),
        "{host:?}"
    );
    let armed_at = query(
        &fx.db,
        "SELECT c.ts_ns FROM calls c JOIN ops o ON o.id = c.op_id WHERE o.name = 'tracer:allocator_armed'",
    )[0]["ts_ns"]
        .as_i64()
        .unwrap();
    let long_sleeps = query(
        &fx.db,
        "SELECT off_ns FROM offcpu_intervals WHERE on_ns - off_ns > 700000000 ORDER BY off_ns",
    );
    let starts: Vec<i64> = long_sleeps
        .iter()
        .map(|s| s["off_ns"].as_i64().unwrap())
        .collect();
    assert!(
        !starts.is_empty() && starts.iter().all(|&off| off >= armed_at),
        "sleeps off the CPU {starts:?}, armed at {armed_at}"
    );
    assert!(
        text.contains("host context only while a process's allocator probes were armed"),
        "{text}"
    );
}

/// `--allocator auto` through an out-of-memory: the probes are armed when the process's device
/// memory passes its share of the GPU (the simulated 3 GiB device), so the segments made
/// before hold blocks tracer did not see; explain still explains the OOM from PyTorch's message
/// and the CUDA calls, says what it could not see, and draws no capacity verdict from a
/// partial layout.
#[test]
fn an_oom_in_auto_mode_is_explained_from_the_message_and_the_calls() {
    let Some(fx) = Fixture::new() else { return };
    let trace = fx.trace(
        &["libcudart.so.12", "libsimtorch.so"],
        &["--quiet", "--allocator", "auto"],
    );
    let out = incident_workload(&fx.sim)
        .args(["--steps", "200", "--speed", "100"])
        .output()
        .unwrap();
    assert!(String::from_utf8_lossy(&out.stderr).contains("OutOfMemoryError"));
    trace.stop(SIGINT);
    let report = tracer_json(&fx.db, &["explain", "--json"]);
    let arming: Vec<(bool, &str)> = report["arming"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| (a["armed"].as_bool().unwrap(), a["reason"].as_str().unwrap()))
        .collect();
    // Armed when its memory passed the share (or, on a slower machine, at the failed
    // allocations or the OOM that came first); its end disarms it, unless the trace stopped first.
    assert_eq!(
        arming[0],
        (false, "not_armed_yet"),
        "{:#}",
        report["arming"]
    );
    let (armed, why) = arming[1];
    assert!(
        armed && ["reserved", "failed_allocation", "out_of_memory"].contains(&why),
        "{:#}",
        report["arming"]
    );
    assert!(
        arming[2..].iter().all(|&a| a == (false, "ended")),
        "{arming:?}"
    );
    if why == "reserved" {
        let armed = &report["arming"][1];
        assert_eq!(armed["total"], 3u64 << 30, "the device's total: {armed}");
        assert!(armed["held"].as_u64().unwrap() * 100 >= 85 * (3u64 << 30));
    }
    let chains = report["chains"].as_array().unwrap();
    let oom = chains
        .iter()
        .find(|c| c["rule"] == "oom")
        .expect("the OOM is explained");
    let effect = oom["effect"].as_str().unwrap();
    assert!(effect.contains("Tried to allocate 216.00 MiB"), "{effect}");
    assert!(effect.contains("contents unknown"), "{effect}");
    // Fragmentation only where the free bytes tracer saw prove it; never capacity from a
    // partial layout.
    assert!(
        !effect.contains("(capacity)"),
        "no verdict from a partial layout: {effect}"
    );
    let verdict = report["holders"][0]["verdict"].as_str().unwrap();
    assert!(["unknown", "fragmentation"].contains(&verdict), "{verdict}");
    let text = explain_text(&fx.db);
    assert!(
        text.contains("came with the probes armed since")
            || text.contains("came while the probes were not armed"),
        "{text}"
    );
    // The memory snapshot at the OOM holds the segments tracer saw whole, no more: the
    // layout's own figures there, the segments of unknown contents left out and said.
    let file = fx.db.with_extension("pickle");
    let said = export_snapshot(&fx.db, &file, &["--at", "oom"]);
    assert!(said.contains("whose blocks tracer did not see"), "{said}");
    let figures = snapshot_figures(&file);
    let layout = tracer_json(&fx.db, &["layout", "--at", "oom", "--json"]);
    let total = &layout[0]["devices"][0]["total"];
    for key in ["allocated", "reserved", "free_blocks", "largest_free"] {
        assert_eq!(figures[key], total[key], "{key}: {figures} {total}");
    }
}
