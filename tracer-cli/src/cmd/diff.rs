//! `tracer diff A B`: what changed between two runs of a job (two sessions).

use std::io::Write as _;

use anyhow::Result;
use clap::Args;
use tracer_cli::{present, query::diff};

#[derive(Debug, Args)]
pub struct DiffArgs {
    /// The run before: a session id (a trace, or an imported snapshot).
    pub a: i64,
    /// The run after.
    pub b: i64,
    #[command(flatten)]
    pub db: super::db::DbArgs,
    /// A's process (default: its busiest).
    #[arg(long)]
    pub pid_a: Option<u32>,
    /// B's process (default: its busiest).
    #[arg(long)]
    pub pid_b: Option<u32>,
    /// As JSON on stdout.
    #[arg(long)]
    pub json: bool,
}

pub fn run(args: DiffArgs) -> Result<()> {
    let db = args.db.path()?;
    let d = diff::diff(&db, args.a, args.b, args.pid_a, args.pid_b)?;
    let mut out = std::io::stdout().lock();
    if args.json {
        serde_json::to_writer_pretty(&mut out, &d)?;
        writeln!(out)?;
    } else {
        present::diff::text(&mut out, &d)?;
    }
    out.flush()?;
    Ok(())
}
