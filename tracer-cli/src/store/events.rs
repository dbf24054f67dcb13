//! Reading sessions and events back for analysis.
//!
//! Each small reader (sessions, events, messages, processes, host context) is a query and its
//! owned row type, kept together so the SQL and its row read as one; the call sites' readers
//! are in call_sites.rs.

use std::{collections::HashMap, path::Path};

use anyhow::{anyhow, bail, Context as _, Result};
use rusqlite::{params, Connection, OpenFlags, OptionalExtension as _};
use tracer_common::{Op, OpClass};

use super::tensor_events::damaged_or;
use crate::{
    exit::user_error,
    model::{stack_id, Event, HostRecord, MessageRow, OffSlice, Placement, StackId, NO_DEVICE},
};

#[derive(Clone, Debug)]
pub struct SessionInfo {
    pub id: i64,
    pub status: String,
}

/// The session's source (`ebpf`, `simulated`, `snapshot`, ...).
pub fn source(conn: &Connection, session: i64) -> Result<String> {
    conn.query_row(
        "SELECT source FROM sessions WHERE id = ?1",
        [session],
        |r| r.get(0),
    )
    .context("read the session's source")
}

/// The session `id`, or the latest one.
pub fn session(conn: &Connection, id: Option<i64>) -> Result<SessionInfo> {
    let row = conn
        .query_row(
            "SELECT id, status FROM sessions WHERE ?1 IS NULL OR id = ?1 ORDER BY id DESC LIMIT 1",
            params![id],
            |r| Ok((r.get::<_, i64>(0)?, r.get::<_, String>(1)?)),
        )
        .optional()
        .context("read sessions")?;
    let Some((id, status)) = row else {
        return Err(match id {
            Some(id) => user_error(format!("no session {id} in this database: list them with `tracer query \"SELECT id, started_ns, status FROM sessions\"`")),
            None => user_error("the database has no session yet: record one with `sudo tracer trace`"),
        });
    };
    Ok(SessionInfo { id, status })
}

/// The host the session was recorded on (its node), where it was recorded.
pub fn session_host(conn: &Connection, session: i64) -> Result<Option<String>> {
    conn.query_row("SELECT host FROM sessions WHERE id = ?1", [session], |r| {
        r.get(0)
    })
    .optional()
    .map(Option::flatten)
    .context("read the session's host")
}

/// Each process's start (wall ns), where /proc said it.
pub fn start_times(conn: &Connection, session: i64) -> Result<HashMap<u32, i64>> {
    let mut stmt = conn.prepare(
        "SELECT pid, start_time_ns FROM processes WHERE session_id = ?1 AND start_time_ns IS NOT NULL",
    )?;
    let rows = stmt.query_map([session], |r| {
        Ok((r.get::<_, u32>(0)?, r.get::<_, i64>(1)?))
    })?;
    rows.collect::<rusqlite::Result<_>>()
        .context("read the processes' start times")
}

/// Figures no real call has: a crafted or damaged database. Refused (exit 2) before any
/// analysis sums, multiplies or subtracts them, so no number in a report ever wraps.
const MAX_PLAUSIBLE_SIZE: u64 = 1 << 52; // 4 PiB
const MAX_PLAUSIBLE_DURATION_NS: u64 = 1 << 50; // 13 days
const MAX_PLAUSIBLE_TS_NS: i64 = 1 << 62; // the year 2116

pub fn check_plausible(session: i64, events: &[Event]) -> Result<()> {
    let bad = events.iter().find(|e| {
        e.size > MAX_PLAUSIBLE_SIZE
            || e.duration_ns > MAX_PLAUSIBLE_DURATION_NS
            || !(0..=MAX_PLAUSIBLE_TS_NS).contains(&e.ts_ns)
    });
    match bad {
        None => Ok(()),
        Some(e) => Err(user_error(format!(
            "session {session} is damaged: a {} call of pid {} has impossible figures (time {} ns, duration {} ns, size {} bytes); record the session again, or query its rows with `tracer query`",
            e.op.name(),
            e.pid,
            e.ts_ns,
            e.duration_ns,
            e.size
        ))),
    }
}

