//! `tracer export --format perfetto -o FILE`: a session as a Perfetto trace, streamed.

use std::path::PathBuf;

use anyhow::{Context as _, Result};
use clap::{Args, ValueEnum};
use tracer_cli::{
    model::layout::AllocConf,
    paths,
    present::perfetto::{PerfettoWriter, Written},
    query,
    store::{events, Access, Store},
};

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
    #[command(flatten)]
    pub db: super::db::DbArgs,
    /// The session (default: the latest).
    #[arg(long)]
    pub session: Option<i64>,
    /// Only this process.
    #[arg(long)]
    pub pid: Option<u32>,
}

pub fn run(args: ExportArgs) -> Result<()> {
    let who = paths::invoker();
    let db = args.db.path_for(&who)?;
    // A failed export leaves no partial trace and the previous file in place.
    let mut output = paths::create_output(&args.output, &who)?;
    let out = std::io::BufWriter::with_capacity(1 << 20, &mut output);
    let Format::Perfetto = args.format;
    let (session, written) = export_perfetto(&db, args.session, args.pid, out)
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

/// Streams a session (or one process of it) into a Perfetto trace: its calls in time order from
/// the first stored (the counters from the keyframe they begin at, when --max-db evicted the
/// earlier ones), then the texts its programs produced (PyTorch's OOM messages).
fn export_perfetto(
    db: &std::path::Path,
    session: Option<i64>,
    pid: Option<u32>,
    out: impl std::io::Write,
) -> Result<(i64, Written)> {
    let store = Store::open(db, Access::ReadOnly)?;
    let conn = store.conn();
    let info = events::session(conn, session)?;
    let names = events::comms(conn, info.id)?;
    let confs = events::alloc_confs(conn, info.id)?
        .into_iter()
        .map(|(p, c)| (p, AllocConf::parse(&c)))
        .collect();
    let sites = events::site_labels(conn, info.id, &[])?;
    let mut writer = PerfettoWriter::new(out, names, confs, sites);
    let begin = query::begin(conn, info.id, i64::MIN, pid)?;
    writer.start_from(begin.states.iter().cloned());
    let mut failed = None;
    query::walk(db, info.id, &begin, i64::MAX, pid, |step| match step {
        query::Step::Call(e) => {
            if failed.is_none() {
                failed = writer.call(e).err();
            }
        }
        // The calls of the hole were evicted: the allocators go on from the keyframe after it.
        query::Step::Resume { states, .. } => writer.start_from(states),
    })?;
    if let Some(e) = failed {
        return Err(e);
    }
    for m in events::messages(conn, info.id)? {
        if pid.is_none_or(|p| p == m.pid) {
            writer.message(&m)?;
        }
    }
    Ok((info.id, writer.finish()?))
}
