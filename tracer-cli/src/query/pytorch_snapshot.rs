//! A session as a PyTorch memory snapshot (`tracer export --format pytorch-snapshot`): one
//! process's allocator replayed to an instant, its segments and blocks then and the trace
//! entries that led there, each with its frames, in the terms `_dump_snapshot` uses. What
//! tracer did not see is left out whole (a segment with its entries) and counted, never
//! written as free.

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::path::Path;

use anyhow::Result;
use tracer_common::Op;

use super::layout::At;
use super::snapshot_ooms::{self, OomSeen};
use super::snapshot_tenants::{Tenant, Tenants};
pub use crate::decode::memory_snapshot::{Action, BlockKind as BlockState};
use crate::exit::user_error;
use crate::model::layout::{AllocConf, Layout, RunKind, FREE_RECORDS_WITHIN_NS};
use crate::model::policy::Pool;
use crate::model::state::ProcessState;
use crate::model::{Event, NO_DEVICE};
use crate::store::{events, Access, Store, SNAPSHOT_UNTIMED};

/// PyTorch's own default ring (`_record_memory_history(max_entries=100000)`).
pub const DEFAULT_MAX_ENTRIES: usize = 100_000;

/// What to export.
#[derive(Clone, Debug)]
pub struct SnapshotQuery {
    pub session: Option<i64>,
    pub pid: Option<u32>,
    pub at: At,
    /// Only entries this long before the instant.
    pub since_ns: Option<i64>,
    /// The most trace entries kept per device (the newest).
    pub max_entries: usize,
}

#[derive(Clone, Debug)]
pub struct Block {
    pub address: u64,
    pub size: u64,
    pub requested_size: u64,
    pub state: BlockState,
    /// Index into [`Export::frames`].
    pub frames: Option<usize>,
}

#[derive(Clone, Debug)]
pub struct Segment {
    pub device: i32,
    pub address: u64,
    pub total_size: u64,
    pub allocated_size: u64,
    pub stream: u64,
    pub small: bool,
    pub expandable: bool,
    /// `segment_pool_id`: its private pool, (0, 0) for the default pools.
    pub pool_id: (u64, u64),
    pub blocks: Vec<Block>,
}

#[derive(Clone, Debug)]
pub struct Entry {
    pub action: Action,
    /// The block or segment (`oom`: none).
    pub addr: u64,
    pub size: u64,
    pub stream: u64,
    /// `oom`: the device's free bytes, when known.
    pub device_free: Option<u64>,
    /// None where the session has no times (an older snapshot imported): none invented.
    pub time_us: Option<i64>,
    pub frames: Option<usize>,
}

/// One frame as PyTorch writes it.
#[derive(Clone, Debug)]
pub struct Frame {
    pub filename: String,
    pub line: i64,
    pub name: String,
}

/// What was left out, and why.
#[derive(Clone, Debug, Default)]
pub struct LeftOut {
    /// Segments whose contents tracer did not see (made before the allocator's probes were
    /// armed, or the process was traced), with their bytes; their entries go with them.
    pub unseen_segments: u64,
    pub unseen_bytes: u64,
    /// Device allocations no block landed in (libraries' own cudaMalloc): not the allocator's.
    pub outside_allocations: u64,
    /// Entries of left-out segments, before `--since`, before a hole `--max-db` made, or the
    /// state before an imported trace began (rebuilt, never recorded).
    pub entries_of_unseen: u64,
    pub entries_before_since: u64,
    pub entries_before_hole: u64,
    pub entries_rebuilt: u64,
    /// Entries past `--max-entries`, oldest first (the ring overflowed).
    pub entries_cut: u64,
    /// Inactive blocks free since before the replay began: their last tenant's requested
    /// size was not seen (written 0, as for a block never allocated).
    pub inactive_tenant_unseen: u64,
}

/// The snapshot, ready to encode.
#[derive(Clone, Debug)]
pub struct Export {
    pub session: i64,
    pub pid: u32,
    pub at_ns: i64,
    pub segments: Vec<Segment>,
    /// Indexed by device number, covering every device a segment or an entry names.
    pub traces: Vec<Vec<Entry>>,
    pub frames: Vec<Vec<Frame>>,
    pub alloc_conf: Option<String>,
    pub expandable: bool,
    pub max_entries: usize,
    pub overflowed: bool,
    pub left_out: LeftOut,
}