/// Whether the session stores its calls in call blocks (every trace since schema 4).
pub(super) fn has_call_blocks(conn: &Connection, session: i64) -> Result<bool> {
    Ok(conn
        .query_row(
            "SELECT call_blocks FROM sessions WHERE id = ?1",
            [session],
            |r| r.get::<_, i64>(0),
        )
        .optional()
        .context("read the session's storage")?
        .is_some_and(|v| v == 1))
}

/// The entry times of the session's first and last stored calls (None: it stored none).
pub fn stored_span(conn: &Connection, session: i64) -> Result<Option<(i64, i64)>> {
    let sql = if has_call_blocks(conn, session)? {
        "SELECT min(min_ts_ns), max(max_ts_ns) FROM call_blocks WHERE session_id = ?1"
    } else {
        "SELECT min(ts_ns), max(ts_ns) FROM calls WHERE session_id = ?1"
    };
    let (first, last): (Option<i64>, Option<i64>) = conn
        .query_row(sql, [session], |r| Ok((r.get(0)?, r.get(1)?)))
        .with_context(|| format!("read the time span of session {session}"))?;
    let plausible = 0..=MAX_PLAUSIBLE_TS_NS;
    if first.is_some_and(|t| !plausible.contains(&t))
        || last.is_some_and(|t| !plausible.contains(&t))
    {
        return Err(user_error(format!(
            "session {session} is damaged: its calls claim impossible times ({} to {} ns); record the session again, or query its rows with `tracer query`",
            first.unwrap_or(0),
            last.unwrap_or(0)
        )));
    }
    Ok(first.zip(last))
}

/// The calls the session stores (in its call blocks, else its rows).
pub fn stored_calls(conn: &Connection, session: i64) -> Result<u64> {
    let sql = if has_call_blocks(conn, session)? {
        "SELECT coalesce(sum(calls), 0) FROM call_blocks WHERE session_id = ?1"
    } else {
        "SELECT count(*) FROM calls WHERE session_id = ?1"
    };
    let n: i64 = conn
        .query_row(sql, [session], |r| r.get(0))
        .with_context(|| format!("count the calls of session {session}"))?;
    Ok(n.max(0) as u64)
}

pub(crate) fn open_reader(path: &Path) -> Result<Connection> {
    let conn = Connection::open_with_flags(
        path,
        OpenFlags::SQLITE_OPEN_READ_ONLY | OpenFlags::SQLITE_OPEN_NO_MUTEX,
    )
    .with_context(|| format!("open database {} for reading", path.display()))?;
    super::counted::opened();
    // 64 MiB of page cache per reader: the scan is sequential, the cache only spares re-reads.
    conn.execute_batch("PRAGMA cache_size = -65536")
        .with_context(|| format!("configure reader of {}", path.display()))?;
    Ok(conn)
}

/// The columns of `calls` [`event_of_row`] reads, in its order.
pub(super) const EVENT_COLUMNS: &str =
    "ts_ns, pid, tid, op_id, device, size, ptr, ret, duration_ns, aux0, aux1, stack_id";

/// The call of a `calls` row whose [`EVENT_COLUMNS`] begin at column `at`; None for an op a
/// newer tracer added (skipped rather than failing the whole analysis).
pub(super) fn event_of_row(r: &rusqlite::Row<'_>, at: usize) -> Result<Option<Event>> {
    let int = |i: usize| -> Result<Option<i64>> { Ok(r.get_ref(at + i)?.as_i64_or_null()?) };
    let Some(op) = Op::from_u32(r.get_ref(at + 3)?.as_i64()? as u32) else {
        return Ok(None);
    };
    Ok(Some(Event {
        ts_ns: r.get_ref(at)?.as_i64()?,
        pid: r.get_ref(at + 1)?.as_i64()? as u32,
        tid: r.get_ref(at + 2)?.as_i64()? as u32,
        op,
        device: int(4)?.map_or(NO_DEVICE, |v| v as i32),
        size: int(5)?.unwrap_or(0) as u64,
        ptr: int(6)?.unwrap_or(0) as u64,
        ret: r.get_ref(at + 7)?.as_i64()? as i32,
        duration_ns: r.get_ref(at + 8)?.as_i64()?.max(0) as u64,
        aux0: int(9)?.unwrap_or(0) as u64,
        aux1: int(10)?.unwrap_or(0) as u64,
        stack: int(11)?.and_then(stack_id),
    }))
}

