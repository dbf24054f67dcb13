//! The whole-session loader: every call of a session read into memory at once, in time order.
//! `walk` reads sessions recorded before call blocks (schema 4) through it; the streaming walk
//! reads every newer one. Its block path (each thread decoding a run of blocks straight into
//! one vector) is the tests' independent reading of a session, against which the streaming
//! walk is checked (store/tests.rs).

use std::path::Path;

use anyhow::{Context as _, Result};
use rusqlite::params;

use super::events::{check_plausible, event_of_row, has_call_blocks, open_reader, EVENT_COLUMNS};
use crate::model::{advise_huge_pages, Event};

/// The session's calls that began at or before `to_ns`, in time order (entry time, then id).
///
/// Read from the session's call blocks (store/blocks.rs) when it has them, else from its rows;
/// in both cases split into parts read on parallel connections, in the order the writer
/// appended them, then put in time order (the writer's batches are almost sorted already, so
/// the final sort is cheap).
pub fn load(path: &Path, session: i64, to_ns: i64, pid: Option<u32>) -> Result<Vec<Event>> {
    let events = load_unchecked(path, session, to_ns, pid)?;
    check_plausible(session, &events)?;
    Ok(events)
}

fn load_unchecked(path: &Path, session: i64, to_ns: i64, pid: Option<u32>) -> Result<Vec<Event>> {
    if has_call_blocks(&open_reader(path)?, session)? {
        match load_blocks(path, session, to_ns, pid) {
            Ok(events) => return Ok(events),
            Err(e) => {
                let rowless = rowless_calls(path, session).unwrap_or(0);
                let lost = if rowless > 0 {
                    format!(" (its {rowless} allocator block events are kept in the blocks only and are left out)")
                } else {
                    String::new()
                };
                eprintln!("tracer: {e:#}; reading the session's rows instead{lost}");
            }
        }
    }
    // Small sessions are not worth a second connection.
    load_split(path, session, to_ns, pid, 200_000)
}

/// The session's calls kept in its blocks only (the allocator's block events, schema 6).
fn rowless_calls(path: &Path, session: i64) -> Result<i64> {
    let conn = open_reader(path)?;
    Ok(conn.query_row(
        "SELECT coalesce(sum(rowless), 0) FROM call_blocks WHERE session_id = ?1",
        [session],
        |r| r.get(0),
    )?)
}

fn reader_threads() -> usize {
    std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .clamp(1, 8)
}

/// `work` on each item, each on its own thread; the results in the items' order.
fn on_threads<I: Send, T: Send>(
    items: impl IntoIterator<Item = I>,
    work: impl Fn(I) -> Result<T> + Sync,
) -> Vec<Result<T>> {
    let work = &work;
    std::thread::scope(|scope| {
        let handles: Vec<_> = items
            .into_iter()
            .map(|item| scope.spawn(move || work(item)))
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(anyhow::anyhow!("a reader thread panicked")))
            })
            .collect()
    })
}

/// Runs `read` for each part on its own thread; concatenates the parts in order and sorts the
/// whole by entry time (stable: equal times keep the writer's order).
fn read_parts<P: Send + Sync>(
    parts: &[P],
    read: impl Fn(&P) -> Result<Vec<Event>> + Sync,
) -> Result<Vec<Event>> {
    let mut chunks = on_threads(parts, &read).into_iter();
    let mut out = chunks.next().unwrap_or_else(|| Ok(Vec::new()))?;
    for chunk in chunks {
        out.extend(chunk?);
    }
    into_time_order(&mut out);
    Ok(out)
}

