//! A recording from start to the final flush: attach, begin the session, run the reader, the
//! registry and the writer on their threads, keep attaching what discovery finds, and on stop
//! pause the probes, drain everything submitted, commit, and end the session.
//!
//! Over 700 lines because start, the threads' hand-offs and the ordered stop (pause, drain, commit,
//! end, detach) must read as one sequence.

use std::{
    collections::{HashMap, HashSet},
    path::PathBuf,
    sync::{
        atomic::Ordering,
        mpsc::{self, Receiver, RecvTimeoutError, SyncSender},
        Arc, Mutex,
    },
    thread::{self, JoinHandle},
    time::{Duration, Instant},
};

use anyhow::{anyhow, Context as _, Result};
use serde::Serialize;

use super::{
    discovery::{note_probed, report_attached},
    on_warning::{HookOutcome, HookRun, OnWarning, WarningHook},
    reader,
    registry::{Inbound, KeyframeClock, Python, Registry},
    restore,
    shared::Shared,
    writer::{self, WriterOptions},
};
use crate::probe::{
    attach::{self, AttachedLibrary, LoadOptions, Probes, ProgramStat},
    discover::{self, Candidate, Origin, Scanner},
    privileges,
};
use crate::traced::{
    mappings::{Mappings, SharedMappings},
    procinfo,
    sites::Sites,
};
use crate::{
    exit::{privilege_error, user_error},
    model::{figures::Figures, live::AllocatorRow, stats::LiveStats},
    paths,
    store::{keyframes::KeyframeState, SessionCounters, SessionStart, Store},
};

/// What to record, and where.
#[derive(Clone, Debug, Default)]
pub struct RecordOptions {
    /// Only these processes (their probes are scoped to them); empty: every process.
    pub pids: Vec<u32>,
    /// Probe these files instead of discovering the CUDA libraries.
    pub libs: Vec<PathBuf>,
    /// The database (its folders are created, owned by the invoking user).
    pub db: PathBuf,
    pub max_db: Option<u64>,
    /// Ring buffer bytes: a power of two, 4 KiB to 2 GiB.
    pub ring_bytes: u64,
    /// Record each call's native stack and Python frames.
    pub stack: bool,
    /// Benchmark floor: the same probes with empty programs; counts calls, stores nothing
    /// (0 off, 1 empty, 2 with the clock reads that timing a call needs).
    pub floor: u32,
    /// Measure the programs' own run time (kernel BPF statistics) for the summary.
    pub program_stats: bool,
    /// Write no keyframes (only to measure what they cost).
    pub no_keyframes: bool,
    /// Benchmark: no scheduler programs (what host context costs is measured against this).
    pub no_host_context: bool,
    /// The command line stored with the session.
    pub command: String,
    /// Run a command on the early warning (--on-warning).
    pub on_warning: Option<OnWarning>,
    /// How long an ended process's figures stay (the metrics endpoint's series; zero: none).
    pub figures_grace: Duration,
    /// NVIDIA's management library to ask who holds each GPU (a file, or a name the loader
    /// finds); None: not asked. `nvml_required`: a library that cannot be loaded is an error,
    /// else it is not asked.
    pub nvml: Option<String>,
    pub nvml_required: bool,
    /// PyTorch's allocator probes: always, armed while memory is tight, or never.
    pub allocator: crate::model::arming::Mode,
    /// When `auto` arms and disarms.
    pub arming: crate::model::arming::Settings,
    /// Write each OOM's evidence into a folder (--dump-on-oom).
    pub dump_on_oom: Option<super::dump::DumpOnOom>,
    /// Stop a process that opens a CUDA library tracer has not probed until it is (off:
    /// `--no-hold`; such a process may then be found late, and is marked so).
    pub hold: bool,
    /// Discovery in the kernel at all (off: the once-a-second scan alone).
    pub open_watch: bool,
}

/// The recording, once its probes are attached and its session begun.
#[derive(Clone, Debug, Serialize)]
pub struct Started {
    pub session: i64,
    pub db: PathBuf,
    pub probes: usize,
    pub libraries: Vec<AttachedLibrary>,
    pub pid_filter: Option<Vec<u32>>,
    /// The scheduler tracepoints, or why not (`off: ...`).
    pub host_context: String,
}

/// Why the recording ended; a signal marks the session "interrupted", anything else "complete".
#[derive(Clone, Debug)]
pub struct Stop {
    pub reason: String,
    pub by_signal: bool,
}

impl Stop {
    pub fn signal(reason: &str) -> Stop {
        Stop {
            reason: reason.into(),
            by_signal: true,
        }
    }

    pub fn done(reason: impl Into<String>) -> Stop {
        Stop {
            reason: reason.into(),
            by_signal: false,
        }
    }
}

/// Converts the kernel's CLOCK_MONOTONIC timestamps to wall-clock time.
#[derive(Clone, Copy)]
struct Clock {
    offset_ns: i64,
}

