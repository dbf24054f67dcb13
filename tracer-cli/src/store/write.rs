//! Batched writes: a round's calls, threads, processes, off-CPU intervals and messages in one
//! transaction, and call sites stored once.

use anyhow::{Context as _, Result};
use rusqlite::params;

use super::*;
use crate::{
    decode::Call,
    model::{devices::Learned, ProcessInfo},
};

impl Store {
    /// Stores threads' devices learned after their first calls were stored without one, and
    /// gives those calls' rows the device (the call blocks keep none: the read side applies
    /// `thread_devices`).
    pub fn learn_devices(&mut self, session: i64, learned: &[Learned]) -> Result<()> {
        if learned.is_empty() {
            return Ok(());
        }
        let tx = self
            .conn
            .transaction()
            .context("begin storing threads' devices")?;
        {
            let mut add = tx.prepare_cached(
                "INSERT INTO thread_devices (session_id, pid, tid, device, from_ns, to_ns, how)
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6, 'pytorch:malloc')",
            )?;
            let mut rows = tx.prepare_cached(
                "UPDATE calls SET device = ?1 WHERE session_id = ?2 AND ts_ns BETWEEN ?3 AND ?4
                 AND pid = ?5 AND tid = ?6 AND device IS NULL",
            )?;
            for l in learned {
                add.execute(params![session, l.pid, l.tid, l.device, l.from_ns, l.to_ns])?;
                rows.execute(params![l.device, session, l.from_ns, l.to_ns, l.pid, l.tid])?;
            }
        }
        tx.commit().context("store threads' devices")
    }

    /// Stores what NVML said of each GPU (traced/nvml.rs).
    pub fn write_gpu_samples(
        &mut self,
        session: i64,
        samples: &[crate::model::GpuSample],
    ) -> Result<()> {
        if samples.is_empty() {
            return Ok(());
        }
        let tx = self
            .conn
            .transaction()
            .context("begin storing NVML's samples")?;
        {
            let mut add = tx.prepare_cached(
                "INSERT INTO gpu_samples (session_id, ts_ns, gpu, total, used, processes)
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6)",
            )?;
            for g in samples {
                let processes =
                    serde_json::to_string(&g.processes).context("encode NVML's processes")?;
                add.execute(params![
                    session,
                    g.ts_ns,
                    g.gpu,
                    g.total as i64,
                    g.used as i64,
                    processes
                ])?;
            }
        }
        tx.commit().context("store NVML's samples")
    }

    /// Writes one batch of calls, with the threads and processes first seen in it, in one transaction.
    pub fn write_batch(&mut self, batch: &Batch<'_>) -> Result<()> {
        let tx = self
            .conn
            .transaction()
            .context("begin a write transaction")?;
        {
            let mut proc_stmt = tx.prepare_cached(
                "INSERT OR IGNORE INTO processes (session_id, pid, start_time_ns, first_seen_ns, comm, cmdline, exe, cgroup, env, gpus)
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10)",
            )?;
            for p in batch.processes {
                proc_stmt.execute(params![
                    batch.session,
                    p.pid,
                    p.start_time_ns,
                    p.first_seen_ns,
                    p.comm,
                    p.cmdline,
                    p.exe,
                    p.cgroup,
                    p.env,
                    p.gpus
                ])?;
            }
            let mut msg_stmt = tx.prepare_cached(
                "INSERT INTO messages (session_id, ts_ns, pid, tid, op_id, text, truncated) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7)",
            )?;
            for m in batch.messages {
                msg_stmt.execute(params![
                    batch.session,
                    m.ts_mono_ns as i64 + batch.wall_offset_ns,
                    m.pid,
                    m.tid,
                    m.op as u32,
                    m.text,
                    m.truncated
                ])?;
            }
            let mut off_stmt = tx.prepare_cached(
                "INSERT INTO offcpu_blocks (session_id, format, intervals, min_off_ns, max_on_ns, data)
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6)",
            )?;
            for chunk in batch.offcpu.chunks(offcpu_blocks::MAX_INTERVALS) {
                let block = offcpu_blocks::encode(chunk, batch.wall_offset_ns);
                off_stmt.execute(params![
                    batch.session,
                    offcpu_blocks::FORMAT,
                    block.intervals as i64,
                    block.min_off_ns,
                    block.max_on_ns,
                    block.data
                ])?;
            }
            let mut thread_stmt =
                tx.prepare_cached("INSERT OR IGNORE INTO threads (session_id, pid, tid, comm) VALUES (?1, ?2, ?3, ?4)")?;
            for (pid, tid, comm) in batch.threads {
                thread_stmt.execute(params![batch.session, pid, tid, comm])?;
            }
            // The allocator's block events are many and small: kept in the blocks only.
            let rowed: Vec<&Call> = batch.calls.iter().filter(|c| has_row(c)).collect();
            // Many rows per statement: one sqlite3_step per CALLS_PER_INSERT rows instead of per
            // row roughly halves the writer's CPU per event.
            let mut chunks = rowed.chunks_exact(CALLS_PER_INSERT);
            let mut full = tx.prepare_cached(&insert_calls_sql(CALLS_PER_INSERT))?;
            for chunk in &mut chunks {
                bind_calls(&mut full, chunk, batch)?;
                full.raw_execute()?;
            }
            let mut one = tx.prepare_cached(&insert_calls_sql(1))?;
            for call in chunks.remainder() {
                bind_calls(&mut one, std::slice::from_ref(call), batch)?;
                one.raw_execute()?;
            }
            // The rows just inserted have consecutive ids (one past the largest, under the
            // write lock), so each block knows the rows it copies.
            let mut next_id = if rowed.is_empty() {
                tx.query_row("SELECT coalesce(max(id), 0) + 1 FROM calls", [], |r| {
                    r.get(0)
                })?
            } else {
                tx.last_insert_rowid() - rowed.len() as i64 + 1
            };
            // A block's id orders the walk, and holes and keyframes name blocks by id: an id
            // must never be given again, even when eviction deleted every block above it
            // (SQLite's own rowid would restart at one past the largest left).
            let mut block_stmt = tx.prepare_cached(
                "INSERT INTO call_blocks (id, session_id, first_call, last_call, calls, min_ts_ns, max_ts_ns, format, data, rowless)
                 VALUES (1 + max(coalesce((SELECT max(id) FROM call_blocks), 0),
                                 coalesce((SELECT max(through_block) FROM holes), 0),
                                 coalesce((SELECT max(through_block) FROM keyframes), 0)),
                         ?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9)",
            )?;
            for chunk in batch.calls.chunks(blocks::MAX_CALLS) {
                let block = blocks::encode(chunk, batch.wall_offset_ns);
                let rows = chunk.iter().filter(|c| has_row(c)).count() as i64;
                // A block without rows copies the empty range (next_id, next_id - 1).
                let last = next_id + rows - 1;
                block_stmt.execute(params![
                    batch.session,
                    next_id,
                    last,
                    block.calls as i64,
                    block.min_ts_ns,
                    block.max_ts_ns,
                    blocks::FORMAT,
                    block.data,
                    chunk.len() as i64 - rows
                ])?;
                next_id = last + 1;
            }
        }
        tx.commit().with_context(|| {
            format!(
                "commit {} events to {}",
                batch.calls.len(),
                self.path.display()
            )
        })?;
        Ok(())
    }

    /// Stores a call site and its frames (innermost first); returns its id for calls.stack_id.
    pub fn insert_stack(&mut self, session: i64, stack: &StackRow<'_>) -> Result<i64> {
        let tx = self
            .conn
            .transaction()
            .context("begin a write transaction")?;
        tx.execute(
            "INSERT INTO stacks (session_id, pid, native_depth, python) VALUES (?1, ?2, ?3, ?4)",
            params![session, stack.pid, stack.native_depth, stack.python],
        )?;
        let id = tx.last_insert_rowid();
        {
            let mut frame = tx.prepare_cached(
                "INSERT INTO stack_frames (stack_id, idx, kind, function, file, line, module, address)
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8)",
            )?;
            for (idx, f) in stack.frames.iter().enumerate() {
                frame.execute(params![
                    id,
                    idx,
                    f.kind,
                    f.function,
                    f.file,
                    f.line,
                    f.module,
                    f.address.map(|a| a as i64)
                ])?;
            }
        }
        tx.commit()
            .with_context(|| format!("store a call site in {}", self.path.display()))?;
        Ok(id)
    }
}

