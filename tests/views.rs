//! Where people look, end to end on a recorded incident (root): the HTML report opened in
//! headless Chromium, and `tracer mcp` driven by a real MCP client; both checked against
//! `tracer explain --json`, `tracer query`, `tracer layout` and the workload's own account.

use std::{
    path::{Path, PathBuf},
    process::Command,
};

use crate::common::*;
use serde_json::Value;

fn python(script: &str, args: &[&std::ffi::OsStr]) -> Value {
    let path = workspace().join("tests/python").join(script);
    let mut all = vec![path.as_os_str()];
    all.extend_from_slice(args);
    python_json(&all)
}

fn number(text: &str) -> i64 {
    text.replace(',', "")
        .parse()
        .unwrap_or_else(|_| panic!("{text:?}"))
}

#[test]
fn the_html_report_opens_offline_in_chromium_and_shows_the_sessions_own_figures() {
    let Some(fx) = Fixture::scoped() else { return };
    let result = record_incident(&fx, &["--stack"], || {});
    let r = &result["result"];
    let dir = fx.db.parent().unwrap();
    let html_path = dir.join("report.html");
    let out = Command::new(TRACER)
        .args(["report", "--skip-frames", "caching_allocator.py", "-o"])
        .arg(&html_path)
        .arg("--db")
        .arg(&fx.db)
        .output()
        .unwrap();
    assert_ok(&out);
    let html = std::fs::read_to_string(&html_path).unwrap();
    // Self-contained: no reference to anything outside the file, every request forbidden.
    for outside in ["src=\"http", "href=\"http", "<link ", "@import", "src=\"//"] {
        assert!(
            !html.contains(outside),
            "the page refers outside: {outside}"
        );
    }
    assert!(html.contains("default-src 'none'"));
    let data = embedded_data(&html);
    let explain = tracer_json(
        &fx.db,
        &["explain", "--json", "--skip-frames", "caching_allocator.py"],
    );
    assert_eq!(data["explain"], explain, "the embedded report is explain's");

    let screenshot = std::env::var_os("TRACER_REPORT_SCREENSHOT")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| dir.join("report.png"));
    let profile = tempfile::tempdir().unwrap();
    let seen = python(
        "report_browser.py",
        &[
            html_path.as_os_str(),
            screenshot.as_os_str(),
            profile.path().as_os_str(),
        ],
    );
    eprintln!(
        "report: {} bytes, loaded and drawn in {:.2} s",
        html.len(),
        seen["load_seconds"].as_f64().unwrap()
    );
    // Loads with no console message and no request but the file itself.
    assert_eq!(seen["console"], serde_json::json!([]), "{seen:#}");
    assert_eq!(seen["requests"], serde_json::json!([seen["url"]]));
    let lines = data["lines"].as_array().unwrap().len();
    assert!(lines >= 1);
    assert_eq!(
        seen["ready"],
        lines * 3,
        "three charts per process and device"
    );
    assert_eq!(seen["canvases"], lines * 3);
    assert_eq!(seen["data"], data, "the browser read the same data");
    let png = std::fs::read(&screenshot).unwrap();
    assert!(png.len() > 10_000 && png.starts_with(b"\x89PNG"));

    // The visible text says what explain --json says.
    let chains = explain["chains"].as_array().unwrap();
    assert!(!chains.is_empty());
    let titles: Vec<String> = chains
        .iter()
        .map(|c| {
            format!(
                "[{}] {} (pid {}, {})",
                c["severity"].as_str().unwrap(),
                c["title"].as_str().unwrap(),
                c["pid"],
                c["rule"].as_str().unwrap()
            )
        })
        .collect();
    assert_eq!(seen["chain_titles"], serde_json::json!(titles));
    // The map's moment links its export as PyTorch's memory snapshot: the command shown runs.
    let commands = seen["export_commands"].as_array().unwrap();
    assert!(!commands.is_empty(), "{seen:#}");
    let shown = commands[0].as_str().unwrap();
    assert!(shown.contains("--at oom"), "{shown}");
    let words: Vec<&str> = shown.split_whitespace().collect();
    assert_eq!(words[0], "tracer");
    let exported = Command::new(TRACER)
        .args(&words[1..])
        .arg("--db")
        .arg(&fx.db)
        .current_dir(dir)
        .output()
        .unwrap();
    assert_ok(&exported);
    let file = dir.join(words[words.len() - 1]);
    assert!(std::fs::metadata(&file).unwrap().len() > 1000);
    // What would have avoided it: whatif's rows, as tracer whatif computes them.
    let whatif = &data["whatif"];
    assert_eq!(whatif["fidelity"]["holds"], true, "{whatif:#}");
    let rows = seen["whatif_rows"].as_array().unwrap();
    assert_eq!(rows.len(), whatif["rows"].as_array().unwrap().len());
    assert_eq!(rows.len(), 12, "the settings as run and eleven others");
    assert!(rows[0][0].as_str().unwrap().starts_with("(as run)"));
    assert!(
        rows[0][1].as_str().unwrap().starts_with("request "),
        "{rows:?}"
    );
    // Who held the GPU at the OOM: a table per out-of-memory, its rows from explain's figures.
    let holders = explain["holders"].as_array().unwrap();
    assert_eq!(holders.len(), 1, "{holders:?}");
    let rows = seen["holders"][0].as_array().unwrap();
    let row = |label: &str| {
        rows.iter()
            .find(|r| r[0].as_str().unwrap().starts_with(label))
            .unwrap_or_else(|| panic!("no {label} in {rows:?}"))[1]
            .clone()
    };
    // The page's bytes(): 1024-based, 2, 1 or 0 decimals as the value grows.
    let said = |n: &Value| {
        let (mut v, mut unit) = (n.as_u64().unwrap() as f64, 0);
        let units = ["B", "KiB", "MiB", "GiB", "TiB"];
        while v >= 1024.0 && unit < units.len() - 1 {
            v /= 1024.0;
            unit += 1;
        }
        let decimals = if v >= 100.0 {
            0
        } else if v >= 10.0 {
            1
        } else {
            2
        };
        match unit {
            0 => format!("{v} B"),
            _ => format!("{v:.decimals$} {}", units[unit]),
        }
    };
    assert_eq!(
        row("this process: allocated by PyTorch"),
        said(&holders[0]["allocated"])
    );
    assert_eq!(
        row("this process, all its traced calls held"),
        said(&holders[0]["held"])
    );
    assert!(seen["holders_said"][0]
        .as_str()
        .unwrap()
        .starts_with("The memory the request needed was "));
    for p in explain["processes"].as_array().unwrap() {
        let rows = seen["ops"][p["pid"].to_string()].as_array().unwrap();
        let ops = p["ops"].as_array().unwrap();
        assert_eq!(rows.len(), ops.len());
        for (row, op) in rows.iter().zip(ops) {
            assert_eq!(row[0], op["op"]);
            assert_eq!(
                number(row[1].as_str().unwrap()),
                op["calls"].as_i64().unwrap()
            );
            assert_eq!(
                number(row[2].as_str().unwrap()),
                op["errors"].as_i64().unwrap()
            );
            assert_eq!(
                number(row[6].as_str().unwrap()),
                op["bytes"].as_i64().unwrap()
            );
        }
    }
    let summary = seen["summary"].as_str().unwrap();
    let in_window = explain["events_in_window"].as_i64().unwrap();
    assert!(
        summary.contains(&format!(
            "{} calls in it",
            in_window
                .to_string()
                .as_bytes()
                .rchunks(3)
                .rev()
                .map(|c| std::str::from_utf8(c).unwrap())
                .collect::<Vec<_>>()
                .join(",")
        )),
        "{summary}"
    );
    let session = &query(&fx.db, "SELECT * FROM sessions ORDER BY id DESC LIMIT 1")[0];
    let losses = seen["losses"].as_object().unwrap();
    assert_eq!(losses.len(), 11);
    for (name, shown) in losses {
        assert_eq!(
            number(shown.as_str().unwrap()),
            session[name].as_i64().unwrap(),
            "{name}"
        );
    }

    // The map opens at the OOM and equals `tracer layout --at oom`; the end's equals the
    // workload allocator's own account.
    assert!(
        seen["snapshot_label"]
            .as_str()
            .unwrap()
            .starts_with("at the OOM"),
        "{}",
        seen["snapshot_label"]
    );
    assert!(seen["segments"].as_i64().unwrap() > 0 && seen["runs"].as_i64().unwrap() > 0);
    // Hovering a block names the Python line that allocated it (a --stack session; the
    // workload's own allocator stands for PyTorch's and is skipped as PyTorch's frames are).
    let sites = data["sites"].as_object().unwrap();
    assert!(
        sites
            .values()
            .any(|s| s.as_str().unwrap().contains("train.py")),
        "{sites:?}"
    );
    let snapshots = data["snapshots"].as_array().unwrap();
    let at = |label: &str| {
        snapshots
            .iter()
            .find(|s| s["label"] == label)
            .unwrap_or_else(|| panic!("no {label} map"))
    };
    let oom = tracer_json(&fx.db, &["layout", "--at", "oom", "--json"]);
    let oom_map = &at("oom")["processes"][0];
    assert_eq!(oom_map["devices"], oom[0]["devices"]);
    assert_eq!(oom_map["segments"], oom[0]["segments"]);
    let end = &at("end")["processes"][0]["devices"][0]["total"];
    assert_eq!(end["allocated"], r["allocated"]);
    assert_eq!(end["reserved"], r["reserved"]);
    assert_eq!(end["largest_free"], r["largest_free_block"]);
    // The marks: the OOM, and every failed allocation and retry the session recorded.
    let markers = data["markers"].as_array().unwrap();
    let kinds = |k: &str| markers.iter().filter(|m| m["kind"] == k).count() as i64;
    assert_eq!(kinds("oom"), r["num_ooms"].as_i64().unwrap());
    assert_eq!(kinds("retry"), r["num_alloc_retries"].as_i64().unwrap());
    assert_eq!(
        kinds("failed"),
        scalar(
            &fx.db,
            "SELECT count(*) FROM events WHERE op = 'cudaMalloc' AND ret != 0"
        )
    );
    assert!(kinds("warning") >= 1);
    // The charts' highest reserved is the session's peak (a point keeps its interval's highest).
    let peak = explain["devices"][0]["peak_reserved"].as_i64().unwrap();
    let reserved_max = data["lines"][0]["reserved"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(Value::as_i64)
        .max()
        .unwrap();
    assert_eq!(reserved_max, peak);
}

