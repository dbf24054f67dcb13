//! A session's figures over time, downsampled while the calls stream by: a fixed number of
//! buckets per process and device whose width doubles (neighbours merge) whenever the session
//! outgrows them, so a report of ten million calls holds at most [`MAX_BUCKETS`] points a line.

use std::collections::BTreeMap;

use serde::Serialize;

/// Points per line, at most.
pub const MAX_BUCKETS: usize = 1000;
/// The narrowest bucket.
const FIRST_WIDTH_NS: i64 = 1_000;
/// Latency histogram: 4 bins per power of two from 64 ns to 2^38 ns (4.6 min).
const LAT_MIN_LOG2: u32 = 6;
const LAT_BINS_PER_OCTAVE: u32 = 4;
const LAT_BINS: usize = ((38 - LAT_MIN_LOG2) * LAT_BINS_PER_OCTAVE) as usize;

/// The levels (memory, fragmentation) as they stood after a bucket's last sample: what an
/// empty bucket after it shows.
#[derive(Clone, Copy, Debug, Default)]
struct Levels {
    allocated: Option<u64>,
    reserved: Option<u64>,
    outside: Option<u64>,
    largest_free: Option<u64>,
    fragmentation: Option<f64>,
    device_free: Option<u64>,
}

impl Levels {
    fn after(self, later: Levels) -> Levels {
        Levels {
            allocated: later.allocated.or(self.allocated),
            reserved: later.reserved.or(self.reserved),
            outside: later.outside.or(self.outside),
            largest_free: later.largest_free.or(self.largest_free),
            fragmentation: later.fragmentation.or(self.fragmentation),
            device_free: later.device_free.or(self.device_free),
        }
    }
}

/// What one bucket saw of one process on one device.
#[derive(Clone, Debug, Default)]
struct Bucket {
    /// The levels after its last sample.
    last: Levels,
    /// The highest allocated, reserved and outside-the-allocator bytes after any call in it.
    allocated: Option<u64>,
    reserved: Option<u64>,
    outside: Option<u64>,
    /// The lowest largest-free-block and the highest fragmentation ratio.
    largest_free: Option<u64>,
    fragmentation: Option<f64>,
    /// The device's free memory as cudaMemGetInfo last said in it.
    device_free: Option<u64>,
    /// The largest request in it.
    request: Option<u64>,
    /// Device allocation calls' durations.
    latency: Option<Box<[u32; LAT_BINS]>>,
}

fn max_of<T: PartialOrd + Copy>(a: Option<T>, b: Option<T>) -> Option<T> {
    match (a, b) {
        (Some(x), Some(y)) => Some(if y > x { y } else { x }),
        (x, None) => x,
        (None, y) => y,
    }
}

fn min_of(a: Option<u64>, b: Option<u64>) -> Option<u64> {
    match (a, b) {
        (Some(x), Some(y)) => Some(x.min(y)),
        (x, None) => x,
        (None, y) => y,
    }
}

impl Bucket {
    /// `later` follows `self` in time.
    fn merge(&mut self, later: Bucket) {
        self.last = self.last.after(later.last);
        self.allocated = max_of(self.allocated, later.allocated);
        self.reserved = max_of(self.reserved, later.reserved);
        self.outside = max_of(self.outside, later.outside);
        self.largest_free = min_of(self.largest_free, later.largest_free);
        self.fragmentation = max_of(self.fragmentation, later.fragmentation);
        self.device_free = later.device_free.or(self.device_free);
        self.request = max_of(self.request, later.request);
        match (&mut self.latency, later.latency) {
            (Some(mine), Some(theirs)) => {
                for (m, t) in mine.iter_mut().zip(theirs.iter()) {
                    *m = m.saturating_add(*t);
                }
            }
            (mine @ None, theirs) => *mine = theirs,
            (_, None) => {}
        }
    }
}

fn latency_bin(ns: u64) -> usize {
    let ns = ns.max(1 << LAT_MIN_LOG2);
    let log2 = 63 - ns.leading_zeros();
    let frac = ((ns >> (log2 - 2)) & 3) as u32;
    (((log2 - LAT_MIN_LOG2) * LAT_BINS_PER_OCTAVE + frac) as usize).min(LAT_BINS - 1)
}

