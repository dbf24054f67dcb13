//! Real allocator traces as the judge: the PyTorch memory snapshots recorded on real GPUs in
//! ../shared/snapshots (provenance in its README) imported with `tracer import --snapshot`, as
//! an unprivileged user would. The layout tracer rebuilds from the events must equal each
//! snapshot's own final segments, blocks and states.

use std::path::PathBuf;
use std::process::Command;

use crate::common::*;
use serde_json::Value;

/// The snapshots, or None (said) when ../shared is not beside the checkout: they are other
/// projects' files, kept out of this repository, so a clone elsewhere skips these tests and
/// says so (CI runs with ../shared beside it). tracer's own GPU recordings are in the
/// repository (tests/recordings.rs).
fn snapshots() -> Option<Vec<PathBuf>> {
    let dir = workspace().join("../shared/snapshots");
    let mut files = pickles_in(&dir, false);
    files.sort();
    if files.is_empty() {
        skipped(&format!(
            "needs ../shared/snapshots beside the checkout (other projects' snapshots, not in this repository): none in {}",
            dir.display()
        ));
        return None;
    }
    Some(files)
}

/// The plain `.pickle` files in `dir`, and with `gzipped` the `.pickle.gz` ones too.
fn pickles_in(dir: &std::path::Path, gzipped: bool) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .map(|d| {
            d.filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| {
                    let name = p.to_string_lossy();
                    name.ends_with(".pickle") || (gzipped && name.ends_with(".pickle.gz"))
                })
                .collect()
        })
        .unwrap_or_default();
    files.sort();
    files
}

/// ../shared's gzip'd GPT-2 snapshot from the H200, or None (said) when ../shared is not beside
/// the checkout.
fn h200_gpt2_snapshot() -> Option<PathBuf> {
    let file = workspace().join("../shared/snapshots/h200-torch2.11-gpt2-expandable-oom.pickle.gz");
    if !file.exists() {
        skipped(&format!("{} is not beside the checkout", file.display()));
        return None;
    }
    Some(file)
}

fn import(db: &std::path::Path, file: &std::path::Path) -> Value {
    tracer_json(
        db,
        &["import", "--json", "--snapshot", file.to_str().unwrap()],
    )
}

#[test]
fn every_real_snapshot_rebuilds_to_the_allocators_own_layout() {
    let Some(files) = snapshots() else { return };
    assert_eq!(files.len(), 4, "{files:?}");
    // (The gzip'd H200 snapshot beside them: every_gzipped_snapshot_from_a_real_gpu_rebuilds_exactly.)
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("t.db");
    for file in &files {
        let r = import(&db, file);
        let check = &r["check"];
        assert_eq!(
            check["first_difference"],
            Value::Null,
            "{}: {r:#}",
            file.display()
        );
        assert_eq!(check["segments"], check["segments_equal"], "{r:#}");
        assert_eq!(check["blocks"], check["blocks_equal"], "{r:#}");
        assert!(check["blocks"].as_u64().unwrap() > 100, "{r:#}");
        // Each one starts mid-run: the state before it was rebuilt, and nothing contradicts it.
        let import = &r["import"];
        assert!(import["blocks_before_trace"].as_u64().unwrap() > 0, "{r:#}");
        assert_eq!(import["inconsistent_entries"], 0, "{r:#}");
        assert_eq!(import["unknown_actions"], 0, "{r:#}");
        // An older snapshot has no times: no rule reads rates or intervals from its order.
        let session = import["session"].as_i64().unwrap().to_string();
        let report = tracer_json(&db, &["explain", "--json", "--session", &session]);
        assert_eq!(report["untimed"], import["times_synthesized"], "{report:#}");
        if report["untimed"] == true {
            for c in report["chains"].as_array().unwrap() {
                assert!(
                    ["fragmentation", "oom", "allocator_retry", "early_warning"]
                        .contains(&c["rule"].as_str().unwrap()),
                    "{c:#}"
                );
            }
        }
    }
}

