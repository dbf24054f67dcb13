//! `cargo xtask bench-tensor`: what tracing PyTorch's own allocator probes costs, at sites built
//! as libc10_cuda.so's are (sys/sdt.h, provider `pytorch`, `malloc(ptr, device, size, stream)`
//! and `free(ptr)`, semaphore-gated: xtask/scripts/tensor_loop.c). Measured side by side in one
//! run:
//! - the cost of a tensor allocation (malloc + free probe hits) on one thread: untraced (the
//!   semaphores are 0, the sites do not run), the floor (tracer's probes at the same sites with a
//!   program that only counts: `tracer trace --floor`), the floor with the one clock read an
//!   event's time needs (`--floor-clock`), and tracer; rounds interleave them;
//! - the USDT program's own time per hit (kernel BPF statistics);
//! - sustained: 4 producer threads at full speed for N seconds, under the floor (the rate the
//!   producers reach) and under tracer: events stored per second, drops, tracer's CPU per million
//!   events and the database's bytes per event.

use std::{
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{anyhow, ensure, Context as _, Result};
use clap::Args;
use serde_json::Value;

use crate::{
    bench::{
        build_release, children_cpu_s, json_of, print_sites, prologue_verdict, ratio, root, row,
        run_ok, Samples, Tracer,
    },
    prologue,
};

#[derive(Args)]
pub struct TensorBenchArgs {
    /// Tensor allocations (malloc + free) per cost run, on one thread.
    #[arg(long, default_value_t = 1_000_000)]
    pairs: u64,
    /// Rounds of the cost runs (the median and the minimum are reported).
    #[arg(long, default_value_t = 5)]
    runs: usize,
    /// Seconds of each sustained run (4 producer threads).
    #[arg(long, default_value_t = 10)]
    secs: u64,
}

struct Setup {
    tracer: PathBuf,
    exe: PathBuf,
    db: PathBuf,
}

/// One run of the loop: its JSON report.
fn tensor_loop(s: &Setup, threads: u32, pairs: u64, secs: u64) -> Result<Value> {
    let out = Command::new(&s.exe)
        .args([threads.to_string(), pairs.to_string(), secs.to_string()])
        .output()
        .context("run tensor_loop")?;
    json_of(out, "tensor_loop")
}

/// CPU ns per tensor allocation of one single-thread run under `setup` (None: untraced).
fn cost_ns(s: &Setup, pairs: u64, setup: Option<&[&str]>) -> Result<(f64, Value)> {
    let tracer = match setup {
        Some(extra) => Some(Tracer::start_with(&s.tracer, &s.db, &s.exe, extra)?),
        None => None,
    };
    let rep = tensor_loop(s, 1, pairs, 0);
    let summary = match tracer {
        Some(t) => t.stop()?,
        None => Value::Null,
    };
    let rep = rep?;
    let expected = u64::from(setup.is_some());
    ensure!(
        rep["semaphore"].as_u64() == Some(expected),
        "the malloc semaphore was {} (expected {expected}): {rep}",
        rep["semaphore"]
    );
    let cpu = rep["cpu_s"].as_f64().ok_or_else(|| anyhow!("no cpu_s"))?;
    Ok((cpu * 1e9 / pairs as f64, summary))
}

/// 4 producers at full speed for `secs` under `extra`, with what it cost and stored.
struct Sustained {
    wall_s: f64,
    pairs: u64,
    stored: i64,
    dropped: i64,
    tracer_cpu: f64,
    bytes: u64,
    blob_bytes: i64,
}

fn sustained(s: &Setup, secs: u64, extra: &[&str]) -> Result<Sustained> {
    let cpu_before = children_cpu_s();
    let tracer = Tracer::start_with(&s.tracer, &s.db, &s.exe, extra)?;
    let started_cpu = children_cpu_s();
    let rep = tensor_loop(s, 4, 0, secs);
    let producer_cpu = children_cpu_s() - started_cpu;
    let summary = tracer.stop()?;
    let rep = rep?;
    let tracer_cpu = children_cpu_s() - cpu_before - producer_cpu;
    let counters = &summary["counters"];
    let blob_bytes = if extra.is_empty() {
        query_i64(
            &s.tracer,
            &s.db,
            "SELECT coalesce(sum(length(data)), 0) FROM call_blocks",
        )?
    } else {
        0
    };
    Ok(Sustained {
        wall_s: rep["wall_s"].as_f64().unwrap_or(1.0),
        pairs: rep["pairs"].as_u64().unwrap_or(0),
        stored: counters["events_stored"].as_i64().unwrap_or(0),
        dropped: counters["dropped_ring_full"].as_i64().unwrap_or(-1),
        tracer_cpu,
        bytes: std::fs::metadata(&s.db).map(|m| m.len()).unwrap_or(0),
        blob_bytes,
    })
}

fn query_i64(tracer: &Path, db: &Path, sql: &str) -> Result<i64> {
    let out = Command::new(tracer)
        .args(["query", "--format", "csv", "--db"])
        .arg(db)
        .arg(sql)
        .output()
        .context("run tracer query")?;
    let text = String::from_utf8_lossy(&out.stdout);
    text.lines()
        .nth(1)
        .and_then(|l| l.trim().parse().ok())
        .ok_or_else(|| anyhow!("tracer query {sql:?} printed {text}"))
}

/// The USDT program's ns per run, from a --program-stats summary.
fn usdt_program_ns(summary: &Value) -> Option<f64> {
    summary["programs"]
        .as_array()?
        .iter()
        .find(|p| p["name"] == "usdt_hit")?["ns_per_run"]
        .as_f64()
}

pub fn run(args: TensorBenchArgs) -> Result<()> {
    let root = root();
    build_release(&root)?;
    let tmp = root.join("target/bench");
    std::fs::create_dir_all(&tmp)?;
    let exe = tmp.join("tensor_loop");
    run_ok(
        Command::new("cc")
            .args(["-O2", "-pthread", "-o"])
            .arg(&exe)
            .arg(root.join("xtask/scripts/tensor_loop.c")),
    )
    .context("build the tensor loop (needs sys/sdt.h: apt-get install systemtap-sdt-dev)")?;
    let s = Setup {
        tracer: root.join("target/release/tracer"),
        exe,
        db: tmp.join("tensor.db"),
    };
    let sites = prologue::usdt_sites(&s.exe)?;

    let mut cost: [Samples; 4] = Default::default();
    for round in 0..args.runs {
        eprintln!("bench-tensor: round {}/{}", round + 1, args.runs);
        cost[0].push(cost_ns(&s, args.pairs, None)?.0);
        cost[1].push(cost_ns(&s, args.pairs, Some(&["--floor"]))?.0);
        cost[2].push(cost_ns(&s, args.pairs, Some(&["--floor-clock"]))?.0);
        cost[3].push(cost_ns(&s, args.pairs, Some(&[]))?.0);
    }
    eprintln!("bench-tensor: the USDT program's own time");
    let (_, stats) = cost_ns(&s, args.pairs, Some(&["--program-stats"]))?;
    eprintln!("bench-tensor: sustained, 4 threads, {} s each", args.secs);
    let floor = sustained(&s, args.secs, &["--floor"])?;
    let traced = sustained(&s, args.secs, &[])?;

    println!(
        "tensor allocations (pytorch:malloc + pytorch:free hits), CPU ns per allocation, {} per run, {} rounds",
        args.pairs, args.runs
    );
    print_sites(&sites);
    if let Some(why) = prologue_verdict(&sites) {
        println!("  {why}");
        return Ok(());
    }
    println!("  {:<22} {:>10} {:>10}", "setup", "median", "min");
    row("untraced", &cost[0], "semaphores 0: the sites do not run");
    row(
        "floor",
        &cost[1],
        "tracer's probes, a program that only counts",
    );
    row(
        "floor + clock",
        &cost[2],
        "and the one clock read an event's time needs",
    );
    row("tracer", &cost[3], "every event decoded and stored");
    ratio("tracer/floor", &cost[3], &cost[1], "target <= 1.25");
    ratio("tracer/(floor+clock)", &cost[3], &cost[2], "");
    ratio("tracer/untraced", &cost[3], &cost[0], "");
    if let Some(ns) = usdt_program_ns(&stats) {
        println!("  usdt_hit program      {ns:>10.0} ns a run (kernel.bpf_stats)");
    }

    println!("\nsustained: 4 producer threads at full speed");
    let rate = |x: &Sustained| 2.0 * x.pairs as f64 / x.wall_s;
    println!(
        "  floor                 {:>10.0} events/s made ({} s)",
        rate(&floor),
        args.secs
    );
    println!(
        "  tracer                {:>10.0} events/s made, {:.0} stored/s ({:.2}x the floor's rate), dropped {}",
        rate(&traced),
        traced.stored as f64 / traced.wall_s,
        rate(&traced) / rate(&floor).max(1.0),
        traced.dropped
    );
    let millions = traced.stored as f64 / 1e6;
    println!(
        "  tracer CPU            {:.2} s = {:.2} s per million events (target <= 0.7)",
        traced.tracer_cpu,
        traced.tracer_cpu / millions.max(1e-9)
    );
    println!(
        "  database              {} bytes = {:.1} bytes/event on disk (target <= 24); call blocks {:.1} bytes/event",
        traced.bytes,
        traced.bytes as f64 / traced.stored.max(1) as f64,
        traced.blob_bytes as f64 / traced.stored.max(1) as f64
    );
    ensure!(
        traced.stored as u64 == 2 * traced.pairs && traced.dropped == 0,
        "the sustained run lost events: {} made, {} stored, {} dropped",
        2 * traced.pairs,
        traced.stored,
        traced.dropped
    );
    Ok(())
}
