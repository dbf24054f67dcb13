//! `cargo xtask bench-graphs`: what probing CUDA graphs costs a serving loop that replays a
//! captured graph every step (xtask/scripts/graph_replay.c on the simulated runtime): paired
//! rounds of the loop untraced and traced (every probe of the runtime attached, the capture
//! and graph calls among them), their order turned each round.

use std::process::Command;

use anyhow::{Context as _, Result};
use clap::Args;

use crate::bench::{bench_dirs, build_release, json_of, root, run_ok, Samples, Tracer};

#[derive(Args, Clone)]
pub struct GraphBenchArgs {
    /// Paired rounds.
    #[arg(long, default_value_t = 7)]
    pub rounds: usize,
    /// The step's CPU-bound body, in microseconds (a small decode step).
    #[arg(long, default_value_t = 2000.0)]
    pub work_us: f64,
    /// Steps a run.
    #[arg(long, default_value_t = 1000)]
    pub steps: u32,
}

pub fn run(args: GraphBenchArgs) -> Result<()> {
    let root = root();
    build_release(&root)?;
    let (sim, tmp) = bench_dirs(&root)?;
    let exe = tmp.join("graph_replay");
    run_ok(
        Command::new("cc")
            .args(["-O2", "-o"])
            .arg(&exe)
            .arg(root.join("xtask/scripts/graph_replay.c"))
            .arg(format!("-L{}", sim.display()))
            .arg("-l:libcudart.so.12")
            .arg(format!("-Wl,-rpath,{}", sim.display())),
    )
    .context("build the graph replay loop")?;
    let once = || -> Result<f64> {
        let out = Command::new(&exe)
            .arg(format!("{:.0}", args.work_us))
            .arg(args.steps.to_string())
            .output()
            .context("run graph_replay")?;
        let rep = json_of(out, "graph_replay")?;
        rep["step_us"]
            .as_f64()
            .context("graph_replay printed no step_us")
    };
    let (mut untraced, mut traced, mut ratios) =
        (Samples::default(), Samples::default(), Samples::default());
    let (mut events, mut launches) = (0.0, 0.0);
    for round in 0..args.rounds {
        let mut pair = [0.0; 2];
        for k in 0..2 {
            let which = (k + round) % 2;
            if which == 0 {
                pair[0] = once()?;
                continue;
            }
            let tracer = Tracer::start_with(
                &root.join("target/release/tracer"),
                &tmp.join("graphs.db"),
                &sim.join("libcudart.so.12"),
                &[],
            )?;
            let step = once();
            let summary = tracer.stop()?;
            pair[1] = step?;
            events = summary["counters"]["events_stored"].as_f64().unwrap_or(0.0);
            launches = f64::from(args.steps + 50);
        }
        untraced.push(pair[0]);
        traced.push(pair[1]);
        ratios.push(pair[1] / pair[0]);
        eprintln!(
            "bench-graphs: round {}/{}: untraced {:.1} us, traced {:.1} us a step",
            round + 1,
            args.rounds,
            pair[0],
            pair[1]
        );
    }
    let (u, t, r) = (untraced.get(), traced.get(), ratios.get());
    let spread = ratios.spread();
    println!(
        "\nserving loop replaying a captured graph every step ({} steps of {:.0} us work a run, {} paired rounds; {:.1} events stored a launch: the launch and the stream wait)",
        args.steps,
        args.work_us,
        args.rounds,
        events / launches
    );
    println!("  {:<28} {:>10} {:>10}", "", "median", "min");
    println!(
        "  {:<28} {:>10.1} {:>10.1}",
        "untraced (us a step)", u.0, u.1
    );
    println!("  {:<28} {:>10.1} {:>10.1}", "traced (us a step)", t.0, t.1);
    println!(
        "  {:<28} {:>10.4} {:>10.4}   rounds' spread {:.4}-{:.4}",
        "traced / untraced", r.0, r.1, spread.0, spread.1
    );
    Ok(())
}
