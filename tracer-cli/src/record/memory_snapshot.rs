//! `tracer import --snapshot`: a PyTorch memory snapshot becomes a session (source `snapshot`)
//! of the events PyTorch's probes and the CUDA runtime would have given: `alloc` a
//! pytorch:malloc, `free_completed` a pytorch:free (the block is back in its pool), segments
//! cudaMalloc/cudaFree, expandable segments' pages cuMemMap/cuMemUnmap in a reserved range, an
//! `oom` the failed cudaMalloc and PyTorch's message. The trace's frames become call sites.
//!
//! A trace is a ring: it may start after the job did. The state before its first entry is
//! rebuilt backwards from the final `segments` (as PyTorch's memory_viz does) and stored as
//! the events that made it, just before the first entry: the segments, then the blocks live at
//! that moment (highest address first, so that each block's split is decided beside the block
//! that followed it).

use std::{
    collections::{BTreeMap, HashMap},
    path::Path,
};

use anyhow::{Context as _, Result};
use serde::Serialize;
use tracer_common::Op;

use super::snapshot_before::{before_maps, map_range, reserved_extent, Before};
use crate::{
    decode::{
        memory_snapshot::{self, Action, BlockKind, MemorySnapshot, TraceEntry},
        pickle, Call, Message,
    },
    exit::user_error,
    model::{
        layout::{AllocConf, SMALL_SIZE},
        policy::segment_size,
        ProcessInfo,
    },
    paths,
    store::{
        Batch, GapRow, SessionCounters, SessionStart, StackFrame, StackRow, Store, SNAPSHOT_UNTIMED,
    },
};

/// The process the snapshot describes: the file names none.
pub const SNAPSHOT_PID: u32 = 1;
const SNAPSHOT_TID: u32 = 1;
/// cudaErrorMemoryAllocation.
const CUDA_OOM: i32 = 2;
/// Calls per write transaction.
const BATCH_CALLS: usize = 100_000;

/// What [`import_snapshot`] stored.
#[derive(Clone, Debug, Serialize)]
pub struct ImportedSnapshot {
    pub session: i64,
    /// Events stored (calls and block events).
    pub calls: u64,
    /// Trace entries read, of all devices.
    pub entries: u64,
    /// What was read of the file but not used, and what it says of its trace.
    #[serde(flatten)]
    pub notes: memory_snapshot::FileNotes,
    /// The trace starts after the job did: segments and blocks live before its first entry,
    /// rebuilt backwards from the final state.
    pub segments_before_trace: u64,
    pub blocks_before_trace: u64,
    /// Entries the backward rebuild could not place (a free of a block it did not hold...).
    pub inconsistent_entries: u64,
    /// The file has no times (older snapshots): entries are 1 µs apart, ending at the file's
    /// modification time.
    pub times_synthesized: bool,
    /// PYTORCH_CUDA_ALLOC_CONF as the snapshot's settings say it.
    pub alloc_conf: Option<String>,
}

/// Reads and checks a snapshot file (untrusted): a bad one is the user's error, naming it.
/// Under sudo the file is opened with the invoking user's file-system ids: root reads nothing
/// through it that they could not read themselves.
/// The most a gzip'd snapshot may unpack to: far above any snapshot memory_viz can open, well
/// below what would exhaust a node's memory.
const GUNZIPPED_MAX: u64 = 4 << 30;

/// The bytes as they are, or unpacked where they are gzip's (magic 1f 8b), bounded.
fn gunzipped(bytes: Vec<u8>) -> std::io::Result<Vec<u8>> {
    use std::io::Read as _;
    if !bytes.starts_with(&[0x1f, 0x8b]) {
        return Ok(bytes);
    }
    let mut out = Vec::new();
    flate2::read::MultiGzDecoder::new(bytes.as_slice())
        .take(GUNZIPPED_MAX + 1)
        .read_to_end(&mut out)?;
    if out.len() as u64 > GUNZIPPED_MAX {
        return Err(std::io::Error::other(format!(
            "it unpacks to more than {} (not a memory snapshot)",
            crate::units::format_bytes(GUNZIPPED_MAX)
        )));
    }
    Ok(out)
}