/// Replays `q`'s process to its instant.
pub fn export(db: &Path, q: &SnapshotQuery) -> Result<Export> {
    let store = Store::open(db, Access::ReadOnly)?;
    let conn = store.conn();
    let info = events::session(conn, q.session)?;
    let at_ns = super::layout::instant(conn, info.id, q.at, q.pid)?;
    let pid = match q.pid {
        Some(p) => p,
        None => only_allocator_process(conn, info.id)?,
    };
    let source = events::source(conn, info.id)?;
    let timed = source != SNAPSHOT_UNTIMED;
    // A snapshot records the allocator's own actions only: each device allocation is its.
    let imported = source == SNAPSHOT_UNTIMED || source == "snapshot";
    let conf = events::alloc_confs(conn, info.id)?.remove(&pid);
    let rebuilt_until = crate::store::series::gaps(conn, info.id)?
        .into_iter()
        .filter(|g| g.pid == pid && g.unseen_start())
        .map(|g| g.to_ns)
        .max();
    let ooms = snapshot_ooms::of(conn, info.id, pid, at_ns)?;
    // The walk starts where the entries do (the first call kept, or the keyframe before
    // --since), not at the instant: the trace leads up to it.
    let from_ns = q.since_ns.map_or(i64::MIN, |s| at_ns.saturating_sub(s));
    let begin = super::begin(conn, info.id, from_ns, Some(pid))?;
    let mut replay = Replay::new(
        begin.states.iter().find(|s| s.pid == pid),
        conf.as_deref(),
        timed,
        rebuilt_until,
        ooms,
    );
    replay.imported = imported;
    super::walk(conn, info.id, &begin, at_ns, Some(pid), |step| match step {
        super::Step::Call(e) => replay.call(e),
        super::Step::Resume { states, .. } => replay.resume(states, pid),
    })?;
    let mut out = replay.finish(q, at_ns, conf)?;
    out.session = info.id;
    out.pid = pid;
    out.frames = frames(conn, &mut out)?;
    Ok(out)
}

/// The one process with PyTorch's block events, else a message naming them.
fn only_allocator_process(conn: &rusqlite::Connection, session: i64) -> Result<u32> {
    let pids = events::block_event_pids(conn, session)?;
    match pids.as_slice() {
        [one] => Ok(*one),
        [] => Err(user_error(format!(
            "session {session} has no PyTorch allocator events (pytorch:malloc, pytorch:free): nothing to export as a memory snapshot"
        ))),
        many => Err(user_error(format!(
            "session {session} has allocator events of {} processes ({}): name one with --pid",
            many.len(),
            many.iter().map(u32::to_string).collect::<Vec<_>>().join(", ")
        ))),
    }
}

/// A block freed whose free_completed is not written yet.
struct Freed {
    device: i32,
    size: u64,
    stream: u64,
    stack: Option<i64>,
    /// The free's instant (an imported one's: where its block returned).
    ts_ns: i64,
    tid: u32,
    /// Kept for other streams' work since (active_pending_free).
    kept: bool,
}

/// The walk's state: the layout, the entries so far, the frees waiting for other streams.
struct Replay {
    layout: Layout,
    timed: bool,
    rebuilt_until: Option<i64>,
    /// Out-of-memory messages not yet placed, oldest first.
    ooms: VecDeque<OomSeen>,
    /// Per device, in time order: (ts_ns, entry, call site).
    entries: BTreeMap<i32, Vec<(i64, Entry, Option<i64>)>>,
    /// Requested bytes of each live block (a free's entry says them).
    requested: HashMap<u64, u64>,
    /// Blocks freed while other streams' work may use them: their free_completed waits.
    pending: BTreeMap<u64, Freed>,
    /// Segments a block landed in: the allocator's (a device allocation no block ever lands
    /// in is a library's own).
    allocator_segments: BTreeSet<u64>,
    /// The latest device free bytes a cudaMemGetInfo said, per device.
    device_free: HashMap<i32, u64>,
    entries_before_hole: u64,
    /// The latest failed device allocation's device and call site: the request an
    /// out-of-memory message follows.
    failed: Option<(i32, Option<i64>)>,
    /// An imported snapshot: every device allocation is the allocator's, and a segment
    /// entry's stream and a free's two instants are stored with it.
    imported: bool,
    /// Segment allocations whose stream the first block in them says: (device, entry index).
    stream_unknown: BTreeMap<u64, (i32, usize)>,
    /// The last requested size each free block's Block object was allocated with.
    tenants: Tenants,
    /// The walk passed the state an imported trace rebuilt.
    past_rebuilt: bool,
}

