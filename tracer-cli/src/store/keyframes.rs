//! Keyframes: every followed process's state (model/state.rs) after the calls of the session's
//! blocks up to `through_block`, so that answers start from the nearest one instead of the
//! session's first call, and --max-db can evict the calls before one without losing what they
//! built (SCHEMA.md, `keyframes`).

use anyhow::{Context as _, Result};
use rusqlite::{params, Connection, OptionalExtension as _};

use super::Store;
use crate::model::state::{ProcessState, KEYFRAME_FORMAT, KEYFRAME_FORMAT_OLDEST};

/// One process's encoded state, for [`Store::insert_keyframe`].
pub struct KeyframeState {
    pub pid: u32,
    pub start_time_ns: Option<i64>,
    pub data: Vec<u8>,
}

/// A stored keyframe.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Keyframe {
    pub id: i64,
    pub session: i64,
    /// The latest call the states include (wall ns).
    pub ts_ns: i64,
    /// The states include every call of the session's blocks up to this id, and no other.
    pub through_block: i64,
}

/// Where reading a session's window starts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Start {
    /// The session's first call: nothing was evicted and no keyframe precedes the window.
    Beginning,
    /// A keyframe at or before the window's start; `clipped` when the window began earlier but
    /// the calls before the keyframe were evicted.
    Keyframe { keyframe: Keyframe, clipped: bool },
}

impl Start {
    /// The calls to read are those stored after this block.
    pub fn after_block(&self) -> i64 {
        match self {
            Start::Beginning => 0,
            Start::Keyframe { keyframe, .. } => keyframe.through_block,
        }
    }
}

impl Store {
    /// Stores a keyframe of `session`: `states` hold every call stored so far in its blocks
    /// (the writer calls this right after committing them). Returns the keyframe.
    pub fn insert_keyframe(
        &mut self,
        session: i64,
        ts_ns: i64,
        states: &[KeyframeState],
    ) -> Result<Keyframe> {
        let tx = self.conn.transaction().context("begin a keyframe")?;
        let through_block: i64 = tx.query_row(
            "SELECT coalesce(max(id), 0) FROM call_blocks WHERE session_id = ?1",
            [session],
            |r| r.get(0),
        )?;
        tx.execute(
            "INSERT INTO keyframes (session_id, ts_ns, through_block, processes) VALUES (?1, ?2, ?3, ?4)",
            params![session, ts_ns, through_block, states.len() as i64],
        )?;
        let id = tx.last_insert_rowid();
        {
            let mut insert = tx.prepare_cached(
                "INSERT INTO keyframe_states (keyframe_id, pid, start_time_ns, format, data) VALUES (?1, ?2, ?3, ?4, ?5)",
            )?;
            for s in states {
                insert.execute(params![id, s.pid, s.start_time_ns, KEYFRAME_FORMAT, s.data])?;
            }
        }
        tx.commit().with_context(|| {
            format!(
                "store a keyframe of session {session} in {}",
                self.path.display()
            )
        })?;
        Ok(Keyframe {
            id,
            session,
            ts_ns,
            through_block,
        })
    }
}

fn keyframe_row(r: &rusqlite::Row<'_>) -> rusqlite::Result<Keyframe> {
    Ok(Keyframe {
        id: r.get(0)?,
        session: r.get(1)?,
        ts_ns: r.get(2)?,
        through_block: r.get(3)?,
    })
}

const KEYFRAME_COLUMNS: &str = "id, session_id, ts_ns, through_block";

/// Whether --max-db evicted calls of the session.
pub fn evicted(conn: &Connection, session: i64) -> Result<bool> {
    Ok(conn
        .query_row(
            "SELECT evicted_events > 0 OR evicted_until_ns IS NOT NULL FROM sessions WHERE id = ?1",
            [session],
            |r| r.get::<_, bool>(0),
        )
        .optional()
        .context("read the session's evictions")?
        .unwrap_or(false))
}

