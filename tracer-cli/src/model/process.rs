//! What tracer learned of a traced process (from /proc, at its first call).

/// A traced process, as stored in the `processes` table.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ProcessInfo {
    pub pid: u32,
    /// Wall-clock start time (from /proc/PID/stat and the boot time).
    pub start_time_ns: Option<i64>,
    pub first_seen_ns: i64,
    pub comm: Option<String>,
    pub cmdline: Option<String>,
    pub exe: Option<String>,
    pub cgroup: Option<String>,
    /// The few environment variables tracer reads (JSON object): the allocator's settings
    /// (PYTORCH_CUDA_ALLOC_CONF, PYTORCH_ALLOC_CONF) and the job's rank (RANK, LOCAL_RANK,
    /// WORLD_SIZE). Nothing else of the environment is kept.
    pub env: Option<String>,
}

/// The environment variables [`ProcessInfo::env`] keeps.
pub const KEPT_ENV: [&str; 5] = [
    "PYTORCH_CUDA_ALLOC_CONF",
    "PYTORCH_ALLOC_CONF",
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
];
