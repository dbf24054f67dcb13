//! The kernel's `struct perf_event_attr`, for the two rooms that open perf events: the probes
//! (a uprobe with a reference counter) and the targets' mapping side band.

/// `struct perf_event_attr` up to `config3` (PERF_ATTR_SIZE_VER8); what a caller leaves out
/// stays zero.
#[repr(C)]
#[derive(Default)]
pub struct PerfEventAttr {
    pub kind: u32,
    pub size: u32,
    pub config: u64,
    pub sample_period: u64,
    pub sample_type: u64,
    pub read_format: u64,
    pub flags: u64,
    pub wakeup_events: u32,
    pub bp_type: u32,
    /// uprobe_path for a uprobe.
    pub config1: u64,
    /// probe_offset for a uprobe.
    pub config2: u64,
    pub branch_sample_type: u64,
    pub sample_regs_user: u64,
    pub sample_stack_user: u32,
    pub clockid: i32,
    pub rest: [u64; 5],
}

/// perf_event_open's flag: the descriptor is closed on exec.
pub const PERF_FLAG_FD_CLOEXEC: libc::c_ulong = 1 << 3;
