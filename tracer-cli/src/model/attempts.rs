//! Device allocations as PyTorch counts them: one attempt per time its allocator asks the
//! device for memory, a failure per attempt the device refused for want of memory, a retry per
//! attempt made again after the cache was released, and the OOM it raised: the failed attempt
//! no retry followed.
//!
//! The real runtime's cudaMalloc calls the driver's cuMemAlloc_v2 (cudaFree cuMemFree_v2), and
//! both are traced: the driver call nested in a runtime call of the same thread is the same
//! request, counted once. Only out-of-memory returns are failures: expandable segments try a
//! shareable handle first and take "not permitted" (800) for an answer, not a failure. Every
//! room that counts failures, retries or OOMs (the live figures, the whole-run series, explain,
//! whatif, `layout --at oom`) counts them here.

use tracer_common::{Library, Op, OpClass, Space};

use super::{Event, FastMap};

/// cudaErrorMemoryAllocation and CUDA_ERROR_OUT_OF_MEMORY: the device has no room.
pub const OUT_OF_MEMORY: i32 = 2;

/// A failed attempt followed this soon by the same request is the allocator's retry after
/// releasing its cache (PyTorch's num_alloc_retries).
pub const RETRY_WITHIN_NS: i64 = 2_000_000_000;

/// The call asks the device for memory: a segment (cudaMalloc, cuMemAlloc*) or a physical
/// chunk (cuMemCreate, expandable segments).
pub fn is_device_alloc(op: Op) -> bool {
    let spec = op.spec();
    spec.class == OpClass::Alloc && matches!(spec.space, Space::Device | Space::Handle)
}

/// `inner`, a driver call, ran inside `outer`, a runtime call of the same thread: the runtime
/// made it on the program's behalf.
pub fn nested(inner: &Event, outer: &Event) -> bool {
    inner.pid == outer.pid
        && inner.tid == outer.tid
        && inner.op.spec().library == Library::Driver
        && outer.op.spec().library == Library::Runtime
        && inner.ts_ns >= outer.ts_ns
        && inner.end_ns() <= outer.end_ns()
}

/// One time the process asked the device for memory.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Attempt {
    pub event: Event,
    /// The device refused it for want of memory.
    pub failed: bool,
    /// It repeats the thread's failed attempt just before (same op and size): the allocator's
    /// retry after releasing its cache.
    pub retry: bool,
    /// Not a device call: a block PyTorch handed out on the thread right after its failed
    /// attempt, which it fits in: the allocator served the request from elsewhere (a
    /// `use_on_oom` pool's free block, PyTorch's last resort) and raised nothing.
    pub rescued: bool,
}

/// A block handed out this soon after the thread's failed attempt is that request served by
/// the allocator's last resort (PyTorch looks in the use_on_oom pools at once, in microseconds).
pub const RESCUED_WITHIN_NS: i64 = 50_000_000;

/// The memory calls a runtime call may make a driver call of (allocations, frees, memory
/// information).
fn nestable(op: Op) -> bool {
    let spec = op.spec();
    matches!(
        spec.class,
        OpClass::Alloc | OpClass::Free | OpClass::MemInfo
    ) && matches!(spec.library, Library::Runtime | Library::Driver)
}

/// One thread's memory calls so far.
#[derive(Clone, Copy, Debug, Default)]
struct Nest {
    /// The thread's latest runtime memory call: a driver call entered inside it is nested.
    outer: Option<Event>,
    /// A driver call not yet decided: in the order calls return, the runtime call that made it
    /// comes after it.
    held: Option<Event>,
}

