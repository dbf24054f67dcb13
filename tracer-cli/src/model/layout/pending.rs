//! Blocks freed while other streams' work may still use them (`Tensor.record_stream`): kept
//! out of their pool until the allocator finds its events complete; and new segments that
//! prove a block was held unseen.

use super::*;

/// Blocks the program freed that the allocator keeps until other streams' work is done.
///
/// PyTorch's `pytorch:free` fires before its allocator looks at the block. A block used on
/// other streams (`Tensor.record_stream`) is not returned to its pool then: the allocator
/// records a CUDA event on each of those streams (cudaEventRecord, called from its own library,
/// right after the free on the same thread) and returns the block when the last one is found
/// complete (cudaEventQuery or cudaEventSynchronize succeeding). Such a block is not allocated
/// (PyTorch's allocated bytes dropped at the free) and not free either.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct PendingFrees {
    /// Block address -> its events not yet seen complete.
    pub(super) blocks: BTreeMap<u64, u32>,
    /// Event handle -> the block it was recorded for.
    pub(super) events: BTreeMap<u64, u64>,
    /// Per thread, the block it freed last (while events recorded next may be that free's).
    pub(super) freeing: BTreeMap<u32, Freed>,
    /// Each cudaMalloc'ed segment's stream (a segment serves one), from its first block.
    pub(super) segment_streams: BTreeMap<u64, u64>,
    /// New segments made while a free block of the same pool and stream that fit the request
    /// was believed free: the allocator did not have it, something held it unseen (blocks
    /// handed out without the probes: `torch.cuda.caching_allocator_alloc`, `raw_alloc`).
    pub held_unseen: u64,
}

/// A block a thread freed last: where, when, and what it was.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub(super) struct Freed {
    pub(super) ptr: u64,
    pub(super) ts_ns: i64,
    pub(super) block: Block,
}

/// The longest a free's own event records follow it (they are made inside the same call, a
/// few microseconds later; the allocator's later records are for blocks freed during a CUDA
/// graph capture, long before).
pub(crate) const FREE_RECORDS_WITHIN_NS: i64 = 10_000_000;

/// `aux1` of a cudaEventRecord called from the library that holds PyTorch's allocator probes
/// (the recording tells so from the call's return address).
pub const EVENT_FROM_ALLOCATOR: u64 = 1;

impl Layout {
    /// The allocator recorded an event for the block its thread just freed: the block is kept
    /// out of its pool until the event completes.
    pub(super) fn event_recorded(&mut self, e: &Event) {
        if self.pending.events.contains_key(&e.ptr) {
            // The pool hands an event out again only once it completed: its completion was
            // not seen.
            self.event_complete(e.ptr);
        }
        let Some(freed) = self.pending.freeing.get(&e.tid) else {
            return;
        };
        if e.ts_ns.saturating_sub(freed.ts_ns) > FREE_RECORDS_WITHIN_NS {
            return;
        }
        let ptr = freed.ptr;
        if let Some(n) = self.pending.blocks.get_mut(&ptr) {
            *n += 1;
        } else {
            let Some(addr) = self.segment_at(ptr) else {
                return;
            };
            let seg = &self.segments[&addr];
            let fits = free_end(addr, seg, ptr).is_some_and(|end| end >= ptr + freed.block.size);
            if !fits {
                // Its space was handed out since: not this block's event.
                return;
            }
            let key = (seg.device, seg.pool.unwrap_or(Pool::Large));
            let block = freed.block.clone();
            self.insert_block(addr, key, ptr, block);
            self.pending.blocks.insert(ptr, 1);
        }
        self.pending.events.insert(e.ptr, ptr);
    }

    /// An event found complete: the block it was recorded for returns to its pool with its
    /// last one.
    pub(super) fn event_complete(&mut self, event: u64) {
        let Some(ptr) = self.pending.events.remove(&event) else {
            return;
        };
        let Some(n) = self.pending.blocks.get_mut(&ptr) else {
            return;
        };
        *n = n.saturating_sub(1);
        if *n == 0 {
            self.pending.blocks.remove(&ptr);
            self.remove_block(ptr, false);
        }
    }

    /// The allocator made segment `addr` for a request of `rounded` bytes on `e`'s stream. It
    /// does so only when no free block of that pool and stream fits; one believed free that
    /// would have is held by something tracer did not see.
    pub(super) fn new_segment_for(&mut self, addr: u64, e: &Event, rounded: u64) {
        let stream = e.aux0;
        let Some(seg) = self.segments.get(&addr) else {
            return;
        };
        let key = (seg.device, seg.pool.unwrap_or(Pool::Large));
        let conf = self.conf;
        // PyTorch's get_free_block: an oversize block serves only requests near its size.
        let serves = |gap: u64| serves(key.1, conf, rounded, gap);
        let private = self.private.of(addr);
        let unseen = self.segments.iter().any(|(&a, s)| {
            a != addr
                && s.mapped.is_none()
                && (s.device, s.pool) == (key.0, Some(key.1))
                && self.private.of(a) == private
                && self.pending.segment_streams.get(&a) == Some(&stream)
                && free_gaps(a, s).into_iter().any(serves)
        });
        self.pending.segment_streams.insert(addr, stream);
        if unseen {
            self.pending.held_unseen += 1;
            self.evidence(e.ts_ns);
        }
    }

    /// Forgets that the block at `ptr` waits for events; whether it did.
    pub(super) fn forget_pending(&mut self, ptr: u64) -> bool {
        if self.pending.blocks.remove(&ptr).is_none() {
            return false;
        }
        self.pending.events.retain(|_, b| *b != ptr);
        true
    }
}
