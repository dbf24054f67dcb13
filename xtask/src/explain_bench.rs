//! `cargo xtask bench-explain`: `tracer explain` over a large session, stored by tracer's own
//! writer (`tracer import` of a synthetic simulated-runtime log).

use std::process::Command;

use anyhow::{ensure, Context as _, Result};
use clap::Args;
use serde_json::Value;

use crate::bench::{build_release, root, run_ok};

#[derive(Args)]
pub struct ExplainBenchArgs {
    /// Calls in the synthetic session.
    #[arg(long, default_value_t = 10_000_000)]
    events: u64,
    /// Processes making them (their calls interleaved).
    #[arg(long, default_value_t = 1)]
    processes: u32,
}

/// Builds a database with one session of `events` synthetic calls and times `tracer explain`.
pub fn explain(args: ExplainBenchArgs) -> Result<()> {
    let root = root();
    build_release(&root)?;
    let tracer = root.join("target/release/tracer");
    let tmp = root.join("target/bench");
    std::fs::create_dir_all(&tmp)?;
    let db = tmp.join("explain.db");
    for suffix in ["", "-wal", "-shm"] {
        let _ = std::fs::remove_file(format!("{}{suffix}", db.display()));
    }
    let log = tmp.join("explain-events.log");
    eprintln!(
        "bench: writing {} synthetic calls to {}",
        args.events,
        log.display()
    );
    run_ok(
        Command::new("python3")
            .arg(root.join("xtask/scripts/gen_events.py"))
            .arg(&log)
            .arg(args.events.to_string())
            .arg(args.processes.to_string()),
    )?;
    // Stored by tracer's own writer, rows and call blocks, as a trace stores them.
    let import_started = std::time::Instant::now();
    let imported = Command::new(&tracer)
        .args(["import", "--json"])
        .arg(&log)
        .arg("--db")
        .arg(&db)
        .output()?;
    ensure!(
        imported.status.success(),
        "tracer import failed: {}",
        String::from_utf8_lossy(&imported.stderr)
    );
    let summary: Value =
        serde_json::from_slice(&imported.stdout).context("read tracer import's JSON line")?;
    eprintln!(
        "bench: session {}: {} calls imported ({:.1} s)",
        summary["session"],
        summary["calls"],
        import_started.elapsed().as_secs_f64()
    );
    let session = summary["session"]
        .as_i64()
        .context("read the session number from tracer import")?
        .to_string();
    let _ = std::fs::remove_file(&log);
    // Three runs: the first may read the database from disk, the others from the page cache.
    let mut walls = Vec::new();
    for run in 1..=3 {
        let started = std::time::Instant::now();
        let out = Command::new(&tracer)
            .args(["explain", "--session", &session, "--per-process", "--db"])
            .arg(&db)
            .env("TRACER_TIMING", "1")
            .output()?;
        let wall = started.elapsed().as_secs_f64();
        ensure!(
            out.status.success(),
            "explain failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let timing = String::from_utf8_lossy(&out.stderr);
        let chains = String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter(|l| l.starts_with('['))
            .count();
        println!(
            "run {run}: tracer explain over {} events of {} process(es): {wall:.2} s wall ({}), {chains} chains",
            args.events,
            args.processes,
            timing.trim()
        );
        walls.push(wall);
    }
    walls.sort_by(f64::total_cmp);
    let median = walls[walls.len() / 2];
    println!(
        "median {median:.2} s; target: 10,000,000 events in at most 2 s; this scales to {:.2} s per 10M events",
        median * 1e7 / args.events as f64
    );
    Ok(())
}
