//! `tracer trace`: attach, stream every call into the database, show a live table, and flush
//! everything on Ctrl-C, SIGTERM, --duration, or when the traced processes are gone.

use std::{
    collections::{BTreeMap, HashSet},
    io::IsTerminal as _,
    os::fd::AsFd as _,
    path::PathBuf,
    sync::{
        atomic::{AtomicBool, AtomicU64, Ordering},
        mpsc::{self, Receiver, RecvTimeoutError, SyncSender},
        Arc, Mutex,
    },
    thread,
    time::{Duration, Instant},
};

use anyhow::{anyhow, Context as _, Result};
use aya::maps::{MapData, RingBuf};
use clap::Args;
use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use tracer_common::maps::{Counter, DEFAULT_RING_BYTES};

use crate::{
    decode::{self, Call, Record},
    discover::{self, Candidate, FileId, Origin},
    exit::{privilege_error, user_error},
    live::{self, LiveView, Status},
    paths, privileges,
    probes::{Followed, LoadOptions, Probes, PyProcs},
    procinfo,
    sites::{Site, SiteWriter, Sites},
    stats::LiveStats,
    store::{Access, Batch, SessionCounters, SessionStart, Store},
    units::{parse_duration, parse_size},
};

#[derive(Debug, Args)]
pub struct TraceArgs {
    /// Trace only this process (repeatable). Default: every process using a CUDA library.
    #[arg(long = "pid", value_name = "PID")]
    pub pids: Vec<u32>,
    /// Probe this library or executable (repeatable); replaces discovery.
    #[arg(long = "lib", value_name = "PATH")]
    pub libs: Vec<PathBuf>,
    /// Stop after this long (e.g. 300s, 5m). Default: until Ctrl-C or SIGTERM.
    #[arg(long, value_parser = parse_duration)]
    pub duration: Option<Duration>,
    /// The database (default: the invoking user's ~/.local/share/tracer/tracer.db, or TRACER_DB).
    #[arg(long, env = paths::DB_ENV)]
    pub db: Option<PathBuf>,
    /// Bound the database size (e.g. 2GiB): the oldest sessions are deleted first.
    #[arg(long, value_parser = parse_size)]
    pub max_db: Option<u64>,
    /// Ring buffer size (a power of two, at least 4KiB).
    #[arg(long, value_parser = parse_size, default_value_t = DEFAULT_RING_BYTES as u64)]
    pub ring_size: u64,
    /// No live table on stderr (the summary is still printed).
    #[arg(long)]
    pub quiet: bool,
    /// Record each call's call site: the native user stack and, in CPython 3.10-3.13
    /// processes, the Python frames of the calling thread (see `tracer stacks`).
    #[arg(long)]
    pub stack: bool,
    /// Machine-readable stdout: one JSON line when recording starts (`"event":"started"`, with
    /// the session id) and one at the end (`"event":"summary"`) instead of the text summary.
    #[arg(long)]
    pub json: bool,
    /// Benchmark floor: the same probes with empty programs; counts calls, stores nothing.
    #[arg(long, hide = true)]
    pub floor: bool,
}

/// How long events may wait in the ring before the reader looks (the delivery bound).
const POLL_INTERVAL_MS: u16 = 10;
const COMMIT_EVERY: Duration = Duration::from_millis(200);
const COMMIT_ROWS: usize = 50_000;

