//! The what-if simulator: PyTorch's caching allocator deciding, request by request, where each
//! block goes (c10/cuda/CUDACachingAllocator.cpp's DeviceCachingAllocator::malloc and free),
//! under settings a job may not have run with and a device of a given capacity. The layout
//! model (layout.rs) observes placements; this decides them, with the same rules (policy.rs).
//!
//! A request misses the cache, then the allocator asks the device (gc first when its threshold
//! is set), then frees oversize cached blocks (max_split_size) and retries, then frees every
//! unused cached segment and retries (counted as a retry); if that fails too, it is PyTorch's
//! OOM. Expandable segments map pages of 2 MiB (small pool) or 20 MiB (large pool) in one
//! reserved range per pool and stream instead.
//!
//! Over 700 lines because PyTorch's malloc and free are one state machine (pools, splits, retries,
//! expandable ranges) with its unit tests beside it.

use std::collections::BTreeMap;

use super::policy::{
    pool_of, segment_size, serves, should_split, AllocConf, Pool, LARGE_SEGMENT, SMALL_SEGMENT,
};

/// No block (a free or failed request's handle, a list's end).
const NONE: u32 = u32::MAX;
/// The most address space a simulated expandable segment reserves.
const MAX_RESERVE: u64 = 1 << 40;
/// Failed requests whose index an outcome keeps.
pub const REFUSALS_KEPT: usize = 10;
/// Where made-up segment addresses start (a recorded run's are used where it has them).
const FIRST_ADDRESS: u64 = 0x7f00_0000_0000;

/// The allocator settings a run is simulated under.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Settings {
    pub conf: AllocConf,
    pub expandable: bool,
    /// garbage_collection_threshold: PyTorch collects only under a memory limit
    /// (per_process_memory_fraction); the simulated device's capacity is taken as that limit.
    pub gc_threshold: Option<f64>,
}

/// One step of the recorded job, in order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Request {
    /// A tensor's allocation: the size requested, on a stream.
    Malloc { size: u64, stream: u64 },
    /// Frees what the `handle`-th block handed out holds (seeded blocks first, then mallocs).
    Free { handle: u32 },
    /// torch.cuda.empty_cache(), where the recorded run released its cache by itself.
    EmptyCache,
    /// A CUDA graph capture began (true) or every capture ended (false): PyTorch runs no cache
    /// flush while one is underway, so a request that does not fit then is refused at once.
    CapturesUnderway(bool),
    /// A private pool no graph holds any more (every graph captured into it reset) is freeable
    /// (true): a flush returns its segments with no live block; a new capture into it holds it
    /// again (false). The pool as [`private_stream`] marks it (any stream).
    PoolFreeable(u64, bool),
    /// A MemPool marked use_on_oom (true) or no longer (false): a default-pool request the
    /// device refuses, after the retry, takes a free block of such a pool before the OOM
    /// (PyTorch's last resort). The pool as [`private_stream`] marks it.
    PoolUseOnOom(u64, bool),
    /// A request left out (an estimate without it): it takes its handle, holds nothing.
    Skipped,
}

/// Marks the stream of a request routed to a private pool (a CUDA graph's, a MemPool's): such a
/// request's blocks match only those of the same pool and stream, as PyTorch's pools keep them
/// apart, and a flush releases none of the pool's segments (a pool still in use is not
/// freeable).
pub const PRIVATE_POOL_STREAM: u64 = 1 << 63;

/// The bits of a private stream that name its pool.
const POOL_BITS: u64 = 0x7fff << 48;

/// The stream a request routed to `pool` is simulated on.
pub fn private_stream(pool: super::pools::PoolId, stream: u64) -> u64 {
    // Streams are user-space addresses (below 2^47) or 0; a pool's counters are small.
    PRIVATE_POOL_STREAM
        | ((pool.0 & 0x7f) << 56)
        | ((pool.1 & 0xff) << 48)
        | (stream & ((1 << 48) - 1))
}

/// A segment live before the first request, and its allocated blocks (address, size).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SeedSegment {
    pub addr: u64,
    pub size: u64,
    pub pool: Pool,
    pub stream: u64,
    pub blocks: Vec<(u64, u64)>,
}

/// What the simulated run did.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Outcome {
    /// The first request that failed (PyTorch's OutOfMemoryError): its index and size.
    pub oom: Option<(usize, u64)>,
    pub ooms: u64,
    /// The first failed requests' indices (at most [`REFUSALS_KEPT`]).
    pub refused: Vec<usize>,
    pub peak_reserved: u64,
    pub peak_allocated: u64,
    /// The most reserved memory not allocated at once: the cache at its fullest.
    pub peak_cached: u64,
    /// cudaMalloc calls, or pages mapped (expandable segments).
    pub device_allocs: u64,
    pub device_frees: u64,
    /// Requests that released the cache and retried (num_alloc_retries).
    pub retries: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    Allocated,
    Free,
    Unmapped,
}