/// The upper bound of a bin: what its calls took at most.
fn bin_upper_ns(bin: usize) -> u64 {
    let octave = bin as u32 / LAT_BINS_PER_OCTAVE + LAT_MIN_LOG2;
    let frac = u64::from(bin as u32 % LAT_BINS_PER_OCTAVE);
    (1u64 << octave) + ((frac + 1) << (octave - 2)) - 1
}

/// The `q` quantile of a histogram, as its bin's upper bound.
fn quantile(hist: &[u32; LAT_BINS], q: f64) -> Option<u64> {
    let total: u64 = hist.iter().map(|&c| u64::from(c)).sum();
    if total == 0 {
        return None;
    }
    let rank = ((q * total as f64).ceil() as u64).clamp(1, total);
    let mut seen = 0;
    for (bin, &c) in hist.iter().enumerate() {
        seen += u64::from(c);
        if seen >= rank {
            return Some(bin_upper_ns(bin));
        }
    }
    None
}

/// The figures after one call, as the caller knows them.
#[derive(Clone, Copy, Debug, Default)]
pub struct Sample {
    pub allocated: Option<u64>,
    pub reserved: Option<u64>,
    pub outside: Option<u64>,
    pub largest_free: Option<u64>,
    pub fragmentation: Option<f64>,
    pub device_free: Option<u64>,
    pub request: Option<u64>,
    /// A device allocation call's duration.
    pub latency_ns: Option<u64>,
}

/// Every process and device's buckets, on one time axis.
#[derive(Debug)]
pub struct Timeline {
    origin: Option<i64>,
    width: i64,
    lines: BTreeMap<(u32, i32), Vec<Bucket>>,
}

impl Default for Timeline {
    fn default() -> Self {
        Timeline {
            origin: None,
            width: FIRST_WIDTH_NS,
            lines: BTreeMap::new(),
        }
    }
}

/// One line's points, column by column (for a chart), with the axis' times.
#[derive(Clone, Debug, Serialize)]
pub struct Line {
    pub pid: u32,
    pub device: i32,
    /// Bucket start times, ns since the epoch.
    pub t: Vec<i64>,
    pub allocated: Vec<Option<u64>>,
    pub reserved: Vec<Option<u64>>,
    pub outside: Vec<Option<u64>>,
    pub largest_free: Vec<Option<u64>>,
    pub fragmentation: Vec<Option<f64>>,
    pub device_free: Vec<Option<u64>>,
    pub request: Vec<Option<u64>>,
    pub latency_p50_ns: Vec<Option<u64>>,
    pub latency_p99_ns: Vec<Option<u64>>,
}

impl Timeline {
    /// Takes in what one call left (calls arrive nearly in time order; a call before the
    /// origin counts in the first bucket).
    pub fn add(&mut self, ts_ns: i64, pid: u32, device: i32, s: Sample) {
        let origin = *self.origin.get_or_insert(ts_ns);
        let mut index = (ts_ns.saturating_sub(origin).max(0) / self.width) as usize;
        while index >= MAX_BUCKETS {
            self.halve();
            index = (ts_ns.saturating_sub(origin).max(0) / self.width) as usize;
        }
        let line = self.lines.entry((pid, device)).or_default();
        if line.len() <= index {
            line.resize_with(index + 1, Bucket::default);
        }
        let b = &mut line[index];
        b.merge(Bucket {
            last: Levels {
                allocated: s.allocated,
                reserved: s.reserved,
                outside: s.outside,
                largest_free: s.largest_free,
                fragmentation: s.fragmentation,
                device_free: s.device_free,
            },
            allocated: s.allocated,
            reserved: s.reserved,
            outside: s.outside,
            largest_free: s.largest_free,
            fragmentation: s.fragmentation,
            device_free: s.device_free,
            request: s.request,
            // Counted in place below: no histogram is made for one call.
            latency: None,
        });
        if let Some(ns) = s.latency_ns {
            let hist = b.latency.get_or_insert_with(|| Box::new([0u32; LAT_BINS]));
            hist[latency_bin(ns)] = hist[latency_bin(ns)].saturating_add(1);
        }
    }

    /// Twice as wide: each pair of buckets becomes one.
    fn halve(&mut self) {
        self.width = self.width.saturating_mul(2);
        for line in self.lines.values_mut() {
            let old = std::mem::take(line);
            let mut pairs = old.into_iter();
            while let Some(mut first) = pairs.next() {
                if let Some(second) = pairs.next() {
                    first.merge(second);
                }
                line.push(first);
            }
        }
    }

    /// The width of a bucket, ns.
    pub fn bucket_ns(&self) -> i64 {
        self.width
    }

