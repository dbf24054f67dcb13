//! An imported memory snapshot judges tracer's layout model: the layout rebuilt from the
//! stored session at its end must equal the allocator's own final `segments`, every segment,
//! block and state (a block pending free on other streams counts as allocated: it is not back
//! in its pool).

use std::path::Path;

use anyhow::Result;
use serde::Serialize;

use super::layout::{layout, At, LayoutQuery};
use crate::{
    decode::memory_snapshot::{BlockKind, MemorySnapshot},
    model::layout::RunKind,
};

/// How the rebuilt final layout compares with the snapshot's.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct SnapshotCheck {
    pub segments: u64,
    pub segments_equal: u64,
    pub blocks: u64,
    pub blocks_equal: u64,
    /// The first segment that differs, said in words.
    pub first_difference: Option<String>,
}

impl SnapshotCheck {
    pub fn equal(&self) -> bool {
        self.segments == self.segments_equal && self.first_difference.is_none()
    }
}

/// (address, size, allocated) of each block of a segment.
type Blocks = Vec<(u64, u64, bool)>;

/// Compares session `session`'s layout at its end with `snap`'s segments.
pub fn check(db: &Path, session: i64, snap: &MemorySnapshot) -> Result<SnapshotCheck> {
    let (_, processes) = layout(
        db,
        &LayoutQuery {
            session: Some(session),
            pid: None,
            device: None,
            at: At::End,
        },
    )?;
    let mut rebuilt: std::collections::BTreeMap<(i32, u64), (u64, Blocks)> = processes
        .iter()
        .flat_map(|p| &p.segments)
        .flat_map(|s| {
            if !s.expandable {
                let blocks: Blocks = s
                    .runs
                    .iter()
                    .map(|r| (r.addr, r.size, r.kind == RunKind::Allocated))
                    .collect();
                return vec![((s.device, s.addr), (s.size, blocks))];
            }
            // PyTorch lists each mapped stretch of an expandable segment as a segment of its
            // own, its size what is mapped.
            stretches(&s.runs)
                .into_iter()
                .map(|blocks| {
                    let size = blocks.iter().map(|b| b.1).sum();
                    ((s.device, blocks[0].0), (size, blocks))
                })
                .collect()
        })
        .collect();
    let mut out = SnapshotCheck::default();
    let mut own_segments: Vec<_> = snap.segments.iter().collect();
    own_segments.sort_by_key(|s| (s.device, s.address));
    for s in own_segments {
        let own: Blocks = s
            .blocks
            .iter()
            .map(|b| (b.address, b.size, b.state != BlockKind::Inactive))
            .collect();
        out.segments += 1;
        out.blocks += own.len() as u64;
        match rebuilt.remove(&(s.device, s.address)) {
            Some((size, blocks)) if size == s.total_size && blocks == own => {
                out.segments_equal += 1;
                out.blocks_equal += own.len() as u64;
            }
            Some((size, blocks)) => {
                out.blocks_equal += blocks.iter().filter(|b| own.contains(b)).count() as u64;
                out.first_difference.get_or_insert_with(|| {
                    format!(
                        "segment {:#x} on device {}: the allocator's is {} bytes in {} blocks {}, tracer's {} bytes in {} blocks {}",
                        s.address,
                        s.device,
                        s.total_size,
                        own.len(),
                        blocks_text(&own),
                        size,
                        blocks.len(),
                        blocks_text(&blocks)
                    )
                });
            }
            None => {
                out.first_difference.get_or_insert_with(|| {
                    format!(
                        "segment {:#x} on device {} ({} bytes, {} blocks) is missing from tracer's layout",
                        s.address,
                        s.device,
                        s.total_size,
                        own.len()
                    )
                });
            }
        }
    }
    if let Some(((device, addr), (size, _))) = rebuilt.into_iter().next() {
        out.first_difference.get_or_insert_with(|| {
            format!("tracer's layout holds segment {addr:#x} on device {device} ({size} bytes) that the allocator no longer has")
        });
    }
    Ok(out)
}

/// The mapped stretches of an expandable segment's runs, each its blocks in address order.
fn stretches(runs: &[crate::model::layout::Run]) -> Vec<Blocks> {
    let mut out: Vec<Blocks> = Vec::new();
    let mut current: Blocks = Vec::new();
    for r in runs {
        if r.kind == RunKind::Unmapped {
            if !current.is_empty() {
                out.push(std::mem::take(&mut current));
            }
            continue;
        }
        current.push((r.addr, r.size, r.kind == RunKind::Allocated));
    }
    if !current.is_empty() {
        out.push(current);
    }
    out
}

fn blocks_text(blocks: &Blocks) -> String {
    let shown: Vec<String> = blocks
        .iter()
        .take(6)
        .map(|&(a, s, alloc)| format!("{a:#x}+{s}{}", if alloc { "" } else { " free" }))
        .collect();
    let more = if blocks.len() > 6 { ", ..." } else { "" };
    format!("[{}{more}]", shown.join(", "))
}