#[derive(Clone, Copy, Debug)]
struct Block {
    addr: u64,
    size: u64,
    seg: u32,
    prev: u32,
    next: u32,
    state: State,
    /// The pool's get_free_block count when the block was cached (its age for gc).
    gc_base: u64,
}

#[derive(Clone, Copy, Debug)]
struct Segment {
    pool: Pool,
    stream: u64,
    /// Expandable: the page size it maps.
    page: Option<u64>,
}

/// Free blocks of a pool in PyTorch's order: stream, size, address.
type FreeSet = BTreeMap<(u64, u64, u64), u32>;

fn pool_index(pool: Pool) -> usize {
    match pool {
        Pool::Small => 0,
        Pool::Large => 1,
    }
}

/// PyTorch's allocator for one device, deciding.
pub struct Simulator {
    settings: Settings,
    /// Bytes the allocator may hold (the device's memory less what others hold).
    capacity: u64,
    /// The device's memory: expandable segments reserve 9/8 of it as address space.
    device_total: u64,
    blocks: Vec<Block>,
    spare: Vec<u32>,
    segments: Vec<Segment>,
    free: [FreeSet; 2],
    /// Expandable segments' unmapped ranges: (stream, address).
    unmapped: [BTreeMap<(u64, u64), u32>; 2],
    /// Each handed-out block by handle (NONE once freed or failed).
    handles: Vec<u32>,
    gc_calls: [u64; 2],
    reserved: u64,
    allocated: u64,
    /// A CUDA graph capture is underway: no flush, no retry.
    capturing: bool,
    /// Private pools no graph holds ([`POOL_BITS`] of their streams).
    freeable: std::collections::HashSet<u64>,
    /// Pools marked use_on_oom (their pool bits), in PyTorch's order of looking.
    use_on_oom: std::collections::BTreeSet<u64>,
    /// Addresses the device gave the recorded run, in order: the simulated run takes them.
    addresses: std::vec::IntoIter<u64>,
    next_address: u64,
    /// Where each malloc was placed, and each device allocation's size (when recording them).
    pub placements: Option<Vec<u64>>,
    pub device_sizes: Option<Vec<u64>>,
    outcome: Outcome,
}

impl Simulator {
    /// `addresses`: the device allocations' addresses of the run being reproduced, in order.
    pub fn new(settings: Settings, capacity: u64, device_total: u64, addresses: Vec<u64>) -> Self {
        Simulator {
            settings,
            capacity,
            device_total: device_total.max(capacity),
            blocks: Vec::new(),
            spare: Vec::new(),
            segments: Vec::new(),
            free: [FreeSet::new(), FreeSet::new()],
            unmapped: [BTreeMap::new(), BTreeMap::new()],
            handles: Vec::new(),
            gc_calls: [0; 2],
            reserved: 0,
            allocated: 0,
            capturing: false,
            freeable: Default::default(),
            use_on_oom: Default::default(),
            addresses: addresses.into_iter(),
            next_address: FIRST_ADDRESS,
            placements: None,
            device_sizes: None,
            outcome: Outcome::default(),
        }
    }

    /// Records where each malloc goes and each device allocation's size.
    pub fn recording(mut self) -> Self {
        self.placements = Some(Vec::new());
        self.device_sizes = Some(Vec::new());
        self
    }

    /// The state before the first request: segments as they were, their blocks allocated (each
    /// gets a handle, in order) and the rest free.
    pub fn seed(&mut self, segments: &[SeedSegment]) {
        for s in segments {
            let seg = self.push_segment(s.pool, s.stream, None);
            let mut at = s.addr;
            let mut prev = NONE;
            let mut link = |sim: &mut Simulator, addr: u64, size: u64, state: State| {
                let b = sim.push_block(addr, size, seg, state);
                sim.blocks[b as usize].prev = prev;
                if prev != NONE {
                    sim.blocks[prev as usize].next = b;
                }
                prev = b;
                b
            };
            for &(addr, size) in &s.blocks {
                if addr < at || addr + size > s.addr + s.size {
                    continue;
                }
                if addr > at {
                    let b = link(self, at, addr - at, State::Free);
                    self.cache(b);
                }
                let b = link(self, addr, size, State::Allocated);
                self.allocated += size;
                self.handles.push(b);
                at = addr + size;
            }
            if at < s.addr + s.size {
                let b = link(self, at, s.addr + s.size - at, State::Free);
                self.cache(b);
            }
            self.reserved += s.size;
        }
        self.peaks();
    }

