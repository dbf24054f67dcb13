//! Host context: the time a thread spent off the CPU during its own slow calls, and how many
//! threads of its process tree were runnable then. A host factor counts only where it overlaps
//! the calls themselves, not merely the same window.

use std::collections::HashMap;

use super::Event;
use crate::model::{arming::ArmingRow, HostRecord, OffSlice};
use crate::units::format_ns as t;

#[derive(Clone, Debug, Default)]
pub struct Host {
    by_tid: HashMap<u32, Vec<OffSlice>>,
    runnable: HashMap<u32, Runnable>,
    /// The scheduler was traced in this session.
    pub recorded: bool,
    /// Online CPUs of the traced machine, when recorded.
    pub cpus: Option<u32>,
    /// `--allocator auto`: the spans in which each process's threads were followed (while its
    /// allocator probes were armed); None where they were followed throughout. A call outside
    /// them has no host context: it is left out, never counted as one that did not wait.
    followed: Option<HashMap<u32, Vec<(i64, i64)>>>,
}

/// How many threads of one traced process tree were runnable (on a CPU or waiting for one), as
/// a step function of time: `counts[k]` holds from `times[k]` to `times[k + 1]`.
#[derive(Clone, Debug, Default)]
struct Runnable {
    times: Vec<i64>,
    counts: Vec<u32>,
    /// Thread-nanoseconds runnable from `times[0]` to `times[k]`.
    integral: Vec<f64>,
}

impl Runnable {
    /// From each thread's slices in time order: a thread is runnable from the moment it could
    /// run (woken, or preempted while runnable) until it next leaves the CPU.
    fn new(threads: &[&[OffSlice]]) -> Runnable {
        let mut steps: Vec<(i64, i32)> = Vec::new();
        for slices in threads {
            for (i, s) in slices.iter().enumerate() {
                let from = if s.preempted {
                    s.off_ns
                } else {
                    s.wakeup_ns.unwrap_or(s.on_ns).clamp(s.off_ns, s.on_ns)
                };
                let to = slices
                    .get(i + 1)
                    .map_or(s.on_ns, |next| next.off_ns.max(s.on_ns));
                if to > from {
                    steps.push((from, 1));
                    steps.push((to, -1));
                }
            }
        }
        steps.sort_unstable();
        let mut r = Runnable::default();
        let mut count: i64 = 0;
        let mut area = 0.0;
        for (ts, delta) in steps {
            if let (Some(&last_ts), Some(&last_count)) = (r.times.last(), r.counts.last()) {
                area += (ts - last_ts) as f64 * f64::from(last_count);
                if ts == last_ts {
                    r.times.pop();
                    r.counts.pop();
                    r.integral.pop();
                }
            }
            count += i64::from(delta);
            r.times.push(ts);
            r.counts.push(count.max(0) as u32);
            r.integral.push(area);
        }
        r
    }

    /// Thread-nanoseconds runnable up to `ts`.
    fn area_to(&self, ts: i64) -> f64 {
        let k = self.times.partition_point(|&t| t <= ts);
        if k == 0 {
            return 0.0;
        }
        self.integral[k - 1] + (ts - self.times[k - 1]) as f64 * f64::from(self.counts[k - 1])
    }

    /// The most threads runnable at once within `[a, b]`.
    fn peak(&self, a: i64, b: i64) -> u32 {
        let k = self.times.partition_point(|&t| t <= a);
        let at_start = k.checked_sub(1).map_or(0, |k| self.counts[k]);
        self.times[k..]
            .iter()
            .zip(&self.counts[k..])
            .take_while(|(t, _)| **t < b)
            .map(|(_, c)| *c)
            .fold(at_start, u32::max)
    }
}

/// Threads of the calls' process tree runnable while the calls ran.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Crowding {
    /// Average over the calls' time.
    pub mean: f64,
    /// The most at one moment.
    pub peak: u32,
}

