//! SQLite storage: opening (with version and sanity checks), sessions, and batched writes.

pub mod blocks;
pub mod events;
mod evict;
pub mod keyframes;
pub mod readonly;
mod schema;
pub mod series;
mod tensor_events;
pub mod walk;

use std::path::{Path, PathBuf};

use anyhow::{Context as _, Result};
use rusqlite::{params, Connection, OpenFlags};
use serde::Serialize;
use tracer_common::{Op, OpClass};

pub use evict::{Eviction, KEPT_SHARE};
pub use schema::SCHEMA_VERSION;
pub use series::{GapRow, OpFigures, SeriesRow};

use crate::{decode::Call, exit::user_error, model::ProcessInfo};

pub struct Store {
    conn: Connection,
    path: PathBuf,
}

#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Access {
    ReadWrite,
    ReadOnly,
}

impl SessionCounters {
    /// What tracer could not keep, by the session column that counts it.
    pub fn losses(&self) -> [(&'static str, u64); 10] {
        [
            ("dropped_ring_full", self.dropped_ring_full),
            ("unmatched_returns", self.unmatched_returns),
            ("alloc_map_full", self.alloc_map_full),
            ("inflight_full", self.inflight_full),
            ("decode_errors", self.decode_errors),
            ("offcpu_dropped", self.offcpu_dropped),
            ("tail_call_failed", self.tail_call_failed),
            ("map_insert_failed", self.map_insert_failed),
            ("calls_abandoned", self.calls_abandoned),
            ("mappings_lost", self.mappings_lost),
        ]
    }
}

/// The source of a session imported from a PyTorch memory snapshot without times (older
/// PyTorch): its calls' times give their order only.
pub const SNAPSHOT_UNTIMED: &str = "snapshot_untimed";

/// What a session records about itself at its start.
#[derive(Debug, Default, Serialize)]
pub struct SessionStart {
    pub started_ns: i64,
    pub source: &'static str,
    pub host: String,
    pub kernel: String,
    pub command: String,
    pub pid_filter: Option<Vec<u32>>,
}

/// Counters kept in the kernel and by the reader, stored with the session.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct SessionCounters {
    pub entries: u64,
    pub submitted: u64,
    pub dropped_ring_full: u64,
    pub unmatched_returns: u64,
    pub alloc_map_full: u64,
    pub inflight_full: u64,
    pub events_read: u64,
    pub events_stored: u64,
    pub decode_errors: u64,
    pub offcpu_submitted: u64,
    pub offcpu_dropped: u64,
    /// Events lost because the call-site program could not be reached (--stack).
    pub tail_call_failed: u64,
    /// Kernel map entries that could not be stored (a full map).
    pub map_insert_failed: u64,
    /// Calls whose thread exited before they returned, or still in progress a while after
    /// the stop: no event could be made of them.
    pub calls_abandoned: u64,
    /// Calls of Python processes made before tracer registered their interpreter: they have
    /// no Python frames (--stack).
    pub calls_before_interpreter: u64,
    /// Records of processes' new mappings the kernel could not hand over (a full side-band
    /// ring): native frames in those mappings may stay unresolved (--stack).
    pub mappings_lost: u64,
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
    }
}

