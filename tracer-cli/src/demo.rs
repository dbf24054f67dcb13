//! `tracer demo`: realistic training workloads on the simulated CUDA runtime, recorded live
//! (with BPF privileges) or through the runtime's own event log (without), with the chains shown
//! as they form, then explained.

use std::{
    collections::BTreeMap,
    io::{IsTerminal as _, Read as _},
    os::unix::process::CommandExt as _,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    sync::mpsc,
    time::{Duration, Instant},
};

use anyhow::{anyhow, Context as _, Result};
use tracer_common::maps::DEFAULT_RING_BYTES;

mod multi_node;

use crate::{
    exit::user_error,
    model::{
        layout::AllocConf, live::LiveAllocators, state::ProcessState, stats::LiveStats, Event, Rank,
    },
    paths,
    present::{
        self,
        live::{self, LiveView},
    },
    probe::privileges,
    query::explain::{self, ExplainQuery},
    record::{import::SimlogImporter, signals, RecordOptions, Recording, Stop},
    store::{events, Access, Store},
};

struct Scenario {
    name: &'static str,
    about: &'static str,
    /// The simulated device: capacity and latencies.
    env: &'static [(&'static str, &'static str)],
    /// The workload's own options beyond the duration and speed.
    args: &'static [&'static str],
}

const SCENARIOS: &[Scenario] = &[
    Scenario {
        name: "incident",
        about: "variable sequence lengths fragment the cache until a request fails with memory \"free\" (background/000)",
        env: &[
            ("SIMCUDA_MEM", "3GiB"),
            ("SIMCUDA_LATENCY", "cudaMalloc=60us,cudaFree=15us,cudaStreamSynchronize=2ms,default=2us"),
            ("SIMCUDA_LATENCY_PER_FRAGMENT_NS", "20000"),
        ],
        args: &[],
    },
    Scenario {
        name: "multi-gpu",
        about: "four ranks on four devices; one rank's uneven sequence lengths fragment its cache and its OOM ends the job (background/001)",
        env: &[
            ("SIMCUDA_DEVICES", "4"),
            ("SIMCUDA_MEM", "3GiB"),
            ("SIMCUDA_LATENCY", "cudaMalloc=60us,cudaFree=15us,cudaStreamSynchronize=2ms,default=2us"),
            ("SIMCUDA_LATENCY_PER_FRAGMENT_NS", "20000"),
        ],
        args: &[],
    },
    Scenario {
        name: "multi-node",
        about: "the multi-GPU job on two simulated nodes, two ranks each, each node its own tracer and database; the job answered across both: the rank that stood out and the first that died",
        env: &[
            ("SIMCUDA_DEVICES", "2"),
            ("SIMCUDA_MEM", "3GiB"),
            ("SIMCUDA_LATENCY", "cudaMalloc=60us,cudaFree=15us,cudaStreamSynchronize=2ms,default=2us"),
            ("SIMCUDA_LATENCY_PER_FRAGMENT_NS", "20000"),
        ],
        args: &[],
    },
    Scenario {
        name: "co-tenant",
        about: "another job's inference server holds 1.25 GiB of the GPU; a training job that fits the GPU alone runs out of memory beside it, and PyTorch's message names the server",
        env: &[
            ("SIMCUDA_MEM", "3GiB"),
            ("SIMCUDA_LATENCY", "cudaMalloc=60us,cudaFree=15us,cudaStreamSynchronize=2ms,default=2us"),
        ],
        args: &[],
    },
    Scenario {
        name: "graphs",
        about: "a model served with CUDA graphs: four batch sizes captured into one pool, then an eager request the device cannot hold while the graphs' pool holds free blocks it may not use",
        env: &[
            ("SIMCUDA_MEM", "1GiB"),
            ("SIMCUDA_LATENCY", "cudaMalloc=60us,cudaFree=15us,default=2us"),
        ],
        args: &[],
    },
    Scenario {
        name: "mempool",
        about: "torch.cuda.MemPool: a pool filled under use_mem_pool, a use_on_oom pool that serves a request the device refused, then an OOM while the first pool holds free blocks the request may not use",
        env: &[
            ("SIMCUDA_MEM", "1GiB"),
            ("SIMCUDA_LATENCY", "cudaMalloc=60us,cudaFree=15us,default=2us"),
        ],
        args: &[],
    },
    Scenario {
        name: "engine",
        about: "a serving engine's start-up (weights, a profiling pass, the KV cache from --gpu-memory-utilization 0.95, a graph capture per batch size) whose KV cache leaves the captures too little",
        env: &[
            ("SIMCUDA_MEM", "4GiB"),
            ("SIMCUDA_LATENCY", "cudaMalloc=60us,cudaFree=15us,default=2us"),
        ],
        args: &["--gpu-memory-utilization", "0.95"],
    },
    Scenario {
        name: "periodic-spike",
        about: "a checkpoint every 25 steps empties the cache and allocates a large buffer",
        env: &[
            ("SIMCUDA_MEM", "8GiB"),
            ("SIMCUDA_LATENCY", "cudaMalloc=50us,cudaFree=10us,default=2us"),
            ("SIMCUDA_LATENCY_PER_MIB_NS", "5000"),
        ],
        args: &[],
    },
    Scenario {
        name: "leak",
        about: "losses kept on the GPU across steps",
        env: &[("SIMCUDA_MEM", "8GiB"), ("SIMCUDA_LATENCY", "cudaMalloc=50us,cudaFree=10us,default=2us")],
        args: &[],
    },
    Scenario {
        name: "oom",
        about: "the batch grows every step until the device is full",
        env: &[("SIMCUDA_MEM", "2GiB"), ("SIMCUDA_LATENCY", "cudaMalloc=80us,cudaFree=10us,default=2us")],
        args: &[],
    },
    Scenario {
        name: "cpu-contention",
        about: "six busy DataLoader workers on a small machine; the loop waits on the GPU and the CPU",
        env: &[
            ("SIMCUDA_MEM", "8GiB"),
            ("SIMCUDA_LATENCY", "cudaMalloc=50us,cudaFree=10us,cudaStreamSynchronize=3ms,default=2us"),
        ],
        args: &[],
    },
];