/// Where to start reading `session` for a window that begins at `from_ns`: the latest keyframe
/// before it; else the beginning, unless calls were evicted: then the earliest keyframe left.
pub fn start_for(conn: &Connection, session: i64, from_ns: i64) -> Result<Start> {
    let before: Option<Keyframe> = conn
        .query_row(
            &format!(
                "SELECT {KEYFRAME_COLUMNS} FROM keyframes WHERE session_id = ?1 AND ts_ns < ?2
                 ORDER BY through_block DESC, id DESC LIMIT 1"
            ),
            params![session, from_ns],
            keyframe_row,
        )
        .optional()
        .context("find a keyframe")?;
    if let Some(keyframe) = before {
        return Ok(Start::Keyframe {
            keyframe,
            clipped: false,
        });
    }
    if !evicted(conn, session)? {
        return Ok(Start::Beginning);
    }
    let earliest: Option<Keyframe> = conn
        .query_row(
            &format!(
                "SELECT {KEYFRAME_COLUMNS} FROM keyframes WHERE session_id = ?1
                 ORDER BY through_block, id LIMIT 1"
            ),
            [session],
            keyframe_row,
        )
        .optional()
        .context("find a keyframe")?;
    Ok(match earliest {
        Some(keyframe) => Start::Keyframe {
            keyframe,
            clipped: true,
        },
        // Evicted by a tracer older than keyframes: what is left, from its start.
        None => Start::Beginning,
    })
}

/// The keyframe of `session` that holds the calls through `block` (where a walk resumes after a
/// hole).
pub fn at_block(conn: &Connection, session: i64, block: i64) -> Result<Option<Keyframe>> {
    conn.query_row(
        &format!(
            "SELECT {KEYFRAME_COLUMNS} FROM keyframes WHERE session_id = ?1 AND through_block = ?2
             ORDER BY id DESC LIMIT 1"
        ),
        params![session, block],
        keyframe_row,
    )
    .optional()
    .context("find the keyframe after a hole")
}

/// The states of a keyframe (one process's, or all).
pub fn states(
    conn: &Connection,
    keyframe: &Keyframe,
    pid: Option<u32>,
) -> Result<Vec<ProcessState>> {
    let mut stmt = conn.prepare(
        "SELECT pid, format, data FROM keyframe_states WHERE keyframe_id = ?1 AND (?2 IS NULL OR pid = ?2) ORDER BY pid",
    )?;
    let mut rows = stmt.query(params![keyframe.id, pid])?;
    let mut out = Vec::new();
    while let Some(r) = rows.next().context("read a keyframe")? {
        let pid: i64 = r.get(0)?;
        let format: i64 = r.get(1)?;
        if !(KEYFRAME_FORMAT_OLDEST..=KEYFRAME_FORMAT).contains(&format) {
            anyhow::bail!(
                "keyframe {} of session {} holds the state of pid {pid} in format {format}, which this tracer does not read: use the tracer that recorded it",
                keyframe.id,
                keyframe.session
            );
        }
        let state = ProcessState::decode(r.get_ref(2)?.as_blob()?, format).with_context(|| {
            format!(
                "keyframe {} of session {} (pid {pid}) is damaged",
                keyframe.id, keyframe.session
            )
        })?;
        out.push(state);
    }
    Ok(out)
}

/// The newest state `session` stored of the process `pid` that started at `start_time_ns`:
/// (its keyframe, the state).
pub fn latest_state_of(
    conn: &Connection,
    pid: u32,
    start_time_ns: i64,
    session: i64,
) -> Result<Option<(Keyframe, ProcessState)>> {
    let keyframe: Option<Keyframe> = conn
        .query_row(
            "SELECT k.id, k.session_id, k.ts_ns, k.through_block
             FROM keyframe_states s JOIN keyframes k ON k.id = s.keyframe_id
             WHERE s.pid = ?1 AND s.start_time_ns = ?2 AND k.session_id = ?3
             ORDER BY k.through_block DESC, k.id DESC LIMIT 1",
            params![pid, start_time_ns, session],
            keyframe_row,
        )
        .optional()
        .context("find an earlier session's keyframe")?;
    let Some(keyframe) = keyframe else {
        return Ok(None);
    };
    Ok(states(conn, &keyframe, Some(pid))?
        .into_iter()
        .next()
        .map(|s| (keyframe, s)))
}
