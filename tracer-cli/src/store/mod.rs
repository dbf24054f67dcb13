//! SQLite storage. `open` (version and sanity checks, migrations, the files' owner, room on
//! disk), `sessions` (begun, counted, ended), `write` (batched writes), `events` (whole-session
//! reads for the small readers), `blocks` and `walk` (the compact call blocks explain reads, in
//! time order), `offcpu_blocks` (the off-CPU intervals, packed), `tensor_events` and
//! `offcpu_intervals` (both packed kinds as tables to SQL), `discovery` (the processes that
//! opened a CUDA library, and whether tracer saw them from their first call), `keyframes`, `series` (the whole-run
//! series and the gaps), `evict` (--max-db), `readonly` (`tracer query`'s SQL) and `schema` (the
//! versions and their migrations).

pub mod blocks;
mod call_sites;
pub mod discovery;
pub mod events;
mod evict;
pub mod keyframes;
pub mod offcpu_blocks;
mod offcpu_intervals;
mod open;
pub mod readonly;
mod schema;
pub mod series;
mod sessions;
mod tensor_events;
pub mod walk;
pub mod whole_session;
mod write;

use std::path::PathBuf;

use rusqlite::Connection;
use tracer_common::OpClass;

pub use evict::{Eviction, KEPT_SHARE};
pub use schema::{READABLE_FROM, SCHEMA_VERSION};
pub use series::{GapRow, OpFigures, SeriesRow};
pub use sessions::{boot_id, SessionCounters, SessionStart, SNAPSHOT_UNTIMED};
pub use write::{has_row, Batch, StackFrame, StackRow};

pub struct Store {
    conn: Connection,
    path: PathBuf,
}

/// What a command's reads cost, counted where they are paid: the connections this process
/// opened to databases and the walks over a session's calls it made (`TRACER_TIMING` prints
/// them; e2e holds `tracer explain` to one of each).
pub mod counted {
    use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

    static CONNECTIONS: AtomicU64 = AtomicU64::new(0);
    static WALKS: AtomicU64 = AtomicU64::new(0);

    pub fn connections() -> u64 {
        CONNECTIONS.load(Relaxed)
    }

    pub fn walks() -> u64 {
        WALKS.load(Relaxed)
    }

    pub(super) fn opened() {
        CONNECTIONS.fetch_add(1, Relaxed);
    }

    pub(super) fn walked() {
        WALKS.fetch_add(1, Relaxed);
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Access {
    ReadWrite,
    ReadOnly,
}

pub fn class_name(class: OpClass) -> &'static str {
    match class {
        OpClass::Alloc => "alloc",
        OpClass::Free => "free",
        OpClass::MemInfo => "meminfo",
        OpClass::SetDevice => "setdevice",
        OpClass::Sync => "sync",
        OpClass::BlockAlloc => "block_alloc",
        OpClass::BlockFree => "block_free",
        OpClass::Oom => "oom",
        OpClass::EventRecord => "event_record",
        OpClass::EventWait => "event_wait",
        OpClass::SetContext => "setcontext",
        OpClass::Context => "context",
        OpClass::Probes => "probes",
        OpClass::CaptureBegin => "capture_begin",
        OpClass::CaptureEnd => "capture_end",
        OpClass::StreamWait => "stream_wait",
        OpClass::CaptureMode => "capture_mode",
        OpClass::Graph => "graph",
        OpClass::PoolCapture => "pool_capture",
        OpClass::PoolCaptured => "pool_captured",
        OpClass::PoolReset => "pool_reset",
        OpClass::PoolRoute => "pool_route",
        OpClass::PoolUnroute => "pool_unroute",
        OpClass::PoolRelease => "pool_release",
        OpClass::PoolCreate => "pool_create",
        OpClass::PoolOnOom => "pool_on_oom",
    }
}

/// Whether the database has the table `name` (those later schema versions added are read
/// only where present).
fn has_table(conn: &Connection, name: &str) -> rusqlite::Result<bool> {
    conn.query_row(
        "SELECT count(*) FROM sqlite_master WHERE type = 'table' AND name = ?1",
        [name],
        |r| r.get::<_, i64>(0),
    )
    .map(|n| n > 0)
}

#[cfg(test)]
pub(crate) mod tests;
