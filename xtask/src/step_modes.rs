//! `--allocator`'s modes on the training-shaped loop (the step bench's last section): at 20 ms
//! a step, rounds interleave untraced, `always`, `auto` outside pressure (never armed), `auto`
//! armed (root's SIGUSR1 before the loop starts) and `auto` through pressure phases (armed for
//! the middle third of the timed steps by SIGUSR1 and SIGUSR2). The loop says which steps ran
//! armed (PyTorch's semaphores raised), tracer what carrying out the armings took.

use anyhow::{ensure, Result};
use serde_json::Value;

use crate::{
    bench::{send_signal, Tracer},
    step_bench::{self, median, spread, work_for, Loop, StepBenchArgs, WARMUP},
};

/// `cargo xtask bench-step` (and `bench`'s last part): the setups' sections unless
/// `--modes-only`, then `--allocator`'s modes unless `--no-modes`. The step files import one way: this one uses
/// step_bench.rs, which uses bench.rs.
pub fn run(args: StepBenchArgs) -> Result<()> {
    let l = step_bench::prepare(&args)?;
    if !args.modes_only {
        step_bench::sections(&l, &args)?;
    }
    if args.no_modes {
        return Ok(());
    }
    section(&l, &args)
}

const STEP_MS: f64 = 20.0;
/// `auto` outside pressure should cost at most this much (issue: always on at fleet scale).
const TARGET: f64 = 1.02;

#[derive(Clone, Copy, PartialEq, Eq)]
enum Mode {
    Untraced,
    Always,
    AutoQuiet,
    /// Outside pressure without the scheduler programs: what they cost there.
    AutoQuietNoSched,
    AutoArmed,
    AutoPhases,
}

const MODES: [Mode; 6] = [
    Mode::Untraced,
    Mode::Always,
    Mode::AutoQuiet,
    Mode::AutoQuietNoSched,
    Mode::AutoArmed,
    Mode::AutoPhases,
];

impl Mode {
    fn name(self) -> &'static str {
        match self {
            Mode::Untraced => "untraced",
            Mode::Always => "--allocator always",
            Mode::AutoQuiet => "auto, outside pressure",
            Mode::AutoQuietNoSched => "  the same, no sched",
            Mode::AutoArmed => "auto, armed (SIGUSR1)",
            Mode::AutoPhases => "auto, pressure phases",
        }
    }

    /// PyTorch's semaphores when the loop ends.
    fn semaphores_at_end(self) -> i64 {
        match self {
            Mode::Always | Mode::AutoArmed => 2,
            _ => 0,
        }
    }
}

/// One run's figures.
#[derive(Clone, Copy, Default)]
struct Run {
    step_ms: f64,
    steps: f64,
    armed_steps: f64,
    armed_ms: f64,
    unarmed_ms: f64,
    /// tracer's own: time carrying out armings, and how many armings and disarmings.
    carry_out_s: f64,
    changes: f64,
}

fn measure(l: &Loop, mode: Mode, work_ms: f64, steps: u32) -> Result<Run> {
    if mode == Mode::Untraced {
        return run_of(&l.run_once(work_ms, steps)?, &Value::Null);
    }
    let torch = l.sim.join("libsimtorch.so").display().to_string();
    let allocator = if mode == Mode::Always {
        "always"
    } else {
        "auto"
    };
    let mut flags = vec![
        "--lib",
        &torch,
        "--allocator",
        allocator,
        "--arm-min",
        "1ms",
        "--arm-quiet",
        "1h",
    ];
    if mode == Mode::AutoQuietNoSched {
        flags.push("--no-host-context");
    }
    let tracer = Tracer::start_with(&l.tracer, &l.db, &l.sim.join("libcudart.so.12"), &flags)?;
    if mode == Mode::AutoArmed {
        tracer.signal(libc::SIGUSR1);
        // Taken by the main thread (50 ms) and the registry (25 ms) before the loop starts.
        std::thread::sleep(std::time::Duration::from_millis(300));
    }
    let rep = std::thread::scope(|s| {
        if mode == Mode::AutoPhases {
            let third = std::time::Duration::from_secs_f64(f64::from(steps) * STEP_MS / 3e3);
            let warmup = std::time::Duration::from_secs_f64(f64::from(WARMUP) * STEP_MS / 1e3);
            let pid = tracer.pid();
            s.spawn(move || {
                std::thread::sleep(warmup + third);
                send_signal(pid, libc::SIGUSR1);
                std::thread::sleep(third);
                send_signal(pid, libc::SIGUSR2);
            });
        }
        l.run_once(work_ms, steps)
    });
    let summary = tracer.stop()?;
    let rep = rep?;
    ensure!(
        rep["semaphore"].as_i64() == Some(mode.semaphores_at_end()),
        "PyTorch's semaphores were {} at the end under {} (expected {})",
        rep["semaphore"],
        mode.name(),
        mode.semaphores_at_end()
    );
    run_of(&rep, &summary)
}