impl Clock {
    fn now() -> Self {
        use nix::time::{clock_gettime, ClockId};
        let ns = |id| {
            clock_gettime(id)
                .map(|t| t.tv_sec() * 1_000_000_000 + t.tv_nsec())
                .unwrap_or(0)
        };
        // Bracket the realtime read with two monotonic reads; use their midpoint.
        let m1 = ns(ClockId::CLOCK_MONOTONIC);
        let r = ns(ClockId::CLOCK_REALTIME);
        let m2 = ns(ClockId::CLOCK_MONOTONIC);
        Clock {
            offset_ns: r - (m1 + (m2 - m1) / 2),
        }
    }

    fn wall_now(&self) -> i64 {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as i64)
            .unwrap_or(0)
    }
}

/// How the recording stands, for a live view.
pub struct RecordingStatus {
    pub elapsed: Duration,
    pub libraries: usize,
    pub probes: usize,
    pub stats: LiveStats,
    pub counters: SessionCounters,
    /// The allocators' figures now, per process and device.
    pub allocators: Vec<AllocatorRow>,
    /// Each process's calls, failures and warnings (ended ones for their grace period).
    pub figures: Figures,
    /// The database's bytes in use, and the sessions --max-db deleted.
    pub db_bytes: u64,
    pub sessions_evicted: u64,
    /// `--allocator`: its mode, the processes armed now, armings and disarmings so far.
    pub allocator_mode: &'static str,
    pub armed_now: u64,
    pub armings: u64,
    pub disarmings: u64,
}

/// What a finished recording stored (printed by `tracer trace` at the end).
#[derive(Clone, Debug, Serialize)]
pub struct Summary {
    pub session: i64,
    pub db: PathBuf,
    /// complete, interrupted or failed.
    pub status: &'static str,
    pub reason: String,
    pub elapsed_s: f64,
    pub probes: usize,
    pub libraries: Vec<AttachedLibrary>,
    pub counters: SessionCounters,
    /// The programs' own cost, with --program-stats.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub programs: Vec<ProgramStat>,
    /// The allocators' figures at the end, per process and device.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub allocators: Vec<AllocatorRow>,
    /// --on-warning's runs.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub on_warning: Vec<HookRun>,
    /// --dump-on-oom's folders, and what could not be written.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub dumps: Option<super::dump::DumpSummary>,
    /// Discovery in the kernel: who was stopped, found late or never traced, opens lost.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub discovery: Option<super::discovery::DiscoverySummary>,
    /// Entries left in the per-thread kernel maps at the end (they go as threads exit).
    pub kernel_maps: std::collections::BTreeMap<String, u64>,
    pub keyframes: KeyframeCost,
    /// `--allocator`: its mode, and what arming cost.
    pub allocator: ArmingCost,
    #[serde(skip)]
    pub stats: LiveStats,
}

/// `--allocator`'s mode, the armings and disarmings, and the time the main thread spent
/// carrying them out (raising and lowering semaphores, not waiting for the registry).
#[derive(Clone, Debug, Default, Serialize)]
pub struct ArmingCost {
    pub mode: &'static str,
    pub armings: u64,
    pub disarmings: u64,
    pub carry_out_s: f64,
}

/// Keyframes stored, and the CPU seconds the recording's threads spent making and storing them.
#[derive(Clone, Debug, Default, Serialize)]
pub struct KeyframeCost {
    pub written: u64,
    pub cpu_s: f64,
}

/// A finished recording: everything is stored; the probes are still attached (paused) until
/// [`Finished::detach`].
pub struct Finished {
    pub summary: Summary,
    probes: Probes,
    /// The first thing that went wrong, if anything did.
    problem: Option<anyhow::Error>,
}

impl Finished {
    /// Removes the probes (the kernel's part in the background); then the recording's outcome.
    pub fn detach(self) -> Result<Summary> {
        self.probes.remove();
        match self.problem {
            Some(e) => Err(e),
            None => Ok(self.summary),
        }
    }
}

pub struct Recording {
    probes: Probes,
    scanner: Scanner,
    /// Discovery in the kernel (None with --pid or --lib, or where the kernel refused it).
    watch: Option<super::discovery::Watch>,
    session_started_ns: i64,
    pid_filter: Option<Vec<u32>>,
    shared: Arc<Shared>,
    reader: JoinHandle<Result<()>>,
    registry: JoinHandle<Result<()>>,
    writer: JoinHandle<(Store, Result<()>)>,
    started: Started,
    clock: Clock,
    began: Instant,
    gone: HashSet<u32>,
    /// Keeps the kernel's BPF statistics on (--program-stats).
    program_stats: Option<std::os::fd::OwnedFd>,
    /// --on-warning's runs, reported when the recording ends.
    on_warning: Option<HookOutcome>,
    /// --dump-on-oom's thread: it ends once the writer (its only sender) has.
    dumps: Option<JoinHandle<super::dump::DumpSummary>>,
    figures_grace: Duration,
    /// `--allocator auto`: this thread arms and disarms.
    arms: bool,
    allocator: crate::model::arming::Mode,
}

