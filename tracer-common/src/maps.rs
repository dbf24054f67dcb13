//! Names of the maps, programs and globals the two sides share, and the counter slots.

/// Discovery in the kernel (crate::libwatch): the ring of library opens, the opens under way
/// (tid -> [`crate::libwatch::LibOpen`]), the paths probed, and the state array's slots.
pub const LIB_OPENS: &str = "LIB_OPENS";
pub const LIB_OPENS_BYTES: u32 = 64 * 1024;
pub const LIB_PENDING: &str = "LIB_PENDING";
pub const LIB_PENDING_ENTRIES: u32 = 1024;
pub const LIB_KNOWN: &str = "LIB_KNOWN";
pub const LIB_KNOWN_ENTRIES: u32 = 4096;
pub const LIB_STATE: &str = "LIB_STATE";
pub const LIB_STATE_SLOTS: u32 = 1;
/// [`LIB_STATE`] slot: processes are stopped only before this CLOCK_MONOTONIC ns.
pub const LIB_HOLD_UNTIL: u32 = 0;
/// Per-CPU counters of opens lost: slot [`LIB_LOST_RING`] the ring full,
/// [`LIB_LOST_PENDING`] the pending map full.
pub const LIB_LOST: &str = "LIB_LOST";
pub const LIB_LOST_SLOTS: u32 = 2;
pub const LIB_LOST_RING: u32 = 0;
pub const LIB_LOST_PENDING: u32 = 1;
/// The tracepoint programs at syscalls:sys_enter_openat and sys_exit_openat.
pub const PROG_LIB_OPEN_ENTER: &str = "lib_open_enter";
pub const PROG_LIB_OPEN_EXIT: &str = "lib_open_exit";
/// Globals: the tracepoints' field offsets (tracefs), task_struct's members (BTF).
pub const GLOBAL_OPENAT_FILENAME_OFF: &str = "OPENAT_FILENAME_OFF";
pub const GLOBAL_OPENAT_RET_OFF: &str = "OPENAT_RET_OFF";
pub const GLOBAL_OPENAT_FLAGS_OFF: &str = "OPENAT_FLAGS_OFF";
pub const GLOBAL_TASK_REAL_PARENT_OFF: &str = "TASK_REAL_PARENT_OFF";
pub const GLOBAL_TASK_COMM_OFF: &str = "TASK_COMM_OFF";
pub const GLOBAL_TASK_PTRACE_OFF: &str = "TASK_PTRACE_OFF";
pub const GLOBAL_TASK_SIGNAL_OFF: &str = "TASK_SIGNAL_OFF";
pub const GLOBAL_SIGNAL_PGID_OFF: &str = "SIGNAL_PGID_OFF";
pub const GLOBAL_PID_NR_OFF: &str = "PID_NR_OFF";
/// Global: tracer's own process id (its own opens are not watched).
pub const GLOBAL_SELF_TGID: &str = "SELF_TGID";

/// Ring buffer of records ([`crate::EventHeader`] first).
pub const EVENTS: &str = "EVENTS";
/// Per-CPU `u64` counters indexed by [`Counter`].
pub const COUNTERS: &str = "COUNTERS";
/// Array of [`Slot`]s indexed by a hash of (thread, op): a call's entry state, between its uprobe
/// and its uretprobe. An array slot costs a fraction of a hash-map lookup; two threads whose
/// pairs share a slot fall back to [`INFLIGHT`].
pub const SLOTS: &str = "SLOTS";
/// (thread, op) -> entry state, for calls whose slot another thread's call holds.
pub const INFLIGHT: &str = "INFLIGHT";
/// Per-CPU array of one [`Stage`]: a CPU's call events wait there and go to the ring
/// [`STAGE_EVENTS`] at a time, one ring write instead of one a call.
pub const STAGE: &str = "STAGE";
/// The program userspace runs on each CPU (BPF_PROG_TEST_RUN, BPF_F_TEST_RUN_ON_CPU) to send
/// what waits in that CPU's stage; returns a [`FlushResult`].
pub const PROG_FLUSH_STAGE: &str = "flush_stage";
/// Array of u64 indexed by CPU, mapped into the reader (BPF_F_MMAPABLE): 0 while the CPU's
/// stage is empty, [`STAGE_CLAIMED`] while a program writes an empty one, else when its oldest
/// event was sent (CLOCK_MONOTONIC ns). The reader runs the flush (an interrupt of that CPU)
/// only on CPUs whose stage holds an event old enough to hand over.
pub const STAGE_OLDEST: &str = "STAGE_OLDEST";
/// [`STAGE_OLDEST`]'s value while a program writes an empty stage.
pub const STAGE_CLAIMED: u64 = 1;
/// CPUs [`STAGE_OLDEST`] has room for; a CPU past them is flushed every round.
pub const STAGE_OLDEST_CPUS: u32 = 4096;