/// `tracer mcp --export-dir DIR`: export_snapshot writes new files in DIR only, named by
/// numbers, never through a link planted under its name (the next name is taken), private to
/// the user, holding the layout at the OOM; a directory given as a link is refused at start.
#[test]
fn an_mcp_client_exports_a_memory_snapshot_only_into_its_directory() {
    use std::os::unix::fs::PermissionsExt as _;
    let Some(fx) = Fixture::scoped() else { return };
    record_incident(&fx, &[], || {});
    let dir = tempfile::tempdir().unwrap();
    let layout = tracer_json(&fx.db, &["layout", "--at", "oom", "--json"]);
    let (session, pid) = (
        scalar(&fx.db, "SELECT max(id) FROM sessions"),
        layout[0]["pid"].as_i64().unwrap(),
    );
    let target = dir.path().join("elsewhere");
    std::fs::write(&target, "not to be touched").unwrap();
    let planted = format!("tracer-s{session}-p{pid}-oom.pickle");
    std::os::unix::fs::symlink(&target, dir.path().join(&planted)).unwrap();
    let tracer = Path::new(TRACER).as_os_str().to_owned();
    let seen = python(
        "mcp_client.py",
        &[
            &tracer,
            fx.db.as_os_str(),
            "export".as_ref(),
            dir.path().as_os_str(),
        ],
    );
    assert_eq!(
        std::fs::read_to_string(&target).unwrap(),
        "not to be touched"
    );
    let first = &seen["first"]["structured"];
    let path = PathBuf::from(first["path"].as_str().unwrap());
    assert_eq!(
        path,
        dir.path()
            .join(format!("tracer-s{session}-p{pid}-oom-2.pickle"))
    );
    assert_eq!(
        seen["second"]["structured"]["path"],
        dir.path()
            .join(format!("tracer-s{session}-p{pid}-oom-3.pickle"))
            .to_str()
            .unwrap()
    );
    assert_eq!(
        std::fs::metadata(&path).unwrap().permissions().mode() & 0o777,
        0o600
    );
    let figures = snapshot_figures(&path);
    let total = &layout[0]["devices"][0]["total"];
    for key in ["allocated", "reserved", "free_blocks", "largest_free"] {
        assert_eq!(figures[key], total[key], "{key}: {figures:#}");
    }
    assert_eq!(first["entries"], figures["entries"]);
    assert_eq!(seen["bad"]["is_error"], true, "{seen:#}");
    assert!(seen["bad"]["text"]
        .as_str()
        .unwrap()
        .contains("max_entries 0"));
    // Only those files, in that directory.
    let mut names: Vec<String> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    names.sort();
    assert_eq!(names.len(), 4, "{names:?}");
    // A directory given as a link is refused before serving.
    let link = dir.path().join("link");
    std::os::unix::fs::symlink(dir.path(), &link).unwrap();
    let refused = Command::new(TRACER)
        .args(["mcp", "--db"])
        .arg(&fx.db)
        .arg("--export-dir")
        .arg(&link)
        .stdin(std::process::Stdio::null())
        .output()
        .unwrap();
    assert_eq!(refused.status.code(), Some(2), "{refused:?}");
    assert!(String::from_utf8_lossy(&refused.stderr).contains("export directory"));
}

