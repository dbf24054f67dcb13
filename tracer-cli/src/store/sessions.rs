//! Sessions: begun, counted, ended, noted; those a dead tracer left running closed.

use anyhow::{Context as _, Result};
use rusqlite::params;
use serde::Serialize;

use super::*;

impl SessionCounters {
    /// What tracer could not keep, by the session column that counts it.
    pub fn losses(&self) -> [(&'static str, u64); 10] {
        [
            ("dropped_ring_full", self.dropped_ring_full),
            ("unmatched_returns", self.unmatched_returns),
            ("alloc_map_full", self.alloc_map_full),
            ("inflight_full", self.inflight_full),
            ("decode_errors", self.decode_errors),
            ("offcpu_dropped", self.offcpu_dropped),
            ("tail_call_failed", self.tail_call_failed),
            ("map_insert_failed", self.map_insert_failed),
            ("calls_abandoned", self.calls_abandoned),
            ("mappings_lost", self.mappings_lost),
        ]
    }
}

/// The source of a session imported from a PyTorch memory snapshot without times (older
/// PyTorch): its calls' times give their order only.
pub const SNAPSHOT_UNTIMED: &str = "snapshot_untimed";

/// What a session records about itself at its start.
#[derive(Debug, Default, Serialize)]
pub struct SessionStart {
    pub started_ns: i64,
    pub source: &'static str,
    pub host: String,
    pub kernel: String,
    pub command: String,
    pub pid_filter: Option<Vec<u32>>,
}

/// Counters kept in the kernel and by the reader, stored with the session.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct SessionCounters {
    pub entries: u64,
    pub submitted: u64,
    pub dropped_ring_full: u64,
    pub unmatched_returns: u64,
    pub alloc_map_full: u64,
    pub inflight_full: u64,
    pub events_read: u64,
    pub events_stored: u64,
    pub decode_errors: u64,
    pub offcpu_submitted: u64,
    pub offcpu_dropped: u64,
    /// Events lost because the call-site program could not be reached (--stack).
    pub tail_call_failed: u64,
    /// Kernel map entries that could not be stored (a full map).
    pub map_insert_failed: u64,
    /// Calls whose thread exited before they returned, or still in progress a while after
    /// the stop: no event could be made of them.
    pub calls_abandoned: u64,
    /// Calls of Python processes made before tracer registered their interpreter: they have
    /// no Python frames (--stack).
    pub calls_before_interpreter: u64,
    /// Records of processes' new mappings the kernel could not hand over (a full side-band
    /// ring): native frames in those mappings may stay unresolved (--stack).
    pub mappings_lost: u64,
    /// Events that reached the reader after it had handed over events made later (a program
    /// held off its CPU for longer than the reader waits): stored after them, so a free may
    /// come before its allocation and lack its size.
    pub events_late: u64,
}