/// Passes on the memory calls no other traced call made: a driver call nested in a runtime
/// call of its thread is the same request, told once. Takes the calls in the order they began
/// or the order they returned (a nested driver call comes after its runtime call in the one,
/// before it in the other); a driver call is passed on once the thread's next call shows it
/// was not nested, or at [`Outermost::finish`].
#[derive(Clone, Debug, Default)]
pub struct Outermost {
    /// Each thread's state: a short list searched from the thread seen last (a process has a
    /// few threads that call CUDA; a hash per call was a third of explain's time).
    threads: Vec<((u32, u32), Nest)>,
    last: usize,
    /// Threads holding a driver call: while none does, the calls that are not memory calls
    /// (PyTorch's block events, by far the most) pass without a lookup.
    holding: usize,
}

impl Outermost {
    /// Takes the next call; hands `out` the memory calls it decides are no other's.
    pub fn push(&mut self, e: &Event, out: &mut impl FnMut(Event)) {
        let memory = nestable(e.op);
        if !memory && self.holding == 0 {
            return;
        }
        let Some(i) = self.thread(e.pid, e.tid, memory) else {
            return;
        };
        if let Some(h) = self.threads[i].1.held.take() {
            self.holding -= 1;
            if !(memory && nested(&h, e)) {
                out(h);
            }
        }
        if !memory {
            return;
        }
        let t = &mut self.threads[i].1;
        if e.op.spec().library == Library::Driver {
            if !t.outer.is_some_and(|o| nested(e, &o)) {
                t.held = Some(*e);
                self.holding += 1;
            }
            return;
        }
        t.outer = Some(*e);
        out(*e);
    }

    /// Where the state of thread (pid, tid) is, made when `make` and it has none.
    fn thread(&mut self, pid: u32, tid: u32, make: bool) -> Option<usize> {
        let key = (pid, tid);
        let i = match self.threads.get(self.last) {
            Some((k, _)) if *k == key => self.last,
            _ => match self.threads.iter().position(|(k, _)| *k == key) {
                Some(i) => i,
                None if make => {
                    self.threads.push((key, Nest::default()));
                    self.threads.len() - 1
                }
                None => return None,
            },
        };
        self.last = i;
        Some(i)
    }

    /// Passes on the driver calls still held (the end of the calls).
    pub fn finish(&mut self, out: &mut impl FnMut(Event)) {
        self.finish_where(|_| true, out);
    }

    /// Passes on one process's held driver calls and forgets it (it ended).
    pub fn finish_process(&mut self, pid: u32, out: &mut impl FnMut(Event)) {
        self.finish_where(|p| p == pid, out);
        self.threads.retain(|(k, _)| k.0 != pid);
        self.last = 0;
    }

    fn finish_where(&mut self, of: impl Fn(u32) -> bool, out: &mut impl FnMut(Event)) {
        let mut held: Vec<Event> = self
            .threads
            .iter_mut()
            .filter(|(k, _)| of(k.0))
            .filter_map(|(_, t)| t.held.take())
            .collect();
        self.holding -= held.len();
        held.sort_by_key(|e| (e.ts_ns, e.tid));
        held.into_iter().for_each(out);
    }
}

/// A thread's failed attempt a retry would repeat.
#[derive(Clone, Debug, Default)]
struct Failures {
    last: FastMap<(u32, u32), Event>,
    /// Each thread's latest failed attempt, until its next attempt, block or OOM message.
    unraised: FastMap<(u32, u32), Event>,
}

impl Failures {
    /// A call that is no attempt: PyTorch's block handed out after a failed attempt (the
    /// request served without the device), or its OOM message (raised).
    fn after_failure(&mut self, e: &Event, out: &mut impl FnMut(Attempt)) {
        if self.unraised.is_empty() {
            return;
        }
        let class = e.op.spec().class;
        if !matches!(class, OpClass::BlockAlloc | OpClass::Oom) {
            return;
        }
        let Some(f) = self.unraised.remove(&(e.pid, e.tid)) else {
            return;
        };
        if class == OpClass::BlockAlloc
            && e.size <= f.size
            && e.ts_ns - f.ts_ns <= RESCUED_WITHIN_NS
        {
            self.last.remove(&(e.pid, e.tid));
            out(Attempt {
                event: *e,
                failed: false,
                retry: false,
                rescued: true,
            });
        }
    }