/// whatif's fidelity gate on what PyTorch's real allocator decided: replayed under the settings
/// the job ran with, from the state each trace began in, the simulator makes every segment
/// allocation the allocator made (count and sizes, in order) and puts every block at the
/// address the allocator did.
#[test]
fn the_simulator_makes_the_real_allocators_decisions_on_every_snapshot() {
    let Some(files) = snapshots() else { return };
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("t.db");
    for file in &files {
        let import = &import(&db, file)["import"];
        let session = import["session"].as_i64().unwrap().to_string();
        let w = tracer_json(
            &db,
            &[
                "whatif",
                "--json",
                "--session",
                &session,
                "--conf",
                "expandable_segments:True",
            ],
        );
        let f = &w["fidelity"];
        assert_eq!(f["holds"], true, "{}: {f:#}", file.display());
        assert_eq!(
            f["placements_matched"],
            f["placements"],
            "{}: {f:#}",
            file.display()
        );
        assert!(f["placements"].as_u64().unwrap() > 900, "{f:#}");
        assert_eq!(w["seeded_blocks"], import["blocks_before_trace"], "{w:#}");
        // Every segment the trace made; none before the trace (those are the seed).
        let made = scalar(
            &db,
            &format!("SELECT count(*) FROM events WHERE session_id = {session} AND op = 'cudaMalloc' AND ret = 0"),
        );
        let before = import["segments_before_trace"].as_i64().unwrap();
        assert_eq!(
            f["device_allocs_recorded"].as_i64().unwrap(),
            made - before,
            "{f:#}"
        );
        // Two rows: the settings as run, then expandable segments; each needs at most what it
        // reserved at its peak.
        let rows = w["rows"].as_array().unwrap();
        assert_eq!(rows.len(), 2);
        for r in rows {
            assert!(
                r["least_memory"].as_u64().unwrap()
                    <= r["peak_reserved"].as_u64().unwrap() + (2 << 20),
                "{r:#}"
            );
        }
    }
}

/// diff between two runs of the same job (the cs336 full training step at context 128 and at
/// 256): the call sites whose peak held bytes changed most come first, and the attention
/// scores' softmax, quadratic in the context, holds four times the bytes at twice the context.
#[test]
fn diff_names_the_call_sites_that_grew_between_two_runs() {
    let Some(files) = snapshots() else { return };
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("t.db");
    let session = |name: &str| {
        let file = files
            .iter()
            .find(|f| f.to_string_lossy().contains(name))
            .unwrap();
        import(&db, file)["import"]["session"]
            .as_i64()
            .unwrap()
            .to_string()
    };
    let (a, b) = (session("ctx128"), session("ctx256"));
    let d = tracer_json(&db, &["diff", &a, &b, "--json"]);
    let sites = d["sites"].as_array().unwrap();
    assert!(!sites.is_empty(), "{d:#}");
    let change = |s: &Value| s["a"].as_i64().unwrap().abs_diff(s["b"].as_i64().unwrap());
    assert!(
        sites.windows(2).all(|w| change(&w[0]) >= change(&w[1])),
        "{d:#}"
    );
    let softmax: Vec<&Value> = sites
        .iter()
        .filter(|s| s["site"].as_str().unwrap().contains("(softmax)"))
        .collect();
    assert!(!softmax.is_empty(), "{d:#}");
    for s in softmax {
        assert_eq!(
            s["b"].as_u64().unwrap(),
            4 * s["a"].as_u64().unwrap(),
            "{s}"
        );
    }
    // The peaks are at least what the layout holds at the end.
    for (run, id) in [(&d["a"], &a), (&d["b"], &b)] {
        let layout = tracer_json(&db, &["layout", "--json", "--session", id]);
        let reserved: u64 = layout[0]["devices"]
            .as_array()
            .unwrap()
            .iter()
            .map(|d| d["total"]["reserved"].as_u64().unwrap())
            .sum();
        assert!(
            run["peak_reserved"].as_u64().unwrap() >= reserved,
            "{run:#} vs {reserved}"
        );
        assert_eq!(run["conf"], "");
    }
}

