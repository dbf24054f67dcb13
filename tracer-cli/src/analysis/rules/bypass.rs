//! Device memory taken past the caching allocator (rule 6).

use std::collections::BTreeMap;

use tracer_common::{Library, OpClass, Space};

use super::churn::expandable_calls;
use super::{Chain, Proc, Rule, Severity, FIX_FRACTION};
use crate::{
    analysis::{Event, FastMap},
    units::format_bytes as b,
};

/// Rule 6: driver allocations not made inside a runtime call of the same thread, nor by
/// PyTorch's expandable segments. Bytes are counted once: physical memory (cuMemCreate,
/// cuMemAlloc), not the address ranges it is mapped into.
pub(super) fn driver_bypass(p: &Proc<'_>) -> Option<Chain> {
    let (pid, evs) = (p.pid, p.window);
    let allocator = expandable_calls(p);
    let driver_alloc =
        |e: &Event| e.op.spec().library == Library::Driver && e.class() == OpClass::Alloc;
    if !evs.iter().any(driver_alloc) {
        return None;
    }
    // Runtime calls of one thread do not overlap (but for nesting), so the enclosing one, if
    // any, is the last that started before the driver call.
    let mut runtime: FastMap<u32, Vec<&Event>> = FastMap::default();
    for e in evs
        .iter()
        .filter(|e| e.op.spec().library == Library::Runtime)
    {
        runtime.entry(e.tid).or_default().push(e);
    }
    let nested = |d: &Event| {
        runtime.get(&d.tid).is_some_and(|calls| {
            let i = calls.partition_point(|r| r.ts_ns <= d.ts_ns);
            i > 0 && d.end_ns() <= calls[i - 1].end_ns()
        })
    };
    let bypass: Vec<&Event> = evs
        .iter()
        .enumerate()
        .filter(|(i, e)| driver_alloc(e) && !allocator.contains(i))
        .map(|(_, e)| e)
        .filter(|d| !nested(d))
        .collect();
    if bypass.is_empty() {
        return None;
    }
    let bytes: u64 = bypass
        .iter()
        .filter(|e| e.ret == 0 && matches!(e.space(), Space::Device | Space::Handle))
        .map(|e| e.size)
        .sum();
    let mut ops: BTreeMap<&str, u64> = BTreeMap::new();
    for e in &bypass {
        *ops.entry(e.op.name()).or_default() += 1;
    }
    let listing: Vec<String> = ops.iter().map(|(op, n)| format!("{op} x{n}")).collect();
    Some(Chain {
        rule: Rule::DriverBypass,
        severity: Severity::Low,
        pid,
        title: "allocations bypass the CUDA runtime".into(),
        root: format!(
            "{} driver allocation(s) ({}) made outside any libcudart call, {} of device memory",
            bypass.len(),
            listing.join(", "),
            b(bytes)
        ),
        effect: "memory taken this way is invisible to PyTorch's allocator statistics and competes with its cache".into(),
        compounding: Vec::new(),
        timeline: Vec::new(),
        fix: vec![
            "account for it (NCCL, cuBLAS workspaces, custom extensions, expandable segments)".into(),
            FIX_FRACTION.into(),
        ],
        evidence: format!("{} driver allocations", bypass.len()),
    })
}
