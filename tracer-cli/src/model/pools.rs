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

/// One private pool on one device at a moment.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
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
}

#[cfg(test)]
mod tests {
    use super::*;

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
