//! `cargo xtask bench`: what tracing costs, measured side by side in one run, at the probe sites
//! users have (every probed site's first instruction is checked: a ratio over a single-stepped
//! site is refused). Rounds interleave every setup of every workload:
//! - cudaMalloc + cudaFree pairs on the simulated runtime (zero simulated latency): untraced, the
//!   floor (the same probes, programs that only count), the floor with the two clock reads a
//!   call's duration needs, tracer, tracer --stack, and bpftrace doing comparable work;
//! - the same loop over the real libcudart.so.12 from PyPI (no GPU: every call returns 35, so the
//!   real entry and return sites on the error path): untraced, floor, tracer;
//! - the pairs from Python (ctypes) 20 frames deep: untraced, floor, tracer, tracer --stack;
//! - a USDT site built with sys/sdt.h (semaphore-gated, as PyTorch's): untraced, and the floor
//!   for such a site (bpftrace attached with an empty action).
//!
//! Then the eBPF programs' own time per pair (kernel BPF statistics, runs of their own), and two
//! producer threads at full speed: events stored per second, drops, tracer CPU, bytes per event.
//! Costs are the workload's CPU time (user + kernel: the probes run in it).
//!
//! Over 700 lines because every setup of every workload is run and printed here, side by side, so
//! that the ratios come from one run.

use std::{
    io::{BufRead as _, BufReader},
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    sync::mpsc,
    time::Duration,
};

use anyhow::{anyhow, ensure, Context as _, Result};
use clap::Args;
use serde_json::Value;

use crate::prologue;

#[derive(Args)]
pub struct BenchArgs {
    /// cudaMalloc + cudaFree pairs per run (Python runs a quarter, the USDT loop 4x as many hits).
    #[arg(long, default_value_t = 1_000_000)]
    iters: u64,
    /// Rounds, each running every setup once (the median and the minimum are reported).
    #[arg(long, default_value_t = 5)]
    runs: usize,
    /// Seconds of the two-thread throughput run.
    #[arg(long, default_value_t = 10)]
    throughput_secs: u64,
}

pub fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("workspace root")
        .to_owned()
}

pub fn run_ok(cmd: &mut Command) -> Result<()> {
    let status = cmd.status().with_context(|| format!("run {cmd:?}"))?;
    ensure!(status.success(), "{cmd:?} failed: {status}");
    Ok(())
}

/// The simulated runtime built for benchmarks, and the benchmarks' scratch folder.
pub fn bench_dirs(root: &Path) -> Result<(PathBuf, PathBuf)> {
    let sim = root.join("target/simcuda-bench");
    run_ok(
        Command::new("bash")
            .arg(root.join("demos/simcuda/build.sh"))
            .arg(&sim)
            .stdout(Stdio::null()),
    )?;
    let tmp = root.join("target/bench");
    std::fs::create_dir_all(&tmp)?;
    Ok((sim, tmp))
}

pub fn build_release(root: &Path) -> Result<()> {
    run_ok(
        Command::new("cargo")
            .args(["build", "--release", "--locked", "-p", "tracer-cli"])
            .current_dir(root),
    )
}

struct Paths {
    tracer: PathBuf,
    sim: PathBuf,
    real: PathBuf,
    usdt: PathBuf,
    tmp: PathBuf,
}

impl Paths {
    fn sim_lib(&self) -> PathBuf {
        self.sim.join("libcudart.so.12")
    }
}

/// A workload: what it runs, and how to count its cost.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Workload {
    /// simdriver pairs on the simulated runtime.
    Sim,
    /// simdriver pairs on the real runtime (error path).
    Real,
    /// Python ctypes pairs, 20 frames deep.
    Python,
}

