//! The writer: batches what the registry hands over into transactions (every 400 ms or 50,000
//! calls, at once for PyTorch's out-of-memory message), stores new call sites before the calls
//! that point at them, notes new threads, keeps the session's counters current and the
//! database under --max-db.

use std::{
    sync::{
        atomic::Ordering,
        mpsc::{Receiver, RecvTimeoutError},
    },
    time::{Duration, Instant},
};

use anyhow::{anyhow, Result};

use super::shared::{thread_cpu_ns, Shared};
use crate::traced::{
    procinfo,
    sites::{Site, SiteWriter, LOCAL_SITE_BASE},
};
use crate::{
    decode::{Call, Message, OffCpu},
    model::{state::ProcessState, ProcessInfo, SeededSet},
    store::{keyframes::KeyframeState, Batch, GapRow, SeriesRow, Store},
};

/// Ended processes whose call sites are kept for the keyframe that holds their last state.
const ENDED_SITES_KEPT: usize = 1024;
/// A commit costs the writer some 0.4 ms beyond its rows (the log's pages, the tables' last
/// pages written again): every 400 ms instead of 200 took an eighth off the writer's CPU an
/// event in the step bench. A dump waits for its message to be stored: messages commit at once.
const COMMIT_EVERY: Duration = Duration::from_millis(400);
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
    /// Calls read after their process's end was acted on: stored, not in the live figures.
    pub after_end: Vec<Call>,
    /// Processes whose call sites the registry forgot again after such a call.
    pub sites_done: Vec<u32>,
    /// Every followed process's state after the calls above (and all before): stored as a
    /// keyframe once they are committed (with the time of the latest call it includes).
    pub keyframe: Option<(i64, Vec<ProcessState>)>,
    /// The whole-run series' rows (never evicted), and what tracer did not see.
    pub series: Vec<SeriesRow>,
    pub gaps: Vec<GapRow>,
    /// Threads' devices learned for calls stored without one (wall-clock times).
    pub learned: Vec<crate::model::devices::Learned>,
    /// What NVML said of each GPU.
    pub gpu_samples: Vec<crate::model::GpuSample>,
}

impl Delivery {
    /// Whether anything waits to be stored.
    fn has_rows(&self) -> bool {
        !self.calls.is_empty()
            || !self.after_end.is_empty()
            || !self.offcpu.is_empty()
            || !self.messages.is_empty()
            || !self.series.is_empty()
            || !self.gaps.is_empty()
            || !self.learned.is_empty()
            || !self.gpu_samples.is_empty()
            || self.keyframe.is_some()
            || !self.exited.is_empty()
    }

