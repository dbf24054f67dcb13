//! What each call of a session changed, for the Perfetto export (`present/perfetto.rs` encodes
//! it): failed and retried allocations, the early warning, and the counters of allocated,
//! reserved, device memory held and the largest free block, from the allocator state replayed
//! call by call here, on the query side.

use std::collections::{HashMap, HashSet};

use tracer_common::OpClass;

use crate::model::{
    figures::Figures, layout::AllocConf, live::LiveAllocators, state::ProcessState, Event,
};

/// The early warning a call raised: the next request of the pool cannot be served.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Warning {
    pub request: u64,
    pub largest_free: u64,
    pub device_free: u64,
    pub device: i32,
}

/// What one call changed.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Consequences {
    /// The call's device (-1: none).
    pub device: i32,
    pub failed: bool,
    pub retried: bool,
    pub warning: Option<Warning>,
    /// Allocated, reserved, device memory held, largest free block (each None where not
    /// known or not moved): in [`COUNTERS`]' order.
    pub counters: [Option<u64>; 4],
}

/// The counters' names, in [`Consequences::counters`]' order.
pub const COUNTERS: [&str; 4] = [
    "allocated",
    "reserved",
    "device memory held",
    "largest free block",
];

/// Every process's allocator state and figures, call by call.
pub struct Replay {
    allocators: LiveAllocators,
    figures: Figures,
    confs: HashMap<u32, AllocConf>,
    described: HashSet<u32>,
}

impl Replay {
    /// `confs`: each process's allocator settings.
    pub fn new(confs: HashMap<u32, AllocConf>) -> Replay {
        Replay {
            allocators: LiveAllocators::default(),
            figures: Figures::default(),
            confs,
            described: HashSet::new(),
        }
    }

    /// The processes' states where the calls to come begin (a keyframe's): the counters go on
    /// from them.
    pub fn start_from(&mut self, states: impl IntoIterator<Item = ProcessState>) {
        for s in states {
            self.allocators.restore(s);
        }
    }

    /// Applies one call; what it changed.
    pub fn call(&mut self, e: &Event) -> Consequences {
        let device = e.device.max(-1);
        let before = self.device_figures(e.pid, device);
        self.figures.apply(e);
        let after = self.device_figures(e.pid, device);
        let mut out = Consequences {
            device,
            ..Consequences::default()
        };
        if let (Some(after), before) = (after, before.unwrap_or_default()) {
            out.failed = after.alloc_failures > before.alloc_failures;
            out.retried = after.retries > before.retries;
        }
        if self.described.insert(e.pid) {
            if let Some(&conf) = self.confs.get(&e.pid) {
                self.allocators.describe(e.pid, Some(conf), None);
            }
        }
        out.warning = self.allocators.apply(e).map(|alarm| Warning {
            request: alarm.request,
            largest_free: alarm.stats.largest_free,
            device_free: alarm.device_free,
            device: alarm.device,
        });
        let moves_memory = matches!(
            e.op.spec().class,
            OpClass::Alloc | OpClass::Free | OpClass::BlockAlloc | OpClass::BlockFree
        );
        if let Some(row) = moves_memory
            .then(|| self.allocators.row(e.pid, device))
            .flatten()
        {
            let blocks = row.view == "blocks";
            out.counters = [
                blocks.then_some(row.stats.allocated),
                blocks.then_some(row.stats.reserved),
                Some(row.stats.reserved + row.outside),
                blocks.then_some(row.stats.largest_free),
            ];
        }
        out
    }

    fn device_figures(
        &self,
        pid: u32,
        device: i32,
    ) -> Option<crate::model::figures::DeviceFigures> {
        self.figures.get(pid)?.devices.get(&device).cloned()
    }
}
