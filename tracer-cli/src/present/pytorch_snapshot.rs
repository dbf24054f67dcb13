//! Encodes an [`Export`] as the pickle `torch.cuda.memory._dump_snapshot()` writes: plain
//! dicts and lists that PyTorch's memory_viz, `_memory_viz.py` and the tools built on them
//! read.

use std::io::{self, Write};

use super::pickle::{self, PyValue};
use crate::query::pytorch_snapshot::{Action, Block, BlockState, Entry, Export, Frame, Segment};

/// Writes `export` as a memory snapshot pickle.
pub fn write(out: &mut impl Write, export: &Export) -> io::Result<()> {
    let frames: Vec<PyValue> = export.frames.iter().map(|f| frame_list(f)).collect();
    let framed = |at: Option<usize>| {
        at.and_then(|i| frames.get(i).cloned())
            .unwrap_or(PyValue::List(Vec::new()))
    };
    let segments = export
        .segments
        .iter()
        .map(|s| segment(s, &framed))
        .collect();
    let traces = export
        .traces
        .iter()
        .map(|t| PyValue::List(t.iter().map(|e| entry(e, &framed)).collect()))
        .collect();
    let root = PyValue::dict([
        ("segments", PyValue::List(segments)),
        ("device_traces", PyValue::List(traces)),
        ("allocator_settings", settings(export)),
    ]);
    pickle::write(out, &root)
}

fn segment(s: &Segment, framed: &impl Fn(Option<usize>) -> PyValue) -> PyValue {
    let requested: u64 = s
        .blocks
        .iter()
        .filter(|b| b.state != BlockState::Inactive)
        .map(|b| b.requested_size)
        .sum();
    PyValue::dict([
        ("device", PyValue::int(s.device)),
        ("address", PyValue::int(s.address)),
        ("total_size", PyValue::int(s.total_size)),
        ("allocated_size", PyValue::int(s.allocated_size)),
        ("active_size", PyValue::int(s.allocated_size)),
        ("requested_size", PyValue::int(requested)),
        ("stream", PyValue::int(s.stream)),
        (
            "segment_type",
            PyValue::str(if s.small { "small" } else { "large" }),
        ),
        (
            "segment_pool_id",
            PyValue::Tuple(vec![PyValue::int(0), PyValue::int(0)]),
        ),
        ("is_expandable", PyValue::Bool(s.expandable)),
        ("frames", PyValue::List(Vec::new())),
        (
            "blocks",
            PyValue::List(s.blocks.iter().map(|b| block(b, framed)).collect()),
        ),
    ])
}

fn block(b: &Block, framed: &impl Fn(Option<usize>) -> PyValue) -> PyValue {
    PyValue::dict([
        ("address", PyValue::int(b.address)),
        ("size", PyValue::int(b.size)),
        ("requested_size", PyValue::int(b.requested_size)),
        (
            "state",
            PyValue::str(match b.state {
                BlockState::ActiveAllocated => "active_allocated",
                BlockState::ActivePendingFree => "active_pending_free",
                BlockState::Inactive => "inactive",
            }),
        ),
        ("frames", framed(b.frames)),
    ])
}

fn entry(e: &Entry, framed: &impl Fn(Option<usize>) -> PyValue) -> PyValue {
    let mut pairs = vec![(
        "action".to_owned(),
        PyValue::str(match e.action {
            Action::Alloc => "alloc",
            Action::FreeRequested => "free_requested",
            Action::FreeCompleted => "free_completed",
            Action::SegmentAlloc => "segment_alloc",
            Action::SegmentFree => "segment_free",
            Action::SegmentMap => "segment_map",
            Action::SegmentUnmap => "segment_unmap",
            Action::Oom => "oom",
        }),
    )];
    // PyTorch writes an out-of-memory's device free bytes in place of an address.
    if e.action == Action::Oom {
        pairs.push((
            "device_free".to_owned(),
            PyValue::int(e.device_free.unwrap_or(0)),
        ));
    } else {
        pairs.push(("addr".to_owned(), PyValue::int(e.addr)));
    }
    pairs.push(("size".to_owned(), PyValue::int(e.size)));
    pairs.push(("stream".to_owned(), PyValue::int(e.stream)));
    if let Some(t) = e.time_us {
        pairs.push(("time_us".to_owned(), PyValue::int(t)));
    }
    pairs.push(("frames".to_owned(), framed(e.frames)));
    PyValue::Dict(pairs)
}

fn frame_list(frames: &[Frame]) -> PyValue {
    PyValue::List(
        frames
            .iter()
            .map(|f| {
                PyValue::dict([
                    ("filename", PyValue::str(f.filename.clone())),
                    ("line", PyValue::int(f.line)),
                    ("name", PyValue::str(f.name.clone())),
                ])
            })
            .collect(),
    )
}

fn settings(export: &Export) -> PyValue {
    PyValue::dict([
        (
            "PYTORCH_CUDA_ALLOC_CONF",
            PyValue::str(export.alloc_conf.clone().unwrap_or_default()),
        ),
        ("expandable_segments", PyValue::Bool(export.expandable)),
        (
            "trace_alloc_max_entries",
            PyValue::int(export.max_entries as u64),
        ),
        ("trace_alloc_overflowed", PyValue::Bool(export.overflowed)),
    ])
}