/// Array of [`crate::usdt::UsdtPlan`] indexed by the attach cookie of a USDT site.
pub const USDT_PLANS: &str = "USDT_PLANS";
/// The program attached at every USDT site (one perf event and link per site).
pub const PROG_USDT: &str = "usdt_hit";
/// The uprobe at PyTorch's OutOfMemoryError constructor: sends the message.
pub const PROG_TORCH_OOM: &str = "torch_oom";

/// Array of one `u32`: set to 1 to stop recording new calls before detaching.
pub const CONTROL: &str = "CONTROL";

/// tid -> pid of the threads the scheduler programs follow: those that made a traced call, the
/// other threads of their processes and of those processes' children (seeded from /proc by
/// userspace, then followed through sched_process_fork), so that explain can count the
/// runnable threads (DataLoader workers) competing with the calls. The value is the traced
/// process the thread belongs to (itself, or its nearest traced ancestor).
pub const SCHED_TIDS: &str = "SCHED_TIDS";
/// tid -> [`crate::sched::OffCpu`] while a followed thread is off the CPU.
pub const OFFCPU: &str = "OFFCPU";
/// Tracepoint programs (sched:sched_switch, sched:sched_wakeup).
pub const PROG_SCHED_SWITCH: &str = "sched_switch";
pub const PROG_SCHED_WAKEUP: &str = "sched_wakeup";
pub const PROG_SCHED_FORK: &str = "sched_process_fork";
pub const PROG_SCHED_EXIT: &str = "sched_process_exit";
/// Globals: field offsets in the tracepoint records, read from tracefs at load time.
pub const GLOBAL_PREV_PID_OFF: &str = "PREV_PID_OFF";
pub const GLOBAL_PREV_STATE_OFF: &str = "PREV_STATE_OFF";
pub const GLOBAL_NEXT_PID_OFF: &str = "NEXT_PID_OFF";
pub const GLOBAL_WAKEUP_PID_OFF: &str = "WAKEUP_PID_OFF";
pub const GLOBAL_FORK_PARENT_PID_OFF: &str = "FORK_PARENT_PID_OFF";
pub const GLOBAL_FORK_CHILD_PID_OFF: &str = "FORK_CHILD_PID_OFF";
pub const SCHED_TIDS_ENTRIES: u32 = 1 << 16;
/// Global: non-zero when the scheduler programs follow a process only while its allocator
/// probes are armed (`--allocator auto`); the processes armed now are in [`SCHED_ARMED`].
pub const GLOBAL_SCHED_ARMED_ONLY: &str = "SCHED_ARMED_ONLY";
/// pid -> 1 for each traced process whose allocator probes are armed now (set by userspace as
/// it arms and disarms), read only when [`GLOBAL_SCHED_ARMED_ONLY`] is set.
pub const SCHED_ARMED: &str = "SCHED_ARMED";
pub const SCHED_ARMED_ENTRIES: u32 = 4096;