/// The session's calls of the given classes (CUDA calls: they have rows), of one process or
/// all, in time order: what is read to count attempts or learn devices without walking the
/// block events.
pub fn calls_of_classes(
    conn: &Connection,
    session: i64,
    classes: &[OpClass],
    pid: Option<u32>,
) -> Result<Vec<Event>> {
    let ops: Vec<String> = Op::ALL
        .iter()
        .filter(|op| classes.contains(&op.spec().class))
        .map(|op| (*op as u32).to_string())
        .collect();
    if ops.is_empty() {
        return Ok(Vec::new());
    }
    let mut stmt = conn.prepare(&format!(
        "SELECT {EVENT_COLUMNS} FROM calls WHERE session_id = ?1 AND (?2 IS NULL OR pid = ?2)
         AND op_id IN ({}) ORDER BY ts_ns",
        ops.join(",")
    ))?;
    let mut rows = stmt.query(params![session, pid])?;
    let mut out = Vec::new();
    while let Some(r) = rows.next().context("read calls")? {
        out.extend(event_of_row(r, 0)?);
    }
    Ok(out)
}

/// The call site of `pid`'s capture that began at `ts_ns` (PyTorch's capture_begin, else the
/// stream's own begin capture), where `--stack` recorded one.
pub fn capture_site(
    conn: &Connection,
    session: i64,
    pid: u32,
    ts_ns: i64,
) -> Result<Option<crate::model::StackId>> {
    let ops: Vec<String> = Op::ALL
        .iter()
        .filter(|op| {
            matches!(
                op.spec().class,
                OpClass::PoolCapture
                    | OpClass::CaptureBegin
                    | OpClass::PoolCreate
                    | OpClass::PoolRoute
            )
        })
        .map(|op| (*op as u32).to_string())
        .collect();
    let id: Option<i64> = conn
        .query_row(
            &format!(
                "SELECT stack_id FROM calls WHERE session_id = ?1 AND pid = ?2 AND ts_ns = ?3
                 AND op_id IN ({}) AND stack_id IS NOT NULL LIMIT 1",
                ops.join(",")
            ),
            params![session, pid, ts_ns],
            |r| r.get(0),
        )
        .optional()
        .context("read a capture's call site")?;
    Ok(id.and_then(stack_id))
}

/// The threads of `session` (of `pid`, or all) with CUDA calls stored without a device: those
/// whose device the read side must learn (model/devices.rs).
pub fn threads_without_device(
    conn: &Connection,
    session: i64,
    pid: Option<u32>,
) -> Result<std::collections::HashSet<(u32, u32)>> {
    let mut stmt = conn.prepare(
        "SELECT DISTINCT pid, tid FROM calls
         WHERE session_id = ?1 AND device IS NULL AND (?2 IS NULL OR pid = ?2)",
    )?;
    let rows = stmt.query_map(params![session, pid], |r| Ok((r.get(0)?, r.get(1)?)))?;
    rows.collect::<rusqlite::Result<_>>()
        .with_context(|| format!("list the threads of session {session} without a device"))
}

/// Whether the database has the table `name` (those later schema versions added are read
/// only where present).
fn has_table(conn: &Connection, name: &str) -> Result<bool> {
    super::has_table(conn, name).with_context(|| format!("look for the {name} table"))
}

/// Whether `session` was recorded by a tracer that stores the devices it learns
/// (`thread_devices`, schema 11): a call it stored without one has no device to learn.
pub fn devices_learned(conn: &Connection, session: i64) -> Result<bool> {
    if !has_column(conn, "sessions", "devices_learned")? {
        return Ok(false);
    }
    let learned: i64 = conn
        .query_row(
            "SELECT devices_learned FROM sessions WHERE id = ?1",
            [session],
            |r| r.get(0),
        )
        .with_context(|| format!("read session {session}"))?;
    Ok(learned != 0)
}

