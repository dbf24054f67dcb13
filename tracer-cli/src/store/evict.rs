//! --max-db: the database, its log included, kept under the budget. Whole older sessions go
//! first, then the current session's oldest calls, cut at a keyframe so that what they built is
//! kept there. The detail around incidents (the minute before an OOM, a failed allocation or an
//! early warning, and seconds after: the whole-run series says when they were) is kept as
//! islands, up to a quarter of the budget, the oldest island going first beyond it. Each range
//! of blocks deleted is a `holes` row: a walk that reaches one resumes at the keyframe at its end
//! (SCHEMA.md, `holes` and `kept`).

use anyhow::{bail, Result};
use rusqlite::{params, OptionalExtension as _, Transaction};

use super::Store;

/// Eviction starts when the footprint passes this share of --max-db (in percent) and goes down
/// to the next: the headroom takes what is written while a reader keeps SQLite from truncating
/// its log (a backup, `VACUUM INTO`), and between two rounds.
const EVICT_ABOVE_PCT: u64 = 85;
const EVICT_TO_PCT: u64 = 75;
/// Incident detail is kept up to 1/KEPT_SHARE of --max-db.
pub const KEPT_SHARE: u64 = 4;
/// Kept before an incident's 10 s interval of the series, and after it.
const KEPT_BEFORE_NS: i64 = 60_000_000_000;
const KEPT_AFTER_NS: i64 = 5_000_000_000;

/// What evicting the current session's oldest calls did.
enum Evicted {
    /// Its note.
    Some(String),
    /// No keyframe lies past the oldest block: a new one is needed first.
    NeedKeyframe,
    /// The only keyframe to cut at is at the session's latest block: cutting would leave no
    /// call, so under the budget nothing goes until calls come after it.
    OnlyTail,
    /// The session has no call block left to evict.
    Nothing,
}

/// What one round of --max-db did.
#[derive(Debug, Default)]
pub struct Eviction {
    pub notes: Vec<String>,
    /// Calls can be evicted only up to a keyframe: a new one is needed.
    pub need_keyframe: bool,
    /// A reader held the log, so it could not be truncated and the database stays over the
    /// budget until a later round: the bytes over it.
    pub over_while_held: Option<u64>,
}

/// Calls deleted, by kind.
#[derive(Default)]
struct Gone {
    calls: i64,
    block_events: i64,
    offcpu: i64,
    until_ns: Option<i64>,
}

/// Blocks (after_block, through_block] of the current session kept around incidents.
struct Island {
    after_block: i64,
    through_block: i64,
    from_ns: i64,
    to_ns: i64,
    reason: String,
}

