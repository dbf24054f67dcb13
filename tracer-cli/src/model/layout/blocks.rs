//! Placing what the calls say: segments made and released, chunks of expandable segments
//! mapped and unmapped, blocks put into free space with the allocator's split rule and taken
//! out again, each pool's multiset of free gaps kept in step, and the evidence that the layout
//! differs from the allocator's (healed where the calls show how).

use super::*;

impl Layout {
    /// The segment holding `ptr`, by its start address.
    pub(super) fn segment_at(&self, ptr: u64) -> Option<u64> {
        let (&addr, seg) = self.segments.range(..=ptr).next_back()?;
        (ptr < addr + seg.size).then_some(addr)
    }

    pub(super) fn segment_alloc(
        &mut self,
        addr: u64,
        size: u64,
        device: i32,
        mapped: Option<BTreeMap<u64, u64>>,
        ts: i64,
    ) {
        if self.segments.contains_key(&addr) {
            // A driver allocation nested in the runtime's, for the same segment.
            return;
        }
        self.forget_stale(addr, size, ts);
        if self.sight.hides(ts) {
            self.sight.unseen.insert(
                addr,
                UnseenSegment {
                    size,
                    device,
                    blocks: BTreeMap::new(),
                },
            );
            return;
        }
        let expandable = mapped.is_some();
        self.segments.insert(
            addr,
            Segment {
                size,
                device,
                mapped,
                pool: None,
                blocks: BTreeMap::new(),
            },
        );
        if !expandable {
            // Outside the allocator until a block lands in it.
            *self.outside.entry(device).or_default() += size;
        }
    }

    pub(super) fn segment_free(&mut self, addr: u64) {
        if self.sight.unseen.remove(&addr).is_some() {
            return;
        }
        let Some(seg) = self.segments.remove(&addr) else {
            return;
        };
        self.pending.segment_streams.remove(&addr);
        if !seg.blocks.is_empty() {
            self.unexplained.segments_freed_with_blocks += 1;
        }
        match seg.pool {
            Some(pool) => {
                let key = (seg.device, pool);
                self.swap_gaps(key, &seg.counted_gaps(addr), &[]);
                let held: u64 = seg
                    .blocks
                    .iter()
                    .filter(|(b, _)| !self.pending.blocks.contains_key(b))
                    .map(|(_, b)| b.size)
                    .sum();
                for b in seg.blocks.keys() {
                    self.forget_pending(*b);
                }
                let t = self.totals.entry(key).or_default();
                t.reserved = t.reserved.saturating_sub(reserved_of(&seg));
                t.allocated = t.allocated.saturating_sub(held);
                self.refresh_largest(key);
            }
            None if seg.mapped.is_none() => {
                let o = self.outside.entry(seg.device).or_default();
                *o = o.saturating_sub(seg.size);
            }
            None => {}
        }
    }

    /// A chunk mapped into (or unmapped from) an expandable segment.
    pub(super) fn map(&mut self, ptr: u64, size: u64, mapped: bool) {
        let Some(addr) = self.segment_at(ptr) else {
            return;
        };
        let Some(seg) = self.segments.get_mut(&addr) else {
            return;
        };
        let before = seg.counted_gaps(addr);
        let Some(ranges) = seg.mapped.as_mut() else {
            return;
        };
        if mapped {
            insert_range(ranges, ptr, ptr + size);
            if seg.pool.is_none() {
                seg.pool = Some(if size <= SMALL_SEGMENT {
                    Pool::Small
                } else {
                    Pool::Large
                });
            }
        } else {
            remove_range(ranges, ptr, ptr + size);
        }
        if let Some(pool) = seg.pool {
            let key = (seg.device, pool);
            let delta = size as i64 * if mapped { 1 } else { -1 };
            let t = self.totals.entry(key).or_default();
            t.reserved = (t.reserved as i64 + delta).max(0) as u64;
            self.regap(addr, &before);
        }
    }