impl Recording {
    /// Loads and attaches the probes, begins the session and starts the reader, the registry
    /// and the writer. Returns once calls are being recorded.
    pub fn start(opts: RecordOptions) -> Result<Recording> {
        check_options(&opts)?;
        let explicit = discover::explicit_libraries(&opts.libs)?;
        // Checked before anything begins: a folder that could redirect root's writes stops it.
        let dump_root = opts
            .dump_on_oom
            .as_ref()
            .map(|cfg| super::dump::DumpRoot::open(cfg, paths::invoker().owner))
            .transpose()?;
        // Before the session begins: a library named that cannot be loaded stops nothing begun.
        let nvml = open_nvml(&opts)?;
        let who = paths::invoker();
        let mut store = Store::open_writable(&opts.db, who.owner)?;
        for id in store.close_orphaned_sessions()? {
            eprintln!("tracer: session {id} was left running by a tracer that is gone: marked crashed (its calls are kept)");
        }
        let pid_scope = (!opts.pids.is_empty()).then_some(opts.pids.as_slice());
        let mut taken = restore::take_up(&store, pid_scope)?;
        let mut probes = Probes::load(LoadOptions {
            // At most 2 GiB: checked above.
            ring_bytes: opts.ring_bytes as u32,
            wakeup_bytes: (opts.ring_bytes / 4).min(1 << 20),
            floor: opts.floor,
            stack: opts.stack,
            host_context: !opts.no_host_context,
            allocator: opts.allocator,
        })
        .map_err(|e| {
            if format!("{e:#}").contains("Operation not permitted") {
                privilege_error(format!(
                    "{e:#}: loading BPF programs was refused; run with sudo"
                ))
            } else {
                e
            }
        })?;
        let pid_filter = (!opts.pids.is_empty()).then(|| opts.pids.clone());
        // Started before the first scan: a library opened meanwhile is heard of.
        let mut watch = (opts.open_watch && pid_filter.is_none() && explicit.is_empty())
            .then(|| start_watch(&mut probes, opts.hold))
            .flatten();
        let mut scanner = Scanner::new(explicit, pid_filter.clone(), &who);
        let shared = Arc::new(Shared::default());
        if opts.figures_grace.is_zero() {
            // Only the metrics endpoint reads them.
            if let Ok(mut figures) = shared.figures.lock() {
                *figures = Figures::disabled();
            }
        }
        for lib in scanner.scan(true) {
            attach_reporting(&mut probes, &lib, pid_filter.as_deref())?;
            note_probed(&shared, &lib);
            if let Some(w) = watch.as_mut() {
                w.probed(lib.id);
            }
        }
        if probes.probe_count() == 0 {
            eprintln!("tracer: no CUDA library found yet; watching for processes that load one (rescanning every second)");
        }
        let clock = Clock::now();
        let session = begin_session(&store, &clock, &opts, &pid_filter)?;
        let session_started_ns = clock.wall_now();
        let mut gaps = Vec::new();
        if let Some(from) = taken.iter().map(|t| t.from_session).max() {
            store.set_restored_from(session, from)?;
            // Its time is the latest call the states include: before any of this session's.
            let included = taken.iter().map(|t| t.state.last_ns).max().unwrap_or(0);
            let mut states = Vec::new();
            for t in &mut taken {
                gaps.push(t.close_gap(session_started_ns));
                if opts.allocator == crate::model::arming::Mode::Always {
                    // Taken up from an `--allocator auto` session that had it disarmed: its
                    // blocks are seen from now on, in segments made from now on.
                    t.state.layout.arm(session_started_ns);
                }
                states.push(KeyframeState {
                    pid: t.state.pid,
                    start_time_ns: t.state.start_time_ns,
                    data: t.state.encode()?,
                });
            }
            // The session's first keyframe, before any of its calls: reading it from its
            // start starts from what was taken up.
            store.insert_keyframe(session, included, &states)?;
            eprintln!(
                "tracer: took up the state of {} running process(es) from session {from}; the gap since is recorded",
                taken.len()
            );
        }
        store.set_libraries(session, &serde_json::to_string(&probes.libraries())?)?;
        let host_context = host_context_state(&probes);
        store.set_host_context(session, &host_context)?;
        store.set_allocator_mode(session, opts.allocator.name())?;
        eprintln!(
            "tracer: session {session}: {} probes on {} libraries; writing to {}",
            probes.probe_count(),
            probes.library_count(),
            opts.db.display()
        );

        let threads = spawn_pipeline(
            &mut probes,
            &opts,
            &pid_filter,
            &shared,
            store,
            Begun {
                session,
                clock,
                started_ns: session_started_ns,
                taken,
                gaps,
                nvml,
                dump_root,
            },
        )?;
        let program_stats = if opts.program_stats {
            Some(attach::enable_program_stats()?)
        } else {
            None
        };
        let started = Started {
            session,
            db: opts.db.clone(),
            probes: probes.probe_count(),
            libraries: probes.libraries(),
            pid_filter: pid_filter.clone(),
            host_context,
        };
        Ok(Recording {
            probes,
            scanner,
            watch,
            session_started_ns,
            pid_filter,
            shared,
            reader: threads.reader,
            registry: threads.registry,
            writer: threads.writer,
            started,
            clock,
            began: Instant::now(),
            gone: HashSet::new(),
            program_stats,
            on_warning: threads.on_warning,
            dumps: threads.dumps,
            figures_grace: opts.figures_grace,
            arms: opts.allocator == crate::model::arming::Mode::Auto,
            allocator: opts.allocator,
        })
    }