impl Store {
    /// Keeps the database, its log included, under `max_bytes`: once it passes
    /// [`EVICT_ABOVE_PCT`] % of it, deletes the oldest data until it is under [`EVICT_TO_PCT`] %:
    /// whole older sessions first,
    /// then the oldest calls of `current` but the detail kept around incidents, never past its
    /// latest keyframe (what they built is kept there). Says when a keyframe is needed to go on.
    pub fn enforce_max_size(&mut self, current: i64, max_bytes: u64) -> Result<Eviction> {
        let mut out = Eviction::default();
        if self.footprint()? <= max_bytes / 100 * EVICT_ABOVE_PCT {
            return Ok(out);
        }
        // The log first: what a checkpoint gives back costs no data.
        let mut log_held = !self.truncate_log();
        while self.footprint()? > max_bytes / 100 * EVICT_TO_PCT {
            let oldest: Option<(i64, i64)> = self
                .conn
                .query_row(
                    "SELECT id, max((SELECT count(*) FROM calls WHERE session_id = s.id),
                                    (SELECT coalesce(sum(calls), 0) FROM call_blocks WHERE session_id = s.id))
                     FROM sessions s WHERE id != ?1 ORDER BY id LIMIT 1",
                    [current],
                    |r| Ok((r.get(0)?, r.get(1)?)),
                )
                .optional()?;
            match oldest {
                Some((id, events)) => {
                    self.delete_session(id)?;
                    out.notes.push(format!(
                        "--max-db: deleted session {id} ({events} events) to stay under {max_bytes} bytes"
                    ));
                }
                None => match self.evict_oldest_calls(current, max_bytes, log_held)? {
                    Evicted::Some(note) => out.notes.push(note),
                    Evicted::NeedKeyframe => {
                        out.need_keyframe = true;
                        break;
                    }
                    Evicted::OnlyTail => break,
                    Evicted::Nothing => {
                        if !log_held && self.footprint()? > max_bytes {
                            bail!(
                                "--max-db {max_bytes} bytes is smaller than what a session needs beside its calls ({} bytes): raise it",
                                self.footprint()?
                            );
                        }
                        break;
                    }
                },
            }
            self.give_back_free_pages()?;
            // While a reader holds the log, what is deleted only makes the log longer: one step
            // a round, the rest when the reader has let go.
            if log_held {
                break;
            }
            log_held = !self.truncate_log();
        }
        let footprint = self.footprint()?;
        if log_held && footprint > max_bytes {
            out.over_while_held = Some(footprint - max_bytes);
        }
        let latest: Option<i64> = self.conn.query_row(
            "SELECT max(through_block) FROM keyframes WHERE session_id = ?1",
            [current],
            |r| r.get(0),
        )?;
        let first_block: Option<i64> = self.conn.query_row(
            "SELECT min(id) FROM call_blocks WHERE session_id = ?1 AND id > ?2",
            params![current, tail_after(&self.conn, current)?],
            |r| r.get(0),
        )?;
        // The next eviction needs a keyframe past the oldest calls.
        out.need_keyframe |= latest.is_none_or(|k| first_block.is_some_and(|b| k < b));
        Ok(out)
    }

    /// Copies the log into the database and truncates it: false when a reader's snapshot kept
    /// it from finishing (or it failed), so the log keeps its size. It does not wait for
    /// readers (a TRUNCATE checkpoint would, up to the busy timeout, holding up the writer).
    fn truncate_log(&self) -> bool {
        let _ = self.conn.busy_timeout(std::time::Duration::ZERO);
        let busy: rusqlite::Result<i64> =
            self.conn
                .query_row("PRAGMA wal_checkpoint(TRUNCATE)", [], |r| r.get(0));
        let _ = self.conn.busy_timeout(super::open::BUSY_TIMEOUT);
        busy == Ok(0)
    }

    /// Gives the free pages back to the file system. `PRAGMA incremental_vacuum` frees one page a
    /// step: run as one statement (sqlite3_exec, `execute_batch`) it frees a single page.
    fn give_back_free_pages(&self) -> Result<()> {
        let mut stmt = self.conn.prepare("PRAGMA incremental_vacuum")?;
        let mut rows = stmt.query([])?;
        while rows.next()?.is_some() {}
        Ok(())
    }

    /// Deletes an older session whole.
    fn delete_session(&mut self, id: i64) -> Result<()> {
        let tx = self.conn.transaction()?;
        for table in [
            "calls",
            "call_blocks",
            "threads",
            "offcpu",
            "offcpu_blocks",
            "messages",
            "series",
            "gaps",
            "holes",
            "kept",
            "processes",
            "thread_devices",
            "gpu_samples",
            "discovery",
        ] {
            tx.execute(&format!("DELETE FROM {table} WHERE session_id = ?1"), [id])?;
        }
        tx.execute(
            "DELETE FROM keyframe_states WHERE keyframe_id IN (SELECT id FROM keyframes WHERE session_id = ?1)",
            [id],
        )?;
        tx.execute("DELETE FROM keyframes WHERE session_id = ?1", [id])?;
        tx.execute(
            "DELETE FROM stack_frames WHERE stack_id IN (SELECT id FROM stacks WHERE session_id = ?1)",
            [id],
        )?;
        tx.execute("DELETE FROM stacks WHERE session_id = ?1", [id])?;
        tx.execute("DELETE FROM sessions WHERE id = ?1", [id])?;
        tx.commit()?;
        Ok(())
    }

    /// Deletes the oldest island when the kept detail is over its share; else the oldest tenth
    /// of the current session's call blocks after the islands (every call is in one), cut at a
    /// keyframe, but the blocks around incidents in it; with the rows they copy, the off-CPU
    /// intervals among them and the keyframes they make useless; counts each kind.
    fn evict_oldest_calls(
        &mut self,
        current: i64,
        max_bytes: u64,
        log_held: bool,
    ) -> Result<Evicted> {
        // A log a reader holds is no measure of the detail: deleting only lengthens it.
        let over_budget = !log_held && self.footprint()? > max_bytes;
        let tx = self.conn.transaction()?;
        if kept_bytes(&tx, current)? > max_bytes / KEPT_SHARE {
            let note = evict_oldest_island(&tx, current)?;
            tx.commit()?;
            return Ok(note.map_or(Evicted::Nothing, Evicted::Some));
        }
        let after = tail_after(&tx, current)?;
        let (blocks, first): (i64, Option<i64>) = tx.query_row(
            "SELECT count(*), min(id) FROM call_blocks WHERE session_id = ?1 AND id > ?2",
            params![current, after],
            |r| Ok((r.get(0)?, r.get(1)?)),
        )?;
        let Some(first) = first else {
            let note = evict_oldest_island(&tx, current)?;
            tx.commit()?;
            return Ok(note.map_or(Evicted::Nothing, Evicted::Some));
        };
        let tenth: i64 = tx.query_row(
            "SELECT id FROM call_blocks WHERE session_id = ?1 AND id > ?2 ORDER BY id LIMIT 1 OFFSET ?3",
            params![current, after, (blocks / 10).max(1) - 1],
            |r| r.get(0),
        )?;
        let keyframe_at = |sql: &str| -> Result<Option<i64>> {
            Ok(tx.query_row(sql, params![current, first, tenth], |r| r.get(0))?)
        };
        let cutoff = match keyframe_at(
            "SELECT max(through_block) FROM keyframes WHERE session_id = ?1 AND through_block >= ?2 AND through_block <= ?3",
        )? {
            Some(c) => c,
            None => match keyframe_at(
                "SELECT min(through_block) FROM keyframes WHERE session_id = ?1 AND through_block >= ?2 AND ?3 = ?3",
            )? {
                Some(c) => c,
                None => {
                    tx.commit()?;
                    return Ok(Evicted::NeedKeyframe);
                }
            },
        };
        // Cutting at the latest block would leave the session no call to explain: only past
        // the budget itself (the bound holds before the detail), never for a held log.
        let last: i64 = tx.query_row(
            "SELECT max(id) FROM call_blocks WHERE session_id = ?1",
            [current],
            |r| r.get(0),
        )?;
        if cutoff >= last && !over_budget {
            tx.commit()?;
            return Ok(Evicted::OnlyTail);
        }
        let islands = islands_in(&tx, current, after, cutoff)?;
        // Kept first: the off-CPU intervals inside them stay.
        for island in &islands {
            keep(&tx, current, island)?;
        }
        let mut gone = Gone::default();
        let mut lo = after;
        for island in &islands {
            delete_blocks(&tx, current, lo, island.after_block, &mut gone)?;
            lo = island.through_block;
        }
        delete_blocks(&tx, current, lo, cutoff, &mut gone)?;
        count_evicted(&tx, current, &gone)?;
        tx.commit()?;
        let kept = match islands.len() {
            0 => String::new(),
            n => format!("; the detail around {n} incident(s) kept"),
        };
        Ok(Evicted::Some(format!(
            "--max-db: deleted the oldest {} events of this session ({} calls, {} allocator block events; what they built is kept in a keyframe){kept}",
            gone.calls + gone.block_events,
            gone.calls,
            gone.block_events
        )))
    }
}