/// Threads' devices the recording learned after their first calls were stored without one
/// (schema 11; none in older sessions).
pub fn learned_devices(conn: &Connection, session: i64) -> Result<HashMap<(u32, u32), i32>> {
    if !has_table(conn, "thread_devices")? {
        return Ok(HashMap::new());
    }
    let mut stmt =
        conn.prepare("SELECT pid, tid, device FROM thread_devices WHERE session_id = ?1")?;
    let rows = stmt.query_map([session], |r| Ok(((r.get(0)?, r.get(1)?), r.get(2)?)))?;
    rows.collect::<rusqlite::Result<_>>()
        .with_context(|| format!("read the threads' devices of session {session}"))
}

/// The processes of `session`, each with whether tracer saw it from its start (no
/// `before_trace` or `found_late` gap); none is said so for a session recorded before schema 9
/// kept gaps.
pub fn processes_seen_from_start(conn: &Connection, session: i64) -> Result<Vec<(u32, bool)>> {
    let sql = if has_table(conn, "gaps")? {
        "SELECT pid, pid NOT IN (SELECT pid FROM gaps WHERE session_id = ?1 AND kind IN ('before_trace', 'found_late'))
         FROM processes WHERE session_id = ?1"
    } else {
        "SELECT pid, 0 FROM processes WHERE session_id = ?1"
    };
    let mut stmt = conn.prepare(sql)?;
    let rows = stmt.query_map([session], |r| Ok((r.get(0)?, r.get::<_, i64>(1)? != 0)))?;
    rows.collect::<rusqlite::Result<_>>()
        .with_context(|| format!("list the processes of session {session}"))
}

/// A session's row: when, what, and the counters of what was and was not kept.
#[derive(Clone, Debug, serde::Serialize)]
pub struct SessionSummary {
    pub id: i64,
    pub started_ns: i64,
    pub ended_ns: Option<i64>,
    pub status: String,
    pub source: String,
    pub command: Option<String>,
    pub counters: crate::store::SessionCounters,
    /// Events deleted by --max-db eviction, by kind, and the latest call they held.
    pub evicted_events: u64,
    pub evicted_calls: u64,
    pub evicted_block_events: u64,
    pub evicted_offcpu: u64,
    pub evicted_until_ns: Option<i64>,
}

impl SessionSummary {
    /// Everything tracer could not keep, summed.
    pub fn lost(&self) -> u64 {
        self.counters.losses().iter().map(|(_, v)| v).sum::<u64>() + self.evicted_events
    }
}

const SUMMARY_COLUMNS: &str =
    "id, started_ns, ended_ns, status, source, command, entries, submitted,
    dropped_ring_full, unmatched_returns, alloc_map_full, inflight_full, events_read, events_stored,
    decode_errors, offcpu_submitted, offcpu_dropped, tail_call_failed, map_insert_failed,
    calls_abandoned, calls_before_interpreter, mappings_lost, evicted_events, evicted_calls,
    evicted_block_events, evicted_offcpu, evicted_until_ns, events_late";

fn summary_row(r: &rusqlite::Row<'_>) -> rusqlite::Result<SessionSummary> {
    let n = |i: usize| -> rusqlite::Result<u64> { Ok(r.get::<_, i64>(i)?.max(0) as u64) };
    Ok(SessionSummary {
        id: r.get(0)?,
        started_ns: r.get(1)?,
        ended_ns: r.get(2)?,
        status: r.get(3)?,
        source: r.get(4)?,
        command: r.get(5)?,
        counters: crate::store::SessionCounters {
            entries: n(6)?,
            submitted: n(7)?,
            dropped_ring_full: n(8)?,
            unmatched_returns: n(9)?,
            alloc_map_full: n(10)?,
            inflight_full: n(11)?,
            events_read: n(12)?,
            events_stored: n(13)?,
            decode_errors: n(14)?,
            offcpu_submitted: n(15)?,
            offcpu_dropped: n(16)?,
            tail_call_failed: n(17)?,
            map_insert_failed: n(18)?,
            calls_abandoned: n(19)?,
            calls_before_interpreter: n(20)?,
            mappings_lost: n(21)?,
            events_late: n(27)?,
        },
        evicted_events: n(22)?,
        evicted_calls: n(23)?,
        evicted_block_events: n(24)?,
        evicted_offcpu: n(25)?,
        evicted_until_ns: r.get(26)?,
    })
}