pub(crate) fn json_of(out: std::process::Output, what: &str) -> Result<Value> {
    ensure!(
        out.status.success(),
        "{what} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).with_context(|| format!("read {what}'s JSON"))
}

/// CPU ns per pair (per hit for the USDT loop) of one run of the workload.
fn workload_ns(p: &Paths, w: Workload, iters: u64) -> Result<f64> {
    let (out, per) = match w {
        Workload::Sim | Workload::Real => {
            let mut cmd = Command::new(p.sim.join("simdriver"));
            cmd.env("SIMCUDA_LATENCY", "default=0")
                .args(["--iters", &iters.to_string()]);
            if w == Workload::Real {
                cmd.arg("--cudart")
                    .arg(&p.real)
                    .args(["--cuda", "none", "--mix", "real-pairs"]);
            } else {
                cmd.args(["--mix", "pairs"]);
            }
            (cmd.output().context("run simdriver")?, iters)
        }
        Workload::Python => {
            let n = (iters / 4).max(1000);
            let out = Command::new("python3")
                .arg(root().join("xtask/scripts/py_pairs.py"))
                .arg(p.sim_lib())
                .arg(n.to_string())
                .args(["20", "1.5"])
                .output()
                .context("run xtask/scripts/py_pairs.py")?;
            (out, n)
        }
    };
    let rep = json_of(out, "the workload")?;
    Ok(rep["cpu_s"].as_f64().ok_or_else(|| anyhow!("no cpu_s"))? * 1e9 / per as f64)
}

/// kill(2) on a child of ours (a pid from [`Tracer::pid`]).
pub(crate) fn send_signal(pid: u32, signal: i32) {
    // SAFETY: kill(2) has no memory effects; the pid is our own child's.
    unsafe { libc::kill(pid as i32, signal) };
}

/// A running `tracer trace --json`, attached.
pub(crate) struct Tracer {
    child: Child,
    lines: mpsc::Receiver<String>,
}

impl Tracer {
    fn start(p: &Paths, lib: &Path, extra: &[&str]) -> Result<Tracer> {
        Tracer::start_with(&p.tracer, &p.tmp.join("bench.db"), lib, extra)
    }

    /// `tracer trace --json --quiet --lib LIB --db DB EXTRA...` (a fresh database).
    pub(crate) fn start_with(
        tracer: &Path,
        db: &Path,
        lib: &Path,
        extra: &[&str],
    ) -> Result<Tracer> {
        Tracer::start_args(tracer, db, Some(lib), extra)
    }

    /// `tracer trace` with no `--lib`: discovery finds what the job loads.
    pub(crate) fn start_discovering(tracer: &Path, db: &Path, extra: &[&str]) -> Result<Tracer> {
        Tracer::start_args(tracer, db, None, extra)
    }

    fn start_args(tracer: &Path, db: &Path, lib: Option<&Path>, extra: &[&str]) -> Result<Tracer> {
        for suffix in ["", "-wal", "-shm"] {
            let _ = std::fs::remove_file(format!("{}{suffix}", db.display()));
        }
        let mut cmd = Command::new(tracer);
        cmd.args(["trace", "--quiet", "--json"]);
        if let Some(lib) = lib {
            cmd.arg("--lib").arg(lib);
        }
        let mut child = cmd
            .arg("--db")
            .arg(db)
            .args(extra)
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .context("start tracer trace")?;
        let stdout = child.stdout.take().ok_or_else(|| anyhow!("no stdout"))?;
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                let _ = tx.send(line);
            }
        });
        let started = lines
            .recv_timeout(Duration::from_secs(60))
            .context("tracer trace did not start")?;
        ensure!(
            started.contains("\"started\""),
            "tracer trace printed {started}"
        );
        Ok(Tracer { child, lines })
    }

    /// Sends it `signal` (SIGUSR1 and SIGUSR2 arm and disarm `--allocator auto`).
    pub(crate) fn signal(&self, signal: i32) {
        send_signal(self.child.id(), signal);
    }

    pub(crate) fn pid(&self) -> u32 {
        self.child.id()
    }

    /// CPU seconds its threads have used so far (the reader, registry and writer): the
    /// scheduler's nanoseconds on a CPU, summed over its threads.
    pub(crate) fn cpu_s(&self) -> f64 {
        let tasks = std::fs::read_dir(format!("/proc/{}/task", self.child.id()));
        let ns: u64 = tasks
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|t| std::fs::read_to_string(t.path().join("schedstat")).ok())
            .filter_map(|s| s.split_whitespace().next()?.parse::<u64>().ok())
            .sum();
        ns as f64 / 1e9
    }

    /// Stops it; its summary.
    pub(crate) fn stop(mut self) -> Result<Value> {
        // SAFETY: kill(2) on our own child.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGINT) };
        let status = self.child.wait()?;
        ensure!(status.success(), "tracer trace ended with {status}");
        let line = self
            .lines
            .recv_timeout(Duration::from_secs(10))
            .context("tracer trace printed no summary")?;
        wait_for_probe_removal()?;
        Ok(serde_json::from_str(&line)?)
    }
}

