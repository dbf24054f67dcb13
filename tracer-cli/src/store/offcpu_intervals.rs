//! `offcpu_intervals`: the off-CPU intervals of the followed threads (host context) as a table
//! to SQL, whichever way they are kept: packed in `offcpu_blocks` since schema version 13, one
//! row each in `offcpu` before. An eponymous virtual table registered on every connection tracer
//! opens: `SELECT * FROM offcpu_intervals WHERE session_id = 3`.
//!
//! It reads on the connection that queries it (so `tracer query`'s read-only guard applies),
//! one block (or one page of old rows) at a time.

use std::ffi::c_int;

use rusqlite::{
    ffi,
    vtab::{eponymous_only_module, Context, Filters, IndexInfo, VTab, VTabConnection, VTabCursor},
    Connection, OptionalExtension as _,
};

use super::{
    offcpu_blocks,
    tensor_events::{best_index_on_session, connect_direct, connection_of},
};
use crate::model::OffSlice;

/// The table's columns, in order: `offcpu`'s, and the block an interval came from (NULL for a
/// row of `offcpu`).
const COLUMNS: &str =
    "CREATE TABLE x(session_id INTEGER, pid INTEGER, tid INTEGER, off_ns INTEGER, on_ns INTEGER, wakeup_ns INTEGER, preempted INTEGER, block_id INTEGER)";
const COL_SESSION: c_int = 0;
/// Old rows read a page at a time.
const ROWS_PER_PAGE: i64 = 8192;

/// Registers `offcpu_intervals` on `conn`.
pub fn register(conn: &Connection) -> rusqlite::Result<()> {
    conn.create_module(
        c"offcpu_intervals",
        eponymous_only_module::<OffCpuIntervals>(),
        None,
    )
}

#[repr(C)]
struct OffCpuIntervals {
    /// Base class; must be first.
    base: ffi::sqlite3_vtab,
    db: *mut ffi::sqlite3,
}

// SAFETY: `base` comes first and is a default sqlite3_vtab, as the trait requires; `db` is the
// connection that created the table, which outlives it.
unsafe impl<'vtab> VTab<'vtab> for OffCpuIntervals {
    type Aux = ();
    type Cursor = Cursor<'vtab>;

    fn connect(
        db: &mut VTabConnection,
        _aux: Option<&()>,
        _args: &[&[u8]],
    ) -> rusqlite::Result<(String, Self)> {
        Ok((
            COLUMNS.to_owned(),
            OffCpuIntervals {
                base: ffi::sqlite3_vtab::default(),
                db: connect_direct(db)?,
            },
        ))
    }

    fn best_index(&self, info: &mut IndexInfo) -> rusqlite::Result<()> {
        best_index_on_session(info, COL_SESSION);
        Ok(())
    }

    fn open(&'vtab mut self) -> rusqlite::Result<Cursor<'vtab>> {
        Ok(Cursor {
            base: ffi::sqlite3_vtab_cursor::default(),
            db: self.db,
            session: None,
            next_block: 0,
            next_row: 0,
            slices: Vec::new(),
            at: 0,
            block: None,
            session_of: Vec::new(),
            _table: std::marker::PhantomData,
        })
    }
}

#[repr(C)]
struct Cursor<'vtab> {
    /// Base class; must be first.
    base: ffi::sqlite3_vtab_cursor,
    db: *mut ffi::sqlite3,
    /// The session asked for, if one was.
    session: Option<i64>,
    /// Blocks after this id are still to read, then rows of `offcpu` after this rowid.
    next_block: i64,
    next_row: i64,
    /// The current block's intervals (or page of rows), and each one's session.
    slices: Vec<OffSlice>,
    session_of: Vec<i64>,
    at: usize,
    /// The block the current intervals came from (None: rows).
    block: Option<i64>,
    _table: std::marker::PhantomData<&'vtab OffCpuIntervals>,
}