/// Rows per multi-row INSERT (14 parameters each; SQLite allows 32766).
const CALLS_PER_INSERT: usize = 64;
const CALL_COLUMNS: usize = 14;

fn insert_calls_sql(rows: usize) -> String {
    let row = format!("({})", vec!["?"; CALL_COLUMNS].join(", "));
    format!(
        "INSERT INTO calls (session_id, ts_ns, pid, tid, op_id, device, size, ptr, ret, duration_ns, aux0, aux1, flags, stack_id) VALUES {}",
        vec![row; rows].join(", ")
    )
}

/// Whether a call gets a `calls` row: all but the allocator's block events, which only the call
/// blocks keep (SCHEMA.md, `tensor_events`).
pub fn has_row(call: &Call) -> bool {
    !matches!(
        call.op.spec().class,
        tracer_common::OpClass::BlockAlloc | tracer_common::OpClass::BlockFree
    )
}

fn bind_calls(
    stmt: &mut rusqlite::CachedStatement<'_>,
    calls: &[&Call],
    batch: &Batch<'_>,
) -> rusqlite::Result<()> {
    let nonzero = |v: u64| (v != 0).then_some(v as i64);
    for (row, call) in calls.iter().enumerate() {
        let base = row * CALL_COLUMNS;
        stmt.raw_bind_parameter(base + 1, batch.session)?;
        stmt.raw_bind_parameter(base + 2, call.ts_mono_ns as i64 + batch.wall_offset_ns)?;
        stmt.raw_bind_parameter(base + 3, call.pid)?;
        stmt.raw_bind_parameter(base + 4, call.tid)?;
        stmt.raw_bind_parameter(base + 5, call.op as u32)?;
        stmt.raw_bind_parameter(base + 6, call.device)?;
        stmt.raw_bind_parameter(base + 7, call.size.map(|v| v as i64))?;
        stmt.raw_bind_parameter(base + 8, call.ptr.map(|v| v as i64))?;
        stmt.raw_bind_parameter(base + 9, call.ret)?;
        stmt.raw_bind_parameter(base + 10, call.duration_ns as i64)?;
        stmt.raw_bind_parameter(base + 11, nonzero(call.aux0))?;
        stmt.raw_bind_parameter(base + 12, nonzero(call.aux1))?;
        stmt.raw_bind_parameter(base + 13, call.flags)?;
        stmt.raw_bind_parameter(base + 14, call.stack)?;
    }
    Ok(())
}

/// A call site as stored: `python` says whether and how the Python frames were read.
pub struct StackRow<'a> {
    pub pid: u32,
    pub native_depth: u32,
    pub python: &'static str,
    pub frames: &'a [StackFrame],
}

/// One frame of a stored call site.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct StackFrame {
    /// "python" or "native".
    pub kind: &'static str,
    pub function: Option<String>,
    pub file: Option<String>,
    pub line: Option<i64>,
    /// Native: the library or executable.
    pub module: Option<String>,
    /// Native: the offset in `module` (the return address - 1).
    pub address: Option<u64>,
}

/// One transaction's worth of rows.
pub struct Batch<'a> {
    pub session: i64,
    pub wall_offset_ns: i64,
    pub calls: &'a [Call],
    pub threads: &'a [(u32, u32, String)],
    pub processes: &'a [ProcessInfo],
    pub offcpu: &'a [crate::decode::OffCpu],
    pub messages: &'a [crate::decode::Message],
}
