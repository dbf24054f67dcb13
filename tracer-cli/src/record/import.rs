//! Recording from the simulated CUDA runtime's own event log (SIMCUDA_EVENTS=FILE) instead of
//! the ring buffer: a workload run on the simulated runtime can be stored and explained without
//! privileges. `tracer import` stores a finished log; `tracer demo` imports a growing one.

use std::{
    collections::BTreeSet,
    io::{Read as _, Seek as _, SeekFrom},
    path::Path,
};

use anyhow::{Context as _, Result};
use serde::Serialize;

use crate::{
    decode::simlog,
    exit::user_error,
    paths,
    record::join::Join,
    store::{Batch, SessionCounters, SessionStart, Store},
    traced::procinfo,
};

/// Bytes of log read per write transaction: bounds memory whatever the log's size.
const CHUNK_BYTES: usize = 8 << 20;

/// Imports the new lines of a growing log. Frees get their allocation's size as when tracing
/// live (the same join).
pub struct SimlogImporter {
    offset: u64,
    partial: Vec<u8>,
    join: Join,
    threads: BTreeSet<(u32, u32)>,
    pids: BTreeSet<u32>,
    /// The log's processes are running now: their names come from /proc.
    live: bool,
    boot: Option<i64>,
    /// Lines so far that were not calls of an op this tracer knows.
    unreadable_lines: u64,
}

impl SimlogImporter {
    pub fn new(live: bool) -> SimlogImporter {
        SimlogImporter {
            offset: 0,
            partial: Vec::new(),
            join: Join::for_log(),
            threads: BTreeSet::new(),
            pids: BTreeSet::new(),
            live,
            boot: procinfo::boot_time_ns(),
            unreadable_lines: 0,
        }
    }

    /// Creates the session the log's calls go into (source `simulated`).
    pub fn begin_session(store: &Store) -> Result<i64> {
        let host = nix::unistd::gethostname()
            .map(|h| h.to_string_lossy().into_owned())
            .unwrap_or_default();
        SimlogImporter::begin_session_on(store, &host)
    }

    /// [`SimlogImporter::begin_session`] for a simulated node named `host`.
    pub fn begin_session_on(store: &Store, host: &str) -> Result<i64> {
        store.begin_session(&SessionStart {
            started_ns: now_ns(),
            source: "simulated",
            host: host.to_owned(),
            kernel: String::new(),
            command: std::env::args().collect::<Vec<_>>().join(" "),
            pid_filter: None,
        })
    }

