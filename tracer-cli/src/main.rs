//! tracer: eBPF tracing of CUDA memory allocation calls.

mod cmd;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

#[derive(Debug, Parser)]
#[command(
    name = "tracer",
    version,
    about = "Trace CUDA memory allocation calls with eBPF, store them in SQLite, explain them"
)]
#[command(
    after_help = "Exit codes: 0 success, 1 failure, 2 bad input, 3 missing privileges or kernel support."
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Record every CUDA allocation call of running processes (needs root or CAP_BPF + CAP_PERFMON).
    Trace(Box<cmd::trace::TraceArgs>),
    /// Run a read-only SQL statement over a trace database.
    Query(cmd::query::QueryArgs),
    /// Check what tracer needs and whether this machine has it.
    Check(cmd::check::CheckArgs),
    /// Explain a recorded session: causal chains with their evidence and fixes (no sudo needed).
    Explain(cmd::explain::ExplainArgs),
    /// Show the call sites of a --stack session: native and Python frames, most frequent first.
    Stacks(cmd::stacks::StacksArgs),
    /// Run a realistic workload on the simulated CUDA runtime, trace it, and explain it (no GPU needed).
    Demo(cmd::demo::DemoArgs),
    /// Store a PyTorch memory snapshot (--snapshot, gzip too) or the simulated runtime's event log as a session to explain.
    Import(cmd::import::ImportArgs),
    /// Show the allocator's segments and blocks at a moment (rebuilt from PyTorch's own probes).
    Layout(cmd::layout::LayoutArgs),
    /// Export a session as a PyTorch memory snapshot (memory_viz) or a Perfetto trace (ui.perfetto.dev).
    Export(cmd::export::ExportArgs),
    /// Write a session as one self-contained HTML page: memory over time, the segment map, the chains.
    Report(cmd::report::ReportArgs),
    /// Serve a trace database to an assistant over MCP (stdio), read-only.
    Mcp(cmd::mcp::McpArgs),
    /// Replay a job's recorded requests under other allocator settings: OOM or not, memory needed.
    Whatif(cmd::whatif::WhatIfArgs),
    /// What changed between two runs of a job: peaks, fragmentation, first warning and OOM, settings, call sites.
    Diff(cmd::diff::DiffArgs),
}

fn main() -> ExitCode {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("warn")).init();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Trace(args) => cmd::trace::run(*args),
        Command::Query(args) => cmd::query::run(args),
        Command::Check(args) => cmd::check::run(args),
        Command::Explain(args) => cmd::explain::run(args),
        Command::Demo(args) => cmd::demo::run(args),
        Command::Stacks(args) => cmd::stacks::run(args),
        Command::Import(args) => cmd::import::run(args),
        Command::Layout(args) => cmd::layout::run(args),
        Command::Export(args) => cmd::export::run(args),
        Command::Report(args) => cmd::report::run(args),
        Command::Mcp(args) => cmd::mcp::run(args),
        Command::Whatif(args) => cmd::whatif::run(args),
        Command::Diff(args) => cmd::diff::run(args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) if tracer_cli::exit::is_broken_pipe(&e) => ExitCode::SUCCESS,
        Err(e) => {
            match e.downcast_ref::<tracer_cli::exit::Coded>() {
                Some(coded) => eprintln!("tracer: {coded}"),
                None => eprintln!("tracer: {e:#}"),
            }
            ExitCode::from(tracer_cli::exit::code_of(&e))
        }
    }
}