/// [`load`] from the session's call blocks: each thread decodes a run of consecutive blocks
/// holding about the same number of calls straight into its own region of the one vector.
pub(super) fn load_blocks(
    path: &Path,
    session: i64,
    to_ns: i64,
    pid: Option<u32>,
) -> Result<Vec<Event>> {
    let conn = open_reader(path)?;
    // Only the rows' small columns: the blobs stay on their overflow pages until decoded.
    let mut stmt = conn.prepare(
        "SELECT id, calls FROM call_blocks WHERE session_id = ?1 AND min_ts_ns <= ?2 ORDER BY id",
    )?;
    let list: Vec<(i64, usize)> = stmt
        .query_map(params![session, to_ns], |r| {
            Ok((r.get(0)?, r.get::<_, i64>(1)?.max(0) as usize))
        })?
        .collect::<rusqlite::Result<_>>()
        .with_context(|| format!("list the call blocks of session {session}"))?;
    drop(stmt);
    drop(conn);
    // A row claiming more calls than a block holds is damaged (or crafted): refuse it before
    // sizing anything by it.
    if let Some((id, n)) = list.iter().find(|(_, n)| *n > super::blocks::MAX_CALLS) {
        anyhow::bail!(
            "call block {id} of session {session} is damaged: it claims {n} calls, more than a block holds"
        );
    }
    let total: usize = list.iter().map(|(_, n)| n).sum();
    let threads = if total < 200_000 { 1 } else { reader_threads() };
    // Runs of blocks (first id, last id, calls) with about total / threads calls each.
    let mut parts: Vec<(i64, i64, usize)> = Vec::new();
    let mut acc = 0;
    for &(id, n) in &list {
        let filled = total * parts.len() / threads;
        match parts.last_mut() {
            Some(part) if acc < filled => {
                part.1 = id;
                part.2 += n;
            }
            _ => parts.push((id, id, n)),
        }
        acc += n;
    }
    let mut out: Vec<Event> = Vec::with_capacity(total);
    advise_huge_pages(&mut out);
    let mut regions = Vec::with_capacity(parts.len());
    let mut rest = &mut out.spare_capacity_mut()[..total];
    for part in &parts {
        let (region, tail) = rest.split_at_mut(part.2);
        regions.push((*part, region));
        rest = tail;
    }
    let written = on_threads(regions, |((first, last, _), region)| {
        let mut n = 0;
        let mut overflow = false;
        read_blocks(path, session, first, last, to_ns, |e| {
            if e.ts_ns <= to_ns && pid.is_none_or(|p| p == e.pid) {
                match region.get_mut(n) {
                    Some(slot) => {
                        slot.write(e);
                        n += 1;
                    }
                    None => overflow = true,
                }
            }
        })?;
        // Each block decodes exactly the calls its row counts, so this means the
        // table changed between the listing and the reading.
        anyhow::ensure!(
            !overflow,
            "the call blocks of session {session} changed while being read"
        );
        Ok(n)
    });
    // Close the gaps that filtered-out calls left between the regions.
    let spare = out.spare_capacity_mut();
    let (mut start, mut len) = (0, 0);
    for (part, n) in parts.iter().zip(written) {
        let n = n?;
        spare.copy_within(start..start + n, len);
        start += part.2;
        len += n;
    }
    // SAFETY: the first `len` slots were written above: each region's first n slots by its
    // thread (MaybeUninit::write), then moved down in order so that they are contiguous.
    unsafe { out.set_len(len) };
    into_time_order(&mut out);
    Ok(out)
}

/// Puts calls in the writer's order into entry-time order, stably. The writer stores a call when
/// it returns, so a call comes after the shorter calls that began after it: the order is nearly
/// sorted, which a general sort of ten million calls (seconds) does not exploit. Each core
/// insertion-sorts a share, then one pass mends the seams.
fn into_time_order(events: &mut [Event]) {
    if events.is_sorted_by_key(|e| e.ts_ns) {
        return;
    }
    let share = events.len().div_ceil(reader_threads()).max(1);
    std::thread::scope(|scope| {
        for part in events.chunks_mut(share) {
            scope.spawn(move || sort_nearly_sorted(part));
        }
    });
    sort_nearly_sorted(events);
}

/// Stable insertion sort by entry time: linear in the number of places calls move, so it gives
/// up for the general sort once that passes 16 per call (data far from sorted).
pub(super) fn sort_nearly_sorted(events: &mut [Event]) {
    let budget = events.len().saturating_mul(16);
    let mut moved = 0usize;
    for i in 1..events.len() {
        let ts = events[i].ts_ns;
        if events[i - 1].ts_ns <= ts {
            continue;
        }
        let mut j = i - 1;
        while j > 0 && events[j - 1].ts_ns > ts {
            j -= 1;
        }
        moved += i - j;
        if moved > budget {
            events.sort_by_key(|e| e.ts_ns);
            return;
        }
        events[j..=i].rotate_right(1);
    }
}