    pub fn started(&self) -> &Started {
        &self.started
    }

    /// Records until a stop arrives on `stops`, `duration` passes, every --pid process has
    /// exited, or a thread fails; `on_tick` sees the recording each second.
    pub fn run(
        &mut self,
        stops: &Receiver<Stop>,
        duration: Option<Duration>,
        mut on_tick: impl FnMut(&RecordingStatus),
    ) -> Result<Stop> {
        let deadline = duration.map(|d| Instant::now() + d);
        let mut next_tick = Instant::now() + Duration::from_secs(1);
        loop {
            let mut wake = deadline.map_or(next_tick, |d| d.min(next_tick));
            if self.arms {
                // Arming waits on this thread, which holds the probes.
                wake = wake.min(Instant::now() + ARMING_POLL);
                if let Some(arm) = super::arming::take_on_demand() {
                    if let Ok(mut q) = self.shared.arming.lock() {
                        q.on_demand = Some(arm);
                    }
                }
                super::arming::carry_out(&mut self.probes, &self.shared);
            }
            if let Some(w) = self.watch.as_mut() {
                // Woken at once by a library's open (a process may be stopped for it); the
                // stops are looked at every WATCH_POLL at least.
                w.wait(wake.min(Instant::now() + WATCH_POLL));
                w.serve(
                    &mut self.probes,
                    &mut self.scanner,
                    &self.shared,
                    self.pid_filter.as_deref(),
                );
                wake = Instant::now();
            }
            match stops.recv_timeout(wake.saturating_duration_since(Instant::now())) {
                Ok(stop) => return Ok(stop),
                Err(RecvTimeoutError::Disconnected) => {
                    return Ok(Stop::done("the controlling program went away"))
                }
                Err(RecvTimeoutError::Timeout) => {}
            }
            if deadline.is_some_and(|d| Instant::now() >= d) {
                let secs = duration.unwrap_or_default().as_secs_f64();
                return Ok(Stop::done(format!("--duration {secs}s reached")));
            }
            if Instant::now() >= next_tick {
                next_tick += Duration::from_secs(1);
                if let Some(stop) = self.tick()? {
                    return Ok(stop);
                }
                on_tick(&self.snapshot()?);
            }
        }
    }

    /// One second's housekeeping: attaches what discovery found since, reads the kernel's
    /// counters, notices traced processes that exited.
    fn tick(&mut self) -> Result<Option<Stop>> {
        if self.shared.stop.load(Ordering::SeqCst) {
            return Err(anyhow!("the reader, registry or writer stopped early"));
        }
        for lib in self.scanner.scan(false) {
            attach_reporting(&mut self.probes, &lib, self.pid_filter.as_deref())?;
            note_probed(&self.shared, &lib);
            if let Some(w) = self.watch.as_mut() {
                w.probed(lib.id);
            }
            self.found_by_scan(&lib);
        }
        if let Some(w) = self.watch.as_mut() {
            w.renew();
        }
        let kernel = self.probes.counters()?;
        if let Ok(mut k) = self.shared.kernel.lock() {
            *k = kernel;
        }
        if let Ok(mut figures) = self.shared.figures.lock() {
            figures.expire(Instant::now(), self.figures_grace);
        }
        if let Some(pids) = &self.pid_filter {
            for &pid in pids {
                if !procinfo::exists(pid) && self.gone.insert(pid) {
                    eprintln!("tracer: process {pid} exited");
                }
            }
            if self.gone.len() == pids.len() {
                return Ok(Some(Stop::done("every traced process exited")));
            }
        }
        Ok(None)
    }

    /// The processes mapping a library the scan found, that began after the session: they
    /// ran with it unprobed, found late (the registry marks them at their first call).
    fn found_by_scan(&self, lib: &Candidate) {
        if lib.origin != Origin::Mapped {
            return;
        }
        let Ok(mut found) = self.shared.discovery.lock() else {
            return;
        };
        for &pid in &lib.pids {
            let started = procinfo::start_time_ns(pid);
            if started.is_some_and(|t| t >= self.session_started_ns) {
                found.late.entry(pid).or_insert(super::discovery::Late {
                    from_ns: started,
                    library: lib.shown.clone(),
                    how: "scan",
                });
            }
        }
    }