impl Store {
    /// Opens the database at `path`. ReadWrite creates it (and migrates an older one);
    /// ReadOnly requires it to exist. A database from a newer tracer, a corrupt file or another
    /// program's database is refused before anything is written.
    pub fn open(path: &Path, access: Access) -> Result<Store> {
        let exists = path.exists();
        if access == Access::ReadOnly && !exists {
            return Err(user_error(format!(
                "database {} does not exist: record one with `sudo tracer trace`, or pass --db FILE / TRACER_DB",
                path.display()
            )));
        }
        if exists {
            check_readable(path, access)?;
        }
        let flags = match access {
            Access::ReadWrite => OpenFlags::SQLITE_OPEN_READ_WRITE | OpenFlags::SQLITE_OPEN_CREATE,
            Access::ReadOnly => OpenFlags::SQLITE_OPEN_READ_ONLY,
        } | OpenFlags::SQLITE_OPEN_NO_MUTEX;
        let conn = Connection::open_with_flags(path, flags)
            .map_err(|e| user_error(format!("cannot open database {}: {e}", path.display())))?;
        // A WAL database is read through its -shm file, which needs write access.
        if access == Access::ReadOnly {
            if let Err(e) = conn.query_row("SELECT count(*) FROM sqlite_master", [], |r| {
                r.get::<_, i64>(0)
            }) {
                if matches!(
                    e.sqlite_error_code(),
                    Some(rusqlite::ErrorCode::ReadOnly | rusqlite::ErrorCode::CannotOpen)
                ) {
                    return Err(user_error(format!(
                        "cannot read database {}: {e}; reading needs write access to it and its directory                          (WAL mode): run as its owner, or copy it somewhere writable",
                        path.display()
                    )));
                }
            }
        }
        conn.busy_timeout(std::time::Duration::from_secs(5))
            .with_context(|| format!("set busy timeout on {}", path.display()))?;
        tensor_events::register(&conn)
            .with_context(|| format!("register tensor_events on {}", path.display()))?;
        let mut store = Store {
            conn,
            path: path.to_owned(),
        };
        let version = store.user_version()?;
        if version > SCHEMA_VERSION {
            return Err(user_error(format!(
                "database {} was written by a newer tracer (schema version {version}; this tracer \
                 reads up to {SCHEMA_VERSION}): upgrade tracer, or use another file with --db",
                path.display()
            )));
        }
        if version == 0 && store.has_foreign_tables()? {
            return Err(user_error(format!(
                "{} is an SQLite database of another program (it has tables but no tracer schema): \
                 pass a new file with --db",
                path.display()
            )));
        }
        match access {
            Access::ReadWrite => store.prepare_for_writing(version)?,
            Access::ReadOnly if version == 0 => {
                return Err(user_error(format!(
                    "database {} is empty (no trace was recorded into it): record one with `sudo tracer trace --db {}`",
                    path.display(),
                    path.display()
                )));
            }
            Access::ReadOnly if version < SCHEMA_VERSION => {
                return Err(user_error(format!(
                    "database {} has schema version {version}; open it once with a writing command \
                     (e.g. `tracer trace --db {}`) to migrate it to {SCHEMA_VERSION}",
                    path.display(),
                    path.display()
                )));
            }
            Access::ReadOnly => {}
        }
        Ok(store)
    }

    pub fn conn(&self) -> &Connection {
        &self.conn
    }

    fn user_version(&self) -> Result<i64> {
        self.conn
            .query_row("PRAGMA user_version", [], |r| r.get(0))
            .map_err(|e| corrupt(&self.path, e))
    }

    fn has_foreign_tables(&self) -> Result<bool> {
        let n: i64 = self
            .conn
            .query_row("SELECT count(*) FROM sqlite_master", [], |r| r.get(0))
            .map_err(|e| corrupt(&self.path, e))?;
        Ok(n > 0)
    }

    fn prepare_for_writing(&mut self, version: i64) -> Result<()> {
        let path = self.path.display().to_string();
        if version == 0 {
            // Must precede the first table: lets --max-db give pages back to the file system.
            self.conn
                .execute_batch("PRAGMA auto_vacuum = INCREMENTAL")
                .with_context(|| format!("set auto_vacuum on {path}"))?;
        }
        self.conn
            .execute_batch(
                "PRAGMA journal_mode = WAL; PRAGMA synchronous = NORMAL; PRAGMA foreign_keys = ON;
                 PRAGMA journal_size_limit = 16777216;",
            )
            .map_err(|e| corrupt(&self.path, e))?;
        let tx = self
            .conn
            .transaction()
            .with_context(|| format!("begin migration of {path}"))?;
        for (from, sql) in schema::MIGRATIONS.iter().enumerate().skip(version as usize) {
            tx.execute_batch(sql)
                .with_context(|| format!("migrate {path} from schema {from} to {}", from + 1))?;
        }
        tx.pragma_update(None, "user_version", SCHEMA_VERSION)
            .with_context(|| format!("set schema version of {path}"))?;
        {
            let mut insert = tx.prepare(
                "INSERT OR IGNORE INTO ops (id, name, library, class) VALUES (?1, ?2, ?3, ?4)",
            )?;
            for op in Op::ALL {
                let spec = op.spec();
                insert.execute(params![
                    op as u32,
                    op.name(),
                    spec.library.name(),
                    class_name(spec.class)
                ])?;
            }
        }
        tx.commit()
            .with_context(|| format!("commit migration of {path}"))?;
        Ok(())
    }