/// tgid -> [`crate::PyProcess`]: CPython interpreters whose frames the return program walks
/// (--stack); filled by userspace, copied to forked children by sched_process_fork.
pub const PY_PROCS: &str = "PY_PROCS";
pub const PY_PROCS_ENTRIES: u32 = 4096;
/// (tgid << 32 | tid) -> the thread's PyThreadState address, found once by walking the
/// interpreter's thread list and re-checked on every use.
pub const PY_THREADS: &str = "PY_THREADS";
pub const PY_THREADS_ENTRIES: u32 = 1 << 14;
/// id -> [`crate::stack::NativeStack`]: each distinct native stack once (--stack). Written by
/// the call-site program, never updated or deleted, so an id names one stack for the whole
/// session; a stack that finds its id taken by another, or the map full, travels inline.
pub const NATIVE_STACKS: &str = "NATIVE_STACKS";
pub const NATIVE_STACKS_ENTRIES: u32 = 1 << 14;
/// Program array whose slot [`SITE_SLOT_READ`] is [`PROG_CALL_SITE`], tail-called by the
/// return program, and slot [`SITE_SLOT_SEND`] [`PROG_SITE_SEND`], tail-called by it.
pub const SITE_PROG: &str = "SITE_PROG";
pub const SITE_SLOT_READ: u32 = 0;
pub const SITE_SLOT_SEND: u32 = 1;
/// The program that reads a call's call site (--stack): its native stack, kept by id, and its
/// Python frames.
pub const PROG_CALL_SITE: &str = "call_site";
/// The program that sends a call with the site [`PROG_CALL_SITE`] read: to the stage, or to
/// the ring with its frames. Two programs: the verifier checks each path after the frame walk
/// once instead of once for each way the walk can end.
pub const PROG_SITE_SEND: &str = "site_send";
/// The benchmark floor mode (`FLOOR_MODE`) above which the USDT program does only its first
/// `mode - FLOOR_USDT_PARTS` parts (`tracer trace --usdt-parts`); the other programs then
/// behave as on the floor.
pub const FLOOR_USDT_PARTS: u32 = 2;

/// Global: non-zero to capture call sites (--stack).
pub const GLOBAL_STACK_MODE: &str = "STACK_MODE";

/// The entry program, attached as a uprobe to every probed symbol (cookie = op).
pub const PROG_ENTRY: &str = "call_entry";
/// The return program, attached as a uretprobe to every probed symbol (cookie = op).
pub const PROG_RETURN: &str = "call_return";

/// Global: wake the reader only when this many bytes are waiting (0: every event).
pub const GLOBAL_WAKEUP_BYTES: &str = "WAKEUP_BYTES";
/// Global: when non-zero, record nothing but count the calls (the benchmark's floor).
pub const GLOBAL_FLOOR_MODE: &str = "FLOOR_MODE";

/// Default ring size: about 160 k call records, 0.15 s of two threads at full speed.
pub const DEFAULT_RING_BYTES: u32 = 16 << 20;
pub const INFLIGHT_ENTRIES: u32 = 1 << 16;
/// A power of two.
pub const SLOT_COUNT: u32 = 1 << 16;
/// Live allocations whose size userspace keeps for their frees; more are counted in
/// [`Counter::AllocMapFull`] and their frees lack a size.
pub const ALLOCS_ENTRIES: u32 = 1 << 20;

/// The [`SLOTS`] index of (thread, op).
#[inline(always)]
pub const fn slot_index(tid: u32, op: u32) -> u32 {
    (tid.wrapping_mul(0x9E37_79B1) ^ op.wrapping_mul(0x85EB_CA77)) & (SLOT_COUNT - 1)
}

/// Slots of the [`COUNTERS`] map. Stable: stored with each session.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Counter {
    /// uprobe hits (entries) of traced calls.
    Entries = 0,
    /// Records written to the ring buffer.
    Submitted = 1,
    /// Records lost because the ring buffer was full.
    RingFull = 2,
    /// Returns whose entry was not found (entry state evicted or the probe attached mid-call).
    UnmatchedReturns = 3,
    /// Allocations not remembered because the allocation map was full (their free lacks a size).
    AllocMapFull = 4,
    /// Entry states not stored because the in-flight map refused them.
    InflightFull = 5,
    /// Off-CPU records written by the scheduler programs.
    SchedSubmitted = 6,
    /// Off-CPU records lost because the ring buffer was full.
    SchedRingFull = 7,
    /// Events lost because the tail call to the call-site program failed (--stack): not the
    /// ring's size, so not fixed by --ring-size.
    TailCallFailed = 8,
    /// Map entries that could not be stored (a full map): what they would have carried (a
    /// followed thread, its time off the CPU, its interpreter state) is missing.
    MapInsertFailed = 9,
    /// Calls whose thread exited before they returned: no event can be made of them.
    CallsAbandoned = 10,
}

