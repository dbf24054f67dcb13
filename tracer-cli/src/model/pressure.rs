//! The early warning's state, shared by the live trace and explain: the device's free memory
//! (as cudaMemGetInfo last said, kept current with the process's own segments) and the sizes
//! requested lately per pool. The warning is the state in which the next request of those sizes
//! fails: no cached block holds it although the cache holds its bytes, and the device cannot
//! give the segment it would need.

use std::collections::{BTreeMap, VecDeque};

use serde::{Deserialize, Serialize};
use tracer_common::{OpClass, Space};

pub use super::policy::{pool_of, segment_size};
use super::{
    attempts::Outermost,
    layout::{AllocConf, Layout, Pool, PoolStats},
    Event,
};

/// Requests remembered per pool: the warning asks whether the sizes being requested still fit.
const RECENT_REQUESTS: usize = 64;

/// The device's free memory as last reported by cudaMemGetInfo, then kept current with the
/// process's own segment allocations and frees.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct DeviceFree {
    pub free: i64,
    /// When cudaMemGetInfo last said.
    pub reported_ns: i64,
}

/// The figures of a warning: what the pool holds against what is being requested.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Alarm {
    pub ts_ns: i64,
    pub device: i32,
    pub pool: Pool,
    /// The largest block requested lately in the pool.
    pub request: u64,
    pub stats: PoolStats,
    pub device_free: u64,
    /// The segment such a request needs.
    pub segment: u64,
}

/// One process's early-warning state.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct Pressure {
    free: BTreeMap<i32, DeviceFree>,
    recent: BTreeMap<(i32, Pool), VecDeque<u64>>,
    /// The largest of each pool's recent requests, kept as they come and go (scanning all of
    /// them at every block event was a sixth of the report's time); rebuilt from `recent` when
    /// absent (a state read from a keyframe).
    #[serde(skip)]
    largest_recent: BTreeMap<(i32, Pool), u64>,
    /// The process's own device memory taken and given back: cudaMalloc and the
    /// cuMemAlloc_v2 inside it are one.
    #[serde(skip)]
    outermost: Outermost,
    /// Each device's capacity, as cudaMemGetInfo said (not in keyframes: known again at the
    /// process's next call of it).
    #[serde(skip)]
    totals: BTreeMap<i32, u64>,
}

impl Pressure {
    /// Takes in what a call says of the device's free memory; call before the layout applies it.
    pub fn observe(&mut self, e: &Event) {
        let spec = e.op.spec();
        if spec.class == OpClass::MemInfo && e.ret == 0 && e.aux1 > 0 {
            self.free.insert(
                e.device,
                DeviceFree {
                    free: e.aux0 as i64,
                    reported_ns: e.ts_ns,
                },
            );
            self.totals.insert(e.device, e.aux1);
            return;
        }
        let free = &mut self.free;
        self.outermost.push(e, &mut |e| {
            let spec = e.op.spec();
            let change = match (spec.class, spec.space) {
                (OpClass::Alloc, Space::Device | Space::Handle) if e.ret == 0 => e.size as i64,
                (OpClass::Free, Space::Device | Space::Handle) if e.ret == 0 => -(e.size as i64),
                _ => 0,
            };
            if let Some(d) = free.get_mut(&e.device).filter(|_| change != 0) {
                if e.ts_ns > d.reported_ns {
                    d.free -= change;
                }
            }
        });
    }

    /// The device's free memory, when cudaMemGetInfo has said.
    pub fn device_free(&self, device: i32) -> Option<&DeviceFree> {
        self.free.get(&device)
    }

    /// The device's capacity, when cudaMemGetInfo has said since the process was followed.
    pub fn device_total(&self, device: i32) -> Option<u64> {
        self.totals.get(&device).copied()
    }

    /// After a block allocation has been applied to `layout`: remembers its size and says
    /// whether its pool is now in the state the warning is about.
    pub fn after_block(&mut self, e: &Event, conf: AllocConf, layout: &Layout) -> Option<Alarm> {
        let rounded = conf.round_size(e.size);
        let pool = pool_of(rounded);
        let key = (e.device, pool);
        let recent = self.recent.entry(key).or_default();
        recent.push_back(rounded);
        let gone = if recent.len() > RECENT_REQUESTS {
            recent.pop_front()
        } else {
            None
        };
        let largest = self.largest_recent.entry(key).or_insert(0);
        // The largest is still among them (or the new one is larger): no scan. Absent (0: a
        // state read from a keyframe), or gone, it is found again.
        *largest = if *largest > 0 && (gone.is_none_or(|g| g < *largest) || rounded >= *largest) {
            (*largest).max(rounded)
        } else {
            recent.iter().copied().max().unwrap_or(rounded)
        };
        let need = *largest;
        let stats = layout.stats().get(&key).copied().unwrap_or_default();
        let device_free = self.free.get(&e.device)?.free;
        let segment = segment_size(need);
        (stats.cached() >= need && stats.largest_free < need && device_free < segment as i64).then(
            || Alarm {
                ts_ns: e.ts_ns,
                device: e.device,
                pool,
                request: need,
                stats,
                device_free: device_free.max(0) as u64,
                segment,
            },
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::layout::tests::ev;
    use tracer_common::Op;

    /// The largest recent request, kept as requests come and go, is the largest of the last
    /// [`RECENT_REQUESTS`] at every step, also after the state went through a keyframe.
    #[test]
    fn the_largest_recent_request_follows_the_window() {
        let (mut pressure, layout, conf) =
            (Pressure::default(), Layout::default(), AllocConf::default());
        let mut seed = 7u64;
        let mut sizes = Vec::new();
        for i in 0..5000 {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            // Large requests only (one pool), sizes that often repeat the window's largest.
            let size = (2 << 20) + (seed >> 33) % 16 * (1 << 20);
            pressure.after_block(&ev(Op::TorchMalloc, 0x1000, size), conf, &layout);
            sizes.push(conf.round_size(size));
            let window = &sizes[sizes.len().saturating_sub(RECENT_REQUESTS)..];
            let key = (0, Pool::Large);
            assert_eq!(
                pressure.largest_recent[&key],
                *window.iter().max().unwrap(),
                "step {i}"
            );
            if i == 2500 {
                let bytes = postcard::to_allocvec(&pressure).unwrap();
                pressure = postcard::from_bytes(&bytes).unwrap();
                assert!(pressure.largest_recent.is_empty());
            }
        }
    }
}