    pub fn snapshot(&self) -> Result<RecordingStatus> {
        let kernel = self.probes.counters()?;
        Ok(RecordingStatus {
            elapsed: self.began.elapsed(),
            libraries: self.probes.library_count(),
            probes: self.probes.probe_count(),
            stats: self
                .shared
                .live
                .lock()
                .map_err(|_| anyhow!("statistics lock poisoned"))?
                .clone(),
            counters: self.shared.counters(&kernel),
            allocators: allocator_rows(&self.shared)?,
            figures: self
                .shared
                .figures
                .lock()
                .map_err(|_| anyhow!("figures lock poisoned"))?
                .clone(),
            db_bytes: self.shared.db_bytes.load(Ordering::SeqCst),
            sessions_evicted: self.shared.sessions_evicted.load(Ordering::SeqCst),
            allocator_mode: self.allocator.name(),
            armed_now: self.shared.armed_now.load(Ordering::SeqCst),
            armings: self.shared.armings.load(Ordering::SeqCst),
            disarmings: self.shared.disarmings.load(Ordering::SeqCst),
        })
    }

    /// Waits, up to `bound`, for the calls entered before the pause to return; how many did
    /// not (they are abandoned: no event can be made of them).
    fn wait_for_calls_in_flight(&self, bound: Duration) -> u64 {
        let deadline = Instant::now() + bound;
        // Returns in progress finish within microseconds; wait at least that.
        thread::sleep(Duration::from_millis(50));
        loop {
            let n = self.probes.calls_in_flight().unwrap_or(0);
            if n == 0 || Instant::now() >= deadline {
                return n;
            }
            thread::sleep(Duration::from_millis(20));
        }
    }

    /// Stops recording new calls, lets calls in progress return, drains and stores everything
    /// submitted, and ends the session; the probes stay attached until [`Finished::detach`].
    pub fn finish(mut self, outcome: Result<Stop>) -> Result<Finished> {
        // Nobody is stopped for tracer from now; what the kernel told of before is served (a
        // row each, the processes it stopped probed and continued).
        if let Some(w) = self.watch.as_mut() {
            w.finish();
            w.serve(
                &mut self.probes,
                &mut self.scanner,
                &self.shared,
                self.pid_filter.as_deref(),
            );
        }
        // The semaphores tracer raised go down with the recording.
        self.probes.disarm_all();
        let paused = self.probes.pause();
        let in_flight = self.wait_for_calls_in_flight(CALLS_IN_FLIGHT_WAIT);
        self.shared.stop.store(true, Ordering::SeqCst);
        let read_result = join(self.reader, "ring-buffer reader")?;
        // Read once the reader has emptied the stages: their events count as submitted when
        // the last flush sends them to the ring.
        let kernel = self.probes.counters()?;
        let registry_result = join(self.registry, "process registry")?;
        let (store, write_result) = self
            .writer
            .join()
            .map_err(|_| anyhow!("the database writer thread panicked"))?;
        let session = self.started.session;
        let mut counters = self.shared.counters(&kernel);
        counters.calls_abandoned += in_flight;
        store.set_counters(session, &counters)?;
        if in_flight > 0 {
            store.append_note(
                session,
                &format!("{in_flight} calls still in progress {CALLS_IN_FLIGHT_WAIT:?} after the stop were abandoned (counted in calls_abandoned)"),
            )?;
        }
        let mut kernel_maps = self.probes.map_entries();
        if let Ok(mut held) = self.shared.registry_maps.lock() {
            kernel_maps.append(&mut held);
        }
        let (status, reason) = match &outcome {
            Ok(stop) if stop.by_signal => ("interrupted", stop.reason.clone()),
            Ok(stop) => ("complete", stop.reason.clone()),
            Err(e) => ("failed", format!("{e:#}")),
        };
        let mut problems: Vec<anyhow::Error> = [paused, read_result, registry_result, write_result]
            .into_iter()
            .filter_map(Result::err)
            .collect();
        store.append_note(session, &format!("stopped: {reason}"))?;
        let on_warning =
            record_on_warning(self.on_warning.as_ref(), &self.shared, &store, session)?;
        let dumps = self.dumps.take().map(|h| {
            let mut summary = h.join().unwrap_or_default();
            summary.skipped += self.shared.dumps_skipped.load(Ordering::SeqCst);
            summary
        });
        if let Some(d) = &dumps {
            for path in &d.written {
                eprintln!("tracer: OOM evidence written to {}", path.display());
            }
            for f in &d.failed {
                eprintln!("tracer: warning: an OOM's evidence could not be written: {f}");
                store.append_note(session, &format!("dump-on-oom: {f}"))?;
            }
            if d.removed > 0 || d.skipped > 0 {
                let said = format!(
                    "dump-on-oom: {} older folder(s) removed to keep --dump-max, {} OOM(s) not dumped (the queue was full)",
                    d.removed, d.skipped
                );
                eprintln!("tracer: {said}");
                store.append_note(session, &said)?;
            }
        }
        for p in &problems {
            store.append_note(session, &format!("{p:#}"))?;
        }
        let discovery = self.watch.as_ref().map(super::discovery::Watch::summary);
        if let Some(d) = &discovery {
            store.set_lib_opens_lost(session, d.lost)?;
            for said in super::discovery::said(d) {
                eprintln!("tracer: {said}");
                store.append_note(session, &said)?;
            }
        }
        let libraries = self.probes.libraries();
        let programs = if self.program_stats.is_some() {
            self.probes.program_stats()
        } else {
            Vec::new()
        };
        store.set_libraries(session, &serde_json::to_string(&libraries)?)?;
        store.end_session(session, self.clock.wall_now(), status)?;
        drop(store);
        eprintln!("tracer: stopped: {reason}");
        let stats = self
            .shared
            .live
            .lock()
            .map_err(|_| anyhow!("statistics lock poisoned"))?
            .clone();
        let allocators = allocator_rows(&self.shared)?;
        if let Err(e) = outcome {
            problems.push(e);
        }
        Ok(Finished {
            summary: Summary {
                session,
                db: self.started.db.clone(),
                status,
                reason,
                elapsed_s: self.began.elapsed().as_secs_f64(),
                probes: self.probes.probe_count(),
                libraries,
                counters,
                programs,
                allocators,
                on_warning,
                dumps,
                discovery,
                kernel_maps: kernel_maps
                    .into_iter()
                    .map(|(name, n)| (name.to_owned(), n))
                    .collect(),
                keyframes: KeyframeCost {
                    written: self.shared.keyframes.load(Ordering::SeqCst),
                    cpu_s: self.shared.keyframe_cpu_ns.load(Ordering::SeqCst) as f64 / 1e9,
                },
                allocator: ArmingCost {
                    mode: self.allocator.name(),
                    armings: self.shared.armings.load(Ordering::SeqCst),
                    disarmings: self.shared.disarmings.load(Ordering::SeqCst),
                    carry_out_s: self.shared.arming_ns.load(Ordering::SeqCst) as f64 / 1e9,
                },
                stats,
            },
            probes: self.probes,
            problem: problems.into_iter().next(),
        })
    }
}

