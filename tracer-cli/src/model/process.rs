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
}