/// Waits until no `tracer-detach` process is left: tracer exits at once and leaves the
/// kernel's removal of its (paused) probes to one, and a run measured before it ends would
/// still pay for their traps.
fn wait_for_probe_removal() -> Result<()> {
    let deadline = std::time::Instant::now() + Duration::from_secs(120);
    let removing = || {
        std::fs::read_dir("/proc")
            .into_iter()
            .flatten()
            .flatten()
            .any(|entry| {
                std::fs::read_to_string(entry.path().join("comm"))
                    .is_ok_and(|comm| comm.trim_end() == "tracer-detach")
            })
    };
    while removing() {
        ensure!(
            std::time::Instant::now() < deadline,
            "the probes of a stopped tracer were still being removed after 120 s"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok(())
}

/// One run of the workload under a tracer setup (`None`: untraced); its cost and the tracer's
/// summary.
fn run_setup(p: &Paths, w: Workload, iters: u64, setup: Option<&[&str]>) -> Result<(f64, Value)> {
    let lib = if w == Workload::Real {
        p.real.clone()
    } else {
        p.sim_lib()
    };
    let Some(extra) = setup else {
        return Ok((workload_ns(p, w, iters)?, Value::Null));
    };
    let tracer = Tracer::start(p, &lib, extra)?;
    let ns = workload_ns(p, w, iters);
    let summary = tracer.stop()?;
    Ok((ns?, summary))
}

/// bpftrace doing comparable work on the simulated runtime (pair entry and return, read the
/// out-pointer, a pointer -> size map, a line per call): ns per pair, and the calls it printed.
fn bpftrace_pair_ns(p: &Paths, iters: u64) -> Result<(f64, u64)> {
    let lib = p.sim_lib();
    let lib = lib.display();
    let script = format!(
        r#"
uprobe:{lib}:cudaMalloc {{ @out[tid] = arg0; @sz[tid] = arg1; @t0[tid] = nsecs; }}
uretprobe:{lib}:cudaMalloc /@t0[tid]/ {{
  $ptr = *(uint64 *)@out[tid];
  @allocs[pid, $ptr] = @sz[tid];
  printf("%d %d cudaMalloc %lu %lu %d %lu\n", pid, tid, $ptr, @sz[tid], retval, nsecs - @t0[tid]);
  delete(@t0[tid]); delete(@out[tid]); delete(@sz[tid]);
}}
uprobe:{lib}:cudaFree {{ @fp[tid] = arg0; @ft[tid] = nsecs; }}
uretprobe:{lib}:cudaFree /@ft[tid]/ {{
  printf("%d %d cudaFree %lu %lu %d %lu\n", pid, tid, @fp[tid], @allocs[pid, @fp[tid]], retval, nsecs - @ft[tid]);
  delete(@allocs[pid, @fp[tid]]); delete(@ft[tid]); delete(@fp[tid]);
}}
"#
    );
    let out = p.tmp.join("peer.out");
    let ns = with_bpftrace(p, &script, &out, || workload_ns(p, Workload::Sim, iters))?;
    let text = std::fs::read_to_string(&out).unwrap_or_default();
    let recorded = text
        .lines()
        .filter(|l| l.contains(" cudaMalloc ") || l.contains(" cudaFree "))
        .count() as u64;
    Ok((ns, recorded))
}

/// Runs `f` while bpftrace runs `script` (output to `out`).
fn with_bpftrace<T>(
    p: &Paths,
    script: &str,
    out: &Path,
    f: impl FnOnce() -> Result<T>,
) -> Result<T> {
    let script_path = p.tmp.join("peer.bt");
    std::fs::write(&script_path, script)?;
    let _ = std::fs::remove_file(out);
    let mut child = Command::new("bpftrace")
        .arg("-o")
        .arg(out)
        .arg(&script_path)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .context("spawn bpftrace (apt-get install bpftrace)")?;
    // bpftrace writes "Attaching N probes..." to its output file once attached.
    for _ in 0..600 {
        if std::fs::read_to_string(out).is_ok_and(|s| s.contains("Attaching")) {
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    std::thread::sleep(Duration::from_millis(500));
    let result = f();
    // SAFETY: kill(2) on our own child.
    unsafe { libc::kill(child.id() as i32, libc::SIGINT) };
    child.wait()?;
    result
}

/// CPU ns per hit of the USDT loop, untraced or with bpftrace's empty program at the site.
fn usdt_hit_ns(p: &Paths, hits: u64, traced: bool) -> Result<f64> {
    let run = || -> Result<f64> {
        let out = Command::new(&p.usdt)
            .arg(hits.to_string())
            .arg(if traced { "0.5" } else { "0" })
            .output()
            .context("run the USDT loop")?;
        let rep = json_of(out, "the USDT loop")?;
        ensure!(
            rep["semaphore"].as_i64() == Some(i64::from(traced)),
            "the USDT semaphore was {} (expected {}): the site did not fire as asked",
            rep["semaphore"],
            i64::from(traced)
        );
        Ok(rep["cpu_s"].as_f64().ok_or_else(|| anyhow!("no cpu_s"))? * 1e9 / hits as f64)
    };
    if !traced {
        return run();
    }
    let script = format!("usdt:{}:tracer_bench:hit {{ }}\n", p.usdt.display());
    with_bpftrace(p, &script, &p.tmp.join("usdt.out"), run)
}

/// (median, minimum).
pub(crate) fn stats(mut v: Vec<f64>) -> (f64, f64) {
    v.sort_by(|a, b| a.total_cmp(b));
    (v[v.len() / 2], v[0])
}

/// Samples of one setup over the rounds.
#[derive(Default)]
pub(crate) struct Samples(Vec<f64>);

impl Samples {
    pub(crate) fn push(&mut self, v: f64) {
        self.0.push(v);
    }

    pub(crate) fn get(&self) -> (f64, f64) {
        stats(self.0.clone())
    }

    /// (least, greatest).
    pub(crate) fn spread(&self) -> (f64, f64) {
        let least = self.0.iter().copied().fold(f64::INFINITY, f64::min);
        let most = self.0.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        (least, most)
    }
}

pub(crate) fn row(name: &str, s: &Samples, note: &str) {
    let (med, min) = s.get();
    println!("  {name:<22} {med:>10.0} {min:>10.0}   {note}");
}

pub(crate) fn ratio(name: &str, a: &Samples, b: &Samples, note: &str) {
    let (a, b) = (a.get(), b.get());
    println!(
        "  {name:<22} {:>10.2} {:>10.2}   {note}",
        a.0 / b.0,
        a.1 / b.1
    );
}

/// The per-pair figures of one workload, or why its ratios are refused.
pub(crate) fn prologue_verdict(sites: &[prologue::Site]) -> Option<String> {
    let bad: Vec<String> = sites
        .iter()
        .filter(|s| !s.emulated)
        .map(|s| s.to_string())
        .collect();
    (!bad.is_empty()).then(|| {
        format!(
            "refused: {} - uprobes single-step that out of line (about 12x dearer than an emulated push or nop), which no user of the real library pays",
            bad.join("; ")
        )
    })
}

pub(crate) fn print_sites(sites: &[prologue::Site]) {
    for s in sites {
        println!("  site  {s}");
    }
}

/// The call programs' own time per pair from a --program-stats summary, with each program's
/// ns a run (the stage flush the reader runs on each CPU every round counted in).
fn program_ns(summary: &Value, pairs: u64) -> (f64, String) {
    let programs = summary["programs"].as_array().cloned().unwrap_or_default();
    let calls: Vec<&Value> = programs
        .iter()
        .filter(|p| {
            matches!(
                p["name"].as_str(),
                Some("call_entry" | "call_return" | "call_site" | "flush_stage")
            )
        })
        .collect();
    let total: f64 = calls
        .iter()
        .map(|p| p["run_time_ns"].as_f64().unwrap_or(0.0))
        .sum();
    let each: Vec<String> = calls
        .iter()
        .map(|p| {
            format!(
                "{} {:.0}",
                p["name"].as_str().unwrap_or("?"),
                p["ns_per_run"].as_f64().unwrap_or(0.0)
            )
        })
        .collect();
    (total / pairs.max(1) as f64, each.join(", "))
}

const FLOOR: &[&str] = &["--floor"];
const FLOOR_CLOCK: &[&str] = &["--floor-clock"];
const TRACER: &[&str] = &[];
const STACK: &[&str] = &["--stack"];

pub fn run(args: BenchArgs) -> Result<()> {
    let root = root();
    build_release(&root)?;
    let (sim, tmp) = bench_dirs(&root)?;
    let usdt = tmp.join("usdt_loop");
    run_ok(
        Command::new("cc")
            .args(["-O2", "-o"])
            .arg(&usdt)
            .arg(root.join("xtask/scripts/usdt_loop.c")),
    )
    .context("build the USDT loop (needs sys/sdt.h: apt-get install systemtap-sdt-dev)")?;
    let real = std::env::var_os("TRACER_REAL_CUDART_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(std::env::var_os("HOME").unwrap_or_default())
                .join(".cache/tracer/cuda-runtime-cu12")
        })
        .join("libcudart.so.12");
    ensure!(
        real.exists(),
        "{} missing: run scripts/setup.sh",
        real.display()
    );
    let p = Paths {
        tracer: root.join("target/release/tracer"),
        sim,
        real,
        usdt,
        tmp,
    };

    // The sites every setup probes, checked before anything is measured.
    let sim_sites = prologue::symbols(&p.sim_lib(), &["cudaMalloc", "cudaFree"])?;
    let real_sites = prologue::symbols(&p.real, &["cudaMalloc", "cudaFree"])?;
    let usdt_sites = prologue::usdt_sites(&p.usdt)?;

    let n = args.iters;
    let mut sim = SimSamples::default();
    let mut real = RealSamples::default();
    let mut py = PySamples::default();
    let mut usdt_s = UsdtSamples::default();
    let mut peer_recorded = Vec::new();
    for round in 0..args.runs {
        eprintln!("bench: round {}/{}", round + 1, args.runs);
        let run = |w, setup| run_setup(&p, w, n, setup).map(|(ns, _)| ns);
        sim.untraced.push(run(Workload::Sim, None)?);
        sim.floor.push(run(Workload::Sim, Some(FLOOR))?);
        sim.floor_clock.push(run(Workload::Sim, Some(FLOOR_CLOCK))?);
        sim.tracer.push(run(Workload::Sim, Some(TRACER))?);
        sim.stack.push(run(Workload::Sim, Some(STACK))?);
        let (ns, recorded) = bpftrace_pair_ns(&p, n)?;
        sim.bpftrace.push(ns);
        peer_recorded.push(recorded);
        real.untraced.push(run(Workload::Real, None)?);
        real.floor.push(run(Workload::Real, Some(FLOOR))?);
        real.tracer.push(run(Workload::Real, Some(TRACER))?);
        py.untraced.push(run(Workload::Python, None)?);
        py.floor.push(run(Workload::Python, Some(FLOOR))?);
        py.tracer.push(run(Workload::Python, Some(TRACER))?);
        py.stack.push(run(Workload::Python, Some(STACK))?);
        usdt_s.untraced.push(usdt_hit_ns(&p, 4 * n, false)?);
        usdt_s.floor.push(usdt_hit_ns(&p, 4 * n, true)?);
    }

    // The programs' own time: runs of their own, since the kernel's statistics cost a little.
    eprintln!("bench: the programs' own time (kernel BPF statistics)");
    let stat_n = (n / 5).max(10_000);
    let mut own = Vec::new();
    for (name, w, setup) in [
        ("floor (simulated)", Workload::Sim, FLOOR),
        ("floor + clock", Workload::Sim, FLOOR_CLOCK),
        ("tracer (simulated)", Workload::Sim, TRACER),
        ("tracer --stack (C)", Workload::Sim, STACK),
        ("tracer (real, error path)", Workload::Real, TRACER),
        ("tracer (Python)", Workload::Python, TRACER),
        ("tracer --stack (Python)", Workload::Python, STACK),
    ] {
        let mut with_stats = setup.to_vec();
        with_stats.push("--program-stats");
        let (_, summary) = run_setup(&p, w, stat_n, Some(&with_stats))?;
        let pairs = if w == Workload::Python {
            (stat_n / 4).max(1000)
        } else {
            stat_n
        };
        own.push((name, program_ns(&summary, pairs)));
    }

    let throughput = throughput(&p, args.throughput_secs)?;

    println!(
        "cudaMalloc + cudaFree, CPU ns per pair (workload's user + kernel time), {} interleaved rounds",
        args.runs
    );
    println!("\nsimulated runtime, C loop, {n} pairs");
    print_sites(&sim_sites);
    println!("  {:<22} {:>10} {:>10}", "setup", "median", "min");
    row("untraced", &sim.untraced, "");
    row("floor", &sim.floor, "same probes, programs that only count");
    row(
        "floor + clock",
        &sim.floor_clock,
        "the floor reading the clock at entry and return",
    );
    row("tracer", &sim.tracer, "");
    row("tracer --stack", &sim.stack, "native stack (no Python)");
    row(
        "bpftrace (peer)",
        &sim.bpftrace,
        &format!("printed {peer_recorded:?} of {} calls per run", 2 * n),
    );
    match prologue_verdict(&sim_sites) {
        Some(why) => println!("  ratios {why}"),
        None => {
            ratio("tracer / floor", &sim.tracer, &sim.floor, "target <= 1.25");
            ratio("tracer / floor+clock", &sim.tracer, &sim.floor_clock, "");
            ratio("--stack / tracer", &sim.stack, &sim.tracer, "target <= 2");
            ratio(
                "bpftrace / tracer",
                &sim.bpftrace,
                &sim.tracer,
                "> 1: tracer cheaper",
            );
            ratio("tracer / untraced", &sim.tracer, &sim.untraced, "");
        }
    }
    println!("\nreal libcudart.so.12 (PyPI), no GPU: every call returns 35, {n} pairs");
    print_sites(&real_sites);
    row("untraced", &real.untraced, "");
    row("floor", &real.floor, "");
    row(
        "tracer",
        &real.tracer,
        "no out-pointer to read, nothing allocated",
    );
    match prologue_verdict(&real_sites) {
        Some(why) => println!("  ratios {why}"),
        None => ratio(
            "tracer / floor",
            &real.tracer,
            &real.floor,
            "target <= 1.25",
        ),
    }
    println!(
        "\nPython (ctypes), 20 frames deep, {} pairs, the simulated runtime",
        (n / 4).max(1000)
    );
    row("untraced", &py.untraced, "");
    row("floor", &py.floor, "");
    row("tracer", &py.tracer, "");
    row("tracer --stack", &py.stack, "native + Python frames");
    match prologue_verdict(&sim_sites) {
        Some(why) => println!("  ratios {why}"),
        None => {
            ratio("tracer / floor", &py.tracer, &py.floor, "");
            ratio("--stack / floor", &py.stack, &py.floor, "");
            ratio("--stack / tracer", &py.stack, &py.tracer, "target <= 2");
        }
    }
    println!(
        "\nUSDT site (sys/sdt.h, semaphore-gated), {} hits, CPU ns per hit",
        4 * n
    );
    print_sites(&usdt_sites);
    row(
        "untraced",
        &usdt_s.untraced,
        "semaphore 0: the site does not run",
    );
    row(
        "floor",
        &usdt_s.floor,
        "bpftrace, empty action: the probe hit alone",
    );
    if let Some(why) = prologue_verdict(&usdt_sites) {
        println!("  floor {why}");
    }
    println!(
        "\nthe eBPF programs' own time (kernel.bpf_stats: run_time_ns / pairs), {stat_n} pairs"
    );
    for (name, (per_pair, each)) in &own {
        println!("  {name:<26} {per_pair:>8.0} ns per pair   ({each} ns a run)");
    }
    println!("  target: tracer <= 600 ns per pair");
    throughput.print();
    Ok(())
}

/// Two producer threads at full speed, traced.
struct Throughput {
    secs: f64,
    calls: i64,
    stored: i64,
    dropped: i64,
    tracer_cpu: f64,
    bytes: u64,
}

impl Throughput {
    fn print(&self) {
        println!("\nthroughput: 2 producer threads, {:.1} s", self.secs);
        println!("  calls made          {}", self.calls);
        println!(
            "  events stored       {} ({:.0} events/s), dropped {}",
            self.stored,
            self.stored as f64 / self.secs,
            self.dropped
        );
        println!(
            "  tracer CPU          {:.2} s = {:.2} s per million events",
            self.tracer_cpu,
            self.tracer_cpu / (self.stored as f64 / 1e6)
        );
        println!(
            "  database            {} bytes = {:.1} bytes/event",
            self.bytes,
            self.bytes as f64 / self.stored.max(1) as f64
        );
    }
}

pub(crate) fn children_cpu_s() -> f64 {
    // SAFETY: getrusage fills the struct we pass.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    unsafe { libc::getrusage(libc::RUSAGE_CHILDREN, &mut ru) };
    let tv = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    tv(ru.ru_utime) + tv(ru.ru_stime)
}

fn throughput(p: &Paths, secs: u64) -> Result<Throughput> {
    eprintln!("bench: throughput run ({secs} s, 2 threads)");
    let tracer = Tracer::start(p, &p.sim_lib(), &[])?;
    let cpu_before = children_cpu_s();
    let out = Command::new(p.sim.join("simdriver"))
        .env("SIMCUDA_LATENCY", "default=0")
        .args([
            "--mix",
            "pairs",
            "--threads",
            "2",
            "--duration-ms",
            &(secs * 1000).to_string(),
        ])
        .output()
        .context("run simdriver")?;
    let rep = json_of(out, "simdriver")?;
    let cpu_driver = children_cpu_s() - cpu_before;
    let summary = tracer.stop()?;
    let tracer_cpu = children_cpu_s() - cpu_before - cpu_driver;
    let calls: i64 = rep["ops"]
        .as_object()
        .map(|o| o.values().map(|v| v["calls"].as_i64().unwrap_or(0)).sum())
        .unwrap_or(0);
    let counters = &summary["counters"];
    let t = Throughput {
        secs: rep["elapsed_s"].as_f64().unwrap_or(1.0),
        calls,
        stored: counters["events_stored"].as_i64().unwrap_or(0),
        dropped: counters["dropped_ring_full"].as_i64().unwrap_or(-1),
        tracer_cpu,
        bytes: std::fs::metadata(p.tmp.join("bench.db"))?.len(),
    };
    ensure!(
        t.stored == t.calls && t.dropped == 0,
        "throughput run lost events: {} calls, {} stored, {} dropped",
        t.calls,
        t.stored,
        t.dropped
    );
    Ok(t)
}

/// The simulated runtime's C loop, per setup: CPU ns per pair, one sample a round.
#[derive(Default)]
struct SimSamples {
    untraced: Samples,
    floor: Samples,
    floor_clock: Samples,
    tracer: Samples,
    stack: Samples,
    /// The peer: bpftrace with the same probes.
    bpftrace: Samples,
}

/// The real libcudart (PyPI, no GPU: every call fails), per setup.
#[derive(Default)]
struct RealSamples {
    untraced: Samples,
    floor: Samples,
    tracer: Samples,
}

/// The Python (ctypes) loop, per setup.
#[derive(Default)]
struct PySamples {
    untraced: Samples,
    floor: Samples,
    tracer: Samples,
    stack: Samples,
}

/// A USDT site: the semaphore down (the site does not run), and the bare probe hit.
#[derive(Default)]
struct UsdtSamples {
    untraced: Samples,
    floor: Samples,
}
