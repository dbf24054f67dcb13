//! What the recording's threads share: the stop flag, the live statistics and the counters.

use std::sync::{
    atomic::{AtomicBool, AtomicU64, Ordering},
    Mutex, MutexGuard,
};

use tracer_common::maps::Counter;

use crate::{
    model::{figures::Figures, live::LiveAllocators, stats::LiveStats},
    store::SessionCounters,
};

/// What the recording's threads share.
/// What the registry and the main thread hand each other.
#[derive(Debug, Default)]
pub struct ArmingQueue {
    /// Decisions to carry out (registry -> main thread).
    pub requests: Vec<crate::model::arming::Decision>,
    /// Marks to hand on (main thread -> registry), each before any call made after it.
    pub marks: Vec<crate::decode::Call>,
    /// Whether each arming took (pid, armed, monotonic ns).
    pub results: Vec<(u32, bool, u64)>,
    /// Root asked to arm (true) or to stop asking (false): SIGUSR1, SIGUSR2.
    pub on_demand: Option<bool>,
}

#[derive(Default)]
pub struct Shared {
    /// `--allocator auto`: decisions, marks and results between the registry and the main
    /// thread (record/arming.rs).
    pub arming: Mutex<ArmingQueue>,
    /// Processes whose allocator probes are armed now, armings and disarmings so far.
    pub armed_now: AtomicU64,
    pub armings: AtomicU64,
    pub disarmings: AtomicU64,
    /// Time the main thread spent raising and lowering semaphores (ns).
    pub arming_ns: AtomicU64,
    pub stop: AtomicBool,
    pub live: Mutex<LiveStats>,
    /// Each process's allocator layout, rebuilt as its calls arrive (the live table).
    pub allocators: Mutex<LiveAllocators>,
    /// Each process's calls, failures and warnings (the metrics endpoint).
    pub figures: Mutex<Figures>,
    /// The database's size and the sessions --max-db deleted, as the writer last saw them.
    pub db_bytes: AtomicU64,
    pub sessions_evicted: AtomicU64,
    /// The user was told that a reader held the log past --max-db (once a session).
    pub told_log_held: AtomicBool,
    /// --max-db can evict calls only up to a keyframe: the writer asks the registry for one.
    pub keyframe_wanted: std::sync::atomic::AtomicBool,
    /// Keyframes stored, and the CPU time the registry and the writer spent making and storing
    /// them (what keyframes cost, counted where it is spent).
    pub keyframes: AtomicU64,
    pub keyframe_cpu_ns: AtomicU64,
    pub events_read: AtomicU64,
    pub events_stored: AtomicU64,
    /// OOMs --dump-on-oom's queue had no room for.
    pub dumps_skipped: AtomicU64,
    pub decode_errors: AtomicU64,
    /// Events read after events made later than them had been handed over.
    pub events_late: AtomicU64,
    /// Events read from the stages' map at the end (a stage the last flush found busy, a CPU
    /// gone offline): submitted to tracer, though not through the ring the kernel counts.
    pub taken_from_stages: AtomicU64,
    /// Allocations whose size userspace could not keep (too many live): their frees lack one.
    pub allocs_not_tracked: AtomicU64,
    /// Early warnings that did not run --on-warning's command (one running, or too soon).
    pub on_warning_skipped: AtomicU64,
    /// The libraries probed, as (dev, inode): a process that maps one is traced, and only a
    /// traced process's memory is read (its interpreter, --stack).
    pub probed_files: Mutex<std::collections::HashSet<(u64, u64)>>,
    /// Entries left at the end in the kernel maps the registry holds (SCHED_TIDS, PY_PROCS).
    pub registry_maps: Mutex<Vec<(&'static str, u64)>>,
    /// Calls of Python processes made before tracer registered their interpreter (no Python
    /// frames).
    pub calls_before_interpreter: AtomicU64,
    /// Side-band records of processes' mappings the kernel could not write (--stack).
    pub mappings_lost: AtomicU64,
    /// The kernel counters as last read (for the writer's periodic session updates).
    pub kernel: Mutex<[u64; Counter::COUNT as usize]>,
    /// Discovery's findings: processes found late (for the registry), rows (for the writer).
    pub discovery: Mutex<crate::model::discovery::Found>,
}

/// CPU time the calling thread has used (ns): what one stage of the recording costs.
pub fn thread_cpu_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes one timespec we own; this clock exists on every Linux.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    if rc != 0 {
        return 0;
    }
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

impl Shared {
    /// The layouts' lock. Taken before the figures' whenever both are held (the registry,
    /// applying calls), so that the two are always taken in one order.
    pub fn lock_allocators(&self) -> anyhow::Result<MutexGuard<'_, LiveAllocators>> {
        self.allocators
            .lock()
            .map_err(|_| anyhow::anyhow!("the live layouts' lock is poisoned"))
    }

    /// The figures' lock (the metrics endpoint's): after [`Shared::lock_allocators`] when both
    /// are held.
    pub fn lock_figures(&self) -> anyhow::Result<MutexGuard<'_, Figures>> {
        self.figures
            .lock()
            .map_err(|_| anyhow::anyhow!("the live figures' lock is poisoned"))
    }

    /// Counts the CPU time spent on keyframes since `started` (a [`thread_cpu_ns`] reading).
    pub fn keyframe_cpu_since(&self, started: u64) {
        self.keyframe_cpu_ns
            .fetch_add(thread_cpu_ns().saturating_sub(started), Ordering::Relaxed);
    }

    pub fn counters(&self, kernel: &[u64; Counter::COUNT as usize]) -> SessionCounters {
        SessionCounters {
            entries: kernel[Counter::Entries as usize],
            submitted: kernel[Counter::Submitted as usize]
                + self.taken_from_stages.load(Ordering::SeqCst),
            dropped_ring_full: kernel[Counter::RingFull as usize],
            unmatched_returns: kernel[Counter::UnmatchedReturns as usize],
            alloc_map_full: kernel[Counter::AllocMapFull as usize]
                + self.allocs_not_tracked.load(Ordering::SeqCst),
            inflight_full: kernel[Counter::InflightFull as usize],
            events_read: self.events_read.load(Ordering::SeqCst),
            events_stored: self.events_stored.load(Ordering::SeqCst),
            decode_errors: self.decode_errors.load(Ordering::SeqCst),
            offcpu_submitted: kernel[Counter::SchedSubmitted as usize],
            offcpu_dropped: kernel[Counter::SchedRingFull as usize],
            tail_call_failed: kernel[Counter::TailCallFailed as usize],
            map_insert_failed: kernel[Counter::MapInsertFailed as usize],
            calls_abandoned: kernel[Counter::CallsAbandoned as usize],
            calls_before_interpreter: self.calls_before_interpreter.load(Ordering::SeqCst),
            mappings_lost: self.mappings_lost.load(Ordering::SeqCst),
            events_late: self.events_late.load(Ordering::SeqCst),
        }
    }
}