/// The newest sessions first, at most `limit`.
pub fn session_summaries(conn: &Connection, limit: u32) -> Result<Vec<SessionSummary>> {
    let mut stmt = conn
        .prepare(&format!(
            "SELECT {SUMMARY_COLUMNS} FROM sessions ORDER BY id DESC LIMIT ?1"
        ))
        .context("read sessions")?;
    let rows = stmt
        .query_map([limit], summary_row)
        .context("read sessions")?
        .collect::<rusqlite::Result<Vec<_>>>()
        .context("read sessions")?;
    Ok(rows)
}

/// One session's row (it exists: found by [`session`]).
pub fn session_summary(conn: &Connection, id: i64) -> Result<SessionSummary> {
    conn.query_row(
        &format!("SELECT {SUMMARY_COLUMNS} FROM sessions WHERE id = ?1"),
        [id],
        summary_row,
    )
    .with_context(|| format!("read session {id}"))
}

/// Process names of a session (from /proc at first sight).
pub fn comms(conn: &Connection, session: i64) -> Result<HashMap<u32, String>> {
    let mut stmt =
        conn.prepare("SELECT pid, comm FROM processes WHERE session_id = ?1 AND comm IS NOT NULL")?;
    let rows = stmt.query_map([session], |r| {
        Ok((r.get::<_, u32>(0)?, r.get::<_, String>(1)?))
    })?;
    rows.collect::<rusqlite::Result<_>>()
        .context("read processes")
}

/// Each process's command line, as recorded (arguments joined by spaces).
pub fn cmdlines(conn: &Connection, session: i64) -> Result<HashMap<u32, String>> {
    let mut stmt = conn.prepare(
        "SELECT pid, cmdline FROM processes WHERE session_id = ?1 AND cmdline IS NOT NULL",
    )?;
    let rows = stmt.query_map([session], |r| {
        Ok((r.get::<_, u32>(0)?, r.get::<_, String>(1)?))
    })?;
    rows.collect::<rusqlite::Result<_>>()
        .context("read processes")
}

/// Each process's allocator settings (PYTORCH_CUDA_ALLOC_CONF, else PYTORCH_ALLOC_CONF), as
/// recorded from its environment.
pub fn alloc_confs(conn: &Connection, session: i64) -> Result<HashMap<u32, String>> {
    Ok(envs(conn, session)?
        .into_iter()
        .filter_map(|(pid, env)| {
            let conf = env
                .get("PYTORCH_CUDA_ALLOC_CONF")
                .or_else(|| env.get("PYTORCH_ALLOC_CONF"))?;
            Some((pid, conf.clone()))
        })
        .collect())
}

/// Each process's kept environment variables (databases before schema 5 have none).
pub fn envs(conn: &Connection, session: i64) -> Result<HashMap<u32, HashMap<String, String>>> {
    if !has_column(conn, "processes", "env")? {
        return Ok(HashMap::new());
    }
    let mut stmt =
        conn.prepare("SELECT pid, env FROM processes WHERE session_id = ?1 AND env IS NOT NULL")?;
    let rows = stmt.query_map([session], |r| {
        Ok((r.get::<_, u32>(0)?, r.get::<_, String>(1)?))
    })?;
    let mut out = HashMap::new();
    for row in rows {
        let (pid, json) = row.context("read processes")?;
        if let Ok(env) = serde_json::from_str(&json) {
            out.insert(pid, env);
        }
    }
    Ok(out)
}

/// The library that made each call site's call (`--stack`): its innermost native frame outside
/// the CUDA libraries themselves ("libcublas.so.13"), by file name.
pub fn stack_owners(conn: &Connection, session: i64) -> Result<HashMap<StackId, String>> {
    if !has_table(conn, "stack_frames")? {
        return Ok(HashMap::new());
    }
    let mut stmt = conn.prepare(
        "SELECT f.stack_id, f.module FROM stack_frames f JOIN stacks s ON s.id = f.stack_id
         WHERE s.session_id = ?1 AND f.kind = 'native' AND f.module IS NOT NULL
         ORDER BY f.stack_id, f.idx",
    )?;
    let rows = stmt.query_map([session], |r| {
        Ok((r.get::<_, i64>(0)?, r.get::<_, String>(1)?))
    })?;
    let mut out = HashMap::new();
    for row in rows {
        let (id, module) = row.context("read call sites' frames")?;
        let Some(id) = stack_id(id) else { continue };
        if out.contains_key(&id) || module.contains("libcudart") || module.contains("libcuda.") {
            continue;
        }
        let name = module.rsplit('/').next().unwrap_or(&module).to_owned();
        out.insert(id, name);
    }
    Ok(out)
}

