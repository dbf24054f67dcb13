//! The training-shaped bench (`cargo xtask bench`'s step section, or `cargo xtask bench-step`
//! alone): what tracer costs a training step, whole and part by part. The loop
//! (xtask/scripts/train_step.c) runs on the simulated runtime with libsimtorch.so's real USDT
//! sites: per step the tensor allocations of a window of a real PyTorch trace
//! (xtask/scripts/step_plan.py over ../shared/snapshots), the CUDA calls beside them, a
//! CPU-bound body in 20 slices each ending in a blocking wait, and a PyTorch job's threads.
//!
//! Rounds interleave the setups (their order turns each round): untraced, the floor (the same
//! probes, programs that only count), tracer without the scheduler programs, tracer, and tracer
//! --stack. Every round's ratios are printed with their spread; the parts come from the same
//! run: the traps (floor - untraced), the programs' own time (kernel BPF statistics, a run of
//! its own), the scheduler programs (tracer - tracer without them), tracer's own threads' CPU,
//! and what is left.

use std::{path::PathBuf, process::Command};

use anyhow::{anyhow, ensure, Context as _, Result};
use clap::Args;
use serde_json::Value;

use crate::bench::{bench_dirs, build_release, json_of, root, run_ok, stats, Tracer};

#[derive(Args, Clone)]
pub struct StepBenchArgs {
    /// Paired rounds at each step length.
    #[arg(long, default_value_t = 5)]
    pub step_rounds: usize,
    /// Seconds of timed steps per run.
    #[arg(long, default_value_t = 3.0)]
    pub step_secs: f64,
    /// Only the section of `--allocator`'s modes.
    #[arg(long)]
    pub modes_only: bool,
    /// Without the section of `--allocator`'s modes.
    #[arg(long, conflicts_with = "modes_only")]
    pub no_modes: bool,
    /// Only these step lengths (ms; 20 and 200 are measured).
    #[arg(long, value_delimiter = ',')]
    pub step_ms: Vec<f64>,
    /// Another build of tracer (a change's "before"): its plain trace and --stack join the
    /// rounds as setups of their own, paired with this build's in every round.
    #[arg(long)]
    pub before: Option<PathBuf>,
}

/// Step lengths measured (ms), with the ratio each should stay under.
const STEP_MS: [(f64, f64); 2] = [(20.0, 1.05), (200.0, 1.02)];
/// Allocator probe hits a step (malloc + free), as a GPT-2 step made on the H200.
const HITS: u32 = 1000;
pub(crate) const WARMUP: u32 = 5;

#[derive(Clone, Copy, PartialEq, Eq)]
enum Setup {
    Untraced,
    Floor,
    NoSched,
    Tracer,
    Stack,
    /// tracer with `--dump-on-oom`: armed, and no OOM happens (its cost should be none).
    Dump,
    /// tracer with no `--lib`: the kernel's notice of each library opened finds the job's (the
    /// openat programs run at every open on the machine; the main thread polls their ring).
    Discover,
    /// `--before`'s build, plain and with --stack.
    TracerBefore,
    StackBefore,
}

const SETUPS: [Setup; 7] = [
    Setup::Untraced,
    Setup::Floor,
    Setup::NoSched,
    Setup::Tracer,
    Setup::Stack,
    Setup::Dump,
    Setup::Discover,
];

/// The setups of this run: `--before`'s two with the rest when given.
fn setups(l: &Loop) -> Vec<Setup> {
    let mut all = SETUPS.to_vec();
    if l.before.is_some() {
        all.extend([Setup::TracerBefore, Setup::StackBefore]);
    }
    all
}

/// Where the `--dump-on-oom` setup's dumps would go: root's own folder, mode 0700.
const DUMP_DIR: &str = "/tmp/tracer-bench-dumps";

impl Setup {
    fn name(self) -> &'static str {
        match self {
            Setup::Untraced => "untraced",
            Setup::Floor => "floor",
            Setup::NoSched => "tracer, no sched",
            Setup::Tracer => "tracer",
            Setup::Stack => "tracer --stack",
            Setup::Dump => "--dump-on-oom",
            Setup::Discover => "discovering",
            Setup::TracerBefore => "tracer (before)",
            Setup::StackBefore => "--stack (before)",
        }
    }

    fn flags(self) -> Option<&'static [&'static str]> {
        match self {
            Setup::Untraced => None,
            Setup::Floor => Some(&["--floor"]),
            Setup::NoSched => Some(&["--no-host-context"]),
            Setup::Tracer => Some(&[]),
            Setup::Stack => Some(&["--stack"]),
            Setup::Dump => Some(&["--dump-on-oom", DUMP_DIR]),
            Setup::Discover => Some(&[]),
            Setup::TracerBefore => Some(&[]),
            Setup::StackBefore => Some(&["--stack"]),
        }
    }
}