#[test]
fn an_mcp_client_investigates_a_trace_read_only_and_within_limits() {
    let Some(fx) = Fixture::scoped() else { return };
    let tracer = Path::new(TRACER).as_os_str().to_owned();
    let db = fx.db.as_os_str().to_owned();
    // While the trace still runs: the server reads what it has committed.
    let mut live = Value::Null;
    record_incident(&fx, &["--stack"], || {
        live = python("mcp_client.py", &[&tracer, &db, "live".as_ref()]);
    });
    assert_eq!(live["server"], "tracer");
    assert_eq!(
        live["sessions"]["structured"]["sessions"][0]["status"],
        "running"
    );
    assert!(live["count"]["structured"]["rows"][0][0].as_i64().unwrap() > 0);

    let sessions_before = scalar(&fx.db, "SELECT count(*) FROM sessions");
    // A 3 s limit keeps the runaway query's case short.
    let seen = python(
        "mcp_client.py",
        &[&tracer, &db, "full".as_ref(), "3s".as_ref()],
    );
    let tools = seen["tools"].as_object().unwrap();
    let mut names: Vec<&str> = tools.keys().map(String::as_str).collect();
    names.sort_unstable();
    assert_eq!(
        names,
        [
            "explain",
            "export_snapshot",
            "layout",
            "op_stats",
            "query",
            "sessions",
            "stacks",
            "whatif"
        ]
    );
    // Without --export-dir the server writes nothing.
    assert_eq!(seen["export_off"]["is_error"], true);
    assert!(seen["export_off"]["text"]
        .as_str()
        .unwrap()
        .contains("--export-dir"));
    assert!(tools.values().all(|t| t["output_schema"] == true));
    assert!(tools["query"]["description"]
        .as_str()
        .unwrap()
        .contains("events("));
    assert_eq!(seen["prompts"], serde_json::json!(["investigate"]));
    assert!(seen["prompt"].as_str().unwrap().contains("`explain`"));
    for tool in [
        "sessions",
        "explain",
        "op_stats",
        "stacks",
        "layout_oom",
        "whatif",
        "query",
    ] {
        assert_eq!(
            seen[tool]["is_error"], false,
            "{tool}: {}",
            seen[tool]["text"]
        );
    }

    // sessions: the session's own row.
    let row = &query(&fx.db, "SELECT * FROM sessions ORDER BY id DESC LIMIT 1")[0];
    let s = &seen["sessions"]["structured"]["sessions"][0];
    assert_eq!(s["id"], row["id"]);
    assert_eq!(s["status"], row["status"]);
    assert_eq!(s["stored"], row["events_stored"]);
    assert_eq!(s["lost"], 0);

    // explain: the chains and the per-process tables of explain --json.
    let explain = tracer_json(&fx.db, &["explain", "--json"]);
    let e = &seen["explain"]["structured"];
    assert_eq!(e["s"], explain["session"]);
    assert_eq!(e["n"], explain["events_in_window"]);
    let chains = explain["chains"].as_array().unwrap();
    let got = e["ch"].as_array().unwrap();
    assert_eq!(got.len(), chains.len());
    for (g, c) in got.iter().zip(chains) {
        assert_eq!(g["r"], c["rule"]);
        assert_eq!(g["sev"], c["severity"]);
        assert_eq!(g["t"], c["title"]);
        assert_eq!(g["pid"], c["pid"]);
        assert_eq!(g["fix"], c["fix"]);
    }
    // Who held the GPU at each OOM, and each device's physical GPU and job.
    let holders = explain["holders"].as_array().unwrap();
    let who = e["who"].as_array().unwrap();
    assert_eq!(who.len(), holders.len());
    for (g, h) in who.iter().zip(holders) {
        assert_eq!(g["pid"], h["pid"]);
        assert_eq!(g["gpu"], h["gpu"]);
        assert_eq!(g["req"], h["requested"]);
        assert_eq!(g["alloc"], h["allocated"]);
        assert_eq!(g["held"], h["held"]);
        assert_eq!(g["verdict"], h["verdict"]);
    }
    for (g, d) in e["dev"]
        .as_array()
        .unwrap()
        .iter()
        .zip(explain["devices"].as_array().unwrap())
    {
        assert_eq!((&g["gpu"], &g["job"]), (&d["gpu"], &d["job"]));
    }
    for (g, p) in e["pr"]
        .as_array()
        .unwrap()
        .iter()
        .zip(explain["processes"].as_array().unwrap())
    {
        assert_eq!(g["pid"], p["pid"]);
        for (go, o) in g["ops"]
            .as_array()
            .unwrap()
            .iter()
            .zip(p["ops"].as_array().unwrap())
        {
            assert_eq!(go["op"], o["op"]);
            assert_eq!(go["n"], o["calls"]);
            assert_eq!(go["err"], o["errors"]);
            assert_eq!(go["p50_ns"], o["p50_ns"]);
            assert_eq!(go["p99_ns"], o["p99_ns"]);
            assert_eq!(go["b"], o["bytes"]);
        }
    }

    // whatif: tracer whatif's answer, compact.
    let w = tracer_json(
        &fx.db,
        &["whatif", "--json", "--conf", "expandable_segments:True"],
    );
    let m = &seen["whatif"]["structured"];
    assert_eq!(m["fid"]["ok"], w["fidelity"]["holds"], "{m:#}");
    assert_eq!(m["fid"]["placed"][1], w["fidelity"]["placements"]);
    assert_eq!(m["rows"].as_array().unwrap().len(), 2);
    for (g, r) in m["rows"]
        .as_array()
        .unwrap()
        .iter()
        .zip(w["rows"].as_array().unwrap())
    {
        assert_eq!(g["conf"], r["conf"]);
        assert_eq!(g["oom"], r["oom_request"]);
        assert_eq!(g["res"], r["peak_reserved"]);
        assert_eq!(g["least"], r["least_memory"]);
    }

    // op_stats: the same windows counted by SQL over the events view.
    let stats = &seen["op_stats"]["structured"];
    let t0 = stats["t0_ns"].as_i64().unwrap();
    let by_sql = query(
        &fx.db,
        &format!(
            "SELECT (ts_ns - {t0}) / 2000000000 AS w, count(*) AS n, sum(ret != 0) AS err,
                    max(duration_ns) AS mx, coalesce(sum(CASE WHEN ret = 0 THEN size END), 0) AS b
             FROM events WHERE session_id = {} AND op = 'cudaMalloc' GROUP BY w ORDER BY w",
            row["id"]
        ),
    );
    let rows = stats["rows"].as_array().unwrap();
    assert_eq!(rows.len(), by_sql.len());
    for (g, want) in rows.iter().zip(&by_sql) {
        assert_eq!(g["w"].as_f64().unwrap(), want["w"].as_f64().unwrap() * 2.0);
        assert_eq!(g["n"], want["n"]);
        assert_eq!(g["err"], want["err"]);
        assert_eq!(g["max_ns"], want["mx"]);
        assert_eq!(g["b"], want["b"]);
    }

    // op_stats pages: at most 300 rows of whole windows, then the rest from where the first
    // page stopped (no window split between the pages).
    let (p1, p2) = (
        &seen["op_stats_page1"]["structured"],
        &seen["op_stats_page2"]["structured"],
    );
    assert_eq!(p1["truncated"], true, "{p1}");
    let page1 = p1["rows"].as_array().unwrap().len();
    assert!(
        (290..=300).contains(&page1),
        "{page1} rows: whole windows, at most 300"
    );
    let next = p1["next_from_s"].as_f64().unwrap();
    let last_of_first = p1["rows"].as_array().unwrap().last().unwrap()["w"]
        .as_f64()
        .unwrap();
    let first_of_second = p2["rows"][0]["w"].as_f64().unwrap();
    assert!(
        last_of_first < next && (first_of_second - next).abs() < 1e-6,
        "{next} {last_of_first} {first_of_second}"
    );

    // stacks: tracer stacks' top call sites.
    let stacks = tracer_json(&fx.db, &["stacks", "--json", "--top", "5"]);
    let sites = seen["stacks"]["structured"]["sites"].as_array().unwrap();
    assert!(!sites.is_empty());
    for (g, want) in sites.iter().zip(stacks.as_array().unwrap()) {
        assert_eq!(g["id"], want["stack_id"]);
        assert_eq!(g["n"], want["calls"]);
        assert_eq!(g["py"], want["python"]);
    }

    // layout at the OOM: tracer layout's figures.
    let oom = tracer_json(&fx.db, &["layout", "--at", "oom", "--json"]);
    let l = &seen["layout_oom"]["structured"]["procs"][0];
    assert_eq!(l["pid"], oom[0]["pid"]);
    let (got, want) = (&l["devs"][0], &oom[0]["devices"][0]["total"]);
    for field in ["allocated", "reserved", "free_blocks", "largest_free"] {
        assert_eq!(got[field], want[field], "{field}");
    }
    assert_eq!(
        l["seg_count"].as_u64().unwrap() as usize,
        oom[0]["segments"].as_array().unwrap().len()
    );

    // query: tracer query's rows.
    let q = &seen["query"]["structured"];
    let want = query(
        &fx.db,
        "SELECT op, count(*) AS n FROM events GROUP BY op ORDER BY op",
    );
    assert_eq!(q["cols"], serde_json::json!(["op", "n"]));
    let rows = q["rows"].as_array().unwrap();
    assert_eq!(rows.len(), want.len());
    for (g, w) in rows.iter().zip(&want) {
        assert_eq!(g[0], w["op"]);
        assert_eq!(g[1], w["n"]);
    }

    // Refusals are tool errors, in words, within their limits; nothing was written.
    for (case, says) in [
        ("write", "read-only"),
        ("attach", "read-only"),
        ("write_after_read", "refused"),
        ("two_statements", "one statement"),
        ("pragma_write", "read-only"),
        ("runaway", "limit"),
    ] {
        let r = &seen["refused"][case];
        assert_eq!(r["is_error"], true, "{case}: {r}");
        assert!(r["text"].as_str().unwrap().contains(says), "{case}: {r}");
    }
    let runaway = seen["refused"]["runaway"]["seconds"].as_f64().unwrap();
    assert!(
        (2.5..10.0).contains(&runaway),
        "the runaway query ran {runaway} s, its limit 3 s"
    );
    let big = &seen["oversized_rows"]["structured"];
    assert_eq!(big["truncated"], true);
    assert_eq!(big["rows"].as_array().unwrap().len(), 500);
    let wide = &seen["oversized_bytes"]["structured"];
    assert_eq!(wide["truncated"], true);
    let wide_bytes = serde_json::to_string(&wide["rows"]).unwrap().len();
    assert!(wide_bytes <= 70 * 1024, "{wide_bytes} bytes of rows");
    assert!(!wide["rows"].as_array().unwrap().is_empty());
    assert_eq!(seen["bad_session"]["is_error"], true);
    assert!(seen["bad_session"]["text"]
        .as_str()
        .unwrap()
        .contains("no session 999999"));
    assert_eq!(seen["bad_op"]["is_error"], true);
    assert!(seen["bad_op"]["text"]
        .as_str()
        .unwrap()
        .contains("no op named"));
    let unknown = &seen["no_such_tool"];
    assert!(
        unknown["is_error"] == true || unknown["raised"].is_string(),
        "{unknown}"
    );
    assert!(!Path::new("/tmp/tracer-mcp-attach.db").exists());
    assert_eq!(
        scalar(&fx.db, "SELECT count(*) FROM sessions"),
        sessions_before
    );
}