    pub(super) fn block_alloc(&mut self, e: &Event) {
        self.blocks_seen += 1;
        self.block_events += 1;
        if self.place_between_blocks(e) {
            return;
        }
        let Some(addr) = self.segment_at(e.ptr) else {
            match self.sight.segment_at(e.ptr) {
                Some(unseen) => {
                    if let Some(seg) = self.sight.unseen.get_mut(&unseen) {
                        seg.blocks.insert(e.ptr, e.size);
                    }
                }
                None => self.orphan_alloc(e),
            }
            return;
        };
        self.heal_overlap(addr, e);
        let conf = self.conf;
        let Some(seg) = self.segments.get_mut(&addr) else {
            return;
        };
        let rounded = split_size(e, conf.round_size(e.size));
        if seg.mapped.is_some() {
            self.expandable_used.insert(addr);
        }
        let fresh = seg.pool.is_none() && seg.mapped.is_none();
        if seg.pool.is_none() {
            // cudaMalloc'ed: 2 MiB segments serve the small pool; expandable: the first
            // mapping said, else the request's size does.
            let small = match seg.mapped {
                None => seg.size == SMALL_SEGMENT,
                Some(_) => rounded <= SMALL_SIZE,
            };
            seg.pool = Some(if small { Pool::Small } else { Pool::Large });
            if seg.mapped.is_none() {
                let o = self.outside.entry(seg.device).or_default();
                *o = o.saturating_sub(seg.size);
            }
            if seg.device < 0 && e.device >= 0 {
                // Allocated by a thread whose cudaSetDevice tracer did not see: PyTorch's
                // probe names the device.
                seg.device = e.device;
            }
            let key = (seg.device, seg.pool.unwrap_or(Pool::Large));
            self.totals.entry(key).or_default().reserved += reserved_of(seg);
            self.regap(addr, &[]);
        }
        let first_block = self
            .segments
            .get(&addr)
            .is_some_and(|s| s.blocks.is_empty());
        if first_block && self.private.of(addr).is_none() {
            // A segment serves one pool for life: a capture routes its first block.
            if let Some(id) = self.captures.route(e.tid, e.aux0) {
                self.private.routed(addr, id);
            }
        }
        if fresh {
            self.new_segment_for(addr, e, rounded);
        }
        let Some(seg) = self.segments.get_mut(&addr) else {
            return;
        };
        let key = (seg.device, seg.pool.unwrap_or(Pool::Large));
        let gap_end = free_end(addr, seg, e.ptr);
        let Some(gap_end) = gap_end else {
            self.unexplained.overlapping_blocks += 1;
            return;
        };
        let run = gap_end.saturating_sub(e.ptr);
        let size = placed_size(key.1, seg.mapped.is_some(), conf, rounded, run);
        let block = Block::new(e, size, self.block_events);
        self.insert_block(addr, key, e.ptr, block);
        self.settle(e.ts_ns);
        self.totals.entry(key).or_default().allocated += size;
    }

    /// The common case of [`Layout::block_alloc`] in one walk of the segments and two of the
    /// segment's blocks (the general path takes two and six): a cudaMalloc'ed segment already
    /// in use, the block landing in free space between its neighbours. False, with nothing
    /// changed, for anything else.
    fn place_between_blocks(&mut self, e: &Event) -> bool {
        let conf = self.conf;
        let Some((&addr, seg)) = self.segments.range_mut(..=e.ptr).next_back() else {
            return false;
        };
        if e.ptr >= addr.saturating_add(seg.size) {
            return false;
        }
        let Some(pool) = seg
            .pool
            .filter(|_| seg.mapped.is_none() && !seg.blocks.is_empty())
        else {
            return false;
        };
        let request = conf.round_size(e.size);
        let reach = e.ptr.saturating_add(request);
        let below = seg.blocks.range(..e.ptr).next_back();
        let lo = below.map_or(addr, |(&b, block)| b + block.size);
        let above = seg.blocks.range(e.ptr..).next().map(|(&b, _)| b);
        let hi = above.unwrap_or(addr + seg.size);
        // Overlaps (blocks freed unseen) take the general path, which heals them.
        if lo > e.ptr || above.is_some_and(|b| b == e.ptr || b < reach) {
            return false;
        }
        let rounded = split_size(e, request);
        let key = (seg.device, pool);
        let size = placed_size(pool, false, conf, rounded, hi.saturating_sub(e.ptr));
        if e.ptr.saturating_add(size) > hi {
            return false;
        }
        seg.blocks
            .insert(e.ptr, Block::new(e, size, self.block_events));
        let (after, n) = nonzero_gaps(e.ptr - lo, hi - (e.ptr + size));
        self.swap_gaps(key, &[hi - lo], &after[..n]).allocated += size;
        self.settle(e.ts_ns);
        true
    }