    fn decide(&mut self, e: Event, out: &mut impl FnMut(Attempt)) {
        if !is_device_alloc(e.op) || (e.ret != 0 && e.ret != OUT_OF_MEMORY) {
            // Not an allocation, or refused for another reason (an invalid value, a handle
            // type not permitted): no memory was asked of a full device.
            return;
        }
        let thread = (e.pid, e.tid);
        // Failures are rare: most attempts find none to repeat without a lookup.
        let last = if self.last.is_empty() {
            None
        } else {
            self.last.remove(&thread)
        };
        let retry = last.is_some_and(|f| {
            f.op == e.op && f.size == e.size && e.ts_ns - f.ts_ns <= RETRY_WITHIN_NS
        });
        let failed = e.ret == OUT_OF_MEMORY;
        if failed && !retry {
            self.last.insert(thread, e);
        }
        if failed {
            self.unraised.insert(thread, e);
        } else if !self.unraised.is_empty() {
            self.unraised.remove(&thread);
        }
        out(Attempt {
            event: e,
            failed,
            retry,
            rescued: false,
        });
    }
}

/// Follows each thread's device allocations and hands on each attempt once it is decided
/// (see [`Outermost`] for the order calls may come in).
#[derive(Clone, Debug, Default)]
pub struct Attempts {
    outermost: Outermost,
    failures: Failures,
}

impl Attempts {
    /// Takes the next call; hands `out` the attempts it decides.
    pub fn push(&mut self, e: &Event, out: &mut impl FnMut(Attempt)) {
        let failures = &mut self.failures;
        self.outermost.push(e, &mut |x| failures.decide(x, out));
        self.failures.after_failure(e, out);
    }

    /// Decides the driver allocations still held (the end of the calls).
    pub fn finish(&mut self, out: &mut impl FnMut(Attempt)) {
        let failures = &mut self.failures;
        self.outermost.finish(&mut |x| failures.decide(x, out));
    }

    /// Decides one process's held driver allocations and forgets it (it ended).
    pub fn finish_process(&mut self, pid: u32, out: &mut impl FnMut(Attempt)) {
        let failures = &mut self.failures;
        self.outermost
            .finish_process(pid, &mut |x| failures.decide(x, out));
        self.failures.last.retain(|k, _| k.0 != pid);
        self.failures.unraised.retain(|k, _| k.0 != pid);
    }
}

impl Attempt {
    /// A failure or a retry: what the counts, the OOM and the chains are made of. The other
    /// attempts only decide them (a retry is always the next attempt of its thread after the
    /// failure it repeats, so keeping these alone keeps [`raised`] and [`counts`] exact).
    pub fn notable(&self) -> bool {
        self.failed || self.retry || self.rescued
    }
}

/// The failures and retries among `evs` (one process's calls or many, in time order), in time
/// order: [`Attempt::notable`] ones only (a training job makes millions of successful ones).
pub fn attempts<'a>(evs: impl IntoIterator<Item = &'a Event>) -> Vec<Attempt> {
    let mut a = Attempts::default();
    let mut out = Vec::new();
    let mut keep = |x: Attempt| {
        if x.notable() {
            out.push(x);
        }
    };
    for e in evs {
        a.push(e, &mut keep);
    }
    a.finish(&mut keep);
    out.sort_by_key(|x| x.event.ts_ns);
    out
}

/// What the attempts add up to.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct Counts {
    pub failures: u64,
    pub retries: u64,
    /// Failed attempts no retry followed: the allocator gave up and raised.
    pub ooms: u64,
}