pub fn read_snapshot(file: &Path) -> Result<MemorySnapshot> {
    let as_user = paths::act_as(paths::invoker().owner);
    if !file.is_file() {
        return Err(user_error(format!(
            "memory snapshot {} is not a file: give the file torch.cuda.memory._dump_snapshot() wrote",
            file.display()
        )));
    }
    let bytes = std::fs::read(file).map_err(|e| {
        user_error(format!(
            "cannot read the memory snapshot {}: {e}",
            file.display()
        ))
    })?;
    drop(as_user);
    let bytes = gunzipped(bytes).map_err(|e| {
        user_error(format!(
            "cannot decompress the memory snapshot {}: {e}",
            file.display()
        ))
    })?;
    let decoded = pickle::decode(&bytes).map_err(|e| {
        user_error(format!(
            "{} is not a memory snapshot tracer can read: {e}",
            file.display()
        ))
    })?;
    memory_snapshot::read(&decoded).map_err(|e| {
        user_error(format!(
            "{} is not a memory snapshot tracer can read: {e}",
            file.display()
        ))
    })
}

/// Stores `snap` (read from `file`) as a new session of `db`.
pub fn import_snapshot(file: &Path, snap: &MemorySnapshot, db: &Path) -> Result<ImportedSnapshot> {
    let who = paths::invoker();
    let mut store = Store::open_writable(db, who.owner)?;
    let mut plan = Plan::new(snap, file_time_ns(file));
    for trace in &snap.traces {
        plan.device(snap, trace.device, &trace.entries);
    }
    plan.calls.sort_by_key(|c| c.ts_mono_ns);
    plan.stamp_pools(snap);
    let session = store.begin_session(&SessionStart {
        started_ns: plan.calls.first().map_or(0, |c| c.ts_mono_ns as i64),
        source: if plan.synthesized {
            SNAPSHOT_UNTIMED
        } else {
            "snapshot"
        },
        host: String::new(),
        kernel: String::new(),
        command: std::env::args().collect::<Vec<_>>().join(" "),
        pid_filter: None,
    })?;
    let mut result = store_plan(&mut store, session, snap, file, &mut plan);
    if let (Ok(()), Some(to_ns)) = (&result, plan.trace_begins_ns) {
        // What the trace did not see: its state before was rebuilt from the final one.
        let gap = GapRow {
            pid: SNAPSHOT_PID,
            from_ns: None,
            to_ns,
            kind: "before_trace".into(),
            detail: format!(
                "the snapshot's trace began while the allocator was in use: {} segments and {} blocks live before its first entry were rebuilt from its final state",
                plan.segments_before, plan.blocks_before
            ),
        };
        result = store.write_series(session, &[], &[gap]);
    }
    let stored = plan.calls.len() as u64;
    store.set_counters(
        session,
        &SessionCounters {
            submitted: stored,
            events_read: stored,
            events_stored: stored,
            ..Default::default()
        },
    )?;
    store.append_note(
        session,
        &format!(
            "imported from the PyTorch memory snapshot {}",
            file.display()
        ),
    )?;
    let end = plan.calls.last().map_or(0, |c| c.ts_mono_ns as i64);
    store.end_session(
        session,
        end,
        if result.is_ok() {
            "complete"
        } else {
            "interrupted"
        },
    )?;
    result.with_context(|| format!("import {} into session {session}", file.display()))?;
    Ok(ImportedSnapshot {
        session,
        calls: stored,
        entries: snap.traces.iter().map(|t| t.entries.len() as u64).sum(),
        notes: snap.notes.clone(),
        segments_before_trace: plan.segments_before,
        blocks_before_trace: plan.blocks_before,
        inconsistent_entries: plan.inconsistent,
        times_synthesized: plan.synthesized,
        alloc_conf: snap.alloc_conf.clone(),
    })
}

