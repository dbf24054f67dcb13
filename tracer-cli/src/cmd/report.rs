//! `tracer report -o report.html`: a session as one self-contained HTML page (charts, the
//! segment map, the chains, call sites and loss counters), to open offline or share.

use std::{path::PathBuf, time::Duration};

use anyhow::{Context as _, Result};
use clap::Args;
use tracer_cli::{
    explain::ExplainQuery,
    paths, present,
    units::{parse_duration, parse_time},
};

#[derive(Debug, Args)]
pub struct ReportArgs {
    /// The file to write (replaced if it exists).
    #[arg(short, long, value_name = "FILE")]
    pub output: PathBuf,
    /// The database (default: ~/.local/share/tracer/tracer.db, or TRACER_DB).
    #[arg(long, env = paths::DB_ENV)]
    pub db: Option<PathBuf>,
    /// The session (default: the latest).
    #[arg(long)]
    pub session: Option<i64>,
    /// Only this process.
    #[arg(long)]
    pub pid: Option<u32>,
    /// Only the last part of the session (e.g. 300s), as for explain.
    #[arg(long, value_parser = parse_duration, conflicts_with_all = ["from", "to"])]
    pub since: Option<Duration>,
    /// Window start: Unix time in seconds or nanoseconds.
    #[arg(long, value_parser = parse_time)]
    pub from: Option<i64>,
    /// Window end: Unix time in seconds or nanoseconds.
    #[arg(long, value_parser = parse_time)]
    pub to: Option<i64>,
    /// Frames whose file contains this are not the user's code when naming call sites
    /// (repeatable; site-packages, dist-packages and the standard library always are).
    #[arg(long = "skip-frames", value_name = "TEXT")]
    pub skip_frames: Vec<String>,
}

pub fn run(args: ReportArgs) -> Result<()> {
    let who = paths::invoker();
    let db = paths::db_path(args.db.as_deref(), &who)?;
    // The path is checked before the session is read; a failed run leaves no partial page
    // and the previous one in place.
    let mut output = paths::create_output(&args.output, &who)?;
    let data = tracer_cli::report::report_data(
        &db,
        &ExplainQuery {
            session: args.session,
            since: args.since,
            from: args.from,
            to: args.to,
            pid: args.pid,
            skip_frames: args.skip_frames.clone(),
        },
    )?;
    let mut out = std::io::BufWriter::with_capacity(1 << 20, &mut output);
    let bytes = present::report::write(&mut out, &data)
        .with_context(|| format!("writing {}", args.output.display()))?;
    drop(out);
    output.commit()?;
    eprintln!(
        "tracer: session {}: {} chains, {} chart lines of at most {} points, {} segment maps, {} bytes in {}",
        data.session.id,
        data.explain.chains.len(),
        data.lines.len(),
        tracer_cli::model::series::MAX_BUCKETS,
        data.snapshots.len(),
        bytes,
        args.output.display()
    );
    Ok(())
}
