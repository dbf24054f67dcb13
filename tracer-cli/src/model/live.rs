//! The allocator's figures while a trace runs: each process's layout, rebuilt call by call, and
//! the largest request of each interval, for the live table and the end-of-trace summary.

use std::collections::BTreeMap;

use serde::Serialize;
use tracer_common::OpClass;

use super::{
    layout::{AllocConf, Layout, PoolStats},
    moves_memory,
    pressure::Alarm,
    state::ProcessState,
    Event, Rank,
};

/// What the live table shows of one process on one device.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct AllocatorRow {
    pub pid: u32,
    pub device: i32,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rank: Option<String>,
    /// "blocks" when the allocator's own probes are seen; "segments" when only cudaMalloc is.
    pub view: &'static str,
    /// Allocated, reserved, free blocks and the largest free block (blocks view); in the
    /// segments view only `reserved`, the device bytes held.
    /// (The largest free block is the default pools': a private pool's serve only requests
    /// routed to it.)
    #[serde(flatten)]
    pub stats: PoolStats,
    /// Of `stats`, the private pools' (CUDA graphs', MemPools'), where tracer knows them: their
    /// reserved and allocated bytes, free blocks and largest free block.
    #[serde(skip_serializing_if = "PoolStats::is_empty")]
    pub private: PoolStats,
    /// 1 - largest free block / cached bytes, in the device's worst default pool (blocks
    /// view): private pools' free blocks serve only their own requests.
    pub fragmentation: f64,
    /// Device bytes held outside the allocator's segments.
    pub outside: u64,
    /// Bytes of segments whose contents tracer did not see (`--allocator auto` armed after
    /// they were made): not in `stats`, their free room unknown.
    pub unseen: u64,
    /// The largest request since the last look.
    pub largest_request: u64,
    /// The device as this process's cudaMemGetInfo last said (free bytes kept current with
    /// its own calls since), when it has asked.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub device_said: Option<super::pressure::DeviceFree>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub device_total: Option<u64>,
    /// The process has ended: its last figures.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub exited: bool,
}

#[derive(Default)]
struct Process {
    /// Layout, early-warning state, peaks and counts: what a keyframe keeps.
    state: ProcessState,
    rank: Option<String>,
    /// Per device: the largest request since the last look.
    largest_request: BTreeMap<i32, u64>,
}

/// Every traced process's layout, as the calls arrive.
#[derive(Default)]
pub struct LiveAllocators {
    processes: BTreeMap<u32, Process>,
    /// The last figures of processes that ended (the most recent [`ENDED_KEPT`]).
    ended: std::collections::VecDeque<AllocatorRow>,
}

/// Ended processes whose last figures are kept for the table and the summary.
pub const ENDED_KEPT: usize = 64;

impl LiveAllocators {
    /// A process's settings and rank, from its kept environment (before its first call).
    pub fn describe(&mut self, pid: u32, conf: Option<AllocConf>, rank: Option<Rank>) {
        let p = self.process(pid);
        if p.state.layout.blocks_seen == 0 && p.state.events == 0 {
            p.state.layout = Layout::new(conf.unwrap_or_default());
        }
        p.rank = rank.map(|r| r.label());
    }

    /// The process's start time (a keyframe names the process by it).
    pub fn started(&mut self, pid: u32, start_time_ns: Option<i64>) {
        self.process(pid).state.start_time_ns = start_time_ns;
    }

    fn process(&mut self, pid: u32) -> &mut Process {
        self.processes.entry(pid).or_insert_with(|| Process {
            state: ProcessState {
                pid,
                ..Default::default()
            },
            ..Default::default()
        })
    }

    /// Applies one call (a process's calls in the order they happened); the early warning's
    /// figures when the call leaves its pool in the state in which the next request fails.
    pub fn apply(&mut self, e: &Event) -> Option<Alarm> {
        self.process(e.pid).apply(e)
    }