/// The blocks of the current session up to here are islands or holes: eviction goes on after.
fn tail_after(conn: &rusqlite::Connection, session: i64) -> Result<i64> {
    Ok(conn.query_row(
        "SELECT coalesce(max(through_block), 0) FROM kept WHERE session_id = ?1",
        [session],
        |r| r.get(0),
    )?)
}

/// Bytes of the blocks the session's islands keep.
fn kept_bytes(tx: &Transaction<'_>, session: i64) -> Result<u64> {
    let bytes: i64 = tx.query_row(
        "SELECT coalesce(sum(length(b.data)), 0) FROM kept k JOIN call_blocks b
           ON b.session_id = k.session_id AND b.id > k.after_block AND b.id <= k.through_block
         WHERE k.session_id = ?1",
        [session],
        |r| r.get(0),
    )?;
    Ok(bytes.max(0) as u64)
}

/// The islands to keep among blocks (after, cutoff]: around each incident the whole-run series
/// recorded there, from the latest keyframe a minute before it to the first keyframe seconds
/// after it (or the cut), overlapping ones merged.
fn islands_in(tx: &Transaction<'_>, session: i64, after: i64, cutoff: i64) -> Result<Vec<Island>> {
    let (from, until): (Option<i64>, Option<i64>) = tx.query_row(
        "SELECT min(min_ts_ns), max(max_ts_ns) FROM call_blocks WHERE session_id = ?1 AND id > ?2 AND id <= ?3",
        params![session, after, cutoff],
        |r| Ok((r.get(0)?, r.get(1)?)),
    )?;
    let (Some(from), Some(until)) = (from, until) else {
        return Ok(Vec::new());
    };
    let mut stmt = tx.prepare(
        "SELECT start_ns, end_ns, sum(ooms), sum(failures), sum(warnings) FROM series
         WHERE session_id = ?1 AND (ooms > 0 OR failures > 0 OR warnings > 0)
           AND end_ns + ?2 >= ?4 AND start_ns - ?3 <= ?5
         GROUP BY start_ns, end_ns ORDER BY start_ns",
    )?;
    let incidents: Vec<(i64, i64, String)> = stmt
        .query_map(
            params![session, KEPT_AFTER_NS, KEPT_BEFORE_NS, from, until],
            |r| {
                let kinds = [(2, "OOM"), (3, "failed allocation"), (4, "early warning")];
                let mut named = Vec::new();
                for (i, name) in kinds {
                    if r.get::<_, i64>(i)? > 0 {
                        named.push(name);
                    }
                }
                Ok((r.get(0)?, r.get(1)?, named.join(", ")))
            },
        )?
        .collect::<rusqlite::Result<_>>()?;
    let mut islands: Vec<Island> = Vec::new();
    for (start, end, reason) in incidents {
        let (lo, hi) = ((start - KEPT_BEFORE_NS).max(from), end + KEPT_AFTER_NS);
        let first_keyframe: Option<i64> = tx.query_row(
            "SELECT coalesce(
               (SELECT max(through_block) FROM keyframes WHERE session_id = ?1 AND through_block >= ?2 AND through_block < ?3 AND ts_ns <= ?4),
               (SELECT min(through_block) FROM keyframes WHERE session_id = ?1 AND through_block >= ?2 AND through_block < ?3))",
            params![session, after, cutoff, lo],
            |r| r.get(0),
        )?;
        let Some(a) = first_keyframe else { continue };
        let b: i64 = tx
            .query_row(
                "SELECT min(through_block) FROM keyframes WHERE session_id = ?1 AND through_block > ?2 AND ts_ns >= ?3",
                params![session, a, hi],
                |r| r.get::<_, Option<i64>>(0),
            )?
            .map_or(cutoff, |b| b.min(cutoff));
        match islands.last_mut() {
            Some(last) if a <= last.through_block => {
                last.through_block = last.through_block.max(b);
                last.to_ns = last.to_ns.max(hi);
                if !last.reason.contains(&reason) {
                    last.reason = format!("{}, {reason}", last.reason);
                }
            }
            _ if b > a => islands.push(Island {
                after_block: a,
                through_block: b,
                from_ns: lo,
                to_ns: hi,
                reason,
            }),
            _ => {}
        }
    }
    Ok(islands)
}

