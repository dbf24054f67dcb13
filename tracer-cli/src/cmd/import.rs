//! `tracer import`: store the simulated CUDA runtime's own event log, or a PyTorch memory
//! snapshot (`--snapshot`), as a session.

use std::path::PathBuf;

use anyhow::Result;
use clap::Args;
use tracer_cli::{
    present::json,
    query::snapshot_check,
    record::{import, memory_snapshot},
};

#[derive(Debug, Args)]
pub struct ImportArgs {
    /// The event log the simulated runtime wrote (its SIMCUDA_EVENTS file).
    #[arg(required_unless_present = "snapshot", conflicts_with = "snapshot")]
    pub log: Option<PathBuf>,
    /// A PyTorch memory snapshot with its trace (torch.cuda.memory._dump_snapshot(); what
    /// Megatron and others dump at an OOM): stored as the events PyTorch's probes and the
    /// CUDA runtime would have given, then the layout tracer rebuilds from them is checked
    /// against the snapshot's own final segments.
    #[arg(long, value_name = "FILE")]
    pub snapshot: Option<PathBuf>,
    #[command(flatten)]
    pub db: super::db::DbArgs,
    /// One JSON line on stdout: {"session", "calls", "skipped_lines"}; with --snapshot the
    /// import's figures and "check" (the rebuilt layout against the snapshot's).
    #[arg(long)]
    pub json: bool,
}

pub fn run(args: ImportArgs) -> Result<()> {
    let db = args.db.path()?;
    if let Some(file) = &args.snapshot {
        return snapshot(file, &db, args.json);
    }
    let Some(log) = &args.log else {
        unreachable!("clap requires the log without --snapshot")
    };
    let imported = import::import_log(log, &db)?;
    if args.json {
        return json::line(&imported);
    }
    println!(
        "session {}: {} calls imported from {}{}",
        imported.session,
        imported.calls,
        log.display(),
        match imported.skipped_lines {
            0 => String::new(),
            n => format!(" ({n} lines were not calls and were skipped)"),
        }
    );
    Ok(())
}

fn snapshot(file: &std::path::Path, db: &std::path::Path, as_json: bool) -> Result<()> {
    let snap = memory_snapshot::read_snapshot(file)?;
    let imported = memory_snapshot::import_snapshot(file, &snap, db)?;
    let check = snapshot_check::check(db, imported.session, &snap)?;
    if as_json {
        return json::line(&serde_json::json!({ "import": imported, "check": check }));
    }
    println!(
        "session {}: {} events from {} trace entries of {}",
        imported.session,
        imported.calls,
        imported.entries,
        file.display()
    );
    if imported.segments_before_trace + imported.blocks_before_trace > 0 {
        println!(
            "the trace starts after the job did: {} segments and {} blocks live before its first entry, rebuilt backwards from the final state",
            imported.segments_before_trace, imported.blocks_before_trace
        );
    }
    if imported.times_synthesized {
        println!(
            "the file has no times (an older snapshot): entries are stored 1 µs apart, in order"
        );
    }
    for (what, n) in [
        (
            "entries of actions tracer does not know, skipped",
            imported.notes.unknown_actions,
        ),
        (
            "entries that contradict the final state",
            imported.inconsistent_entries,
        ),
    ] {
        if n > 0 {
            println!("{n} {what}");
        }
    }
    if let Some(first) = &imported.notes.first_unusable {
        println!(
            "{} entries lack a field tracer needs, skipped (the first: {first})",
            imported.notes.unusable_entries
        );
    }
    if imported.notes.trace_overflowed == Some(true) {
        println!(
            "the file says its trace ring overflowed ({} entries kept): what came before its first entry is rebuilt from the final state, its calls unknown",
            imported
                .notes
                .trace_max_entries
                .map_or("its capacity".to_owned(), |n| n.to_string())
        );
    }
    if imported.notes.host_segments + imported.notes.host_entries > 0 {
        println!(
            "{} pinned host segments and {} host trace entries: not imported (tracer models device memory)",
            imported.notes.host_segments, imported.notes.host_entries
        );
    }
    if check.equal() {
        println!(
            "layout check: equal to the allocator's own final state ({} segments, {} blocks)",
            check.segments, check.blocks
        );
    } else {
        println!(
            "layout check: {} of {} segments and {} of {} blocks equal the allocator's own final state; first difference: {}",
            check.segments_equal,
            check.segments,
            check.blocks_equal,
            check.blocks,
            check.first_difference.as_deref().unwrap_or("none")
        );
    }
    Ok(())
}