    /// [`LiveAllocators::apply`], and what the whole-run series takes after a call that moves
    /// memory: the process's figures on the call's device (a row's stats, view and
    /// fragmentation, without the rest of the row) and the device's free bytes
    /// ([`LiveAllocators::device_free`]), in one look-up of the process (this runs after every
    /// call).
    pub fn apply_for_series(
        &mut self,
        e: &Event,
    ) -> (Option<Alarm>, Option<SeriesFigures>, Option<i64>) {
        let p = self.process(e.pid);
        let alarm = p.apply(e);
        if !moves_memory(e.class()) {
            return (alarm, None, None);
        }
        let device = e.device.max(-1);
        let free = p.state.pressure.device_free(device).map(|d| d.free);
        (alarm, Some(p.series_figures(device)), free)
    }

    /// A process ended: its layout goes (a process reusing the pid starts afresh), its last
    /// figures stay among the ended ones.
    pub fn exited(&mut self, pid: u32) {
        let Some(process) = self.processes.remove(&pid) else {
            return;
        };
        let mut one = LiveAllocators::default();
        one.processes.insert(pid, process);
        for row in one.rows() {
            if self.ended.len() == ENDED_KEPT {
                self.ended.pop_front();
            }
            self.ended.push_back(AllocatorRow {
                exited: true,
                ..row
            });
        }
    }

    /// A live process's layout.
    pub fn layout(&self, pid: u32) -> Option<&Layout> {
        Some(&self.processes.get(&pid)?.state.layout)
    }

    /// The processes followed now.
    pub fn pids(&self) -> Vec<u32> {
        self.processes.keys().copied().collect()
    }

    /// A process's state for a keyframe (the call-level join is the caller's to add).
    pub fn state(&self, pid: u32) -> Option<&ProcessState> {
        Some(&self.processes.get(&pid)?.state)
    }

    /// Takes a process's state up from a keyframe (tracer restarted while it ran).
    pub fn restore(&mut self, s: ProcessState) {
        let p = self.process(s.pid);
        p.state = ProcessState {
            live: Default::default(),
            thread_devices: Vec::new(),
            ..s
        };
    }

    /// Blocks every followed process holds (a keyframe costs in proportion).
    pub fn blocks_held(&self) -> u64 {
        self.processes
            .values()
            .map(|p| p.state.layout.blocks_held())
            .sum()
    }

    /// The device's free memory as cudaMemGetInfo last told the process, kept current with its
    /// own allocations since.
    pub fn device_free(&self, pid: u32, device: i32) -> Option<i64> {
        Some(
            self.processes
                .get(&pid)?
                .state
                .pressure
                .device_free(device)?
                .free,
        )
    }

    /// The rank label of a process, if its environment gave one.
    pub fn rank(&self, pid: u32) -> Option<&str> {
        self.processes.get(&pid)?.rank.as_deref()
    }

    /// The rows for each process and device with memory; starts a new interval.
    pub fn rows(&mut self) -> Vec<AllocatorRow> {
        let mut rows = Vec::new();
        for (&pid, p) in &mut self.processes {
            let layout = &p.state.layout;
            let mut devices: Vec<i32> = layout.stats().keys().map(|&(d, _)| d).collect();
            devices.extend(layout.outside_devices());
            devices.extend(layout.unseen_devices());
            devices.extend(p.largest_request.keys());
            devices.sort_unstable();
            devices.dedup();
            rows.extend(devices.into_iter().map(|device| p.row(pid, device)));
            p.largest_request.clear();
        }
        rows.extend(self.ended.iter().cloned());
        rows
    }

    /// One process's figures on one device now (the interval goes on).
    pub fn row(&self, pid: u32, device: i32) -> Option<AllocatorRow> {
        Some(self.processes.get(&pid)?.row(pid, device))
    }
}

/// A row's stats, view (blocks: true) and fragmentation: [`LiveAllocators::apply_for_series`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SeriesFigures {
    pub stats: PoolStats,
    pub blocks: bool,
    pub fragmentation: f64,
}

