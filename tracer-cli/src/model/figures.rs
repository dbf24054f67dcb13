//! What each traced process's calls add up to, for the metrics endpoint: calls, errors, bytes
//! and a latency histogram per op; out-of-memory errors, failed allocations, the allocator's
//! retries and early warnings per device. Kept while the process lives and for a grace period
//! after it ends, so a series neither vanishes before its last scrape nor lives forever.

use std::{
    collections::BTreeMap,
    time::{Duration, Instant},
};

use tracer_common::{Op, OpClass};

use super::{
    attempts::{Attempt, Attempts},
    Event,
};

/// Upper bounds of the latency buckets, in nanoseconds (1 us to 1 s: CUDA allocation calls
/// take from about a microsecond, cached, to hundreds of milliseconds, synchronizing).
pub const LATENCY_BOUNDS_NS: [u64; 17] = [
    1_000,
    5_000,
    10_000,
    25_000,
    50_000,
    100_000,
    250_000,
    500_000,
    1_000_000,
    2_500_000,
    5_000_000,
    10_000_000,
    25_000_000,
    50_000_000,
    100_000_000,
    250_000_000,
    1_000_000_000,
];

/// Calls of one op.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct OpFigures {
    pub calls: u64,
    pub errors: u64,
    /// Bytes of successful allocations or frees.
    pub bytes: u64,
    /// Calls per latency bucket (not cumulative; the last is above every bound).
    pub buckets: [u64; LATENCY_BOUNDS_NS.len() + 1],
    pub duration_sum_ns: u64,
}

/// What happened on one device.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct DeviceFigures {
    /// PyTorch raised OutOfMemoryError (its probe at the exception's constructor, whose
    /// message arrives as a message, not a call).
    pub ooms: u64,
    /// Device allocations refused for want of memory, each attempt once (model/attempts.rs).
    pub alloc_failures: u64,
    /// Failed allocations the allocator retried after releasing its cache.
    pub retries: u64,
    /// Early warnings: the allocator reached the state in which its next request fails.
    pub warnings: u64,
    /// OOMs explained (by --dump-on-oom's explain), per verdict.
    pub verdicts: BTreeMap<String, u64>,
}

/// Where a process runs in Kubernetes, from its cgroup.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PodRef {
    pub pod_uid: String,
    pub container_id: Option<String>,
}

/// One process's figures.
#[derive(Clone, Debug, Default)]
pub struct ProcessFigures {
    pub pid: u32,
    pub comm: String,
    pub rank: Option<String>,
    pub pod: Option<PodRef>,
    /// Its job and the physical GPU behind each device number.
    pub placement: Option<super::Placement>,
    pub ops: BTreeMap<Op, OpFigures>,
    pub devices: BTreeMap<i32, DeviceFigures>,
    /// When it ended (its series go after the grace period).
    pub ended: Option<Instant>,
}

/// Every traced process's figures.
#[derive(Clone, Debug, Default)]
pub struct Figures {
    processes: BTreeMap<u32, ProcessFigures>,
    /// Device allocations as PyTorch counts them (failures and retries).
    attempts: Attempts,
    /// Nothing reads them (no --metrics): the event path skips them.
    disabled: bool,
}

impl Figures {
    /// Figures that stay empty: every update returns at once.
    pub fn disabled() -> Figures {
        Figures {
            disabled: true,
            ..Figures::default()
        }
    }

    /// A process seen for the first time (its /proc facts).
    pub fn describe(
        &mut self,
        pid: u32,
        comm: &str,
        rank: Option<String>,
        pod: Option<PodRef>,
        placement: super::Placement,
    ) {
        if self.disabled {
            return;
        }
        let p = self.processes.entry(pid).or_default();
        if p.ended.is_some() {
            // A new process reusing the pid of one still in its grace period.
            *p = ProcessFigures::default();
        }
        p.pid = pid;
        p.comm = comm.to_owned();
        p.rank = rank;
        p.pod = pod;
        p.placement = Some(placement);
    }