impl Replay {
    fn new(
        state: Option<&ProcessState>,
        conf: Option<&str>,
        timed: bool,
        rebuilt_until: Option<i64>,
        ooms: Vec<OomSeen>,
    ) -> Replay {
        let layout = state.map_or_else(
            || Layout::new(conf.map_or_else(AllocConf::default, AllocConf::parse)),
            |s| s.layout.clone(),
        );
        let allocator_segments = layout
            .segments()
            .iter()
            .filter(|s| s.pool.is_some())
            .map(|s| s.addr)
            .collect();
        Replay {
            timed,
            rebuilt_until,
            ooms: ooms.into(),
            entries: BTreeMap::new(),
            requested: HashMap::new(),
            pending: BTreeMap::new(),
            allocator_segments,
            device_free: HashMap::new(),
            entries_before_hole: 0,
            failed: None,
            imported: false,
            stream_unknown: BTreeMap::new(),
            tenants: Tenants::not_seen(&layout),
            past_rebuilt: false,
            layout,
        }
    }

    fn call(&mut self, e: &Event) {
        while self.ooms.front().is_some_and(|o| o.ts_ns <= e.ts_ns) {
            if let Some(o) = self.ooms.pop_front() {
                self.oom(&o);
            }
        }
        if !self.past_rebuilt && self.rebuilt_until.is_some_and(|r| e.ts_ns >= r) {
            // The state an imported trace rebuilt holds free blocks whose tenants it never
            // saw.
            self.past_rebuilt = true;
            self.tenants = Tenants::not_seen(&self.layout);
        }
        let device = if e.device == NO_DEVICE { 0 } else { e.device };
        let stack = e.stack.map(|s| i64::from(s.get()));
        let ok = e.ret == 0;
        match e.op {
            Op::TorchMalloc => {
                self.requested.insert(e.ptr, e.size);
                self.push(e.ts_ns, device, Action::Alloc, e.ptr, e.size, e.aux0, stack);
            }
            Op::TorchFree => {
                let size = self.requested.remove(&e.ptr).unwrap_or(e.size);
                // An imported free is stored where the block returned; aux1 says how long
                // before the program freed it.
                let asked = if self.imported {
                    e.ts_ns - e.aux1 as i64
                } else {
                    e.ts_ns
                };
                self.push(
                    asked,
                    device,
                    Action::FreeRequested,
                    e.ptr,
                    size,
                    e.aux0,
                    stack,
                );
                self.pending.insert(
                    e.ptr,
                    Freed {
                        device,
                        size,
                        stream: e.aux0,
                        stack,
                        ts_ns: e.ts_ns,
                        tid: e.tid,
                        kept: false,
                    },
                );
            }
            Op::CudaMemGetInfo | Op::CuMemGetInfo if ok => {
                self.device_free.insert(device, e.aux0);
            }
            // The request PyTorch's out-of-memory follows: where it was made.
            op if !ok && op.spec().class == tracer_common::OpClass::Alloc => {
                self.failed = Some((device, stack));
            }
            op if ok && is_segment_op(op) => {
                let action = match op {
                    Op::CudaFree | Op::CuMemFree => Action::SegmentFree,
                    Op::CuMemMap => Action::SegmentMap,
                    Op::CuMemUnmap => Action::SegmentUnmap,
                    _ => Action::SegmentAlloc,
                };
                let stream = if self.imported {
                    e.aux0
                } else {
                    self.layout.segment_stream(e.ptr).unwrap_or(0)
                };
                if action == Action::SegmentAlloc && !self.imported {
                    let at = self.entries.get(&device).map_or(0, Vec::len);
                    self.stream_unknown.insert(e.ptr, (device, at));
                }
                self.push(e.ts_ns, device, action, e.ptr, e.size, stream, stack);
            }
            _ => {}
        }
        let before = self.tenants.before(&self.layout, e);
        self.layout.apply(e);
        if let Some(before) = before {
            self.tenants.after(&self.layout, before, e);
        }
        if e.op == Op::TorchMalloc {
            if let Some(seg) = self.layout.segment_of(e.ptr) {
                self.allocator_segments.insert(seg);
                // The segment was made for this block: its stream.
                if let Some((device, at)) = self.stream_unknown.remove(&seg) {
                    if let Some(entry) = self.entries.get_mut(&device).and_then(|v| v.get_mut(at)) {
                        entry.1.stream = e.aux0;
                    }
                }
            }
        }
        self.completed(Some(e));
    }

