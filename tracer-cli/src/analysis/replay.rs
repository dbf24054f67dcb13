//! One replay of a process's allocations and frees, call by call, answering every question the
//! rules ask of it: bytes held at given times and their peaks per interval, short alloc/free
//! cycles, and what is still live at the end. Ten million calls make a hash-map replay the
//! costliest step of explain, so it is done once per process, not once per rule.

use std::collections::BTreeMap;

use tracer_common::{Op, OpClass, Space};

use super::{Event, FastMap, Window};

/// Lifetimes below this make an alloc/free pair a churn cycle.
pub const CHURN_LIFETIME_NS: i64 = 10_000_000;

/// Intervals of equal length over which peaks of held bytes are taken.
#[derive(Clone, Copy, Debug)]
pub struct Buckets {
    pub start: i64,
    pub span: i64,
}

pub const BUCKETS: usize = 6;

impl Buckets {
    /// Which of BUCKETS equal intervals from `start` over `span` holds `ts`.
    pub fn of(&self, ts: i64) -> usize {
        // In i64 while it cannot overflow (spans under 48 years): 128-bit division was a tenth
        // of the replay's time.
        let bucket = match (ts - self.start).checked_mul(BUCKETS as i64) {
            Some(scaled) => scaled / (self.span + 1),
            None => ((ts - self.start) as i128 * BUCKETS as i128 / (self.span as i128 + 1)) as i64,
        };
        (bucket.max(0) as usize).min(BUCKETS - 1)
    }

    fn contains(&self, ts: i64) -> bool {
        ts >= self.start && ts <= self.start + self.span
    }
}

/// What the replay found.
#[derive(Debug, Default)]
pub struct Replayed<'a> {
    /// Bytes held (live device allocations and physical handles) at each sample time: after
    /// every call that began at or before it.
    pub held_at: Vec<u64>,
    /// Peak bytes held in each bucket, when buckets were asked for.
    pub peaks: [u64; BUCKETS],
    /// Lifetimes of alloc/free pairs both made in the window and shorter than
    /// [`CHURN_LIFETIME_NS`], by (op, size) of the allocation.
    pub churn: BTreeMap<(Op, u64), Vec<u64>>,
    /// Allocations (any memory space) not freed by the end of the calls replayed.
    pub live: Vec<&'a Event>,
    /// The window's successful device allocations, when buckets were asked for.
    pub device_allocs: DeviceAllocs,
}

/// The window's successful device allocations, by bucket (fragmentation pressure reads them).
#[derive(Debug, Default)]
pub struct DeviceAllocs {
    pub durations: [Vec<u64>; BUCKETS],
    pub count: usize,
    pub min_size: u64,
    pub max_size: u64,
    /// Bit `op as u32` set for each op seen.
    pub ops: u64,
}

/// A successful allocation of device memory.
pub fn is_device_alloc_ok(e: &Event) -> bool {
    e.ret == 0 && e.class() == OpClass::Alloc && e.space() == Space::Device
}

fn holds_bytes(space: Space) -> bool {
    matches!(space, Space::Device | Space::Handle)
}

/// Replays `evs` (one process, in time order, up to the window's end). `samples` ascend.
pub fn replay<'a>(
    evs: &'a [Event],
    window: Window,
    samples: &[i64],
    buckets: Option<Buckets>,
) -> Replayed<'a> {
    let mut live: FastMap<(u32, u64), usize> = FastMap::default();
    let mut held = 0u64;
    let mut out = Replayed {
        held_at: Vec::with_capacity(samples.len()),
        ..Default::default()
    };
    out.device_allocs.min_size = u64::MAX;
    for (i, e) in evs.iter().enumerate() {
        while out.held_at.len() < samples.len() && e.ts_ns > samples[out.held_at.len()] {
            out.held_at.push(held);
        }
        if e.ptr != 0 && e.ret == 0 {
            let space = e.space();
            let key = (space as u32, e.ptr);
            match e.class() {
                OpClass::Alloc => {
                    if let Some(old) = live.insert(key, i) {
                        if holds_bytes(space) {
                            held -= evs[old].size;
                        }
                    }
                    if holds_bytes(space) {
                        held += e.size;
                    }
                }
                OpClass::Free => {
                    if let Some(old) = live.remove(&key) {
                        let a = &evs[old];
                        if holds_bytes(space) {
                            held -= a.size;
                        }
                        let life = e.ts_ns - a.ts_ns;
                        if a.ts_ns >= window.from_ns && life < CHURN_LIFETIME_NS {
                            out.churn
                                .entry((a.op, a.size))
                                .or_default()
                                .push(life.max(0) as u64);
                        }
                    }
                }
                _ => {}
            }
        }
        if let Some(b) = buckets.filter(|b| b.contains(e.ts_ns)) {
            let k = b.of(e.ts_ns);
            out.peaks[k] = out.peaks[k].max(held);
            if e.ts_ns >= window.from_ns && is_device_alloc_ok(e) {
                let d = &mut out.device_allocs;
                d.durations[k].push(e.duration_ns);
                d.count += 1;
                d.min_size = d.min_size.min(e.size);
                d.max_size = d.max_size.max(e.size);
                d.ops |= 1 << (e.op as u32);
            }
        }
    }
    out.held_at.resize(samples.len(), held);
    let mut indexes: Vec<usize> = live.into_values().collect();
    indexes.sort_unstable();
    out.live = indexes.into_iter().map(|i| &evs[i]).collect();
    out
}

/// Bytes held (device allocations and handles) after the calls of `evs` (in time order) that
/// began at or before `ts`.
pub fn held_bytes_at<'a>(evs: impl IntoIterator<Item = &'a Event>, ts: i64) -> u64 {
    let mut live: FastMap<(u32, u64), u64> = FastMap::default();
    let mut held = 0u64;
    for e in evs.into_iter().take_while(|e| e.ts_ns <= ts) {
        let space = e.space();
        if e.ptr == 0 || e.ret != 0 || !holds_bytes(space) {
            continue;
        }
        let key = (space as u32, e.ptr);
        match e.class() {
            OpClass::Alloc => {
                held += e.size;
                if let Some(old) = live.insert(key, e.size) {
                    held -= old;
                }
            }
            OpClass::Free => held -= live.remove(&key).unwrap_or(0),
            _ => {}
        }
    }
    held
}