pub(crate) struct Loop {
    pub(crate) tracer: PathBuf,
    /// `--before`'s build.
    before: Option<PathBuf>,
    pub(crate) sim: PathBuf,
    exe: PathBuf,
    plan: PathBuf,
    pub(crate) db: PathBuf,
    units_per_ms: f64,
}

/// One run's figures.
#[derive(Clone, Copy, Default)]
struct Run {
    step_ms: f64,
    job_cpu_ms: f64,
    /// Events tracer stored a step (0 untraced or on the floor).
    events: f64,
    tracer_cpu_ms: f64,
    /// Steps the run made, warm-up included (the probes fire in those too).
    steps_made: u32,
}

impl Loop {
    pub(crate) fn run_once(&self, work_ms: f64, steps: u32) -> Result<Value> {
        let out = Command::new(&self.exe)
            .arg(&self.plan)
            .arg(format!("{:.0}", self.units_per_ms))
            .arg(format!("{work_ms:.3}"))
            .arg(steps.to_string())
            .arg(WARMUP.to_string())
            .output()
            .context("run train_step")?;
        json_of(out, "train_step")
    }

    /// One run of `steps` under `setup` (tracer given `extra` too), and the tracer's summary.
    fn measure(
        &self,
        setup: Setup,
        work_ms: f64,
        steps: u32,
        extra: &[&str],
    ) -> Result<(Run, Value)> {
        let Some(flags) = setup.flags() else {
            let rep = self.run_once(work_ms, steps)?;
            return Ok((run_of(&rep, steps)?, Value::Null));
        };
        let torch = self.sim.join("libsimtorch.so").display().to_string();
        let binary = match (setup, &self.before) {
            (Setup::TracerBefore | Setup::StackBefore, Some(before)) => before,
            _ => &self.tracer,
        };
        let tracer = if setup == Setup::Discover {
            let all: Vec<&str> = flags.iter().chain(extra).copied().collect();
            Tracer::start_discovering(binary, &self.db, &all)?
        } else {
            let all: Vec<&str> = ["--lib", torch.as_str()]
                .into_iter()
                .chain(flags.iter().copied())
                .chain(extra.iter().copied())
                .collect();
            Tracer::start_with(binary, &self.db, &self.sim.join("libcudart.so.12"), &all)?
        };
        let cpu0 = tracer.cpu_s();
        let rep = self.run_once(work_ms, steps);
        let cpu = tracer.cpu_s() - cpu0;
        let summary = tracer.stop()?;
        let rep = rep?;
        ensure!(
            rep["semaphore"].as_i64() == Some(2),
            "the pytorch semaphores were {} under {} (expected 2)",
            rep["semaphore"],
            setup.name()
        );
        let mut run = run_of(&rep, steps)?;
        let stored = summary["counters"]["events_stored"].as_f64().unwrap_or(0.0);
        let dropped = summary["counters"]["dropped_ring_full"]
            .as_i64()
            .unwrap_or(-1);
        ensure!(dropped == 0, "{} dropped {dropped} events", setup.name());
        run.events = stored / f64::from(steps + WARMUP);
        run.tracer_cpu_ms = cpu * 1e3 / f64::from(steps);
        Ok((run, summary))
    }
}

fn run_of(rep: &Value, steps: u32) -> Result<Run> {
    let get = |k: &str| {
        rep[k]
            .as_f64()
            .ok_or_else(|| anyhow!("train_step printed no {k}: {rep}"))
    };
    Ok(Run {
        step_ms: get("step_ms_mean")?,
        job_cpu_ms: get("cpu_s")? * 1e3 / f64::from(steps),
        steps_made: steps + WARMUP,
        ..Run::default()
    })
}

/// The median of one setup's rounds (bench.rs's `stats`).
pub(crate) fn median(v: Vec<f64>) -> f64 {
    stats(v).0
}