    /// Runs the requests; what the run did.
    pub fn run(mut self, requests: &[Request]) -> (Outcome, Option<Vec<u64>>, Option<Vec<u64>>) {
        for (i, r) in requests.iter().enumerate() {
            match *r {
                Request::Malloc { size, stream } => {
                    let b = self.malloc(size, stream);
                    if b == NONE {
                        self.outcome.ooms += 1;
                        self.outcome.oom.get_or_insert((i, size));
                        if self.outcome.refused.len() < REFUSALS_KEPT {
                            self.outcome.refused.push(i);
                        }
                    }
                    self.handles.push(b);
                    if let Some(p) = self.placements.as_mut() {
                        p.push(if b == NONE {
                            0
                        } else {
                            self.blocks[b as usize].addr
                        });
                    }
                }
                Request::Free { handle } => self.free_handle(handle),
                Request::Skipped => self.handles.push(NONE),
                // empty_cache() is a no-op while a capture is underway.
                Request::EmptyCache if self.capturing => {}
                Request::EmptyCache => self.release_cached(),
                Request::CapturesUnderway(underway) => self.capturing = underway,
                Request::PoolFreeable(pool, true) => {
                    self.freeable.insert(pool & POOL_BITS);
                }
                Request::PoolFreeable(pool, false) => {
                    self.freeable.remove(&(pool & POOL_BITS));
                }
                Request::PoolUseOnOom(pool, true) => {
                    self.use_on_oom.insert(pool & POOL_BITS);
                }
                Request::PoolUseOnOom(pool, false) => {
                    self.use_on_oom.remove(&(pool & POOL_BITS));
                }
            }
            self.peaks();
        }
        (self.outcome, self.placements, self.device_sizes)
    }

    fn peaks(&mut self) {
        let o = &mut self.outcome;
        o.peak_reserved = o.peak_reserved.max(self.reserved);
        o.peak_allocated = o.peak_allocated.max(self.allocated);
        o.peak_cached = o
            .peak_cached
            .max(self.reserved - self.allocated.min(self.reserved));
    }

    fn push_segment(&mut self, pool: Pool, stream: u64, page: Option<u64>) -> u32 {
        self.segments.push(Segment { pool, stream, page });
        (self.segments.len() - 1) as u32
    }

    fn push_block(&mut self, addr: u64, size: u64, seg: u32, state: State) -> u32 {
        let b = Block {
            addr,
            size,
            seg,
            prev: NONE,
            next: NONE,
            state,
            gc_base: 0,
        };
        match self.spare.pop() {
            Some(i) => {
                self.blocks[i as usize] = b;
                i
            }
            None => {
                self.blocks.push(b);
                (self.blocks.len() - 1) as u32
            }
        }
    }

    fn segment_of(&self, b: u32) -> Segment {
        self.segments[self.blocks[b as usize].seg as usize]
    }

    fn key(&self, b: u32) -> (usize, (u64, u64, u64)) {
        let blk = self.blocks[b as usize];
        let seg = self.segment_of(b);
        (pool_index(seg.pool), (seg.stream, blk.size, blk.addr))
    }

    /// Into its pool's free blocks (insert_into_blocks: its gc age starts now).
    fn cache(&mut self, b: u32) {
        let (pool, key) = self.key(b);
        self.blocks[b as usize].gc_base = self.gc_calls[pool];
        self.free[pool].insert(key, b);
    }

    fn uncache(&mut self, b: u32) {
        let (pool, key) = self.key(b);
        self.free[pool].remove(&key);
    }

    fn unmapped_key(&self, b: u32) -> (usize, (u64, u64)) {
        let seg = self.segment_of(b);
        (
            pool_index(seg.pool),
            (seg.stream, self.blocks[b as usize].addr),
        )
    }

    /// A new address range from the device: the recorded run's next, else a made-up one.
    fn address(&mut self, size: u64) -> u64 {
        self.addresses.next().unwrap_or_else(|| {
            let a = self.next_address;
            self.next_address = self
                .next_address
                .saturating_add(size.div_ceil(SMALL_SEGMENT).saturating_mul(SMALL_SEGMENT));
            a
        })
    }

    fn malloc(&mut self, size: u64, stream: u64) -> u32 {
        let rounded = self.settings.conf.round_size(size);
        let pool = pool_of(rounded);
        let alloc_size = segment_size(rounded);
        let mut b = self.get_free_block(pool, stream, rounded);
        if b == NONE {
            self.garbage_collect();
            b = self.alloc_block(pool, stream, rounded, alloc_size);
        }
        if b == NONE && self.release_available(pool, stream, rounded) {
            b = self.alloc_block(pool, stream, rounded, alloc_size);
        }
        if b == NONE && !self.capturing {
            self.release_cached();
            self.outcome.retries += 1;
            b = self.alloc_block(pool, stream, rounded, alloc_size);
        }
        if b == NONE && stream & PRIVATE_POOL_STREAM == 0 {
            b = self.use_on_oom_block(pool, stream, rounded);
        }
        if b == NONE {
            return NONE;
        }
        self.split(b, pool, rounded);
        self.blocks[b as usize].state = State::Allocated;
        self.allocated += self.blocks[b as usize].size;
        b
    }

    /// PyTorch's last resort for a default-pool request: a free block of a use_on_oom pool
    /// (the request's stream in that pool), no new segment.
    fn use_on_oom_block(&mut self, pool: Pool, stream: u64, rounded: u64) -> u32 {
        let pools: Vec<u64> = self.use_on_oom.iter().copied().collect();
        for bits in pools {
            let routed = PRIVATE_POOL_STREAM | bits | (stream & ((1 << 48) - 1));
            let b = self.get_free_block(pool, routed, rounded);
            if b != NONE {
                return b;
            }
        }
        NONE
    }

