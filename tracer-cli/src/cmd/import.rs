//! `tracer import`: store the simulated CUDA runtime's own event log as a session.

use std::path::PathBuf;

use anyhow::Result;
use clap::Args;
use tracer_cli::{paths, present::json, record::import};

#[derive(Debug, Args)]
pub struct ImportArgs {
    /// The event log the simulated runtime wrote (its SIMCUDA_EVENTS file).
    pub log: PathBuf,
    /// The database (default: ~/.local/share/tracer/tracer.db, or TRACER_DB).
    #[arg(long, env = paths::DB_ENV)]
    pub db: Option<PathBuf>,
    /// One JSON line on stdout: {"session", "calls", "skipped_lines"}.
    #[arg(long)]
    pub json: bool,
}

pub fn run(args: ImportArgs) -> Result<()> {
    let db = paths::db_path(args.db.as_deref(), &paths::invoker())?;
    let imported = import::import_log(&args.log, &db)?;
    if args.json {
        return json::line(&imported);
    }
    println!(
        "session {}: {} calls imported from {}{}",
        imported.session,
        imported.calls,
        args.log.display(),
        match imported.skipped_lines {
            0 => String::new(),
            n => format!(" ({n} lines were not calls and were skipped)"),
        }
    );
    Ok(())
}
