//! What a call's own record does not say, joined from the records before it: the size and
//! device of the allocation (or the framework's block) a free releases, and the device of the
//! calling thread (as CUDA defines it: model/devices.rs). The kernel keeps neither (a map update per call cost more than
//! the rest of a traced call); every record reaches the registry in the order the calls returned
//! (the reader puts the CPUs' batches back in that order), so the join is exact here.

use std::collections::HashMap;

use tracer_common::{call::flags, maps::ALLOCS_ENTRIES, OpClass, Space};

use crate::{
    decode::Call,
    model::{
        devices::{Learned, ThreadDevices},
        state::LiveAlloc,
        SeededMap,
    },
};

/// (process, pointer space, pointer).
type Key = (u32, u32, u64);

/// A free that released a pointer: the enclosing free of a nested pair (cudaFree calling the
/// driver's cuMemFree_v2 on the same pointer) returns after it and takes its size.
#[derive(Clone, Copy)]
struct Released {
    key: Key,
    size: u64,
    device: Option<i32>,
    ts: u64,
    end: u64,
}

/// One process's share of the join, for a keyframe: its live pointers and its threads'
/// devices.
#[derive(Debug, Default)]
pub struct JoinState {
    pub live: Vec<LiveAlloc>,
    pub devices: Vec<(u32, i32)>,
}

/// What a live pointer holds: size, device, the op that made it and when (monotonic ns).
#[derive(Clone, Copy)]
struct Held {
    size: u64,
    device: Option<i32>,
    op: tracer_common::Op,
    ts: u64,
}

impl Held {
    /// As a keyframe keeps it (wall-clock time).
    fn as_live(&self, space: u32, ptr: u64, wall_offset_ns: i64) -> LiveAlloc {
        LiveAlloc {
            space,
            ptr,
            size: self.size,
            device: self.device,
            op: self.op as u32,
            ts_ns: self.ts as i64 + wall_offset_ns,
        }
    }
}

pub struct Join {
    live: SeededMap<Key, Held>,
    devices: ThreadDevices,
    /// Per thread: the first and last call (monotonic ns) given no device, until PyTorch's
    /// probe tells the thread's device.
    unresolved: SeededMap<(u32, u32), (u64, u64)>,
    /// Devices learned for calls already passed on without one.
    learned: Vec<Learned>,
    last_free: SeededMap<(u32, u32), Released>,
    /// Thread devices come from cudaSetDevice calls (live), or with each record (a log).
    track_devices: bool,
    /// Allocations not kept because [`ALLOCS_ENTRIES`] were live: their frees lack a size.
    pub not_tracked: u64,
}

impl Join {
    /// For records from the kernel: they name a device only when the call itself does.
    pub fn live() -> Join {
        Join::new(true)
    }

    /// Forgets an ended process: a process that reuses its pid must not free its allocations.
    pub fn forget_process(&mut self, pid: u32) {
        self.live.retain(|k, _| k.0 != pid);
        self.devices.forget_process(pid);
        self.unresolved.retain(|k, _| k.0 != pid);
        self.last_free.retain(|k, _| k.0 != pid);
    }

    /// A process tracer saw start: its threads that set no device are on device 0.
    pub fn seen_whole(&mut self, pid: u32) {
        self.devices.seen_whole(pid);
    }

    /// For the simulated runtime's log, whose lines carry each call's device.
    pub fn for_log() -> Join {
        Join::new(false)
    }

    fn new(track_devices: bool) -> Join {
        Join {
            live: SeededMap::default(),
            devices: ThreadDevices::default(),
            unresolved: SeededMap::default(),
            learned: Vec::new(),
            last_free: SeededMap::default(),
            track_devices,
            not_tracked: 0,
        }
    }

    /// Completes `call` from what came before, and remembers what it allocated or set.
    pub fn apply(&mut self, call: &mut Call) {
        let spec = call.op.spec();
        if self.track_devices {
            self.resolve_device(call);
        }
        let Some(ptr) = call.ptr else {
            return;
        };
        if spec.space == Space::None {
            return;
        }
        let key = (call.pid, spec.space as u32, ptr);
        match spec.class {
            OpClass::Alloc | OpClass::BlockAlloc if call.ret == 0 && ptr != 0 => {
                self.allocated(key, call)
            }
            OpClass::Free => self.freed(key, call, true),
            // The allocator's probe fires once a free: no free of its nests in another.
            OpClass::BlockFree => self.freed(key, call, false),
            _ => {}
        }
    }