fn run_of(rep: &Value, summary: &Value) -> Result<Run> {
    let f = |v: &Value, k: &str| v[k].as_f64();
    let a = &summary["allocator"];
    let (Some(step_ms), Some(steps), Some(armed_steps), Some(armed), Some(unarmed)) = (
        f(rep, "step_ms_median"),
        f(rep, "steps"),
        f(rep, "armed_steps"),
        f(rep, "armed_ms_sum"),
        f(rep, "unarmed_ms_sum"),
    ) else {
        anyhow::bail!("train_step printed {rep}");
    };
    Ok(Run {
        step_ms,
        steps,
        armed_steps,
        armed_ms: if armed_steps > 0.0 {
            armed / armed_steps
        } else {
            0.0
        },
        unarmed_ms: if steps > armed_steps {
            unarmed / (steps - armed_steps)
        } else {
            0.0
        },
        carry_out_s: f(a, "carry_out_s").unwrap_or(0.0),
        changes: f(a, "armings").unwrap_or(0.0) + f(a, "disarmings").unwrap_or(0.0),
    })
}

pub(crate) fn section(l: &Loop, args: &StepBenchArgs) -> Result<()> {
    let work_ms = work_for(l, STEP_MS)?;
    // Long enough that each phase holds many steps.
    let steps = ((args.step_secs * 2e3 / STEP_MS).ceil() as u32).max(30);
    let mut runs: Vec<Vec<Run>> = vec![Vec::new(); MODES.len()];
    for round in 0..args.step_rounds {
        eprintln!(
            "bench: --allocator modes, round {}/{}",
            round + 1,
            args.step_rounds
        );
        for k in 0..MODES.len() {
            let i = (k + round) % MODES.len();
            runs[i].push(measure(l, MODES[i], work_ms, steps)?);
        }
    }
    print(steps, &runs);
    Ok(())
}

fn print(steps: u32, runs: &[Vec<Run>]) {
    let of = |m: Mode| &runs[MODES.iter().position(|&x| x == m).unwrap_or(0)];
    let untraced = of(Mode::Untraced);
    println!(
        "\n--allocator's modes at {STEP_MS} ms steps ({steps} timed steps a run, {} paired rounds; auto's phases: armed by SIGUSR1 a third into the timed steps, disarmed by SIGUSR2 a third later)",
        untraced.len()
    );
    println!(
        "  {:<28} {:>8}  {:<40} {:>12}",
        "mode", "step ms", "ratio to untraced, each round", "armed steps"
    );
    for (i, &mode) in MODES.iter().enumerate() {
        let r = &runs[i];
        let ratios: Vec<f64> = r
            .iter()
            .zip(untraced)
            .map(|(a, u)| a.step_ms / u.step_ms)
            .collect();
        let armed: f64 = r.iter().map(|x| x.armed_steps).sum::<f64>()
            / r.iter().map(|x| x.steps).sum::<f64>().max(1.0);
        println!(
            "  {:<28} {:>8.2}  {:<40} {:>11.0} %",
            mode.name(),
            median(r.iter().map(|x| x.step_ms).collect()),
            ratios
                .iter()
                .map(|x| format!("{x:.3}"))
                .collect::<Vec<_>>()
                .join(" "),
            armed * 100.0
        );
    }
    let ratio = |m: Mode| -> (f64, (f64, f64)) {
        let v: Vec<f64> = of(m)
            .iter()
            .zip(untraced)
            .map(|(a, u)| a.step_ms / u.step_ms)
            .collect();
        (median(v.clone()), spread(&v))
    };
    let (quiet, (lo, hi)) = ratio(Mode::AutoQuiet);
    println!(
        "  auto outside pressure   {quiet:.3}x untraced, rounds {lo:.3}-{hi:.3}   target <= {TARGET}"
    );
    let (no_sched, (lo, hi)) = ratio(Mode::AutoQuietNoSched);
    println!(
        "    without the scheduler programs {no_sched:.3}x, rounds {lo:.3}-{hi:.3} (they cost {:.3} of the step there)",
        quiet - no_sched
    );
    let (armed, (lo, hi)) = ratio(Mode::AutoArmed);
    println!("  auto armed              {armed:.3}x untraced, rounds {lo:.3}-{hi:.3}");
    let (always, (lo, hi)) = ratio(Mode::Always);
    println!("  always                  {always:.3}x untraced, rounds {lo:.3}-{hi:.3}");
    let phases = of(Mode::AutoPhases);
    let armed_ms = median(phases.iter().map(|x| x.armed_ms).collect());
    let unarmed_ms = median(phases.iter().map(|x| x.unarmed_ms).collect());
    let base = median(untraced.iter().map(|x| x.step_ms).collect());
    println!(
        "  pressure phases: armed steps {armed_ms:.2} ms ({:.3}x untraced), the others {unarmed_ms:.2} ms ({:.3}x), step means",
        armed_ms / base,
        unarmed_ms / base
    );
    let cycle_us: Vec<f64> = phases
        .iter()
        .filter(|x| x.changes >= 2.0)
        .map(|x| x.carry_out_s * 1e6 / (x.changes / 2.0))
        .collect();
    if !cycle_us.is_empty() {
        println!(
            "  one arm and disarm cycle: {:.0} us of tracer's main thread (raising and lowering the semaphores), median of {} runs",
            median(cycle_us.clone()),
            cycle_us.len()
        );
    }
}