    /// The allocation is the front of the block; a remainder PyTorch splits off stays cached.
    fn split(&mut self, b: u32, pool: Pool, rounded: u64) {
        let blk = self.blocks[b as usize];
        let remaining = blk.size - rounded;
        let expandable = self.segment_of(b).page.is_some();
        if !should_split(pool, expandable, self.settings.conf, rounded, remaining) {
            return;
        }
        let rest = self.push_block(blk.addr + rounded, remaining, blk.seg, State::Free);
        self.link(rest, blk.next);
        self.link(b, rest);
        self.blocks[b as usize].size = rounded;
        self.cache(rest);
    }

    /// get_free_block: the smallest cached block of the stream that fits (lowest address among
    /// equals), taken out of the pool; NONE when it does not serve the request.
    fn get_free_block(&mut self, pool: Pool, stream: u64, rounded: u64) -> u32 {
        let p = pool_index(pool);
        if self.settings.gc_threshold.is_some() {
            self.gc_calls[p] += 1;
        }
        let mut candidates = self.free[p].range((stream, rounded, 0)..);
        let Some((&(s, _, _), &first)) = candidates.next() else {
            return NONE;
        };
        if s != stream {
            return NONE;
        }
        let mut b = first;
        // In expandable segments, a block that cannot grow is taken before the growable one
        // at the end of the mapped range.
        while self.segment_of(b).page.is_some() {
            match candidates.next() {
                Some((&(s, _, _), &n))
                    if s == stream
                        && self.segment_of(n).page.is_some()
                        && self.growable(n) < self.growable(b) =>
                {
                    b = n
                }
                _ => break,
            }
        }
        if !serves(
            pool,
            self.settings.conf,
            rounded,
            self.blocks[b as usize].size,
        ) {
            return NONE;
        }
        self.uncache(b);
        b
    }

    /// A block's size with the unmapped range after it.
    fn growable(&self, b: u32) -> u64 {
        let blk = self.blocks[b as usize];
        let next = blk.next;
        blk.size
            + if next != NONE && self.blocks[next as usize].state == State::Unmapped {
                self.blocks[next as usize].size
            } else {
                0
            }
    }

    /// alloc_block: a new segment (or pages of an expandable one) from the device, which has
    /// room only within the capacity.
    fn alloc_block(&mut self, pool: Pool, stream: u64, rounded: u64, alloc_size: u64) -> u32 {
        // Sizes come from recordings (a refused request may be absurd): no overflow.
        if self.reserved.saturating_add(alloc_size) > self.capacity {
            return NONE;
        }
        if self.settings.expandable {
            return self.allocate_expandable(pool, stream, rounded);
        }
        let addr = self.address(alloc_size);
        let seg = self.push_segment(pool, stream, None);
        let b = self.push_block(addr, alloc_size, seg, State::Free);
        self.reserved += alloc_size;
        self.device_alloc(alloc_size);
        b
    }

    fn device_alloc(&mut self, size: u64) {
        self.outcome.device_allocs += 1;
        if let Some(d) = self.device_sizes.as_mut() {
            d.push(size);
        }
    }

    /// release_block: a whole cached segment back to the device.
    fn release_segment(&mut self, b: u32) {
        self.uncache(b);
        self.reserved -= self.blocks[b as usize].size;
        self.outcome.device_frees += 1;
        self.spare.push(b);
    }

    fn whole_segment(&self, b: u32) -> bool {
        let blk = self.blocks[b as usize];
        blk.prev == NONE && blk.next == NONE && self.segment_of(b).page.is_none()
    }

    /// Block `b` lies in a private pool's segment (a CUDA graph's, a MemPool's).
    fn private(&self, b: u32) -> bool {
        let stream = self.segment_of(b).stream;
        stream & PRIVATE_POOL_STREAM != 0 && !self.freeable.contains(&(stream & POOL_BITS))
    }

    /// A whole free segment a flush returns: not one of a private pool still in use.
    fn flushable(&self, b: u32) -> bool {
        self.whole_segment(b) && !self.private(b)
    }

    /// release_available_cached_blocks: with max_split_size set, the smallest oversize cached
    /// block that covers the request, else oversize blocks from the largest down until they do.
    fn release_available(&mut self, pool: Pool, stream: u64, rounded: u64) -> bool {
        let max_split = self.settings.conf.max_split_size;
        if max_split == u64::MAX {
            return false;
        }
        let key = rounded.max(max_split);
        let p = pool_index(pool);
        let found = self.free[p]
            .range((stream, key, 0)..)
            .next()
            .filter(|(k, &b)| k.0 == stream && self.whole_segment(b))
            .map(|(_, &b)| b);
        if let Some(b) = found {
            self.release_segment(b);
            return true;
        }
        let below: Vec<(u64, u32)> = self.free[p]
            .range(..(stream, key, 0))
            .rev()
            .take_while(|(k, _)| k.0 == stream && k.1 >= max_split)
            .map(|(k, &b)| (k.1, b))
            .collect();
        let mut released = 0;
        for (size, b) in below {
            if released >= key {
                break;
            }
            if self.whole_segment(b) {
                self.release_segment(b);
                released += size;
            }
        }
        released >= key
    }