    /// Frees whose block went back to its pool (no stream's work holds it now). A block freed
    /// is kept for other streams by the events its thread records right after the free: until
    /// that thread moves on, its free is not decided; one never kept completed at its free (as
    /// PyTorch's free_block does at once), one kept when the layout returns it (`e`'s time).
    /// `None`: the walk ended.
    fn completed(&mut self, e: Option<&Event>) {
        let mut done = Vec::new();
        for (&addr, freed) in &mut self.pending {
            if self.layout.is_pending(addr) {
                freed.kept = true;
                continue;
            }
            let undecided = !freed.kept
                && e.is_some_and(|e| {
                    let the_free = e.ts_ns == freed.ts_ns && e.ptr == addr;
                    let elsewhere_soon = e.tid != freed.tid
                        && e.ts_ns.saturating_sub(freed.ts_ns) <= FREE_RECORDS_WITHIN_NS;
                    the_free || elsewhere_soon
                });
            if !undecided {
                let at = match (freed.kept, e) {
                    (true, Some(e)) => e.ts_ns,
                    _ => freed.ts_ns,
                };
                done.push((addr, at));
            }
        }
        for (addr, ts_ns) in done {
            if let Some(f) = self.pending.remove(&addr) {
                self.push(
                    ts_ns,
                    f.device,
                    Action::FreeCompleted,
                    addr,
                    f.size,
                    f.stream,
                    f.stack,
                );
            }
        }
    }

    /// PyTorch's out-of-memory: the request from its message, the device's free bytes from
    /// the cudaMemGetInfo it made for the message.
    fn oom(&mut self, o: &OomSeen) {
        use crate::analysis::oom::{free_said, pytorch_tried, snapshot_free_said};
        let (device, stack) = self.failed.take().unwrap_or((0, None));
        let text = o.text.as_deref();
        let size = text.and_then(pytorch_tried).or(o.size).unwrap_or(0);
        // The cudaMemGetInfo PyTorch made for its message, else the message (an imported
        // snapshot's has the entry's bytes).
        let free = o
            .device_free
            .or_else(|| self.device_free.get(&device).copied())
            .or_else(|| text.and_then(snapshot_free_said))
            .or_else(|| text.and_then(free_said));
        let ts_ns = o.ts_ns;
        self.entries.entry(device).or_default().push((
            ts_ns,
            Entry {
                action: Action::Oom,
                addr: 0,
                size,
                stream: 0,
                device_free: free,
                time_us: self.timed.then_some(ts_ns / 1000),
                frames: None,
            },
            stack,
        ));
    }

    #[allow(clippy::too_many_arguments)] // reason: one entry's fields, named at each use
    fn push(
        &mut self,
        ts_ns: i64,
        device: i32,
        action: Action,
        addr: u64,
        size: u64,
        stream: u64,
        stack: Option<i64>,
    ) {
        self.entries.entry(device).or_default().push((
            ts_ns,
            Entry {
                action,
                addr,
                size,
                stream,
                device_free: None,
                time_us: self.timed.then_some(ts_ns / 1000),
                frames: None,
            },
            stack,
        ));
    }

