//! What `tracer trace` prints when it stops: the per-op table and the counters, as text or as
//! one JSON line.

use std::{io::Write, time::Duration};

use anyhow::Result;
use serde_json::{json, Value};

use crate::{present::live, record::Summary};

pub fn text(out: &mut impl Write, s: &Summary) -> Result<()> {
    let c = &s.counters;
    writeln!(
        out,
        "session {}: {:.1}s, {} libraries, {} probes, {} processes",
        s.session,
        s.elapsed_s,
        s.libraries.len(),
        s.probes,
        s.stats.pids.len()
    )?;
    for line in live::op_table(&s.stats, Duration::from_secs_f64(s.elapsed_s)) {
        writeln!(out, "{line}")?;
    }
    writeln!(
        out,
        "events: {} submitted, {} read, {} stored; dropped (ring full): {}; unmatched returns: {}; decode errors: {}",
        c.submitted, c.events_read, c.events_stored, c.dropped_ring_full, c.unmatched_returns, c.decode_errors
    )?;
    if c.dropped_ring_full > 0 {
        writeln!(
            out,
            "warning: {} events were lost because the ring buffer was full: raise --ring-size",
            c.dropped_ring_full
        )?;
    }
    if c.alloc_map_full > 0 {
        writeln!(out, "warning: {} allocations were not tracked (allocation map full): their frees lack a size", c.alloc_map_full)?;
    }
    writeln!(out, "database: {}", s.db.display())?;
    Ok(())
}

/// The summary as one JSON record (`"event": "summary"`), with the per-op figures.
pub fn json(s: &Summary) -> Value {
    let ops: Vec<Value> = s
        .stats
        .ops
        .iter()
        .map(|(op, o)| {
            json!({
                "op": op.name(), "calls": o.calls, "errors": o.errors, "bytes": o.bytes,
                "p50_ns": o.latency.quantile(0.5), "p99_ns": o.latency.quantile(0.99), "max_ns": o.max_ns,
            })
        })
        .collect();
    let mut value = serde_json::to_value(s).unwrap_or(Value::Null);
    if let Value::Object(map) = &mut value {
        map.insert("event".into(), "summary".into());
        map.insert("processes".into(), json!(s.stats.pids));
        map.insert("ops".into(), Value::Array(ops));
    }
    value
}