/// The failed attempts the allocator raised for (no retry of theirs followed), in time order:
/// PyTorch's OOMs as its allocator makes them. `attempts` may hold the notable ones only.
pub fn raised(attempts: &[Attempt]) -> Vec<Attempt> {
    attempts
        .iter()
        .enumerate()
        .filter(|(i, a)| {
            a.failed && {
                let next = attempts[i + 1..]
                    .iter()
                    .find(|b| b.event.pid == a.event.pid && b.event.tid == a.event.tid);
                !next.is_some_and(|b| b.retry || b.rescued)
            }
        })
        .map(|(_, a)| *a)
        .collect()
}

/// Failures, retries and raised OOMs of `attempts`.
pub fn counts(attempts: &[Attempt]) -> Counts {
    Counts {
        failures: attempts.iter().filter(|a| a.failed).count() as u64,
        retries: attempts.iter().filter(|a| a.retry).count() as u64,
        ooms: raised(attempts).len() as u64,
    }
}

/// The instant PyTorch first raised OutOfMemoryError: its message's time when the message was
/// recorded, else the first failed attempt no retry followed, else none. explain's OOM chain,
/// `layout --at oom`, the report, mcp and diff all take it from here.
pub fn oom_instant(attempts: &[Attempt], message_ns: Option<i64>) -> Option<i64> {
    message_ns.or_else(|| raised(attempts).first().map(|a| a.event.ts_ns))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn call(op: Op, tid: u32, ts_ns: i64, dur: u64, size: u64, ret: i32) -> Event {
        Event {
            ts_ns,
            duration_ns: dur,
            size,
            ptr: 0x1000,
            aux0: 0,
            aux1: 0,
            pid: 7,
            tid,
            ret,
            device: 0,
            stack: None,
            op,
        }
    }

    /// A cudaMalloc that fails, with the cuMemAlloc_v2 inside it; the cache released; the
    /// retry (cudaMalloc and its cuMemAlloc_v2) fails too: PyTorch's 1 retry and 1 OOM.
    fn default_oom() -> Vec<Event> {
        vec![
            call(Op::CudaMalloc, 1, 100, 50, 1 << 30, 2),
            call(Op::CuMemAlloc, 1, 110, 30, 1 << 30, 2),
            call(Op::CudaFree, 1, 200, 20, 1 << 20, 0),
            call(Op::CuMemFree, 1, 205, 10, 1 << 20, 0),
            call(Op::CudaMalloc, 1, 300, 50, 1 << 30, 2),
            call(Op::CuMemAlloc, 1, 310, 30, 1 << 30, 2),
        ]
    }

    #[test]
    fn a_driver_call_inside_a_runtime_call_is_one_attempt_in_either_order() {
        let by_entry = default_oom();
        let mut by_return = by_entry.clone();
        by_return.sort_by_key(Event::end_ns);
        for evs in [&by_entry, &by_return] {
            let a = attempts(evs.iter());
            assert_eq!(a.len(), 2, "the failure and its retry: {a:?}");
            assert!(a.iter().all(|x| x.event.op == Op::CudaMalloc));
            assert_eq!(
                counts(&a),
                Counts {
                    failures: 2,
                    retries: 1,
                    ooms: 1
                }
            );
            assert_eq!(
                oom_instant(&a, None),
                Some(300),
                "the retry's failure raised"
            );
        }
    }

    #[test]
    fn a_block_handed_out_right_after_the_failure_was_served_not_raised() {
        // The failure and its retry, then PyTorch's block of that request (from a use_on_oom
        // pool): no OOM. The same block after the OOM's message, or much later: raised.
        let block = |ts| call(Op::TorchMalloc, 1, ts, 0, 1 << 29, 0);
        let mut rescued = default_oom();
        rescued.push(block(400));
        let a = attempts(rescued.iter());
        assert_eq!(
            counts(&a),
            Counts {
                failures: 2,
                retries: 1,
                ooms: 0
            },
            "{a:?}"
        );
        assert!(a.last().unwrap().rescued);
        let mut raised_first = default_oom();
        raised_first.push(call(Op::TorchOom, 1, 350, 0, 0, 0));
        raised_first.push(block(400));
        assert_eq!(counts(&attempts(raised_first.iter())).ooms, 1);
        let mut later = default_oom();
        later.push(block(300 + RESCUED_WITHIN_NS + 1));
        assert_eq!(counts(&attempts(later.iter())).ooms, 1);
        let mut other_thread = default_oom();
        other_thread.push(call(Op::TorchMalloc, 2, 400, 0, 1 << 29, 0));
        assert_eq!(counts(&attempts(other_thread.iter())).ooms, 1);
    }

    #[test]
    fn a_driver_allocation_of_its_own_is_an_attempt() {
        // cuBLAS's workspace: cuMemAlloc_v2 outside any runtime call.
        let evs = [
            call(Op::CudaMalloc, 1, 100, 50, 1 << 20, 0),
            call(Op::CuMemAlloc, 1, 200, 30, 1 << 22, 2),
        ];
        let a = attempts(evs.iter());
        assert_eq!(a.len(), 1);
        assert_eq!(a[0].event.op, Op::CuMemAlloc);
    }

    #[test]
    fn only_out_of_memory_is_a_failure() {
        // Expandable segments: a fabric handle not permitted (800), then the chunk made; later
        // a chunk refused, the cache released, the retry's first chunk made and a later one
        // refused: PyTorch's 2 failures, 1 retry, 1 OOM.
        let chunk = 20 << 20;
        let evs = [
            call(Op::CuMemCreate, 1, 100, 5, chunk, 800),
            call(Op::CuMemCreate, 1, 110, 5, chunk, 0),
            call(Op::CuMemCreate, 1, 1_000, 5, chunk, 2),
            call(Op::CuMemRelease, 1, 1_010, 5, chunk, 0),
            call(Op::CuMemCreate, 1, 2_000, 5, chunk, 0),
            call(Op::CuMemCreate, 1, 2_010, 5, chunk, 2),
        ];
        let a = attempts(evs.iter());
        assert_eq!(
            a.len(),
            3,
            "the 800 is no attempt, the first chunk made not notable"
        );
        assert_eq!(
            counts(&a),
            Counts {
                failures: 2,
                retries: 1,
                ooms: 1
            }
        );
        assert_eq!(oom_instant(&a, None), Some(2_010));
    }

    #[test]
    fn a_recovered_failure_is_not_the_oom() {
        let gib = 1 << 30;
        let evs = [
            call(Op::CudaMalloc, 1, 0, 10, gib, 2),
            call(Op::CudaFree, 1, 100, 10, gib, 0),
            call(Op::CudaMalloc, 1, 200, 10, gib, 0),
            // Seconds later: another request fails twice and is raised.
            call(Op::CudaMalloc, 1, 5_000_000_000, 10, 2 * gib, 2),
            call(Op::CudaMalloc, 1, 5_000_000_100, 10, 2 * gib, 2),
        ];
        let a = attempts(evs.iter());
        assert_eq!(
            counts(&a),
            Counts {
                failures: 3,
                retries: 2,
                ooms: 1
            }
        );
        assert_eq!(oom_instant(&a, None), Some(5_000_000_100));
        assert_eq!(oom_instant(&a, Some(5_000_000_200)), Some(5_000_000_200));
    }

    #[test]
    fn threads_are_apart() {
        // Two threads' failures interleave: each its own request.
        let evs = [
            call(Op::CudaMalloc, 1, 0, 10, 4096, 2),
            call(Op::CudaMalloc, 2, 5, 10, 4096, 0),
            call(Op::CudaMalloc, 1, 20, 10, 4096, 0),
        ];
        let a = attempts(evs.iter());
        assert_eq!(counts(&a).retries, 1);
        // Thread 2's success is no retry of thread 1's failure: not kept.
        assert!(a.iter().all(|x| x.event.tid == 1), "{a:?}");
    }
}
