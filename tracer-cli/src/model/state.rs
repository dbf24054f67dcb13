//! A process's state at a moment: everything a later answer about it depends on, so that
//! answers can start from it instead of from the process's first call. The writer stores one per
//! process in each keyframe (SCHEMA.md, `keyframes`); a tracer restarted while the process runs
//! takes it up again.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use tracer_common::{Op, OpClass, Space};

use super::{
    layout::{Layout, PendingFrees, Sight},
    moves_memory,
    pools::{Captures, PrivatePools},
    pressure::{Alarm, Pressure},
    Event,
};

/// How a keyframe's `data` is encoded: postcard of [`ProcessState`] followed (since format 2)
/// by its layout's blocks kept for other streams ([`PendingFrees`]). Format 1 is still read.
/// Format 3 adds what the layout knows of the blocks after them ([`Sight`]: `--allocator
/// auto`), format 4 each segment's private pool ([`PrivatePools`]), format 5 what the captures
/// route where ([`Captures`]).
pub const KEYFRAME_FORMAT: i64 = 5;
/// The oldest format this tracer reads.
pub const KEYFRAME_FORMAT_OLDEST: i64 = 1;

/// An allocation (or a framework block) the process still held.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LiveAlloc {
    /// Its pointer space (tracer_common::Space as u32) and pointer.
    pub space: u32,
    pub ptr: u64,
    pub size: u64,
    pub device: Option<i32>,
    /// The op that made it (Op as u32).
    pub op: u32,
    /// Wall clock, ns.
    pub ts_ns: i64,
}

impl LiveAlloc {
    pub fn op(&self) -> Option<Op> {
        Op::from_u32(self.op)
    }
}

/// The most a process held on one device, since it was first seen.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct DevicePeaks {
    pub held: u64,
    pub reserved: u64,
    pub allocated: u64,
}

impl DevicePeaks {
    fn raise(&mut self, held: u64, reserved: u64, allocated: u64) {
        self.held = self.held.max(held);
        self.reserved = self.reserved.max(reserved);
        self.allocated = self.allocated.max(allocated);
    }
}

/// One process's state after the calls of every stored block up to a keyframe's.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct ProcessState {
    pub pid: u32,
    /// The process's start (boot-relative ns, as /proc says): a later tracer takes the state
    /// up only for the same process, not another that reuses the pid.
    pub start_time_ns: Option<i64>,
    /// When the process was first seen, and its last call before the keyframe (wall ns).
    pub first_ns: i64,
    pub last_ns: i64,
    /// The allocator's segments and blocks (PyTorch's probes), or the device allocations.
    pub layout: Layout,
    /// The early warning's state: the device's free memory and the sizes requested lately.
    pub pressure: Pressure,
    /// The call-level join: what each live pointer holds, by (space, pointer), and each
    /// thread's device.
    pub live: BTreeMap<(u32, u64), LiveAlloc>,
    pub thread_devices: Vec<(u32, i32)>,
    /// Per device: the most held since the process was first seen.
    pub peaks: Vec<(i32, DevicePeaks)>,
    /// Calls and block events seen since the process was first seen.
    pub events: u64,
}

impl ProcessState {
    /// Advances the memory model by one of the process's calls (in the order they happened):
    /// its layout, early-warning state, peaks and counts. The early warning's figures when the
    /// call leaves its pool in the state in which the next request fails.
    pub fn apply_memory(&mut self, e: &Event) -> Option<Alarm> {
        if self.events == 0 {
            self.first_ns = e.ts_ns;
        }
        self.events += 1;
        self.last_ns = self.last_ns.max(e.ts_ns);
        let class = e.class();
        if class.is_pool_call()
            || matches!(
                class,
                OpClass::EventRecord
                    | OpClass::EventWait
                    | OpClass::Probes
                    | OpClass::CaptureBegin
                    | OpClass::StreamWait
                    | OpClass::CaptureEnd
            )
        {
            // The allocator's events keep blocks used on other streams from their pool.
            self.layout.apply(e);
            return None;
        }
        if !moves_memory(class) {
            return None;
        }
        self.pressure.observe(e);
        self.layout.apply(e);
        if let Some(device) = e.device() {
            let t = self.layout.device_total(device);
            let held = t.reserved + self.layout.outside(device);
            match self.peaks.iter_mut().find(|(d, _)| *d == device) {
                Some((_, peak)) => peak.raise(held, t.reserved, t.allocated),
                None => self.peaks.push((
                    device,
                    DevicePeaks {
                        held,
                        reserved: t.reserved,
                        allocated: t.allocated,
                    },
                )),
            }
        }
        (class == OpClass::BlockAlloc && e.ptr != 0)
            .then(|| {
                self.pressure
                    .after_block(e, self.layout.conf(), &self.layout)
            })
            .flatten()
    }