/// whatif and diff over what they cannot replay exit 2 naming the session and what would do.
#[test]
fn whatif_and_diff_refuse_sessions_without_allocator_requests() {
    let dir = tempfile::tempdir().unwrap();
    let (db, log) = (dir.path().join("t.db"), dir.path().join("calls.log"));
    // Two CUDA calls, no allocator probe (the simulated runtime's log format).
    std::fs::write(
        &log,
        "1795000000000000000 1000 7 7 cudaMalloc 0 0 2097152 140000000000000 - -\n\
         1795000000000100000 1000 7 7 cudaFree 0 0 - 140000000000000 - -\n",
    )
    .unwrap();
    let imported = tracer_json(&db, &["import", "--json", log.to_str().unwrap()]);
    let session = imported["session"].as_i64().unwrap().to_string();
    let run = |args: &[&str]| {
        std::process::Command::new(TRACER)
            .args(args)
            .arg("--db")
            .arg(&db)
            .output()
            .unwrap()
    };
    let out = run(&["whatif", "--session", &session]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.contains(&format!("session {session} holds no pytorch:malloc")),
        "{err}"
    );
    assert!(err.contains("import a memory snapshot"), "{err}");
    let out = run(&["whatif", "--session", "99"]);
    assert_eq!(
        out.status.code(),
        Some(2),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = run(&["diff", &session, "99"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("99"), "{err}");
    // Requests whose placements no allocator made (no segment recorded): imported whole, and
    // whatif says the simulator does not reproduce them before any figure.
    let probes = dir.path().join("probes.log");
    std::fs::write(
        &probes,
        "1795000000000000000 0 8 8 pytorch:malloc 0 0 7821312 140000000000000 0 -\n\
         1795000000000100000 0 8 8 pytorch:free 0 0 - 140000000000000 - -\n",
    )
    .unwrap();
    let imported = tracer_json(&db, &["import", "--json", probes.to_str().unwrap()]);
    assert_eq!(
        imported["calls"], 2,
        "block events count as calls: {imported}"
    );
    let session = imported["session"].as_i64().unwrap().to_string();
    let w = tracer_json(
        &db,
        &["whatif", "--json", "--session", &session, "--no-search"],
    );
    assert_eq!(w["fidelity"]["holds"], false, "{w:#}");
    assert_eq!(
        w["fidelity"]["first_device_divergence"],
        serde_json::json!([0, 0, 20 << 20]),
        "{w:#}"
    );
    let text = run(&["whatif", "--session", &session]);
    let text = String::from_utf8_lossy(&text.stdout);
    let verdict = text.find("Fidelity NOT met").expect(&text);
    assert!(verdict < text.find("settings").unwrap(), "{text}");
}

#[test]
fn a_file_that_is_not_a_snapshot_exits_2_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    let cases: [(&str, &[u8], &str); 5] = [
        // gzip's magic, then no deflate stream: a snapshot.pickle.gz cut or not gzip at all.
        (
            "broken.pickle.gz",
            b"\x1f\x8b\x08\x00garbage that is no deflate stream",
            "cannot decompress",
        ),
        // pickle.dumps(collections.OrderedDict()): names a class.
        (
            "model.pt",
            b"\x80\x04\x95\"\x00\x00\x00\x00\x00\x00\x00\x8c\x0bcollections\x94\x8c\x0bOrderedDict\x94\x93\x94)R\x94.",
            "Python object",
        ),
        // pickle.dumps([1, 2]) cut short.
        (
            "cut.pickle",
            b"\x80\x04\x95\x09\x00\x00\x00\x00\x00\x00\x00]\x94(K\x01K",
            "cut short",
        ),
        // pickle.dumps([1, 2]): plain data, but no snapshot.
        (
            "list.pickle",
            b"\x80\x04\x95\x09\x00\x00\x00\x00\x00\x00\x00]\x94(K\x01K\x02e.",
            "not a dict",
        ),
        // pickle.dumps({'segments': []}): no trace.
        (
            "no_trace.pickle",
            b"\x80\x04\x95\x11\x00\x00\x00\x00\x00\x00\x00}\x94\x8c\x08segments\x94]\x94s.",
            "_record_memory_history",
        ),
    ];
    let db = dir.path().join("t.db");
    let import = |file: &std::path::Path| {
        std::process::Command::new(TRACER)
            .args(["import", "--snapshot"])
            .arg(file)
            .arg("--db")
            .arg(&db)
            .output()
            .unwrap()
    };
    for (name, bytes, why) in cases {
        let bad = dir.path().join(name);
        std::fs::write(&bad, bytes).unwrap();
        let out = import(&bad);
        assert_eq!(out.status.code(), Some(2), "{name}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(name) && err.contains(why), "{name}: {err}");
    }
    let out = import(&dir.path().join("missing.pickle"));
    assert_eq!(out.status.code(), Some(2));
    assert!(!db.exists(), "nothing stored for a bad file");
}

/// Runs `script` (Python writing a snapshot with its own pickle) with `path` as its argument.
fn write_with_python(script: &str, path: &std::path::Path) {
    let status = std::process::Command::new("python3")
        .args(["-c", script])
        .arg(path)
        .status()
        .unwrap();
    assert!(status.success());
}

/// Writes, with Python's own pickle, a snapshot of PyTorch's expandable segments from an empty
/// allocator: one reserved range whose 20 MiB pages are mapped as it grows (and one unmapped
/// when the cache is released), blocks split in it, then a request of 100 MiB the device
/// refuses with 10 MiB free. Its final state is what the allocator would report.
fn expandable_snapshot(path: &std::path::Path) {
    const SCRIPT: &str = r#"
import pickle, sys
MIB = 1 << 20
A = 0x7f0000000000
fr = [{'name': 'forward', 'filename': 'train.py', 'line': 42}]
def e(action, addr, size, t):
    return {'action': action, 'addr': addr, 'size': size, 'stream': 0, 'time_us': 1000 + t, 'frames': fr}
trace = [
    e('segment_map', A, 20 * MIB, 1),
    e('alloc', A, 8 * MIB, 2),
    e('alloc', A + 8 * MIB, 4 * MIB, 3),
    e('free_requested', A, 8 * MIB, 4),
    e('free_completed', A, 8 * MIB, 4),
    e('segment_map', A + 20 * MIB, 20 * MIB, 5),
    e('alloc', A + 12 * MIB, 20 * MIB, 6),
    e('segment_map', A + 40 * MIB, 20 * MIB, 7),
    e('segment_unmap', A + 40 * MIB, 20 * MIB, 8),
    # PyTorch's form: the device's free bytes as `device_free`, no address.
    {'action': 'oom', 'device_free': 10 * MIB, 'size': 100 * MIB, 'stream': 0, 'time_us': 1009, 'frames': fr},
]
# A free block keeps the request of its Block object's last tenant: the 8 MiB freed at A; the
# remainder at A + 32 MiB is the Block the pages were mapped as, never allocated.
blocks = [
    {'address': A, 'size': 8 * MIB, 'requested_size': 8 * MIB, 'state': 'inactive'},
    {'address': A + 8 * MIB, 'size': 4 * MIB, 'requested_size': 4 * MIB, 'state': 'active_allocated'},
    {'address': A + 12 * MIB, 'size': 20 * MIB, 'requested_size': 20 * MIB, 'state': 'active_allocated'},
    {'address': A + 32 * MIB, 'size': 8 * MIB, 'requested_size': 0, 'state': 'inactive'},
]
seg = {'device': 0, 'address': A, 'total_size': 40 * MIB, 'allocated_size': 24 * MIB, 'active_size': 24 * MIB,
       'requested_size': 24 * MIB, 'stream': 0, 'segment_type': 'large', 'segment_pool_id': (0, 0),
       'is_expandable': True, 'frames': [], 'blocks': blocks}
settings = {'PYTORCH_CUDA_ALLOC_CONF': 'expandable_segments:True', 'max_split_size': -1,
            'garbage_collection_threshold': 0.0, 'expandable_segments': True}
pickle.dump({'segments': [seg], 'device_traces': [trace], 'allocator_settings': settings}, open(sys.argv[1], 'wb'))
"#;
    write_with_python(SCRIPT, path);
}

#[test]
fn an_expandable_segments_oom_is_capacity_and_the_allocator_is_no_bypass() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("expandable.pickle");
    expandable_snapshot(&file);
    let db = dir.path().join("t.db");
    let r = import(&db, &file);
    assert_eq!(r["check"]["first_difference"], Value::Null, "{r:#}");
    assert_eq!(r["check"]["blocks_equal"], 4, "{r:#}");
    assert_eq!(r["import"]["alloc_conf"], "expandable_segments:True");
    // From an empty allocator: nothing before the trace, nothing contradicts it.
    assert_eq!(r["import"]["segments_before_trace"], 0, "{r:#}");
    assert_eq!(r["import"]["blocks_before_trace"], 0, "{r:#}");
    assert_eq!(r["import"]["inconsistent_entries"], 0, "{r:#}");
    let report = tracer_json(&db, &["explain", "--json"]);
    let rules = rule_names(&report);
    assert!(!rules.contains(&"driver_bypass"), "{rules:?}");
    assert!(!rules.contains(&"churn"), "{rules:?}");
    // 16 MiB free in the cache could not have served PyTorch's 100 MiB.
    let oom = report["chains"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["rule"] == "oom")
        .unwrap_or_else(|| panic!("an OOM chain: {rules:?}"));
    let effect = oom["effect"].as_str().unwrap();
    assert!(effect.contains("Tried to allocate 100.00 MiB"), "{effect}");
    // The entry's device free bytes, from PyTorch's form (`device_free`), in its message.
    let evidence = oom["evidence"].as_str().unwrap();
    assert!(evidence.contains("GPU 0 has 10.00 MiB free"), "{evidence}");
    // Exported back, it is the same snapshot: the expandable segment, its blocks, every entry
    // (the mappings, and the oom with its request and free bytes).
    let out = dir.path().join("exported.pickle");
    export_snapshot(&db, &out, &[]);
    let parts = assert_snapshots_equal(&file, &out);
    assert_eq!(parts["entries"]["compared"], 11, "{parts:#}");
    // 100 MiB asked, 10 MiB free by the oom entry, 16 MiB split: capacity.
    assert!(effect.contains("short by 90.00 MiB"), "{effect}");
    assert!(effect.contains("capacity: it does not fit"), "{effect}");
}

/// Every real snapshot imported, then exported as PyTorch's memory snapshot: its segments
/// (every field), blocks, the requested bytes of its live blocks and of its free ones (the last
/// tenant's of each Block object, followed through splits and merges) and its trace entries
/// (action, address, size, stream, time, an out-of-memory's free bytes) equal the original's,
/// and so do the Python frames of every entry; a file without times gets none.
#[test]
fn every_real_snapshot_exports_back_to_itself() {
    let Some(files) = snapshots() else { return };
    let dir = tempfile::tempdir().unwrap();
    for (i, file) in files.iter().enumerate() {
        let db = dir.path().join(format!("{i}.db"));
        let r = import(&db, file);
        assert_eq!(r["import"]["unusable_entries"], 0, "{r:#}");
        let out = dir.path().join(format!("{i}.pickle"));
        let stderr = export_snapshot(&db, &out, &[]);
        assert!(
            stderr.contains("entries of the state before an imported trace began"),
            "{stderr}"
        );
        // Every free block at the end was freed inside the trace: its tenant was seen.
        assert!(!stderr.contains("inactive blocks"), "{stderr}");
        let parts = assert_snapshots_equal(file, &out);
        assert!(
            parts["entries"]["compared"].as_u64().unwrap() > 1000,
            "{parts:#}"
        );
        assert!(
            parts["inactive_requested"]["compared"].as_u64().unwrap() >= 4,
            "{parts:#}"
        );
        // PyTorch's own tool (the real wheel's _memory_viz.py, run as a script) prints the
        // same summary and trace for both.
        for action in ["stats", "trace"] {
            assert!(
                memory_viz("2.15.0", action, file) == memory_viz("2.15.0", action, &out),
                "{}: _memory_viz.py {action} differs",
                file.display()
            );
        }
    }
}

/// Snapshots dumped at real OOMs and mid-run on an H200 (PyTorch 2.11), gzip'd as they are kept:
/// ../shared's GPT-2 job with expandable segments whose ring wrapped (the trace begins with 303
/// blocks live, in two reservations, one of them mapped in two stretches), and the GPU check's
/// recorded cases (CUDA graphs' private pools, torch.compile, a MemPool, ring-wrapped OOMs of
/// both allocators). Imported as they are, every segment and block is rebuilt as PyTorch held
/// it, nothing contradicts the trace, and a block from before it keeps the size it was split
/// to.
#[test]
fn every_gzipped_snapshot_from_a_real_gpu_rebuilds_exactly() {
    let mut files = pickles_in(&workspace().join("tests/data/gpu-h200/cases"), true);
    assert_eq!(files.len(), 13, "{files:?}");
    files.extend(h200_gpt2_snapshot());
    let dir = tempfile::tempdir().unwrap();
    let (mut before, mut pooled) = (0, 0);
    for (i, file) in files.iter().enumerate() {
        let db = dir.path().join(format!("{i}.db"));
        let r = import(&db, file);
        let check = &r["check"];
        assert_eq!(
            check["first_difference"],
            Value::Null,
            "{}: {r:#}",
            file.display()
        );
        assert_eq!(
            check["segments"],
            check["segments_equal"],
            "{}: {r:#}",
            file.display()
        );
        assert_eq!(
            check["blocks"],
            check["blocks_equal"],
            "{}: {r:#}",
            file.display()
        );
        assert_eq!(
            r["import"]["inconsistent_entries"],
            0,
            "{}: {r:#}",
            file.display()
        );
        before += r["import"]["blocks_before_trace"].as_u64().unwrap();
        // Exported back: every segment (with its private pool's `segment_pool_id`), block and
        // live block's request as PyTorch held them.
        let out = dir.path().join(format!("{i}.pickle"));
        export_snapshot(&db, &out, &[]);
        let parts =
            assert_snapshots_equal_in(file, &out, &["segments", "blocks", "active_requested"]);
        pooled += parts["private_pool_segments"].as_u64().unwrap();
    }
    // The ring-wrapped ones began mid-run.
    assert!(before > 1000, "{before}");
    // Graphs' and MemPools' segments: the captures, torch.compile's trees, the engine's.
    assert!(pooled >= 40, "{pooled}");
}

/// whatif on a snapshot dumped in PyTorch's out-of-memory observer (the GPU check's ring-wrapped
/// OOM on the H200): the device's capacity for the allocator is what it held at the failure and
/// the device's free bytes the `oom` entry records, not the refused request's upper bound; the
/// "as run" row is the replay the gate checks and fails at the recorded request; no setting
/// whose replay still fails is offered as a fix.
#[test]
fn whatif_takes_the_capacity_from_the_oom_entry_and_offers_no_disproved_fix() {
    let file =
        workspace().join("tests/data/gpu-h200/cases/ring-oom-default-snapshot-at-oom.pickle.gz");
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("t.db");
    import(&db, &file);
    let w = tracer_json(&db, &["whatif", "--json", "--no-search"]);
    // At the instant: 8,959,033,344 B reserved (the snapshot's segments), 60,358,656 B free
    // (its oom entry's `device_free`, to the byte).
    assert_eq!(w["capacity"], 8_959_033_344u64 + 60_358_656, "{w:#}");
    assert!(
        w["capacity_source"]
            .as_str()
            .unwrap()
            .contains("PyTorch's message"),
        "{w:#}"
    );
    let f = &w["fidelity"];
    assert_eq!(f["holds"], true, "{f:#}");
    let refused = f["refused_recorded"][0].as_u64().unwrap();
    assert_eq!(w["rows"][0]["recorded_settings"], true);
    assert_eq!(w["rows"][0]["oom_request"], refused, "{w:#}");
    // Every setting tried still fails at that request: none is a fix.
    let report = tracer_json(&db, &["explain", "--json"]);
    for c in report["chains"].as_array().unwrap() {
        for fix in c["fix"].as_array().unwrap() {
            let text = fix.as_str().unwrap();
            assert!(
                !(text.contains("[simulated")
                    && text.contains("an OOM at request")
                    && !text.contains("as run:")),
                "{text}"
            );
            if text.contains("[simulated") {
                assert!(
                    text.contains(": no OOM,"),
                    "a fix whose replay fails: {text}"
                );
            }
        }
    }
}

/// A replay that does not reproduce the run (../shared's GPT-2 snapshot with expandable
/// segments, begun mid-run): the gate says so and no fix is called simulated.
#[test]
fn a_replay_that_does_not_reproduce_the_run_cites_no_simulated_fix() {
    let Some(file) = h200_gpt2_snapshot() else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("t.db");
    import(&db, &file);
    let w = tracer_json(&db, &["whatif", "--json", "--no-search"]);
    assert_eq!(w["fidelity"]["holds"], false, "{:#}", w["fidelity"]);
    // The recorded setting is never added to itself.
    for r in w["rows"].as_array().unwrap() {
        let conf = r["conf"].as_str().unwrap();
        assert_eq!(
            conf.matches("expandable_segments:True").count(),
            1,
            "{conf}"
        );
    }
    let report = tracer_json(&db, &["explain", "--json"]);
    let fixes = report["chains"].to_string();
    assert!(!fixes.contains("[simulated"), "{fixes}");
}

/// ../shared's H200 GPT-2 snapshot (expandable segments, its ring wrapped) imported and exported
/// back: its segments, blocks, live blocks' requests and every entry's Python frames as PyTorch
/// wrote them; of its 30,000 entries all but PyTorch's own `snapshot` marker (not kept) come
/// back, the frees requested before the trace began left with the state before it.
#[test]
fn the_gzipped_h200_snapshot_exports_back() {
    let Some(file) = h200_gpt2_snapshot() else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("t.db");
    import(&db, &file);
    let out = dir.path().join("back.pickle");
    export_snapshot(&db, &out, &[]);
    let compared = Command::new("python3")
        .arg(workspace().join("tests/python/snapshot_compare.py"))
        .arg(&file)
        .arg(&out)
        .output()
        .unwrap();
    assert!(compared.status.success(), "{compared:?}");
    let parts: Value = serde_json::from_slice(&compared.stdout).unwrap();
    for part in [
        "segments",
        "blocks",
        "active_requested",
        "entry_frames_python",
    ] {
        assert_eq!(
            parts[part]["compared"], parts[part]["equal"],
            "{part}: {parts:#}"
        );
    }
    assert_eq!(
        parts["entry_frames_python"]["compared"], 29_999,
        "{parts:#}"
    );
    let entries = &parts["entries"];
    assert!(entries["equal"].as_u64().unwrap() >= 29_996, "{parts:#}");
}

/// Writes, with Python's own pickle, a snapshot of a CUDA graph's private pool beside the default
/// pool: a 20 MiB default segment full, a 32 MiB segment captured into pool (1, 0) whose second
/// half was freed inside the capture, then an eager 24 MiB request the device refuses with 10
/// MiB free. The graph pool's 16 MiB free block may not serve it.
fn graph_pool_snapshot(path: &std::path::Path) {
    const SCRIPT: &str = r#"
import pickle, sys
MIB = 1 << 20
A, B = 0x7f0000000000, 0x7f0002000000
fr = [{'name': 'forward', 'filename': 'serve.py', 'line': 7}]
def e(action, addr, size, t):
    return {'action': action, 'addr': addr, 'size': size, 'stream': 0, 'time_us': 1000 + t, 'frames': fr}
trace = [
    e('segment_alloc', A, 20 * MIB, 1),
    e('alloc', A, 20 * MIB, 2),
    e('segment_alloc', B, 32 * MIB, 3),
    e('alloc', B, 16 * MIB, 4),
    e('alloc', B + 16 * MIB, 16 * MIB, 5),
    e('free_requested', B + 16 * MIB, 16 * MIB, 6),
    e('free_completed', B + 16 * MIB, 16 * MIB, 6),
    {'action': 'oom', 'device_free': 10 * MIB, 'size': 24 * MIB, 'stream': 0, 'time_us': 1009, 'frames': fr},
]
def seg(addr, size, allocated, pool, blocks):
    return {'device': 0, 'address': addr, 'total_size': size, 'allocated_size': allocated,
            'active_size': allocated, 'requested_size': allocated, 'stream': 0, 'segment_type': 'large',
            'segment_pool_id': pool, 'is_expandable': False, 'frames': [], 'blocks': blocks}
default = seg(A, 20 * MIB, 20 * MIB, (0, 0),
              [{'address': A, 'size': 20 * MIB, 'requested_size': 20 * MIB, 'state': 'active_allocated'}])
graph = seg(B, 32 * MIB, 16 * MIB, (1, 0),
            [{'address': B, 'size': 16 * MIB, 'requested_size': 16 * MIB, 'state': 'active_allocated'},
             {'address': B + 16 * MIB, 'size': 16 * MIB, 'requested_size': 16 * MIB, 'state': 'inactive'}])
settings = {'PYTORCH_CUDA_ALLOC_CONF': '', 'max_split_size': -1, 'garbage_collection_threshold': 0.0,
            'expandable_segments': False}
pickle.dump({'segments': [default, graph], 'device_traces': [trace], 'allocator_settings': settings},
            open(sys.argv[1], 'wb'))
"#;
    write_with_python(SCRIPT, path);
}

/// An OOM beside a CUDA graph's private pool: the pool's free block is the pool's, not the
/// cache's. The layout shows the pool apart, the OOM chain gives PyTorch's own figures ("with
/// 16.00 MiB allocated in private pools", 0 bytes reserved but unallocated) and says the pool
/// decided it (its 16 MiB free beyond the 14 MiB short, nothing split in the default pool, the
/// free block beside one the graph keeps), not fragmentation; the export writes the pool back.
#[test]
fn a_graph_pools_free_block_is_not_the_caches() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("graph.pickle");
    graph_pool_snapshot(&file);
    let db = dir.path().join("t.db");
    let r = import(&db, &file);
    assert_eq!(r["check"]["first_difference"], Value::Null, "{r:#}");
    let layout = tracer_json(&db, &["layout", "--json"]);
    let pools = &layout[0]["devices"][0]["private_pools"];
    assert_eq!(pools.as_array().unwrap().len(), 1, "{layout:#}");
    let p = &pools[0];
    assert_eq!(p["id"], serde_json::json!([1, 0]));
    assert_eq!(
        (&p["reserved"], &p["allocated"], &p["free"]),
        (
            &Value::from(32u64 << 20),
            &Value::from(16u64 << 20),
            &Value::from(16u64 << 20)
        ),
        "{p:#}"
    );
    let report = tracer_json(&db, &["explain", "--json"]);
    let oom = chain(&report, "oom");
    let effect = oom["effect"].as_str().unwrap();
    for said in [
        // PyTorch adds the private pools' free bytes to what it calls allocated: 36 + 16.
        "52.00 MiB is allocated by PyTorch, with 16.00 MiB allocated in private pools",
        "and 0 bytes is reserved by PyTorch but unallocated",
        "16.00 MiB free inside private pools",
        "short by 14.00 MiB",
        "private pools decided it: 16.00 MiB lay free inside",
        "only 0 bytes of it lay in pool segments holding no live block",
    ] {
        assert!(effect.contains(said), "{said} not in {effect}");
    }
    assert!(!effect.contains("fragmentation decided"), "{effect}");
    // No release is offered: a flush would return none of the pool's free bytes.
    let fixes = oom["fix"].to_string();
    assert!(!fixes.contains("reset()"), "{fixes}");
    let h = &report["holders"][0];
    assert_eq!(h["arithmetic"]["split"], 0, "{h:#}");
    assert_eq!(h["arithmetic"]["private"], 16u64 << 20, "{h:#}");
    let out = dir.path().join("exported.pickle");
    export_snapshot(&db, &out, &[]);
    let parts = assert_snapshots_equal(&file, &out);
    assert_eq!(parts["private_pool_segments"], 1, "{parts:#}");
}

