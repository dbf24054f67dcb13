//! `tracer check`: what tracer needs, whether this machine has it, and the fix for each gap.

use anyhow::Result;
use clap::Args;
use tracer_cli::{
    exit::{Coded, NO_PRIVILEGE},
    present,
    probe::check,
};

#[derive(Debug, Args)]
pub struct CheckArgs {
    /// Also list every process using each library.
    #[arg(long)]
    pub verbose: bool,
    /// One JSON object on stdout (checks, libraries, and whether tracing works here).
    #[arg(long)]
    pub json: bool,
}

pub fn run(args: CheckArgs) -> Result<()> {
    let report = check::run_checks();
    if args.json {
        present::json::line(&report)?;
    } else {
        present::check::text(&mut std::io::stdout().lock(), &report, args.verbose)?;
    }
    if report.failed > 0 {
        return Err(Coded {
            code: NO_PRIVILEGE,
            message: format!("{} required check(s) failed", report.failed),
        }
        .into());
    }
    Ok(())
}
