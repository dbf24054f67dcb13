//! A session's stored calls read back in time order, a block at a time: memory holds the calls
//! of the blocks being read and those a later block may still precede, never the session.
//!
//! The writer stores a call when it returns, so blocks are in return order; a later block can
//! only hold calls that began before the ones read so far if it says so in its `min_ts_ns`.
//! Calls are handed on once no later block can hold an earlier one: the order is exactly
//! [`super::events::load`]'s (entry time, then the writer's order).

use std::path::Path;

use anyhow::{Context as _, Result};
use rusqlite::params;

use super::events::{has_call_blocks, open_reader};
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
/// or before `to_ns`, of `pid` (or every process), in time order, and each hole it passes.
pub fn walk(
    path: &Path,
    session: i64,
    after_block: i64,
    to_ns: i64,
    pid: Option<u32>,
    mut visit: impl FnMut(Step<'_>) -> Result<()>,
) -> Result<Walked> {
    let mut walked = Walked::default();
    if !has_call_blocks(path, session)? {
        // Sessions older than the call blocks (schema 4) are read whole.
        for e in load(path, session, to_ns, pid)? {
            walked.calls += 1;
            visit(Step::Call(&e))?;
        }
        return Ok(walked);
    }
    let conn = open_reader(path)?;
    let holes = holes(&conn, session, after_block)?;
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
    let mut later_min = vec![i64::MAX; list.len() + 1];
    for i in (0..list.len()).rev() {
        later_min[i] = later_min[i + 1].min(list[i].1);
    }
    let mut block = conn
        .prepare("SELECT format, calls, data FROM call_blocks WHERE id = ?1 AND session_id = ?2")?;
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
        let mut rows = block.query(params![id, session])?;
        let Some(r) = rows.next().context("read a call block")? else {
            continue;
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
        super::blocks::decode(r.get_ref(2)?.as_blob()?, calls, |e| {
            if e.ts_ns <= to_ns && pid.is_none_or(|p| p == e.pid) {
                batch.push(e);
            }
        })
        .map_err(|e| damaged(session, id, e.to_string()))?;
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