fn store_plan(
    store: &mut Store,
    session: i64,
    snap: &MemorySnapshot,
    file: &Path,
    plan: &mut Plan,
) -> Result<()> {
    // Each call site once, with its stored id.
    let mut sites: HashMap<u32, i64> = HashMap::new();
    for call in &mut plan.calls {
        let Some(idx) = call.stack else { continue };
        let id = match sites.get(&(idx as u32)) {
            Some(&id) => id,
            None => {
                let frames = stack_frames(&snap.stacks[idx as usize]);
                let id = store.insert_stack(
                    session,
                    &StackRow {
                        pid: SNAPSHOT_PID,
                        native_depth: frames.iter().filter(|f| f.kind == "native").count() as u32,
                        python: "ok",
                        frames: &frames,
                    },
                )?;
                sites.insert(idx as u32, id);
                id
            }
        };
        call.stack = Some(id);
    }
    let first = plan.calls.first().map_or(0, |c| c.ts_mono_ns as i64);
    let process = ProcessInfo {
        pid: SNAPSHOT_PID,
        start_time_ns: None,
        first_seen_ns: first,
        comm: Some("snapshot".into()),
        cmdline: Some(format!("PyTorch memory snapshot {}", file.display())),
        exe: None,
        cgroup: None,
        env: snap
            .alloc_conf
            .as_ref()
            .map(|c| serde_json::json!({ "PYTORCH_CUDA_ALLOC_CONF": c }).to_string()),
        gpus: None,
        owner: None,
    };
    let threads = [(SNAPSHOT_PID, SNAPSHOT_TID, "snapshot".to_owned())];
    let mut messages = std::mem::take(&mut plan.messages);
    for (i, chunk) in plan.calls.chunks(BATCH_CALLS).enumerate() {
        let last = chunk.last().map_or(i64::MAX, |c| c.ts_mono_ns as i64);
        let split = messages.partition_point(|m| m.ts_mono_ns as i64 <= last);
        let now: Vec<Message> = messages.drain(..split).collect();
        store.write_batch(&Batch {
            session,
            wall_offset_ns: 0,
            calls: chunk,
            threads: if i == 0 { &threads } else { &[] },
            processes: if i == 0 {
                std::slice::from_ref(&process)
            } else {
                &[]
            },
            offcpu: &[],
            messages: &now,
        })?;
    }
    if !messages.is_empty() {
        store.write_batch(&Batch {
            session,
            wall_offset_ns: 0,
            calls: &[],
            threads: &[],
            processes: &[],
            offcpu: &[],
            messages: &messages,
        })?;
    }
    Ok(())
}

/// The innermost frames of PyTorch's own recording and of its allocator: where a probe in
/// the allocator fires, not where the program asked.
const RECORDER_FRAMES: [&str; 5] = [
    "torch::unwind::",
    "torch::CapturedTraceback::",
    "torch::cuda::(anonymous namespace)::gather",
    "c10::cuda::CUDACachingAllocator::",
    "c10::cuda::MemPool",
];

/// PyTorch's frames (innermost first) as tracer stores a call site's, from the first frame
/// outside the recording and the allocator.
fn stack_frames(frames: &[memory_snapshot::Frame]) -> Vec<StackFrame> {
    let inner = frames
        .iter()
        .take_while(|f| RECORDER_FRAMES.iter().any(|r| f.name.starts_with(r)))
        .count();
    frames[inner..]
        .iter()
        .map(|f| {
            let python = f.is_python();
            StackFrame {
                kind: if python { "python" } else { "native" },
                function: Some(f.name.clone()),
                file: (python || !matches!(f.filename.as_str(), "" | "??"))
                    .then(|| f.filename.clone()),
                line: (f.line > 0).then_some(f.line),
                module: None,
                address: None,
            }
        })
        .collect()
}

