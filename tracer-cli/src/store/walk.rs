//! A session's stored calls read back in time order, a block at a time: memory holds the calls
//! of the blocks being read and those a later block may still precede, never the session.
//!
//! The writer stores a call when it returns, so blocks are in return order; a later block can
//! only hold calls that began before the ones read so far if it says so in its `min_ts_ns`.
//! Calls are handed on once no later block can hold an earlier one: the order is exactly
//! [`super::events::load`]'s (entry time, then the writer's order).

use anyhow::{Context as _, Result};
use rusqlite::{params, Connection};

use super::events::has_call_blocks;
use super::whole_session::{load, sort_nearly_sorted};
use crate::{exit::user_error, model::Event};

/// Calls held back at most (a very long call stored far behind the ones that began after it):
/// beyond this the earliest are handed on anyway, and counted.
const MAX_HELD: usize = 4 << 20;

/// What a walk read.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Walked {
    pub blocks: u64,
    pub calls: u64,
    /// Calls handed on before a call stored later that began earlier (more than [`MAX_HELD`]
    /// were waiting).
    pub out_of_order: u64,
    /// Holes passed.
    pub holes: u64,
}

pub use crate::model::run_series::Hole;

/// What a walk hands on: the next call, or a hole it passed (every call before it was handed).
pub enum Step<'a> {
    Call(&'a Event),
    Hole(&'a Hole),
}

/// The holes of `session` a walk from `after_block` passes, in order.
pub fn holes(conn: &rusqlite::Connection, session: i64, after_block: i64) -> Result<Vec<Hole>> {
    conn.prepare(
        "SELECT after_block, through_block, from_ns, to_ns, calls FROM holes
         WHERE session_id = ?1 AND through_block > ?2 ORDER BY through_block",
    )?
    .query_map(params![session, after_block], |r| {
        Ok(Hole {
            after_block: r.get(0)?,
            through_block: r.get(1)?,
            from_ns: r.get(2)?,
            to_ns: r.get(3)?,
            calls: r.get(4)?,
        })
    })?
    .collect::<rusqlite::Result<_>>()
    .with_context(|| format!("list the holes --max-db left in session {session}"))
}

/// Hands `visit` the calls of `session` stored in blocks after `after_block` (0: all), begun at
/// or before `to_ns`, of `pid` (or every process), in time order, and each hole it passes:
/// read through `conn` (in the caller's read transaction, where it holds one).
pub fn walk(
    conn: &Connection,
    session: i64,
    after_block: i64,
    to_ns: i64,
    pid: Option<u32>,
    mut visit: impl FnMut(Step<'_>) -> Result<()>,
) -> Result<Walked> {
    super::counted::walked();
    let mut walked = Walked::default();
    if !has_call_blocks(conn, session)? {
        // Sessions older than the call blocks (schema 4) are read whole, on connections of
        // the old loader's own.
        for e in load(&database_path(conn)?, session, to_ns, pid)? {
            walked.calls += 1;
            visit(Step::Call(&e))?;
        }
        return Ok(walked);
    }
    let holes = holes(conn, session, after_block)?;
    let mut next_hole = 0;
    let list: Vec<(i64, i64)> = conn
        .prepare(
            "SELECT id, min_ts_ns FROM call_blocks WHERE session_id = ?1 AND id > ?2 ORDER BY id",
        )?
        .query_map(params![session, after_block], |r| {
            Ok((r.get(0)?, r.get(1)?))
        })?
        .collect::<rusqlite::Result<_>>()
        .with_context(|| format!("list the call blocks of session {session}"))?;
    // The earliest call any block from i on can hold.
    let later_min = earliest_from(list.iter().map(|b| b.1));
    let mut block = conn.prepare(BLOCK_SQL)?;
    let mut pending: Vec<Event> = Vec::new();
    let mut batch: Vec<Event> = Vec::new();
    for (i, &(id, _)) in list.iter().enumerate() {
        if later_min[i] > to_ns {
            break;
        }
        while let Some(hole) = holes.get(next_hole).filter(|h| h.through_block < id) {
            // Everything after the hole began after what was read before it.
            for e in pending.drain(..) {
                walked.calls += 1;
                visit(Step::Call(&e))?;
            }
            visit(Step::Hole(hole))?;
            walked.holes += 1;
            next_hole += 1;
        }
        batch.clear();
        let read = read_block(&mut block, session, id, |e| {
            if e.ts_ns <= to_ns && pid.is_none_or(|p| p == e.pid) {
                batch.push(e);
            }
        })?;
        if !read {
            continue;
        }
        walked.blocks += 1;
        sort_nearly_sorted(&mut batch);
        merge_into(&mut pending, &mut batch);
        let limit = later_min[i + 1];
        let mut cut = pending.partition_point(|e| e.ts_ns <= limit);
        if pending.len() - cut > MAX_HELD {
            let forced = pending.len() - MAX_HELD;
            walked.out_of_order += (forced - cut) as u64;
            cut = forced;
        }
        for e in pending.drain(..cut) {
            walked.calls += 1;
            visit(Step::Call(&e))?;
        }
    }
    for e in pending.drain(..) {
        walked.calls += 1;
        visit(Step::Call(&e))?;
    }
    Ok(walked)
}

/// For blocks whose earliest calls are `mins`, in order: the earliest call any block from
/// each on can hold (one more entry, `i64::MAX`, past the last).
fn earliest_from(mins: impl DoubleEndedIterator<Item = i64> + ExactSizeIterator) -> Vec<i64> {
    let mut later_min = vec![i64::MAX; mins.len() + 1];
    for (i, min) in mins.enumerate().rev() {
        later_min[i] = later_min[i + 1].min(min);
    }
    later_min
}

/// The statement [`read_block`] runs.
const BLOCK_SQL: &str =
    "SELECT format, calls, data FROM call_blocks WHERE id = ?1 AND session_id = ?2";

/// Hands `visit` every call of block `id` (false: there is no such block).
fn read_block(
    stmt: &mut rusqlite::Statement<'_>,
    session: i64,
    id: i64,
    visit: impl FnMut(Event),
) -> Result<bool> {
    let mut rows = stmt.query(params![id, session])?;
    let Some(r) = rows.next().context("read a call block")? else {
        return Ok(false);
    };
    let format: i64 = r.get(0)?;
    if format != super::blocks::FORMAT {
        return Err(user_error(format!(
            "call block {id} of session {session} has format {format}, which this tracer does not read: use the tracer that recorded it"
        )));
    }
    let calls = r.get::<_, i64>(1)?.max(0) as usize;
    if calls > super::blocks::MAX_CALLS {
        return Err(damaged(
            session,
            id,
            format!("it claims {calls} calls, more than a block holds"),
        ));
    }
    super::blocks::decode(r.get_ref(2)?.as_blob()?, calls, visit)
        .map_err(|e| damaged(session, id, e.to_string()))?;
    Ok(true)
}

/// The entry times of the first and last stored calls of `pid` in `session` begun at or before
/// `to_ns` (None: it stored none), read from the blocks at either end that hold them rather
/// than by a walk: a block's `min_ts_ns` and `max_ts_ns` say when no block further in can hold
/// an earlier, or a later, call.
pub fn pid_span(
    conn: &Connection,
    session: i64,
    pid: u32,
    to_ns: i64,
) -> Result<Option<(i64, i64)>> {
    if !has_call_blocks(conn, session)? {
        let calls = load(&database_path(conn)?, session, to_ns, Some(pid))?;
        return Ok(calls
            .first()
            .zip(calls.last())
            .map(|(a, b)| (a.ts_ns, b.ts_ns)));
    }
    let list: Vec<(i64, i64, i64)> = conn
        .prepare(
            "SELECT id, min_ts_ns, max_ts_ns FROM call_blocks WHERE session_id = ?1 ORDER BY id",
        )?
        .query_map([session], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))?
        .collect::<rusqlite::Result<_>>()
        .with_context(|| format!("list the call blocks of session {session}"))?;
    let mut stmt = conn.prepare(BLOCK_SQL)?;
    let mut times = |id: i64, keep: &mut dyn FnMut(i64)| {
        read_block(&mut stmt, session, id, |e| {
            if e.pid == pid && e.ts_ns <= to_ns {
                keep(e.ts_ns);
            }
        })
    };
    // The earliest call any block from i on can hold, and the latest any block up to i can.
    let later_min = earliest_from(list.iter().map(|b| b.1));
    let earlier_max: Vec<i64> = list
        .iter()
        .scan(i64::MIN, |m, b| {
            *m = (*m).max(b.2);
            Some(*m)
        })
        .collect();
    let mut first: Option<i64> = None;
    for (i, &(id, _, _)) in list.iter().enumerate() {
        if later_min[i] > to_ns || first.is_some_and(|f| later_min[i] >= f) {
            break;
        }
        times(id, &mut |t| first = Some(first.map_or(t, |f| f.min(t))))?;
    }
    let Some(first) = first else {
        return Ok(None);
    };
    let mut last = first;
    for (i, &(id, _, _)) in list.iter().enumerate().rev() {
        if earlier_max[i] <= last {
            break;
        }
        times(id, &mut |t| last = last.max(t))?;
    }
    Ok(Some((first, last)))
}

/// The file behind `conn`, for the old loader's connections.
fn database_path(conn: &Connection) -> Result<std::path::PathBuf> {
    conn.path()
        .filter(|p| !p.is_empty())
        .map(std::path::PathBuf::from)
        .context(
            "a session recorded before call blocks is read from a database file, not from memory",
        )
}

/// A block that cannot be read back: said, with what still can be (exit 2).
fn damaged(session: i64, block: i64, why: String) -> anyhow::Error {
    user_error(format!(
        "call block {block} of session {session} is damaged: {why}; record the session again, or query its rows with `tracer query`"
    ))
}

/// Merges the sorted `batch` into the sorted `pending` (stably: `pending` first on equal times);
/// leaves `batch` empty.
fn merge_into(pending: &mut Vec<Event>, batch: &mut Vec<Event>) {
    if pending.is_empty() {
        std::mem::swap(pending, batch);
        return;
    }
    if batch
        .first()
        .is_none_or(|b| pending.last().is_some_and(|p| p.ts_ns <= b.ts_ns))
    {
        pending.append(batch);
        return;
    }
    let mut merged = Vec::with_capacity(pending.len() + batch.len());
    let (mut i, mut j) = (0, 0);
    while i < pending.len() && j < batch.len() {
        if pending[i].ts_ns <= batch[j].ts_ns {
            merged.push(pending[i]);
            i += 1;
        } else {
            merged.push(batch[j]);
            j += 1;
        }
    }
    merged.extend_from_slice(&pending[i..]);
    merged.extend_from_slice(&batch[j..]);
    *pending = merged;
    batch.clear();
}