    /// One call of a process (in the order its calls happened).
    pub fn apply(&mut self, e: &Event) {
        if self.disabled {
            return;
        }
        let p = self
            .processes
            .entry(e.pid)
            .or_insert_with(|| ProcessFigures {
                pid: e.pid,
                ..ProcessFigures::default()
            });
        let o = p.ops.entry(e.op).or_default();
        o.calls += 1;
        let spec = e.op.spec();
        if e.ret != 0 {
            o.errors += 1;
        } else if matches!(spec.class, OpClass::Alloc | OpClass::Free) {
            o.bytes += e.size;
        }
        let bucket = LATENCY_BOUNDS_NS
            .iter()
            .position(|&b| e.duration_ns <= b)
            .unwrap_or(LATENCY_BOUNDS_NS.len());
        o.buckets[bucket] += 1;
        o.duration_sum_ns += e.duration_ns;
        let processes = &mut self.processes;
        self.attempts.push(e, &mut |a| count_attempt(processes, &a));
    }

    /// PyTorch raised OutOfMemoryError in a process (the device its message names, see
    /// [`oom_device`]).
    pub fn oom(&mut self, pid: u32, message: &str) {
        if self.disabled {
            return;
        }
        let device = oom_device(message);
        let p = self.processes.entry(pid).or_insert_with(|| ProcessFigures {
            pid,
            ..ProcessFigures::default()
        });
        p.devices.entry(device).or_default().ooms += 1;
    }

    /// explain's verdict on a process's OOM on `device` (--dump-on-oom).
    pub fn oom_verdict(&mut self, pid: u32, device: i32, verdict: &str) {
        if self.disabled {
            return;
        }
        if let Some(p) = self.processes.get_mut(&pid) {
            *p.devices
                .entry(device)
                .or_default()
                .verdicts
                .entry(verdict.to_owned())
                .or_default() += 1;
        }
    }

    /// An early warning fired for a process's device.
    pub fn warned(&mut self, pid: u32, device: i32) {
        if self.disabled {
            return;
        }
        if let Some(p) = self.processes.get_mut(&pid) {
            p.devices.entry(device.max(-1)).or_default().warnings += 1;
        }
    }

    /// A process ended: its figures stay until [`Figures::expire`] finds them older than the
    /// grace period.
    pub fn exited(&mut self, pid: u32, now: Instant) {
        let processes = &mut self.processes;
        self.attempts
            .finish_process(pid, &mut |a| count_attempt(processes, &a));
        if let Some(p) = self.processes.get_mut(&pid) {
            p.ended.get_or_insert(now);
        }
    }

    /// Drops the processes that ended more than `grace` ago.
    pub fn expire(&mut self, now: Instant, grace: Duration) {
        self.processes
            .retain(|_, p| p.ended.is_none_or(|t| now.duration_since(t) < grace));
    }

    pub fn processes(&self) -> impl Iterator<Item = &ProcessFigures> {
        self.processes.values()
    }

    pub fn get(&self, pid: u32) -> Option<&ProcessFigures> {
        self.processes.get(&pid)
    }

    pub fn len(&self) -> usize {
        self.processes.len()
    }

    pub fn is_empty(&self) -> bool {
        self.processes.is_empty()
    }
}

/// A decided allocation attempt, counted on its device.
fn count_attempt(processes: &mut BTreeMap<u32, ProcessFigures>, a: &Attempt) {
    let Some(p) = processes.get_mut(&a.event.pid) else {
        return;
    };
    let d = p.devices.entry(a.event.device.max(-1)).or_default();
    d.retries += u64::from(a.retry);
    d.alloc_failures += u64::from(a.failed);
}