    /// Advances the call-level join by one call: live pointers and thread devices (what the
    /// recording's registry keeps apart, record/join.rs).
    pub fn apply_join(&mut self, e: &Event) {
        let spec = e.op.spec();
        if spec.class == OpClass::SetDevice && e.ret == 0 {
            if let Some(device) = e.device() {
                match self.thread_devices.iter_mut().find(|(t, _)| *t == e.tid) {
                    Some((_, d)) => *d = device,
                    None => self.thread_devices.push((e.tid, device)),
                }
            }
            return;
        }
        if spec.space == Space::None || e.ret != 0 {
            return;
        }
        let key = (spec.space as u32, e.ptr);
        match spec.class {
            OpClass::Alloc | OpClass::BlockAlloc if e.ptr != 0 => {
                let alloc = LiveAlloc {
                    space: key.0,
                    ptr: e.ptr,
                    size: e.size,
                    device: e.device(),
                    op: e.op as u32,
                    ts_ns: e.ts_ns,
                };
                self.live.insert(key, alloc);
            }
            OpClass::Free | OpClass::BlockFree => {
                self.live.remove(&key);
            }
            _ => {}
        }
    }

    /// The call-level join's share of the state (record/join.rs keeps it apart while recording).
    pub fn take_join(&mut self, live: Vec<LiveAlloc>, thread_devices: Vec<(u32, i32)>) {
        self.live = live.into_iter().map(|a| ((a.space, a.ptr), a)).collect();
        self.thread_devices = thread_devices;
    }

    /// In [`KEYFRAME_FORMAT`].
    pub fn encode(&self) -> anyhow::Result<Vec<u8>> {
        let l = &self.layout;
        postcard::to_stdvec(&(self, &l.pending, &l.sight, &l.private, &l.captures))
            .map_err(|e| anyhow::anyhow!("encode the state of pid {}: {e}", self.pid))
    }

    /// From `format` (1: without the blocks kept for other streams, which format 1 did not
    /// know of).
    pub fn decode(bytes: &[u8], format: i64) -> anyhow::Result<ProcessState> {
        let none = PrivatePools::default;
        let decoded = match format {
            1 => postcard::from_bytes(bytes).map(|s| {
                (
                    s,
                    PendingFrees::default(),
                    Sight::default(),
                    none(),
                    Captures::default(),
                )
            }),
            2 => postcard::from_bytes::<(ProcessState, PendingFrees)>(bytes)
                .map(|(s, p)| (s, p, Sight::default(), none(), Captures::default())),
            3 => postcard::from_bytes::<(ProcessState, PendingFrees, Sight)>(bytes)
                .map(|(s, p, g)| (s, p, g, none(), Captures::default())),
            4 => postcard::from_bytes::<(ProcessState, PendingFrees, Sight, PrivatePools)>(bytes)
                .map(|(s, p, g, pools)| (s, p, g, pools, Captures::default())),
            _ => {
                postcard::from_bytes::<(ProcessState, PendingFrees, Sight, PrivatePools, Captures)>(
                    bytes,
                )
            }
        };
        let (mut state, pending, sight, private, captures) =
            decoded.map_err(|e| anyhow::anyhow!("decode a keyframe's process state: {e}"))?;
        state.layout.pending = pending;
        state.layout.sight = sight;
        state.layout.private = private;
        state.layout.captures = captures;
        Ok(state)
    }
}