    /// Puts a block into free space of segment `addr`, counting its pool's free gaps.
    pub(super) fn insert_block(&mut self, addr: u64, key: (i32, Pool), ptr: u64, block: Block) {
        let Some(seg) = self.segments.get_mut(&addr) else {
            return;
        };
        let size = block.size;
        let span = seg.span_around(addr, ptr, ptr.saturating_add(size));
        let before = if span.is_some() {
            Vec::new()
        } else {
            seg.counted_gaps(addr)
        };
        seg.blocks.insert(ptr, block);
        match span {
            // The span it landed in is cut in two (either may be empty).
            Some((lo, hi)) => {
                let (after, n) = nonzero_gaps(ptr - lo, hi - (ptr + size));
                self.swap_gaps(key, &[hi - lo], &after[..n]);
            }
            None => self.regap(addr, &before),
        }
    }

    /// A block where no known segment lies: its segment was created unseen.
    pub(super) fn orphan_alloc(&mut self, e: &Event) {
        self.unexplained.blocks_outside_segments += 1;
        self.unknown.unseen_segments = true;
        let size = self.conf.round_size(e.size);
        if let Some(old) = self.orphans.insert(
            e.ptr,
            Orphan {
                size,
                requested: e.size,
                device: e.device,
            },
        ) {
            self.unknown.freed_unseen += 1;
            self.unknown.freed_unseen_bytes += old.size;
        }
        self.evidence(e.ts_ns);
    }

    /// Blocks the new allocation at `e.ptr` overlaps were freed while tracer did not see:
    /// they go, counted.
    pub(super) fn heal_overlap(&mut self, addr: u64, e: &Event) {
        let rounded = self.conf.round_size(e.size);
        let Some(seg) = self.segments.get_mut(&addr) else {
            return;
        };
        let end = e.ptr.saturating_add(rounded);
        let mut stale: Vec<u64> = seg.blocks.range(e.ptr..end).map(|(&b, _)| b).collect();
        if let Some((&b, block)) = seg.blocks.range(..e.ptr).next_back() {
            if b + block.size > e.ptr {
                stale.push(b);
            }
        }
        if stale.is_empty() {
            return;
        }
        let before = seg.counted_gaps(addr);
        let key = (seg.device, seg.pool.unwrap_or(Pool::Large));
        let mut bytes = 0;
        let mut allocated = 0;
        for b in &stale {
            if let Some(block) = seg.blocks.remove(b) {
                bytes += block.size;
                if !self.pending.blocks.contains_key(b) {
                    allocated += block.size;
                }
            }
        }
        for b in &stale {
            self.forget_pending(*b);
        }
        self.unexplained.overlapping_blocks += 1;
        self.unknown.freed_unseen += stale.len() as u64;
        self.unknown.freed_unseen_bytes += bytes;
        let t = self.totals.entry(key).or_default();
        t.allocated = t.allocated.saturating_sub(allocated);
        self.regap(addr, &before);
        self.evidence(e.ts_ns);
    }

