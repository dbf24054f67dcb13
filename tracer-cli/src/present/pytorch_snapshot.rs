//! Encodes an [`Export`] as the pickle `torch.cuda.memory._dump_snapshot()` writes: plain
//! dicts and lists that PyTorch's memory_viz, `_memory_viz.py` and the tools built on them
//! read.

use std::io::{self, Write};

use super::pickle::{self, PyValue};
use crate::query::pytorch_snapshot::{
    Action, Block, BlockState, Entry, Export, Frame, LeftOut, Segment,
};

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
            PyValue::Tuple(vec![PyValue::int(s.pool_id.0), PyValue::int(s.pool_id.1)]),
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
        ("state", PyValue::str(b.state.name())),
        ("frames", framed(b.frames)),
    ])
}

fn entry(e: &Entry, framed: &impl Fn(Option<usize>) -> PyValue) -> PyValue {
    let mut pairs = vec![("action".to_owned(), PyValue::str(e.action.name()))];
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

/// What the snapshot leaves out, in words (nothing unseen is written as free).
pub fn left_out_lines(l: &LeftOut) -> Vec<String> {
    let mut lines = Vec::new();
    if l.unseen_segments > 0 {
        lines.push(format!(
            "{} segments ({}) whose blocks tracer did not see (made before PyTorch's allocator probes were armed or the process was traced), with {} entries of theirs",
            l.unseen_segments,
            crate::units::format_bytes(l.unseen_bytes),
            l.entries_of_unseen
        ));
    } else if l.entries_of_unseen > 0 {
        lines.push(format!(
            "{} entries of device allocations that are not the allocator's",
            l.entries_of_unseen
        ));
    }
    if l.outside_allocations > 0 {
        lines.push(format!(
            "{} device allocations no block landed in (a library's own cudaMalloc)",
            l.outside_allocations
        ));
    }
    for (n, what) in [
        (l.entries_rebuilt, "entries of the state before an imported trace began (rebuilt from its final state, never recorded)"),
        (l.entries_before_hole, "entries before calls --max-db deleted (the layout after them comes from a keyframe)"),
        (l.entries_before_since, "entries before --since"),
        (l.entries_cut, "oldest entries past --max-entries (trace_alloc_overflowed is set)"),
        (l.inactive_tenant_unseen, "inactive blocks' requested_size (free since before what tracer saw: written 0, as PyTorch writes for a block never allocated)"),
    ] {
        if n > 0 {
            lines.push(format!("{n} {what}"));
        }
    }
    lines
}
