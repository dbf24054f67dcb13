//! Whether the allocator's block events are seen (`--allocator auto` arms PyTorch's probes only
//! while memory is tight): segments made while they were not have contents tracer did not
//! see, kept apart from the figures.

use super::*;

/// Whether a process's block events are seen (`--allocator auto` arms PyTorch's probes only
/// while memory is tight).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum BlockSight {
    /// From the process's first call (`--allocator always`, and every session before the mode).
    #[default]
    Always,
    /// Armed at this time (wall ns): segments made before hold blocks tracer never saw.
    ArmedAt(i64),
    /// Not armed since this time (wall ns): what was known of the blocks is dropped.
    DisarmedAt(i64),
    /// Being armed since this time: the semaphores are being raised, so a segment made now
    /// may hold blocks made before they were up. New segments are of unknown contents until
    /// the armed mark (made once they are up); block events are taken.
    ArmingSince(i64),
}

/// A segment whose contents tracer did not see: made before the allocator's probes were
/// armed, or while they were not. Its free bytes are unknown until it is released; blocks
/// seen in it since are kept only so that their frees are recognised.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct UnseenSegment {
    pub size: u64,
    pub device: i32,
    /// Blocks seen allocated in it since arming (address -> requested bytes).
    pub(super) blocks: BTreeMap<u64, u64>,
}

/// What the layout knows of the allocator's blocks (see [`BlockSight`]).
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct Sight {
    pub state: BlockSight,
    /// By address.
    pub(super) unseen: BTreeMap<u64, UnseenSegment>,
    /// Frees of blocks allocated before arming: expected, not evidence of a gap.
    pub frees_before_arming: u64,
}

impl Sight {
    /// Segments made at `ts` have contents tracer does not see.
    pub(super) fn hides(&self, ts: i64) -> bool {
        match self.state {
            BlockSight::Always => false,
            BlockSight::ArmedAt(at) => ts < at,
            BlockSight::DisarmedAt(_) | BlockSight::ArmingSince(_) => true,
        }
    }

    /// The unseen segment holding `ptr`, by its start address.
    pub(super) fn segment_at(&self, ptr: u64) -> Option<u64> {
        let (&addr, seg) = self.unseen.range(..=ptr).next_back()?;
        (ptr < addr + seg.size).then_some(addr)
    }
}

impl Layout {
    /// PyTorch's allocator probes were armed in this process at `ts`: block events are seen
    /// from then on; segments made before hold blocks tracer never saw.
    pub fn arm(&mut self, ts: i64) {
        // Armed already, or seen from the first call: nothing was missed.
        if let BlockSight::DisarmedAt(_) | BlockSight::ArmingSince(_) = self.sight.state {
            self.sight.state = BlockSight::ArmedAt(ts);
        }
    }

    /// tracer began raising the probes' semaphores at `ts` (the armed mark follows once they
    /// are up): block events are taken from now, but a segment made before that mark may hold
    /// blocks made before the semaphores were up, so its contents stay unknown.
    pub fn arming(&mut self, ts: i64) {
        if let BlockSight::DisarmedAt(_) = self.sight.state {
            self.sight.state = BlockSight::ArmingSince(ts);
        }
    }

    /// The probes were disarmed at `ts`: what was known of the blocks is dropped, and every
    /// segment's contents become unknown until it is released.
    pub fn disarm(&mut self, ts: i64) {
        if !matches!(self.sight.state, BlockSight::DisarmedAt(_)) {
            self.drop_blocks();
            self.sight.state = BlockSight::DisarmedAt(ts);
        }
    }

    /// Whether the segment at `addr` holds blocks tracer did not see (made before the
    /// allocator's probes were armed).
    pub fn contents_unseen(&self, addr: u64) -> bool {
        self.sight.unseen.contains_key(&addr)
    }

    /// The segments whose contents tracer did not see: (address, size).
    pub fn unseen_segments(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        self.sight.unseen.iter().map(|(&a, s)| (a, s.size))
    }

    pub fn blocks_known(&self) -> bool {
        matches!(
            self.sight.state,
            BlockSight::Always | BlockSight::ArmedAt(_)
        )
    }

    /// Whether block events are seen now, and since when.
    pub fn block_sight(&self) -> BlockSight {
        self.sight.state
    }

    /// Segments whose contents tracer did not see, on `device` (all: None): (segments,
    /// bytes). Their free bytes and largest free block are unknown: the pools' figures count
    /// only the segments seen whole.
    pub fn unseen_contents(&self, device: Option<i32>) -> (u64, u64) {
        let mut out = (0, 0);
        for seg in self.sight.unseen.values() {
            if device.is_none_or(|d| d == seg.device) {
                out.0 += 1;
                out.1 += seg.size;
            }
        }
        out
    }

    /// The devices with segments of unseen contents.
    pub fn unseen_devices(&self) -> impl Iterator<Item = i32> + '_ {
        self.sight.unseen.values().map(|s| s.device)
    }
}
