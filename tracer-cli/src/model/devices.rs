//! The device a call ran on, as CUDA defines it: a thread's current device is the one its last
//! successful cudaSetDevice chose, or the device of the context its last cuCtxSetCurrent made
//! current; a thread that did neither is on device 0. PyTorch relies on that default: on
//! device 0 it never calls cudaSetDevice (it sets a device only to change it), so a process on
//! one GPU makes no call that names its device.
//!
//! The default holds only for a thread tracer saw from its start. For a process that ran
//! before the trace began, a thread's device is learned from PyTorch's own probe
//! (`pytorch:malloc` names the current device of the thread that allocates); the calls it made
//! before that are on the same device when no cudaSetDevice came between, which the read side
//! settles by looking ahead ([`Initial`]). Otherwise the device stays unknown, never guessed.
//!
//! The recording (record/join.rs) and every read of a stored session (query/mod.rs) resolve
//! devices here, so a recording made before this rule reads the same as one made after.

use std::collections::{HashMap, HashSet};

use super::FastMap;

use tracer_common::{Op, OpClass};

/// What a thread's device is known to be.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Current {
    Device(i32),
    /// It made a context current whose device tracer did not see handed out.
    Unknown,
}

/// The calls that tell a thread's device, and the device each thread is on.
#[derive(Clone, Debug, Default)]
pub struct ThreadDevices {
    threads: FastMap<(u32, u32), Current>,
    /// Each process's contexts: (pid, context) -> device.
    contexts: FastMap<(u32, u64), i32>,
    /// Processes tracer saw from their start: a thread that set no device is on device 0.
    whole: FastMap<u32, ()>,
    /// Threads' devices before their first cudaSetDevice, learned from a later probe.
    initial: Initial,
}

/// The device each thread was on before it first set one, where a later `pytorch:malloc` of
/// the same thread (before any set) tells it: the read side's look ahead.
pub type Initial = HashMap<(u32, u32), i32>;

/// A thread's device learned after calls of it were stored without one: they ran from
/// `from_ns` to `to_ns` (the recording's clock) on `device`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Learned {
    pub pid: u32,
    pub tid: u32,
    pub device: i32,
    pub from_ns: i64,
    pub to_ns: i64,
}

impl ThreadDevices {
    /// A process tracer saw start (it started after the trace began): its threads that set no
    /// device are on device 0.
    pub fn seen_whole(&mut self, pid: u32) {
        self.whole.insert(pid, ());
    }

    pub fn is_whole(&self, pid: u32) -> bool {
        self.whole.contains_key(&pid)
    }

    /// Threads' first devices learned by looking ahead.
    pub fn learn_initial(&mut self, initial: Initial) {
        self.initial.extend(initial);
    }

    /// A thread's device as a keyframe held it.
    pub fn restore(&mut self, pid: u32, tid: u32, device: i32) {
        self.threads.insert((pid, tid), Current::Device(device));
    }

    /// Forgets an ended process (a later one may reuse its pid).
    pub fn forget_process(&mut self, pid: u32) {
        self.threads.retain(|k, _| k.0 != pid);
        self.contexts.retain(|k, _| k.0 != pid);
        self.whole.remove(&pid);
        self.initial.retain(|k, _| k.0 != pid);
    }

    /// The processes with a thread whose device is known.
    pub fn processes(&self) -> Vec<u32> {
        let mut pids: Vec<u32> = self.threads.keys().map(|k| k.0).collect();
        pids.sort_unstable();
        pids.dedup();
        pids
    }

    /// The threads whose device is known, for a keyframe.
    pub fn known(&self, pid: u32) -> Vec<(u32, i32)> {
        let mut out: Vec<(u32, i32)> = self
            .threads
            .iter()
            .filter_map(|(&(p, tid), c)| match *c {
                Current::Device(d) if p == pid => Some((tid, d)),
                _ => None,
            })
            .collect();
        out.sort_unstable();
        out
    }

    /// Takes in one call (in the order the thread made them) and returns its device: the one
    /// the call names (`named`: cudaSetDevice's argument, cuMemCreate's location, a free's
    /// allocation), else its thread's, else None.
    pub fn apply(
        &mut self,
        pid: u32,
        tid: u32,
        op: Op,
        ret: i32,
        ptr: u64,
        named: Option<i32>,
    ) -> Option<i32> {
        let thread = (pid, tid);
        match op.spec().class {
            OpClass::SetDevice => {
                if let (0, Some(d)) = (ret, named) {
                    self.threads.insert(thread, Current::Device(d));
                }
                return named;
            }
            OpClass::Context => {
                if let (0, Some(d)) = (ret, named) {
                    self.contexts.insert((pid, ptr), d);
                }
                return named;
            }
            OpClass::SetContext if ret == 0 && ptr != 0 => {
                let now = match self.contexts.get(&(pid, ptr)) {
                    Some(&d) => Current::Device(d),
                    None => Current::Unknown,
                };
                self.threads.insert(thread, now);
            }
            // PyTorch's allocator asks for the thread's current device and names it.
            OpClass::BlockAlloc => {
                if let Some(d) = named.filter(|d| *d >= 0) {
                    // The same device as before, nearly always: no write.
                    if self.threads.get(&thread) != Some(&Current::Device(d)) {
                        self.threads.insert(thread, Current::Device(d));
                    }
                }
                return named;
            }
            _ => {}
        }
        named.or_else(|| {
            let d = self.current(pid, tid)?;
            // Learned or defaulted once: the thread's own entry from now on.
            self.threads.entry(thread).or_insert(Current::Device(d));
            Some(d)
        })
    }

