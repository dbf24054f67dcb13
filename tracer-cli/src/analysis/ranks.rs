//! Ranks and devices compared: each process's row on each device it used (its peaks and
//! failures), which the outlier rule (rules/ranks.rs) reads.

use serde::Serialize;

use super::allocator::DevicePeak;
use crate::model::Rank;

/// One process on one device, over the window.
#[derive(Clone, Debug, Serialize)]
pub struct DeviceRow {
    pub pid: u32,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rank: Option<Rank>,
    pub device: i32,
    /// The physical GPU behind the device number ("GPU 3"), and the job the process belongs
    /// to ("torchelastic run abc", "job at 10.0.0.1:29500", or "pid 812": model/process.rs).
    pub gpu: String,
    pub job: String,
    /// What compares GPUs across processes (two containers' "device 0" are one GPU only when
    /// their roots say so).
    #[serde(skip)]
    pub gpu_key: String,
    /// "blocks" when the allocator's own probes were seen; "segments" otherwise.
    pub view: &'static str,
    /// The most device memory held at once.
    pub peak_held: u64,
    /// Blocks view: the most reserved and allocated, and the highest fragmentation.
    pub peak_reserved: u64,
    pub peak_allocated: u64,
    pub fragmentation: f64,
    /// New segments reserved while the cache held the bytes but no block that fit.
    pub forced_segments: u64,
    pub forced_bytes: u64,
    /// Device allocations refused for want of memory, the allocator's retries of them, and the
    /// OOMs it raised (model/attempts.rs: as PyTorch counts them).
    pub failures: u64,
    pub retries: u64,
    pub ooms: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub first_failure_ns: Option<i64>,
    /// The process's allocator state is not fully known (model/layout.rs `Unknown`): its
    /// peaks are not compared.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub unknown: bool,
}

impl DeviceRow {
    pub fn new(pid: u32, rank: Option<Rank>, device: i32, visible: bool, p: &DevicePeak) -> Self {
        DeviceRow {
            pid,
            rank,
            device,
            gpu: format!("GPU {device}"),
            job: format!("pid {pid}"),
            gpu_key: format!("GPU {device}"),
            view: if visible { "blocks" } else { "segments" },
            peak_held: p.held,
            peak_reserved: p.reserved,
            peak_allocated: p.allocated,
            fragmentation: p.fragmentation,
            forced_segments: p.forced_segments,
            forced_bytes: p.forced_bytes,
            failures: p.failures,
            retries: p.counts.retries,
            ooms: p.counts.ooms,
            first_failure_ns: p.first_failure_ns,
            unknown: false,
        }
    }

    /// Where the process runs (its job, the physical GPU behind the device number).
    pub fn place(&mut self, placement: &crate::model::Placement) {
        let gpu = placement.gpu(self.device);
        self.gpu = gpu.label;
        self.gpu_key = gpu.key;
        self.job = placement.job.clone();
    }

    /// "rank 2/4 (pid 812, GPU 2)" or "pid 812 on GPU 0".
    pub fn who(&self) -> String {
        let gpu = if self.device < 0 {
            "an unknown GPU".to_owned()
        } else {
            self.gpu.clone()
        };
        match &self.rank {
            Some(r) => format!("{} (pid {}, {gpu})", r.label(), self.pid),
            None => format!("pid {} on {gpu}", self.pid),
        }
    }

    pub fn blocks(&self) -> bool {
        self.view == "blocks"
    }
}