    /// A new segment at [addr, addr + size): what tracer believed there (blocks of unseen
    /// segments, a segment whose free it missed) was released unseen.
    pub(super) fn forget_stale(&mut self, addr: u64, size: u64, ts: i64) {
        let end = addr.saturating_add(size);
        // Unseen segments there were released before arming, or while not armed.
        let mut gone: Vec<u64> = self
            .sight
            .unseen
            .range(addr..end)
            .map(|(&a, _)| a)
            .collect();
        gone.extend(self.sight.segment_at(addr));
        for a in gone {
            self.sight.unseen.remove(&a);
        }
        let orphans: Vec<u64> = self.orphans.range(addr..end).map(|(&a, _)| a).collect();
        for a in orphans {
            if let Some(o) = self.orphans.remove(&a) {
                self.unknown.freed_unseen += 1;
                self.unknown.freed_unseen_bytes += o.size;
            }
        }
        let mut stale: Vec<u64> = self.segments.range(addr..end).map(|(&a, _)| a).collect();
        if let Some((&a, seg)) = self.segments.range(..addr).next_back() {
            if a + seg.size > addr {
                stale.push(a);
            }
        }
        if stale.is_empty() {
            return;
        }
        self.evidence(ts);
        for a in stale {
            self.segment_free(a);
        }
    }

    /// Evidence that the layout differs from the allocator's, at `ts`.
    pub(super) fn evidence(&mut self, ts: i64) {
        if self.unknown.exact() {
            self.unknown.since_ns = Some(ts);
            self.unknown.longest_life_events = 0;
        }
        self.unknown.exact_ns = None;
        self.unknown.last_evidence_ns = self.unknown.last_evidence_ns.max(ts);
        self.unknown.last_evidence_event = self.block_events;
    }

    /// After a call that did not contradict the layout: exact again once nothing has for long
    /// enough (see [`Unknown`]).
    pub(super) fn settle(&mut self, ts: i64) {
        let u = &mut self.unknown;
        if u.exact() || u.unseen_segments {
            return;
        }
        let quiet = (2 * u.longest_life_events).max(QUIET_EVENTS);
        if self.block_events - u.last_evidence_event >= quiet {
            u.exact_ns = Some(ts);
        }
    }

    /// Moves every segment to the unseen ones and forgets every block.
    pub(super) fn drop_blocks(&mut self) {
        for (addr, seg) in std::mem::take(&mut self.segments) {
            let unseen = UnseenSegment {
                size: seg.size,
                device: seg.device,
                blocks: BTreeMap::new(),
            };
            self.sight.unseen.insert(addr, unseen);
        }
        for seg in self.sight.unseen.values_mut() {
            seg.blocks.clear();
        }
        self.gaps.clear();
        self.totals.clear();
        self.outside.clear();
        self.orphans.clear();
        self.pending = PendingFrees {
            held_unseen: self.pending.held_unseen,
            ..PendingFrees::default()
        };
    }

    pub(super) fn for_each_block(&mut self, mut f: impl FnMut(&mut Block)) {
        for seg in self.segments.values_mut() {
            for b in seg.blocks.values_mut() {
                f(b);
            }
        }
    }

    pub(super) fn block_free(&mut self, e: &Event) {
        self.block_events += 1;
        if self.forget_pending(e.ptr) {
            // Freed again while believed kept for other streams: their events completed unseen.
            self.remove_block(e.ptr, false);
            self.unexplained.unmatched_frees += 1;
            self.evidence(e.ts_ns);
            return;
        }
        let Some(block) = self.remove_block(e.ptr, true) else {
            if let Some(unseen) = self.sight.segment_at(e.ptr) {
                let seen = self
                    .sight
                    .unseen
                    .get_mut(&unseen)
                    .and_then(|seg| seg.blocks.remove(&e.ptr));
                if seen.is_none() {
                    self.sight.frees_before_arming += 1;
                }
            } else if self.orphans.remove(&e.ptr).is_none() {
                self.unexplained.unmatched_frees += 1;
                self.evidence(e.ts_ns);
            }
            return;
        };
        if !block.carried && !self.unknown.exact() {
            let life = self.block_events - block.event;
            self.unknown.longest_life_events = self.unknown.longest_life_events.max(life);
        }
        self.settle(e.ts_ns);
        self.pending.freeing.insert(
            e.tid,
            Freed {
                ptr: e.ptr,
                ts_ns: e.ts_ns,
                block,
            },
        );
    }