    /// `--max-db` deleted calls: the entries before cannot be replayed onto the state after.
    fn resume(&mut self, states: Vec<ProcessState>, pid: u32) {
        if let Some(s) = states.into_iter().find(|s| s.pid == pid) {
            self.layout = s.layout;
        }
        self.tenants = Tenants::not_seen(&self.layout);
        self.entries_before_hole += self.entries.values().map(|v| v.len() as u64).sum::<u64>();
        self.entries.clear();
        self.pending.clear();
        self.stream_unknown.clear();
    }

    fn finish(mut self, q: &SnapshotQuery, at_ns: i64, conf: Option<String>) -> Result<Export> {
        self.completed(None);
        // Each was taken at or before the instant (a refusal's entry just after its call).
        for o in std::mem::take(&mut self.ooms) {
            self.oom(&o);
        }
        let mut left = LeftOut {
            entries_before_hole: self.entries_before_hole,
            ..LeftOut::default()
        };
        let (segments, unseen) = self.segments(&mut left);
        let since = q.since_ns.map(|s| at_ns.saturating_sub(s));
        let mut traces: Vec<Vec<(Entry, Option<i64>)>> = Vec::new();
        let mut overflowed = false;
        for (device, mut list) in std::mem::take(&mut self.entries) {
            // An imported free's request was placed at its own, earlier, instant.
            list.sort_by_key(|(ts, _, _)| *ts);
            let mut kept: Vec<(Entry, Option<i64>)> = Vec::new();
            for (ts, entry, stack) in list {
                if self.rebuilt_until.is_some_and(|r| ts < r) {
                    left.entries_rebuilt += 1;
                } else if since.is_some_and(|s| ts < s) {
                    left.entries_before_since += 1;
                } else if self.of_left_out(&entry, &unseen) || self.not_allocators(&entry) {
                    left.entries_of_unseen += 1;
                } else {
                    kept.push((entry, stack));
                }
            }
            if kept.len() > q.max_entries {
                let cut = kept.len() - q.max_entries;
                left.entries_cut += cut as u64;
                kept.drain(..cut);
                overflowed = true;
            }
            let at = usize::try_from(device).unwrap_or(0);
            if traces.len() <= at {
                traces.resize_with(at + 1, Vec::new);
            }
            traces[at] = kept;
        }
        if let Some(last) = segments.iter().map(|s| s.device).max() {
            let needed = usize::try_from(last).unwrap_or(0) + 1;
            if traces.len() < needed {
                traces.resize_with(needed, Vec::new);
            }
        }
        let expandable = conf
            .as_deref()
            .is_some_and(|c| c.contains("expandable_segments:True"))
            || segments.iter().any(|s| s.expandable);
        Ok(Export {
            session: 0,
            pid: 0,
            at_ns,
            segments,
            traces: traces
                .into_iter()
                .map(|t| {
                    t.into_iter()
                        .map(|(mut e, stack)| {
                            e.frames = stack.map(|s| s as usize);
                            e
                        })
                        .collect()
                })
                .collect(),
            frames: Vec::new(),
            expandable,
            alloc_conf: conf,
            max_entries: q.max_entries,
            overflowed,
            left_out: left,
        })
    }