/// The events to store, built device by device.
struct Plan {
    calls: Vec<Call>,
    messages: Vec<Message>,
    /// Wall-clock ns of the newest entry when the file has no times.
    file_ns: i64,
    /// The allocator ran expandable segments (its settings, or a segment says so).
    expandable: bool,
    synthesized: bool,
    segments_before: u64,
    blocks_before: u64,
    /// The latest device's first trace entry, when a state before the trace was rebuilt: the
    /// allocator was in use before it.
    trace_begins_ns: Option<i64>,
    /// Blocks the program freed whose return to the pool is not yet in the trace: when.
    free_requested: HashMap<u64, i64>,
    inconsistent: u64,
}

impl Plan {
    fn new(snap: &MemorySnapshot, file_ns: i64) -> Plan {
        Plan {
            calls: Vec::with_capacity(snap.traces.iter().map(|t| t.entries.len()).sum()),
            messages: Vec::new(),
            file_ns,
            expandable: snap.segments.iter().any(|s| s.expandable)
                || snap
                    .alloc_conf
                    .as_deref()
                    .is_some_and(|c| AllocConf::expandable_from_env(|_| Some(c))),
            synthesized: false,
            segments_before: 0,
            blocks_before: 0,
            trace_begins_ns: None,
            free_requested: HashMap::new(),
            inconsistent: 0,
        }
    }

    /// Each final segment's private pool, on the call that made it (the last one at its
    /// address): model/pools.rs reads it there. Segments freed before the end carry none: the
    /// snapshot does not say theirs.
    fn stamp_pools(&mut self, snap: &MemorySnapshot) {
        let mut pools: BTreeMap<(i32, u64), (u64, u64)> = snap
            .segments
            .iter()
            .filter(|s| s.pool_id != (0, 0))
            .map(|s| ((s.device, s.address), s.pool_id))
            .collect();
        for c in self.calls.iter_mut().rev() {
            if pools.is_empty() {
                break;
            }
            if !matches!(c.op, Op::CudaMalloc | Op::CuMemAddressReserve) {
                continue;
            }
            let key = (c.device.unwrap_or(0), c.ptr.unwrap_or(0));
            if let Some(id) = pools.remove(&key) {
                c.aux1 = crate::model::pools::pool_id_to_aux1(id);
            }
        }
    }

    fn device(&mut self, snap: &MemorySnapshot, device: i32, entries: &[TraceEntry]) {
        let times = self.times(entries);
        let before = self.rebuild_before(snap, device, entries);
        let start = times.first().copied().unwrap_or(self.file_ns);
        self.state_before(device, &before, snap, entries, start);
        for (e, &ts) in entries.iter().zip(&times) {
            self.entry(device, e, ts, start);
        }
    }

    /// Each entry's time in ns, strictly increasing.
    fn times(&mut self, entries: &[TraceEntry]) -> Vec<i64> {
        let mut out = Vec::with_capacity(entries.len());
        let n = entries.len() as i64;
        let mut last = i64::MIN;
        for (i, e) in entries.iter().enumerate() {
            let ts = match e.time_us {
                Some(us) => us.saturating_mul(1000),
                None => {
                    self.synthesized = true;
                    self.file_ns - (n - i as i64) * 1000
                }
            };
            last = ts.max(last.saturating_add(1));
            out.push(last);
        }
        out
    }