/// What to run, and where to store it.
#[derive(Clone, Debug)]
pub struct DemoOptions {
    pub scenario: String,
    /// Run the workload faster (2) or slower (0.5).
    pub speed: f64,
    /// How long the workload runs.
    pub duration: Duration,
    /// The database.
    pub db: PathBuf,
    /// Use the simulated runtime's own event log even when eBPF tracing is possible.
    pub simulated: bool,
}

/// The scenarios, as (name, what it shows).
pub fn scenarios() -> impl Iterator<Item = (&'static str, &'static str)> {
    SCENARIOS.iter().map(|s| (s.name, s.about))
}

/// Where the demo's sources live: TRACER_DEMOS, else the source tree this binary was built from.
fn demos_dir() -> Result<PathBuf> {
    let candidates = [
        std::env::var_os("TRACER_DEMOS").map(PathBuf::from),
        Some(
            Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("..")
                .join("demos"),
        ),
    ];
    candidates
        .into_iter()
        .flatten()
        .find(|d| d.join("simcuda/build.sh").exists() && d.join("workloads/train.py").exists())
        .ok_or_else(|| {
            user_error(
                "demo files not found: set TRACER_DEMOS to the demos/ folder of tracer's sources",
            )
        })
}

/// The simulated runtime, built by the invoking user (never by root on someone's behalf): in the
/// source tree's target/simcuda-demo when that user can write there, else in a private
/// temporary folder of theirs (a random name) kept for this run only.
struct Runtime {
    dir: PathBuf,
    owner: Option<(u32, u32)>,
    temp: Option<tempfile::TempDir>,
}

impl Drop for Runtime {
    fn drop(&mut self) {
        // Removed as its owner: root deletes nothing in a user's folder.
        let _as_user = paths::act_as(self.owner);
        drop(self.temp.take());
    }
}