/// Off-CPU time overlapping some calls (those whose threads were followed), and the part of
/// it spent runnable, waiting for a CPU.
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
    pub fn new(record: HostRecord) -> Host {
        let HostRecord {
            mut slices,
            recorded,
            cpus,
            while_armed,
        } = record;
        slices.sort_by_key(|s| (s.tid, s.off_ns));
        let mut by_tid: HashMap<u32, Vec<OffSlice>> = HashMap::new();
        for s in slices {
            by_tid.entry(s.tid).or_default().push(s);
        }
        let mut trees: HashMap<u32, Vec<&[OffSlice]>> = HashMap::new();
        for slices in by_tid.values() {
            trees.entry(slices[0].pid).or_default().push(slices);
        }
        let runnable = trees
            .into_iter()
            .map(|(pid, threads)| (pid, Runnable::new(&threads)))
            .collect();
        Host {
            by_tid,
            runnable,
            recorded,
            cpus,
            followed: while_armed.then(HashMap::new),
        }
    }

    /// Whether the scheduler followed a process only while it was armed (`--allocator auto`).
    pub fn while_armed(&self) -> bool {
        self.followed.is_some()
    }

    /// Sets the spans in which each process was followed, from whether it was armed where the
    /// walk began (`armed_from_start`) and its armings and disarmings after, in time order;
    /// only for a session that followed processes while armed.
    pub fn follow_while_armed(&mut self, armed_from_start: &[u32], rows: &[ArmingRow]) {
        let Some(followed) = &mut self.followed else {
            return;
        };
        let mut open: HashMap<u32, i64> = armed_from_start.iter().map(|&p| (p, i64::MIN)).collect();
        for r in rows {
            match (r.armed, open.get(&r.pid).copied()) {
                (true, None) => {
                    open.insert(r.pid, r.ts_ns);
                }
                (false, Some(from)) => {
                    open.remove(&r.pid);
                    followed.entry(r.pid).or_default().push((from, r.ts_ns));
                }
                _ => {}
            }
        }
        for (pid, from) in open {
            followed.entry(pid).or_default().push((from, i64::MAX));
        }
    }

    /// Whether the call's threads were followed for the whole of it.
    pub fn saw(&self, e: &Event) -> bool {
        let Some(followed) = &self.followed else {
            return true;
        };
        followed.get(&e.pid).is_some_and(|spans| {
            spans
                .iter()
                .any(|&(from, to)| from <= e.ts_ns && e.end_ns() <= to)
        })
    }

    /// How many threads of `pid`'s process tree were runnable during `calls`.
    pub fn crowding(&self, pid: u32, calls: &[&Event]) -> Option<Crowding> {
        let r = self.runnable.get(&pid)?;
        let (mut area, mut time, mut peak) = (0.0, 0u64, 0);
        for e in calls.iter().filter(|e| self.saw(e)) {
            area += r.area_to(e.end_ns()) - r.area_to(e.ts_ns);
            time += e.duration_ns;
            peak = peak.max(r.peak(e.ts_ns, e.end_ns()));
        }
        (time > 0).then(|| Crowding {
            mean: area / time as f64,
            peak,
        })
    }

    /// "5.8 threads of the process tree runnable on average (peak 7) on 2 CPUs".
    pub fn crowding_text(&self, pid: u32, calls: &[&Event]) -> Option<String> {
        let c = self.crowding(pid, calls)?;
        Some(format!(
            "{:.1} threads of the process and its children runnable on average (peak {}){}",
            c.mean,
            c.peak,
            self.cpus
                .map(|n| format!(" on {n} CPUs"))
                .unwrap_or_default()
        ))
    }

    /// How long the calls' own threads were off the CPU while the calls ran.
    pub fn during(&self, calls: &[&Event]) -> Overlap {
        let mut o = Overlap::default();
        for e in calls.iter().filter(|e| self.saw(e)) {
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

    /// "12" or, where some calls' threads were not followed, "12 of the 40 ... followed".
    pub fn of_followed(&self, seen: u64, all: usize) -> String {
        if seen as usize == all {
            seen.to_string()
        } else {
            format!("{seen} (of {all}: those while the scheduler followed their threads, the allocator probes armed)")
        }
    }

    /// A compounding factor for `calls` when their threads waited for a CPU during a real share
    /// of them (10%).
    pub fn compounding(&self, calls: &[&Event], what: &str) -> Option<String> {
        let o = self.during(calls);
        if o.call_ns == 0 || o.run_queue_ns * 10 < o.call_ns {
            return None;
        }
        let crowd = calls
            .first()
            .and_then(|e| self.crowding_text(e.pid, calls))
            .map(|c| format!("; {c}"))
            .unwrap_or_default();
        Some(format!(
            "CPU contention: during the {} {what} their own threads waited {} for a CPU ({:.0}% of the {} they took; {} off the CPU in all){crowd} - other runnable work, such as DataLoader workers, competed for the cores",
            self.of_followed(o.calls, calls.len()),
            t(o.run_queue_ns),
            o.run_queue_ns as f64 * 100.0 / o.call_ns as f64,
            t(o.call_ns),
            t(o.off_cpu_ns)
        ))
    }
}