/// What NVML said of each GPU during `session` (schema 12), in time order.
pub fn gpu_samples(conn: &Connection, session: i64) -> Result<Vec<crate::model::GpuSample>> {
    if !has_table(conn, "gpu_samples")? {
        return Ok(Vec::new());
    }
    let mut stmt = conn.prepare(
        "SELECT ts_ns, gpu, total, used, processes FROM gpu_samples WHERE session_id = ?1
         ORDER BY ts_ns",
    )?;
    let rows = stmt.query_map([session], |r| {
        Ok((
            r.get::<_, i64>(0)?,
            r.get::<_, String>(1)?,
            r.get::<_, i64>(2)?,
            r.get::<_, i64>(3)?,
            r.get::<_, String>(4)?,
        ))
    })?;
    let mut out = Vec::new();
    for row in rows {
        let (ts_ns, gpu, total, used, processes) = row.context("read NVML's samples")?;
        out.push(crate::model::GpuSample {
            ts_ns,
            gpu,
            total: total.max(0) as u64,
            used: used.max(0) as u64,
            // A row another program wrote badly names no process.
            processes: serde_json::from_str(&processes).unwrap_or_default(),
        });
    }
    Ok(out)
}

/// Where each process of `session` runs: its job and the physical GPU behind each of its
/// device numbers (model/process.rs `Placement`).
pub fn placements(conn: &Connection, session: i64) -> Result<HashMap<u32, Placement>> {
    let mut envs = envs(conn, session)?;
    let gpus_sql = if has_column(conn, "processes", "gpus")? {
        "SELECT pid, gpus FROM processes WHERE session_id = ?1"
    } else {
        "SELECT pid, NULL FROM processes WHERE session_id = ?1"
    };
    let mut stmt = conn.prepare(gpus_sql)?;
    let rows = stmt.query_map([session], |r| {
        Ok((r.get::<_, u32>(0)?, r.get::<_, Option<String>>(1)?))
    })?;
    let mut out = HashMap::new();
    for row in rows {
        let (pid, gpus) = row.context("read processes")?;
        let env = envs.remove(&pid).unwrap_or_default();
        out.insert(pid, Placement::new(pid, &env, gpus.as_deref()));
    }
    Ok(out)
}

/// Whether `table` has the column `name` (those later schema versions added are read only
/// where present).
fn has_column(conn: &Connection, table: &str, name: &str) -> Result<bool> {
    let n: i64 = conn
        .query_row(
            "SELECT count(*) FROM pragma_table_info(?1) WHERE name = ?2",
            [table, name],
            |r| r.get(0),
        )
        .with_context(|| format!("look for {table}.{name}"))?;
    Ok(n > 0)
}

/// The session's messages in time order (databases before schema 5 have none).
pub fn messages(conn: &Connection, session: i64) -> Result<Vec<MessageRow>> {
    if !has_table(conn, "messages")? {
        return Ok(Vec::new());
    }
    let mut stmt = conn.prepare(
        "SELECT m.ts_ns, m.pid, m.tid, o.name, m.text, m.truncated FROM messages m
         JOIN ops o ON o.id = m.op_id WHERE m.session_id = ?1 ORDER BY m.ts_ns",
    )?;
    let rows = stmt.query_map([session], |r| {
        Ok(MessageRow {
            ts_ns: r.get(0)?,
            pid: r.get(1)?,
            tid: r.get(2)?,
            op: r.get(3)?,
            text: r.get(4)?,
            truncated: r.get::<_, i64>(5)? != 0,
        })
    })?;
    rows.collect::<rusqlite::Result<_>>()
        .context("read messages")
}