/// target/simcuda-demo in the source tree if `owner` (else this user) can make it or owns it
/// and can write in it.
fn in_tree_build_dir(demos: &Path, owner: Option<(u32, u32)>) -> Option<PathBuf> {
    use std::os::unix::fs::MetadataExt as _;
    let dir = demos.join("..").join("target").join("simcuda-demo");
    let _as_user = paths::act_as(owner);
    std::fs::create_dir_all(&dir).ok()?;
    let meta = std::fs::symlink_metadata(&dir).ok()?;
    let uid = owner.map_or_else(|| nix::unistd::Uid::effective().as_raw(), |(uid, _)| uid);
    let theirs = meta.is_dir() && meta.uid() == uid;
    (theirs && tempfile::tempfile_in(&dir).is_ok()).then_some(dir)
}

/// Builds the simulated runtime, as `owner`, when it is missing or older than its sources.
fn simulated_runtime(demos: &Path, owner: Option<(u32, u32)>) -> Result<Runtime> {
    let src = demos.join("simcuda");
    let runtime = match in_tree_build_dir(demos, owner) {
        Some(dir) => Runtime {
            dir,
            owner,
            temp: None,
        },
        None => {
            let _as_user = paths::act_as(owner);
            let temp = tempfile::Builder::new()
                .prefix("tracer-simcuda-")
                .tempdir()
                .context("make a private temporary folder for the simulated runtime")?;
            Runtime {
                dir: temp.path().to_owned(),
                owner,
                temp: Some(temp),
            }
        }
    };
    let out = &runtime.dir;
    let lib = out.join("libcudart.so.12");
    let modified = |p: &Path| std::fs::metadata(p).and_then(|m| m.modified()).ok();
    let newest_source = std::fs::read_dir(&src)?
        .flatten()
        .filter_map(|e| modified(&e.path()))
        .max();
    if modified(&lib).is_none() || newest_source > modified(&lib) {
        eprintln!(
            "demo: building the simulated CUDA runtime into {}",
            out.display()
        );
        let mut build = Command::new("bash");
        build
            .arg(src.join("build.sh"))
            .arg(out)
            .stdout(Stdio::null());
        if let Some((uid, gid)) = owner {
            // The compiler runs as the user whose tree this is, never as root.
            build.uid(uid).gid(gid);
        }
        let status = build
            .status()
            .context("run demos/simcuda/build.sh (needs a C compiler: apt-get install gcc)")?;
        if !status.success() {
            return Err(anyhow!(
                "building the simulated CUDA runtime failed ({status})"
            ));
        }
    }
    Ok(runtime)
}

fn workload(
    demos: &Path,
    sim: &Path,
    scenario: &Scenario,
    opts: &DemoOptions,
    events_log: Option<&Path>,
) -> Command {
    let mut cmd = Command::new("python3");
    cmd.arg(demos.join("workloads/train.py"))
        .arg(scenario.name)
        .args([
            "--duration",
            &opts.duration.as_secs_f64().to_string(),
            "--speed",
            &opts.speed.to_string(),
        ])
        .args(scenario.args)
        .arg("--cudart")
        .arg(sim.join("libcudart.so.12"))
        .envs(scenario.env.iter().copied())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    if let Some(log) = events_log {
        cmd.env("SIMCUDA_EVENTS", log);
    }
    // Never run the workload as root on someone's behalf: it runs as the user who ran sudo.
    if let Some((uid, gid)) = paths::invoker().owner {
        cmd.uid(uid).gid(gid);
    }
    cmd
}

/// Runs the scenario, shows what forms, and ends with the explain report.
pub fn run(opts: &DemoOptions) -> Result<()> {
    let scenario = SCENARIOS
        .iter()
        .find(|s| s.name == opts.scenario)
        .ok_or_else(|| {
            let names: Vec<&str> = SCENARIOS.iter().map(|s| s.name).collect();
            user_error(format!(
                "unknown scenario {:?}: choose one of {}",
                opts.scenario,
                names.join(", ")
            ))
        })?;
    if !(opts.speed > 0.0 && opts.speed.is_finite()) {
        return Err(user_error(format!(
            "--speed {} must be a positive number",
            opts.speed
        )));
    }
    let demos = demos_dir()?;
    let who = paths::invoker();
    let runtime = simulated_runtime(&demos, who.owner)?;
    let sim = runtime.dir.clone();
    if scenario.name == "multi-node" {
        return multi_node::run(&sim, &demos, scenario, opts, who.owner);
    }
    let live = !opts.simulated && privileges::can_trace().is_ok();
    let started = Instant::now();
    let (session, outcome, announced) = if live {
        run_traced(&sim, &demos, scenario, opts)?
    } else {
        if !opts.simulated {
            eprintln!(
                "demo: no BPF privileges, so the simulated runtime reports its own calls (session marked simulated); run with sudo to trace them live"
            );
        }
        run_simulated(&sim, &demos, scenario, opts, who.owner)?
    };
    eprintln!(
        "demo: {} finished in {:.0}s: {outcome}",
        scenario.name,
        started.elapsed().as_secs_f64()
    );
    final_report(&opts.db, session, &announced)
}

