//! The whole run, always: per process and device, one row per interval of [`INTERVAL_NS`] with
//! the allocator's figures (highest allocated, reserved and cached, lowest largest free block,
//! highest fragmentation), the largest request, the device's lowest free memory, the calls and
//! their latency quantiles per op, failures, OOMs, retries and early warnings. The recording
//! keeps it as calls arrive and stores each row once its interval is over; --max-db never
//! evicts it (a row is 200 to 400 bytes: 8,640 a day per process and device, 2 to 3.5 MB).

use std::collections::BTreeMap;

use tracer_common::{Op, OpClass};

use super::{
    attempts::{Attempt, Attempts},
    live::SeriesFigures,
    stats::Histogram,
    Event, FastMap,
};
use serde::{Deserialize, Serialize};

/// An interval of the series, aligned on the wall clock.
pub const INTERVAL_NS: i64 = 10_000_000_000;

/// An interval is over once a call this much later than its end came in (calls reach the
/// registry 10-20 ms after they are made, later when it falls behind) ...
const LATE_NS: i64 = 2_000_000_000;
/// ... or, when no call comes, once the wall clock is this far past its end.
const IDLE_NS: i64 = 60_000_000_000;

/// One process's figures on one device over one interval of the series.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct SeriesRow {
    pub pid: u32,
    pub device: i32,
    pub start_ns: i64,
    pub end_ns: i64,
    /// The interval's highest allocated, reserved and cached bytes (cached: reserved less
    /// allocated), its lowest largest free block, its highest fragmentation.
    pub allocated: u64,
    pub reserved: u64,
    pub cached: u64,
    pub largest_free: u64,
    pub fragmentation: f64,
    pub largest_request: u64,
    /// The device's lowest free memory (cudaMemGetInfo, kept current), when known.
    pub device_free: Option<u64>,
    pub calls: u64,
    pub errors: u64,
    /// Failed device allocations, PyTorch's out-of-memory errors, allocations retried after
    /// the cache was released, early warnings.
    pub failures: u64,
    pub ooms: u64,
    pub retries: u64,
    pub warnings: u64,
    /// Per op: (name, calls, errors, p50 ns, p99 ns, max ns).
    pub ops: Vec<OpFigures>,
}

/// One op's calls in an interval of the series.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct OpFigures {
    pub op: String,
    pub calls: u64,
    pub errors: u64,
    pub p50_ns: u64,
    pub p99_ns: u64,
    pub max_ns: u64,
}

/// A span of a process's life tracer did not see.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct GapRow {
    pub pid: u32,
    /// From when (None: the process's start is not known).
    pub from_ns: Option<i64>,
    pub to_ns: i64,
    /// `before_trace`: the process ran before tracer started; `restart`: between an earlier
    /// session's last call of it and this session (its state was taken up from a keyframe);
    /// `found_late`: it opened a CUDA library before tracer had probed it (record/discovery.rs).
    pub kind: String,
    pub detail: String,
}

impl GapRow {
    /// The process ran unseen until `to_ns`: before the trace, or with its library not yet
    /// probed (found late); its allocator is seen from then, as if the trace began there.
    pub fn unseen_start(&self) -> bool {
        self.kind == "before_trace" || self.kind == "found_late"
    }
}

/// Blocks --max-db deleted between two kept parts of a session (SCHEMA.md, `holes`): a walk
/// that reaches one resumes at the keyframe after `through_block`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Hole {
    #[serde(skip)]
    pub after_block: i64,
    #[serde(skip)]
    pub through_block: i64,
    /// The first and last call deleted (wall ns).
    pub from_ns: i64,
    pub to_ns: i64,
    /// Calls and block events deleted.
    pub calls: i64,
}

/// Detail --max-db kept around incidents (SCHEMA.md, `kept`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct KeptRow {
    pub from_ns: i64,
    pub to_ns: i64,
    /// The incidents: OOM, failed allocation, early warning.
    pub reason: String,
}

