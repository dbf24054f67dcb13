//! `tracer report -o report.html`: a session as one self-contained HTML page (charts, the
//! segment map, the chains, call sites and loss counters), to open offline or share.

use std::path::PathBuf;

use anyhow::{Context as _, Result};
use clap::Args;
use tracer_cli::{paths, present};

#[derive(Debug, Args)]
pub struct ReportArgs {
    /// The file to write (replaced if it exists).
    #[arg(short, long, value_name = "FILE")]
    pub output: PathBuf,
    #[command(flatten)]
    pub db: super::db::DbArgs,
    #[command(flatten)]
    pub window: super::explain::WindowArgs,
}

pub fn run(args: ReportArgs) -> Result<()> {
    let who = paths::invoker();
    let db = args.db.path_for(&who)?;
    // The path is checked before the session is read; a failed run leaves no partial page
    // and the previous one in place.
    let mut output = paths::create_output(&args.output, &who)?;
    let data = tracer_cli::query::report::report_data(&db, &args.window.query())?;
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