impl Process {
    fn row(&self, pid: u32, device: i32) -> AllocatorRow {
        let layout = &self.state.layout;
        let (stats, blocks, private) = self.stats(device);
        let outside = layout.outside(device);
        AllocatorRow {
            pid,
            device,
            rank: self.rank.clone(),
            view: if blocks { "blocks" } else { "segments" },
            fragmentation: layout.default_fragmentation(device),
            stats,
            private,
            outside: if blocks { outside } else { 0 },
            unseen: if blocks {
                layout.unseen_contents(Some(device)).1
            } else {
                0
            },
            largest_request: self.largest_request.get(&device).copied().unwrap_or(0),
            device_said: self.state.pressure.device_free(device).copied(),
            device_total: self.state.pressure.device_total(device),
            exited: false,
        }
    }

    /// Applies one call (see [`LiveAllocators::apply`]).
    fn apply(&mut self, e: &Event) -> Option<Alarm> {
        let alarm = self.state.apply_memory(e);
        let class = e.class();
        let request = matches!(class, OpClass::BlockAlloc)
            || (matches!(class, OpClass::Alloc) && self.state.layout.blocks_seen == 0);
        if request && e.size > 0 && moves_memory(class) {
            if let Some(device) = e.device() {
                let max = self.largest_request.entry(device).or_default();
                *max = (*max).max(e.size);
            }
        }
        alarm
    }

    fn series_figures(&self, device: i32) -> SeriesFigures {
        let (stats, blocks, _) = self.stats(device);
        SeriesFigures {
            stats,
            blocks,
            fragmentation: self.state.layout.default_fragmentation(device),
        }
    }

    /// The device's figures, whether they are the blocks' (else the segments' bytes held
    /// alone), and the private pools' part of them.
    fn stats(&self, device: i32) -> (PoolStats, bool, PoolStats) {
        let layout = &self.state.layout;
        // Not armed (`--allocator auto`): what is served is the device bytes held, as when
        // PyTorch's probes are never seen; no block figure from before is served as current.
        let disarmed = !layout.blocks_known();
        let blocks = layout.blocks_seen > 0 && !disarmed;
        let mut stats = layout.device_total(device);
        let mut private = PoolStats::default();
        for p in layout.private_pools().iter().filter(|p| p.device == device) {
            private.reserved += p.reserved;
            private.allocated += p.allocated;
            private.free_blocks += p.free_blocks;
            private.largest_free = private.largest_free.max(p.largest_free);
        }
        if private.reserved > 0 {
            stats.largest_free = layout
                .default_pools(device)
                .iter()
                .map(|(_, s)| s.largest_free)
                .max()
                .unwrap_or(0);
        }
        if !blocks {
            let outside = layout.outside(device);
            stats = PoolStats {
                reserved: stats.reserved + outside + layout.unseen_contents(Some(device)).1,
                ..PoolStats::default()
            };
            private = PoolStats::default();
        }
        (stats, blocks, private)
    }
}

#[cfg(test)]
mod tests {
    use tracer_common::Op;

    use super::*;

    const MIB: u64 = 1 << 20;

    fn event(op: Op, ptr: u64, size: u64) -> Event {
        Event {
            duration_ns: 1,
            pid: 7,
            tid: 7,
            ..crate::model::layout::tests::ev(op, ptr, size)
        }
    }