/// Deletes blocks (lo, hi] of the session, the rows they copy and the off-CPU intervals among
/// them, and records the hole (merged with one it continues).
fn delete_blocks(
    tx: &Transaction<'_>,
    session: i64,
    lo: i64,
    hi: i64,
    gone: &mut Gone,
) -> Result<()> {
    if hi <= lo {
        return Ok(());
    }
    let range: Range = tx.query_row(
        "SELECT min(id), min(first_call), max(last_call), coalesce(sum(calls), 0), coalesce(sum(rowless), 0), min(min_ts_ns), max(max_ts_ns)
         FROM call_blocks WHERE session_id = ?1 AND id > ?2 AND id <= ?3",
        params![session, lo, hi],
        |r| {
            Ok(Range {
                first_block: r.get(0)?,
                first_row: r.get(1)?,
                last_row: r.get(2)?,
                n: r.get(3)?,
                rowless: r.get(4)?,
                min_ts: r.get(5)?,
                max_ts: r.get(6)?,
            })
        },
    )?;
    let Range {
        first_block,
        first_row,
        last_row,
        n,
        rowless,
        min_ts,
        max_ts,
    } = range;
    let Some(first_block) = first_block else {
        return Ok(());
    };
    if let (Some(a), Some(b)) = (first_row, last_row) {
        tx.execute(
            "DELETE FROM calls WHERE session_id = ?1 AND id BETWEEN ?2 AND ?3",
            params![session, a, b],
        )?;
    }
    tx.execute(
        "DELETE FROM call_blocks WHERE session_id = ?1 AND id > ?2 AND id <= ?3",
        params![session, lo, hi],
    )?;
    if let (Some(from), Some(to)) = (min_ts, max_ts) {
        gone.offcpu += delete_offcpu(tx, session, from, to)?;
    }
    // Keyframes in the hole, or at its start, lead nowhere: the one at its end is where a walk
    // that reaches the hole resumes.
    tx.execute(
        "DELETE FROM keyframe_states WHERE keyframe_id IN
           (SELECT id FROM keyframes WHERE session_id = ?1 AND through_block >= ?2 AND through_block < ?3)",
        params![session, lo, hi],
    )?;
    tx.execute(
        "DELETE FROM keyframes WHERE session_id = ?1 AND through_block >= ?2 AND through_block < ?3",
        params![session, lo, hi],
    )?;
    // A hole continued: the latest before these blocks, with no block left between.
    let continued = tx.execute(
        "UPDATE holes SET through_block = ?3, to_ns = max(to_ns, coalesce(?4, to_ns)), calls = calls + ?5
         WHERE rowid = (SELECT rowid FROM holes h WHERE h.session_id = ?1 AND h.through_block < ?2
                          AND NOT EXISTS (SELECT 1 FROM call_blocks b WHERE b.session_id = ?1
                                            AND b.id > h.through_block AND b.id < ?2)
                        ORDER BY h.through_block DESC LIMIT 1)",
        params![session, first_block, hi, max_ts, n],
    )?;
    if continued == 0 {
        tx.execute(
            "INSERT INTO holes (session_id, after_block, through_block, from_ns, to_ns, calls) VALUES (?1, ?2, ?3, ?4, ?5, ?6)",
            params![session, lo, hi, min_ts.unwrap_or(0), max_ts.unwrap_or(0), n],
        )?;
    }
    gone.calls += n - rowless;
    gone.block_events += rowless;
    gone.until_ns = gone.until_ns.max(max_ts);
    Ok(())
}