/// --on-warning's runs, once the last has ended, each in the session's notes.
fn record_on_warning(
    hook: Option<&HookOutcome>,
    shared: &Shared,
    store: &Store,
    session: i64,
) -> Result<Vec<HookRun>> {
    let Some(hook) = hook else {
        return Ok(Vec::new());
    };
    let runs = hook.wait();
    for run in &runs {
        store.append_note(session, &run.note(&hook.command))?;
    }
    let skipped = shared.on_warning_skipped.load(Ordering::SeqCst);
    if skipped > 0 {
        store.append_note(
            session,
            &format!(
                "on-warning: {skipped} warnings came while the command ran or within its interval"
            ),
        )?;
    }
    Ok(runs)
}

/// The allocators' figures now; starts the live table's next interval.
fn allocator_rows(shared: &Shared) -> Result<Vec<AllocatorRow>> {
    Ok(shared.lock_allocators()?.rows())
}

/// How long the stop waits for calls in progress to return before counting them abandoned.
const CALLS_IN_FLIGHT_WAIT: Duration = Duration::from_secs(1);
/// How often the main thread looks for arming decisions to carry out (`--allocator auto`).
const ARMING_POLL: Duration = Duration::from_millis(50);

/// Refuses what cannot be recorded before anything is attached.
fn check_options(opts: &RecordOptions) -> Result<()> {
    privileges::can_trace().map_err(privilege_error)?;
    let ring = opts.ring_bytes;
    if !ring.is_power_of_two() || !(4096..=(1 << 31)).contains(&ring) {
        return Err(user_error(format!(
            "--ring-size {ring} must be a power of two between 4KiB and 2GiB (e.g. 16MiB)"
        )));
    }
    for &pid in &opts.pids {
        if pid == 0 || !procinfo::exists(pid) {
            return Err(user_error(format!(
                "process {pid} does not exist: check the pid with `ps -p {pid}`"
            )));
        }
    }
    Ok(())
}

fn join(handle: JoinHandle<Result<()>>, what: &str) -> Result<Result<()>> {
    handle
        .join()
        .map_err(|_| anyhow!("the {what} thread panicked"))
}