    /// Takes the block at `ptr` out of its segment, its space counted free again (and its bytes
    /// no longer allocated where `held`: not where its free was counted already): the block, or
    /// None where no known segment holds a block there.
    pub(super) fn remove_block(&mut self, ptr: u64, held: bool) -> Option<Block> {
        let (&addr, seg) = self.segments.range_mut(..=ptr).next_back()?;
        if ptr >= addr + seg.size {
            return None;
        }
        let span = seg.span_of_block(addr, ptr)?;
        let before = if span.is_some() {
            Vec::new()
        } else {
            seg.counted_gaps(addr)
        };
        let block = seg.blocks.remove(&ptr)?;
        let key = (seg.device, seg.pool.unwrap_or(Pool::Large));
        let totals = match span {
            // The spans on either side of it (either may be empty) become one.
            Some((lo, hi)) => {
                let (old, n) = nonzero_gaps(ptr - lo, hi - (ptr + block.size));
                self.swap_gaps(key, &old[..n], &[hi - lo])
            }
            None => {
                self.regap(addr, &before);
                self.totals.entry(key).or_default()
            }
        };
        if held {
            totals.allocated = totals.allocated.saturating_sub(block.size);
        }
        Some(block)
    }

    /// Recounts a segment's free gaps into its pool's multiset, where they were `before`.
    pub(super) fn regap(&mut self, addr: u64, before: &[u64]) {
        let Some(seg) = self.segments.get(&addr) else {
            return;
        };
        let Some(pool) = seg.pool else {
            return;
        };
        let key = (seg.device, pool);
        let new = free_gaps(addr, seg);
        self.swap_gaps(key, before, &new);
    }

    /// Takes the pool's free gaps `old` out of its multiset and counts `new` in: its free-block
    /// count and largest free block follow (each block event comes here once or twice: one
    /// look-up of the pool's multiset and one of its totals, returned for the caller's
    /// allocated bytes).
    pub(super) fn swap_gaps(
        &mut self,
        key: (i32, Pool),
        old: &[u64],
        new: &[u64],
    ) -> &mut PoolStats {
        let set = self.gaps.entry(key).or_default();
        let mut removed = 0u64;
        for &g in old {
            if let Some(n) = set.get_mut(&g) {
                *n -= 1;
                removed += 1;
                if *n == 0 {
                    set.remove(&g);
                }
            }
        }
        for &g in new {
            *set.entry(g).or_default() += 1;
        }
        let largest = set.keys().next_back().copied().unwrap_or(0);
        let t = self.totals.entry(key).or_default();
        t.free_blocks = t.free_blocks.saturating_sub(removed) + new.len() as u64;
        t.largest_free = largest;
        t
    }

    pub(super) fn refresh_largest(&mut self, key: (i32, Pool)) {
        let largest = self
            .gaps
            .get(&key)
            .and_then(|s| s.keys().next_back().copied())
            .unwrap_or(0);
        self.totals.entry(key).or_default().largest_free = largest;
    }
}

/// The gaps either side of a block that are not empty, without an allocation per block event.
fn nonzero_gaps(below: u64, above: u64) -> ([u64; 2], usize) {
    match (below > 0, above > 0) {
        (true, true) => ([below, above], 2),
        (true, false) => ([below, 0], 1),
        (false, true) => ([above, 0], 1),
        (false, false) => ([0, 0], 0),
    }
}

/// The size of a block of `rounded` bytes placed at the start of a free run of `run` bytes:
/// itself where the allocator splits the run, else the whole run (PyTorch's split rule).
fn placed_size(pool: Pool, expandable: bool, conf: AllocConf, rounded: u64, run: u64) -> u64 {
    let remaining = run.saturating_sub(rounded);
    if should_split(pool, expandable, conf, rounded, remaining) {
        rounded
    } else {
        run.max(rounded)
    }
}