    /// Records the session's counters and note and ends it; returns the calls it holds.
    pub fn end_session(
        &self,
        store: &Store,
        session: i64,
        note: &str,
        status: &str,
    ) -> Result<u64> {
        // The call blocks hold every call, the allocator's block events too (which have no
        // row in `calls`).
        let stored: i64 = store
            .conn()
            .query_row(
                "SELECT max((SELECT count(*) FROM calls WHERE session_id = ?1),
                            (SELECT coalesce(sum(calls), 0) FROM call_blocks WHERE session_id = ?1))",
                [session],
                |r| r.get(0),
            )
            .context("count the imported calls")?;
        let stored = stored as u64;
        store.set_counters(
            session,
            &SessionCounters {
                submitted: stored,
                events_read: stored + self.unreadable_lines,
                events_stored: stored,
                decode_errors: self.unreadable_lines,
                alloc_map_full: self.join.not_tracked,
                ..Default::default()
            },
        )?;
        store.append_note(session, note)?;
        store.end_session(session, now_ns(), status)?;
        Ok(stored)
    }

    /// Stores every complete line appended to `log` since the last call (a log that does not
    /// exist yet holds nothing); returns how many calls it stored.
    pub fn import(&mut self, log: &Path, store: &mut Store, session: i64) -> Result<u64> {
        let Ok(mut file) = std::fs::File::open(log) else {
            return Ok(0);
        };
        file.seek(SeekFrom::Start(self.offset))
            .with_context(|| format!("seek in {}", log.display()))?;
        let mut total = 0;
        let mut chunk = Vec::with_capacity(CHUNK_BYTES);
        loop {
            chunk.clear();
            chunk.append(&mut self.partial);
            let n = (&mut file)
                .take(CHUNK_BYTES as u64)
                .read_to_end(&mut chunk)
                .with_context(|| format!("read {}", log.display()))?;
            self.offset += n as u64;
            let complete = chunk.iter().rposition(|&b| b == b'\n').map_or(0, |i| i + 1);
            self.partial = chunk[complete..].to_vec();
            total += self.store_lines(&chunk[..complete], store, session)?;
            if n < CHUNK_BYTES {
                return Ok(total);
            }
        }
    }

    fn store_lines(&mut self, text: &[u8], store: &mut Store, session: i64) -> Result<u64> {
        let mut calls = Vec::new();
        let mut threads = Vec::new();
        let mut processes = Vec::new();
        let mut messages = Vec::new();
        for line in text.split(|&b| b == b'\n').filter(|l| !l.is_empty()) {
            let mut call = match std::str::from_utf8(line).ok().and_then(simlog::parse_line) {
                Some(simlog::Line::Call(call)) => call,
                Some(simlog::Line::Message(message)) => {
                    messages.push(message);
                    continue;
                }
                None => {
                    self.unreadable_lines += 1;
                    continue;
                }
            };
            self.join.apply(&mut call);
            if self.threads.insert((call.pid, call.tid)) {
                let comm = self
                    .live
                    .then(|| procinfo::thread_comm(call.pid, call.tid))
                    .flatten()
                    .unwrap_or_else(|| "python3".into());
                threads.push((call.pid, call.tid, comm));
            }
            if self.pids.insert(call.pid) {
                processes.push(if self.live {
                    procinfo::read(call.pid, call.ts_mono_ns as i64, "python3", self.boot)
                } else {
                    // The pid may belong to another process by now: name only what the log says.
                    crate::model::ProcessInfo {
                        pid: call.pid,
                        start_time_ns: None,
                        first_seen_ns: call.ts_mono_ns as i64,
                        comm: None,
                        cmdline: None,
                        exe: None,
                        cgroup: None,
                        env: None,
                        gpus: None,
                        owner: None,
                    }
                });
            }
            calls.push(call);
        }
        store.write_batch(&Batch {
            session,
            wall_offset_ns: 0,
            calls: &calls,
            threads: &threads,
            processes: &processes,
            offcpu: &[],
            messages: &messages,
        })?;
        Ok(calls.len() as u64)
    }
}

fn now_ns() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as i64)
}

/// What [`import_log`] stored.
#[derive(Clone, Debug, Serialize)]
pub struct Imported {
    pub session: i64,
    /// Calls stored.
    pub calls: u64,
    /// Lines that were not calls and were skipped.
    pub skipped_lines: u64,
}

/// Stores a finished log as a new session of `db` (created for the invoking user when missing).
/// What was stored stays, and its session is closed, even when a later part of the log fails.
pub fn import_log(log: &Path, db: &Path) -> Result<Imported> {
    if !log.is_file() {
        return Err(user_error(format!(
            "event log {} is not a file: give the file the simulated runtime wrote (SIMCUDA_EVENTS=FILE)",
            log.display()
        )));
    }
    let who = paths::invoker();
    let mut store = Store::open_writable(db, who.owner)?;
    let session = SimlogImporter::begin_session(&store)?;
    let mut importer = SimlogImporter::new(false);
    let result = importer.import(log, &mut store, session);
    let calls = importer.end_session(
        &store,
        session,
        &format!("imported from {}", log.display()),
        if result.is_ok() {
            "complete"
        } else {
            "interrupted"
        },
    )?;
    result.with_context(|| format!("import {} into session {session}", log.display()))?;
    if calls == 0 {
        return Err(user_error(format!(
            "{} holds no call: is it the simulated runtime's event log (SIMCUDA_EVENTS)?",
            log.display()
        )));
    }
    Ok(Imported {
        session,
        calls,
        skipped_lines: importer.unreadable_lines,
    })
}
