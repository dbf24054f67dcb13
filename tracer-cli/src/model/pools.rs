//! Private pools: the memory CUDA graphs' captures and `torch.cuda.MemPool` hold apart from the
//! default pools. A segment belongs to one pool for its life; only requests routed to that pool
//! (a capture into it, code under `use_mem_pool`) may use its free blocks, so its free bytes are
//! not the default cache's.
//!
//! Where tracer knows a segment's pool: a memory snapshot's `segment_pool_id` (the import writes
//! it into the aux1 of the call that made the segment, tagged so that no traced call's aux1 is
//! read as one). Segments tracer saw made without such a word are in the default pools as far
//! as it knows.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// PyTorch's `MempoolId_t`: (captures' own ids, user-made ids); (0, 0) is the default pool.
pub type PoolId = (u64, u64);

/// Marks an aux1 that holds a pool id: above any address or size a probe copies there.
const POOL_ID_TAG: u64 = 1 << 63;

/// An imported segment's pool id, for the aux1 of the call that made it (each half of the id is
/// a counter PyTorch bumps once per pool: 31 bits are kept).
pub fn pool_id_to_aux1(id: PoolId) -> u64 {
    POOL_ID_TAG | ((id.0 & 0x7fff_ffff) << 32) | (id.1 & 0xffff_ffff)
}

/// The pool id a segment-making call's aux1 carries, if the import put one there.
pub fn pool_id_in_aux1(aux1: u64) -> Option<PoolId> {
    (aux1 & POOL_ID_TAG != 0).then_some(((aux1 >> 32) & 0x7fff_ffff, aux1 & 0xffff_ffff))
}

/// Each segment's private pool, by the segment's address. Kept in keyframes after the state
/// (model/state.rs, format 4).
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct PrivatePools {
    of_segment: BTreeMap<u64, PoolId>,
}

impl PrivatePools {
    pub fn made(&mut self, addr: u64, aux1: u64) {
        match pool_id_in_aux1(aux1) {
            Some(id) if id != (0, 0) => {
                self.of_segment.insert(addr, id);
            }
            _ => {
                self.of_segment.remove(&addr);
            }
        }
    }

    /// A capture routed the first block of the segment at `addr` to pool `id`.
    pub fn routed(&mut self, addr: u64, id: PoolId) {
        self.of_segment.insert(addr, id);
    }

    pub fn released(&mut self, addr: u64) {
        self.of_segment.remove(&addr);
    }

    /// The private pool of the segment at `addr`; None: a default pool.
    pub fn of(&self, addr: u64) -> Option<PoolId> {
        self.of_segment.get(&addr).copied()
    }

    pub fn is_empty(&self) -> bool {
        self.of_segment.is_empty()
    }
}

/// What the process's CUDA graph captures route where, learned from the capture calls in the
/// order they were made (PyTorch's rules, c10/cuda/CUDACachingAllocator.cpp and
/// aten/src/ATen/cuda/CUDAGraph.cpp): while a stream captures, the allocator's requests on it
/// and on every stream joined to the capture (by waiting on an event recorded on a capturing
/// stream) go to the capture's private pool. PyTorch's `CUDAGraph::capture_begin` names the
/// pool where graphs share one; a new pool gets the next id PyTorch's own counter gives
/// ((1, 0), (2, 0), ...), which tracer counts from the captures it saw. Kept in keyframes after
/// the pools (model/state.rs, format 5).
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct Captures {
    /// Streams capturing now -> the pool their requests go to.
    streams: BTreeMap<u64, PoolId>,
    /// Per thread, the CUDAGraph and pool its `capture_begin` chose, until its stream begins
    /// capturing (inside that same call).
    announced: BTreeMap<u32, (u64, PoolId)>,
    /// Each CUDAGraph object (its address) -> its pool, from capture_begin to reset.
    graphs: BTreeMap<u64, PoolId>,
    /// Pools captures were made into: how many, and how many graphs still use each.
    pools: BTreeMap<PoolId, PoolUse>,
    /// Events recorded on a capturing stream -> that capture's pool.
    events: BTreeMap<u64, PoolId>,
    /// The last graph-pool id handed out (PyTorch's counter starts at 1).
    last_numbered: u64,
    /// Threads whose requests a routing outside any capture sends to a pool (`use_mem_pool`,
    /// torch.compile's graph trees' warm-up), from the allocator's beginAllocateToPool.
    #[serde(default)]
    threads: BTreeMap<u32, PoolId>,
}