pub(crate) fn spread(v: &[f64]) -> (f64, f64) {
    let lo = v.iter().copied().fold(f64::INFINITY, f64::min);
    let hi = v.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    (lo, hi)
}

fn setup_loop(before: Option<PathBuf>) -> Result<Loop> {
    let root = root();
    build_release(&root)?;
    let (sim, tmp) = bench_dirs(&root)?;
    let exe = tmp.join("train_step");
    run_ok(
        Command::new("cc")
            .args(["-O2", "-pthread", "-o"])
            .arg(&exe)
            .arg(root.join("xtask/scripts/train_step.c"))
            .arg(format!("-L{}", sim.display()))
            .args(["-l:libcudart.so.12", "-l:libsimtorch.so"])
            .arg(format!("-Wl,-rpath,{}", sim.display())),
    )
    .context("build the training-shaped loop")?;
    let snapshot = root
        .join("../shared/snapshots")
        .join("kkaitlyn111-cs336-a2-systems-c1272e18-memory_ctx128_fullstep_.pickle");
    let plan = tmp.join("step_plan.txt");
    let out = Command::new("python3")
        .arg(root.join("xtask/scripts/step_plan.py"))
        .arg(&snapshot)
        .arg(HITS.to_string())
        .output()
        .context("run xtask/scripts/step_plan.py")?;
    ensure!(
        out.status.success(),
        "step_plan.py over {} failed: {}",
        snapshot.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    std::fs::write(&plan, &out.stdout).with_context(|| format!("write {}", plan.display()))?;
    let cal = Command::new(&exe).arg("calibrate").output()?;
    let units_per_ms: f64 = String::from_utf8_lossy(&cal.stdout)
        .trim()
        .parse()
        .context("read train_step's calibration")?;
    if let Some(before) = &before {
        ensure!(
            before.is_file(),
            "--before {}: no such build of tracer",
            before.display()
        );
    }
    Ok(Loop {
        tracer: root.join("target/release/tracer"),
        before,
        sim,
        exe,
        plan,
        db: tmp.join("step.db"),
        units_per_ms,
    })
}

/// The body's work that makes an untraced step last `step_ms` (the waits and hand-offs take
/// the rest): two untraced runs, a line through them.
pub(crate) fn work_for(l: &Loop, step_ms: f64) -> Result<f64> {
    let steps = (1000.0 / step_ms).ceil().max(5.0) as u32;
    let (w0, w1) = (step_ms * 0.4, step_ms * 0.8);
    let t0 = run_of(&l.run_once(w0, steps)?, steps)?.step_ms;
    let t1 = run_of(&l.run_once(w1, steps)?, steps)?.step_ms;
    let slope = ((t1 - t0) / (w1 - w0)).max(0.1);
    Ok((w1 + (step_ms - t1) / slope).max(step_ms * 0.1))
}

/// The loop built and calibrated, and the dump setup's folder made.
pub(crate) fn prepare(args: &StepBenchArgs) -> Result<Loop> {
    ensure!(args.step_rounds >= 1, "--step-rounds must be at least 1");
    let l = setup_loop(args.before.clone())?;
    dump_dir()?;
    Ok(l)
}

/// The setups' sections, one per step length (step_modes.rs runs them, then its own).
pub(crate) fn sections(l: &Loop, args: &StepBenchArgs) -> Result<()> {
    for (step_ms, target) in STEP_MS {
        if args.step_ms.is_empty() || args.step_ms.contains(&step_ms) {
            section(l, args, step_ms, target)?;
        }
    }
    Ok(())
}

/// The dump setup's folder, made fresh as root's own with mode 0700 (tracer refuses any other).
fn dump_dir() -> Result<()> {
    use std::os::unix::fs::DirBuilderExt as _;
    let _ = std::fs::remove_dir_all(DUMP_DIR);
    std::fs::DirBuilder::new()
        .mode(0o700)
        .create(DUMP_DIR)
        .with_context(|| format!("create the dump setup's folder {DUMP_DIR}"))
}

fn section(l: &Loop, args: &StepBenchArgs, step_ms: f64, target: f64) -> Result<()> {
    let work_ms = work_for(l, step_ms)?;
    let steps = ((args.step_secs * 1e3 / step_ms).ceil() as u32).max(10);
    let all = setups(l);
    let mut runs: Vec<Vec<Run>> = vec![Vec::new(); all.len()];
    for round in 0..args.step_rounds {
        eprintln!(
            "bench: steps of {step_ms} ms, round {}/{}",
            round + 1,
            args.step_rounds
        );
        for k in 0..all.len() {
            let i = (k + round) % all.len();
            runs[i].push(l.measure(all[i], work_ms, steps, &[])?.0);
        }
    }
    eprintln!("bench: steps of {step_ms} ms, the programs' own time");
    // The programs' own time, a run of its own per build and mode (statistics cost a little).
    let mut stats = Vec::new();
    for setup in [
        Setup::Tracer,
        Setup::Stack,
        Setup::TracerBefore,
        Setup::StackBefore,
    ] {
        if all.contains(&setup) {
            let (run, summary) = l.measure(setup, work_ms, steps, &["--program-stats"])?;
            stats.push((setup, run, summary));
        }
    }
    let ctx = Section {
        all: &all,
        runs: &runs,
        stats: &stats,
    };
    print_section(step_ms, target, steps, &ctx);
    if step_ms == STEP_MS[0].0 {
        usdt_parts(l, work_ms, steps, &stats)?;
    }
    Ok(())
}

/// usdt_hit part by part: a statistics run for the floor (the program returns at its first
/// test) and for each `--usdt-parts`, then the whole program (the plain trace's run).
fn usdt_parts(l: &Loop, work_ms: f64, steps: u32, stats: &[(Setup, Run, Value)]) -> Result<()> {
    eprintln!("bench: usdt_hit part by part");
    let ns_of = |run: &Run, summary: &Value| {
        program_times(run, summary)
            .into_iter()
            .find(|(name, ..)| name == "usdt_hit")
            .map_or(0.0, |(_, ns, _)| ns)
    };
    let mut rows = Vec::new();
    let (run, summary) = l.measure(Setup::Floor, work_ms, steps, &["--program-stats"])?;
    rows.push(("floor: paused? counted, returns", ns_of(&run, &summary)));
    for (k, what) in [
        (1, "+ the site's plan (attach cookie)"),
        (2, "+ the thread, the stage claimed"),
        (3, "+ the clock, the event begun"),
        (4, "+ the arguments read"),
    ] {
        let parts = k.to_string();
        let (run, summary) = l.measure(
            Setup::Tracer,
            work_ms,
            steps,
            &["--usdt-parts", &parts, "--program-stats"],
        )?;
        rows.push((what, ns_of(&run, &summary)));
    }
    if let Some((_, run, summary)) = stats.iter().find(|(s, ..)| *s == Setup::Tracer) {
        rows.push(("+ to the stage (the whole program)", ns_of(run, summary)));
    }
    println!("  usdt_hit part by part, ns a run (a statistics run each; the kernel's own timing is in every figure):");
    let mut before = 0.0;
    for (what, ns) in rows {
        println!("    {what:<40} {ns:>6.0}   {:>+6.0}", ns - before);
        before = ns;
    }
    Ok(())
}

/// One step length's figures: every setup's rounds and the statistics runs.
struct Section<'a> {
    all: &'a [Setup],
    runs: &'a [Vec<Run>],
    stats: &'a [(Setup, Run, Value)],
}