/// The session just begun: its id and clock, and the processes taken up from an earlier one.
struct Begun {
    session: i64,
    clock: Clock,
    started_ns: i64,
    taken: Vec<restore::TakenUp>,
    /// What the processes taken up did unseen, until this session's probes were attached.
    gaps: Vec<crate::model::run_series::GapRow>,
    nvml: Option<super::registry::NvmlWatch>,
    dump_root: Option<super::dump::DumpRoot>,
}

/// The recording's three threads.
struct Threads {
    reader: JoinHandle<Result<()>>,
    registry: JoinHandle<Result<()>>,
    writer: JoinHandle<(Store, Result<()>)>,
    on_warning: Option<HookOutcome>,
    dumps: Option<JoinHandle<super::dump::DumpSummary>>,
}

/// NVML, as the options ask: the system's where it is found, or the file named (required).
fn open_nvml(opts: &RecordOptions) -> Result<Option<super::registry::NvmlWatch>> {
    let Some(path) = opts.nvml.as_deref() else {
        return Ok(None);
    };
    match crate::traced::nvml::Nvml::open(path) {
        Ok(nvml) => Ok(Some(super::registry::NvmlWatch::new(nvml))),
        Err(e) if opts.nvml_required => Err(crate::exit::user_error(format!(
            "--nvml {path}: {e:#} (name NVIDIA's libnvidia-ml.so.1, or --nvml off)"
        ))),
        Err(_) => Ok(None),
    }
}

/// Starts the reader (ring -> records), the registry (records -> deliveries, with what /proc
/// and the interpreters say) and the writer (deliveries -> the database).
fn spawn_pipeline(
    probes: &mut Probes,
    opts: &RecordOptions,
    pid_filter: &Option<Vec<u32>>,
    shared: &Arc<Shared>,
    store: Store,
    begun: Begun,
) -> Result<Threads> {
    let Begun {
        session,
        clock,
        started_ns,
        taken,
        gaps,
        nvml,
        dump_root,
    } = begun;
    let source = reader::Source {
        ring: probes.take_ring()?,
        // With --stack too: a call from a process that is not Python waits in the stage with
        // its native stack's id.
        stages: Some(probes.take_stages()?),
        arming: opts.allocator == crate::model::arming::Mode::Auto,
    };
    let (records_tx, records_rx) = mpsc::sync_channel(1024);
    let mappings = if opts.stack {
        follow_mappings(shared, records_tx.clone())
    } else {
        None
    };
    let mut python = if opts.stack {
        Some(Python {
            procs: probes.take_py_procs()?,
            stacks: probes.take_native_stacks()?,
            sites: Sites::with_mappings(mappings),
            scope: pid_filter.clone(),
            registered_at: HashMap::new(),
        })
    } else {
        None
    };
    if let Some(python) = python.as_mut() {
        python.scan(shared);
    }
    let hook = opts
        .on_warning
        .clone()
        .map(|cfg| WarningHook::new(cfg, session));
    let on_warning = hook.as_ref().map(WarningHook::outcome);
    let mut registry = Registry {
        join: super::join::Join::live(),
        followed: probes.take_followed()?,
        python,
        wall_offset_ns: clock.offset_ns,
        hook,
        before_interpreter: 0,
        session_started_ns: started_ns,
        series: Default::default(),
        keyframes: KeyframeClock::new(!opts.no_keyframes),
        taken_up: HashSet::new(),
        gaps: Vec::new(),
        ended: Vec::new(),
        ended_joins: HashMap::new(),
        exits: Default::default(),
        callers: Default::default(),
        nvml,
        arming: super::arming::Auto::new(crate::model::arming::Arming::new(
            opts.allocator,
            opts.arming,
        )),
    };
    registry.take_up(taken, gaps, shared)?;
    let (deliveries_tx, deliveries_rx) = mpsc::sync_channel(1024);
    let reader = {
        let shared = shared.clone();
        thread::Builder::new()
            .name("tracer-reader".into())
            .spawn(move || reader::read_loop(source, records_tx, &shared))?
    };
    let registry = {
        let shared = shared.clone();
        thread::Builder::new()
            .name("tracer-registry".into())
            .spawn(move || registry.run(records_rx, deliveries_tx, &shared))?
    };
    let writer_opts = WriterOptions {
        session,
        wall_offset_ns: clock.offset_ns,
        max_db: opts.max_db,
        owner: paths::invoker().owner,
    };
    let (dump_watch, dumps) = match dump_root {
        Some(root) => {
            let (watch, handle) = root.spawn(opts.db.clone(), session, shared.clone())?;
            (Some(watch), Some(handle))
        }
        None => (None, None),
    };
    let writer = {
        let shared = shared.clone();
        thread::Builder::new()
            .name("tracer-writer".into())
            .spawn(move || {
                writer::write_loop(store, deliveries_rx, &shared, writer_opts, dump_watch)
            })?
    };
    Ok(Threads {
        reader,
        registry,
        writer,
        on_warning,
        dumps,
    })
}