#[test]
fn bad_report_paths_and_databases_get_clear_messages() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("missing.db");
    let run = |args: &[&str]| Command::new(TRACER).args(args).output().unwrap();
    let stderr = |o: &std::process::Output| String::from_utf8_lossy(&o.stderr).into_owned();
    let db = missing.to_str().unwrap();
    // A folder that does not exist: said before any reading.
    let out = run(&["report", "-o", "/nonexistent/r.html", "--db", db]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("pick a writable path with -o"),
        "{}",
        stderr(&out)
    );
    // No database: exit 2 naming it; the previous page is kept and no partial one is left.
    let page = dir.path().join("r.html");
    std::fs::write(&page, "the previous report").unwrap();
    let out = run(&["report", "-o", page.to_str().unwrap(), "--db", db]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(stderr(&out).contains("missing.db"), "{}", stderr(&out));
    assert_eq!(
        std::fs::read_to_string(&page).unwrap(),
        "the previous report"
    );
    assert_eq!(
        std::fs::read_dir(dir.path()).unwrap().count(),
        1,
        "only the page"
    );
    // The MCP server refuses to start on a database that is not there, or with no time to query.
    let out = run(&["mcp", "--db", db]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(stderr(&out).contains("missing.db"), "{}", stderr(&out));
    assert!(out.stdout.is_empty(), "stdout carries only the protocol");
    let out = run(&["mcp", "--db", db, "--query-time", "0s"]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(stderr(&out).contains("--query-time"), "{}", stderr(&out));
}