    /// release_cached_blocks (a retry, empty_cache): every unused cached segment back to the
    /// device, and in expandable segments every whole free page.
    fn release_cached(&mut self) {
        for p in [1, 0] {
            let cached: Vec<u32> = self.free[p].values().copied().collect();
            for b in cached {
                if self.flushable(b) {
                    self.release_segment(b);
                } else if self.segment_of(b).page.is_some() && !self.private(b) {
                    // A private pool still in use gives back none of its pages either.
                    self.unmap(b);
                }
            }
        }
    }

    /// garbage_collect_cached_blocks: above the threshold of the capacity, the large pool's
    /// unused segments cached longest (at least the average age) go back, pass by pass.
    fn garbage_collect(&mut self) {
        let Some(threshold) = self.settings.gc_threshold else {
            return;
        };
        let limit = (threshold * self.capacity as f64) as u64;
        if self.reserved <= limit {
            return;
        }
        let target = self.reserved - limit;
        let p = pool_index(Pool::Large);
        let now = self.gc_calls[p];
        let age = |sim: &Simulator, b: u32| now - sim.blocks[b as usize].gc_base.min(now);
        let candidates: Vec<u32> = self.free[p]
            .values()
            .copied()
            .filter(|&b| self.flushable(b))
            .collect();
        let (mut total_age, mut n) = (
            candidates.iter().map(|&b| age(self, b)).sum::<u64>(),
            candidates.len() as u64,
        );
        let mut reclaimed = 0;
        let mut freed = true;
        let mut left = candidates;
        while reclaimed < target && freed && n > 0 {
            let average = total_age as f64 / n as f64;
            freed = false;
            let mut kept = Vec::new();
            for b in left {
                let a = age(self, b);
                if a as f64 >= average {
                    reclaimed += self.blocks[b as usize].size;
                    self.release_segment(b);
                    total_age -= a;
                    n -= 1;
                    freed = true;
                } else {
                    kept.push(b);
                }
            }
            left = kept;
        }
    }

    fn free_handle(&mut self, handle: u32) {
        let Some(&b) = self.handles.get(handle as usize) else {
            return;
        };
        if b == NONE {
            return;
        }
        self.handles[handle as usize] = NONE;
        self.allocated -= self.blocks[b as usize].size;
        self.blocks[b as usize].state = State::Free;
        let merged = self.merge(b, State::Free);
        self.cache(merged);
    }

    /// try_merge_blocks: `b` (not in any set) absorbs its neighbours in `state`; the block
    /// that remains.
    fn merge(&mut self, b: u32, state: State) -> u32 {
        let next = self.blocks[b as usize].next;
        if next != NONE && self.blocks[next as usize].state == state {
            self.take_out(next, state);
            self.absorb_next(b);
        }
        let prev = self.blocks[b as usize].prev;
        if prev != NONE && self.blocks[prev as usize].state == state {
            self.take_out(prev, state);
            self.absorb_next(prev);
            return prev;
        }
        b
    }

    /// `first` takes over the block after it.
    fn absorb_next(&mut self, first: u32) {
        let gone = self.blocks[first as usize].next;
        let g = self.blocks[gone as usize];
        self.blocks[first as usize].size += g.size;
        self.link(first, g.next);
        self.spare.push(gone);
    }

    fn take_out(&mut self, b: u32, state: State) {
        match state {
            State::Free => self.uncache(b),
            State::Unmapped => {
                let (p, key) = self.unmapped_key(b);
                self.unmapped[p].remove(&key);
            }
            State::Allocated => {}
        }
    }

    // Expandable segments ------------------------------------------------------------------

    /// try_allocate_expandable_block: the lowest range of this stream's segments, free or
    /// unmapped, that holds the request, mapped page by page; NONE when the device runs out.
    fn allocate_expandable(&mut self, pool: Pool, stream: u64, rounded: u64) -> u32 {
        let mut c = self.find_expandable(pool, stream, rounded);
        if self.blocks[c as usize].state == State::Unmapped {
            let len = self.blocks[c as usize].size.min(rounded);
            c = self.map(c, len);
            if c == NONE {
                return NONE;
            }
        }
        while self.blocks[c as usize].size < rounded {
            let next = self.blocks[c as usize].next;
            if next == NONE || self.blocks[next as usize].state != State::Unmapped {
                return NONE;
            }
            let len = (rounded - self.blocks[c as usize].size).min(self.blocks[next as usize].size);
            c = self.map(next, len);
            if c == NONE {
                return NONE;
            }
        }
        self.uncache(c);
        c
    }