/// Follows every process's mappings from the kernel's side band (--stack) on its own thread,
/// which hands what concerns interpreters to the registry at once. Without it (an old kernel, a
/// sandbox), call sites are resolved from /proc as before; the user is told.
fn follow_mappings(shared: &Arc<Shared>, tx: SyncSender<Inbound>) -> Option<SharedMappings> {
    let mappings = match Mappings::open() {
        Ok(m) => m,
        Err(e) => {
            eprintln!(
                "tracer: warning: {e:#}: native frames of processes that exit within milliseconds of a call may stay unresolved, and interpreters are found at their first call"
            );
            return None;
        }
    };
    let fds = match mappings.poll_fds() {
        Ok(fds) => fds,
        Err(e) => {
            eprintln!("tracer: warning: {e:#}");
            return None;
        }
    };
    let shared_maps: SharedMappings = Arc::new(Mutex::new(mappings));
    let (maps, shared) = (shared_maps.clone(), shared.clone());
    let spawned = thread::Builder::new()
        .name("tracer-mappings".into())
        .spawn(move || {
            while !shared.stop.load(Ordering::SeqCst) {
                Mappings::wait(&fds, Duration::from_millis(100));
                let notices = match maps.lock() {
                    Ok(mut m) => {
                        if let Ok(probed) = shared.probed_files.lock() {
                            m.set_probed(&probed);
                        }
                        m.drain();
                        shared.mappings_lost.store(m.lost, Ordering::SeqCst);
                        m.take_notices()
                    }
                    Err(_) => return,
                };
                if !notices.is_empty() && tx.send(Inbound::Processes(notices)).is_err() {
                    return;
                }
            }
        });
    match spawned {
        Ok(_) => Some(shared_maps),
        Err(e) => {
            eprintln!("tracer: warning: start the mappings thread: {e}");
            None
        }
    }
}

/// The session's host-context state: the scheduler tracepoints with the CPU count, or why not.
fn host_context_state(probes: &Probes) -> String {
    match &probes.host_context {
        Ok(()) => format!(
            "sched_switch, sched_wakeup, sched_process_fork, sched_process_exit; cpus={}{}",
            procinfo::online_cpus().unwrap_or(0),
            if probes.follows_armed_only() {
                format!("; {}", crate::model::FOLLOWED_WHILE_ARMED)
            } else {
                String::new()
            }
        ),
        Err(e) => {
            eprintln!(
                "tracer: no host context (explain cannot tie slow calls to CPU contention): {e}"
            );
            format!("off: {e}")
        }
    }
}

fn begin_session(
    store: &Store,
    clock: &Clock,
    opts: &RecordOptions,
    pid_filter: &Option<Vec<u32>>,
) -> Result<i64> {
    let uname = nix::sys::utsname::uname().ok();
    store
        .begin_session(&SessionStart {
            started_ns: clock.wall_now(),
            source: "ebpf",
            host: uname
                .as_ref()
                .map(|u| u.nodename().to_string_lossy().into_owned())
                .unwrap_or_default(),
            kernel: uname
                .as_ref()
                .map(|u| u.release().to_string_lossy().into_owned())
                .unwrap_or_default(),
            command: opts.command.clone(),
            pid_filter: pid_filter.clone(),
        })
        .context("begin the session")
}

/// How often the main thread looks at the stops while it waits on the library opens.
const WATCH_POLL: Duration = Duration::from_millis(100);

/// Discovery in the kernel, or a warning saying why the once-a-second scan is all there is.
fn start_watch(probes: &mut Probes, hold: bool) -> Option<super::discovery::Watch> {
    match probes.take_libwatch(hold) {
        Ok(lib) => {
            if hold {
                if let Err(why) = &probes.task_offsets {
                    eprintln!("tracer: warning: {why}: a process that opens a CUDA library not yet probed is not stopped until it is, and may be found late (marked so)");
                }
            }
            match super::discovery::Watch::new(lib, Clock::now().offset_ns) {
                Ok(w) => Some(w),
                Err(e) => {
                    eprintln!("tracer: warning: {e:#}: CUDA libraries are found by the once-a-second scan only; a short program may go unseen");
                    None
                }
            }
        }
        Err(e) => {
            eprintln!("tracer: warning: {e:#}: CUDA libraries are found by the once-a-second scan only; a short program may go unseen");
            None
        }
    }
}

fn attach_reporting(probes: &mut Probes, lib: &Candidate, pids: Option<&[u32]>) -> Result<()> {
    match probes.attach(lib, pids) {
        Ok(att) => {
            report_attached(att);
            Ok(())
        }
        Err(e) if lib.origin == Origin::Explicit => {
            Err(e.context(format!("attach uprobes in {}", lib.shown)))
        }
        Err(e) => {
            eprintln!("tracer: skipping {}: {e:#}", lib.shown);
            Ok(())
        }
    }
}
