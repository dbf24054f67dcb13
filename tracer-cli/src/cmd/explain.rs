//! `tracer explain`: what went wrong in a recorded session, why, where, and what to change.
//! Works without privileges on the database a trace left behind.

use std::{io::Write as _, time::Duration};

use anyhow::Result;
use clap::Args;
use tracer_cli::{
    paths, present,
    query::explain::{self, ExplainQuery},
    units::{parse_duration, parse_time},
};

#[derive(Debug, Args)]
pub struct ExplainArgs {
    /// The database (default: the invoking user's ~/.local/share/tracer/tracer.db, or
    /// TRACER_DB). Given more than once (every node's): one answer for each job across them,
    /// as --dumps gives.
    #[arg(long, env = paths::DB_ENV)]
    pub db: Vec<std::path::PathBuf>,
    #[command(flatten)]
    pub window: WindowArgs,
    /// Per-process tables: calls, latency, bytes, outstanding allocations, warnings.
    #[arg(long)]
    pub per_process: bool,
    /// Everything as JSON on stdout.
    #[arg(long)]
    pub json: bool,
    /// One answer for a job across its ranks and nodes, from the `--dump-on-oom` folders
    /// gathered under DIR (every node's): which rank ran out first, whether they died at the
    /// same request or one stood out, a row for every rank. With one --db or none, no database
    /// is read.
    #[arg(long, value_name = "DIR")]
    pub dumps: Option<std::path::PathBuf>,
}

/// Which part of which session: explain's and report's window options.
#[derive(Debug, Args)]
pub struct WindowArgs {
    /// The session (default: the latest).
    #[arg(long)]
    pub session: Option<i64>,
    /// Only the last part of the session (e.g. 300s), ending at its last event (or now, while
    /// the trace runs).
    #[arg(long, value_parser = parse_duration, conflicts_with_all = ["from", "to"])]
    pub since: Option<Duration>,
    /// Window start: a time as tracer prints it (2026-11-22 04:55:12.817 UTC), RFC 3339, or
    /// Unix seconds (1795323312.5) or nanoseconds.
    #[arg(long, value_parser = parse_time)]
    pub from: Option<i64>,
    /// Window end, written as --from.
    #[arg(long, value_parser = parse_time)]
    pub to: Option<i64>,
    /// Only this process.
    #[arg(long)]
    pub pid: Option<u32>,
    /// Frames whose file contains this are not the user's code when naming call sites
    /// (repeatable; site-packages, dist-packages and the standard library always are).
    #[arg(long = "skip-frames", value_name = "TEXT")]
    pub skip_frames: Vec<String>,
}

impl WindowArgs {
    pub fn query(self) -> ExplainQuery {
        ExplainQuery {
            session: self.session,
            since: self.since,
            from: self.from,
            to: self.to,
            pid: self.pid,
            skip_frames: self.skip_frames,
        }
    }
}

pub fn run(args: ExplainArgs) -> Result<()> {
    if args.dumps.is_some() || args.db.len() > 1 {
        let dbs = if args.db.len() > 1 { &args.db[..] } else { &[] };
        return job_answer(args.dumps.as_deref(), dbs, args.window.session, args.json);
    }
    let db = super::db::DbArgs {
        db: args.db.first().cloned(),
    }
    .path()?;
    let explained = explain::explain(&db, &args.window.query())?;
    if std::env::var_os("TRACER_TIMING").is_some() {
        eprintln!(
            "explain: load {:?}, analyze {:?}, {} connection(s), {} walk(s)",
            explained.load_time,
            explained.analysis_time,
            tracer_cli::store::counted::connections(),
            tracer_cli::store::counted::walks()
        );
    }
    if args.json {
        return present::json::document(&explained.report);
    }
    let mut out = std::io::BufWriter::new(std::io::stdout().lock());
    present::explain::text(&mut out, &explained, args.per_process)?;
    out.flush()?;
    Ok(())
}

/// `--dumps DIR` and `--db` more than once: each job's answer from its ranks' folders, the
/// rank snapshots beside them, and every database's OOMs and peers.
fn job_answer(
    dir: Option<&std::path::Path>,
    dbs: &[std::path::PathBuf],
    session: Option<i64>,
    json: bool,
) -> Result<()> {
    use tracer_cli::query::job;
    let mut dumps = Vec::new();
    if let Some(dir) = dir {
        dumps = job::read_dumps(dir)?;
        for (file, rank) in job::rank_snapshots(dir)? {
            dumps.push(snapshot_rank(&file, rank)?);
        }
    }
    let mut peers = Vec::new();
    let mut read = Vec::new();
    for db in dbs {
        let Ok(real) = db.canonicalize() else {
            return Err(tracer_cli::exit::user_error(format!(
                "--db {}: no such database: give each node's tracer.db (copied from it)",
                db.display()
            )));
        };
        // The same database twice is read once.
        if read.contains(&real) {
            continue;
        }
        read.push(real);
        let (ooms, theirs) = job::from_db(db, session)?;
        dumps.extend(ooms);
        peers.extend(theirs);
    }
    let measured = job::measure_peers(peers, &dumps)?;
    dumps.extend(measured);
    let jobs = job::answer(dumps);
    if json {
        return present::json::document(&jobs);
    }
    let mut out = std::io::BufWriter::new(std::io::stdout().lock());
    present::job::text(&mut out, &jobs)?;
    out.flush()?;
    Ok(())
}

/// A rank's own PyTorch snapshot (torchtitan's, any `_dump_snapshot()`), imported into a
/// scratch database and explained there: its row beside the dump folders'.
fn snapshot_rank(file: &std::path::Path, rank: String) -> Result<tracer_cli::query::job::RankDump> {
    use anyhow::Context as _;
    use tracer_cli::record::memory_snapshot;
    let scratch = tempfile::tempdir().context("make a scratch folder for a rank's snapshot")?;
    let db = scratch.path().join("rank.db");
    let snap = memory_snapshot::read_snapshot(file)?;
    memory_snapshot::import_snapshot(file, &snap, &db)?;
    let explained = explain::explain(
        &db,
        &ExplainQuery {
            session: None,
            since: None,
            from: None,
            to: None,
            pid: None,
            skip_frames: Vec::new(),
        },
    )?;
    let report = serde_json::to_value(&explained.report)?;
    let (_, layouts) = tracer_cli::query::layout::layout(
        &db,
        &tracer_cli::query::layout::LayoutQuery {
            session: None,
            pid: None,
            device: None,
            at: tracer_cli::query::layout::At::End,
        },
    )?;
    let layout = serde_json::to_value(&layouts)?;
    let last_ns = report["window"]["to_ns"].as_i64().unwrap_or(0);
    Ok(tracer_cli::query::job::snapshot_rank(
        file,
        rank,
        memory_snapshot::SNAPSHOT_PID,
        &report,
        &layout,
        last_ns,
    ))
}