    fn find_expandable(&mut self, pool: Pool, stream: u64, rounded: u64) -> u32 {
        let p = pool_index(pool);
        let starts: Vec<u32> = self.unmapped[p]
            .range((stream, 0)..(stream.saturating_add(1), 0))
            .map(|(_, &u)| u)
            .collect();
        for u in starts {
            let prev = self.blocks[u as usize].prev;
            let start = if prev != NONE && self.blocks[prev as usize].state == State::Free {
                prev
            } else {
                u
            };
            let (mut total, mut b) = (0, start);
            while b != NONE && self.blocks[b as usize].state != State::Allocated && total < rounded
            {
                total += self.blocks[b as usize].size;
                b = self.blocks[b as usize].next;
            }
            if total >= rounded {
                return start;
            }
        }
        let page = if pool == Pool::Small {
            SMALL_SEGMENT
        } else {
            LARGE_SEGMENT
        };
        // 9/8 of the device's memory; a device of unknown size gets a range of 1 TiB (the
        // range's size changes no decision, only where made-up addresses fall).
        let total = self.device_total.min(MAX_RESERVE);
        let size = (total.saturating_add(total / 8))
            .div_ceil(page)
            .max(rounded.div_ceil(page))
            .saturating_mul(page);
        let addr = self.address(size);
        let seg = self.push_segment(pool, stream, Some(page));
        let b = self.push_block(addr, size, seg, State::Unmapped);
        self.unmapped[p].insert((stream, addr), b);
        b
    }

    /// Maps whole pages covering the first `len` bytes of unmapped block `u`; the free block
    /// they become part of, or NONE when the device has no room for them.
    fn map(&mut self, u: u32, len: u64) -> u32 {
        let page = self.segment_of(u).page.unwrap_or(LARGE_SEGMENT);
        let blk = self.blocks[u as usize];
        let mapped = len.div_ceil(page).saturating_mul(page).min(blk.size);
        if self.reserved.saturating_add(mapped) > self.capacity {
            return NONE;
        }
        self.take_out(u, State::Unmapped);
        if mapped < blk.size {
            let rest = self.push_block(
                blk.addr.saturating_add(mapped),
                blk.size - mapped,
                blk.seg,
                State::Unmapped,
            );
            self.link(rest, blk.next);
            self.link(u, rest);
            self.blocks[u as usize].size = mapped;
            let (p, key) = self.unmapped_key(rest);
            self.unmapped[p].insert(key, rest);
        }
        self.reserved += mapped;
        // PyTorch maps page by page: one device allocation each.
        for _ in 0..mapped / page {
            self.device_alloc(page);
        }
        self.blocks[u as usize].state = State::Free;
        let merged = self.merge(u, State::Free);
        self.cache(merged);
        merged
    }

    /// unmap_block: the whole pages inside free block `b` go back to the device.
    fn unmap(&mut self, b: u32) {
        let page = self.segment_of(b).page.unwrap_or(LARGE_SEGMENT);
        let blk = self.blocks[b as usize];
        let base = self.segment_base(b);
        let lo = base + (blk.addr - base).div_ceil(page) * page;
        let hi = base + (blk.addr + blk.size - base) / page * page;
        if lo >= hi {
            return;
        }
        self.uncache(b);
        self.reserved -= hi - lo;
        self.outcome.device_frees += 1;
        let (end, next) = (blk.addr + blk.size, blk.next);
        // [addr, lo) stays free in `b`, [lo, hi) is unmapped, [hi, end) stays free.
        let middle = if lo > blk.addr {
            self.blocks[b as usize].size = lo - blk.addr;
            self.cache(b);
            let m = self.push_block(lo, hi - lo, blk.seg, State::Unmapped);
            self.link(b, m);
            m
        } else {
            self.blocks[b as usize].size = hi - lo;
            self.blocks[b as usize].state = State::Unmapped;
            b
        };
        if hi < end {
            let t = self.push_block(hi, end - hi, blk.seg, State::Free);
            self.link(middle, t);
            self.link(t, next);
            self.cache(t);
        } else {
            self.link(middle, next);
        }
        let m = self.merge(middle, State::Unmapped);
        let (p, key) = self.unmapped_key(m);
        self.unmapped[p].insert(key, m);
    }

    /// Makes `b` the block before `next` (which may be NONE).
    fn link(&mut self, b: u32, next: u32) {
        self.blocks[b as usize].next = next;
        if next != NONE {
            self.blocks[next as usize].prev = b;
        }
    }

