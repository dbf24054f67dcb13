//! `tensor_events`: the allocator's block events (pytorch:malloc, pytorch:free), which only the
//! call blocks keep (a training job makes hundreds of thousands a second; a row each would
//! quadruple the database), as a table to SQL. An eponymous virtual table registered on every
//! connection tracer opens: `SELECT * FROM tensor_events WHERE session_id = 3`.
//!
//! It reads `call_blocks` on the connection that queries it (so `tracer query`'s read-only guard
//! applies) and decodes one block at a time.

use std::ffi::c_int;

use rusqlite::{
    ffi,
    vtab::{
        eponymous_only_module, Context, Filters, IndexConstraintOp, IndexInfo, VTab, VTabConfig,
        VTabConnection, VTabCursor,
    },
    Connection,
};
use tracer_common::OpClass;

use crate::model::{Event, NO_DEVICE};

/// The table's columns, in order.
const COLUMNS: &str =
    "CREATE TABLE x(session_id INTEGER, ts_ns INTEGER, pid INTEGER, tid INTEGER, op TEXT, device INTEGER, size INTEGER, ptr INTEGER, stack_id INTEGER, block_id INTEGER)";
const COL_SESSION: c_int = 0;

/// Registers `tensor_events` on `conn`.
pub fn register(conn: &Connection) -> rusqlite::Result<()> {
    conn.create_module(
        c"tensor_events",
        eponymous_only_module::<TensorEvents>(),
        None,
    )
}

#[repr(C)]
struct TensorEvents {
    /// Base class; must be first.
    base: ffi::sqlite3_vtab,
    db: *mut ffi::sqlite3,
}

// SAFETY: `base` comes first and is a default sqlite3_vtab, as the trait requires; `db` is the
// connection that created the table, which outlives it.
unsafe impl<'vtab> VTab<'vtab> for TensorEvents {
    type Aux = ();
    type Cursor = Cursor<'vtab>;

    fn connect(
        db: &mut VTabConnection,
        _aux: Option<&()>,
        _args: &[&[u8]],
    ) -> rusqlite::Result<(String, Self)> {
        Ok((
            COLUMNS.to_owned(),
            TensorEvents {
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
            blocks: Vec::new(),
            next_block: 0,
            events: Vec::new(),
            at: 0,
            block: (0, 0),
            _table: std::marker::PhantomData,
        })
    }
}

#[repr(C)]
struct Cursor<'vtab> {
    /// Base class; must be first.
    base: ffi::sqlite3_vtab_cursor,
    db: *mut ffi::sqlite3,
    /// The blocks to read: (id, session).
    blocks: Vec<(i64, i64)>,
    next_block: usize,
    /// The current block's block events.
    events: Vec<Event>,
    at: usize,
    /// The current block: (id, session).
    block: (i64, i64),
    _table: std::marker::PhantomData<&'vtab TensorEvents>,
}