#[cfg(test)]
mod tests {
    use tracer_common::Op;

    use super::*;
    use crate::model::layout::pending_tests::{ev, freed_first, record, EVENT};

    #[test]
    fn a_kept_block_survives_a_keyframe_and_older_keyframes_still_decode() {
        let mut l = freed_first();
        l.apply(&record(1500, true));
        let state = ProcessState {
            pid: 1,
            layout: l,
            ..Default::default()
        };
        let bytes = state.encode().unwrap();
        let mut back = ProcessState::decode(&bytes, KEYFRAME_FORMAT).unwrap();
        assert_eq!(back.layout.pending(None), (1, 4 << 20));
        back.layout.apply(&ev(Op::CudaEventQuery, EVENT, 0, 2000));
        assert_eq!(back.layout.pending(None), (0, 0));
        assert_eq!(back.layout.total().free_blocks, 2);
        // Format 1 was the state alone.
        let old = postcard::to_stdvec(&state).unwrap();
        let back = ProcessState::decode(&old, 1).unwrap();
        assert_eq!(back.layout.pending(None), (0, 0));
        assert_eq!(back.layout.total().allocated, 4 << 20);
    }

    /// A segment's private pool survives a keyframe; format 3 (before pools) still decodes.
    #[test]
    fn a_segments_private_pool_survives_a_keyframe() {
        let mut l = Layout::default();
        let mut made = ev(Op::CudaMalloc, 0x7000_0000, 2 << 20, 10);
        made.aux1 = crate::model::pools::pool_id_to_aux1((0, 3));
        l.apply(&made);
        let state = ProcessState {
            pid: 1,
            layout: l,
            ..Default::default()
        };
        let back = ProcessState::decode(&state.encode().unwrap(), KEYFRAME_FORMAT).unwrap();
        assert_eq!(back.layout.private.of(0x7000_0000), Some((0, 3)));
        let l = &state.layout;
        let three = postcard::to_stdvec(&(&state, &l.pending, &l.sight)).unwrap();
        let back = ProcessState::decode(&three, 3).unwrap();
        assert!(back.layout.private.is_empty());
    }

    /// A capture underway survives a keyframe (its stream still routes to its pool after it);
    /// format 4 (before captures) still decodes.
    #[test]
    fn a_capture_underway_survives_a_keyframe() {
        let mut l = Layout::default();
        let mut announce = ev(Op::TorchCaptureBegin, 0x9000, 0, 10);
        (announce.aux0, announce.aux1, announce.tid) = (0, 2, 7);
        l.apply(&announce);
        let mut begin = ev(Op::CudaStreamBeginCapture, 0, 0, 11);
        (begin.aux0, begin.tid) = (0x5000, 7);
        l.apply(&begin);
        let state = ProcessState {
            pid: 1,
            layout: l,
            ..Default::default()
        };
        let mut back = ProcessState::decode(&state.encode().unwrap(), KEYFRAME_FORMAT).unwrap();
        assert_eq!(back.layout.captures.route(0, 0x5000), Some((0, 2)));
        // The capture's segment, made after the keyframe, is the pool's.
        back.layout
            .apply(&ev(Op::CudaMalloc, 0x7000_0000, 20 << 20, 12));
        let mut block = ev(Op::TorchMalloc, 0x7000_0000, 4 << 20, 13);
        block.aux0 = 0x5000;
        back.layout.apply(&block);
        assert_eq!(back.layout.private.of(0x7000_0000), Some((0, 2)));
        let l = &state.layout;
        let four = postcard::to_stdvec(&(&state, &l.pending, &l.sight, &l.private)).unwrap();
        let back = ProcessState::decode(&four, 4).unwrap();
        assert_eq!(back.layout.captures.route(0, 0x5000), None);
    }
}