    /// Undoes the trace from the final state of `device`.
    fn rebuild_before(
        &mut self,
        snap: &MemorySnapshot,
        device: i32,
        entries: &[TraceEntry],
    ) -> Before {
        let mut b = Before::default();
        for s in snap.segments.iter().filter(|s| s.device == device) {
            b.segments.insert(s.address, (s.total_size, s.expandable));
            if s.expandable {
                map_range(&mut b.mapped, s.address, s.address + s.total_size, true);
                if s.small {
                    b.small.insert(s.address);
                }
            }
            for blk in &s.blocks {
                if blk.state != BlockKind::Inactive {
                    b.blocks
                        .insert(blk.address, (blk.requested_size, s.stream, Some(blk.size)));
                }
            }
        }
        for e in entries.iter().rev() {
            let consistent = match e.action {
                Action::Alloc => b.blocks.remove(&e.addr).is_some(),
                Action::FreeCompleted => {
                    b.blocks.insert(e.addr, (e.size, e.stream, None)).is_none()
                }
                Action::SegmentAlloc => b.segments.remove(&e.addr).is_some(),
                Action::SegmentFree => b.segments.insert(e.addr, (e.size, false)).is_none(),
                Action::SegmentMap => map_range(&mut b.mapped, e.addr, e.addr + e.size, false),
                Action::SegmentUnmap => map_range(&mut b.mapped, e.addr, e.addr + e.size, true),
                Action::FreeRequested | Action::Oom | Action::Snapshot => true,
            };
            if !consistent {
                self.inconsistent += 1;
            }
        }
        b
    }

    /// The segments and blocks live before the first entry, as the events that made them.
    fn state_before(
        &mut self,
        device: i32,
        before: &Before,
        snap: &MemorySnapshot,
        entries: &[TraceEntry],
        start: i64,
    ) {
        let maps = before_maps(before, snap, entries);
        let events = before.segments.len() + maps.len() + before.blocks.len();
        if events > 0 {
            self.trace_begins_ns = Some(self.trace_begins_ns.map_or(start, |t| t.max(start)));
        }
        let mut ts = start - events as i64 - 1;
        for (&addr, &(size, expandable)) in &before.segments {
            if expandable {
                // The reservation is never in the trace: it held memory before the trace
                // only if pages were mapped in it.
                let next = before.segments.range(addr + 1..).next().map(|(&a, _)| a);
                let extent = reserved_extent(addr, size, snap, entries, next);
                self.push(Op::CuMemAddressReserve, device, addr, extent, ts, 0, None);
                if before.mapped.range(addr..addr + extent).next().is_some() {
                    self.segments_before += 1;
                }
            } else {
                self.push(Op::CudaMalloc, device, addr, size, ts, 0, None);
                self.segments_before += 1;
            }
            ts += 1;
        }
        for (addr, size) in maps {
            self.push(Op::CuMemMap, device, addr, size, ts, 0, None);
            ts += 1;
        }
        for (&addr, &(requested, stream, block)) in before.blocks.iter().rev() {
            // A block from before the trace keeps the size it was split to (a remainder under
            // 1 MiB is not split off a large block): its block size goes with it (aux1, see
            // model/layout.rs `SPLIT_SIZE_IN_AUX1`), its request stays the request.
            self.push(Op::TorchMalloc, device, addr, requested, ts, stream, None);
            if let (Some(c), Some(block)) = (self.calls.last_mut(), block) {
                c.aux1 = block;
            }
            self.blocks_before += 1;
            ts += 1;
        }
    }

    fn entry(&mut self, device: i32, e: &TraceEntry, ts: i64, start: i64) {
        let op = match e.action {
            Action::Alloc => Op::TorchMalloc,
            Action::FreeCompleted => Op::TorchFree,
            Action::SegmentAlloc => Op::CudaMalloc,
            Action::SegmentFree => Op::CudaFree,
            Action::SegmentMap => Op::CuMemMap,
            Action::SegmentUnmap => Op::CuMemUnmap,
            Action::Oom => return self.oom(device, e, ts),
            Action::FreeRequested => {
                self.free_requested.insert(e.addr, ts);
                return;
            }
            Action::Snapshot => return,
        };
        self.push(op, device, e.addr, e.size, ts, e.stream, e.stack);
        if e.action == Action::FreeCompleted {
            // The block returns to its pool now; the program freed it this long before
            // (kept in aux1, so that an export writes both entries at their times). A free
            // requested before the trace began is placed just before it, with the rebuilt
            // state an export leaves out.
            let requested = self.free_requested.remove(&e.addr).unwrap_or(start - 1);
            if let Some(c) = self.calls.last_mut() {
                c.aux1 = (ts - requested).max(0) as u64;
            }
        }
    }