    /// Marks 'crashed' the sessions still 'running' whose tracer is gone: the node restarted
    /// since (another boot id), or their tracer process no longer exists. Everything they
    /// committed stays. Returns their ids.
    pub fn close_orphaned_sessions(&self) -> Result<Vec<i64>> {
        let boot = boot_id();
        let running: Vec<(i64, i64, Option<String>)> = self
            .conn
            .prepare("SELECT id, tracer_pid, boot_id FROM sessions WHERE status = 'running' AND tracer_pid IS NOT NULL")?
            .query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))?
            .collect::<rusqlite::Result<_>>()
            .with_context(|| format!("read the running sessions of {}", self.path.display()))?;
        let mut closed = Vec::new();
        for (id, pid, session_boot) in running {
            let rebooted = session_boot.as_deref() != Some(boot.as_str());
            let gone = rebooted || !tracer_alive(pid);
            if !gone {
                continue;
            }
            let why = if rebooted {
                "the machine restarted"
            } else {
                "its tracer process is gone (killed?)"
            };
            self.conn.execute(
                "UPDATE sessions SET status = 'crashed' WHERE id = ?1 AND status = 'running'",
                [id],
            )?;
            self.append_note(
                id,
                &format!("crashed: found running by a later trace, but {why}; every call committed before is kept"),
            )?;
            closed.push(id);
        }
        Ok(closed)
    }

    pub fn begin_session(&self, start: &SessionStart) -> Result<i64> {
        let pid_filter = start
            .pid_filter
            .as_ref()
            .map(serde_json::to_string)
            .transpose()?;
        self.conn
            .execute(
                "INSERT INTO sessions (started_ns, status, source, host, kernel, tracer_version, command, pid_filter, call_blocks, tracer_pid, boot_id)
                 VALUES (?1, 'running', ?2, ?3, ?4, ?5, ?6, ?7, 1, ?8, ?9)",
                params![
                    start.started_ns,
                    start.source,
                    start.host,
                    start.kernel,
                    env!("CARGO_PKG_VERSION"),
                    start.command,
                    pid_filter,
                    std::process::id(),
                    boot_id()
                ],
            )
            .with_context(|| format!("create a session in {}", self.path.display()))?;
        Ok(self.conn.last_insert_rowid())
    }

    pub fn set_libraries(&self, session: i64, libraries_json: &str) -> Result<()> {
        self.conn
            .execute(
                "UPDATE sessions SET libraries = ?2 WHERE id = ?1",
                params![session, libraries_json],
            )
            .with_context(|| format!("record libraries of session {session}"))?;
        Ok(())
    }

    pub fn set_counters(&self, session: i64, c: &SessionCounters) -> Result<()> {
        self.conn
            .execute(
                "UPDATE sessions SET entries = ?2, submitted = ?3, dropped_ring_full = ?4,
                    unmatched_returns = ?5, alloc_map_full = ?6, inflight_full = ?7, events_read = ?8,
                    events_stored = ?9, decode_errors = ?10, offcpu_submitted = ?11, offcpu_dropped = ?12,
                    tail_call_failed = ?13, map_insert_failed = ?14, calls_abandoned = ?15,
                    calls_before_interpreter = ?16, mappings_lost = ?17
                 WHERE id = ?1",
                params![
                    session,
                    c.entries as i64,
                    c.submitted as i64,
                    c.dropped_ring_full as i64,
                    c.unmatched_returns as i64,
                    c.alloc_map_full as i64,
                    c.inflight_full as i64,
                    c.events_read as i64,
                    c.events_stored as i64,
                    c.decode_errors as i64,
                    c.offcpu_submitted as i64,
                    c.offcpu_dropped as i64,
                    c.tail_call_failed as i64,
                    c.map_insert_failed as i64,
                    c.calls_abandoned as i64,
                    c.calls_before_interpreter as i64,
                    c.mappings_lost as i64
                ],
            )
            .with_context(|| format!("store counters of session {session}"))?;
        Ok(())
    }

    pub fn end_session(&self, session: i64, ended_ns: i64, status: &str) -> Result<()> {
        self.conn
            .execute(
                "UPDATE sessions SET ended_ns = ?2, status = ?3 WHERE id = ?1",
                params![session, ended_ns, status],
            )
            .with_context(|| format!("close session {session}"))?;
        Ok(())
    }

    /// The session took up running processes' state from session `from`'s keyframe.
    pub fn set_restored_from(&self, session: i64, from: i64) -> Result<()> {
        self.conn
            .execute(
                "UPDATE sessions SET restored_from = ?2 WHERE id = ?1",
                params![session, from],
            )
            .with_context(|| format!("record where session {session} took its state up from"))?;
        Ok(())
    }

    pub fn set_host_context(&self, session: i64, state: &str) -> Result<()> {
        self.conn
            .execute(
                "UPDATE sessions SET host_context = ?2 WHERE id = ?1",
                params![session, state],
            )
            .with_context(|| format!("record the host context state of session {session}"))?;
        Ok(())
    }

    pub fn append_note(&self, session: i64, note: &str) -> Result<()> {
        self.conn
            .execute(
                "UPDATE sessions SET note = CASE WHEN note IS NULL OR note = '' THEN ?2 ELSE note || char(10) || ?2 END
                 WHERE id = ?1",
                params![session, note],
            )
            .with_context(|| format!("add a note to session {session}"))?;
        Ok(())
    }

    /// Writes one batch of calls, with the threads and processes first seen in it, in one transaction.
    pub fn write_batch(&mut self, batch: &Batch<'_>) -> Result<()> {
        let tx = self
            .conn
            .transaction()
            .context("begin a write transaction")?;
        {
            let mut proc_stmt = tx.prepare_cached(
                "INSERT OR IGNORE INTO processes (session_id, pid, start_time_ns, first_seen_ns, comm, cmdline, exe, cgroup, env)
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9)",
            )?;
            for p in batch.processes {
                proc_stmt.execute(params![
                    batch.session,
                    p.pid,
                    p.start_time_ns,
                    p.first_seen_ns,
                    p.comm,
                    p.cmdline,
                    p.exe,
                    p.cgroup,
                    p.env
                ])?;
            }
            let mut msg_stmt = tx.prepare_cached(
                "INSERT INTO messages (session_id, ts_ns, pid, tid, op_id, text, truncated) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7)",
            )?;
            for m in batch.messages {
                msg_stmt.execute(params![
                    batch.session,
                    m.ts_mono_ns as i64 + batch.wall_offset_ns,
                    m.pid,
                    m.tid,
                    m.op as u32,
                    m.text,
                    m.truncated
                ])?;
            }
            let mut off_stmt = tx.prepare_cached(
                "INSERT INTO offcpu (session_id, pid, tid, off_ns, on_ns, wakeup_ns, preempted) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7)",
            )?;
            for o in batch.offcpu {
                let wall = |mono: u64| mono as i64 + batch.wall_offset_ns;
                off_stmt.execute(params![
                    batch.session,
                    o.pid,
                    o.tid,
                    wall(o.off_mono_ns),
                    wall(o.on_mono_ns),
                    o.wakeup_mono_ns.map(wall),
                    o.preempted
                ])?;
            }
            let mut thread_stmt =
                tx.prepare_cached("INSERT OR IGNORE INTO threads (session_id, pid, tid, comm) VALUES (?1, ?2, ?3, ?4)")?;
            for (pid, tid, comm) in batch.threads {
                thread_stmt.execute(params![batch.session, pid, tid, comm])?;
            }
            // The allocator's block events are many and small: kept in the blocks only.
            let rowed: Vec<&Call> = batch.calls.iter().filter(|c| has_row(c)).collect();
            // Many rows per statement: one sqlite3_step per CALLS_PER_INSERT rows instead of per
            // row roughly halves the writer's CPU per event.
            let mut chunks = rowed.chunks_exact(CALLS_PER_INSERT);
            let mut full = tx.prepare_cached(&insert_calls_sql(CALLS_PER_INSERT))?;
            for chunk in &mut chunks {
                bind_calls(&mut full, chunk, batch)?;
                full.raw_execute()?;
            }
            let mut one = tx.prepare_cached(&insert_calls_sql(1))?;
            for call in chunks.remainder() {
                bind_calls(&mut one, std::slice::from_ref(call), batch)?;
                one.raw_execute()?;
            }
            // The rows just inserted have consecutive ids (one past the largest, under the
            // write lock), so each block knows the rows it copies.
            let mut next_id = if rowed.is_empty() {
                tx.query_row("SELECT coalesce(max(id), 0) + 1 FROM calls", [], |r| {
                    r.get(0)
                })?
            } else {
                tx.last_insert_rowid() - rowed.len() as i64 + 1
            };
            // A block's id orders the walk, and holes and keyframes name blocks by id: an id
            // must never be given again, even when eviction deleted every block above it
            // (SQLite's own rowid would restart at one past the largest left).
            let mut block_stmt = tx.prepare_cached(
                "INSERT INTO call_blocks (id, session_id, first_call, last_call, calls, min_ts_ns, max_ts_ns, format, data, rowless)
                 VALUES (1 + max(coalesce((SELECT max(id) FROM call_blocks), 0),
                                 coalesce((SELECT max(through_block) FROM holes), 0),
                                 coalesce((SELECT max(through_block) FROM keyframes), 0)),
                         ?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9)",
            )?;
            for chunk in batch.calls.chunks(blocks::MAX_CALLS) {
                let block = blocks::encode(chunk, batch.wall_offset_ns);
                let rows = chunk.iter().filter(|c| has_row(c)).count() as i64;
                // A block without rows copies the empty range (next_id, next_id - 1).
                let last = next_id + rows - 1;
                block_stmt.execute(params![
                    batch.session,
                    next_id,
                    last,
                    block.calls as i64,
                    block.min_ts_ns,
                    block.max_ts_ns,
                    blocks::FORMAT,
                    block.data,
                    chunk.len() as i64 - rows
                ])?;
                next_id = last + 1;
            }
        }
        tx.commit().with_context(|| {
            format!(
                "commit {} events to {}",
                batch.calls.len(),
                self.path.display()
            )
        })?;
        Ok(())
    }

    /// Stores a call site and its frames (innermost first); returns its id for calls.stack_id.
    pub fn insert_stack(&mut self, session: i64, stack: &StackRow<'_>) -> Result<i64> {
        let tx = self
            .conn
            .transaction()
            .context("begin a write transaction")?;
        tx.execute(
            "INSERT INTO stacks (session_id, pid, native_depth, python) VALUES (?1, ?2, ?3, ?4)",
            params![session, stack.pid, stack.native_depth, stack.python],
        )?;
        let id = tx.last_insert_rowid();
        {
            let mut frame = tx.prepare_cached(
                "INSERT INTO stack_frames (stack_id, idx, kind, function, file, line, module, address)
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8)",
            )?;
            for (idx, f) in stack.frames.iter().enumerate() {
                frame.execute(params![
                    id,
                    idx,
                    f.kind,
                    f.function,
                    f.file,
                    f.line,
                    f.module,
                    f.address.map(|a| a as i64)
                ])?;
            }
        }
        tx.commit()
            .with_context(|| format!("store a call site in {}", self.path.display()))?;
        Ok(id)
    }

    /// Bytes the database uses, not counting free pages it keeps for reuse.
    pub fn used_bytes(&self) -> Result<u64> {
        let (pages, free, size): (i64, i64, i64) = self.conn.query_row(
            "SELECT (SELECT page_count FROM pragma_page_count), (SELECT freelist_count FROM pragma_freelist_count),
                    (SELECT page_size FROM pragma_page_size)",
            [],
            |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)),
        )?;
        Ok(((pages - free).max(0) * size) as u64)
    }

    /// Keeps the write-ahead log to a small share of --max-db: a checkpoint once it holds an
    /// eighth of it (at least 64 pages).
    pub fn limit_log(&self, max_bytes: u64) -> Result<()> {
        let page: i64 = self.conn.query_row("PRAGMA page_size", [], |r| r.get(0))?;
        let pages = (max_bytes as i64 / 8 / page.max(512)).max(64);
        self.conn
            .pragma_update(None, "wal_autocheckpoint", pages)
            .with_context(|| format!("set the log's checkpoint of {}", self.path.display()))?;
        Ok(())
    }

    /// Bytes of the write-ahead log beside the database.
    pub fn wal_bytes(&self) -> u64 {
        let mut name = self.path.clone().into_os_string();
        name.push("-wal");
        std::fs::symlink_metadata(name).map_or(0, |m| m.len())
    }

    /// What --max-db counts: the database file (its pages, free ones included) and its
    /// write-ahead log.
    pub fn footprint(&self) -> Result<u64> {
        let (pages, size): (i64, i64) = self.conn.query_row(
            "SELECT (SELECT page_count FROM pragma_page_count), (SELECT page_size FROM pragma_page_size)",
            [],
            |r| Ok((r.get(0)?, r.get(1)?)),
        )?;
        Ok((pages.max(0) * size) as u64 + self.wal_bytes())
    }

    /// Opens (creating it if needed) the database tracer writes, as `owner` (the user who ran
    /// sudo) would: a path that is a link is refused, the folders and files are created with
    /// their file-system ids (so only where they could create them, and theirs), and the files
    /// are made private through descriptors that follow no link, before SQLite opens them (the
    /// log and the shared memory it creates later take the database's mode and owner).
    pub fn open_writable(path: &Path, owner: Option<(u32, u32)>) -> Result<Store> {
        crate::paths::refuse_links(path)?;
        let _as_user = crate::paths::act_as(owner);
        crate::paths::create_parent_dirs(path, owner)?;
        secure_files(path, owner)?;
        let store = Store::open(path, Access::ReadWrite).map_err(|e| match owner {
            Some((uid, _)) => user_error(format!(
                "{e:#} (opened as uid {uid}, who ran sudo: choose a --db the invoking user can write)"
            )),
            None => e,
        })?;
        Ok(store)
    }
}