impl Store {
    /// Marks 'crashed' the sessions still 'running' whose tracer is gone: the node restarted
    /// since (another boot id), or their tracer process no longer exists. Everything they
    /// committed stays. Returns their ids.
    pub fn close_orphaned_sessions(&self) -> Result<Vec<i64>> {
        let boot = boot_id();
        let running: Vec<(i64, i64, Option<String>)> = self
            .conn
            .prepare("SELECT id, tracer_pid, boot_id FROM sessions WHERE status = 'running' AND tracer_pid IS NOT NULL")?
            .query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))?
            .collect::<rusqlite::Result<_>>()
            .with_context(|| format!("read the running sessions of {}", self.path.display()))?;
        let mut closed = Vec::new();
        for (id, pid, session_boot) in running {
            let rebooted = session_boot.as_deref() != Some(boot.as_str());
            let gone = rebooted || !tracer_alive(pid);
            if !gone {
                continue;
            }
            let why = if rebooted {
                "the machine restarted"
            } else {
                "its tracer process is gone (killed?)"
            };
            self.conn.execute(
                "UPDATE sessions SET status = 'crashed' WHERE id = ?1 AND status = 'running'",
                [id],
            )?;
            self.append_note(
                id,
                &format!("crashed: found running by a later trace, but {why}; every call committed before is kept"),
            )?;
            closed.push(id);
        }
        Ok(closed)
    }

    pub fn begin_session(&self, start: &SessionStart) -> Result<i64> {
        let pid_filter = start
            .pid_filter
            .as_ref()
            .map(serde_json::to_string)
            .transpose()?;
        self.conn
            .execute(
                "INSERT INTO sessions (started_ns, status, source, host, kernel, tracer_version, command, pid_filter, call_blocks, tracer_pid, boot_id, devices_learned)
                 VALUES (?1, 'running', ?2, ?3, ?4, ?5, ?6, ?7, 1, ?8, ?9, 1)",
                params![
                    start.started_ns,
                    start.source,
                    start.host,
                    start.kernel,
                    env!("CARGO_PKG_VERSION"),
                    start.command,
                    pid_filter,
                    std::process::id(),
                    boot_id()
                ],
            )
            .with_context(|| format!("create a session in {}", self.path.display()))?;
        Ok(self.conn.last_insert_rowid())
    }

    pub fn set_libraries(&self, session: i64, libraries_json: &str) -> Result<()> {
        self.conn
            .execute(
                "UPDATE sessions SET libraries = ?2 WHERE id = ?1",
                params![session, libraries_json],
            )
            .with_context(|| format!("record libraries of session {session}"))?;
        Ok(())
    }

    pub fn set_counters(&self, session: i64, c: &SessionCounters) -> Result<()> {
        // Once a second for the whole trace: prepared once.
        self.conn
            .prepare_cached(
                "UPDATE sessions SET entries = ?2, submitted = ?3, dropped_ring_full = ?4,
                    unmatched_returns = ?5, alloc_map_full = ?6, inflight_full = ?7, events_read = ?8,
                    events_stored = ?9, decode_errors = ?10, offcpu_submitted = ?11, offcpu_dropped = ?12,
                    tail_call_failed = ?13, map_insert_failed = ?14, calls_abandoned = ?15,
                    calls_before_interpreter = ?16, mappings_lost = ?17, events_late = ?18
                 WHERE id = ?1",
            )
            .and_then(|mut update| {
                update.execute(params![
                    session,
                    c.entries as i64,
                    c.submitted as i64,
                    c.dropped_ring_full as i64,
                    c.unmatched_returns as i64,
                    c.alloc_map_full as i64,
                    c.inflight_full as i64,
                    c.events_read as i64,
                    c.events_stored as i64,
                    c.decode_errors as i64,
                    c.offcpu_submitted as i64,
                    c.offcpu_dropped as i64,
                    c.tail_call_failed as i64,
                    c.map_insert_failed as i64,
                    c.calls_abandoned as i64,
                    c.calls_before_interpreter as i64,
                    c.mappings_lost as i64,
                    c.events_late as i64
                ])
            })
            .with_context(|| format!("store counters of session {session}"))?;
        Ok(())
    }

    pub fn end_session(&self, session: i64, ended_ns: i64, status: &str) -> Result<()> {
        self.conn
            .execute(
                "UPDATE sessions SET ended_ns = ?2, status = ?3 WHERE id = ?1",
                params![session, ended_ns, status],
            )
            .with_context(|| format!("close session {session}"))?;
        Ok(())
    }

    /// The session took up running processes' state from session `from`'s keyframe.
    pub fn set_restored_from(&self, session: i64, from: i64) -> Result<()> {
        self.conn
            .execute(
                "UPDATE sessions SET restored_from = ?2 WHERE id = ?1",
                params![session, from],
            )
            .with_context(|| format!("record where session {session} took its state up from"))?;
        Ok(())
    }

    pub fn set_host_context(&self, session: i64, state: &str) -> Result<()> {
        self.conn
            .execute(
                "UPDATE sessions SET host_context = ?2 WHERE id = ?1",
                params![session, state],
            )
            .with_context(|| format!("record the host context state of session {session}"))?;
        Ok(())
    }

    /// `--allocator`'s mode ("always", "auto", "off").
    pub fn set_allocator_mode(&self, session: i64, mode: &str) -> Result<()> {
        self.conn
            .execute(
                "UPDATE sessions SET allocator = ?2 WHERE id = ?1",
                params![session, mode],
            )
            .with_context(|| format!("record the allocator mode of session {session}"))?;
        Ok(())
    }

    pub fn append_note(&self, session: i64, note: &str) -> Result<()> {
        self.conn
            .execute(
                "UPDATE sessions SET note = CASE WHEN note IS NULL OR note = '' THEN ?2 ELSE note || char(10) || ?2 END
                 WHERE id = ?1",
                params![session, note],
            )
            .with_context(|| format!("add a note to session {session}"))?;
        Ok(())
    }
}

/// This boot's id (changes when the machine restarts).
pub fn boot_id() -> String {
    std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
        .map(|s| s.trim().to_owned())
        .unwrap_or_default()
}

/// Whether `pid` is a running tracer (a pid reused by another program is not).
fn tracer_alive(pid: i64) -> bool {
    pid == i64::from(std::process::id())
        || std::fs::read_to_string(format!("/proc/{pid}/comm")).is_ok_and(|c| c.trim() == "tracer")
}
