//! Per-op statistics for the live table and the summary: counts, bytes, errors, and latency
//! quantiles from a log-linear histogram (about 3% relative error, fixed memory).

use std::collections::BTreeMap;

use tracer_common::{Op, OpClass};

/// 8 sub-buckets per power of two, up to 2^40 ns.
const SUB: usize = 8;
const BUCKETS: usize = 41 * SUB;

#[derive(Clone, Debug)]
pub struct Histogram {
    counts: Box<[u64; BUCKETS]>,
    total: u64,
    /// The smallest and largest values added: a quantile never lies outside them.
    min: u64,
    max: u64,
}

impl Default for Histogram {
    fn default() -> Self {
        Histogram {
            counts: Box::new([0; BUCKETS]),
            total: 0,
            min: u64::MAX,
            max: 0,
        }
    }
}

impl Histogram {
    fn index(v: u64) -> usize {
        if v < SUB as u64 {
            return v as usize;
        }
        let exp = 63 - v.leading_zeros() as usize; // v in [2^exp, 2^(exp+1))
        let frac = ((v >> (exp - 3)) & (SUB as u64 - 1)) as usize; // next 3 bits
        ((exp - 2) * SUB + frac).min(BUCKETS - 1)
    }

    /// Lower bound of a bucket, the inverse of `index`.
    fn value(i: usize) -> u64 {
        if i < SUB {
            return i as u64;
        }
        let exp = i / SUB + 2;
        let frac = (i % SUB) as u64;
        (1u64 << exp) + (frac << (exp - 3))
    }

    pub fn add(&mut self, v: u64) {
        self.counts[Self::index(v)] += 1;
        self.total += 1;
        self.min = self.min.min(v);
        self.max = self.max.max(v);
    }

    /// The q-quantile (0..=1), as the midpoint of its bucket, within the values seen (a
    /// bucket's midpoint may lie past the largest value in it).
    pub fn quantile(&self, q: f64) -> u64 {
        if self.total == 0 {
            return 0;
        }
        let rank = ((q * self.total as f64).ceil() as u64).clamp(1, self.total);
        let mut seen = 0;
        for (i, &c) in self.counts.iter().enumerate() {
            seen += c;
            if seen >= rank {
                let lo = Self::value(i);
                let hi = if i + 1 < BUCKETS {
                    Self::value(i + 1)
                } else {
                    lo
                };
                return (lo + (hi - lo) / 2).clamp(self.min, self.max);
            }
        }
        Self::value(BUCKETS - 1)
    }
}

#[derive(Clone, Debug, Default)]
pub struct OpStats {
    pub calls: u64,
    pub errors: u64,
    /// Bytes of successful allocations or frees.
    pub bytes: u64,
    pub latency: Histogram,
    pub max_ns: u64,
}

#[derive(Clone, Debug, Default)]
pub struct LiveStats {
    pub ops: BTreeMap<Op, OpStats>,
    /// The processes seen that have not exited (a trace of weeks sees millions come and go:
    /// exited ones are counted, and only the first [`ENDED_LISTED`] listed).
    pub pids: std::collections::BTreeSet<u32>,
    pub ended: u64,
    pub ended_pids: Vec<u32>,
    pub events: u64,
    /// The pid of the call added last, in `pids` (calls come in runs from one process).
    last_pid: Option<u32>,
}

/// Exited processes listed by pid in the summary; the rest are counted.
pub const ENDED_LISTED: usize = 1024;

impl LiveStats {
    /// One call, from any source (a decoded event or a stored row).
    pub fn add_one(&mut self, pid: u32, op: Op, ret: i32, size: Option<u64>, duration_ns: u64) {
        self.events += 1;
        if self.last_pid != Some(pid) {
            self.pids.insert(pid);
            self.last_pid = Some(pid);
        }
        let s = self.ops.entry(op).or_default();
        s.calls += 1;
        if ret != 0 {
            s.errors += 1;
        } else if matches!(op.spec().class, OpClass::Alloc | OpClass::Free) {
            s.bytes += size.unwrap_or(0);
        }
        s.latency.add(duration_ns);
        s.max_ns = s.max_ns.max(duration_ns);
    }

    /// A process ended: it is counted, and listed while the list has room.
    pub fn exited(&mut self, pid: u32) {
        if self.last_pid == Some(pid) {
            self.last_pid = None;
        }
        if self.pids.remove(&pid) {
            self.ended += 1;
            if self.ended_pids.len() < ENDED_LISTED {
                self.ended_pids.push(pid);
            }
        }
    }

    /// How many processes made calls, living and ended.
    pub fn processes(&self) -> u64 {
        self.pids.len() as u64 + self.ended
    }

    /// The pids listed: every living one, and the first ended ones.
    pub fn pid_list(&self) -> Vec<u32> {
        let mut all: Vec<u32> = self.pids.iter().chain(&self.ended_pids).copied().collect();
        all.sort_unstable();
        all.dedup();
        all
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantiles_within_bucket_error() {
        let mut h = Histogram::default();
        for v in 1..=10_000u64 {
            h.add(v * 1000);
        }
        let p50 = h.quantile(0.5) as f64;
        let p99 = h.quantile(0.99) as f64;
        assert!((p50 / 5_000_000.0 - 1.0).abs() < 0.07, "p50 {p50}");
        assert!((p99 / 9_900_000.0 - 1.0).abs() < 0.07, "p99 {p99}");
        assert_eq!(h.total, 10_000);
    }

    #[test]
    fn bucket_bounds_are_monotonic() {
        for i in 1..BUCKETS {
            assert!(Histogram::value(i) > Histogram::value(i - 1), "bucket {i}");
            assert_eq!(Histogram::index(Histogram::value(i)), i);
        }
    }

    #[test]
    fn a_quantile_never_exceeds_the_largest_value_seen() {
        // The live table once showed p99 311.296us above max 302.189us: the bucket's midpoint.
        let mut h = Histogram::default();
        for v in [86_016, 90_000, 155_648, 302_189] {
            h.add(v);
        }
        assert!(h.quantile(0.99) <= 302_189, "{}", h.quantile(0.99));
        assert_eq!(h.quantile(1.0), 302_189);
        assert!(h.quantile(0.0) >= 86_016);
    }

    /// A process is listed while it lives, also when its pid comes back after it ended (the
    /// pid of the call before is not asked again, and an end forgets it).
    #[test]
    fn a_pid_that_ends_and_comes_back_is_listed_again() {
        let mut live = LiveStats::default();
        for pid in [5, 5, 6, 5] {
            live.add_one(pid, Op::TorchMalloc, 0, Some(512), 10);
        }
        assert_eq!(live.pid_list(), [5, 6]);
        live.exited(5);
        assert_eq!((live.pids.len(), live.ended), (1, 1));
        live.add_one(5, Op::TorchMalloc, 0, Some(512), 10);
        live.add_one(5, Op::TorchFree, 0, None, 10);
        assert!(live.pids.contains(&5));
        assert_eq!((live.processes(), live.events), (3, 6));
    }

    #[test]
    fn empty_histogram_is_zero() {
        assert_eq!(Histogram::default().quantile(0.99), 0);
    }
}