/// The scheduler's record of the session's traced threads (host context), up to `to_ns`.
pub fn host(conn: &Connection, session: i64, to_ns: i64, pid: Option<u32>) -> Result<HostRecord> {
    let state: Option<String> = conn
        .query_row(
            "SELECT host_context FROM sessions WHERE id = ?1",
            [session],
            |r| r.get(0),
        )
        .context("read the session's host context state")?;
    let recorded = state.as_deref().is_some_and(|s| s.starts_with("sched"));
    // "...; cpus=N" since the process tree is followed.
    let cpus = state.as_deref().and_then(|s| {
        s.split(';')
            .find_map(|part| part.trim().strip_prefix("cpus=")?.parse().ok())
    });
    // Sessions recorded before schema version 13 have a row each in `offcpu`.
    let mut stmt = conn.prepare(
        "SELECT pid, tid, off_ns, on_ns, wakeup_ns, preempted FROM offcpu
         WHERE session_id = ?1 AND off_ns <= ?2 AND (?3 IS NULL OR pid = ?3)",
    )?;
    let rows = stmt.query_map(params![session, to_ns, pid], |r| off_slice(r, 0))?;
    let mut slices = rows
        .collect::<rusqlite::Result<Vec<_>>>()
        .context("read offcpu")?;
    if has_table(conn, "offcpu_blocks")? {
        off_cpu_blocks(conn, session, to_ns, pid, &mut slices)?;
    }
    let while_armed = state.as_deref().is_some_and(|s| {
        s.split(';')
            .any(|part| part.trim() == crate::model::FOLLOWED_WHILE_ARMED)
    });
    Ok(HostRecord {
        slices,
        recorded,
        cpus,
        while_armed,
    })
}

/// An `offcpu` row's interval: its pid, tid, off_ns, on_ns, wakeup_ns and preempted from
/// column `at` on.
pub(super) fn off_slice(r: &rusqlite::Row<'_>, at: usize) -> rusqlite::Result<OffSlice> {
    Ok(OffSlice {
        pid: r.get(at)?,
        tid: r.get(at + 1)?,
        off_ns: r.get(at + 2)?,
        on_ns: r.get(at + 3)?,
        wakeup_ns: r.get(at + 4)?,
        preempted: r.get::<_, i64>(at + 5)? != 0,
    })
}

/// Adds the session's packed off-CPU intervals that began by `to_ns` (of `pid`, if given).
fn off_cpu_blocks(
    conn: &Connection,
    session: i64,
    to_ns: i64,
    pid: Option<u32>,
    slices: &mut Vec<OffSlice>,
) -> Result<()> {
    let mut stmt = conn.prepare(
        "SELECT id, format, intervals, data FROM offcpu_blocks
         WHERE session_id = ?1 AND min_off_ns <= ?2 ORDER BY id",
    )?;
    let mut rows = stmt.query(params![session, to_ns])?;
    while let Some(r) = rows.next().context("read offcpu_blocks")? {
        let (id, format, intervals): (i64, i64, i64) = (r.get(0)?, r.get(1)?, r.get(2)?);
        if format != super::offcpu_blocks::FORMAT {
            bail!("off-CPU block {id} has format {format}, which this tracer does not read: use a newer tracer");
        }
        let data = r.get_ref(3)?.as_blob()?;
        super::offcpu_blocks::decode(data, intervals.max(0) as usize, |s| {
            if s.off_ns <= to_ns && pid.is_none_or(|p| p == s.pid) {
                slices.push(s);
            }
        })
        .map_err(|e| anyhow!("off-CPU block {id} is damaged: {e}"))?;
    }
    Ok(())
}

/// The processes with PyTorch's block events in the session.
pub fn block_event_pids(conn: &Connection, session: i64) -> Result<Vec<u32>> {
    let mut stmt =
        conn.prepare("SELECT DISTINCT pid FROM tensor_events WHERE session_id = ?1 ORDER BY pid")?;
    let pids = stmt
        .query_map([session], |r| r.get(0))?
        .collect::<rusqlite::Result<Vec<u32>>>()
        .map_err(|e| damaged_or(e, session, "read the processes with block events"))?;
    Ok(pids)
}

pub use super::call_sites::{
    frames_of, pytorch_or_interpreter, site_labels, stacks, FrameOut, StackSite,
};