    /// Adds `more` to what waits for the next commit. Its new call sites are stored at once and
    /// its calls made to point at the stored ids.
    fn absorb(
        &mut self,
        mut more: Delivery,
        sites: &mut SiteWriter,
        store: &mut Store,
        session: i64,
    ) -> Result<()> {
        sites.store(store, session, &more.sites)?;
        for c in more.calls.iter_mut().chain(more.after_end.iter_mut()) {
            // Written only where there is one: the calls arrive from another core.
            if let Some(local) = c.stack {
                c.stack = sites.stored_id(c.pid, local);
            }
        }
        // Moved in bulk: a call at a time, the copies were a tenth of the writer's time.
        self.calls.append(&mut more.calls);
        self.calls.append(&mut more.after_end);
        // Their sites are forgotten once the keyframe holding their last state is stored.
        self.exited.extend(more.exited);
        self.sites_done.extend(more.sites_done);
        self.processes.extend(more.processes);
        self.offcpu.extend(more.offcpu);
        self.messages.extend(more.messages);
        self.series.extend(more.series);
        self.gaps.extend(more.gaps);
        self.learned.extend(more.learned);
        self.gpu_samples.extend(more.gpu_samples);
        if more.keyframe.is_some() {
            self.keyframe = more.keyframe;
        }
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
    mut dumps: Option<super::dump::OomWatch>,
) -> (Store, Result<()>) {
    // This thread only writes the database: all of it as the invoking user (files SQLite
    // creates later, such as a new -wal, are theirs and only where they could create them).
    let _as_user = crate::paths::act_as(opts.owner);
    let result = (|| -> Result<()> {
        if let Some(max) = opts.max_db {
            store.limit_log(max)?;
        }
        // What waits for the next commit: calls, processes and off-CPU records (sites are
        // stored as they arrive, before the calls that point at them).
        let mut pending = Delivery::default();
        let mut threads_seen: SeededSet<(u32, u32)> = SeededSet::default();
        let mut site_writer = SiteWriter::default();
        let mut last_commit = Instant::now();
        let mut last_housekeeping = Instant::now();
        let mut ended: Vec<u32> = Vec::new();
        let mut keyframes_seen = 0;
        loop {
            let disconnected = match rx.recv_timeout(Duration::from_millis(50)) {
                Ok(first) => {
                    pending.absorb(first, &mut site_writer, &mut store, opts.session)?;
                    while pending.keyframe.is_none() && pending.calls.len() < COMMIT_ROWS {
                        let Ok(more) = rx.try_recv() else { break };
                        pending.absorb(more, &mut site_writer, &mut store, opts.session)?;
                    }
                    false
                }
                Err(RecvTimeoutError::Timeout) => false,
                Err(RecvTimeoutError::Disconnected) => true,
            };
            let due = disconnected
                || pending.keyframe.is_some()
                || !pending.messages.is_empty()
                || pending.calls.len() >= COMMIT_ROWS
                || last_commit.elapsed() >= COMMIT_EVERY;
            if due && pending.has_rows() {
                if let Some(watch) = dumps.as_mut() {
                    watch.note(&pending.processes);
                }
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
                store.write_series(opts.session, &pending.series, &pending.gaps)?;
                store.learn_devices(opts.session, &pending.learned)?;
                store.write_gpu_samples(opts.session, &pending.gpu_samples)?;
                shared.events_stored.fetch_add(
                    (pending.calls.len() + pending.messages.len()) as u64,
                    Ordering::SeqCst,
                );
                // Stored: the OOMs' evidence may be read now.
                if let Some(watch) = dumps.as_mut() {
                    watch.stored(
                        &pending.calls,
                        &pending.messages,
                        opts.wall_offset_ns,
                        shared,
                    );
                }
                // Right after the calls it includes: the keyframe covers exactly the blocks
                // stored so far.
                ended.append(&mut pending.exited);
                ended.append(&mut pending.sites_done);
                if let Some((ts_ns, states)) = pending.keyframe.take() {
                    let started = thread_cpu_ns();
                    let states = keyframe_states(states, &site_writer)?;
                    store.insert_keyframe(opts.session, ts_ns, &states)?;
                    shared.keyframes.fetch_add(1, Ordering::SeqCst);
                    shared.keyframe_cpu_since(started);
                }
                // An ended process's last state goes in the next keyframe, with its call sites:
                // they are forgotten once it is stored (or, without keyframes, soon).
                if shared.keyframes.load(Ordering::SeqCst) > keyframes_seen
                    || ended.len() > ENDED_SITES_KEPT
                {
                    keyframes_seen = shared.keyframes.load(Ordering::SeqCst);
                    for pid in ended.drain(..) {
                        site_writer.forget_process(pid);
                    }
                }
                // The calls' room is kept: grown afresh each commit, its copies and first
                // touches of new pages were a tenth of the writer's time.
                let mut calls = std::mem::take(&mut pending.calls);
                calls.clear();
                pending = Delivery {
                    calls,
                    ..Delivery::default()
                };
                last_commit = Instant::now();
            }
            if let Some(watch) = dumps.as_mut() {
                // At the end no retry can follow: every failure left is settled as it stands.
                let now = if disconnected {
                    u64::MAX
                } else {
                    super::arming::monotonic_ns()
                };
                watch.due(now, opts.wall_offset_ns, shared);
            }
            let found = shared
                .discovery
                .lock()
                .map(|mut f| std::mem::take(&mut f.rows))
                .unwrap_or_default();
            if !found.is_empty() {
                store.write_discovery(opts.session, &found)?;
            }
            let every = if opts.max_db.is_some() {
                Duration::from_millis(250)
            } else {
                Duration::from_secs(1)
            };
            if last_housekeeping.elapsed() >= every || disconnected {
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

/// The states as stored: call sites by their stored ids (the registry knows them by ids local
/// to the recording), encoded.
fn keyframe_states(states: Vec<ProcessState>, sites: &SiteWriter) -> Result<Vec<KeyframeState>> {
    states
        .into_iter()
        .map(|mut s| {
            let pid = s.pid;
            s.layout.map_stacks(|id| {
                if i64::from(id) < LOCAL_SITE_BASE {
                    // Stored already (taken up from an earlier session).
                    return Some(id);
                }
                sites
                    .stored_id(pid, i64::from(id))
                    .and_then(|id| u32::try_from(id).ok())
            });
            Ok(KeyframeState {
                pid,
                start_time_ns: s.start_time_ns,
                data: s.encode()?,
            })
        })
        .collect()
}

/// Threads seen for the first time in `calls`, with their names.
fn new_threads(calls: &[Call], seen: &mut SeededSet<(u32, u32)>) -> Vec<(u32, u32, String)> {
    let mut threads = Vec::new();
    // Calls come in runs from one thread: the set is asked once a run.
    let mut last = None;
    for call in calls {
        if last == Some((call.pid, call.tid)) {
            continue;
        }
        last = Some((call.pid, call.tid));
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
        let eviction = store.enforce_max_size(opts.session, max)?;
        if eviction.need_keyframe {
            shared.keyframe_wanted.store(true, Ordering::SeqCst);
        }
        if let Some(over) = eviction.over_while_held {
            if !shared.told_log_held.swap(true, Ordering::SeqCst) {
                eprintln!(
                    "tracer: --max-db: a reader (explain, query, a backup) holds the database's log, which cannot shrink until it lets go: {over} bytes over --max-db for now"
                );
            }
        }
        for note in eviction.notes {
            log::info!("{note}");
            if note.starts_with(SESSION_DELETED) {
                eprintln!("tracer: {note}");
                shared.sessions_evicted.fetch_add(1, Ordering::SeqCst);
                store.append_note(opts.session, &note)?;
            }
        }
    }
    shared.db_bytes.store(store.footprint()?, Ordering::SeqCst);
    Ok(())
}

#[cfg(test)]
mod tests {
    use tracer_common::Op;

    use super::*;

    fn call(pid: u32, tid: u32) -> Call {
        Call {
            ts_mono_ns: 1,
            pid,
            tid,
            op: Op::TorchMalloc,
            device: Some(0),
            ret: 0,
            duration_ns: 1,
            size: Some(512),
            ptr: Some(0x1000),
            aux0: 0,
            aux1: 0,
            flags: 0,
            comm: format!("t{tid}"),
            site: None,
            stack: None,
        }
    }

    /// Each thread once, named by its first call, in runs or interleaved, across batches.
    #[test]
    fn each_new_thread_is_named_once() {
        let mut seen = SeededSet::default();
        let batch = [
            call(1, 1),
            call(1, 1),
            call(1, 2),
            call(1, 1),
            call(2, 2),
            call(1, 2),
        ];
        let threads = new_threads(&batch, &mut seen);
        assert_eq!(
            threads,
            [
                (1, 1, "t1".to_string()),
                (1, 2, "t2".to_string()),
                (2, 2, "t2".to_string())
            ]
        );
        let threads = new_threads(&[call(1, 2), call(1, 3), call(1, 3)], &mut seen);
        assert_eq!(threads, [(1, 3, "t3".to_string())]);
    }
}