    /// The device of a thread now, if known.
    pub fn current(&self, pid: u32, tid: u32) -> Option<i32> {
        match self.threads.get(&(pid, tid)) {
            Some(Current::Device(d)) => Some(*d),
            Some(Current::Unknown) => None,
            None => self
                .initial
                .get(&(pid, tid))
                .copied()
                .or_else(|| self.whole.contains_key(&pid).then_some(0)),
        }
    }
}

/// Looks ahead over one session's calls (in time order) for the device each thread was on
/// before it set one: its first `pytorch:malloc` before any cudaSetDevice or cuCtxSetCurrent
/// of its own. `wanted` says which threads still need it; the look ahead stops once none do.
#[derive(Debug, Default)]
pub struct LookAhead {
    wanted: HashSet<(u32, u32)>,
    found: Initial,
}

impl LookAhead {
    pub fn new(wanted: HashSet<(u32, u32)>) -> LookAhead {
        LookAhead {
            wanted,
            found: Initial::new(),
        }
    }

    /// Takes the next call; false once nothing more is wanted.
    pub fn take(&mut self, pid: u32, tid: u32, op: Op, ret: i32, device: i32) -> bool {
        let thread = (pid, tid);
        if !self.wanted.contains(&thread) {
            return !self.wanted.is_empty();
        }
        match op.spec().class {
            OpClass::SetDevice | OpClass::SetContext if ret == 0 => {
                // The thread changed device before telling which it was on: unknown.
                self.wanted.remove(&thread);
            }
            OpClass::BlockAlloc if device >= 0 => {
                self.found.insert(thread, device);
                self.wanted.remove(&thread);
            }
            _ => {}
        }
        !self.wanted.is_empty()
    }

    pub fn found(self) -> Initial {
        self.found
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(d: &mut ThreadDevices, tid: u32, op: Op, ptr: u64, named: Option<i32>) -> Option<i32> {
        d.apply(7, tid, op, 0, ptr, named)
    }

    #[test]
    fn a_thread_that_set_no_device_is_on_device_0_when_seen_whole() {
        let mut d = ThreadDevices::default();
        assert_eq!(
            at(&mut d, 1, Op::CudaMalloc, 0, None),
            None,
            "not seen whole"
        );
        d.seen_whole(7);
        assert_eq!(at(&mut d, 1, Op::CudaMalloc, 0, None), Some(0));
        assert_eq!(at(&mut d, 2, Op::CudaSetDevice, 0, Some(1)), Some(1));
        assert_eq!(at(&mut d, 2, Op::CudaMalloc, 0, None), Some(1));
        assert_eq!(
            at(&mut d, 1, Op::CudaFree, 0, None),
            Some(0),
            "threads apart"
        );
        // A free names its allocation's device.
        assert_eq!(at(&mut d, 1, Op::CudaFree, 0, Some(1)), Some(1));
    }

    #[test]
    fn contexts_carry_their_device() {
        let mut d = ThreadDevices::default();
        d.seen_whole(7);
        at(&mut d, 1, Op::CuDevicePrimaryCtxRetain, 0xc1, Some(1));
        at(&mut d, 3, Op::CuCtxSetCurrent, 0xc1, None);
        assert_eq!(at(&mut d, 3, Op::CuMemAlloc, 0, None), Some(1));
        // A context tracer did not see handed out: unknown, not the default.
        at(&mut d, 3, Op::CuCtxSetCurrent, 0xc9, None);
        assert_eq!(at(&mut d, 3, Op::CuMemAlloc, 0, None), None);
    }

    #[test]
    fn pytorch_names_the_threads_device() {
        let mut d = ThreadDevices::default();
        at(&mut d, 1, Op::TorchMalloc, 0x10, Some(2));
        assert_eq!(at(&mut d, 1, Op::CudaMalloc, 0, None), Some(2));
        // Learned ahead: the calls before the first probe.
        let mut ahead = LookAhead::new([(7, 4), (7, 5)].into_iter().collect());
        assert!(ahead.take(7, 4, Op::CudaMalloc, 0, -1));
        assert!(ahead.take(7, 5, Op::CudaSetDevice, 0, 1), "5 set one first");
        assert!(
            !ahead.take(7, 4, Op::TorchMalloc, 0, 3),
            "nothing more wanted"
        );
        d.learn_initial(ahead.found());
        assert_eq!(at(&mut d, 4, Op::CudaMalloc, 0, None), Some(3));
        assert_eq!(at(&mut d, 5, Op::CudaMalloc, 0, None), None);
    }
}
