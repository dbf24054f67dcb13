//! The whole-run series (one row per process, device and interval, never evicted) and the gaps:
//! what tracer did not see of a process (SCHEMA.md, `series`, `gaps`).

use super::Store;
pub use crate::model::run_series::{GapRow, KeptRow, OpFigures, SeriesRow};
use anyhow::{Context as _, Result};
use rusqlite::{params, Connection};

impl Store {
    /// Stores series rows and gaps (in the writer's transaction rhythm).
    pub fn write_series(
        &mut self,
        session: i64,
        rows: &[SeriesRow],
        gaps: &[GapRow],
    ) -> Result<()> {
        if rows.is_empty() && gaps.is_empty() {
            return Ok(());
        }
        let tx = self
            .conn
            .transaction()
            .context("begin writing the series")?;
        {
            let mut insert = tx.prepare_cached(
                "INSERT INTO series (session_id, pid, device, start_ns, end_ns, allocated, reserved, cached,
                    largest_free, fragmentation, largest_request, device_free, calls, errors, failures, ooms,
                    retries, warnings, ops)
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14, ?15, ?16, ?17, ?18, ?19)",
            )?;
            for r in rows {
                insert.execute(params![
                    session,
                    r.pid,
                    r.device,
                    r.start_ns,
                    r.end_ns,
                    r.allocated as i64,
                    r.reserved as i64,
                    r.cached as i64,
                    r.largest_free as i64,
                    r.fragmentation,
                    r.largest_request as i64,
                    r.device_free.map(|v| v as i64),
                    r.calls as i64,
                    r.errors as i64,
                    r.failures as i64,
                    r.ooms as i64,
                    r.retries as i64,
                    r.warnings as i64,
                    serde_json::to_string(&r.ops)?,
                ])?;
            }
            let mut gap = tx.prepare_cached(
                "INSERT INTO gaps (session_id, pid, from_ns, to_ns, kind, detail) VALUES (?1, ?2, ?3, ?4, ?5, ?6)",
            )?;
            for g in gaps {
                gap.execute(params![
                    session, g.pid, g.from_ns, g.to_ns, g.kind, g.detail
                ])?;
            }
        }
        tx.commit().with_context(|| {
            format!(
                "store the series of session {session} in {}",
                self.path.display()
            )
        })
    }
}

/// The series of a session (one process, or all), by process, device and time.
pub fn series(conn: &Connection, session: i64, pid: Option<u32>) -> Result<Vec<SeriesRow>> {
    let mut stmt = conn.prepare(
        "SELECT pid, device, start_ns, end_ns, allocated, reserved, cached, largest_free, fragmentation,
                largest_request, device_free, calls, errors, failures, ooms, retries, warnings, ops
         FROM series WHERE session_id = ?1 AND (?2 IS NULL OR pid = ?2) ORDER BY pid, device, start_ns",
    )?;
    let rows = stmt
        .query_map(params![session, pid], |r| {
            let u = |i: usize| -> rusqlite::Result<u64> { Ok(r.get::<_, i64>(i)?.max(0) as u64) };
            Ok(SeriesRow {
                pid: r.get(0)?,
                device: r.get(1)?,
                start_ns: r.get(2)?,
                end_ns: r.get(3)?,
                allocated: u(4)?,
                reserved: u(5)?,
                cached: u(6)?,
                largest_free: u(7)?,
                fragmentation: r.get(8)?,
                largest_request: u(9)?,
                device_free: r.get::<_, Option<i64>>(10)?.map(|v| v.max(0) as u64),
                calls: u(11)?,
                errors: u(12)?,
                failures: u(13)?,
                ooms: u(14)?,
                retries: u(15)?,
                warnings: u(16)?,
                ops: serde_json::from_str(&r.get::<_, String>(17)?).unwrap_or_default(),
            })
        })?
        .collect::<rusqlite::Result<Vec<_>>>()
        .with_context(|| format!("read the series of session {session}"))?;
    Ok(rows)
}

/// The detail --max-db kept around incidents of a session, oldest first.
pub fn kept(conn: &Connection, session: i64) -> Result<Vec<KeptRow>> {
    let mut stmt = conn.prepare(
        "SELECT from_ns, to_ns, reason FROM kept WHERE session_id = ?1 ORDER BY after_block",
    )?;
    let rows = stmt
        .query_map([session], |r| {
            Ok(KeptRow {
                from_ns: r.get(0)?,
                to_ns: r.get(1)?,
                reason: r.get(2)?,
            })
        })?
        .collect::<rusqlite::Result<Vec<_>>>()
        .with_context(|| format!("read the detail kept of session {session}"))?;
    Ok(rows)
}

/// What tracer did not see of a session's processes.
pub fn gaps(conn: &Connection, session: i64) -> Result<Vec<GapRow>> {
    let mut stmt = conn.prepare(
        "SELECT pid, from_ns, to_ns, kind, detail FROM gaps WHERE session_id = ?1 ORDER BY pid, to_ns",
    )?;
    let rows = stmt
        .query_map([session], |r| {
            Ok(GapRow {
                pid: r.get(0)?,
                from_ns: r.get(1)?,
                to_ns: r.get(2)?,
                kind: r.get(3)?,
                detail: r.get(4)?,
            })
        })?
        .collect::<rusqlite::Result<Vec<_>>>()
        .with_context(|| format!("read the gaps of session {session}"))?;
    Ok(rows)
}
