//! `tracer mcp`: an MCP server over stdio for assistants (Claude, Cursor, any MCP client),
//! read-only over a trace database (with `--export-dir`, it also writes PyTorch memory
//! snapshots there, and only there). stdout carries only the protocol; logs go to stderr.

use std::time::Duration;

use anyhow::{Context as _, Result};
use clap::Args;
use tracer_cli::{store, units::parse_duration};

#[derive(Debug, Args)]
pub struct McpArgs {
    #[command(flatten)]
    pub db: super::db::DbArgs,
    /// How long one `query` may run before it is stopped.
    #[arg(long, value_parser = parse_duration, default_value = "20s")]
    pub query_time: Duration,
    /// Lets the `export_snapshot` tool write PyTorch memory snapshots, as new files in this
    /// existing directory only (opened now, never through a link; off without it).
    #[arg(long, value_name = "DIR")]
    pub export_dir: Option<std::path::PathBuf>,
}

pub fn run(args: McpArgs) -> Result<()> {
    if args.query_time.is_zero() {
        return Err(tracer_cli::exit::user_error(
            "--query-time 0 would stop every query: give a duration such as 20s",
        ));
    }
    let db = args.db.path()?;
    // Fail at once, with the fix, rather than at the first tool call.
    store::Store::open(&db, store::Access::ReadOnly)?;
    let export_dir = args
        .export_dir
        .as_deref()
        .map(|d| tracer_cli::paths::ExportDir::open(d, &tracer_cli::paths::invoker()))
        .transpose()?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the MCP server's runtime")?;
    runtime.block_on(tracer_cli::serve::mcp::serve(
        db,
        args.query_time,
        export_dir,
    ))
}
