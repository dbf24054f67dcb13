//! `cargo xtask bench-whatif`: `tracer whatif` over a session of N recorded allocator requests
//! (xtask/scripts/gen_requests.py, stored with `tracer import`): the requests replayed under the
//! recorded settings and 11 others, without and with the least-memory search. Needs no root.

use std::{process::Command, time::Instant};

use anyhow::{ensure, Result};
use clap::Args;
use serde_json::Value;

use crate::bench::{build_release, root, run_ok};

#[derive(Args)]
pub struct WhatIfBenchArgs {
    /// Requests (mallocs and frees) in the synthetic session.
    #[arg(long, default_value_t = 10_000_000)]
    requests: u64,
}

/// Times `tracer whatif` (wall seconds, its JSON answer).
fn timed(tracer: &std::path::Path, db: &std::path::Path, extra: &[&str]) -> Result<(f64, Value)> {
    let started = Instant::now();
    let out = Command::new(tracer)
        .args(["whatif", "--json", "--db"])
        .arg(db)
        .args(extra)
        .output()?;
    ensure!(
        out.status.success(),
        "tracer whatif failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok((
        started.elapsed().as_secs_f64(),
        serde_json::from_slice(&out.stdout)?,
    ))
}

pub fn run(args: WhatIfBenchArgs) -> Result<()> {
    let root = root();
    build_release(&root)?;
    let tracer = root.join("target/release/tracer");
    let tmp = root.join("target/bench");
    std::fs::create_dir_all(&tmp)?;
    let (db, log) = (tmp.join("whatif.db"), tmp.join("whatif-requests.log"));
    for suffix in ["", "-wal", "-shm"] {
        let _ = std::fs::remove_file(format!("{}{suffix}", db.display()));
    }
    eprintln!("bench-whatif: writing {} requests", args.requests);
    run_ok(
        Command::new("python3")
            .arg(root.join("xtask/scripts/gen_requests.py"))
            .arg(&log)
            .arg(args.requests.to_string()),
    )?;
    run_ok(
        Command::new(&tracer)
            .args(["import", "--json"])
            .arg(&log)
            .arg("--db")
            .arg(&db),
    )?;
    let (plain, answer) = timed(&tracer, &db, &["--no-search"])?;
    let settings = answer["rows"].as_array().map_or(0, Vec::len);
    println!(
        "tracer whatif: {} requests ({} allocations) under {settings} settings: {plain:.2} s (simulation only)",
        answer["requests"], answer["mallocs"]
    );
    let (searched, _) = timed(&tracer, &db, &[])?;
    println!("  with each setting's least-memory search: {searched:.2} s");
    Ok(())
}