    /// The first address of `b`'s segment (the start of its chain of blocks).
    fn segment_base(&self, b: u32) -> u64 {
        let mut at = b;
        while self.blocks[at as usize].prev != NONE {
            at = self.blocks[at as usize].prev;
        }
        self.blocks[at as usize].addr
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::policy::MIB;

    fn settings(conf: &str, expandable: bool) -> Settings {
        Settings {
            conf: AllocConf::parse(conf),
            expandable,
            gc_threshold: None,
        }
    }

    fn malloc(size: u64) -> Request {
        Request::Malloc { size, stream: 0 }
    }

    fn free(handle: u32) -> Request {
        Request::Free { handle }
    }

    fn run(s: Settings, capacity: u64, requests: &[Request]) -> (Outcome, Vec<u64>, Vec<u64>) {
        let (o, placed, sizes) = Simulator::new(s, capacity, capacity, Vec::new())
            .recording()
            .run(requests);
        (o, placed.unwrap(), sizes.unwrap())
    }

    /// Small requests share a 2 MiB segment, split at the front; 1-10 MiB ones a 20 MiB one;
    /// a freed block merges with its free neighbours and serves the next request that fits.
    #[test]
    fn segments_splits_and_reuse_follow_pytorch() {
        let (o, placed, sizes) = run(
            settings("", false),
            1 << 30,
            &[
                malloc(1000),
                malloc(300 * 1024),
                malloc(3 * MIB),
                free(0),
                free(1),
                malloc(4 * MIB),
            ],
        );
        assert_eq!(sizes, vec![2 * MIB, 20 * MIB]);
        assert_eq!(
            placed[1],
            placed[0] + 1024,
            "the second small block follows the first"
        );
        // The 3 MiB block's 17 MiB remainder serves the 4 MiB request right after it.
        assert_eq!(placed[3], placed[2] + 3 * MIB);
        assert_eq!(
            (o.peak_reserved, o.device_allocs, o.retries),
            (22 * MIB, 2, 0)
        );
        assert_eq!(o.peak_allocated, 7 * MIB);
        assert_eq!(o.oom, None);
    }

    /// A request the device cannot serve first releases the cache (counted as a retry), and
    /// fails with PyTorch's OOM only when that does not make room either.
    #[test]
    fn a_full_device_releases_the_cache_then_fails() {
        let capacity = 60 * MIB;
        let requests = [
            malloc(20 * MIB),
            malloc(20 * MIB),
            free(0),
            // 30 MiB fits neither the free 20 MiB segment nor the device: the cache goes.
            malloc(30 * MIB),
            malloc(30 * MIB),
        ];
        let (o, _, sizes) = run(settings("", false), capacity, &requests);
        assert_eq!(sizes, vec![20 * MIB, 20 * MIB, 30 * MIB]);
        assert_eq!(o.device_frees, 1);
        assert_eq!(o.retries, 2);
        assert_eq!(o.oom, Some((4, 30 * MIB)));
        assert_eq!(o.peak_reserved, 50 * MIB);
    }

    /// A graph's private pool: its free block serves no default-pool request, and the retry's
    /// flush does not return its segment (the pool is in use): the eager request fails where
    /// the same bytes in the default pool would have served it.
    #[test]
    fn a_private_pools_free_block_serves_only_its_pool() {
        let graph = private_stream((1, 0), 0);
        let requests = [
            Request::Malloc {
                size: 20 * MIB,
                stream: graph,
            },
            free(0),
            malloc(20 * MIB),
        ];
        let (o, _, sizes) = run(settings("", false), 30 * MIB, &requests);
        assert_eq!(sizes, vec![20 * MIB]);
        assert_eq!(o.device_frees, 0);
        assert_eq!(o.oom, Some((2, 20 * MIB)));
        // Routed to the pool, the same request reuses the block.
        let again = [
            requests[0],
            free(0),
            Request::Malloc {
                size: 20 * MIB,
                stream: graph,
            },
        ];
        let (o, placed, _) = run(settings("", false), 30 * MIB, &again);
        assert_eq!((o.oom, placed[0]), (None, placed[1]));
    }

    /// While a capture is underway a request that does not fit is refused at once: no flush
    /// (nor empty_cache()) returns the cache's free segment; after the capture the retry does.
    #[test]
    fn no_flush_while_a_capture_is_underway() {
        let graph = private_stream((1, 0), 0x5000);
        let requests = [
            malloc(20 * MIB),
            free(0),
            Request::CapturesUnderway(true),
            Request::EmptyCache,
            Request::Malloc {
                size: 20 * MIB,
                stream: graph,
            },
            Request::CapturesUnderway(false),
            Request::Malloc {
                size: 20 * MIB,
                stream: graph,
            },
        ];
        let (o, placed, _) = run(settings("", false), 30 * MIB, &requests);
        assert_eq!(o.oom, Some((4, 20 * MIB)));
        assert_eq!(o.retries, 1, "the retry after the capture only");
        assert_eq!(o.device_frees, 1);
        assert_eq!(placed[1], 0, "refused");
        assert_ne!(placed[2], 0, "served once the cache went back");
    }

    /// A private pool's free segment stays at a flush while a graph holds the pool; once every
    /// graph captured into it is reset, the next flush returns it; a new capture holds it again.
    #[test]
    fn a_pool_is_released_at_the_flush_after_its_graphs_reset() {
        let graph = private_stream((1, 0), 0x5000);
        let pooled = Request::Malloc {
            size: 20 * MIB,
            stream: graph,
        };
        let held = [pooled, free(0), Request::EmptyCache];
        let (o, _, _) = run(settings("", false), 30 * MIB, &held);
        assert_eq!(o.device_frees, 0, "the pool is held");
        let released = [
            pooled,
            free(0),
            Request::PoolFreeable(graph, true),
            Request::EmptyCache,
            malloc(20 * MIB),
        ];
        let (o, _, _) = run(settings("", false), 30 * MIB, &released);
        assert_eq!((o.device_frees, o.oom), (1, None), "freed at the flush");
        let held_again = [
            pooled,
            free(0),
            Request::PoolFreeable(graph, true),
            Request::PoolFreeable(private_stream((1, 0), 0), false),
            Request::EmptyCache,
        ];
        let (o, _, _) = run(settings("", false), 30 * MIB, &held_again);
        assert_eq!(o.device_frees, 0, "held again by a new capture");
    }

    /// max_split_size: an oversize cached block serves only oversize requests within 20 MiB of
    /// it, and on a miss oversize blocks are released before the whole cache.
    #[test]
    fn oversize_blocks_follow_max_split_size() {
        let requests = [
            malloc(100 * MIB),
            free(0),
            malloc(10 * MIB),
            malloc(90 * MIB),
        ];
        let (plain, placed, _) = run(settings("", false), 1 << 30, &requests);
        assert_eq!(
            placed[1], placed[0],
            "without a limit the 100 MiB block is split"
        );
        assert_eq!(plain.device_allocs, 1);
        let (limited, placed, sizes) =
            run(settings("max_split_size_mb:64", false), 1 << 30, &requests);
        assert_ne!(placed[1], placed[0]);
        assert_eq!(
            placed[2], placed[0],
            "90 MiB is within 20 MiB of the 100 MiB block"
        );
        assert_eq!(sizes, vec![100 * MIB, 10 * MIB]);
        assert_eq!(limited.retries, 0);
        // A device of 105 MiB: the 100 MiB block is released for the 10 MiB request, no retry.
        let (tight, _, sizes) = run(
            settings("max_split_size_mb:64", false),
            105 * MIB,
            &requests[..3],
        );
        assert_eq!((tight.device_frees, tight.retries, tight.oom), (1, 0, None));
        assert_eq!(sizes, vec![100 * MIB, 10 * MIB]);
    }

    /// Expandable segments map pages of 20 MiB (large pool) as requests need them, growing
    /// from the lowest free range before the unmapped space; a retry unmaps free whole pages.
    #[test]
    fn expandable_segments_map_and_unmap_pages() {
        let requests = [malloc(30 * MIB), malloc(5 * MIB), free(0), malloc(50 * MIB)];
        let (o, placed, sizes) = run(settings("", true), 1 << 30, &requests);
        // 30 MiB maps two pages; 5 MiB fits in what is left of them.
        assert_eq!(placed[1], placed[0] + 30 * MIB);
        // 50 MiB: the free 5 MiB just before the unmapped space, and 60 MiB mapped after it.
        assert_eq!(placed[2], placed[0] + 35 * MIB);
        // Page by page, as PyTorch maps them: two for the first request, three for the third.
        assert_eq!(sizes, vec![20 * MIB; 5]);
        assert_eq!((o.peak_reserved, o.device_allocs), (100 * MIB, 5));
        // On a device of 60 MiB the retry unmaps the one whole free page, not enough: PyTorch
        // checks the request against the limit before mapping.
        let (tight, _, _) = run(settings("", true), 60 * MIB, &requests);
        assert_eq!((tight.retries, tight.device_frees), (1, 1));
        assert_eq!(tight.oom, Some((3, 50 * MIB)));
    }

    /// A state seeded before the first request: its blocks are handles 0.., its gaps cached.
    #[test]
    fn a_seeded_state_is_taken_up() {
        let mut sim = Simulator::new(settings("", false), 1 << 30, 1 << 30, Vec::new()).recording();
        let base = 0x1000_0000;
        sim.seed(&[SeedSegment {
            addr: base,
            size: 20 * MIB,
            pool: Pool::Large,
            stream: 0,
            blocks: vec![(base, 4 * MIB), (base + 10 * MIB, 2 * MIB)],
        }]);
        let (o, placed, sizes) = sim.run(&[malloc(5 * MIB), free(0), malloc(9 * MIB)]);
        let (placed, sizes) = (placed.unwrap(), sizes.unwrap());
        // The 6 MiB gap is the best fit, taken whole (a remainder of 1 MiB is not split off);
        // the freed 4 MiB and the 8 MiB gap are too small for 9 MiB: a new segment.
        assert_eq!(placed, vec![base + 4 * MIB, FIRST_ADDRESS]);
        assert_eq!(sizes, vec![20 * MIB]);
        assert_eq!(o.peak_allocated, 2 * MIB + 6 * MIB + 9 * MIB);
    }
}