/// The chains a demo announced while it ran: (rule, pid) -> title.
type Announced = BTreeMap<(String, u32), String>;

/// Shows what the session recorded so far: the live per-op table (redrawn in place on a
/// terminal, every 10 s otherwise) and each causal chain as it forms.
struct ChainWatch {
    /// Chains announced: (rule, pid) -> title.
    seen: BTreeMap<(String, u32), String>,
    view: LiveView,
    looks: u64,
    /// The last call seen at the previous look (the live table's interval starts after it).
    last_look_ns: i64,
}

impl ChainWatch {
    fn new() -> ChainWatch {
        ChainWatch {
            seen: BTreeMap::new(),
            view: LiveView::new(std::io::stderr().is_terminal()),
            looks: 0,
            last_look_ns: i64::MIN,
        }
    }

    fn look(&mut self, db: &Path, session: i64) {
        self.looks += 1;
        let Ok(store) = Store::open(db, Access::ReadOnly) else {
            return;
        };
        // The live table's figures come from the same walk as the chains: explain's.
        let mut seen = LookVisit::new(store.conn(), session, self.last_look_ns);
        let q = ExplainQuery {
            session: Some(session),
            ..Default::default()
        };
        let Ok(explained) = explain::explain_visiting(db, &q, &mut seen) else {
            return;
        };
        let report = explained.report;
        let Some((first, last)) = seen.span else {
            return;
        };
        self.last_look_ns = last;
        let stats = seen.stats;
        let elapsed = Duration::from_nanos((last - first).max(0) as u64);
        let mut table = vec![format!(
            "demo {:>5.1}s | session {session} | {} processes | {} calls | {} chains",
            elapsed.as_secs_f64(),
            stats.processes(),
            stats.events,
            report.chains.len()
        )];
        table.extend(live::op_table(&stats, elapsed));
        table.extend(live::allocator_table(&seen.allocators.rows()));
        self.view.clear();
        for chain in &report.chains {
            if let std::collections::btree_map::Entry::Vacant(slot) =
                self.seen.entry((chain.rule.to_string(), chain.pid))
            {
                slot.insert(chain.title.clone());
                eprintln!(
                    "demo: +{:>5.1}s chain formed: [{:?}] {} - {}",
                    (last - first) as f64 / 1e9,
                    chain.severity,
                    chain.title,
                    chain.root
                );
            }
        }
        // Off a terminal, a table every 10 s (each look is 2 s apart) keeps logs readable.
        if self.view.is_tty() || self.looks % 5 == 1 {
            self.view.redraw(&table);
        }
    }

    /// The last table, left on the screen above what follows.
    fn finish(&mut self, db: &Path, session: i64) {
        self.looks = 0;
        self.look(db, session);
    }
}

/// What a look gathers beside the chains from explain's walk: the per-op figures and the
/// allocators' layouts, as `tracer trace` shows them, and the calls' span.
struct LookVisit {
    allocators: LiveAllocators,
    stats: LiveStats,
    span: Option<(i64, i64)>,
    /// The previous look's last call: the live table's interval starts after it.
    interval_from_ns: i64,
    interval_started: bool,
}

impl LookVisit {
    fn new(conn: &rusqlite::Connection, session: i64, interval_from_ns: i64) -> LookVisit {
        let mut allocators = LiveAllocators::default();
        for (pid, env) in events::envs(conn, session).unwrap_or_default() {
            let get = |k: &str| env.get(k).map(String::as_str);
            allocators.describe(pid, AllocConf::from_env(get), Rank::from_env(get));
        }
        LookVisit {
            allocators,
            stats: LiveStats::default(),
            span: None,
            interval_from_ns,
            interval_started: false,
        }
    }
}