    /// The call's device (model/devices.rs); calls passed on without one are settled once
    /// PyTorch's probe names the thread's device before it sets another.
    fn resolve_device(&mut self, call: &mut Call) {
        let thread = (call.pid, call.tid);
        call.device = self.devices.apply(
            call.pid,
            call.tid,
            call.op,
            call.ret,
            call.ptr.unwrap_or(0),
            call.device,
        );
        let class = call.op.spec().class;
        if self.unresolved.is_empty() && call.device.is_some() {
            // Nearly always: nothing waits for a device.
            return;
        }
        let sets = matches!(class, OpClass::SetDevice | OpClass::SetContext) && call.ret == 0;
        match (class, call.device) {
            _ if sets => {
                // Those before it ran on a device no call told.
                self.unresolved.remove(&thread);
            }
            (OpClass::BlockAlloc, Some(device)) => {
                if let Some((from, to)) = self.unresolved.remove(&thread) {
                    self.learned.push(Learned {
                        pid: call.pid,
                        tid: call.tid,
                        device,
                        from_ns: from as i64,
                        to_ns: to as i64,
                    });
                }
            }
            (_, None) => {
                let ts = call.ts_mono_ns;
                let span = self.unresolved.entry(thread).or_insert((ts, ts));
                span.1 = span.1.max(ts);
            }
            _ => {}
        }
    }

    /// Devices learned since the last call (times monotonic ns), for the writer to store.
    pub fn take_learned(&mut self) -> Vec<Learned> {
        std::mem::take(&mut self.learned)
    }

    fn allocated(&mut self, key: Key, call: &Call) {
        if self.live.len() >= ALLOCS_ENTRIES as usize && !self.live.contains_key(&key) {
            self.not_tracked += 1;
            return;
        }
        self.live.insert(
            key,
            Held {
                size: call.size.unwrap_or(0),
                device: call.device,
                op: call.op,
                ts: call.ts_mono_ns,
            },
        );
    }

    /// Every followed process's live pointers and thread devices, for a keyframe (times made
    /// wall clock with `wall_offset_ns`).
    pub fn snapshot(&self, wall_offset_ns: i64) -> HashMap<u32, JoinState> {
        let mut out: HashMap<u32, JoinState> = HashMap::new();
        for (&(pid, space, ptr), h) in &self.live {
            out.entry(pid)
                .or_default()
                .live
                .push(h.as_live(space, ptr, wall_offset_ns));
        }
        for pid in self.devices.processes() {
            out.entry(pid).or_default().devices = self.devices.known(pid);
        }
        for s in out.values_mut() {
            s.live.sort_unstable_by_key(|a| (a.space, a.ptr));
            s.devices.sort_unstable();
        }
        out
    }

    /// One process's live pointers and thread devices (see [`Join::snapshot`]).
    pub fn snapshot_of(&self, pid: u32, wall_offset_ns: i64) -> JoinState {
        let live = self
            .live
            .iter()
            .filter(|(k, _)| k.0 == pid)
            .map(|(&(_, space, ptr), h)| h.as_live(space, ptr, wall_offset_ns))
            .collect();
        JoinState {
            live,
            devices: self.devices.known(pid),
        }
    }