impl Cursor<'_> {
    fn connection(&self) -> rusqlite::Result<Connection> {
        connection_of(self.db)
    }

    /// Decodes blocks until one holds block events, or none is left.
    fn load_next_block(&mut self) -> rusqlite::Result<()> {
        self.events.clear();
        self.at = 0;
        while self.events.is_empty() && self.next_block < self.blocks.len() {
            let (id, session) = self.blocks[self.next_block];
            self.next_block += 1;
            self.block = (id, session);
            let conn = self.connection()?;
            let (format, calls, data): (i64, i64, Vec<u8>) = conn.query_row(
                "SELECT format, calls, data FROM call_blocks WHERE id = ?1",
                [id],
                |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)),
            )?;
            if format != super::blocks::FORMAT {
                return Err(rusqlite::Error::ModuleError(format!(
                    "call block {id} has format {format}, which this tracer does not read"
                )));
            }
            let events = &mut self.events;
            super::blocks::decode(&data, calls.max(0) as usize, |e| {
                if matches!(e.class(), OpClass::BlockAlloc | OpClass::BlockFree) {
                    events.push(e);
                }
            })
            .map_err(|e| {
                rusqlite::Error::ModuleError(format!("call block {id} is damaged: {e}"))
            })?;
        }
        Ok(())
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
        let conn = self.connection()?;
        let blocks = if idx_num == 1 {
            let session: i64 = args.get(0)?;
            let mut stmt = conn.prepare(
                "SELECT id, session_id FROM call_blocks WHERE session_id = ?1 AND rowless > 0 ORDER BY id",
            )?;
            let rows = stmt.query_map([session], |r| Ok((r.get(0)?, r.get(1)?)))?;
            rows.collect::<rusqlite::Result<Vec<_>>>()?
        } else {
            let mut stmt = conn
                .prepare("SELECT id, session_id FROM call_blocks WHERE rowless > 0 ORDER BY id")?;
            let rows = stmt.query_map([], |r| Ok((r.get(0)?, r.get(1)?)))?;
            rows.collect::<rusqlite::Result<Vec<_>>>()?
        };
        self.blocks = blocks;
        self.next_block = 0;
        self.load_next_block()
    }

    fn next(&mut self) -> rusqlite::Result<()> {
        self.at += 1;
        if self.at >= self.events.len() {
            self.load_next_block()?;
        }
        Ok(())
    }

    fn eof(&self) -> bool {
        self.at >= self.events.len()
    }

    fn column(&self, ctx: &mut Context, i: c_int) -> rusqlite::Result<()> {
        let Some(e) = self.events.get(self.at) else {
            return ctx.set_result(&rusqlite::types::Null);
        };
        let nonzero = |v: u64| (v != 0).then_some(v as i64);
        match i {
            0 => ctx.set_result(&self.block.1),
            1 => ctx.set_result(&e.ts_ns),
            2 => ctx.set_result(&e.pid),
            3 => ctx.set_result(&e.tid),
            4 => ctx.set_result(&e.op.name()),
            5 => ctx.set_result(&(e.device != NO_DEVICE).then_some(e.device)),
            6 => ctx.set_result(&nonzero(e.size)),
            7 => ctx.set_result(&nonzero(e.ptr)),
            8 => ctx.set_result(&e.stack.map(|s| s.get())),
            _ => ctx.set_result(&self.block.0),
        }
    }

    fn rowid(&self) -> rusqlite::Result<i64> {
        // Unique within a query: the block's id, then the event's place in it.
        Ok(self.block.0 * blocks_stride() + self.at as i64)
    }
}

/// Room for every call of a block in a rowid.
const fn blocks_stride() -> i64 {
    super::blocks::MAX_CALLS as i64 * 2
}

/// What connecting a table read from its own connection's tables does: SQL in triggers and
/// views may not use it (`DirectOnly`), and it keeps the connection's handle.
pub(super) fn connect_direct(db: &mut VTabConnection) -> rusqlite::Result<*mut ffi::sqlite3> {
    db.config(VTabConfig::DirectOnly)?;
    // SAFETY: the handle of the connection this table lives on, used only while it does.
    Ok(unsafe { db.handle() })
}

/// The connection a table lives on, for its cursor's queries.
pub(super) fn connection_of(db: *mut ffi::sqlite3) -> rusqlite::Result<Connection> {
    // SAFETY: the table's own connection (connect_direct); the wrapper does not close it when
    // dropped.
    unsafe { Connection::from_handle(db) }
}

/// The plan of a table whose rows are read a session at a time: `session_column = ?` is
/// handed to the cursor (idx_num 1, argument 1) and reads only that session; else all.
pub(super) fn best_index_on_session(info: &mut IndexInfo, session_column: c_int) {
    let session = info.constraints().position(|c| {
        c.column() == session_column
            && c.is_usable()
            && c.operator() == IndexConstraintOp::SQLITE_INDEX_CONSTRAINT_EQ
    });
    match session {
        Some(i) => {
            let mut usage = info.constraint_usage(i);
            usage.set_argv_index(1);
            usage.set_omit(true);
            info.set_idx_num(1);
            info.set_estimated_cost(1e5);
        }
        None => {
            info.set_idx_num(0);
            info.set_estimated_cost(1e7);
        }
    }
}

/// A damaged call block met inside a query (through `tensor_events`) is bad input, named as
/// such (exit 2); any other error keeps its context.
pub(super) fn damaged_or(e: rusqlite::Error, session: i64, what: &str) -> anyhow::Error {
    match &e {
        rusqlite::Error::SqliteFailure(_, Some(msg)) if msg.contains("damaged") => {
            crate::exit::user_error(format!(
                "{what} of session {session}: the database is damaged: {msg} (tracer explain reads the rows instead)"
            ))
        }
        _ => anyhow::Error::new(e).context(what.to_owned()),
    }
}