impl Section<'_> {
    fn of(&self, s: Setup) -> &[Run] {
        self.all
            .iter()
            .position(|&x| x == s)
            .map_or(&[], |i| &self.runs[i])
    }

    fn step(&self, s: Setup) -> f64 {
        median(self.of(s).iter().map(|r| r.step_ms).collect())
    }

    fn tracer_cpu(&self, s: Setup) -> f64 {
        median(self.of(s).iter().map(|r| r.tracer_cpu_ms).collect())
    }

    fn job_cpu(&self, s: Setup) -> f64 {
        median(self.of(s).iter().map(|r| r.job_cpu_ms).collect())
    }

    /// Each round's step over the same round's untraced one.
    fn ratios(&self, s: Setup) -> Vec<f64> {
        self.of(s)
            .iter()
            .zip(self.of(Setup::Untraced))
            .map(|(a, u)| a.step_ms / u.step_ms)
            .collect()
    }
}

fn print_section(step_ms: f64, target: f64, steps: u32, c: &Section) {
    let untraced = c.of(Setup::Untraced);
    let events = median(c.of(Setup::Tracer).iter().map(|r| r.events).collect());
    println!(
        "\ntraining-shaped steps of {step_ms:.0} ms ({steps} timed steps a run, {} paired rounds; {events:.0} events a step: {HITS} allocator probe hits, the rest CUDA calls)",
        untraced.len()
    );
    println!(
        "  {:<18} {:>9} {:>9} {:>9}   {:<34} {:>9}",
        "setup", "step ms", "job CPU", "tracer", "ratio to untraced, each round", "us/event"
    );
    for (i, setup) in c.all.iter().enumerate() {
        let r = &c.runs[i];
        let per_event: Vec<f64> = r
            .iter()
            .zip(untraced)
            .map(|(a, u)| (a.step_ms - u.step_ms) * 1e3 / events)
            .collect();
        let each: Vec<String> = c.ratios(*setup).iter().map(|x| format!("{x:.3}")).collect();
        println!(
            "  {:<18} {:>9.2} {:>9.2} {:>9.2}   {:<34} {:>9}",
            setup.name(),
            c.step(*setup),
            c.job_cpu(*setup),
            c.tracer_cpu(*setup),
            each.join(" "),
            if *setup == Setup::Untraced {
                String::new()
            } else {
                format!("{:.2}", median(per_event))
            },
        );
    }
    for (s, note) in [
        (Setup::Floor, "the probes alone".to_owned()),
        (Setup::Tracer, format!("target <= {target:.2}")),
        (Setup::Stack, String::new()),
        (Setup::TracerBefore, String::new()),
        (Setup::StackBefore, String::new()),
    ] {
        if !c.all.contains(&s) {
            continue;
        }
        let r = c.ratios(s);
        let (lo, hi) = spread(&r);
        println!(
            "  {:<18} {:>9.3}x untraced, rounds {lo:.3}-{hi:.3}   {note}",
            s.name(),
            median(r)
        );
    }
    print_against_tracer(c);
    // Per event against the floor, round by round: (tracer - untraced) / (floor - untraced).
    let per_round: Vec<f64> = c
        .of(Setup::Tracer)
        .iter()
        .zip(c.of(Setup::Floor))
        .zip(untraced)
        .filter(|((_, f), u)| f.step_ms > u.step_ms)
        .map(|((t, f), u)| (t.step_ms - u.step_ms) / (f.step_ms - u.step_ms))
        .collect();
    if !per_round.is_empty() {
        let (lo, hi) = spread(&per_round);
        println!(
            "  tracer/floor per event {:>6.2}, rounds {lo:.2}-{hi:.2} ({} rounds where the floor cost anything)",
            median(per_round.clone()),
            per_round.len()
        );
    }
    print_parts(c, events);
    print_stack_parts(c, events);
}