impl Cursor<'_> {
    fn connection(&self) -> rusqlite::Result<Connection> {
        connection_of(self.db)
    }

    /// Reads the next block, or page of rows, that holds intervals; none when all are read.
    fn load_next(&mut self) -> rusqlite::Result<()> {
        self.slices.clear();
        self.session_of.clear();
        self.at = 0;
        while self.slices.is_empty() {
            if self.next_block >= 0 {
                if !self.load_block()? {
                    self.next_block = -1;
                }
            } else if self.next_row >= 0 {
                if !self.load_rows()? {
                    self.next_row = -1;
                }
            } else {
                return Ok(());
            }
        }
        Ok(())
    }

    /// The next block of the session (or any): false when none is left.
    fn load_block(&mut self) -> rusqlite::Result<bool> {
        let conn = self.connection()?;
        if !super::has_table(&conn, "offcpu_blocks")? {
            return Ok(false);
        }
        let block: Option<(i64, i64, i64, i64, Vec<u8>)> = conn
            .query_row(
                "SELECT id, session_id, format, intervals, data FROM offcpu_blocks
                 WHERE id > ?1 AND (?2 IS NULL OR session_id = ?2) ORDER BY id LIMIT 1",
                rusqlite::params![self.next_block, self.session],
                |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?, r.get(4)?)),
            )
            .optional()?;
        let Some((id, session, format, intervals, data)) = block else {
            return Ok(false);
        };
        self.next_block = id;
        self.block = Some(id);
        if format != offcpu_blocks::FORMAT {
            return Err(rusqlite::Error::ModuleError(format!(
                "off-CPU block {id} has format {format}, which this tracer does not read"
            )));
        }
        let slices = &mut self.slices;
        offcpu_blocks::decode(&data, intervals.max(0) as usize, |s| slices.push(s)).map_err(
            |e| rusqlite::Error::ModuleError(format!("off-CPU block {id} is damaged: {e}")),
        )?;
        self.session_of.resize(self.slices.len(), session);
        Ok(true)
    }

    /// The next page of `offcpu` rows: false when none is left.
    fn load_rows(&mut self) -> rusqlite::Result<bool> {
        let conn = self.connection()?;
        let mut stmt = conn.prepare(
            "SELECT rowid, session_id, pid, tid, off_ns, on_ns, wakeup_ns, preempted FROM offcpu
             WHERE rowid > ?1 AND (?2 IS NULL OR session_id = ?2) ORDER BY rowid LIMIT ?3",
        )?;
        let mut rows = stmt.query(rusqlite::params![
            self.next_row,
            self.session,
            ROWS_PER_PAGE
        ])?;
        self.block = None;
        while let Some(r) = rows.next()? {
            self.next_row = r.get(0)?;
            self.session_of.push(r.get(1)?);
            self.slices.push(super::events::off_slice(r, 2)?);
        }
        Ok(!self.slices.is_empty())
    }
}

// SAFETY: `base` comes first and is a default sqlite3_vtab_cursor, as the trait requires.
unsafe impl VTabCursor for Cursor<'_> {
    fn filter(
        &mut self,
        idx_num: c_int,
        _idx_str: Option<&str>,
        args: &Filters<'_>,
    ) -> rusqlite::Result<()> {
        self.session = if idx_num == 1 {
            Some(args.get(0)?)
        } else {
            None
        };
        self.next_block = 0;
        self.next_row = 0;
        self.load_next()
    }

    fn next(&mut self) -> rusqlite::Result<()> {
        self.at += 1;
        if self.at >= self.slices.len() {
            self.load_next()?;
        }
        Ok(())
    }

    fn eof(&self) -> bool {
        self.at >= self.slices.len()
    }

    fn column(&self, ctx: &mut Context, i: c_int) -> rusqlite::Result<()> {
        let (Some(s), Some(session)) = (self.slices.get(self.at), self.session_of.get(self.at))
        else {
            return ctx.set_result(&rusqlite::types::Null);
        };
        match i {
            0 => ctx.set_result(session),
            1 => ctx.set_result(&s.pid),
            2 => ctx.set_result(&s.tid),
            3 => ctx.set_result(&s.off_ns),
            4 => ctx.set_result(&s.on_ns),
            5 => ctx.set_result(&s.wakeup_ns),
            6 => ctx.set_result(&i64::from(s.preempted)),
            _ => ctx.set_result(&self.block),
        }
    }

    fn rowid(&self) -> rusqlite::Result<i64> {
        // Unique within a query: blocks as tensor_events numbers them, rows negative.
        Ok(match self.block {
            Some(b) => b * (offcpu_blocks::MAX_INTERVALS as i64 * 2) + self.at as i64,
            None => -(self.next_row + 1) * ROWS_PER_PAGE - self.at as i64,
        })
    }
}