#[derive(Default)]
struct Interval {
    start_ns: i64,
    allocated: u64,
    reserved: u64,
    cached: u64,
    largest_free: Option<u64>,
    fragmentation: f64,
    largest_request: u64,
    device_free: Option<u64>,
    calls: u64,
    errors: u64,
    failures: u64,
    ooms: u64,
    retries: u64,
    warnings: u64,
    ops: BTreeMap<Op, (u64, u64, Histogram)>,
}

/// The series being kept, and the rows whose interval is over.
#[derive(Default)]
pub struct RunSeries {
    open: BTreeMap<(u32, i32), Interval>,
    closed: Vec<SeriesRow>,
    /// Per (pid, device): where the interval after the last one stored starts. A call later
    /// than that row counts in the next interval: one row per interval, however late calls
    /// come.
    next_start: FastMap<(u32, i32), i64>,
    /// The latest call taken in.
    latest_ns: i64,
    /// Device allocations as PyTorch counts them (failures and retries).
    attempts: Attempts,
}

fn interval_start(ts_ns: i64) -> i64 {
    ts_ns.div_euclid(INTERVAL_NS) * INTERVAL_NS
}

impl RunSeries {
    /// The interval of (pid, device) holding `ts_ns`; the one before it, if any, is over.
    fn interval(&mut self, pid: u32, device: i32, ts_ns: i64) -> &mut Interval {
        let key = (pid, device);
        self.latest_ns = self.latest_ns.max(ts_ns);
        // Nearly always the open interval holds the call: two look-ups, not three (an open
        // interval never starts before its key's next start).
        let fresh = interval_start(ts_ns);
        let open_start = self.open.get(&key).map(|i| i.start_ns);
        let mut start = fresh;
        if open_start.is_none_or(|s| s < fresh) {
            start = fresh.max(self.next_start.get(&key).copied().unwrap_or(i64::MIN));
            if open_start.is_some_and(|s| s < start) {
                self.close(key);
            }
        }
        self.open.entry(key).or_insert_with(|| Interval {
            start_ns: start,
            ..Interval::default()
        })
    }

    /// Takes in one call (after the live layouts applied it): `figures` are the process's on
    /// the call's device now, when it has memory there.
    pub fn apply(&mut self, e: &Event, figures: Option<SeriesFigures>, device_free: Option<i64>) {
        let device = e.device.max(-1);
        let spec = e.op.spec();
        let mut decided = Vec::new();
        self.attempts.push(e, &mut |a| decided.push(a));
        for a in &decided {
            self.count_attempt(a);
        }
        let i = self.interval(e.pid, device, e.ts_ns);
        i.calls += 1;
        let op = i.ops.entry(e.op).or_default();
        op.0 += 1;
        op.2.add(e.duration_ns);
        if e.ret != 0 {
            i.errors += 1;
            op.1 += 1;
        }
        if matches!(spec.class, OpClass::BlockAlloc | OpClass::Alloc) && e.ret == 0 {
            i.largest_request = i.largest_request.max(e.size);
        }
        if let Some(f) = figures {
            i.allocated = i.allocated.max(f.stats.allocated);
            i.reserved = i.reserved.max(f.stats.reserved);
            i.cached = i.cached.max(f.stats.cached());
            if f.blocks {
                i.largest_free = Some(
                    i.largest_free
                        .map_or(f.stats.largest_free, |l| l.min(f.stats.largest_free)),
                );
                i.fragmentation = i.fragmentation.max(f.fragmentation);
            }
        }
        if let Some(free) = device_free {
            let free = free.max(0) as u64;
            i.device_free = Some(i.device_free.map_or(free, |d| d.min(free)));
        }
    }

    /// An early warning on the process's device.
    pub fn warned(&mut self, pid: u32, device: i32, ts_ns: i64) {
        self.interval(pid, device.max(-1), ts_ns).warnings += 1;
    }

    /// PyTorch raised its out-of-memory error.
    pub fn oom(&mut self, pid: u32, device: i32, ts_ns: i64) {
        self.interval(pid, device.max(-1), ts_ns).ooms += 1;
    }

    fn close(&mut self, key: (u32, i32)) {
        if let Some(done) = self.open.remove(&key) {
            self.next_start.insert(key, done.start_ns + INTERVAL_NS);
            self.closed.push(row(key.0, key.1, done));
        }
    }