/// What tracer saw of one private pool's captures.
#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct PoolUse {
    pub captures: u32,
    /// Graphs holding the pool (PyTorch's use_count): at 0 the pool is freeable, and its
    /// segments with no live block go back at the next cache flush.
    pub graphs: u32,
    /// Its id was counted by tracer (a new pool PyTorch numbered itself): right when tracer saw
    /// every capture of the process, else tracer's own numbering.
    pub numbered: bool,
    /// Wall ns of its first capture, or of its making (a MemPool) where no capture came first.
    pub first_ns: i64,
    /// PyTorch's allocator's own pool calls were seen (libc10_cuda's pool methods probed):
    /// `uses` is then the pool's use count, else only `graphs` is known.
    #[serde(default)]
    pub probed: bool,
    /// The pool's use count as the allocator keeps it: made or routed to +1, released -1.
    #[serde(default)]
    pub uses: u32,
    /// Made by `torch.cuda.MemPool` (createOrIncrefPool seen) rather than by a capture.
    #[serde(default)]
    pub made: bool,
    /// Times requests were routed to it outside a capture (`use_mem_pool`, a warm-up).
    #[serde(default)]
    pub routed: u32,
    /// Marked `use_on_oom`: a request the default pool cannot serve may take its free blocks
    /// as a last resort, before the OOM.
    #[serde(default)]
    pub use_on_oom: bool,
}

impl PoolUse {
    /// Nothing holds the pool any more: its segments with no live block go back at the next
    /// flush.
    pub fn freeable(&self) -> bool {
        match (self.probed, self.made || self.captures > 0) {
            (false, _) => self.graphs == 0,
            (true, true) => self.uses == 0,
            // Only routed to: made before tracer saw it, so its count is not known.
            (true, false) => false,
        }
    }

    /// A torch.cuda.MemPool's (made by createOrIncrefPool, or routed to with no capture),
    /// not a CUDA graph's.
    pub fn mem_pool(&self) -> bool {
        self.made || (self.captures == 0 && self.routed > 0)
    }

    /// Made by the user (torch.cuda.MemPool, or graph_pool_handle for graphs that share):
    /// PyTorch numbers those (0, n).
    pub fn user_made(id: PoolId) -> bool {
        id.0 == 0 && id.1 != 0
    }
}

impl Captures {
    /// Applies one of the process's calls (in time order); false where it is no capture call.
    pub fn apply(&mut self, e: &super::Event) -> bool {
        use tracer_common::OpClass;
        match e.class() {
            OpClass::PoolCapture => self.announce(e.tid, e.ptr, (e.aux0, e.aux1), e.ts_ns),
            OpClass::CaptureBegin if e.ret == 0 => self.begin(e.tid, e.aux0, e.ts_ns),
            OpClass::EventRecord if e.ret == 0 => self.recorded(e.ptr, e.aux0),
            OpClass::StreamWait if e.ret == 0 => self.waited(e.aux0, e.ptr),
            // A failed end capture still ends it (the capture is invalidated).
            OpClass::CaptureEnd => self.end(e.aux0),
            OpClass::PoolCaptured => self.captured(e.ptr),
            OpClass::PoolReset => self.reset(e.ptr),
            OpClass::PoolRoute => self.route_begin(e.tid, (e.aux0, e.aux1), e.ts_ns),
            OpClass::PoolUnroute => self.route_end((e.aux0, e.aux1)),
            OpClass::PoolRelease => self.pool_released((e.aux0, e.aux1)),
            OpClass::PoolCreate => self.pool_made((e.aux0, e.aux1), e.ts_ns),
            OpClass::PoolOnOom => self.entry((e.aux0, e.aux1), e.ts_ns).use_on_oom = e.size != 0,
            _ => return false,
        }
        true
    }

    /// PyTorch's `CUDAGraph::capture_begin(pool)` on a thread: (0, 0) asks for a new pool.
    pub fn announce(&mut self, tid: u32, graph: u64, pool: PoolId, ts_ns: i64) {
        let id = if pool == (0, 0) { self.next_id() } else { pool };
        let numbered = pool == (0, 0);
        let entry = self.pools.entry(id).or_insert(PoolUse {
            numbered,
            first_ns: ts_ns,
            ..PoolUse::default()
        });
        entry.captures += 1;
        entry.graphs += 1;
        if let Some(old) = self.graphs.insert(graph, id) {
            // Captured again without a reset: the old capture's hold ends.
            self.release(old);
        }
        self.announced.insert(tid, (graph, id));
    }

