//! Whose requested size a free block shows. PyTorch's snapshot writes, for an inactive block,
//! the `requested_size` its Block object was last allocated with, and the layout holds free
//! space as gaps, not Block objects, so the export follows PyTorch's rules for those objects
//! beside it, run by run:
//!
//! - an allocation that splits a free block gives the part it takes to a new Block; the
//!   remainder stays the old one;
//! - a freed block keeps its own identity and absorbs the free neighbours it merges with;
//! - a new segment, and the pieces that mapping or unmapping pages of an expandable segment
//!   leaves beside them, are new Blocks (never allocated: 0);
//! - pages mapped take the identity of the unmapped block they came from, and pages unmapped
//!   that of the free block they were.
//!
//! A free run that existed before the replay began has a last tenant tracer did not see.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};

use tracer_common::{OpClass, Space};

use crate::model::layout::{Layout, Run, RunKind};
use crate::model::Event;

/// The Block object a free or unmapped run is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Tenant {
    /// Last allocated with this many bytes requested (0: never allocated).
    Requested(u64),
    /// Free since before the replay began: its last tenant was not seen.
    NotSeen,
}

/// The tenant of every free and unmapped run, per segment.
#[derive(Debug, Default)]
pub struct Tenants {
    /// Per segment (by its start): each free or unmapped run's, by the run's start.
    segments: HashMap<u64, BTreeMap<u64, Tenant>>,
    /// The block the latest free released: an event the allocator records next may keep it
    /// out of its pool.
    last_freed: Option<u64>,
}

/// The runs of the segments an event may change, as they were before it.
pub struct Before {
    segments: Vec<(u64, Vec<Run>)>,
}

impl Tenants {
    /// Every free and unmapped run of `layout` is one whose last tenant was not seen.
    pub fn not_seen(layout: &Layout) -> Tenants {
        let segments = layout
            .segment_maps(true)
            .into_iter()
            .map(|s| {
                let runs = s
                    .runs
                    .iter()
                    .filter(|r| !holds_block(r))
                    .map(|r| (r.addr, Tenant::NotSeen))
                    .collect();
                (s.addr, runs)
            })
            .collect();
        Tenants {
            segments,
            last_freed: None,
        }
    }

    /// The tenant of the free run at `run` in the segment at `segment`.
    pub fn of(&self, segment: u64, run: u64) -> Tenant {
        self.segments
            .get(&segment)
            .and_then(|runs| runs.get(&run))
            .copied()
            .unwrap_or(Tenant::NotSeen)
    }

    /// The runs `e` may change, read before the layout applies it (None: it changes none).
    pub fn before(&self, layout: &Layout, e: &Event) -> Option<Before> {
        let touched = self.touched(layout, e)?;
        let segments = touched
            .into_iter()
            .filter_map(|addr| Some((addr, layout.runs_of_segment(addr)?)))
            .collect();
        Some(Before { segments })
    }

    /// Relabels the runs `e` changed, now that the layout applied it.
    pub fn after(&mut self, layout: &Layout, before: Before, e: &Event) {
        let mut touched: BTreeSet<u64> = self.touched(layout, e).unwrap_or_default();
        let mut old: HashMap<u64, Vec<Run>> = before.segments.into_iter().collect();
        touched.extend(old.keys().copied());
        for addr in touched {
            let old_runs = old.remove(&addr).unwrap_or_default();
            let Some(new_runs) = layout.runs_of_segment(addr) else {
                self.segments.remove(&addr);
                continue;
            };
            let old_tenants = self.segments.remove(&addr).unwrap_or_default();
            let labels = relabel(&old_runs, &old_tenants, &new_runs, Change::of(e));
            self.segments.insert(addr, labels);
        }
        if e.op.spec().class == OpClass::BlockFree {
            self.last_freed = Some(e.ptr);
        }
    }

    /// The segments `e` may change: the one its address lies in, and for the allocator's
    /// events, those holding blocks kept for other streams.
    fn touched(&self, layout: &Layout, e: &Event) -> Option<BTreeSet<u64>> {
        let spec = e.op.spec();
        let mut out = BTreeSet::new();
        match (spec.class, spec.space) {
            (OpClass::BlockAlloc | OpClass::BlockFree, _)
            | (OpClass::Alloc | OpClass::Free, Space::Device)
            | (OpClass::Alloc | OpClass::Free, Space::AddressRange)
            | (OpClass::Alloc | OpClass::Free, Space::Mapping) => {
                out.extend(layout.segment_of(e.ptr));
            }
            (OpClass::EventRecord | OpClass::EventWait, _) => {
                out.extend(self.last_freed.and_then(|p| layout.segment_of(p)));
            }
            _ => return None,
        }
        out.extend(layout.pending_blocks().filter_map(|p| layout.segment_of(p)));
        Some(out)
    }
}

/// What kind of change made the new runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Change {
    Map,
    Unmap,
    Other,
}

impl Change {
    fn of(e: &Event) -> Change {
        let spec = e.op.spec();
        match (spec.class, spec.space) {
            (OpClass::Alloc, Space::Mapping) => Change::Map,
            (OpClass::Free, Space::Mapping) => Change::Unmap,
            _ => Change::Other,
        }
    }
}

fn holds_block(r: &Run) -> bool {
    matches!(r.kind, RunKind::Allocated | RunKind::Pending)
}