/// Armed and no OOM, and discovery in the kernel, each against tracer given its libraries,
/// round by round (the "nothing measurable" is this ratio inside tracer's own rounds'
/// spread).
fn print_against_tracer(c: &Section) {
    let (tlo, thi) = spread(&c.ratios(Setup::Tracer));
    for (s, name) in [
        (Setup::Dump, "--dump-on-oom"),
        (Setup::Discover, "discovering"),
    ] {
        let against: Vec<f64> = c
            .of(s)
            .iter()
            .zip(c.of(Setup::Tracer))
            .map(|(d, t)| d.step_ms / t.step_ms)
            .collect();
        let (lo, hi) = spread(&against);
        println!(
            "  {name:<18} {:>9.3}x tracer --lib, rounds {lo:.3}-{hi:.3}   tracer's own rounds span {:.3}",
            median(against),
            thi / tlo
        );
    }
}

/// The programs' own time from a statistics run: (name, ns a run, ms a step).
fn program_times(run: &Run, stats: &Value) -> Vec<(String, f64, f64)> {
    let programs = stats["programs"].as_array().cloned().unwrap_or_default();
    let steps_run = f64::from(run.steps_made);
    let session_s = stats["elapsed_s"].as_f64().unwrap_or(1.0).max(1e-3);
    let mut out = Vec::new();
    for p in &programs {
        let name = p["name"].as_str().unwrap_or("?");
        let runs = p["runs"].as_f64().unwrap_or(0.0);
        if runs == 0.0 {
            continue;
        }
        let total_ms = p["run_time_ns"].as_f64().unwrap_or(0.0) / 1e6;
        // The scheduler programs and the stage flush run the whole session, on every CPU:
        // per second of it, scaled to a step; the probes' programs run only in steps.
        let per_step = if name.starts_with("sched_") || name == "flush_stage" {
            total_ms / session_s * run.step_ms / 1e3
        } else {
            total_ms / steps_run
        };
        out.push((
            name.to_owned(),
            p["ns_per_run"].as_f64().unwrap_or(0.0),
            per_step,
        ));
    }
    out
}

