//! The writer: batches what the registry hands over into transactions (every 200 ms or 50,000
//! calls), stores new call sites before the calls that point at them, notes new threads, keeps
//! the session's counters current and the database under --max-db.

use std::{
    collections::HashSet,
    sync::{
        atomic::Ordering,
        mpsc::{Receiver, RecvTimeoutError},
    },
    time::{Duration, Instant},
};

use anyhow::{anyhow, Result};

use super::{
    procinfo,
    shared::Shared,
    sites::{Site, SiteWriter},
};
use crate::{
    decode::{Call, Message, OffCpu},
    model::ProcessInfo,
    store::{Batch, Store},
};

const COMMIT_EVERY: Duration = Duration::from_millis(200);
const COMMIT_ROWS: usize = 50_000;

/// Calls read from the ring, with the processes first seen among them, and the traced
/// threads' off-CPU intervals.
#[derive(Default)]
pub struct Delivery {
    pub calls: Vec<Call>,
    pub processes: Vec<ProcessInfo>,
    pub offcpu: Vec<OffCpu>,
    /// Texts the traced programs produced (PyTorch's out-of-memory messages).
    pub messages: Vec<Message>,
    /// Call sites first seen in these calls (--stack).
    pub sites: Vec<(i64, Site)>,
    /// Followed processes that ended, after their calls above (not stored: for the live view).
    pub exited: Vec<u32>,
}

impl Delivery {
    /// Adds `more` to what waits for the next commit. Its new call sites are stored at once and
    /// its calls made to point at the stored ids.
    fn absorb(
        &mut self,
        more: Delivery,
        sites: &mut SiteWriter,
        store: &mut Store,
        session: i64,
    ) -> Result<()> {
        sites.store(store, session, &more.sites)?;
        self.calls.extend(more.calls.into_iter().map(|mut c| {
            c.stack = c.stack.and_then(|local| sites.stored_id(c.pid, local));
            c
        }));
        for &pid in &more.exited {
            sites.forget_process(pid);
        }
        self.processes.extend(more.processes);
        self.offcpu.extend(more.offcpu);
        self.messages.extend(more.messages);
        Ok(())
    }
}

#[derive(Clone, Copy)]
pub struct WriterOptions {
    pub session: i64,
    pub wall_offset_ns: i64,
    pub max_db: Option<u64>,
    pub owner: Option<(u32, u32)>,
}

/// Batches calls into transactions; notes new processes and threads; keeps the session's
/// counters current and the database under --max-db. Returns the store for the final update.
pub fn write_loop(
    mut store: Store,
    rx: Receiver<Delivery>,
    shared: &Shared,
    opts: WriterOptions,
) -> (Store, Result<()>) {
    // This thread only writes the database: all of it as the invoking user (files SQLite
    // creates later, such as a new -wal, are theirs and only where they could create them).
    let _as_user = crate::paths::act_as(opts.owner);
    let result = (|| -> Result<()> {
        // What waits for the next commit: calls, processes and off-CPU records (sites are
        // stored as they arrive, before the calls that point at them).
        let mut pending = Delivery::default();
        let mut threads_seen: HashSet<(u32, u32)> = HashSet::new();
        let mut site_writer = SiteWriter::default();
        let mut last_commit = Instant::now();
        let mut last_housekeeping = Instant::now();
        let mut owned = false;
        loop {
            let disconnected = match rx.recv_timeout(Duration::from_millis(50)) {
                Ok(first) => {
                    pending.absorb(first, &mut site_writer, &mut store, opts.session)?;
                    while let Ok(more) = rx.try_recv() {
                        pending.absorb(more, &mut site_writer, &mut store, opts.session)?;
                        if pending.calls.len() >= COMMIT_ROWS {
                            break;
                        }
                    }
                    false
                }
                Err(RecvTimeoutError::Timeout) => false,
                Err(RecvTimeoutError::Disconnected) => true,
            };
            if (!pending.calls.is_empty()
                || !pending.offcpu.is_empty()
                || !pending.messages.is_empty())
                && (disconnected
                    || pending.calls.len() >= COMMIT_ROWS
                    || last_commit.elapsed() >= COMMIT_EVERY)
            {
                let threads = new_threads(&pending.calls, &mut threads_seen);
                store.write_batch(&Batch {
                    session: opts.session,
                    wall_offset_ns: opts.wall_offset_ns,
                    calls: &pending.calls,
                    threads: &threads,
                    processes: &pending.processes,
                    offcpu: &pending.offcpu,
                    messages: &pending.messages,
                })?;
                shared.events_stored.fetch_add(
                    (pending.calls.len() + pending.messages.len()) as u64,
                    Ordering::SeqCst,
                );
                pending = Delivery::default();
                last_commit = Instant::now();
                if !owned {
                    store.secure_files(opts.owner)?;
                    owned = true;
                }
            }
            if last_housekeeping.elapsed() >= Duration::from_secs(1) || disconnected {
                last_housekeeping = Instant::now();
                housekeeping(&mut store, shared, opts)?;
            }
            if disconnected {
                return Ok(());
            }
        }
    })();
    if result.is_err() {
        shared.stop.store(true, Ordering::SeqCst);
    }
    (store, result)
}

/// Threads seen for the first time in `calls`, with their names.
fn new_threads(calls: &[Call], seen: &mut HashSet<(u32, u32)>) -> Vec<(u32, u32, String)> {
    let mut threads = Vec::new();
    for call in calls {
        if seen.insert((call.pid, call.tid)) {
            // The kernel sends a thread's name with its first event only; if that one was
            // lost, ask /proc.
            let comm = if call.comm.is_empty() {
                procinfo::thread_comm(call.pid, call.tid).unwrap_or_default()
            } else {
                call.comm.clone()
            };
            threads.push((call.pid, call.tid, comm));
        }
    }
    threads
}

/// How [`Store::enforce_max_size`]'s note on deleting a whole session begins.
const SESSION_DELETED: &str = "--max-db: deleted session ";

/// Once a second: the session's counters, and the database under --max-db.
fn housekeeping(store: &mut Store, shared: &Shared, opts: WriterOptions) -> Result<()> {
    let kernel = *shared
        .kernel
        .lock()
        .map_err(|_| anyhow!("counter lock poisoned"))?;
    store.set_counters(opts.session, &shared.counters(&kernel))?;
    if let Some(max) = opts.max_db {
        for note in store.enforce_max_size(opts.session, max)? {
            eprintln!("tracer: {note}");
            if note.starts_with(SESSION_DELETED) {
                shared.sessions_evicted.fetch_add(1, Ordering::SeqCst);
            }
            store.append_note(opts.session, &note)?;
        }
    }
    shared.db_bytes.store(store.used_bytes()?, Ordering::SeqCst);
    Ok(())
}
