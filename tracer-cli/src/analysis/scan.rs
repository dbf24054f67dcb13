//! One pass over a process's calls in the window, gathering what the per-op table and the rules
//! that need no replay read. Ten million calls take about 0.1 s per pass over them, so the
//! rules share one instead of making one each.

use tracer_common::{Library, OpClass, Space, OP_COUNT};

use super::{BlockTally, Event};
use crate::model::attempts::{attempts, Attempt};

/// One op's calls.
#[derive(Debug, Default)]
pub struct OpAcc {
    pub durations: Vec<u64>,
    pub errors: u64,
    /// Bytes of its successful allocations or frees.
    pub bytes: u64,
}

#[derive(Debug)]
pub struct Scan<'a> {
    /// Indexed by op value.
    pub by_op: [OpAcc; OP_COUNT],
    /// Successful allocations and frees (any memory space).
    pub allocs_ok: u64,
    pub frees_ok: u64,
    /// Successful frees of device memory.
    pub device_frees_ok: u64,
    /// The window's device allocation attempts, as PyTorch counts them (model/attempts.rs).
    pub attempts: Vec<Attempt>,
    /// Some driver (libcuda) allocation was made.
    pub driver_allocs: bool,
    pub syncs: Vec<&'a Event>,
    /// Durations of the successful device allocations.
    pub device_alloc_durations: Vec<u64>,
    /// The block events' durations that are not zero, and how many are (their tally).
    pub block_durations: Vec<u64>,
    pub block_zero_durations: u64,
}

impl<'a> Scan<'a> {
    pub fn of(evs: &'a [Event], blocks: Option<&BlockTally>) -> Scan<'a> {
        let mut counts = [0usize; OP_COUNT];
        for e in evs {
            counts[e.op as usize] += 1;
        }
        let mut scan = Scan {
            by_op: std::array::from_fn(|i| OpAcc {
                durations: Vec::with_capacity(counts[i]),
                ..OpAcc::default()
            }),
            allocs_ok: 0,
            frees_ok: 0,
            device_frees_ok: 0,
            attempts: attempts(evs),
            driver_allocs: false,
            syncs: Vec::new(),
            device_alloc_durations: Vec::new(),
            block_durations: blocks
                .iter()
                .flat_map(|b| b.ops.values())
                .flat_map(|t| t.durations.iter().copied())
                .collect(),
            block_zero_durations: blocks
                .map_or(0, |b| b.ops.values().map(|t| t.zero_durations).sum()),
        };
        for e in evs {
            let acc = &mut scan.by_op[e.op as usize];
            acc.durations.push(e.duration_ns);
            let spec = e.op.spec();
            if e.ret != 0 {
                acc.errors += 1;
            }
            match (spec.class, e.ret) {
                (OpClass::Alloc, 0) => {
                    acc.bytes += e.size;
                    scan.allocs_ok += 1;
                    if spec.space == Space::Device {
                        scan.device_alloc_durations.push(e.duration_ns);
                    }
                }
                (OpClass::Free, 0) => {
                    acc.bytes += e.size;
                    scan.frees_ok += 1;
                    if spec.space == Space::Device {
                        scan.device_frees_ok += 1;
                    }
                }
                (OpClass::Sync, _) => scan.syncs.push(e),
                _ => {}
            }
            if spec.class == OpClass::Alloc && spec.library == Library::Driver {
                scan.driver_allocs = true;
            }
        }
        scan
    }

    /// Durations of every call that are not zero, in no order (the per-op table reorders
    /// them), and how many are zero (block events' are counted, not kept).
    pub fn all_durations(&self) -> (Vec<u64>, u64) {
        let mut zeros = self.block_zero_durations;
        let mut d: Vec<u64> = self.block_durations.clone();
        for acc in &self.by_op {
            for &v in &acc.durations {
                if v == 0 {
                    zeros += 1;
                } else {
                    d.push(v);
                }
            }
        }
        (d, zeros)
    }
}
