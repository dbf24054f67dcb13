//! `cargo xtask bench-flight`: the flight recorder on a job that runs long, at the rate tracer
//! sustains here (demos/simcuda/simjob.c: a caching allocator with PyTorch's probes, its weights
//! allocated first and held, then steps, then a fragmentation OOM, its own account written at the
//! end), traced with --max-db. Measured in one run:
//! - keyframes' cost, side by side: tracer's CPU per million events with and without keyframes
//!   (rounds interleaved, no --max-db); and counted where it is spent: the CPU time tracer's
//!   threads report for making and storing keyframes, as a share of tracer's CPU;
//! - the long run: every block event the job fired stored, evicted or counted; the database's
//!   footprint (its write-ahead log included) against --max-db, sampled each second; at each of
//!   the given minutes of history, the read side's wall time and peak RSS (explain, `layout --at
//!   end`, report, the Perfetto export, mcp's explain tool) while the trace runs, and again after
//!   the job, alone on the machine, over a consistent copy of the database taken at that moment
//!   (job and tracer keep both cores of a 2-core machine busy: the first figures measure the
//!   contention as much as the read side); at the end, the layout at the OOM against the job's
//!   own account, and the whole-run series' coverage.

use std::{
    io::{BufRead as _, BufReader, Write as _},
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::{anyhow, ensure, Context as _, Result};
use clap::Args;
use serde_json::{json, Value};

use crate::bench::{bench_dirs, build_release, children_cpu_s, root, Tracer};

#[derive(Args)]
pub struct FlightBenchArgs {
    /// Minutes of the long run (0: only keyframes' cost).
    #[arg(long, default_value_t = 30)]
    minutes: u64,
    /// --max-db of the long run.
    #[arg(long, default_value = "256MiB")]
    max_db: String,
    /// Minutes of history at which the read side is measured.
    #[arg(long, value_delimiter = ',', default_value = "1,10,30")]
    at: Vec<u64>,
    /// Seconds of each keyframe cost run, and how many rounds of each.
    #[arg(long, default_value_t = 20)]
    keyframe_secs: u64,
    #[arg(long, default_value_t = 3)]
    keyframe_rounds: usize,
    /// Block events a second the long run's job fires (the rate tracer keeps up with here, the
    /// read side running beside it); 0: as fast as it can.
    #[arg(long, default_value_t = 600_000)]
    rate: u64,
}

struct Setup {
    tracer: PathBuf,
    sim: PathBuf,
    tmp: PathBuf,
}

impl Setup {
    fn job(&self, secs: u64, rate: u64, account: Option<&Path>) -> Command {
        let mut cmd = Command::new(self.sim.join("simjob"));
        cmd.env("SIMCUDA_MEM", "512MiB")
            .env("SIMCUDA_LATENCY", "default=0")
            .arg("--cudart")
            .arg(self.sim.join("libcudart.so.12"))
            .args(["--seconds", &secs.to_string(), "--rate", &rate.to_string()]);
        if let Some(a) = account {
            cmd.arg("--account").arg(a);
        }
        cmd
    }

    fn trace(&self, db: &Path, extra: &[&str]) -> Result<Tracer> {
        let torch = self.sim.join("libsimtorch.so");
        let mut args = vec!["--lib", torch.to_str().unwrap_or_default()];
        args.extend_from_slice(extra);
        Tracer::start_with(&self.tracer, db, &self.sim.join("libcudart.so.12"), &args)
    }
}

/// One run of the job for keyframes' cost.
struct KeyframeRun {
    /// tracer's CPU seconds per million events stored.
    cpu_per_million: f64,
    stored: u64,
    tracer_cpu_s: f64,
    keyframes: u64,
    /// What tracer's threads counted for making and storing keyframes.
    keyframe_cpu_s: f64,
}

/// Tracer's CPU for one run of the job under `extra`.
fn keyframe_run(s: &Setup, secs: u64, extra: &[&str]) -> Result<KeyframeRun> {
    let db = s.tmp.join("keyframes.db");
    let before = children_cpu_s();
    let tracer = s.trace(&db, extra)?;
    let started = children_cpu_s();
    let out = s.job(secs, 0, None).output().context("run simjob")?;
    let job_cpu = children_cpu_s() - started;
    let summary = tracer.stop()?;
    ensure!(
        out.status.code() == Some(1),
        "simjob did not end with its OOM: {out:?}"
    );
    let tracer_cpu = children_cpu_s() - before - job_cpu;
    let stored = summary["counters"]["events_stored"].as_u64().unwrap_or(0);
    Ok(KeyframeRun {
        cpu_per_million: tracer_cpu * 1e6 / stored.max(1) as f64,
        stored,
        tracer_cpu_s: tracer_cpu,
        keyframes: summary["keyframes"]["written"].as_u64().unwrap_or(0),
        keyframe_cpu_s: summary["keyframes"]["cpu_s"].as_f64().unwrap_or(0.0),
    })
}

/// Wall seconds and peak RSS (MiB) of a command run to its end.
fn measured(cmd: &mut Command, stdin: Option<&str>, errors: &Path) -> Result<(f64, f64)> {
    let t = Instant::now();
    let mut child = cmd
        .stdin(if stdin.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        // Only MCP's answers are read: other output is dropped, and the errors go to a file, so
        // that no pipe fills while wait4 waits.
        .stdout(if stdin.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stderr(std::fs::File::create(errors).context("create the errors' file")?)
        .spawn()
        .with_context(|| format!("run {cmd:?}"))?;
    if let Some(text) = stdin {
        mcp_explain(&mut child, text)?;
    }
    let mut status = 0;
    // SAFETY: rusage is plain data wait4 fills for our own child.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: wait4 on our own child's pid.
    let pid = unsafe { libc::wait4(child.id() as i32, &mut status, 0, &mut ru) };
    ensure!(pid > 0, "wait4 failed");
    let wall = t.elapsed().as_secs_f64();
    let err = std::fs::read_to_string(errors).unwrap_or_default();
    ensure!(
        libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
        "{cmd:?} failed: {err}"
    );
    Ok((wall, ru.ru_maxrss as f64 / 1024.0))
}

/// Speaks MCP to `tracer mcp`: initialize, then the explain tool; waits for its answer.
fn mcp_explain(child: &mut std::process::Child, _: &str) -> Result<()> {
    let mut stdin = child.stdin.take().ok_or_else(|| anyhow!("no stdin"))?;
    let stdout = child.stdout.take().ok_or_else(|| anyhow!("no stdout"))?;
    let mut lines = BufReader::new(stdout).lines();
    let mut send = |v: Value| -> Result<()> {
        writeln!(stdin, "{v}")?;
        stdin.flush()?;
        Ok(())
    };
    send(
        json!({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
        "protocolVersion": "2025-06-18", "capabilities": {},
        "clientInfo": {"name": "bench-flight", "version": "0"}}}),
    )?;
    lines
        .next()
        .ok_or_else(|| anyhow!("mcp: no answer to initialize"))??;
    send(json!({"jsonrpc": "2.0", "method": "notifications/initialized"}))?;
    send(json!({"jsonrpc": "2.0", "id": 2, "method": "tools/call",
        "params": {"name": "explain", "arguments": {}}}))?;
    let answer = lines
        .next()
        .ok_or_else(|| anyhow!("mcp: no answer to explain"))??;
    let v: Value = serde_json::from_str(&answer)?;
    ensure!(
        v["result"]["isError"] != true && v["error"].is_null(),
        "mcp explain failed: {answer}"
    );
    Ok(())
}

/// One read-side command's cost.
struct Reading {
    what: &'static str,
    wall_s: f64,
    rss_mib: f64,
}

/// The read side at one moment of the long run.
fn read_side(s: &Setup, db: &Path) -> Result<Vec<Reading>> {
    let t = &s.tracer;
    let db_arg = db.display().to_string();
    let html = s.tmp.join("flight.html").display().to_string();
    let trace = s.tmp.join("flight.pftrace").display().to_string();
    let errors = s.tmp.join("flight-read.err");
    let runs: [(&'static str, Vec<&str>); 4] = [
        ("explain", vec!["explain", "--json", "--db", &db_arg]),
        ("layout --at end", vec!["layout", "--json", "--db", &db_arg]),
        ("report", vec!["report", "-o", &html, "--db", &db_arg]),
        (
            "export perfetto",
            vec![
                "export", "--format", "perfetto", "-o", &trace, "--db", &db_arg,
            ],
        ),
    ];
    let mut out = Vec::new();
    for (what, args) in runs {
        let (wall_s, rss_mib) = measured(Command::new(t).args(&args), None, &errors)?;
        out.push(Reading {
            what,
            wall_s,
            rss_mib,
        });
    }
    let (wall_s, rss_mib) = measured(
        Command::new(t).args(["mcp", "--db", &db_arg]),
        Some("explain"),
        &errors,
    )?;
    out.push(Reading {
        what: "mcp explain",
        wall_s,
        rss_mib,
    });
    Ok(out)
}

/// A consistent copy of the database as it is now (SQLite's VACUUM INTO, read-only on the
/// original while tracer writes it).
fn snapshot(db: &Path, copy: &Path) -> Result<()> {
    let _ = std::fs::remove_file(copy);
    let conn =
        rusqlite::Connection::open_with_flags(db, rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY)
            .with_context(|| format!("open {}", db.display()))?;
    conn.busy_timeout(Duration::from_secs(30))?;
    conn.execute("VACUUM INTO ?1", [copy.display().to_string()])
        .with_context(|| format!("copy {} to {}", db.display(), copy.display()))?;
    Ok(())
}

fn footprint(db: &Path) -> u64 {
    ["", "-wal"]
        .iter()
        .map(|s| std::fs::metadata(format!("{}{s}", db.display())).map_or(0, |m| m.len()))
        .sum()
}

fn query(s: &Setup, db: &Path, sql: &str) -> Result<Value> {
    let out = Command::new(&s.tracer)
        .args(["query", "--format", "json", "--db"])
        .arg(db)
        .arg(sql)
        .output()?;
    ensure!(
        out.status.success(),
        "query {sql}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let rows: Value = serde_json::from_slice(&out.stdout)?;
    Ok(rows[0].clone())
}

/// Segments as (address, size, blocks as (address, size, allocated)).
type Map = Vec<(u64, u64, Vec<(u64, u64, bool)>)>;

/// The [`Map`] of the job's account or of `tracer layout --json`.
fn segments(v: &Value, seg_addr: &str, runs: &str, addr: &str) -> Map {
    v.as_array()
        .into_iter()
        .flatten()
        .map(|seg| {
            let blocks = seg[runs]
                .as_array()
                .into_iter()
                .flatten()
                .map(|b| {
                    let allocated = b["allocated"].as_bool().unwrap_or(b["kind"] == "allocated");
                    (
                        b[addr].as_u64().unwrap_or(0),
                        b["size"].as_u64().unwrap_or(0),
                        allocated,
                    )
                })
                .collect();
            (
                seg[seg_addr].as_u64().unwrap_or(0),
                seg["size"].as_u64().unwrap_or(0),
                blocks,
            )
        })
        .collect()
}

pub fn run(args: FlightBenchArgs) -> Result<()> {
    let root = root();
    build_release(&root)?;
    let (sim, tmp) = bench_dirs(&root)?;
    let s = Setup {
        tracer: root.join("target/release/tracer"),
        sim,
        tmp,
    };

    eprintln!(
        "bench-flight: keyframes' cost, {} rounds of {} s each way",
        args.keyframe_rounds, args.keyframe_secs
    );
    let (mut on, mut off) = (Vec::new(), Vec::new());
    for _ in 0..args.keyframe_rounds {
        off.push(keyframe_run(&s, args.keyframe_secs, &["--no-keyframes"])?);
        on.push(keyframe_run(&s, args.keyframe_secs, &[])?);
    }
    let median = |v: &[KeyframeRun]| {
        let mut x: Vec<f64> = v.iter().map(|r| r.cpu_per_million).collect();
        x.sort_by(f64::total_cmp);
        x[x.len() / 2]
    };
    let runs = |v: &[KeyframeRun]| {
        v.iter()
            .map(|r| (r.cpu_per_million * 1000.0).round() / 1000.0)
            .collect::<Vec<_>>()
    };
    let rate = |v: &[KeyframeRun]| {
        v.iter().map(|r| r.stored).sum::<u64>() as f64
            / (v.len() as f64 * args.keyframe_secs as f64)
    };
    println!("keyframes' cost (tracer CPU-s per million events stored, median of {} interleaved rounds):", args.keyframe_rounds);
    println!(
        "  without keyframes {:.3} (runs {:?}), with {:.3} (runs {:?}): with / without {:.3} x",
        median(&off),
        runs(&off),
        median(&on),
        runs(&on),
        median(&on) / median(&off)
    );
    println!(
        "  events stored a second: without {:.0}, with {:.0}",
        rate(&off),
        rate(&on)
    );
    let spent: f64 = on.iter().map(|r| r.keyframe_cpu_s).sum();
    let tracer: f64 = on.iter().map(|r| r.tracer_cpu_s).sum();
    println!(
        "  counted where spent: {} keyframes took {spent:.3} s of tracer's {tracer:.1} CPU-s: {:.2} %",
        on.iter().map(|r| r.keyframes).sum::<u64>(),
        100.0 * spent / tracer.max(f64::MIN_POSITIVE)
    );
    if args.minutes == 0 {
        return Ok(());
    }

    let db = s.tmp.join("flight.db");
    let account = s.tmp.join("flight-account.json");
    eprintln!(
        "bench-flight: the long run, {} min with --max-db {}",
        args.minutes, args.max_db
    );
    let tracer = s.trace(&db, &["--max-db", &args.max_db])?;
    let started = Instant::now();
    let mut job = s
        .job(args.minutes * 60, args.rate, Some(&account))
        .stdout(Stdio::piped())
        .spawn()
        .context("start simjob")?;
    let mut peak_footprint = 0u64;
    let mut moments = args.at.clone();
    moments.retain(|&m| m <= args.minutes);
    let mut readings = Vec::new();
    let mut copies = Vec::new();
    loop {
        peak_footprint = peak_footprint.max(footprint(&db));
        if let Some(&m) = moments.first() {
            // Just before the job's end at the last one: history of nearly all of it.
            let at = Duration::from_secs(m * 60).min(Duration::from_secs(args.minutes * 60 - 20));
            if started.elapsed() >= at {
                moments.remove(0);
                eprintln!("bench-flight: the read side after {m} min");
                readings.push((m, read_side(&s, &db)?));
                let copy = s.tmp.join(format!("flight-{m}min.db"));
                snapshot(&db, &copy)?;
                copies.push((m, copy));
            }
        }
        if job.try_wait()?.is_some() {
            break;
        }
        std::thread::sleep(Duration::from_secs(1));
    }
    let job_out = job.wait_with_output()?;
    let rep: Value = serde_json::from_slice(&job_out.stdout).context("simjob's line")?;
    std::thread::sleep(Duration::from_secs(1));
    peak_footprint = peak_footprint.max(footprint(&db));
    let summary = tracer.stop()?;
    let c = &summary["counters"];
    let session = query(&s, &db, "SELECT events_stored, evicted_events, evicted_calls, evicted_block_events, evicted_offcpu, dropped_ring_full, started_ns, ended_ns FROM sessions ORDER BY id DESC LIMIT 1")?;
    let series = query(&s, &db, "SELECT count(*) AS rows, min(start_ns) AS first, max(end_ns) AS last, sum(length(ops)) + count(*) * 120 AS bytes FROM series")?;
    let keyframes = query(&s, &db, "SELECT count(*) AS n, (SELECT sum(length(data)) FROM keyframe_states) AS bytes FROM keyframes")?;
    let layout: Value = {
        let out = Command::new(&s.tracer)
            .args(["layout", "--at", "oom", "--json", "--db"])
            .arg(&db)
            .output()?;
        ensure!(
            out.status.success(),
            "layout --at oom: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_slice(&out.stdout)?
    };
    let truth: Value = serde_json::from_slice(&std::fs::read(&account)?)?;
    let rebuilt = segments(&layout[0]["segments"], "addr", "runs", "addr");
    let own = segments(&truth["segments"], "ptr", "blocks", "ptr");
    let fired = rep["block_events"].as_u64().unwrap_or(0);
    println!(
        "long run: {} min, --max-db {}, the job paced to {} block events a second",
        args.minutes, args.max_db, args.rate
    );
    println!(
        "  the job fired {fired} block events ({:.0} a second), {} steps",
        fired as f64 / started.elapsed().as_secs_f64(),
        rep["steps"]
    );
    println!("  tracer: {} events read, {} stored, {} dropped (ring full), {} decode errors; evicted {} ({} CUDA calls, {} block events, {} off-CPU intervals)",
        c["events_read"], c["events_stored"], c["dropped_ring_full"], c["decode_errors"],
        session["evicted_events"], session["evicted_calls"], session["evicted_block_events"], session["evicted_offcpu"]);
    println!("  database footprint (with its log): peak {:.1} MiB sampled each second, {:.1} MiB at the end",
        peak_footprint as f64 / 1048576.0, footprint(&db) as f64 / 1048576.0);
    println!(
        "  keyframes kept at the end: {} ({} bytes of states)",
        keyframes["n"], keyframes["bytes"]
    );
    let span =
        session["ended_ns"].as_i64().unwrap_or(0) - session["started_ns"].as_i64().unwrap_or(0);
    println!(
        "  whole-run series: {} rows covering {:.0} of the session's {:.0} s, about {} bytes",
        series["rows"],
        (series["last"].as_i64().unwrap_or(0) - series["first"].as_i64().unwrap_or(0)) as f64 / 1e9,
        span as f64 / 1e9,
        series["bytes"]
    );
    println!("  layout at the OOM: {} segments, {} blocks; the job's own: {} segments, {} blocks; equal: {}",
        rebuilt.len(), rebuilt.iter().map(|s| s.2.len()).sum::<usize>(), own.len(),
        own.iter().map(|s| s.2.len()).sum::<usize>(), rebuilt == own);
    println!("read side while the trace ran (wall s / peak RSS MiB):");
    print_readings(&readings);
    let mut alone = Vec::new();
    for (m, copy) in &copies {
        alone.push((*m, read_side(&s, copy)?));
        let _ = std::fs::remove_file(copy);
    }
    println!("read side alone, over the copy taken at that moment (wall s / peak RSS MiB):");
    print_readings(&alone);
    Ok(())
}

fn print_readings(readings: &[(u64, Vec<Reading>)]) {
    for (m, rows) in readings {
        let cells: Vec<String> = rows
            .iter()
            .map(|r| format!("{} {:.2} s / {:.0} MiB", r.what, r.wall_s, r.rss_mib))
            .collect();
        println!("  after {m:>2} min: {}", cells.join("; "));
    }
}
