//! `tracer export --format perfetto -o FILE`: a session as a Perfetto trace, streamed;
//! `--format pytorch-snapshot`: one process as PyTorch's memory snapshot pickle.

use std::path::PathBuf;

use anyhow::{Context as _, Result};
use clap::{Args, ValueEnum};
use tracer_cli::{
    model::layout::AllocConf,
    paths, present,
    present::perfetto::{PerfettoWriter, Written},
    query,
    query::layout::At,
    query::pytorch_snapshot::{self, SnapshotQuery, DEFAULT_MAX_ENTRIES},
    store::{events, Access, Store},
};

#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum Format {
    /// Perfetto's protobuf trace (open it in ui.perfetto.dev).
    Perfetto,
    /// PyTorch's memory snapshot pickle (`torch.cuda.memory._dump_snapshot`): open it in
    /// pytorch.org/memory_viz or read it with torch.cuda._memory_viz.
    PytorchSnapshot,
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
    /// Only this process (a memory snapshot is one process's: needed when several used
    /// PyTorch's allocator).
    #[arg(long)]
    pub pid: Option<u32>,
    /// pytorch-snapshot: the instant: `oom` (the first out-of-memory) or a time as tracer
    /// prints it (default: the end).
    #[arg(long, value_parser = super::layout::parse_at)]
    pub at: Option<At>,
    /// pytorch-snapshot: only the trace entries this long before the instant (e.g. 300s).
    #[arg(long, value_parser = tracer_cli::units::parse_duration)]
    pub since: Option<std::time::Duration>,
    /// pytorch-snapshot: the most trace entries per device, the newest kept
    /// (`trace_alloc_overflowed` is then set).
    #[arg(long, default_value_t = DEFAULT_MAX_ENTRIES as u64, value_parser = clap::value_parser!(u64).range(1..))]
    pub max_entries: u64,
}

pub fn run(args: ExportArgs) -> Result<()> {
    let who = paths::invoker();
    let db = args.db.path_for(&who)?;
    // A failed export leaves no partial trace and the previous file in place.
    let mut output = paths::create_output(&args.output, &who)?;
    let out = std::io::BufWriter::with_capacity(1 << 20, &mut output);
    if let Format::PytorchSnapshot = args.format {
        export_snapshot(&db, &args, out)
            .with_context(|| format!("exporting to {}", args.output.display()))?;
        return output.commit();
    }
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

/// Writes one process as a PyTorch memory snapshot; says on stderr what it holds and what was
/// left out.
fn export_snapshot(
    db: &std::path::Path,
    args: &ExportArgs,
    mut out: impl std::io::Write,
) -> Result<()> {
    let export = pytorch_snapshot::export(
        db,
        &SnapshotQuery {
            session: args.session,
            pid: args.pid,
            at: args.at.unwrap_or(At::End),
            since_ns: args
                .since
                .map(|d| i64::try_from(d.as_nanos()).unwrap_or(i64::MAX)),
            max_entries: usize::try_from(args.max_entries).unwrap_or(usize::MAX),
        },
    )?;
    present::pytorch_snapshot::write(&mut out, &export)?;
    out.flush()?;
    let entries: usize = export.traces.iter().map(Vec::len).sum();
    let blocks: usize = export.segments.iter().map(|s| s.blocks.len()).sum();
    eprintln!(
        "tracer: session {} pid {}: {} segments, {} blocks, {} trace entries on {} devices, {} call sites in {}",
        export.session,
        export.pid,
        export.segments.len(),
        blocks,
        entries,
        export.traces.len(),
        export.frames.len(),
        args.output.display()
    );
    for line in present::pytorch_snapshot::left_out_lines(&export.left_out) {
        eprintln!("tracer: left out: {line}");
    }
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
    let mut writer = PerfettoWriter::new(out, names, sites);
    let mut replay = query::perfetto::Replay::new(confs);
    let begin = query::begin(conn, info.id, i64::MIN, pid)?;
    replay.start_from(begin.states.iter().cloned());
    let mut failed = None;
    query::walk(conn, info.id, &begin, i64::MAX, pid, |step| match step {
        query::Step::Call(e) => {
            let changed = replay.call(e);
            if failed.is_none() {
                failed = writer.call(e, &changed).err();
            }
        }
        // The calls of the hole were evicted: the allocators go on from the keyframe after it.
        query::Step::Resume { states, .. } => replay.start_from(states),
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