/// The device PyTorch's out-of-memory message names ("... GPU 0 has a total capacity ..."),
/// or -1.
pub fn oom_device(message: &str) -> i32 {
    message
        .split("GPU ")
        .nth(1)
        .and_then(|rest| rest.split(|c: char| !c.is_ascii_digit()).next())
        .and_then(|n| n.parse::<i32>().ok())
        .unwrap_or(-1)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn call(op: Op, ret: i32, size: u64, ts_ns: i64, duration_ns: u64) -> Event {
        Event {
            ts_ns,
            duration_ns,
            size,
            ptr: 0x1000,
            aux0: 0,
            aux1: 0,
            pid: 9,
            tid: 9,
            ret,
            device: 1,
            stack: None,
            op,
        }
    }

    #[test]
    fn calls_buckets_failures_and_retries() {
        let mut f = Figures::default();
        f.describe(
            9,
            "python3",
            Some("rank 0/2".into()),
            None,
            Default::default(),
        );
        f.apply(&call(Op::CudaMalloc, 0, 1 << 20, 0, 800));
        f.apply(&call(Op::CudaMalloc, 2, 1 << 30, 1_000, 3_000_000));
        f.apply(&call(Op::CudaFree, 0, 1 << 20, 2_000, 20_000));
        // The same size succeeding soon after the failure: a retry.
        f.apply(&call(
            Op::CudaMalloc,
            0,
            1 << 30,
            500_000_000,
            2_000_000_000,
        ));
        f.oom(9, "CUDA out of memory. Tried to allocate 450.00 MiB. GPU 1 has a total capacity of 3.00 GiB");
        f.oom(9, "no device named");
        f.warned(9, 1);
        let p = f.get(9).unwrap();
        let m = &p.ops[&Op::CudaMalloc];
        assert_eq!((m.calls, m.errors, m.bytes), (3, 1, (1 << 20) + (1 << 30)));
        // 800 ns -> the 1 us bucket; 3 ms -> 5 ms; 2 s -> above every bound.
        assert_eq!(m.buckets[0], 1);
        assert_eq!(m.buckets[10], 1);
        assert_eq!(m.buckets[LATENCY_BOUNDS_NS.len()], 1);
        assert_eq!(m.duration_sum_ns, 800 + 3_000_000 + 2_000_000_000);
        let d = &p.devices[&1];
        assert_eq!(
            (d.ooms, d.alloc_failures, d.retries, d.warnings),
            (1, 1, 1, 1)
        );
        assert_eq!(p.devices[&-1].ooms, 1);
        assert_eq!(p.rank.as_deref(), Some("rank 0/2"));
    }

    #[test]
    fn a_success_long_after_a_failure_is_no_retry() {
        let mut f = Figures::default();
        f.apply(&call(Op::CudaMalloc, 2, 4096, 0, 1));
        f.apply(&call(Op::CudaMalloc, 0, 4096, 3_000_000_000, 1));
        f.apply(&call(Op::CudaMalloc, 0, 8192, 3_000_000_001, 1));
        assert_eq!(f.get(9).unwrap().devices[&1].retries, 0);
    }

    #[test]
    fn a_failed_retry_is_one_retry_and_ends_the_request() {
        // Fails, the cache is freed, the retry fails too (PyTorch raises); the next step asks
        // for the same size again: a new request, no retry.
        let mut f = Figures::default();
        f.apply(&call(Op::CudaMalloc, 2, 4096, 0, 1));
        f.apply(&call(Op::CudaFree, 0, 8192, 10, 1));
        f.apply(&call(Op::CudaMalloc, 2, 4096, 20, 1));
        f.apply(&call(Op::CudaMalloc, 0, 4096, 30, 1));
        let d = &f.get(9).unwrap().devices[&1];
        assert_eq!((d.alloc_failures, d.retries), (2, 1));
    }

    #[test]
    fn ended_processes_go_after_the_grace_period() {
        let mut f = Figures::default();
        let t0 = Instant::now();
        f.apply(&call(Op::CudaMalloc, 0, 4096, 0, 1));
        f.exited(9, t0);
        f.expire(t0 + Duration::from_secs(5), Duration::from_secs(10));
        assert_eq!(f.len(), 1);
        f.expire(t0 + Duration::from_secs(11), Duration::from_secs(10));
        assert!(f.is_empty());
        // A pid reused during the grace period starts afresh.
        f.apply(&call(Op::CudaMalloc, 0, 4096, 0, 1));
        f.exited(9, t0);
        f.describe(9, "new", None, None, Default::default());
        assert!(f.get(9).unwrap().ops.is_empty() && f.get(9).unwrap().ended.is_none());
    }

    #[test]
    fn disabled_figures_stay_empty() {
        let mut f = Figures::disabled();
        f.describe(9, "x", None, None, Default::default());
        f.apply(&call(Op::CudaMalloc, 2, 4096, 0, 1));
        f.oom(9, "GPU 0");
        assert!(f.is_empty());
    }
}