/// Deletes the off-CPU intervals that ended by `to`: from `from` on, and before it those
/// outside the detail kept around incidents. Packed ones go a block at a time (one that reaches
/// into kept detail stays). Returns how many intervals went.
fn delete_offcpu(tx: &Transaction<'_>, session: i64, from: i64, to: i64) -> Result<i64> {
    let rows = tx.execute(
        "DELETE FROM offcpu WHERE session_id = ?1 AND on_ns <= ?3
           AND (on_ns >= ?2 OR NOT EXISTS (SELECT 1 FROM kept k WHERE k.session_id = ?1 AND offcpu.on_ns BETWEEN k.from_ns AND k.to_ns))",
        params![session, from, to],
    )? as i64;
    let packed = "FROM offcpu_blocks b WHERE b.session_id = ?1 AND b.max_on_ns <= ?3
           AND (b.min_off_ns >= ?2 OR NOT EXISTS (SELECT 1 FROM kept k WHERE k.session_id = ?1
                                                   AND b.max_on_ns >= k.from_ns AND b.min_off_ns <= k.to_ns))";
    let intervals: i64 = tx.query_row(
        &format!("SELECT coalesce(sum(b.intervals), 0) {packed}"),
        params![session, from, to],
        |r| r.get(0),
    )?;
    tx.execute(
        &format!("DELETE FROM offcpu_blocks WHERE id IN (SELECT b.id {packed})"),
        params![session, from, to],
    )?;
    Ok(rows + intervals)
}

