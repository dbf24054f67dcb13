//! `tracer layout`: the allocator's segments and blocks at a moment (the end, a time, or the
//! first out-of-memory), rebuilt from a session's calls and PyTorch's own probes.

use std::io::Write as _;

use anyhow::Result;
use clap::Args;
use tracer_cli::{
    present,
    query::layout::{self, At, LayoutQuery},
    units::parse_time,
};

#[derive(Debug, Args)]
pub struct LayoutArgs {
    #[command(flatten)]
    pub db: super::db::DbArgs,
    /// The session (default: the latest).
    #[arg(long)]
    pub session: Option<i64>,
    /// Only this process.
    #[arg(long)]
    pub pid: Option<u32>,
    /// Only this device.
    #[arg(long)]
    pub device: Option<i32>,
    /// When: `oom` (the first out-of-memory), a time as tracer prints it (2026-11-22
    /// 04:55:12.817 UTC), RFC 3339, or Unix seconds or nanoseconds (default: the end).
    #[arg(long, value_parser = parse_at)]
    pub at: Option<At>,
    /// As JSON on stdout.
    #[arg(long)]
    pub json: bool,
    /// The figures after every block event, as JSON lines (for comparing with the allocator's own).
    #[arg(long, conflicts_with_all = ["at", "device"])]
    pub timeline: bool,
}

pub(crate) fn parse_at(text: &str) -> Result<At, String> {
    if text == "oom" {
        return Ok(At::Oom);
    }
    parse_time(text).map(At::Time)
}

pub fn run(args: LayoutArgs) -> Result<()> {
    let db = args.db.path()?;
    if args.timeline {
        let mut out = std::io::BufWriter::new(std::io::stdout().lock());
        layout::layout_timeline(&db, args.session, args.pid, |point| {
            serde_json::to_writer(&mut out, &point)?;
            writeln!(out)?;
            Ok(())
        })?;
        out.flush()?;
        return Ok(());
    }
    let (session, layouts) = layout::layout(
        &db,
        &LayoutQuery {
            session: args.session,
            pid: args.pid,
            device: args.device,
            at: args.at.unwrap_or(At::End),
        },
    )?;
    if layouts.is_empty() {
        return Err(tracer_cli::exit::user_error(format!(
            "session {session} has no device allocations{} to lay out",
            if args.pid.is_some() {
                " of this process"
            } else {
                ""
            }
        )));
    }
    if args.json {
        return present::json::document(&layouts);
    }
    let mut out = std::io::BufWriter::new(std::io::stdout().lock());
    present::layout::text(&mut out, session, &layouts)?;
    out.flush()?;
    Ok(())
}