    /// The rows whose interval is over at the wall clock's `now_ns` (all, with i64::MAX): a
    /// call [`LATE_NS`] past its end came in, or none did for [`IDLE_NS`].
    pub fn take_closed(&mut self, now_ns: i64) -> Vec<SeriesRow> {
        let over_at = (self.latest_ns - LATE_NS).max(now_ns.saturating_sub(IDLE_NS));
        let over: Vec<(u32, i32)> = self
            .open
            .iter()
            .filter(|(_, i)| now_ns == i64::MAX || i.start_ns + INTERVAL_NS <= over_at)
            .map(|(&k, _)| k)
            .collect();
        for key in over {
            self.close(key);
        }
        std::mem::take(&mut self.closed)
    }

    /// A process ended: its open rows are over.
    pub fn exited(&mut self, pid: u32) {
        let mut decided = Vec::new();
        self.attempts.finish_process(pid, &mut |a| decided.push(a));
        for a in &decided {
            self.count_attempt(a);
        }
        let keys: Vec<(u32, i32)> = self
            .open
            .range((pid, i32::MIN)..=(pid, i32::MAX))
            .map(|(&k, _)| k)
            .collect();
        for key in keys {
            self.close(key);
        }
        self.next_start.retain(|&(p, _), _| p != pid);
    }

    /// A decided allocation attempt, counted in the interval of its call.
    fn count_attempt(&mut self, a: &Attempt) {
        let e = &a.event;
        let i = self.interval(e.pid, e.device.max(-1), e.ts_ns);
        i.retries += u64::from(a.retry);
        i.failures += u64::from(a.failed);
    }
}

fn row(pid: u32, device: i32, i: Interval) -> SeriesRow {
    SeriesRow {
        pid,
        device,
        start_ns: i.start_ns,
        end_ns: i.start_ns + INTERVAL_NS,
        allocated: i.allocated,
        reserved: i.reserved,
        cached: i.cached,
        largest_free: i.largest_free.unwrap_or(0),
        fragmentation: i.fragmentation,
        largest_request: i.largest_request,
        device_free: i.device_free,
        calls: i.calls,
        errors: i.errors,
        failures: i.failures,
        ooms: i.ooms,
        retries: i.retries,
        warnings: i.warnings,
        ops: i
            .ops
            .into_iter()
            .map(|(op, (calls, errors, h))| OpFigures {
                op: op.name().to_owned(),
                calls,
                errors,
                p50_ns: h.quantile(0.5),
                p99_ns: h.quantile(0.99),
                max_ns: h.quantile(1.0),
            })
            .collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn call(ts_ns: i64) -> Event {
        Event {
            ts_ns,
            duration_ns: 1_000,
            pid: 7,
            tid: 7,
            ..crate::model::layout::tests::ev(Op::CudaMalloc, 0x1000, 4096)
        }
    }

    /// Calls reaching the series 5 s after they were made (a recording behind the job), some
    /// later still, and the rows taken every 250 ms of wall clock: one row per interval, every
    /// call counted once.
    #[test]
    fn calls_arriving_late_make_one_row_per_interval() {
        let mut series = RunSeries::default();
        let mut rows = Vec::new();
        let base = 1_800_000_000_000_000_000i64;
        let lag = 5_000_000_000;
        let mut ts = base;
        let mut calls = 0;
        while ts < base + 60_000_000_000 {
            series.apply(&call(ts), None, None);
            // Every 97th call comes 3 s later than the rest.
            if calls % 97 == 0 {
                series.apply(&call(ts - 3_000_000_000), None, None);
                calls += 1;
            }
            calls += 1;
            if calls % 25 == 0 {
                rows.extend(series.take_closed(ts + lag));
            }
            ts += 10_000_000;
        }
        rows.extend(series.take_closed(i64::MAX));
        let starts: Vec<i64> = rows.iter().map(|r| r.start_ns).collect();
        let mut unique = starts.clone();
        unique.sort();
        unique.dedup();
        assert_eq!(starts.len(), unique.len(), "{starts:?}");
        assert_eq!(rows.len(), 6);
        assert_eq!(rows.iter().map(|r| r.calls).sum::<u64>(), calls);
    }
}
