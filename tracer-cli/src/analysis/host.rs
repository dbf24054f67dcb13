//! Host context: the time a thread spent off the CPU during its own slow calls. A host factor
//! counts only where it overlaps the calls themselves, not merely the same window.

use std::collections::HashMap;

use super::Event;
use crate::units::format_ns as t;

/// One interval a traced thread spent off the CPU (wall-clock ns).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OffSlice {
    pub tid: u32,
    pub off_ns: i64,
    pub on_ns: i64,
    /// When it was woken, if it had blocked.
    pub wakeup_ns: Option<i64>,
    /// It left the CPU runnable (preempted).
    pub preempted: bool,
}

#[derive(Clone, Debug, Default)]
pub struct Host {
    by_tid: HashMap<u32, Vec<OffSlice>>,
    /// The scheduler was traced in this session.
    pub recorded: bool,
}

/// Off-CPU time overlapping some calls, and the part of it spent runnable, waiting for a CPU.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Overlap {
    pub calls: u64,
    pub call_ns: u64,
    pub off_cpu_ns: u64,
    pub run_queue_ns: u64,
}

fn overlap(a: (i64, i64), b: (i64, i64)) -> u64 {
    (a.1.min(b.1) - a.0.max(b.0)).max(0) as u64
}

impl Host {
    pub fn new(mut slices: Vec<OffSlice>, recorded: bool) -> Host {
        slices.sort_by_key(|s| (s.tid, s.off_ns));
        let mut by_tid: HashMap<u32, Vec<OffSlice>> = HashMap::new();
        for s in slices {
            by_tid.entry(s.tid).or_default().push(s);
        }
        Host { by_tid, recorded }
    }

    /// How long the calls' own threads were off the CPU while the calls ran.
    pub fn during(&self, calls: &[&Event]) -> Overlap {
        let mut o = Overlap::default();
        for e in calls {
            o.calls += 1;
            o.call_ns += e.duration_ns;
            let Some(slices) = self.by_tid.get(&e.tid) else {
                continue;
            };
            let span = (e.ts_ns, e.end_ns());
            let first = slices.partition_point(|s| s.on_ns <= span.0);
            for s in slices[first..].iter().take_while(|s| s.off_ns < span.1) {
                o.off_cpu_ns += overlap((s.off_ns, s.on_ns), span);
                let waiting_from = if s.preempted {
                    Some(s.off_ns)
                } else {
                    s.wakeup_ns
                };
                if let Some(from) = waiting_from {
                    o.run_queue_ns += overlap((from, s.on_ns), span);
                }
            }
        }
        o
    }

    /// A compounding factor for `calls` when their threads waited for a CPU during a real share
    /// of them (10%).
    pub fn compounding(&self, calls: &[&Event], what: &str) -> Option<String> {
        let o = self.during(calls);
        if o.call_ns == 0 || o.run_queue_ns * 10 < o.call_ns {
            return None;
        }
        Some(format!(
            "CPU contention: during the {} {what} their own threads waited {} for a CPU ({:.0}% of the {} they took; {} off the CPU in all) - other runnable work, such as DataLoader workers, competed for the cores",
            o.calls,
            t(o.run_queue_ns),
            o.run_queue_ns as f64 * 100.0 / o.call_ns as f64,
            t(o.call_ns),
            t(o.off_cpu_ns)
        ))
    }
}