/// A range of blocks: the first, the rows they copy, their calls (those without rows) and
/// their calls' times.
struct Range {
    first_block: Option<i64>,
    first_row: Option<i64>,
    last_row: Option<i64>,
    n: i64,
    rowless: i64,
    min_ts: Option<i64>,
    max_ts: Option<i64>,
}

/// Records an island (merged with the one it continues).
fn keep(tx: &Transaction<'_>, session: i64, island: &Island) -> Result<()> {
    let continued = tx.execute(
        "UPDATE kept SET through_block = ?3, to_ns = max(to_ns, ?4), reason = reason || ', ' || ?5
         WHERE session_id = ?1 AND through_block = ?2",
        params![
            session,
            island.after_block,
            island.through_block,
            island.to_ns,
            island.reason
        ],
    )?;
    if continued == 0 {
        tx.execute(
            "INSERT INTO kept (session_id, after_block, through_block, from_ns, to_ns, reason) VALUES (?1, ?2, ?3, ?4, ?5, ?6)",
            params![
                session,
                island.after_block,
                island.through_block,
                island.from_ns,
                island.to_ns,
                island.reason
            ],
        )?;
    }
    Ok(())
}

/// Deletes the session's oldest island (over its share, or nothing else is left): its note.
fn evict_oldest_island(tx: &Transaction<'_>, session: i64) -> Result<Option<String>> {
    let oldest: Option<(i64, i64, i64, String)> = tx
        .query_row(
            "SELECT after_block, through_block, from_ns, reason FROM kept WHERE session_id = ?1 ORDER BY after_block LIMIT 1",
            [session],
            |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?)),
        )
        .optional()?;
    let Some((after, through, from_ns, reason)) = oldest else {
        return Ok(None);
    };
    tx.execute(
        "DELETE FROM kept WHERE session_id = ?1 AND after_block = ?2",
        params![session, after],
    )?;
    let mut gone = Gone::default();
    delete_blocks(tx, session, after, through, &mut gone)?;
    // The hole before the island and the one after it are one now.
    let next: Option<(i64, i64, i64)> = tx
        .query_row(
            "SELECT through_block, to_ns, calls FROM holes WHERE session_id = ?1 AND after_block = ?2",
            params![session, through],
            |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)),
        )
        .optional()?;
    if let Some((to_block, to_ns, calls)) = next {
        tx.execute(
            "DELETE FROM holes WHERE session_id = ?1 AND after_block = ?2",
            params![session, through],
        )?;
        tx.execute(
            "UPDATE holes SET through_block = ?3, to_ns = max(to_ns, ?4), calls = calls + ?5 WHERE session_id = ?1 AND through_block = ?2",
            params![session, through, to_block, to_ns, calls],
        )?;
        tx.execute(
            "DELETE FROM keyframe_states WHERE keyframe_id IN (SELECT id FROM keyframes WHERE session_id = ?1 AND through_block = ?2)",
            params![session, through],
        )?;
        tx.execute(
            "DELETE FROM keyframes WHERE session_id = ?1 AND through_block = ?2",
            params![session, through],
        )?;
    }
    count_evicted(tx, session, &gone)?;
    Ok(Some(format!(
        "--max-db: deleted the detail kept around the incident(s) at {} ({reason}; {} events): the kept detail passed a quarter of the budget",
        crate::units::format_utc(from_ns),
        gone.calls + gone.block_events
    )))
}

fn count_evicted(tx: &Transaction<'_>, session: i64, gone: &Gone) -> Result<()> {
    tx.execute(
        "UPDATE sessions SET evicted_events = evicted_events + ?2,
             evicted_calls = evicted_calls + ?3, evicted_block_events = evicted_block_events + ?4,
             evicted_offcpu = evicted_offcpu + ?5,
             evicted_until_ns = max(coalesce(evicted_until_ns, ?6), ?6)
         WHERE id = ?1",
        params![
            session,
            gone.calls + gone.block_events,
            gone.calls,
            gone.block_events,
            gone.offcpu,
            gone.until_ns.unwrap_or(0)
        ],
    )?;
    Ok(())
}