    #[test]
    fn rows_follow_the_blocks_and_the_interval() {
        let mut live = LiveAllocators::default();
        live.describe(
            7,
            None,
            Some(Rank {
                rank: Some(1),
                local_rank: Some(1),
                world_size: Some(2),
            }),
        );
        live.apply(&event(Op::CudaMalloc, 0x1000_0000, 20 * MIB));
        let rows = live.rows();
        assert_eq!(rows.len(), 1);
        assert_eq!(rows[0].view, "segments");
        assert_eq!(rows[0].stats.reserved, 20 * MIB);
        assert_eq!(rows[0].largest_request, 20 * MIB);
        assert_eq!(rows[0].rank.as_deref(), Some("rank 1/2"));

        // Two blocks with a hole between them: 12 MiB cached, in two free blocks.
        live.apply(&event(Op::TorchMalloc, 0x1000_0000, 4 * MIB));
        live.apply(&event(Op::TorchMalloc, 0x1000_0000 + 4 * MIB, 4 * MIB));
        live.apply(&event(Op::TorchMalloc, 0x1000_0000 + 8 * MIB, 4 * MIB));
        live.apply(&event(Op::TorchFree, 0x1000_0000 + 4 * MIB, 0));
        let rows = live.rows();
        assert_eq!(rows[0].view, "blocks");
        assert_eq!(rows[0].stats.allocated, 8 * MIB);
        assert_eq!(rows[0].stats.reserved, 20 * MIB);
        assert_eq!(rows[0].stats.free_blocks, 2);
        assert_eq!(rows[0].stats.largest_free, 8 * MIB);
        assert!((rows[0].fragmentation - (1.0 - 8.0 / 12.0)).abs() < 1e-9);
        assert_eq!(rows[0].largest_request, 4 * MIB);
        // A new interval with no requests.
        assert_eq!(live.rows()[0].largest_request, 0);
        // It ends: its last figures stay, marked, and a process reusing the pid starts afresh.
        live.exited(7);
        let rows = live.rows();
        assert_eq!(rows.len(), 1);
        assert!(rows[0].exited && rows[0].stats.allocated == 8 * MIB);
        live.apply(&event(Op::CudaMalloc, 0x2000_0000, 2 * MIB));
        let rows = live.rows();
        assert_eq!(rows.len(), 2);
        assert_eq!((rows[0].stats.reserved, rows[0].exited), (2 * MIB, false));
    }

    /// What the series takes after each call, read in the same look-up as the call is applied,
    /// equals what the live table's row and the device's free bytes say then; a call that moves
    /// no memory gives none.
    #[test]
    fn the_series_figures_taken_with_the_call_equal_those_read_after_it() {
        let mut live = LiveAllocators::default();
        let info = Event {
            aux0: 30 * MIB,
            aux1: 80 * MIB,
            ..event(Op::CudaMemGetInfo, 0, 0)
        };
        let (_, _, free) = live.apply_for_series(&info);
        assert_eq!(free, Some(30 * MIB as i64));
        let (_, figures, free) = live.apply_for_series(&event(Op::CudaEventQuery, 0x99, 0));
        assert_eq!((figures.is_none(), free), (true, None));
        // After the cudaMemGetInfo (at 0): its own allocations keep the free bytes current.
        let after = |ts_ns, e: Event| Event { ts_ns, ..e };
        let calls = [
            after(1, event(Op::CudaMalloc, 0x1000_0000, 20 * MIB)),
            after(2, event(Op::TorchMalloc, 0x1000_0000, 3 * MIB)),
            after(3, event(Op::TorchMalloc, 0x1040_0000, 5 * MIB)),
            after(4, event(Op::TorchFree, 0x1000_0000, 0)),
        ];
        let mut last = (None, None);
        for call in &calls {
            let (_, figures, free) = live.apply_for_series(call);
            let f = figures.expect("a call that moves memory");
            let row = live
                .rows()
                .into_iter()
                .find(|r| r.pid == 7 && r.device == 0);
            let row = row.expect("a row of device 0");
            let as_row = (row.stats, row.view == "blocks", row.fragmentation);
            assert_eq!((f.stats, f.blocks, f.fragmentation), as_row, "{call:?}");
            assert_eq!(free, live.device_free(7, 0), "{call:?}");
            last = (figures, free);
        }
        let (figures, free) = last;
        let f = figures.expect("a free moves memory");
        // 20 MiB reserved, 5 allocated, the cudaMalloc taken from the 30 MiB said free.
        assert_eq!((f.stats.reserved, f.stats.allocated), (20 * MIB, 5 * MIB));
        assert_eq!(free, Some(10 * MIB as i64));
    }
}