/// Creates the database file private (0600), or makes the database's files private, through
/// descriptors opened without following links, as `owner`; a file that is not a regular file
/// of theirs is refused, never chown'ed. Only before SQLite opens them: closing any descriptor
/// of a file drops every POSIX lock the process holds on it, SQLite's included, and a reader
/// then believing itself alone truncates the shared memory the writer has mapped (SIGBUS).
fn secure_files(path: &Path, owner: Option<(u32, u32)>) -> Result<()> {
    crate::paths::create_private(path)?;
    for suffix in ["", "-wal", "-shm"] {
        let mut name = path.to_owned().into_os_string();
        name.push(suffix);
        crate::paths::make_private(&PathBuf::from(name), owner)?;
    }
    Ok(())
}

impl Store {}

/// Rows per multi-row INSERT (14 parameters each; SQLite allows 32766).
const CALLS_PER_INSERT: usize = 64;
const CALL_COLUMNS: usize = 14;

fn insert_calls_sql(rows: usize) -> String {
    let row = format!("({})", vec!["?"; CALL_COLUMNS].join(", "));
    format!(
        "INSERT INTO calls (session_id, ts_ns, pid, tid, op_id, device, size, ptr, ret, duration_ns, aux0, aux1, flags, stack_id) VALUES {}",
        vec![row; rows].join(", ")
    )
}