/// whatif's replay of the GPU check's snapshots with private pools (six captures into one shared
/// pool and make_graphed_callables, a MemPool beside a use_on_oom pool, an engine's captures,
/// an OOM during capture): each request routed to the pool its block lay in, the replay as run
/// holds (every block placed where PyTorch placed it) and its peak reserved is PyTorch's own.
#[test]
fn whatif_replays_private_pools_as_pytorch_ran_them() {
    let data = workspace().join("tests/data/gpu-h200/cases");
    let dir = tempfile::tempdir().unwrap();
    for (snapshot, case) in [
        ("graphs-snapshot-captured", "graphs"),
        ("mempool-snapshot-pools", "mempool"),
        ("engine-snapshot", "engine"),
        ("engine-oom-snapshot", "engine-oom"),
    ] {
        let db = dir.path().join(format!("{snapshot}.db"));
        import(&db, &data.join(format!("{snapshot}.pickle.gz")));
        let w = tracer_json(&db, &["whatif", "--json", "--no-search"]);
        assert_eq!(
            w["fidelity"]["holds"], true,
            "{snapshot}: {:#}",
            w["fidelity"]
        );
        let stats: Value = serde_json::from_slice(
            &std::fs::read(data.join(format!("{case}-stats.json"))).unwrap(),
        )
        .unwrap();
        let peak = stats["phases"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| p["peak_reserved"].as_u64().unwrap())
            .max();
        assert_eq!(
            w["rows"][0]["peak_reserved"].as_u64(),
            peak,
            "{snapshot}: {w:#}"
        );
    }
}
