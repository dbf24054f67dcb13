//! Reading sessions and events back for analysis.

use std::collections::HashMap;

use anyhow::{Context as _, Result};
use rusqlite::{params, Connection, OptionalExtension as _};
use tracer_common::Op;

use crate::{
    analysis::{Event, Host, OffSlice},
    exit::user_error,
};

#[derive(Clone, Debug)]
pub struct SessionInfo {
    pub id: i64,
    pub status: String,
    /// Entry time of the first and end time of the last event (None: no events).
    pub first_ns: Option<i64>,
    pub last_ns: Option<i64>,
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
    let (first_ns, last_ns): (Option<i64>, Option<i64>) = conn
        .query_row(
            "SELECT min(ts_ns), max(ts_ns + duration_ns) FROM calls WHERE session_id = ?1",
            [id],
            |r| Ok((r.get(0)?, r.get(1)?)),
        )
        .context("read the session's time range")?;
    Ok(SessionInfo {
        id,
        status,
        first_ns,
        last_ns,
    })
}

/// The session's calls that began at or before `to_ns`, in time order.
pub fn load(conn: &Connection, session: i64, to_ns: i64, pid: Option<u32>) -> Result<Vec<Event>> {
    let mut stmt = conn.prepare(
        "SELECT ts_ns, pid, tid, op_id, device, size, ptr, ret, duration_ns, aux0, aux1 FROM calls
         WHERE session_id = ?1 AND ts_ns <= ?2 AND (?3 IS NULL OR pid = ?3) ORDER BY ts_ns, id",
    )?;
    let rows = stmt.query_map(params![session, to_ns, pid], |r| {
        Ok((
            r.get::<_, i64>(0)?,
            r.get::<_, u32>(1)?,
            r.get::<_, u32>(2)?,
            r.get::<_, u32>(3)?,
            r.get::<_, Option<i32>>(4)?,
            r.get::<_, Option<i64>>(5)?,
            r.get::<_, Option<i64>>(6)?,
            r.get::<_, i32>(7)?,
            r.get::<_, i64>(8)?,
            r.get::<_, Option<i64>>(9)?,
            r.get::<_, Option<i64>>(10)?,
        ))
    })?;
    let mut out = Vec::new();
    for row in rows {
        let (ts_ns, pid, tid, op, device, size, ptr, ret, duration, aux0, aux1) =
            row.context("read calls")?;
        // Ops a newer tracer added are skipped rather than failing the whole analysis.
        let Some(op) = Op::from_u32(op) else { continue };
        out.push(Event {
            ts_ns,
            pid,
            tid,
            op,
            device,
            size: size.map(|v| v as u64),
            ptr: ptr.map(|v| v as u64),
            ret,
            duration_ns: duration.max(0) as u64,
            aux0: aux0.map(|v| v as u64),
            aux1: aux1.map(|v| v as u64),
        });
    }
    Ok(out)
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

/// The scheduler's record of the session's traced threads (host context), up to `to_ns`.
pub fn host(conn: &Connection, session: i64, to_ns: i64, pid: Option<u32>) -> Result<Host> {
    let state: Option<String> = conn
        .query_row(
            "SELECT host_context FROM sessions WHERE id = ?1",
            [session],
            |r| r.get(0),
        )
        .context("read the session's host context state")?;
    let recorded = state.is_some_and(|s| s.starts_with("sched"));
    let mut stmt = conn.prepare(
        "SELECT tid, off_ns, on_ns, wakeup_ns, preempted FROM offcpu
         WHERE session_id = ?1 AND off_ns <= ?2 AND (?3 IS NULL OR pid = ?3)",
    )?;
    let rows = stmt.query_map(params![session, to_ns, pid], |r| {
        Ok(OffSlice {
            tid: r.get(0)?,
            off_ns: r.get(1)?,
            on_ns: r.get(2)?,
            wakeup_ns: r.get(3)?,
            preempted: r.get::<_, i64>(4)? != 0,
        })
    })?;
    let slices = rows
        .collect::<rusqlite::Result<Vec<_>>>()
        .context("read offcpu")?;
    Ok(Host::new(slices, recorded))
}