/// Whether a call gets a `calls` row: all but the allocator's block events, which only the call
/// blocks keep (SCHEMA.md, `tensor_events`).
pub fn has_row(call: &Call) -> bool {
    !matches!(
        call.op.spec().class,
        tracer_common::OpClass::BlockAlloc | tracer_common::OpClass::BlockFree
    )
}

fn bind_calls(
    stmt: &mut rusqlite::CachedStatement<'_>,
    calls: &[&Call],
    batch: &Batch<'_>,
) -> rusqlite::Result<()> {
    let nonzero = |v: u64| (v != 0).then_some(v as i64);
    for (row, call) in calls.iter().enumerate() {
        let base = row * CALL_COLUMNS;
        stmt.raw_bind_parameter(base + 1, batch.session)?;
        stmt.raw_bind_parameter(base + 2, call.ts_mono_ns as i64 + batch.wall_offset_ns)?;
        stmt.raw_bind_parameter(base + 3, call.pid)?;
        stmt.raw_bind_parameter(base + 4, call.tid)?;
        stmt.raw_bind_parameter(base + 5, call.op as u32)?;
        stmt.raw_bind_parameter(base + 6, call.device)?;
        stmt.raw_bind_parameter(base + 7, call.size.map(|v| v as i64))?;
        stmt.raw_bind_parameter(base + 8, call.ptr.map(|v| v as i64))?;
        stmt.raw_bind_parameter(base + 9, call.ret)?;
        stmt.raw_bind_parameter(base + 10, call.duration_ns as i64)?;
        stmt.raw_bind_parameter(base + 11, nonzero(call.aux0))?;
        stmt.raw_bind_parameter(base + 12, nonzero(call.aux1))?;
        stmt.raw_bind_parameter(base + 13, call.flags)?;
        stmt.raw_bind_parameter(base + 14, call.stack)?;
    }
    Ok(())
}