/// Decodes the blocks with ids in `[first, last]` of `session` that begin by `to_ns`.
fn read_blocks(
    path: &Path,
    session: i64,
    first: i64,
    last: i64,
    to_ns: i64,
    mut emit: impl FnMut(Event),
) -> Result<()> {
    let conn = open_reader(path)?;
    let mut stmt = conn.prepare(
        "SELECT id, format, calls, data FROM call_blocks
         WHERE id >= ?1 AND id <= ?2 AND session_id = ?3 AND min_ts_ns <= ?4 ORDER BY id",
    )?;
    let mut rows = stmt.query(params![first, last, session, to_ns])?;
    while let Some(r) = rows.next().context("read call blocks")? {
        let id: i64 = r.get(0)?;
        let format: i64 = r.get(1)?;
        if format != super::blocks::FORMAT {
            anyhow::bail!(
                "call block {id} of session {session} has format {format}, which this tracer does not read"
            );
        }
        let calls = r.get::<_, i64>(2)?.max(0) as usize;
        let data = r.get_ref(3)?.as_blob()?;
        super::blocks::decode(data, calls, &mut emit)
            .map_err(|e| anyhow::anyhow!("call block {id} of session {session} is damaged: {e}"))?;
    }
    Ok(())
}

/// [`load`] from the rows, reading in parallel once the session spans `min_ids_to_split` ids.
pub(super) fn load_split(
    path: &Path,
    session: i64,
    to_ns: i64,
    pid: Option<u32>,
    min_ids_to_split: i64,
) -> Result<Vec<Event>> {
    let conn = open_reader(path)?;
    let (lo, hi): (Option<i64>, Option<i64>) = conn
        .query_row(
            "SELECT min(id), max(id) FROM calls WHERE session_id = ?1",
            [session],
            |r| Ok((r.get(0)?, r.get(1)?)),
        )
        .context("read the session's id range")?;
    let (Some(lo), Some(hi)) = (lo, hi) else {
        return Ok(Vec::new());
    };
    drop(conn);
    let threads = reader_threads() as i64;
    let parts = if hi - lo < min_ids_to_split {
        1
    } else {
        threads.max(2)
    };
    let step = (hi - lo + parts) / parts;
    let ranges: Vec<(i64, i64, i64)> = (0..parts)
        .map(|i| {
            let (from, to) = (lo + i * step, (lo + (i + 1) * step).min(hi + 1));
            // The first part's vector holds them all: the others are appended to it.
            (from, to, if i == 0 { hi - lo + 1 } else { to - from })
        })
        .collect();
    read_parts(&ranges, |&(from, to, capacity)| {
        load_range(path, session, from, to, to_ns, pid, capacity)
    })
}

/// Calls with ids in `[from, to)` of `session`, begun at or before `to_ns`, in id order.
fn load_range(
    path: &Path,
    session: i64,
    from: i64,
    to: i64,
    to_ns: i64,
    pid: Option<u32>,
    capacity: i64,
) -> Result<Vec<Event>> {
    let conn = open_reader(path)?;
    let mut stmt = conn.prepare(&format!(
        "SELECT session_id, {EVENT_COLUMNS} FROM calls WHERE id >= ?1 AND id < ?2 ORDER BY id"
    ))?;
    let mut rows = stmt.query(params![from, to])?;
    let mut out = Vec::with_capacity(capacity.max(0) as usize);
    while let Some(r) = rows.next().context("read calls")? {
        if r.get_ref(0)?.as_i64()? != session {
            continue;
        }
        let Some(e) = event_of_row(r, 1)? else {
            continue;
        };
        if e.ts_ns > to_ns || pid.is_some_and(|p| p != e.pid) {
            continue;
        }
        out.push(e);
    }
    Ok(out)
}