    fn entry(&mut self, id: PoolId, ts_ns: i64) -> &mut PoolUse {
        self.pools.entry(id).or_insert(PoolUse {
            first_ns: ts_ns,
            ..PoolUse::default()
        })
    }

    /// The allocator's beginAllocateToPool on thread `tid`: inside a capture_begin, the
    /// capture's pool (its real id, where tracer had counted one); else the thread's requests
    /// go to the pool until its endAllocateToPool.
    pub fn route_begin(&mut self, tid: u32, id: PoolId, ts_ns: i64) {
        if let Some(&(graph, counted)) = self.announced.get(&tid) {
            if counted != id {
                self.renumber(counted, id);
                self.announced.insert(tid, (graph, id));
            }
            let p = self.entry(id, ts_ns);
            p.numbered = false;
            p.probed = true;
            p.uses += 1;
            return;
        }
        let p = self.entry(id, ts_ns);
        p.probed = true;
        p.uses += 1;
        p.routed += 1;
        self.threads.insert(tid, id);
    }

    /// A pool tracer had numbered itself turns out to be `real` (the allocator said).
    fn renumber(&mut self, counted: PoolId, real: PoolId) {
        if let Some(mut p) = self.pools.remove(&counted) {
            p.numbered = false;
            let into = self.pools.entry(real).or_insert(PoolUse {
                first_ns: p.first_ns,
                ..PoolUse::default()
            });
            into.captures += p.captures;
            into.graphs += p.graphs;
            into.first_ns = into.first_ns.min(p.first_ns);
        }
        for v in self.graphs.values_mut().chain(self.streams.values_mut()) {
            if *v == counted {
                *v = real;
            }
        }
        if counted.1 == 0 && counted.0 == self.last_numbered && real.1 == 0 {
            self.last_numbered = real.0;
        }
    }

    /// endAllocateToPool: every routing to the pool ends (a capture's, a thread's).
    pub fn route_end(&mut self, id: PoolId) {
        self.threads.retain(|_, p| *p != id);
    }

    /// releasePool: the pool's use count falls by one.
    pub fn pool_released(&mut self, id: PoolId) {
        if let Some(p) = self.pools.get_mut(&id) {
            p.probed = true;
            p.uses = p.uses.saturating_sub(1);
        }
    }

    /// createOrIncrefPool: a MemPool made (or its count raised).
    pub fn pool_made(&mut self, id: PoolId, ts_ns: i64) {
        let p = self.entry(id, ts_ns);
        p.probed = true;
        p.made = true;
        p.uses += 1;
    }

    fn next_id(&mut self) -> PoolId {
        self.last_numbered += 1;
        (self.last_numbered, 0)
    }

    /// A stream began capturing on thread `tid`: into the pool its capture_begin announced, or
    /// where no PyTorch probe said (another framework, libtorch_cuda not probed) a new one.
    pub fn begin(&mut self, tid: u32, stream: u64, ts_ns: i64) {
        let id = match self.announced.remove(&tid) {
            Some((_, id)) => id,
            None => {
                let id = self.next_id();
                let entry = self.pools.entry(id).or_insert(PoolUse {
                    numbered: true,
                    first_ns: ts_ns,
                    ..PoolUse::default()
                });
                entry.captures += 1;
                id
            }
        };
        self.streams.insert(stream, id);
    }

    /// An event recorded on `stream`: a stream waiting on it later joins the capture.
    pub fn recorded(&mut self, event: u64, stream: u64) {
        match self.streams.get(&stream) {
            Some(&id) => {
                self.events.insert(event, id);
            }
            None => {
                self.events.remove(&event);
            }
        }
    }

    /// `stream` waits on `event`: joined to the capture the event was recorded in.
    pub fn waited(&mut self, stream: u64, event: u64) {
        if let Some(&id) = self.events.get(&event) {
            self.streams.insert(stream, id);
        }
    }