/// The tenants of a segment's free and unmapped runs after a change, from its runs before.
fn relabel(
    old: &[Run],
    old_tenants: &BTreeMap<u64, Tenant>,
    new: &[Run],
    change: Change,
) -> BTreeMap<u64, Tenant> {
    // Blocks gone back to free space: each makes the free run it lies in its own. (By
    // address: a small pool's segment may hold thousands of blocks.)
    let still: HashSet<u64> = new
        .iter()
        .filter(|r| holds_block(r))
        .map(|r| r.addr)
        .collect();
    let freed: Vec<&Run> = old
        .iter()
        .filter(|r| holds_block(r) && !still.contains(&r.addr))
        .collect();
    let old_space: HashMap<u64, &Run> = old
        .iter()
        .filter(|r| !holds_block(r))
        .map(|r| (r.addr, r))
        .collect();
    let tenant_of = |r: &Run| old_tenants.get(&r.addr).copied().unwrap_or(Tenant::NotSeen);
    let mut out = BTreeMap::new();
    for n in new.iter().filter(|r| !holds_block(r)) {
        let overlaps = |r: &Run| r.addr < n.addr + n.size && n.addr < r.addr + r.size;
        let same = old_space
            .get(&n.addr)
            .filter(|r| r.kind == n.kind && r.size == n.size);
        let freed_here = freed.iter().rev().find(|r| overlaps(r));
        let tenant = if let Some(b) = freed_here.filter(|_| n.kind == RunKind::Free) {
            Tenant::Requested(b.requested)
        } else if let Some(&r) = same {
            tenant_of(r)
        } else {
            // Mapped pages take the unmapped block's identity, unmapped pages the free
            // block's; what either leaves beside them is new.
            let from = match (change, n.kind) {
                (Change::Map, RunKind::Free) => Some(RunKind::Unmapped),
                (Change::Unmap, RunKind::Unmapped) => Some(RunKind::Free),
                (Change::Map | Change::Unmap, _) => None,
                (Change::Other, kind) => Some(kind),
            };
            from.and_then(|kind| old.iter().find(|r| r.kind == kind && overlaps(r)))
                .map_or(Tenant::Requested(0), tenant_of)
        };
        out.insert(n.addr, tenant);
    }
    out
}

#[cfg(test)]
mod tests {
    use tracer_common::Op;

    use super::*;
    use crate::model::layout::{tests::ev, AllocConf};

    /// Replays `events`, relabelling as the export does.
    fn replay(layout: &mut Layout, tenants: &mut Tenants, events: &[Event]) {
        for e in events {
            let before = tenants.before(layout, e);
            layout.apply(e);
            if let Some(b) = before {
                tenants.after(layout, b, e);
            }
        }
    }

    const SEG: u64 = 0x7000_0000;
    const MIB: u64 = 1 << 20;

    #[test]
    fn a_split_leaves_the_old_tenant_and_a_free_brings_its_own() {
        let mut layout = Layout::new(AllocConf::default());
        let mut tenants = Tenants::default();
        replay(
            &mut layout,
            &mut tenants,
            &[
                ev(Op::CudaMalloc, SEG, 20 * MIB),
                ev(Op::TorchMalloc, SEG, 8 * MIB),
            ],
        );
        // The segment's remainder is the Block the segment was made as: never allocated.
        assert_eq!(tenants.of(SEG, SEG + 8 * MIB), Tenant::Requested(0));
        replay(
            &mut layout,
            &mut tenants,
            &[
                ev(Op::TorchMalloc, SEG + 8 * MIB, 4 * MIB),
                ev(Op::TorchFree, SEG, 8 * MIB),
            ],
        );
        assert_eq!(tenants.of(SEG, SEG), Tenant::Requested(8 * MIB));
        assert_eq!(tenants.of(SEG, SEG + 12 * MIB), Tenant::Requested(0));
        // Freed between two free runs: one run, the freed block's.
        replay(
            &mut layout,
            &mut tenants,
            &[ev(Op::TorchFree, SEG + 8 * MIB, 4 * MIB)],
        );
        assert_eq!(tenants.of(SEG, SEG), Tenant::Requested(4 * MIB));
        // A smaller request splits it: the remainder keeps the 4 MiB tenant.
        replay(
            &mut layout,
            &mut tenants,
            &[ev(Op::TorchMalloc, SEG, 2 * MIB)],
        );
        assert_eq!(tenants.of(SEG, SEG + 2 * MIB), Tenant::Requested(4 * MIB));
        replay(&mut layout, &mut tenants, &[ev(Op::CudaFree, SEG, 0)]);
        assert!(!tenants.segments.contains_key(&SEG));
    }

    #[test]
    fn free_runs_from_before_the_replay_are_not_seen() {
        let mut layout = Layout::new(AllocConf::default());
        let mut none = Tenants::default();
        replay(
            &mut layout,
            &mut none,
            &[
                ev(Op::CudaMalloc, SEG, 20 * MIB),
                ev(Op::TorchMalloc, SEG, 8 * MIB),
            ],
        );
        let mut tenants = Tenants::not_seen(&layout);
        assert_eq!(tenants.of(SEG, SEG + 8 * MIB), Tenant::NotSeen);
        replay(
            &mut layout,
            &mut tenants,
            &[ev(Op::TorchMalloc, SEG + 8 * MIB, 2 * MIB)],
        );
        assert_eq!(tenants.of(SEG, SEG + 10 * MIB), Tenant::NotSeen);
    }
}