fn stats_of(c: &Section, s: Setup) -> Option<Vec<(String, f64, f64)>> {
    c.stats
        .iter()
        .find(|(setup, ..)| *setup == s)
        .map(|(_, run, stats)| program_times(run, stats))
}

fn print_parts(c: &Section, events: f64) {
    let us_event = |ms: f64| ms * 1e3 / events;
    println!("  the parts, ms a step (us an event):");
    let traps = c.step(Setup::Floor) - c.step(Setup::Untraced);
    println!(
        "    traps and empty programs (floor - untraced)      {traps:>7.3} ({:.2})",
        us_event(traps)
    );
    for (name, ns, per_step) in stats_of(c, Setup::Tracer).unwrap_or_default() {
        println!(
            "    program {name:<20} {ns:>6.0} ns a run    {per_step:>7.3} ({:.2})",
            us_event(per_step)
        );
    }
    let sched = c.step(Setup::Tracer) - c.step(Setup::NoSched);
    println!(
        "    scheduler programs (tracer - no sched)           {sched:>7.3} ({:.2})",
        us_event(sched)
    );
    let tracer_cpu = c.tracer_cpu(Setup::Tracer);
    println!(
        "    tracer's threads' CPU (reader, registry, writer) {tracer_cpu:>7.3} ({:.2}), on cores the job shares",
        us_event(tracer_cpu)
    );
    let job_cpu = c.job_cpu(Setup::Tracer) - c.job_cpu(Setup::Floor);
    println!(
        "    the job's own CPU above the floor's              {job_cpu:>7.3} ({:.2}): the programs' work in its threads",
        us_event(job_cpu)
    );
    let above = c.step(Setup::Tracer) - c.step(Setup::Floor);
    println!(
        "    tracer above the floor, whole step               {above:>7.3} ({:.2}); the rest ({:.3}) is waiting for a core",
        us_event(above),
        above - job_cpu
    );
}

/// What --stack adds to the plain trace, part by part, for this build and `--before`'s.
fn print_stack_parts(c: &Section, events: f64) {
    let us_event = |ms: f64| ms * 1e3 / events;
    for (plain, stack, build) in [
        (Setup::Tracer, Setup::Stack, "this build"),
        (Setup::TracerBefore, Setup::StackBefore, "before"),
    ] {
        if !c.all.contains(&stack) {
            continue;
        }
        println!("  --stack above the plain trace, {build}, ms a step (us an event):");
        let whole = c.step(stack) - c.step(plain);
        let above: Vec<f64> = c
            .of(stack)
            .iter()
            .zip(c.of(plain))
            .map(|(s, t)| us_event(s.step_ms - t.step_ms))
            .collect();
        let (lo, hi) = spread(&above);
        println!(
            "    whole step                                       {whole:>7.3} ({:.2}; rounds {lo:.2} to {hi:.2})",
            us_event(whole)
        );
        let programs = |s: Setup, name: &str| {
            stats_of(c, s)
                .unwrap_or_default()
                .into_iter()
                .find(|(n, ..)| n == name)
                .map_or((0.0, 0.0), |(_, ns, ms)| (ns, ms))
        };
        let (plain_ns, plain_ms) = programs(plain, "usdt_hit");
        let (stack_ns, stack_ms) = programs(stack, "usdt_hit");
        println!(
            "    usdt_hit with the call-site programs  {stack_ns:>6.0} ns a run (plain {plain_ns:.0})  {:>7.3} ({:.2})",
            stack_ms - plain_ms,
            us_event(stack_ms - plain_ms)
        );
        let job = c.job_cpu(stack) - c.job_cpu(plain);
        println!(
            "    the job's own CPU                                {job:>7.3} ({:.2})",
            us_event(job)
        );
        let cpu = c.tracer_cpu(stack) - c.tracer_cpu(plain);
        println!(
            "    tracer's threads' CPU                            {cpu:>7.3} ({:.2}); all of it {:.3} ({:.2})",
            us_event(cpu),
            c.tracer_cpu(stack),
            us_event(c.tracer_cpu(stack))
        );
    }
}
