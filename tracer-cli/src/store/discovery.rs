//! The processes that opened a CUDA library and what tracer saw of each (SCHEMA.md,
//! `discovery`; schema 15): written as the main thread finds them, read by explain.

use anyhow::{Context as _, Result};
use rusqlite::{params, Connection};

use super::Store;
use crate::model::discovery::{DiscoveryRow, Outcome};

impl Store {
    pub fn write_discovery(&mut self, session: i64, rows: &[DiscoveryRow]) -> Result<()> {
        let tx = self
            .conn
            .transaction()
            .context("begin storing the processes that opened a CUDA library")?;
        {
            let mut add = tx.prepare_cached(
                "INSERT INTO discovery (session_id, pid, comm, library, opened_ns, probed_ns, held_us, outcome, why)
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9)",
            )?;
            for r in rows {
                add.execute(params![
                    session,
                    r.pid,
                    r.comm,
                    r.library,
                    r.opened_ns,
                    r.probed_ns,
                    r.held_us.map(|us| us as i64),
                    r.outcome.name(),
                    r.why
                ])?;
            }
        }
        tx.commit()
            .context("store the processes that opened a CUDA library")
    }

    /// Library opens the kernel could not tell tracer of (its ring or pending map full).
    pub fn set_lib_opens_lost(&self, session: i64, lost: u64) -> Result<()> {
        self.conn
            .execute(
                "UPDATE sessions SET lib_opens_lost = ?2 WHERE id = ?1",
                params![session, lost as i64],
            )
            .with_context(|| format!("count the lost library opens of session {session}"))?;
        Ok(())
    }
}

/// The session's rows (none before schema 15), in the order they were found.
pub fn rows(conn: &Connection, session: i64) -> Result<Vec<DiscoveryRow>> {
    if !super::has_table(conn, "discovery")? {
        return Ok(Vec::new());
    }
    let mut stmt = conn.prepare(
        "SELECT pid, comm, library, opened_ns, probed_ns, held_us, outcome, why
         FROM discovery WHERE session_id = ?1 ORDER BY rowid",
    )?;
    let rows = stmt.query_map([session], |r| {
        let outcome: String = r.get(6)?;
        Ok(DiscoveryRow {
            pid: r.get(0)?,
            comm: r.get(1)?,
            library: r.get(2)?,
            opened_ns: r.get(3)?,
            probed_ns: r.get(4)?,
            held_us: r.get::<_, Option<i64>>(5)?.map(|us| us.max(0) as u64),
            outcome: Outcome::parse(&outcome).unwrap_or(Outcome::Missed),
            why: r.get(7)?,
        })
    })?;
    rows.collect::<rusqlite::Result<_>>().with_context(|| {
        format!("read the processes that opened a CUDA library in session {session}")
    })
}