    /// The device refused the segment the request needed: the failed cudaMalloc, then
    /// PyTorch's message (its figures as the trace has them).
    fn oom(&mut self, device: i32, e: &TraceEntry, ts: i64) {
        // Expandable segments grow by a page of the pool, created then mapped: the creation
        // is what the device refuses.
        let (op, size) = if self.expandable {
            let page = if e.size <= SMALL_SIZE {
                2 << 20
            } else {
                20 << 20
            };
            (Op::CuMemCreate, page)
        } else {
            (Op::CudaMalloc, segment_size(e.size))
        };
        self.push(op, device, 0, size, ts, e.stream, e.stack);
        if let Some(c) = self.calls.last_mut() {
            c.ret = CUDA_OOM;
        }
        self.messages.push(Message {
            ts_mono_ns: ts as u64 + 1,
            pid: SNAPSHOT_PID,
            tid: SNAPSHOT_TID,
            op: Op::TorchOom,
            text: format!(
                "CUDA out of memory. Tried to allocate {}. GPU {device} has {} free {}{} bytes free).",
                pytorch_size(e.size),
                pytorch_size(e.addr),
                crate::analysis::oom::SNAPSHOT_OOM_SAYS,
                e.addr
            ),
            truncated: false,
        });
    }

    #[allow(clippy::too_many_arguments)] // reason: one call's fields, named at each use
    fn push(
        &mut self,
        op: Op,
        device: i32,
        ptr: u64,
        size: u64,
        ts: i64,
        stream: u64,
        stack: Option<u32>,
    ) {
        self.calls.push(Call {
            ts_mono_ns: ts.max(0) as u64,
            pid: SNAPSHOT_PID,
            tid: SNAPSHOT_TID,
            op,
            device: Some(device),
            ret: 0,
            duration_ns: 0,
            size: Some(size),
            ptr: Some(ptr),
            aux0: stream,
            aux1: 0,
            flags: 0,
            comm: String::new(),
            site: None,
            stack: stack.map(i64::from),
        });
    }
}

/// A size as PyTorch's format_size writes it.
fn pytorch_size(bytes: u64) -> String {
    const KIB: f64 = 1024.0;
    let b = bytes as f64;
    if bytes <= 1024 {
        format!("{bytes} bytes")
    } else if b <= KIB * KIB {
        format!("{:.2} KiB", b / KIB)
    } else if b <= KIB * KIB * KIB {
        format!("{:.2} MiB", b / KIB / KIB)
    } else {
        format!("{:.2} GiB", b / KIB / KIB / KIB)
    }
}

fn file_time_ns(file: &Path) -> i64 {
    std::fs::metadata(file)
        .and_then(|m| m.modified())
        .ok()
        .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
        .map_or(0, |d| d.as_nanos() as i64)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    #[test]
    fn mapped_ranges_merge_split_and_check() {
        let mut r = BTreeMap::new();
        assert!(map_range(&mut r, 0, 40, true));
        assert!(map_range(&mut r, 40, 60, true));
        assert_eq!(r, BTreeMap::from([(0, 60)]));
        assert!(map_range(&mut r, 20, 40, false));
        assert_eq!(r, BTreeMap::from([(0, 20), (40, 60)]));
        assert!(
            !map_range(&mut r, 10, 30, false),
            "half of it was not mapped"
        );
        assert_eq!(r, BTreeMap::from([(0, 10), (40, 60)]));
        assert!(!map_range(&mut r, 50, 70, true), "half of it was mapped");
        assert!(map_range(&mut r, 10, 40, true));
        assert_eq!(r, BTreeMap::from([(0, 70)]));
    }
}
