//! A PyTorch memory snapshot (`torch.cuda.memory._dump_snapshot`), read from the plain-data
//! pickle into owned values: the allocator's final segments and blocks, each device's trace of
//! allocator actions (oldest first) with the frames of each, and the allocator's settings.
//! Every field is checked; a missing or mistyped one names the object and the field.

use std::collections::HashMap;

use anyhow::{anyhow, bail, Result};

use super::pickle::{Pickle, Value, ValueId};

/// A snapshot as tracer uses it.
#[derive(Debug, Default)]
pub struct MemorySnapshot {
    pub segments: Vec<SegmentState>,
    /// Per device that has any, its actions, oldest first.
    pub traces: Vec<DeviceTrace>,
    /// The allocator's settings as PYTORCH_CUDA_ALLOC_CONF would say them (None: the file
    /// does not say; older snapshots).
    pub alloc_conf: Option<String>,
    /// The distinct call sites of the trace's entries, innermost frame first.
    pub stacks: Vec<Vec<Frame>>,
    /// What tracer read of the file but could not use, and what it says of itself.
    pub notes: FileNotes,
}

/// What an import read of a snapshot but could not use, and what the file says of its trace.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct FileNotes {
    /// Entries of actions this tracer does not know, skipped.
    pub unknown_actions: u64,
    /// Entries of known actions that lack a field tracer needs (or hold a mistyped one),
    /// skipped, and the first one's place and fault.
    pub unusable_entries: u64,
    pub first_unusable: Option<String>,
    /// The trace's ring overflowed, so it starts after the job did
    /// (`allocator_settings.trace_alloc_overflowed`; None: the file does not say).
    pub trace_overflowed: Option<bool>,
    /// The ring's capacity (`allocator_settings.trace_alloc_max_entries`).
    pub trace_max_entries: Option<u64>,
    /// Pinned host memory (`host_segments`, `host_traces`): counted, not imported (tracer
    /// models device memory).
    pub host_segments: u64,
    pub host_entries: u64,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SegmentState {
    pub device: i32,
    pub address: u64,
    pub total_size: u64,
    pub stream: u64,
    /// segment_type "small".
    pub small: bool,
    pub expandable: bool,
    /// `segment_pool_id`: the private pool it belongs to (a CUDA graph's, a MemPool's); (0, 0)
    /// or absent for the default pools.
    pub pool_id: (u64, u64),
    pub blocks: Vec<BlockState>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockState {
    pub address: u64,
    /// The block as split.
    pub size: u64,
    pub requested_size: u64,
    pub state: BlockKind,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BlockKind {
    Allocated,
    /// Freed by the program, waiting for events on other streams (record_stream).
    PendingFree,
    Inactive,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceTrace {
    pub device: i32,
    pub entries: Vec<TraceEntry>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    Alloc,
    FreeRequested,
    FreeCompleted,
    SegmentAlloc,
    SegmentFree,
    SegmentMap,
    SegmentUnmap,
    /// The device refused: `addr` holds the device's free bytes, `size` the request.
    Oom,
    Snapshot,
}

/// Each action by the name PyTorch writes.
const ACTIONS: [(&str, Action); 9] = [
    ("alloc", Action::Alloc),
    ("free_requested", Action::FreeRequested),
    ("free_completed", Action::FreeCompleted),
    ("segment_alloc", Action::SegmentAlloc),
    ("segment_free", Action::SegmentFree),
    ("segment_map", Action::SegmentMap),
    ("segment_unmap", Action::SegmentUnmap),
    ("oom", Action::Oom),
    ("snapshot", Action::Snapshot),
];

impl Action {
    fn parse(name: &str) -> Option<Action> {
        ACTIONS.iter().find(|(n, _)| *n == name).map(|(_, a)| *a)
    }

    /// The name PyTorch writes.
    pub fn name(self) -> &'static str {
        ACTIONS
            .iter()
            .find(|(_, a)| *a == self)
            .map_or("snapshot", |(n, _)| n)
    }
}

impl BlockKind {
    /// The state PyTorch writes.
    pub fn name(self) -> &'static str {
        match self {
            BlockKind::Allocated => "active_allocated",
            BlockKind::PendingFree => "active_pending_free",
            BlockKind::Inactive => "inactive",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TraceEntry {
    pub action: Action,
    pub addr: u64,
    pub size: u64,
    pub stream: u64,
    /// Wall-clock microseconds (None in older snapshots).
    pub time_us: Option<i64>,
    /// Index into [`MemorySnapshot::stacks`].
    pub stack: Option<u32>,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Frame {
    pub name: String,
    pub filename: String,
    pub line: i64,
}

impl Frame {
    /// A Python frame (its file is a .py), not a native one.
    pub fn is_python(&self) -> bool {
        self.filename.ends_with(".py")
    }
}

/// Reads the snapshot out of a decoded pickle.
pub fn read(p: &Pickle) -> Result<MemorySnapshot> {
    let root = p.root();
    if !matches!(p.get(root), Value::Dict(_)) {
        bail!("the pickle is not a dict: not a memory snapshot");
    }
    let mut r = Reader {
        p,
        stacks: HashMap::new(),
        out: MemorySnapshot::default(),
    };
    let segments = p
        .field(root, "segments")
        .ok_or_else(|| anyhow!("no 'segments': not a memory snapshot"))?;
    for (i, &s) in p.items(segments).iter().enumerate() {
        let seg = r.segment(s).map_err(|e| anyhow!("segments[{i}]: {e}"))?;
        r.out.segments.push(seg);
    }
    let traces = p
        .field(root, "device_traces")
        .ok_or_else(|| anyhow!("no 'device_traces': a snapshot without its trace (record it with torch.cuda.memory._record_memory_history())"))?;
    for (device, &t) in p.items(traces).iter().enumerate() {
        let mut entries = Vec::new();
        for (i, &e) in p.items(t).iter().enumerate() {
            match r.entry(e) {
                Ok(Some(entry)) => entries.push(entry),
                Ok(None) => {}
                // One entry tracer cannot use is no reason to refuse the file: counted, said.
                Err(err) => {
                    r.out.notes.unusable_entries += 1;
                    r.out
                        .notes
                        .first_unusable
                        .get_or_insert_with(|| format!("device_traces[{device}][{i}]: {err}"));
                }
            }
        }
        if !entries.is_empty() {
            r.out.traces.push(DeviceTrace {
                device: device as i32,
                entries,
            });
        }
    }
    let settings = p.field(root, "allocator_settings");
    r.out.alloc_conf = settings.map(|s| alloc_conf(p, s));
    r.out.notes.trace_overflowed = settings
        .and_then(|s| p.field(s, "trace_alloc_overflowed"))
        .and_then(|v| p.bool(v));
    r.out.notes.trace_max_entries = settings
        .and_then(|s| p.field(s, "trace_alloc_max_entries"))
        .and_then(|v| p.int(v))
        .and_then(|n| u64::try_from(n).ok());
    r.out.notes.host_segments = p
        .field(root, "host_segments")
        .map_or(0, |v| p.items(v).len() as u64);
    r.out.notes.host_entries = p.field(root, "host_traces").map_or(0, |v| {
        p.items(v).iter().map(|&t| p.items(t).len() as u64).sum()
    });
    Ok(r.out)
}

struct Reader<'a> {
    p: &'a Pickle,
    /// Frame lists by the frames they hold (PyTorch shares each frame between entries).
    stacks: HashMap<Vec<ValueId>, u32>,
    out: MemorySnapshot,
}

impl Reader<'_> {
    fn u64(&self, obj: ValueId, key: &str) -> Result<u64> {
        let v = self.i64(obj, key)?;
        u64::try_from(v).map_err(|_| anyhow!("'{key}' is negative ({v})"))
    }

    fn i64(&self, obj: ValueId, key: &str) -> Result<i64> {
        let v = self
            .p
            .field(obj, key)
            .ok_or_else(|| anyhow!("no '{key}'"))?;
        self.p
            .int(v)
            .ok_or_else(|| anyhow!("'{key}' is not an integer"))
    }

    fn str(&self, obj: ValueId, key: &str) -> Result<&str> {
        let v = self
            .p
            .field(obj, key)
            .ok_or_else(|| anyhow!("no '{key}'"))?;
        self.p
            .str(v)
            .ok_or_else(|| anyhow!("'{key}' is not a string"))
    }

    fn segment(&mut self, s: ValueId) -> Result<SegmentState> {
        let mut blocks = Vec::new();
        let list = self
            .p
            .field(s, "blocks")
            .ok_or_else(|| anyhow!("no 'blocks'"))?;
        for (i, &b) in self.p.items(list).iter().enumerate() {
            let named = self
                .str(b, "state")
                .map_err(|e| anyhow!("blocks[{i}]: {e}"))?;
            let Some(state) = [
                BlockKind::Allocated,
                BlockKind::PendingFree,
                BlockKind::Inactive,
            ]
            .into_iter()
            .find(|k| k.name() == named) else {
                bail!("blocks[{i}]: unknown state '{named}'");
            };
            blocks.push(BlockState {
                address: self
                    .u64(b, "address")
                    .map_err(|e| anyhow!("blocks[{i}]: {e}"))?,
                size: self
                    .u64(b, "size")
                    .map_err(|e| anyhow!("blocks[{i}]: {e}"))?,
                requested_size: self.u64(b, "requested_size").unwrap_or(0),
                state,
            });
        }
        Ok(SegmentState {
            device: self.i64(s, "device")? as i32,
            address: self.u64(s, "address")?,
            total_size: self.u64(s, "total_size")?,
            stream: self.u64(s, "stream").unwrap_or(0),
            small: self.str(s, "segment_type").is_ok_and(|t| t == "small"),
            expandable: self
                .p
                .field(s, "is_expandable")
                .and_then(|v| self.p.bool(v))
                .unwrap_or(false),
            pool_id: self.pool_id(s)?,
            blocks,
        })
    }

    /// A segment's `segment_pool_id`, a pair of counters (older snapshots lack it).
    fn pool_id(&self, s: ValueId) -> Result<(u64, u64)> {
        let Some(v) = self.p.field(s, "segment_pool_id") else {
            return Ok((0, 0));
        };
        let half = |i: usize| {
            self.p
                .items(v)
                .get(i)
                .and_then(|&x| self.p.int(x))
                .and_then(|x| u64::try_from(x).ok())
                .ok_or_else(|| anyhow!("'segment_pool_id' is not a pair of counters"))
        };
        Ok((half(0)?, half(1)?))
    }

    fn entry(&mut self, e: ValueId) -> Result<Option<TraceEntry>> {
        let Some(action) = Action::parse(self.str(e, "action")?) else {
            self.out.notes.unknown_actions += 1;
            return Ok(None);
        };
        let stack = match self.p.field(e, "frames") {
            Some(f) => self.stack(f)?,
            None => None,
        };
        // PyTorch writes an out-of-memory's device free bytes as `device_free`, with no
        // address (older tracer test files put them in `addr`).
        let addr = match action {
            Action::Oom => self
                .u64(e, "device_free")
                .or_else(|_| self.u64(e, "addr"))?,
            _ => self.u64(e, "addr")?,
        };
        Ok(Some(TraceEntry {
            action,
            addr,
            size: self.u64(e, "size")?,
            stream: self.u64(e, "stream").unwrap_or(0),
            time_us: self.i64(e, "time_us").ok(),
            stack,
        }))
    }

    fn stack(&mut self, frames: ValueId) -> Result<Option<u32>> {
        let ids = self.p.items(frames);
        if ids.is_empty() {
            return Ok(None);
        }
        if let Some(&id) = self.stacks.get(ids) {
            return Ok(Some(id));
        }
        let mut stack = Vec::with_capacity(ids.len());
        for (i, &f) in ids.iter().enumerate() {
            stack.push(Frame {
                name: self
                    .str(f, "name")
                    .map_err(|e| anyhow!("frames[{i}]: {e}"))?
                    .to_owned(),
                filename: self
                    .str(f, "filename")
                    .map_err(|e| anyhow!("frames[{i}]: {e}"))?
                    .to_owned(),
                line: self.i64(f, "line").map(|l| l.max(0)).unwrap_or(0),
            });
        }
        let id = self.out.stacks.len() as u32;
        self.out.stacks.push(stack);
        self.stacks.insert(ids.to_vec(), id);
        Ok(Some(id))
    }
}

/// The settings as PYTORCH_CUDA_ALLOC_CONF says them: the process's own value when it set one,
/// else the settings that differ from PyTorch's defaults.
fn alloc_conf(p: &Pickle, settings: ValueId) -> String {
    let conf = p
        .field(settings, "PYTORCH_CUDA_ALLOC_CONF")
        .and_then(|v| p.str(v))
        .unwrap_or("");
    if !conf.is_empty() {
        return conf.to_owned();
    }
    let mut parts = Vec::new();
    if p.field(settings, "expandable_segments")
        .and_then(|v| p.bool(v))
        .unwrap_or(false)
    {
        parts.push("expandable_segments:True".to_owned());
    }
    if let Some(max) = p
        .field(settings, "max_split_size")
        .and_then(|v| p.int(v))
        .filter(|&m| m > 0 && m < i64::MAX)
    {
        parts.push(format!("max_split_size_mb:{}", max >> 20));
    }
    if let Some(gc) = p
        .field(settings, "garbage_collection_threshold")
        .and_then(|v| p.float(v))
        .filter(|&t| t > 0.0)
    {
        parts.push(format!("garbage_collection_threshold:{gc}"));
    }
    parts.join(",")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A snapshot Python wrote (tracer-cli/testdata/tiny_snapshot.pickle): one 2 MiB segment,
    /// its allocation and a failed request, frames shared between the entries.
    pub const TINY: &[u8] = include_bytes!("../../testdata/tiny_snapshot.pickle");

    #[test]
    fn reads_segments_traces_frames_and_settings() {
        let snap = read(&super::super::pickle::decode(TINY).unwrap()).unwrap();
        let seg = &snap.segments[0];
        assert_eq!(
            (seg.address, seg.total_size, seg.small),
            (1 << 40, 2 << 20, true)
        );
        assert_eq!(seg.blocks[0].state, BlockKind::Allocated);
        assert_eq!(seg.blocks[1].size, (2 << 20) - 512);
        let entries = &snap.traces[0].entries;
        let actions: Vec<Action> = entries.iter().map(|e| e.action).collect();
        assert_eq!(actions, [Action::SegmentAlloc, Action::Alloc, Action::Oom]);
        assert_eq!(
            (entries[2].addr, entries[2].size, entries[2].time_us),
            (1000, 1 << 30, Some(7))
        );
        // One call site, shared.
        assert_eq!(snap.stacks.len(), 1);
        assert!(entries.iter().all(|e| e.stack == Some(0)));
        assert!(snap.stacks[0][0].is_python() && !snap.stacks[0][1].is_python());
        assert_eq!(snap.alloc_conf.as_deref(), Some("expandable_segments:True"));
    }
}
