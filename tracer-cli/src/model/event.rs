//! One stored call, as analysis needs it, and what comes with it: the window analysed, call-site
//! ids and labels, off-CPU intervals. Owned by neither the store (which builds these) nor
//! analysis (which reads them), so the dependency runs one way: store -> model <- analysis.

use std::collections::HashMap;

use serde::Serialize;
use tracer_common::{Op, OpClass, Space};

/// The hash map of the replays: keys are our own pointers and ids, not attacker-chosen, and
/// SipHash was a tenth of explain's time over millions of calls.
pub type FastMap<K, V> = HashMap<K, V, foldhash::fast::FixedState>;

/// The hash map and set of the recording, keyed by what traced processes choose (pointers):
/// seeded afresh in each run, so no process can pick keys that collide (SipHash in these maps
/// was 3 % of tracer's own CPU on the step bench).
pub type SeededMap<K, V> = HashMap<K, V, foldhash::fast::RandomState>;
pub type SeededSet<K> = std::collections::HashSet<K, foldhash::fast::RandomState>;

/// One stored call, as analysis needs it: 72 bytes, so that ten million of them stay within
/// reach of the caches (absent values are 0, which no allocation size or pointer of interest is).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Event {
    /// Wall clock at entry, ns since the epoch.
    pub ts_ns: i64,
    pub duration_ns: u64,
    /// Bytes requested or freed; 0 when the op has none or it is unknown.
    pub size: u64,
    /// The pointer or handle allocated or freed; 0 when none.
    pub ptr: u64,
    /// Op-specific (free bytes of a MemGetInfo, ...); 0 when none.
    pub aux0: u64,
    /// Op-specific (total bytes of a MemGetInfo, ...); 0 when none.
    pub aux1: u64,
    pub pid: u32,
    pub tid: u32,
    pub ret: i32,
    /// The CUDA device, or [`NO_DEVICE`].
    pub device: i32,
    /// The call site (stacks.id), when traced with --stack.
    pub stack: Option<StackId>,
    pub op: Op,
}

/// [`Event::device`] when the call's device is not known.
pub const NO_DEVICE: i32 = -1;

/// A stacks.id (row ids start at 1, so the zero niche keeps `Option<StackId>` at 4 bytes).
pub type StackId = std::num::NonZeroU32;

/// The stack id of a stacks.id, if it fits (a database would need 4 billion call sites not to).
pub fn stack_id(id: i64) -> Option<StackId> {
    u32::try_from(id).ok().and_then(StackId::new)
}

impl Event {
    pub fn class(&self) -> OpClass {
        self.op.spec().class
    }

    pub fn space(&self) -> Space {
        self.op.spec().space
    }

    pub fn end_ns(&self) -> i64 {
        // Saturating: a damaged record's figures must not wrap around.
        self.ts_ns
            .saturating_add(i64::try_from(self.duration_ns).unwrap_or(i64::MAX))
    }

    pub fn device(&self) -> Option<i32> {
        (self.device != NO_DEVICE).then_some(self.device)
    }
}

/// The time range analysed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Window {
    pub from_ns: i64,
    pub to_ns: i64,
}

impl Window {
    pub fn contains(&self, ts: i64) -> bool {
        ts >= self.from_ns && ts <= self.to_ns
    }

    pub fn secs(&self) -> f64 {
        (self.to_ns - self.from_ns).max(1) as f64 / 1e9
    }
}

/// Entry time of the first call and end time of the last one to end, of calls in time order.
pub fn span(events: &[Event]) -> Option<(i64, i64)> {
    let first = events.first()?.ts_ns;
    Some((first, events.iter().map(Event::end_ns).max()?))
}

/// Call sites by stacks.id: the first frame in the user's own code, as "train.py:74 (step)".
pub type SiteLabels = HashMap<StackId, String>;

/// One interval a traced thread spent off the CPU (wall-clock ns).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OffSlice {
    /// The traced process the thread belongs to (itself or its nearest traced ancestor).
    pub pid: u32,
    pub tid: u32,
    pub off_ns: i64,
    pub on_ns: i64,
    /// When it was woken, if it had blocked.
    pub wakeup_ns: Option<i64>,
    /// It left the CPU runnable (preempted).
    pub preempted: bool,
}

/// A text a traced program produced (PyTorch's out-of-memory message).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct MessageRow {
    pub ts_ns: i64,
    pub pid: u32,
    pub tid: u32,
    pub op: String,
    pub text: String,
    pub truncated: bool,
}

/// What the scheduler recorded of a session's traced threads (host context).
#[derive(Clone, Debug, Default)]
pub struct HostRecord {
    pub slices: Vec<OffSlice>,
    /// The scheduler was traced in this session.
    pub recorded: bool,
    /// Online CPUs of the traced machine, when recorded.
    pub cpus: Option<u32>,
    /// A process's threads were followed only while its allocator probes were armed
    /// (`--allocator auto`): their off-CPU time is known only then.
    pub while_armed: bool,
}

/// The part of a session's host-context state that says its scheduler programs followed a
/// process only while its allocator probes were armed.
pub const FOLLOWED_WHILE_ARMED: &str = "followed=while-armed";

/// Asks for transparent huge pages under a large vector about to be filled: a tenth of the
/// page faults, and the kernel clears 2 MiB at a time.
pub fn advise_huge_pages(v: &mut Vec<Event>) {
    const HUGE: usize = 2 << 20;
    let spare = v.spare_capacity_mut();
    let bytes = std::mem::size_of_val(spare);
    if bytes < 4 * HUGE {
        return;
    }
    let start = spare.as_mut_ptr() as usize;
    let aligned = start.next_multiple_of(HUGE);
    let len = (start + bytes - aligned) / HUGE * HUGE;
    // SAFETY: [aligned, aligned + len) lies inside the vector's own allocation, which nothing
    // has read or written yet; MADV_HUGEPAGE only changes how the kernel backs those pages.
    unsafe {
        libc::madvise(aligned as *mut libc::c_void, len, libc::MADV_HUGEPAGE);
    }
}

/// The calls that change, or tell, what a process holds on a device: the only ones the
/// allocators' figures follow.
pub fn moves_memory(class: OpClass) -> bool {
    matches!(
        class,
        OpClass::Alloc
            | OpClass::Free
            | OpClass::BlockAlloc
            | OpClass::BlockFree
            | OpClass::MemInfo
    )
}