impl Counter {
    pub const COUNT: u32 = 11;
    pub const ALL: [Counter; Self::COUNT as usize] = [
        Counter::Entries,
        Counter::Submitted,
        Counter::RingFull,
        Counter::UnmatchedReturns,
        Counter::AllocMapFull,
        Counter::InflightFull,
        Counter::SchedSubmitted,
        Counter::SchedRingFull,
        Counter::TailCallFailed,
        Counter::MapInsertFailed,
        Counter::CallsAbandoned,
    ];

    pub const fn name(self) -> &'static str {
        match self {
            Counter::Entries => "entries",
            Counter::Submitted => "submitted",
            Counter::RingFull => "dropped_ring_full",
            Counter::UnmatchedReturns => "unmatched_returns",
            Counter::AllocMapFull => "alloc_map_full",
            Counter::InflightFull => "inflight_full",
            Counter::SchedSubmitted => "offcpu_submitted",
            Counter::SchedRingFull => "offcpu_dropped",
            Counter::TailCallFailed => "tail_call_failed",
            Counter::MapInsertFailed => "map_insert_failed",
            Counter::CallsAbandoned => "calls_abandoned",
        }
    }
}

/// Key of [`INFLIGHT`]: one pending call per thread and op (a runtime call may nest a driver call).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct InflightKey {
    pub tid: u32,
    pub op: u32,
}

/// Value of [`INFLIGHT`]: what the entry program saw.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct Inflight {
    /// Entry time; 0 once the return consumed it.
    pub ts_ns: u64,
    pub args: [u64; crate::probes::MAX_ARGS],
}

/// Value of [`SLOTS`]: the entry state of the (thread, op) that holds the slot.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct Slot {
    pub tid: u32,
    pub op: u32,
    /// 1 once an event of this (thread, op) carried the thread's name (task comm); later
    /// events of the pair leave it empty. Reset when another pair takes the slot.
    pub comm_sent: u32,
    pub _pad: u32,
    pub state: Inflight,
}

/// Events a CPU's stage holds before it goes to the ring in one write.
pub const STAGE_EVENTS: usize = 32;

/// Value of [`STAGE`]: this CPU's call events not yet in the ring, in the order they returned.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct Stage {
    /// Events held, at most [`STAGE_EVENTS`].
    pub len: u32,
    /// 1 while a program of this CPU writes the stage: another one that interrupts or preempts
    /// it (the flush, a preempted return) must leave the stage alone.
    pub busy: u32,
    pub events: [crate::CallEvent; STAGE_EVENTS],
}

/// What [`PROG_FLUSH_STAGE`] did with its CPU's stage.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FlushResult {
    /// Everything the stage held is in the ring (or it held nothing).
    Sent = 0,
    /// A program of this CPU was writing the stage; nothing was done.
    Busy = 1,
    /// The ring was full: the stage's events were lost, and counted as such.
    RingFull = 2,
}

#[cfg(feature = "user")]
mod pod {
    // SAFETY: repr(C), u32s and CallEvents (Pod themselves), 8-aligned with no implicit padding.
    unsafe impl aya::Pod for super::Stage {}
    // SAFETY: each is repr(C), only integers, with explicit padding fields.
    unsafe impl aya::Pod for super::InflightKey {}
    // SAFETY: as above.
    unsafe impl aya::Pod for super::Inflight {}
    // SAFETY: as above.
    unsafe impl aya::Pod for super::Slot {}
}
