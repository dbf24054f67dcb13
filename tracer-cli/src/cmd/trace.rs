//! `tracer trace`: record every call into the database, show a live table, and flush
//! everything on Ctrl-C, SIGTERM, --duration, or when the traced processes are gone.

use std::{io::IsTerminal as _, path::PathBuf, time::Duration};

use anyhow::Result;
use clap::Args;
use tracer_cli::{
    exit::user_error,
    paths,
    present::{self, live},
    record::{on_warning::OnWarning, signals, RecordOptions, Recording},
    units::{parse_duration, parse_size},
};
use tracer_common::maps::DEFAULT_RING_BYTES;

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
    /// Also measure tracer's own programs (kernel BPF statistics, a few tens of ns a call more
    /// while on): their runs and run time go into the summary.
    #[arg(long)]
    pub program_stats: bool,
    /// Run this shell command when a traced process's allocator reaches the state in which its
    /// next request fails (the early warning), e.g. to checkpoint. It runs as the user who ran
    /// sudo (never as root), with TRACER_PID, TRACER_DEVICE, TRACER_REQUEST_BYTES,
    /// TRACER_LARGEST_FREE_BYTES, TRACER_DEVICE_FREE_BYTES, ... in its environment; its exit
    /// status goes into the session's notes.
    #[arg(long, value_name = "CMD")]
    pub on_warning: Option<String>,
    /// The user --on-warning's command runs as (default: the one who ran sudo).
    #[arg(long, value_name = "USER", requires = "on_warning")]
    pub on_warning_user: Option<String>,
    /// At most one run per process in this long.
    #[arg(long, value_parser = parse_duration, default_value = "60s", requires = "on_warning")]
    pub on_warning_interval: Duration,
    /// Kill a run still going after this long.
    #[arg(long, value_parser = parse_duration, default_value = "30s", requires = "on_warning")]
    pub on_warning_timeout: Duration,
    /// Benchmark floor: the same probes with empty programs; counts calls, stores nothing.
    #[arg(long, hide = true)]
    pub floor: bool,
    /// Benchmark floor that also reads the clock at entry and return, as timing a call needs.
    #[arg(long, hide = true, conflicts_with = "floor")]
    pub floor_clock: bool,
}

pub fn run(args: TraceArgs) -> Result<()> {
    // Signals are caught from here on: a Ctrl-C during set-up still ends in a flushed session.
    let (stop_tx, stops) = std::sync::mpsc::channel();
    signals::stop_on_signals(stop_tx)?;
    let who = paths::invoker();
    let db = paths::db_path(args.db.as_deref(), &who)?;
    let on_warning = match &args.on_warning {
        Some(command) => Some(OnWarning {
            command: command.clone(),
            user: OnWarning::resolve_user(args.on_warning_user.as_deref(), who.owner)
                .map_err(|e| user_error(format!("{e:#}")))?,
            interval: args.on_warning_interval,
            timeout: args.on_warning_timeout,
        }),
        None => None,
    };
    let mut recording = Recording::start(RecordOptions {
        pids: args.pids.clone(),
        libs: args.libs.clone(),
        db,
        max_db: args.max_db,
        ring_bytes: args.ring_size,
        stack: args.stack,
        floor: if args.floor_clock {
            2
        } else {
            u32::from(args.floor)
        },
        program_stats: args.program_stats,
        command: std::env::args().collect::<Vec<_>>().join(" "),
        on_warning,
    })?;
    if args.json {
        let mut started = serde_json::to_value(recording.started())?;
        started["event"] = "started".into();
        // A reader of stdout that went away stops nothing: the database is the record.
        unless_broken_pipe(present::json::line(&started))?;
    }
    let mut view = live::LiveView::new(std::io::stderr().is_terminal());
    let outcome = recording.run(&stops, args.duration, |snapshot| {
        if !args.quiet {
            view.draw(&live::Status {
                elapsed: snapshot.elapsed,
                libraries: snapshot.libraries,
                probes: snapshot.probes,
                stats: &snapshot.stats,
                counters: &snapshot.counters,
                allocators: &snapshot.allocators,
            });
        }
    });
    let finished = recording.finish(outcome)?;
    let printed = if args.json {
        present::json::line(&present::summary::json(&finished.summary))
    } else {
        present::summary::text(&mut std::io::stdout().lock(), &finished.summary)
    };
    // Everything is stored; the kernel now removes the probes (about 0.1 s per probe).
    finished.detach()?;
    unless_broken_pipe(printed)
}

/// `result` of a write to stdout, with a closed stdout counted as success.
fn unless_broken_pipe(result: Result<()>) -> Result<()> {
    match result {
        Err(e) if tracer_cli::exit::is_broken_pipe(&e) => Ok(()),
        other => other,
    }
}
