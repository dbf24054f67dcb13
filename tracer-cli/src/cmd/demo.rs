//! `tracer demo`: a training workload on the simulated CUDA runtime, recorded and explained.

use std::{io::Write as _, time::Duration};

use anyhow::Result;
use clap::Args;
use tracer_cli::{
    demo::{self, DemoOptions},
    units::parse_duration,
};

#[derive(Debug, Args)]
pub struct DemoArgs {
    /// The scenario (see --list).
    #[arg(required_unless_present = "list")]
    pub scenario: Option<String>,
    /// List the scenarios.
    #[arg(long)]
    pub list: bool,
    /// Run the workload faster (2) or slower (0.5).
    #[arg(long, default_value_t = 1.0)]
    pub speed: f64,
    /// How long the workload runs.
    #[arg(long, value_parser = parse_duration, default_value = "20s")]
    pub duration: Duration,
    #[command(flatten)]
    pub db: super::db::DbArgs,
    /// Use the simulated runtime's own event log even when eBPF tracing is possible.
    #[arg(long)]
    pub simulated: bool,
}

pub fn run(args: DemoArgs) -> Result<()> {
    if args.list {
        let mut out = std::io::stdout().lock();
        for (name, about) in demo::scenarios() {
            writeln!(out, "{name:<16} {about}")?;
        }
        return Ok(());
    }
    demo::run(&DemoOptions {
        scenario: args.scenario.unwrap_or_default(),
        speed: args.speed,
        duration: args.duration,
        db: args.db.path()?,
        simulated: args.simulated,
    })
}