    /// The lines: a bucket with samples shows its highest level (largest free block: lowest);
    /// one without shows the level the calls before it left.
    pub fn lines(&self) -> Vec<Line> {
        let origin = self.origin.unwrap_or(0);
        self.lines
            .iter()
            .map(|(&(pid, device), buckets)| {
                let mut line = Line {
                    pid,
                    device,
                    t: Vec::with_capacity(buckets.len()),
                    allocated: Vec::with_capacity(buckets.len()),
                    reserved: Vec::with_capacity(buckets.len()),
                    outside: Vec::with_capacity(buckets.len()),
                    largest_free: Vec::with_capacity(buckets.len()),
                    fragmentation: Vec::with_capacity(buckets.len()),
                    device_free: Vec::with_capacity(buckets.len()),
                    request: Vec::with_capacity(buckets.len()),
                    latency_p50_ns: Vec::with_capacity(buckets.len()),
                    latency_p99_ns: Vec::with_capacity(buckets.len()),
                };
                let mut before = Levels::default();
                for (i, b) in buckets.iter().enumerate() {
                    line.t.push(origin + i as i64 * self.width);
                    line.allocated.push(b.allocated.or(before.allocated));
                    line.reserved.push(b.reserved.or(before.reserved));
                    line.outside.push(b.outside.or(before.outside));
                    line.largest_free
                        .push(b.largest_free.or(before.largest_free));
                    line.fragmentation
                        .push(b.fragmentation.or(before.fragmentation));
                    line.device_free.push(b.device_free.or(before.device_free));
                    before = before.after(b.last);
                    line.request.push(b.request);
                    line.latency_p50_ns
                        .push(b.latency.as_ref().and_then(|h| quantile(h, 0.5)));
                    line.latency_p99_ns
                        .push(b.latency.as_ref().and_then(|h| quantile(h, 0.99)));
                }
                line
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_idle_stretch_shows_the_level_left_not_the_peak() {
        let mut t = Timeline::default();
        let at = |t: &mut Timeline, ns: i64, allocated: u64| {
            t.add(
                ns,
                1,
                0,
                Sample {
                    allocated: Some(allocated),
                    ..Default::default()
                },
            )
        };
        // A peak and its free within the first bucket, silence, then one more call.
        at(&mut t, 0, 5 << 30);
        at(&mut t, 100, 1 << 30);
        at(&mut t, 10_000_000, 1 << 30);
        let l = &t.lines()[0];
        assert_eq!(l.allocated[0], Some(5 << 30), "a bucket shows its peak");
        assert!(
            l.allocated[1..].iter().all(|&a| a == Some(1 << 30)),
            "{:?}",
            l.allocated
        );
    }

    #[test]
    fn bins_bound_their_durations() {
        for ns in [
            1u64,
            64,
            65,
            100,
            127,
            128,
            1_000,
            60_000,
            1 << 37,
            u64::MAX,
        ] {
            let bin = latency_bin(ns);
            assert!(bin < LAT_BINS);
            if (64..1 << 38).contains(&ns) {
                assert!(bin_upper_ns(bin) >= ns, "{ns} in bin {bin}");
                assert!(bin_upper_ns(bin) < ns + ns / 4 + 1, "{ns} in bin {bin}");
            }
        }
    }

    #[test]
    fn buckets_halve_and_keep_peaks() {
        let mut t = Timeline::default();
        // 10 s of calls, one every millisecond, allocated rising then one spike.
        for i in 0..10_000i64 {
            let allocated = if i == 5_000 { 1 << 40 } else { i as u64 };
            t.add(
                1_000_000_000 + i * 1_000_000,
                7,
                0,
                Sample {
                    allocated: Some(allocated),
                    latency_ns: Some(60_000),
                    ..Default::default()
                },
            );
        }
        let lines = t.lines();
        assert_eq!(lines.len(), 1);
        let l = &lines[0];
        assert!(l.t.len() <= MAX_BUCKETS && l.t.len() > MAX_BUCKETS / 2);
        assert_eq!(l.allocated.iter().flatten().max(), Some(&(1u64 << 40)));
        assert_eq!(l.allocated.last(), Some(&Some(9_999)));
        assert!(l
            .latency_p99_ns
            .iter()
            .flatten()
            .all(|&p| (60_000..75_000).contains(&p)));
        assert_eq!(l.t[1] - l.t[0], t.bucket_ns());
    }
}
