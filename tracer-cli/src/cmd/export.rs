//! `tracer export --format perfetto -o FILE`: a session as a Perfetto trace, streamed.

use std::path::PathBuf;

use anyhow::{Context as _, Result};
use clap::{Args, ValueEnum};
use tracer_cli::{explain, paths};

#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum Format {
    /// Perfetto's protobuf trace (open it in ui.perfetto.dev).
    Perfetto,
}

#[derive(Debug, Args)]
pub struct ExportArgs {
    /// The output format.
    #[arg(long, value_enum)]
    pub format: Format,
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
}

pub fn run(args: ExportArgs) -> Result<()> {
    let who = paths::invoker();
    let db = paths::db_path(args.db.as_deref(), &who)?;
    // A failed export leaves no partial trace and the previous file in place.
    let mut output = paths::create_output(&args.output, &who)?;
    let out = std::io::BufWriter::with_capacity(1 << 20, &mut output);
    let Format::Perfetto = args.format;
    let (session, written) = explain::export_perfetto(&db, args.session, args.pid, out)
        .with_context(|| format!("exporting to {}", args.output.display()))?;
    output.commit()?;
    eprintln!(
        "tracer: session {session}: {} slices, {} counter points, {} instants on {} tracks, {} bytes in {}",
        written.slices,
        written.counter_points,
        written.instants,
        written.tracks,
        written.bytes,
        args.output.display()
    );
    Ok(())
}