    /// The capture on `stream` ended: it and every stream joined to it stop routing.
    pub fn end(&mut self, stream: u64) {
        if let Some(id) = self.streams.remove(&stream) {
            self.streams.retain(|_, p| *p != id);
            self.events.retain(|_, p| *p != id);
        }
    }

    /// PyTorch's capture_end for `graph`: routing to its pool ends (the stream's own end
    /// capture came just before, inside it).
    pub fn captured(&mut self, graph: u64) {
        if let Some(&id) = self.graphs.get(&graph) {
            self.streams.retain(|_, p| *p != id);
        }
    }

    /// CUDAGraph::reset: the graph lets go of its pool.
    pub fn reset(&mut self, graph: u64) {
        if let Some(id) = self.graphs.remove(&graph) {
            self.release(id);
        }
    }

    fn release(&mut self, id: PoolId) {
        if let Some(p) = self.pools.get_mut(&id) {
            p.graphs = p.graphs.saturating_sub(1);
        }
    }

    /// The pool CUDAGraph object `graph` holds.
    pub fn pool_of_graph(&self, graph: u64) -> Option<PoolId> {
        self.graphs.get(&graph).copied()
    }

    /// The pool a request on `stream` from thread `tid` goes to now: a capture's (by stream),
    /// else a routing of the thread's (`use_mem_pool`). A graph trees' warm-up routes the
    /// current stream's requests, which tracer cannot read: it routes by the thread that
    /// began it, the same requests where one thread drives the stream.
    pub fn route(&self, tid: u32, stream: u64) -> Option<PoolId> {
        self.streams
            .get(&stream)
            .or_else(|| self.threads.get(&tid))
            .copied()
    }

    /// Whether a capture is underway.
    pub fn capturing(&self) -> bool {
        !self.streams.is_empty()
    }

    /// Whether any routing to a pool is underway (a capture, `use_mem_pool`): PyTorch's
    /// allocator runs no cache flush, and so no retry, while its list of them is not empty.
    pub fn underway(&self) -> bool {
        !self.streams.is_empty() || !self.threads.is_empty()
    }

    /// Pools marked use_on_oom that nothing released yet: an OOM tried their free blocks.
    pub fn use_on_oom(&self) -> Vec<PoolId> {
        self.pools
            .iter()
            .filter(|(_, p)| p.use_on_oom && !(p.probed && p.uses == 0))
            .map(|(id, _)| *id)
            .collect()
    }

    /// What tracer saw of pool `id`'s captures, if any.
    pub fn pool(&self, id: PoolId) -> Option<PoolUse> {
        self.pools.get(&id).copied()
    }
}