    /// Takes up a process's live pointers and thread devices from a keyframe.
    pub fn restore<'a>(
        &mut self,
        pid: u32,
        live: impl IntoIterator<Item = &'a LiveAlloc>,
        devices: &[(u32, i32)],
        wall_offset_ns: i64,
    ) {
        for a in live {
            let Some(op) = a.op() else { continue };
            self.live.insert(
                (pid, a.space, a.ptr),
                Held {
                    size: a.size,
                    device: a.device,
                    op,
                    ts: (a.ts_ns - wall_offset_ns).max(0) as u64,
                },
            );
        }
        for &(tid, device) in devices {
            self.devices.restore(pid, tid, device);
        }
    }

    /// `nests`: the runtime's and the driver's frees, one of which may call the other on the
    /// same pointer (kept per thread for the enclosing one, a map update a free).
    fn freed(&mut self, key: Key, call: &mut Call, nests: bool) {
        let thread = (call.pid, call.tid);
        let end = call.ts_mono_ns + call.duration_ns;
        let from_live = if call.ret == 0 {
            self.live.remove(&key)
        } else {
            self.live.get(&key).copied()
        }
        .map(|h| (h.size, h.device));
        let found = from_live.or_else(|| {
            if !nests {
                return None;
            }
            let inner = self.last_free.get(&thread).copied()?;
            let nested = inner.key == key && inner.ts >= call.ts_mono_ns && inner.end <= end;
            nested.then(|| {
                self.last_free.remove(&thread);
                (inner.size, inner.device)
            })
        });
        match found {
            Some((size, device)) => {
                call.size = Some(size);
                // The allocation's device; when it was made before its thread's device was
                // known, the thread's (a free runs on the device of what it frees).
                call.device = device.or(call.device);
                call.flags |= flags::SIZE_KNOWN;
            }
            None if key.2 != 0 => call.flags |= flags::FREE_UNMATCHED,
            None => {}
        }
        if let (Some((size, device)), 0, true) = (from_live, call.ret, nests) {
            self.last_free.insert(
                thread,
                Released {
                    key,
                    size,
                    device,
                    ts: call.ts_mono_ns,
                    end,
                },
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use tracer_common::Op;

    use super::*;

    fn call(op: Op, tid: u32, ts: u64, dur: u64, size: Option<u64>, ptr: u64, ret: i32) -> Call {
        Call {
            ts_mono_ns: ts,
            pid: 7,
            tid,
            op,
            device: None,
            ret,
            duration_ns: dur,
            size,
            ptr: Some(ptr),
            aux0: 0,
            aux1: 0,
            flags: 0,
            comm: String::new(),
            site: None,
            stack: None,
        }
    }

    fn set_device(tid: u32, d: i32) -> Call {
        let mut c = call(Op::CudaSetDevice, tid, 1, 1, None, 0, 0);
        c.ptr = None;
        c.device = Some(d);
        c
    }

    #[test]
    fn frees_carry_their_allocations_size_and_device() {
        let mut j = Join::live();
        j.apply(&mut set_device(1, 3));
        let mut a = call(Op::CudaMalloc, 1, 10, 5, Some(4096), 0x1000, 0);
        j.apply(&mut a);
        assert_eq!(a.device, Some(3), "the thread's device");
        // Freed by another thread, whose device is unknown: the allocation's device.
        let mut f = call(Op::CudaFree, 2, 20, 5, None, 0x1000, 0);
        j.apply(&mut f);
        assert_eq!((f.size, f.device), (Some(4096), Some(3)));
        assert_eq!(f.flags & flags::FREE_UNMATCHED, 0);
        // Freed again: unmatched.
        let mut again = call(Op::CudaFree, 2, 30, 5, None, 0x1000, 1);
        j.apply(&mut again);
        assert_eq!(again.size, None);
        assert_ne!(again.flags & flags::FREE_UNMATCHED, 0);
    }

    #[test]
    fn a_failed_free_keeps_the_allocation_live() {
        let mut j = Join::live();
        j.apply(&mut call(Op::CudaMalloc, 1, 10, 5, Some(512), 0x2000, 0));
        let mut failed = call(Op::CudaFree, 1, 20, 5, None, 0x2000, 400);
        j.apply(&mut failed);
        assert_eq!(failed.size, Some(512));
        let mut ok = call(Op::CudaFree, 1, 30, 5, None, 0x2000, 0);
        j.apply(&mut ok);
        assert_eq!(ok.size, Some(512));
    }

    #[test]
    fn a_nested_free_of_the_same_pointer_gives_both_the_size() {
        let mut j = Join::live();
        j.apply(&mut call(
            Op::CudaMalloc,
            1,
            10,
            5,
            Some(1 << 20),
            0x3000,
            0,
        ));
        // cudaFree enters at 100 and calls cuMemFree_v2 (100..150), which returns first.
        let mut inner = call(Op::CuMemFree, 1, 110, 40, None, 0x3000, 0);
        j.apply(&mut inner);
        let mut outer = call(Op::CudaFree, 1, 100, 60, None, 0x3000, 0);
        j.apply(&mut outer);
        assert_eq!((inner.size, outer.size), (Some(1 << 20), Some(1 << 20)));
        // A later, unrelated free of the pointer is not nested: unmatched.
        let mut later = call(Op::CudaFree, 1, 300, 10, None, 0x3000, 0);
        j.apply(&mut later);
        assert_eq!(later.size, None);
    }

    /// The allocator's probe fires once a free: a second free of a block at the same moment on
    /// the same thread is a free of a block not held, not the inner half of a nested pair.
    #[test]
    fn a_block_freed_twice_at_once_is_unmatched_the_second_time() {
        let mut j = Join::live();
        j.apply(&mut call(Op::TorchMalloc, 1, 10, 0, Some(512), 0x4000, 0));
        let mut first = call(Op::TorchFree, 1, 20, 0, None, 0x4000, 0);
        j.apply(&mut first);
        assert_eq!(first.size, Some(512));
        let mut second = call(Op::TorchFree, 1, 20, 0, None, 0x4000, 0);
        j.apply(&mut second);
        assert_eq!(second.size, None);
        assert_ne!(second.flags & flags::FREE_UNMATCHED, 0);
    }

    #[test]
    fn spaces_keep_pointers_apart_and_the_call_named_device_wins() {
        let mut j = Join::live();
        j.apply(&mut set_device(1, 0));
        let mut create = call(Op::CuMemCreate, 1, 10, 5, Some(2 << 20), 0x1, 0);
        create.device = Some(1);
        j.apply(&mut create);
        assert_eq!(
            create.device,
            Some(1),
            "cuMemCreate's properties name device 1"
        );
        j.apply(&mut call(Op::CudaMalloc, 1, 20, 5, Some(64), 0x1, 0));
        let mut release = call(Op::CuMemRelease, 1, 30, 5, None, 0x1, 0);
        j.apply(&mut release);
        assert_eq!((release.size, release.device), (Some(2 << 20), Some(1)));
        let mut free = call(Op::CudaFree, 1, 40, 5, None, 0x1, 0);
        j.apply(&mut free);
        assert_eq!((free.size, free.device), (Some(64), Some(0)));
    }
}
