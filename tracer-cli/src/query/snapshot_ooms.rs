//! The out-of-memory entries of an exported memory snapshot: PyTorch's messages where they were
//! recorded, else the refusals its allocator raised for, with the device's free bytes PyTorch
//! read for its message.

use anyhow::Result;

use crate::model::Event;
use crate::store::events;

/// The process's out-of-memory entries up to `at_ns`, oldest first.
pub fn of(conn: &rusqlite::Connection, session: i64, pid: u32, at_ns: i64) -> Result<Vec<OomSeen>> {
    use tracer_common::Op;
    let said: Vec<OomSeen> = events::messages(conn, session)?
        .into_iter()
        .filter(|m| m.pid == pid && m.op == Op::TorchOom.name() && m.ts_ns <= at_ns)
        .map(|m| OomSeen {
            ts_ns: m.ts_ns,
            text: Some(m.text),
            size: None,
            device_free: None,
        })
        .collect();
    if said.is_empty() {
        return raised_unsaid(conn, session, pid, at_ns);
    }
    Ok(said)
}

/// An out-of-memory to write as an `oom` entry: PyTorch's message, or where none was recorded
/// the refusal its allocator raised for (no retry followed), with the free bytes of the
/// cudaMemGetInfo right after it (PyTorch's own reading for its message).
pub struct OomSeen {
    pub ts_ns: i64,
    pub text: Option<String>,
    pub size: Option<u64>,
    pub device_free: Option<u64>,
}

/// The process's raised refusals up to `at_ns`, for a recording without PyTorch's messages.
fn raised_unsaid(
    conn: &rusqlite::Connection,
    session: i64,
    pid: u32,
    at_ns: i64,
) -> Result<Vec<OomSeen>> {
    use crate::model::attempts;
    use tracer_common::OpClass;
    let calls = events::calls_of_classes(
        conn,
        session,
        &[OpClass::Alloc, OpClass::MemInfo],
        Some(pid),
    )?;
    let allocs: Vec<&Event> = calls
        .iter()
        .filter(|c| c.class() == OpClass::Alloc)
        .collect();
    let raised = attempts::raised(&attempts::attempts(allocs.iter().copied()));
    Ok(raised
        .iter()
        .filter(|a| a.event.ts_ns <= at_ns)
        .map(|a| {
            let f = &a.event;
            // The thread's next calls after the failure, up to its next allocation.
            let reading = calls
                .iter()
                .filter(|c| c.tid == f.tid && c.ts_ns > f.ts_ns)
                .take_while(|c| c.class() != OpClass::Alloc)
                .find(|c| c.class() == OpClass::MemInfo && c.ret == 0);
            OomSeen {
                // Just after the failed call, so that the entry follows it.
                ts_ns: f.ts_ns + 1,
                text: None,
                size: Some(f.size),
                device_free: reading.map(|r| r.aux0),
            }
        })
        .collect())
}