pub fn run(args: TraceArgs) -> Result<()> {
    privileges::can_trace().map_err(privilege_error)?;
    if !args.ring_size.is_power_of_two() || args.ring_size < 4096 || args.ring_size > (1 << 31) {
        return Err(user_error(format!(
            "--ring-size {} must be a power of two between 4KiB and 2GiB (e.g. 16MiB)",
            args.ring_size
        )));
    }
    for &pid in &args.pids {
        if pid == 0 || !procinfo::exists(pid) {
            return Err(user_error(format!(
                "process {pid} does not exist: check the pid with `ps -p {pid}`"
            )));
        }
    }
    // Signals are caught from here on: a Ctrl-C during set-up still ends in a flushed session.
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("start the event loop")?;
    let mut signals = {
        let _entered = runtime.enter();
        Signals::install()?
    };
    let explicit = explicit_libraries(&args.libs)?;
    let who = paths::invoker();
    let db_path = paths::db_path(args.db.as_deref(), &who)?;
    paths::create_parent_dirs(&db_path, who.owner)?;
    let store = Store::open(&db_path, Access::ReadWrite)?;
    store.chown_files(who.owner)?;

    let ring_bytes = args.ring_size as u32;
    let mut probes = Probes::load(LoadOptions {
        ring_bytes,
        wakeup_bytes: (ring_bytes as u64 / 4).min(1 << 20),
        floor: args.floor,
        stack: args.stack,
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

    let pid_filter = (!args.pids.is_empty()).then(|| args.pids.clone());
    let mut scanner = Scanner::new(explicit, pid_filter.clone(), &who);
    for lib in scanner.scan(true) {
        attach_reporting(&mut probes, &lib, pid_filter.as_deref())?;
    }
    if probes.probe_count() == 0 {
        eprintln!("tracer: no CUDA library found yet; watching for processes that load one (rescanning every second)");
    }

    let clock = Clock::now();
    let uname = nix::sys::utsname::uname().ok();
    let session = store.begin_session(&SessionStart {
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
        command: std::env::args().collect::<Vec<_>>().join(" "),
        pid_filter: pid_filter.clone(),
    })?;
    store.set_libraries(session, &serde_json::to_string(&probes.libraries())?)?;
    let host = match &probes.host_context {
        Ok(()) => format!(
            "sched_switch, sched_wakeup, sched_process_fork; cpus={}",
            procinfo::online_cpus().unwrap_or(0)
        ),
        Err(e) => {
            eprintln!(
                "tracer: no host context (explain cannot tie slow calls to CPU contention): {e}"
            );
            format!("off: {e}")
        }
    };
    store.set_host_context(session, &host)?;
    eprintln!(
        "tracer: session {session}: {} probes on {} libraries; writing to {}",
        probes.probe_count(),
        probes.library_count(),
        db_path.display()
    );
    let shared = Arc::new(Shared::default());
    let ring = probes.take_ring()?;
    let followed = probes.take_followed()?;
    let mut python = if args.stack {
        Some((
            probes.take_py_procs()?,
            Sites::default(),
            pid_filter.clone(),
        ))
    } else {
        None
    };
    // Interpreters already running are registered before "started" is announced, so that a
    // process told to go on by it has Python frames from its first call.
    if let Some((procs, sites, scope)) = python.as_mut() {
        for pid in scope.clone().unwrap_or_else(crate::discover::all_pids) {
            register_python(procs, sites, pid);
        }
    }
    if args.json {
        print_json(&serde_json::json!({
            "event": "started",
            "session": session,
            "db": db_path,
            "probes": probes.probe_count(),
            "libraries": probes.libraries(),
            "pid_filter": pid_filter,
            "host_context": host,
        }))?;
    }

    let (tx, rx) = mpsc::sync_channel::<Delivery>(1024);
    let reader = {
        let shared = shared.clone();
        let offset = clock.offset_ns;
        thread::Builder::new()
            .name("tracer-reader".into())
            .spawn(move || read_loop(ring, followed, python, tx, &shared, offset))?
    };
    let writer_opts = WriterOptions {
        session,
        wall_offset_ns: clock.offset_ns,
        max_db: args.max_db,
        owner: who.owner,
    };
    let writer = {
        let shared = shared.clone();
        thread::Builder::new()
            .name("tracer-writer".into())
            .spawn(move || write_loop(store, rx, &shared, writer_opts))?
    };

    let started = Instant::now();
    let outcome = runtime.block_on(main_loop(
        &args,
        &mut signals,
        &mut probes,
        &mut scanner,
        &shared,
        started,
        pid_filter.as_deref(),
    ));

    // Pause the probes, let calls already inside return, then drain: everything submitted is
    // read and stored before the (slow) detach.
    let paused = probes.pause();
    thread::sleep(Duration::from_millis(100));
    let kernel = probes.counters()?;
    shared.stop.store(true, Ordering::SeqCst);
    let read_result = reader
        .join()
        .map_err(|_| anyhow!("the ring-buffer reader thread panicked"))?;
    let (store, write_result) = writer
        .join()
        .map_err(|_| anyhow!("the database writer thread panicked"))?;
    let counters = snapshot(&shared, &kernel);
    store.set_counters(session, &counters)?;
    let (status, reason) = match &outcome {
        Ok(stop) if stop.by_signal => ("interrupted", stop.reason.clone()),
        Ok(stop) => ("complete", stop.reason.clone()),
        Err(e) => ("failed", format!("{e:#}")),
    };
    let mut problems = Vec::new();
    for r in [paused, read_result, write_result] {
        if let Err(e) = r {
            problems.push(format!("{e:#}"));
        }
    }
    store.append_note(session, &format!("stopped: {reason}"))?;
    for p in &problems {
        store.append_note(session, p)?;
    }
    store.set_libraries(session, &serde_json::to_string(&probes.libraries())?)?;
    store.end_session(session, clock.wall_now(), status)?;
    store.chown_files(who.owner)?;
    drop(store);

    eprintln!("tracer: stopped: {reason}");
    let stats = shared
        .live
        .lock()
        .map_err(|_| anyhow!("statistics lock poisoned"))?
        .clone();
    let summary = Summary {
        session,
        db: &db_path,
        elapsed: started.elapsed(),
        stats: &stats,
        counters: &counters,
        libraries: probes.library_count(),
        probes: probes.probe_count(),
    };
    if args.json {
        print_json(&summary.json(status, &reason))?;
    } else {
        summary.print()?;
    }
    // Everything is stored; the kernel now removes the probes (about 0.1 s per probe).
    probes.detach_all()?;
    if let Some(p) = problems.first() {
        return Err(anyhow!("{p}"));
    }
    outcome.map(|_| ())
}

fn explicit_libraries(libs: &[PathBuf]) -> Result<Vec<Candidate>> {
    let mut out = Vec::new();
    for path in libs {
        let id = discover::file_id(path).ok_or_else(|| {
            user_error(format!(
                "--lib {}: no such file (pass the path of libcudart.so.* or libcuda.so.*)",
                path.display()
            ))
        })?;
        let symbols = crate::elf::read_symbols(path)
            .map_err(|e| user_error(format!("--lib {}: {e:#}", path.display())))?;
        if symbols.targets.is_empty() {
            return Err(user_error(format!(
                "--lib {}: the file exports none of the probed CUDA calls (cudaMalloc, cuMemAlloc_v2, ...): pass libcudart.so.* or libcuda.so.*",
                path.display()
            )));
        }
        let open_path = path.canonicalize().unwrap_or_else(|_| path.clone());
        out.push(Candidate {
            shown: open_path.display().to_string(),
            open_path,
            id,
            origin: Origin::Explicit,
            pids: Default::default(),
        });
    }
    Ok(out)
}

fn attach_reporting(probes: &mut Probes, lib: &Candidate, pids: Option<&[u32]>) -> Result<()> {
    match probes.attach(lib, pids) {
        Ok(att) => {
            eprintln!(
                "tracer: probing {} ({}, {} symbols)",
                att.path,
                att.origin,
                att.symbols.len()
            );
            if !att.missing.is_empty() {
                eprintln!(
                    "tracer:   not exported there (not traced): {}",
                    att.missing.join(", ")
                );
            }
            for f in &att.failed {
                eprintln!("tracer:   failed to attach {f}");
            }
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

/// Why the trace ended; a signal marks the session "interrupted", anything else "complete".
struct Stop {
    reason: String,
    by_signal: bool,
}

impl Stop {
    fn signal(reason: &str) -> Stop {
        Stop {
            reason: reason.into(),
            by_signal: true,
        }
    }

    fn done(reason: impl Into<String>) -> Stop {
        Stop {
            reason: reason.into(),
            by_signal: false,
        }
    }
}

/// Finds libraries to probe, now and during the trace.
struct Scanner {
    explicit: Vec<Candidate>,
    pids: Option<Vec<u32>>,
    homes: Vec<PathBuf>,
    static_cache: BTreeMap<FileId, bool>,
    seen: HashSet<FileId>,
    ticks: u64,
}

impl Scanner {
    fn new(explicit: Vec<Candidate>, pids: Option<Vec<u32>>, who: &paths::Invoker) -> Self {
        let mut homes: Vec<PathBuf> = who.home.iter().cloned().collect();
        if let Some(h) = std::env::var_os("HOME").map(PathBuf::from) {
            if !homes.contains(&h) {
                homes.push(h);
            }
        }
        Scanner {
            explicit,
            pids,
            homes,
            static_cache: BTreeMap::new(),
            seen: HashSet::new(),
            ticks: 0,
        }
    }

    /// Candidates not returned before. With --lib, only those; with --pid, only what those map.
    fn scan(&mut self, first: bool) -> Vec<Candidate> {
        self.ticks += 1;
        let mut found = Vec::new();
        if !self.explicit.is_empty() {
            if first {
                found = self.explicit.clone();
            }
        } else {
            let pids = self.pids.clone().unwrap_or_else(discover::all_pids);
            found.extend(discover::scan_processes(&pids, &mut self.static_cache));
            // Installed copies change rarely: look every 30 s, and not when scoped to pids.
            if self.pids.is_none() && (first || self.ticks.is_multiple_of(30)) {
                found.extend(discover::scan_installed(&self.homes));
            }
        }
        found.retain(|c| self.seen.insert(c.id));
        found
    }
}

#[derive(Default)]
struct Shared {
    stop: AtomicBool,
    live: Mutex<LiveStats>,
    events_read: AtomicU64,
    events_stored: AtomicU64,
    decode_errors: AtomicU64,
    /// The kernel counters as last read by the main loop (for periodic session updates).
    kernel: Mutex<[u64; Counter::COUNT as usize]>,
}

fn snapshot(shared: &Shared, kernel: &[u64; Counter::COUNT as usize]) -> SessionCounters {
    SessionCounters {
        entries: kernel[Counter::Entries as usize],
        submitted: kernel[Counter::Submitted as usize],
        dropped_ring_full: kernel[Counter::RingFull as usize],
        unmatched_returns: kernel[Counter::UnmatchedReturns as usize],
        alloc_map_full: kernel[Counter::AllocMapFull as usize],
        inflight_full: kernel[Counter::InflightFull as usize],
        events_read: shared.events_read.load(Ordering::SeqCst),
        events_stored: shared.events_stored.load(Ordering::SeqCst),
        decode_errors: shared.decode_errors.load(Ordering::SeqCst),
        offcpu_submitted: kernel[Counter::SchedSubmitted as usize],
        offcpu_dropped: kernel[Counter::SchedRingFull as usize],
    }
}

struct Signals {
    int: tokio::signal::unix::Signal,
    term: tokio::signal::unix::Signal,
    hup: tokio::signal::unix::Signal,
}

impl Signals {
    /// Must run inside the runtime.
    fn install() -> Result<Signals> {
        use tokio::signal::unix::{signal, SignalKind};
        Ok(Signals {
            int: signal(SignalKind::interrupt()).context("install the SIGINT handler")?,
            term: signal(SignalKind::terminate()).context("install the SIGTERM handler")?,
            hup: signal(SignalKind::hangup()).context("install the SIGHUP handler")?,
        })
    }
}

async fn main_loop(
    args: &TraceArgs,
    signals: &mut Signals,
    probes: &mut Probes,
    scanner: &mut Scanner,
    shared: &Shared,
    started: Instant,
    pid_filter: Option<&[u32]>,
) -> Result<Stop> {
    let deadline = args
        .duration
        .map(|d| tokio::time::Instant::from_std(started + d));
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut view = LiveView::new(std::io::stderr().is_terminal());
    let mut gone: HashSet<u32> = HashSet::new();
    loop {
        tokio::select! {
            _ = signals.int.recv() => return Ok(Stop::signal("interrupted (SIGINT)")),
            _ = signals.term.recv() => return Ok(Stop::signal("terminated (SIGTERM)")),
            _ = signals.hup.recv() => return Ok(Stop::signal("terminated (SIGHUP)")),
            _ = async { tokio::time::sleep_until(deadline.unwrap_or_else(tokio::time::Instant::now)).await }, if deadline.is_some() => {
                return Ok(Stop::done(format!("--duration {}s reached", args.duration.unwrap_or_default().as_secs_f64())));
            }
            _ = tick.tick() => {
                if shared.stop.load(Ordering::SeqCst) {
                    return Err(anyhow!("the reader or writer stopped early"));
                }
                for lib in scanner.scan(false) {
                    attach_reporting(probes, &lib, pid_filter)?;
                }
                let kernel = probes.counters()?;
                if let Ok(mut k) = shared.kernel.lock() {
                    *k = kernel;
                }
                if let Some(pids) = pid_filter {
                    for &pid in pids {
                        if !procinfo::exists(pid) && gone.insert(pid) {
                            eprintln!("tracer: process {pid} exited");
                        }
                    }
                    if gone.len() == pids.len() {
                        return Ok(Stop::done("every traced process exited"));
                    }
                }
                if !args.quiet {
                    let counters = snapshot(shared, &kernel);
                    let stats = shared.live.lock().map_err(|_| anyhow!("statistics lock poisoned"))?.clone();
                    view.draw(&Status {
                        elapsed: started.elapsed(),
                        libraries: probes.library_count(),
                        probes: probes.probe_count(),
                        stats: &stats,
                        counters: &counters,
                    });
                }
            }
        }
    }
}

/// Drains the ring buffer: wakes on the kernel's signal (a batch is waiting) or every
/// POLL_INTERVAL_MS, whichever comes first, so delivery latency stays bounded.
fn read_loop(
    mut ring: RingBuf<MapData>,
    mut followed: Option<Followed>,
    mut python: Option<(PyProcs, Sites, Option<Vec<u32>>)>,
    tx: SyncSender<Delivery>,
    shared: &Shared,
    wall_offset_ns: i64,
) -> Result<()> {
    let result = (|| -> Result<()> {
        let boot = procinfo::boot_time_ns();
        let mut pids_seen: HashSet<u32> = HashSet::new();
        let mut out = Delivery::default();
        let mut last_python_scan: Option<Instant> = None;
        loop {
            let stopping = shared.stop.load(Ordering::SeqCst);
            if let Some((procs, sites, scope)) = python.as_mut() {
                // Interpreters started since the last look are registered before they call,
                // as far as a once-a-second scan allows (the first sight of a pid also does).
                if last_python_scan.is_none_or(|t| t.elapsed() >= PYTHON_SCAN_EVERY) {
                    last_python_scan = Some(Instant::now());
                    let pids = scope.clone().unwrap_or_else(crate::discover::all_pids);
                    for pid in pids {
                        register_python(procs, sites, pid);
                    }
                }
            }
            let mut decode_errors = 0;
            while let Some(item) = ring.next() {
                match decode::decode(&item) {
                    Ok(Record::Call(mut call)) => {
                        // Read /proc at first sight: a short-lived process may be gone by the
                        // time its events are written.
                        if pids_seen.insert(call.pid) {
                            let seen = call.ts_mono_ns as i64 + wall_offset_ns;
                            out.processes
                                .push(procinfo::read(call.pid, seen, &call.comm, boot));
                            if let Some(f) = followed.as_mut() {
                                f.process_tree(call.pid);
                            }
                            if let Some((procs, sites, _)) = python.as_mut() {
                                register_python(procs, sites, call.pid);
                            }
                        }
                        if let (Some(site), Some((_, sites, _))) =
                            (call.site.take(), python.as_mut())
                        {
                            call.stack = Some(sites.intern(call.pid, *site, &mut out.sites));
                        }
                        out.calls.push(call);
                    }
                    Ok(Record::OffCpu(off)) => out.offcpu.push(off),
                    Err(_) => decode_errors += 1,
                }
                if out.calls.len() + out.offcpu.len() >= 8192 {
                    deliver(std::mem::take(&mut out), &tx, shared)?;
                }
            }
            shared
                .decode_errors
                .fetch_add(decode_errors, Ordering::SeqCst);
            if !out.calls.is_empty() || !out.offcpu.is_empty() {
                deliver(std::mem::take(&mut out), &tx, shared)?;
            }
            if stopping {
                return Ok(());
            }
            let mut fds = [PollFd::new(ring.as_fd(), PollFlags::POLLIN)];
            match poll(&mut fds, PollTimeout::from(POLL_INTERVAL_MS)) {
                Ok(_) | Err(nix::errno::Errno::EINTR) => {}
                Err(e) => return Err(anyhow!("poll the event ring buffer: {e}")),
            }
        }
    })();
    if result.is_err() {
        shared.stop.store(true, Ordering::SeqCst);
    }
    result
}

/// Calls read from the ring, with the processes first seen among them, and the traced
/// threads' off-CPU intervals.
#[derive(Default)]
struct Delivery {
    calls: Vec<Call>,
    processes: Vec<procinfo::ProcessInfo>,
    offcpu: Vec<decode::OffCpu>,
    /// Call sites first seen in these calls (--stack).
    sites: Vec<(i64, Site)>,
}

fn deliver(delivery: Delivery, tx: &SyncSender<Delivery>, shared: &Shared) -> Result<()> {
    shared
        .events_read
        .fetch_add(delivery.calls.len() as u64, Ordering::SeqCst);
    if let Ok(mut live) = shared.live.lock() {
        for call in &delivery.calls {
            live.add(call);
        }
    }
    tx.send(delivery)
        .map_err(|_| anyhow!("the database writer stopped"))
}

impl Delivery {
    /// Adds `more` to what waits for the next commit. Its new call sites are stored at once and
    /// its calls made to point at the stored ids.
    fn absorb(
        &mut self,
        more: Delivery,
        sites: &mut SiteWriter,
        store: &mut Store,
        session: i64,
    ) -> Result<()> {
        sites.store(store, session, &more.sites)?;
        self.calls.extend(more.calls.into_iter().map(|mut c| {
            c.stack = c.stack.and_then(|local| sites.stored_id(local));
            c
        }));
        self.processes.extend(more.processes);
        self.offcpu.extend(more.offcpu);
        Ok(())
    }
}

const PYTHON_SCAN_EVERY: Duration = Duration::from_secs(1);

/// Puts `pid`'s interpreter, if it runs one tracer can walk, where the kernel finds it.
fn register_python(procs: &mut PyProcs, sites: &mut Sites, pid: u32) {
    if let Some(interp) = sites.register(pid) {
        if let Err(e) = procs.insert(pid, interp) {
            eprintln!("tracer: {e:#}");
        }
    }
}

#[derive(Clone, Copy)]
struct WriterOptions {
    session: i64,
    wall_offset_ns: i64,
    max_db: Option<u64>,
    owner: Option<(u32, u32)>,
}

/// Batches calls into transactions; notes new processes and threads; keeps the session's
/// counters current and the database under --max-db. Returns the store for the final update.
fn write_loop(
    mut store: Store,
    rx: Receiver<Delivery>,
    shared: &Shared,
    opts: WriterOptions,
) -> (Store, Result<()>) {
    let result = (|| -> Result<()> {
        // What waits for the next commit: calls, processes and off-CPU records (sites are
        // stored as they arrive, before the calls that point at them).
        let mut pending = Delivery::default();
        let mut threads_seen: HashSet<(u32, u32)> = HashSet::new();
        let mut site_writer = SiteWriter::default();
        let mut last_commit = Instant::now();
        let mut last_housekeeping = Instant::now();
        let mut owned = false;
        loop {
            let disconnected = match rx.recv_timeout(Duration::from_millis(50)) {
                Ok(first) => {
                    pending.absorb(first, &mut site_writer, &mut store, opts.session)?;
                    while let Ok(more) = rx.try_recv() {
                        pending.absorb(more, &mut site_writer, &mut store, opts.session)?;
                        if pending.calls.len() >= COMMIT_ROWS {
                            break;
                        }
                    }
                    false
                }
                Err(RecvTimeoutError::Timeout) => false,
                Err(RecvTimeoutError::Disconnected) => true,
            };
            if (!pending.calls.is_empty() || !pending.offcpu.is_empty())
                && (disconnected
                    || pending.calls.len() >= COMMIT_ROWS
                    || last_commit.elapsed() >= COMMIT_EVERY)
            {
                let mut threads = Vec::new();
                for call in &pending.calls {
                    if threads_seen.insert((call.pid, call.tid)) {
                        // The kernel sends a thread's name with its first event only; if that
                        // one was lost, ask /proc.
                        let comm = if call.comm.is_empty() {
                            procinfo::thread_comm(call.pid, call.tid).unwrap_or_default()
                        } else {
                            call.comm.clone()
                        };
                        threads.push((call.pid, call.tid, comm));
                    }
                }
                store.write_batch(&Batch {
                    session: opts.session,
                    wall_offset_ns: opts.wall_offset_ns,
                    calls: &pending.calls,
                    threads: &threads,
                    processes: &pending.processes,
                    offcpu: &pending.offcpu,
                })?;
                shared
                    .events_stored
                    .fetch_add(pending.calls.len() as u64, Ordering::SeqCst);
                pending = Delivery::default();
                last_commit = Instant::now();
                if !owned {
                    store.chown_files(opts.owner)?;
                    owned = true;
                }
            }
            if last_housekeeping.elapsed() >= Duration::from_secs(1) || disconnected {
                last_housekeeping = Instant::now();
                let kernel = *shared
                    .kernel
                    .lock()
                    .map_err(|_| anyhow!("counter lock poisoned"))?;
                store.set_counters(opts.session, &snapshot(shared, &kernel))?;
                if let Some(max) = opts.max_db {
                    for note in store.enforce_max_size(opts.session, max)? {
                        eprintln!("tracer: {note}");
                        store.append_note(opts.session, &note)?;
                    }
                }
            }
            if disconnected {
                return Ok(());
            }
        }
    })();
    if result.is_err() {
        shared.stop.store(true, Ordering::SeqCst);
    }
    (store, result)
}

/// Converts the kernel's CLOCK_MONOTONIC timestamps to wall-clock time.
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

/// What the trace recorded, printed when it stops.
struct Summary<'a> {
    session: i64,
    db: &'a std::path::Path,
    elapsed: Duration,
    stats: &'a LiveStats,
    counters: &'a SessionCounters,
    libraries: usize,
    probes: usize,
}

impl Summary<'_> {
    fn print(&self) -> Result<()> {
        use std::io::Write as _;
        let (session, c) = (self.session, self.counters);
        let mut out = std::io::stdout().lock();
        writeln!(
            out,
            "session {session}: {:.1}s, {} libraries, {} probes, {} processes",
            self.elapsed.as_secs_f64(),
            self.libraries,
            self.probes,
            self.stats.pids.len()
        )?;
        for line in live::op_table(self.stats, self.elapsed) {
            writeln!(out, "{line}")?;
        }
        writeln!(
            out,
            "events: {} submitted, {} read, {} stored; dropped (ring full): {}; unmatched returns: {}; decode errors: {}",
            c.submitted, c.events_read, c.events_stored, c.dropped_ring_full, c.unmatched_returns, c.decode_errors
        )?;
        if c.dropped_ring_full > 0 {
            writeln!(
                out,
                "warning: {} events were lost because the ring buffer was full: raise --ring-size",
                c.dropped_ring_full
            )?;
        }
        if c.alloc_map_full > 0 {
            writeln!(out, "warning: {} allocations were not tracked (allocation map full): their frees lack a size", c.alloc_map_full)?;
        }
        writeln!(out, "database: {}", self.db.display())?;
        Ok(())
    }

    fn json(&self, status: &str, reason: &str) -> serde_json::Value {
        let ops: Vec<serde_json::Value> = self
            .stats
            .ops
            .iter()
            .map(|(op, s)| {
                serde_json::json!({
                    "op": op.name(), "calls": s.calls, "errors": s.errors, "bytes": s.bytes,
                    "p50_ns": s.latency.quantile(0.5), "p99_ns": s.latency.quantile(0.99), "max_ns": s.max_ns,
                })
            })
            .collect();
        serde_json::json!({
            "event": "summary",
            "session": self.session,
            "status": status,
            "reason": reason,
            "elapsed_s": self.elapsed.as_secs_f64(),
            "libraries": self.libraries,
            "probes": self.probes,
            "processes": self.stats.pids,
            "ops": ops,
            "counters": self.counters,
            "db": self.db,
        })
    }
}

/// One JSON record on its own line, flushed at once (a script may be waiting for it).
fn print_json(value: &serde_json::Value) -> Result<()> {
    use std::io::Write as _;
    let mut out = std::io::stdout().lock();
    serde_json::to_writer(&mut out, value)?;
    writeln!(out)?;
    out.flush()?;
    Ok(())
}