impl explain::Visit for LookVisit {
    fn start(&mut self, begin: &crate::query::Begin) {
        for s in &begin.states {
            self.allocators.restore(s.clone());
        }
    }

    fn call(&mut self, e: &Event) {
        if !self.interval_started && e.ts_ns > self.interval_from_ns {
            // Rows close the previous interval's figures.
            self.allocators.rows();
            self.interval_started = true;
        }
        self.allocators.apply(e);
        self.stats.add_one(
            e.pid,
            e.op,
            e.ret,
            (e.size != 0).then_some(e.size),
            e.duration_ns,
        );
        let end = e.ts_ns;
        self.span = Some(
            self.span
                .map_or((end, end), |(a, b)| (a.min(end), b.max(end))),
        );
    }

    fn resume(&mut self, _hole: &crate::store::walk::Hole, states: &[ProcessState]) {
        for s in states {
            self.allocators.restore(s.clone());
        }
    }
}

/// Runs the workload, calling `tick` about every 2 s until it exits; returns its outcome.
fn supervise(mut child: Child, mut tick: impl FnMut()) -> Result<String> {
    let stderr = child.stderr.take();
    let err_reader = std::thread::spawn(move || {
        let mut text = String::new();
        if let Some(mut s) = stderr {
            let _ = s.read_to_string(&mut text);
        }
        text
    });
    let mut last = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait()? {
            break status;
        }
        if last.elapsed() >= Duration::from_secs(2) {
            tick();
            last = Instant::now();
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let err = err_reader.join().unwrap_or_default();
    let message = err
        .lines()
        .find(|l| l.contains("OutOfMemoryError"))
        .map(str::to_owned);
    Ok(match (status.success(), message) {
        (true, _) => "the workload completed".into(),
        (false, Some(m)) => format!("the workload died: {m}"),
        (false, None) => format!("the workload failed ({status}): {}", err.trim()),
    })
}

/// Records the workload live with eBPF, in this process: the workload is supervised on a thread
/// of its own while the recording runs here; Ctrl-C stops both and still flushes.
fn run_traced(
    sim: &Path,
    demos: &Path,
    scenario: &Scenario,
    opts: &DemoOptions,
) -> Result<(i64, String, Announced)> {
    let (stop_tx, stops) = mpsc::channel();
    signals::stop_on_signals(stop_tx.clone())?;
    let mut recording = Recording::start(RecordOptions {
        libs: vec![
            sim.join("libcudart.so.12"),
            sim.join("libcuda.so.1"),
            sim.join("libsimtorch.so"),
        ],
        db: opts.db.clone(),
        ring_bytes: DEFAULT_RING_BYTES as u64,
        command: std::env::args().collect::<Vec<_>>().join(" "),
        ..Default::default()
    })?;
    let session = recording.started().session;
    eprintln!(
        "demo: tracing live with eBPF (session {session}); running the {} workload",
        scenario.name
    );
    let child = workload(demos, sim, scenario, opts, None)
        .spawn()
        .context("start the workload (python3)")?;
    let db = opts.db.clone();
    let supervisor = std::thread::spawn(move || {
        let mut watch = ChainWatch::new();
        let outcome = supervise(child, || watch.look(&db, session));
        let _ = stop_tx.send(Stop::done("the demo's workload ended"));
        (outcome, watch)
    });
    let stop = recording.run(&stops, None, |_| {});
    let finished = recording.finish(stop)?;
    let (outcome, mut watch) = supervisor
        .join()
        .map_err(|_| anyhow!("the workload supervisor panicked"))?;
    watch.finish(&opts.db, session);
    finished.detach()?;
    Ok((session, outcome?, watch.seen))
}

fn run_simulated(
    sim: &Path,
    demos: &Path,
    scenario: &Scenario,
    opts: &DemoOptions,
    owner: Option<(u32, u32)>,
) -> Result<(i64, String, Announced)> {
    let db = opts.db.as_path();
    let mut store = Store::open_writable(db, owner)?;
    let session = SimlogImporter::begin_session(&store)?;
    // The runtime's log: written by the workload (the user), in a private folder of theirs.
    let log_dir = {
        let _as_user = paths::act_as(owner);
        tempfile::Builder::new()
            .prefix("tracer-demo-")
            .tempdir()
            .context("make a private temporary folder for the simulated runtime's log")?
    };
    let log = log_dir.path().join("events.log");
    let child = workload(demos, sim, scenario, opts, Some(&log))
        .spawn()
        .context("start the workload (python3)")?;
    let mut importer = SimlogImporter::new(true);
    let mut watch = ChainWatch::new();
    let mut failure = None;
    let outcome = supervise(child, || {
        if let Err(e) = importer.import(&log, &mut store, session) {
            failure.get_or_insert(e);
        }
        watch.look(db, session);
    })?;
    if let Some(e) = failure {
        return Err(e.context(format!(
            "import the simulated runtime's events from {}",
            log.display()
        )));
    }
    importer.import(&log, &mut store, session)?;
    importer.end_session(
        &store,
        session,
        &format!("simulated: events reported by the simulated runtime; {outcome}"),
        "complete",
    )?;
    watch.finish(db, session);
    let _as_user = paths::act_as(owner);
    drop(log_dir);
    Ok((session, outcome, watch.seen))
}

/// What became of the chains announced while the demo ran that the whole session does not
/// repeat as shown: withdrawn (no such chain now) or revised (another title).
fn changed_since_shown(announced: &Announced, kept: &BTreeMap<(&str, u32), &str>) -> Vec<String> {
    announced
        .iter()
        .filter_map(|((rule, pid), title)| match kept.get(&(rule.as_str(), *pid)) {
            None => Some(format!(
                "Withdrawn: \"{title}\" (pid {pid}) was shown while the demo ran; the whole session does not support it (what looked like a trend levelled off, or a later figure explains it better)."
            )),
            // E.g. a failed allocation that looked unrecovered until its retry succeeded.
            Some(now) if now != title => Some(format!(
                "Revised: \"{title}\" (pid {pid}) was shown while the demo ran; the whole session says \"{now}\" (a later call changed what the first one meant)."
            )),
            Some(_) => None,
        })
        .collect()
}

/// The explain report, and the chains announced while running that the whole session no
/// longer supports, said as withdrawn rather than silently dropped.
fn final_report(db: &Path, session: i64, announced: &Announced) -> Result<()> {
    println!();
    let explained = explain::explain(
        db,
        &ExplainQuery {
            session: Some(session),
            ..Default::default()
        },
    )?;
    present::explain::text(&mut std::io::stdout().lock(), &explained, true)?;
    let kept: BTreeMap<(&str, u32), &str> = explained
        .report
        .chains
        .iter()
        .map(|c| ((c.rule.name(), c.pid), c.title.as_str()))
        .collect();
    for line in changed_since_shown(announced, &kept) {
        println!("{line}");
    }
    println!();
    println!("Stored in {} (session {session}): explore with `tracer explain --db {} --json` or `tracer query`.", db.display(), db.display());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_chain_shown_then_gone_is_withdrawn_and_one_retitled_is_revised() {
        let shown_oom = "out of memory: cudaMalloc of 46.0 MiB failed";
        let announced: Announced = [
            (("oom".to_owned(), 7), shown_oom.to_owned()),
            (("leak".to_owned(), 7), "memory held rising".to_owned()),
            (("fragmentation".to_owned(), 7), "fragmentation".to_owned()),
        ]
        .into_iter()
        .collect();
        let kept: BTreeMap<(&str, u32), &str> = [
            (("oom", 7), "out of memory: cudaMalloc of 38.0 MiB failed"),
            (("fragmentation", 7), "fragmentation"),
        ]
        .into_iter()
        .collect();
        let lines = changed_since_shown(&announced, &kept);
        assert_eq!(lines.len(), 2, "{lines:?}");
        assert!(lines[0].starts_with("Withdrawn: \"memory held rising\" (pid 7)"));
        assert!(lines[1].starts_with(&format!("Revised: \"{shown_oom}\" (pid 7)")));
        assert!(lines[1].contains("says \"out of memory: cudaMalloc of 38.0 MiB failed\""));
    }
}