/// One private pool on one device at a moment.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct PrivatePool {
    pub id: PoolId,
    pub device: i32,
    pub segments: u64,
    pub reserved: u64,
    pub allocated: u64,
    /// Free bytes inside it: only requests routed to this pool may use them.
    pub free: u64,
    pub free_blocks: u64,
    pub largest_free: u64,
    /// Its segments mapped with the driver's virtual memory calls (cuMemCreate, cuMemMap)
    /// rather than cudaMalloc'd: another allocator's (NCCL's ncclMemAlloc), or expandable
    /// segments.
    #[serde(skip_serializing_if = "is_zero")]
    pub mapped_segments: u64,
    /// What tracer saw of its captures (none: known from a snapshot's segment_pool_id only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub captures: Option<PoolUse>,
    /// Where its first capture was made ("serve.py:88 (capture)"), where `--stack` recorded it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub captured_at: Option<String>,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    const MAIN: u32 = 10;
    const SIDE_STREAM: u64 = 0x5000;
    const JOINED_STREAM: u64 = 0x6000;
    const GRAPH: u64 = 0x9000;

    #[test]
    fn a_capture_routes_its_stream_and_the_streams_joined_to_it_until_it_ends() {
        let mut c = Captures::default();
        // PyTorch's capture_begin with no pool given: PyTorch numbers a new one (1, 0).
        c.announce(MAIN, GRAPH, (0, 0), 100);
        assert_eq!(
            c.route(0, SIDE_STREAM),
            None,
            "routing begins with the stream's capture"
        );
        c.begin(MAIN, SIDE_STREAM, 101);
        assert_eq!(c.route(0, SIDE_STREAM), Some((1, 0)));
        assert!(c.underway());
        // An event recorded on the capturing stream, waited on by another: joined.
        c.recorded(0xe1, SIDE_STREAM);
        c.recorded(0xe2, 0);
        c.waited(JOINED_STREAM, 0xe2);
        assert_eq!(
            c.route(0, JOINED_STREAM),
            None,
            "an event of an eager stream joins nothing"
        );
        c.waited(JOINED_STREAM, 0xe1);
        assert_eq!(c.route(0, JOINED_STREAM), Some((1, 0)));
        c.end(SIDE_STREAM);
        assert_eq!(
            (c.route(0, SIDE_STREAM), c.route(0, JOINED_STREAM)),
            (None, None)
        );
        assert!(!c.underway());
        let used = c.pool((1, 0)).unwrap();
        assert_eq!((used.captures, used.graphs, used.numbered), (1, 1, true));
    }

    #[test]
    fn graphs_share_a_given_pool_and_release_it_at_reset() {
        let mut c = Captures::default();
        for (i, graph) in [GRAPH, GRAPH + 64].into_iter().enumerate() {
            c.announce(MAIN, graph, (0, 1), 100 + i as i64);
            c.begin(MAIN, SIDE_STREAM, 101 + i as i64);
            assert_eq!(c.route(0, SIDE_STREAM), Some((0, 1)));
            c.end(SIDE_STREAM);
            c.captured(graph);
        }
        let used = c.pool((0, 1)).unwrap();
        assert_eq!((used.captures, used.graphs, used.numbered), (2, 2, false));
        c.reset(GRAPH);
        assert_eq!(
            c.pool((0, 1)).unwrap().graphs,
            1,
            "the other graph still holds it"
        );
        c.reset(GRAPH + 64);
        c.reset(GRAPH + 64);
        assert_eq!(
            c.pool((0, 1)).unwrap().graphs,
            0,
            "freeable: no graph holds it"
        );
        // A new capture of its own after a shared one gets PyTorch's next graph-pool number.
        c.announce(MAIN, GRAPH, (0, 0), 200);
        c.begin(MAIN, SIDE_STREAM, 201);
        assert_eq!(c.route(0, SIDE_STREAM), Some((1, 0)));
    }

    #[test]
    fn a_capture_no_pytorch_probe_announced_gets_the_next_new_pool() {
        let mut c = Captures::default();
        c.begin(MAIN, SIDE_STREAM, 1);
        c.end(SIDE_STREAM);
        c.begin(MAIN + 1, JOINED_STREAM, 2);
        assert_eq!(c.route(0, JOINED_STREAM), Some((2, 0)));
        assert!(c.pool((1, 0)).unwrap().numbered);
        // A failed end capture still ends it.
        c.end(JOINED_STREAM);
        assert!(!c.underway());
    }

    #[test]
    fn the_allocators_own_call_gives_a_new_capture_pool_its_real_id() {
        let mut c = Captures::default();
        // capture_begin((0, 0)): tracer counts (1, 0); PyTorch had numbered others before the
        // trace, and beginAllocateToPool says (4, 0).
        c.announce(MAIN, GRAPH, (0, 0), 100);
        c.route_begin(MAIN, (4, 0), 100);
        c.begin(MAIN, SIDE_STREAM, 101);
        assert_eq!(c.route(MAIN, SIDE_STREAM), Some((4, 0)));
        assert_eq!(
            c.route(MAIN, 0),
            None,
            "a capture routes by stream, not thread"
        );
        c.end(SIDE_STREAM);
        c.route_end((4, 0));
        c.captured(GRAPH);
        assert_eq!(c.pool((1, 0)), None, "the counted id is gone");
        let p = c.pool((4, 0)).unwrap();
        assert_eq!((p.captures, p.graphs, p.uses, p.numbered), (1, 1, 1, false));
        assert_eq!(c.pool_of_graph(GRAPH), Some((4, 0)));
        // The next new pool follows PyTorch's own counter.
        c.announce(MAIN, GRAPH + 64, (0, 0), 200);
        c.begin(MAIN, SIDE_STREAM, 201);
        assert_eq!(c.route(MAIN, SIDE_STREAM), Some((5, 0)));
        c.end(SIDE_STREAM);
        // reset, then releasePool: freeable at use count 0.
        c.reset(GRAPH);
        assert!(
            !c.pool((4, 0)).unwrap().freeable(),
            "the allocator's count says held"
        );
        c.pool_released((4, 0));
        assert!(c.pool((4, 0)).unwrap().freeable());
    }

    #[test]
    fn use_mem_pool_routes_its_thread_until_it_ends_and_the_pool_frees_at_use_count_0() {
        let mut c = Captures::default();
        let other = MAIN + 1;
        // torch.cuda.MemPool(): createOrIncrefPool; use_mem_pool: begin .. end, release.
        c.pool_made((0, 1), 50);
        c.route_begin(MAIN, (0, 1), 60);
        assert_eq!(c.route(MAIN, 0), Some((0, 1)), "any stream of the thread");
        assert_eq!(c.route(MAIN, SIDE_STREAM), Some((0, 1)));
        assert_eq!(
            c.route(other, 0),
            None,
            "another thread's requests stay default"
        );
        assert!(c.underway() && !c.capturing(), "no flush while it routes");
        c.route_end((0, 1));
        c.pool_released((0, 1));
        assert_eq!(c.route(MAIN, 0), None);
        assert!(!c.underway());
        let p = c.pool((0, 1)).unwrap();
        assert!(
            p.made && p.probed && !p.freeable(),
            "the MemPool object holds it"
        );
        assert_eq!((p.uses, p.routed, p.first_ns), (1, 1, 50));
        assert!(PoolUse::user_made((0, 1)) && !PoolUse::user_made((1, 0)));
        // ~MemPool: released; its segments go at the next flush.
        c.pool_released((0, 1));
        assert!(c.pool((0, 1)).unwrap().freeable());
    }

    #[test]
    fn a_graph_trees_warm_up_routes_to_the_graphs_pool_outside_capture() {
        // torch.compile's graph trees: a capture makes pool (1, 0); a later warm-up run routes
        // its requests there with no capture (beginAllocateCurrentStreamToPool), so its blocks
        // land in the graphs' pool; then the next capture into it shares it.
        let mut c = Captures::default();
        c.announce(MAIN, GRAPH, (0, 0), 100);
        c.route_begin(MAIN, (1, 0), 100);
        c.begin(MAIN, SIDE_STREAM, 101);
        c.end(SIDE_STREAM);
        c.route_end((1, 0));
        c.captured(GRAPH);
        assert_eq!(c.route(MAIN, 0), None, "eager between the runs");
        c.route_begin(MAIN, (1, 0), 200);
        assert_eq!(c.route(MAIN, 0), Some((1, 0)), "the warm-up's requests");
        assert!(!c.capturing() && c.underway());
        c.route_end((1, 0));
        c.pool_released((1, 0));
        assert_eq!(c.route(MAIN, 0), None);
        let p = c.pool((1, 0)).unwrap();
        assert!(
            !p.mem_pool(),
            "a graphs' pool, routed to once for a warm-up"
        );
        assert_eq!((p.captures, p.routed, p.uses, p.graphs), (1, 1, 1, 1));
        assert!(!p.freeable(), "the graph still holds it");
    }

    #[test]
    fn use_on_oom_pools_are_listed_until_unmarked_or_released() {
        let mut c = Captures::default();
        c.pool_made((0, 2), 10);
        c.entry((0, 2), 11).use_on_oom = true;
        c.pool_made((0, 3), 12);
        assert_eq!(c.use_on_oom(), vec![(0, 2)]);
        c.pool_released((0, 2));
        assert!(c.use_on_oom().is_empty(), "a freed pool serves no OOM");
    }

    #[test]
    fn a_pool_id_survives_aux1_and_no_probe_word_reads_as_one() {
        for id in [(0, 1), (1, 0), (0, 7), (3, 0), (0x7fff_ffff, 0xffff_ffff)] {
            assert_eq!(pool_id_in_aux1(pool_id_to_aux1(id)), Some(id));
        }
        // A return address, a size, a flag word: no pool.
        for aux1 in [0, 1, 0x7f12_3456_7890, 2 << 20] {
            assert_eq!(pool_id_in_aux1(aux1), None);
        }
        let mut p = PrivatePools::default();
        p.made(0x1000, pool_id_to_aux1((0, 2)));
        p.made(0x2000, 0);
        assert_eq!((p.of(0x1000), p.of(0x2000)), (Some((0, 2)), None));
        p.released(0x1000);
        assert!(p.is_empty());
    }
}
