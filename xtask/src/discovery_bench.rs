//! `cargo xtask bench-discovery`: what discovery in the kernel costs while nothing runs (the
//! tracer's own CPU, idle) and what every other process pays for it (an `openat`, with the two
//! tracepoint programs on every open of the machine), against tracer given its library (`--lib`:
//! no openat programs) and no tracer at all. Paired rounds, the setups' order turning.
//! (The cost while a job runs is the step bench's `discovering` setup.)

use std::{path::Path, process::Command, time::Duration};

use anyhow::{Context as _, Result};
use clap::Args;

use crate::bench::{bench_dirs, build_release, json_of, root, run_ok, Tracer};

#[derive(Args)]
pub struct DiscoveryBenchArgs {
    /// Paired rounds.
    #[arg(long, default_value_t = 5)]
    rounds: usize,
    /// Opens a run of the open loop.
    #[arg(long, default_value_t = 300_000)]
    opens: u64,
    /// Seconds tracer is left idle a run.
    #[arg(long, default_value_t = 10)]
    idle_secs: u64,
}

#[derive(Clone, Copy, PartialEq)]
enum Setup {
    Untraced,
    Lib,
    Discovering,
}

impl Setup {
    fn name(self) -> &'static str {
        match self {
            Setup::Untraced => "untraced",
            Setup::Lib => "tracer --lib",
            Setup::Discovering => "tracer discovering",
        }
    }
}

const SETUPS: [Setup; 3] = [Setup::Untraced, Setup::Lib, Setup::Discovering];

pub fn run(args: DiscoveryBenchArgs) -> Result<()> {
    let root = root();
    build_release(&root)?;
    let (sim, tmp) = bench_dirs(&root)?;
    let exe = tmp.join("open_loop");
    run_ok(
        Command::new("cc")
            .args(["-O2", "-o"])
            .arg(&exe)
            .arg(root.join("xtask/scripts/open_loop.c")),
    )?;
    let tracer = root.join("target/release/tracer");
    let db = tmp.join("discovery.db");
    let lib = sim.join("libcudart.so.12");
    let mut per_open = vec![Vec::new(); SETUPS.len()];
    let mut idle_cpu = vec![Vec::new(); SETUPS.len()];
    for round in 0..args.rounds {
        eprintln!("bench: discovery, round {}/{}", round + 1, args.rounds);
        for k in 0..SETUPS.len() {
            let i = (k + round) % SETUPS.len();
            let (ns, cpu) = measure(SETUPS[i], &tracer, &db, &lib, &exe, &args)?;
            per_open[i].push(ns);
            idle_cpu[i].extend(cpu);
        }
    }
    println!(
        "\ndiscovery in the kernel ({} paired rounds; {} opens of /etc/hostname a run; tracer idle {} s a run)",
        args.rounds, args.opens, args.idle_secs
    );
    println!(
        "  {:<20} {:>12}   {:<40} {:>16}",
        "setup", "ns an open", "each round", "tracer CPU, idle"
    );
    for (i, s) in SETUPS.iter().enumerate() {
        let each: Vec<String> = per_open[i].iter().map(|x| format!("{x:.0}")).collect();
        let cpu = if idle_cpu[i].is_empty() {
            String::new()
        } else {
            format!("{:.2} ms/s", median(&idle_cpu[i]))
        };
        println!(
            "  {:<20} {:>12.0}   {:<40} {:>16}",
            s.name(),
            median(&per_open[i]),
            each.join(" "),
            cpu
        );
    }
    let (u, l, d) = (&per_open[0], &per_open[1], &per_open[2]);
    let added: Vec<f64> = d.iter().zip(l).map(|(d, l)| d - l).collect();
    let spread = |v: &[f64]| {
        let lo = v.iter().copied().fold(f64::INFINITY, f64::min);
        let hi = v.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        hi - lo
    };
    println!(
        "  the openat programs add {:.0} ns an open (rounds {}); untraced rounds span {:.0} ns",
        median(&added),
        added
            .iter()
            .map(|x| format!("{x:.0}"))
            .collect::<Vec<_>>()
            .join(" "),
        spread(u)
    );
    Ok(())
}

/// One run: the open loop's ns an open; with tracer, also its CPU over an idle spell (ms/s).
fn measure(
    setup: Setup,
    tracer: &Path,
    db: &Path,
    lib: &Path,
    exe: &Path,
    args: &DiscoveryBenchArgs,
) -> Result<(f64, Option<f64>)> {
    let running = match setup {
        Setup::Untraced => None,
        Setup::Lib => Some(Tracer::start_with(tracer, db, lib, &[])?),
        Setup::Discovering => Some(Tracer::start_discovering(tracer, db, &[])?),
    };
    let idle = match &running {
        Some(t) => {
            let before = t.cpu_s();
            std::thread::sleep(Duration::from_secs(args.idle_secs));
            Some((t.cpu_s() - before) * 1e3 / args.idle_secs as f64)
        }
        None => None,
    };
    let out = Command::new(exe)
        .arg("/etc/hostname")
        .arg(args.opens.to_string())
        .output()
        .context("run open_loop")?;
    let rep = json_of(out, "open_loop")?;
    if let Some(t) = running {
        t.stop()?;
    }
    let ns = rep["ns_per_open"]
        .as_f64()
        .context("open_loop printed no ns_per_open")?;
    Ok((ns, idle))
}

fn median(v: &[f64]) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    s.get(s.len() / 2).copied().unwrap_or(f64::NAN)
}