    /// The segments seen whole, and the address ranges of those left out.
    fn segments(&self, left: &mut LeftOut) -> (Vec<Segment>, Vec<(u64, u64)>) {
        let mut out = Vec::new();
        let mut unseen = Vec::new();
        for (addr, size) in self.layout.unseen_segments() {
            left.unseen_segments += 1;
            left.unseen_bytes += size;
            unseen.push((addr, addr + size));
        }
        for s in self.layout.segments() {
            if unseen.iter().any(|&(a, _)| a == s.addr) {
                continue;
            }
            if !self.imported && s.pool.is_none() && !self.allocator_segments.contains(&s.addr) {
                left.outside_allocations += 1;
                unseen.push((s.addr, s.addr + s.size));
                continue;
            }
            // PyTorch reports each contiguous mapped range of an expandable segment as a
            // segment of its own.
            for runs in s.runs.split(|r| r.kind == RunKind::Unmapped) {
                let Some(first) = runs.first() else { continue };
                let blocks: Vec<Block> = runs
                    .iter()
                    .map(|r| {
                        let mut b = block(r);
                        if b.state == BlockState::Inactive {
                            b.requested_size = match self.tenants.of(s.addr, r.addr) {
                                Tenant::Requested(bytes) => bytes,
                                Tenant::NotSeen => {
                                    left.inactive_tenant_unseen += 1;
                                    0
                                }
                            };
                        }
                        b
                    })
                    .collect();
                out.push(Segment {
                    device: s.device,
                    address: first.addr,
                    total_size: blocks.iter().map(|b| b.size).sum(),
                    allocated_size: blocks
                        .iter()
                        .filter(|b| b.state != BlockState::Inactive)
                        .map(|b| b.size)
                        .sum(),
                    stream: self.layout.segment_stream(s.addr).unwrap_or(0),
                    small: s.pool.map_or(s.size == 2 << 20, |p| p == Pool::Small),
                    expandable: s.expandable,
                    pool_id: s.pool_id.unwrap_or((0, 0)),
                    blocks,
                });
            }
        }
        out.sort_by_key(|s| (s.device, s.address));
        (out, unseen)
    }

    /// A device allocation (or its release) no block ever landed in: a library's own.
    fn not_allocators(&self, e: &Entry) -> bool {
        !self.imported
            && matches!(e.action, Action::SegmentAlloc | Action::SegmentFree)
            && !self.allocator_segments.contains(&e.addr)
    }

    /// Whether the entry is of a segment left out.
    fn of_left_out(&self, e: &Entry, unseen: &[(u64, u64)]) -> bool {
        e.action != Action::Oom && unseen.iter().any(|&(a, b)| a <= e.addr && e.addr < b)
    }
}

/// A run of the layout as PyTorch's block.
fn block(r: &crate::model::layout::Run) -> Block {
    Block {
        address: r.addr,
        size: r.size,
        requested_size: r.requested,
        state: match r.kind {
            RunKind::Allocated => BlockState::Allocated,
            RunKind::Pending => BlockState::PendingFree,
            _ => BlockState::Inactive,
        },
        frames: r.stack.map(|s| s as usize),
    }
}

fn is_segment_op(op: Op) -> bool {
    matches!(
        op,
        // The runtime's, not the driver calls nested in them (the same allocation); the
        // driver's mappings of expandable segments.
        Op::CudaMalloc | Op::CudaFree | Op::CuMemMap | Op::CuMemUnmap
    )
}

/// Reads the frames of the call sites the blocks and entries name (stack ids until now), and
/// points them at the list.
fn frames(conn: &rusqlite::Connection, out: &mut Export) -> Result<Vec<Vec<Frame>>> {
    let mut index: HashMap<usize, usize> = HashMap::new();
    let mut frames = Vec::new();
    let mut place = |stack: &mut Option<usize>| -> Result<()> {
        let Some(id) = *stack else { return Ok(()) };
        let at = match index.get(&id) {
            Some(&at) => at,
            None => {
                let rows = events::frames_of(conn, id as i64)?;
                frames.push(rows.into_iter().map(frame).collect());
                index.insert(id, frames.len() - 1);
                frames.len() - 1
            }
        };
        *stack = Some(at);
        Ok(())
    };
    for s in &mut out.segments {
        for b in &mut s.blocks {
            place(&mut b.frames)?;
        }
    }
    for t in &mut out.traces {
        for e in t {
            place(&mut e.frames)?;
        }
    }
    Ok(frames)
}

/// A stored frame as PyTorch names one: a Python frame's file and line, a native one's
/// function (or its module and offset) with the file unknown ("??").
fn frame(f: events::FrameOut) -> Frame {
    let name = f
        .function
        .clone()
        .unwrap_or_else(|| match (&f.module, f.address) {
            (Some(m), Some(a)) => format!("{m}+{a:#x}"),
            _ => "??".to_owned(),
        });
    Frame {
        filename: f.file.unwrap_or_else(|| "??".to_owned()),
        line: f.line.unwrap_or(0),
        name,
    }
}