/// A call site as stored: `python` says whether and how the Python frames were read.
pub struct StackRow<'a> {
    pub pid: u32,
    pub native_depth: u32,
    pub python: &'static str,
    pub frames: &'a [StackFrame],
}

/// One frame of a stored call site.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct StackFrame {
    /// "python" or "native".
    pub kind: &'static str,
    pub function: Option<String>,
    pub file: Option<String>,
    pub line: Option<i64>,
    /// Native: the library or executable.
    pub module: Option<String>,
    /// Native: the offset in `module` (the return address - 1).
    pub address: Option<u64>,
}

/// One transaction's worth of rows.
pub struct Batch<'a> {
    pub session: i64,
    pub wall_offset_ns: i64,
    pub calls: &'a [Call],
    pub threads: &'a [(u32, u32, String)],
    pub processes: &'a [ProcessInfo],
    pub offcpu: &'a [crate::decode::OffCpu],
    pub messages: &'a [crate::decode::Message],
}

fn check_readable(path: &Path, access: Access) -> Result<()> {
    let meta = std::fs::metadata(path)
        .map_err(|e| user_error(format!("cannot access database {}: {e}", path.display())))?;
    if meta.is_dir() {
        return Err(user_error(format!(
            "database {} is a directory: pass a file with --db",
            path.display()
        )));
    }
    let file = match access {
        Access::ReadOnly => std::fs::File::open(path),
        Access::ReadWrite => std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(path),
    };
    if let Err(e) = file {
        use std::os::unix::fs::MetadataExt as _;
        return Err(user_error(format!(
            "cannot {} database {}: {e} (owner uid {}, mode {:o}): run as its owner, or pass another file with --db",
            if access == Access::ReadOnly { "read" } else { "write" },
            path.display(),
            meta.uid(),
            meta.mode() & 0o777
        )));
    }
    Ok(())
}

fn corrupt(path: &Path, e: rusqlite::Error) -> anyhow::Error {
    user_error(format!(
        "{} is not a usable tracer database ({e}): it is corrupt or not SQLite; pass another file with --db",
        path.display()
    ))
}

#[cfg(test)]
pub(crate) mod tests;

/// This boot's id (changes when the machine restarts).
pub fn boot_id() -> String {
    std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
        .map(|s| s.trim().to_owned())
        .unwrap_or_default()
}

/// Whether `pid` is a running tracer (a pid reused by another program is not).
fn tracer_alive(pid: i64) -> bool {
    pid == i64::from(std::process::id())
        || std::fs::read_to_string(format!("/proc/{pid}/comm")).is_ok_and(|c| c.trim() == "tracer")
}
