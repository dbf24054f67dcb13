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
        s.stats.processes()
    )?;
    for line in live::op_table(&s.stats, Duration::from_secs_f64(s.elapsed_s)) {
        writeln!(out, "{line}")?;
    }
    for line in live::allocator_table(&s.allocators) {
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
    if c.tail_call_failed > 0 {
        writeln!(
            out,
            "warning: {} events were lost because the call-site program could not be reached (a failed tail call; not the ring's size)",
            c.tail_call_failed
        )?;
    }
    if c.events_late > 0 {
        writeln!(
            out,
            "warning: {} events reached tracer after events made later than them and are stored after those (their program was held off its CPU longer than the reader waits, 2 ms): a free among them may lack its allocation's size",
            c.events_late
        )?;
    }
    if c.calls_abandoned > 0 {
        writeln!(
            out,
            "warning: {} calls were abandoned: their thread exited, or they were still in progress after the stop, before they returned",
            c.calls_abandoned
        )?;
    }
    if c.calls_before_interpreter > 0 {
        writeln!(
            out,
            "warning: {} calls of Python processes were made before tracer registered their interpreter: they have no Python frames",
            c.calls_before_interpreter
        )?;
    }
    if c.mappings_lost > 0 {
        writeln!(
            out,
            "warning: {} records of processes' new mappings were lost (a full side-band ring): native frames in them may stay unresolved",
            c.mappings_lost
        )?;
    }
    if c.map_insert_failed > 0 {
        writeln!(
            out,
            "warning: {} kernel map entries could not be stored (a full map): followed threads, off-CPU intervals or interpreter states are missing",
            c.map_insert_failed
        )?;
    }
    if c.alloc_map_full > 0 {
        writeln!(out, "warning: {} allocations were not tracked (allocation map full): their frees lack a size", c.alloc_map_full)?;
    }
    for run in &s.on_warning {
        writeln!(out, "{}", run.note("--on-warning"))?;
    }
    if s.keyframes.written > 0 {
        writeln!(
            out,
            "keyframes: {} written, {:.3} s of CPU",
            s.keyframes.written, s.keyframes.cpu_s
        )?;
    }
    if let Some(d) = s
        .discovery
        .as_ref()
        .filter(|d| d.held + d.unseen + d.lost > 0)
    {
        writeln!(
            out,
            "discovery: {} process(es) stopped until their CUDA library was probed (longest {:.1} ms); {} found late or never traced; {} library opens not told",
            d.held,
            d.held_max_us as f64 / 1e3,
            d.unseen,
            d.lost
        )?;
    }
    for p in &s.programs {
        writeln!(
            out,
            "program {}: {} runs, {:.0} ns a run",
            p.name, p.runs, p.ns_per_run
        )?;
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
        map.insert("processes".into(), json!(s.stats.pid_list()));
        map.insert("ops".into(), Value::Array(ops));
    }
    value
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{model::stats::LiveStats, store::SessionCounters};
    use tracer_common::Op;

    fn summary(dropped: u64, map_full: u64) -> Summary {
        let mut stats = LiveStats::default();
        stats.add_one(7, Op::CudaMalloc, 0, Some(4096), 1500);
        stats.add_one(7, Op::CudaFree, 0, Some(4096), 700);
        Summary {
            session: 3,
            db: "/tmp/t.db".into(),
            status: "interrupted",
            reason: "interrupted (SIGINT)".into(),
            elapsed_s: 2.0,
            probes: 4,
            libraries: Vec::new(),
            programs: Vec::new(),
            allocators: Vec::new(),
            on_warning: Vec::new(),
            dumps: None,
            discovery: None,
            kernel_maps: Default::default(),
            keyframes: Default::default(),
            allocator: Default::default(),
            counters: SessionCounters {
                submitted: 2,
                events_read: 2,
                events_stored: 2,
                dropped_ring_full: dropped,
                alloc_map_full: map_full,
                ..Default::default()
            },
            stats,
        }
    }

    #[test]
    fn text_counts_every_loss_and_says_what_to_do() {
        let mut out = Vec::new();
        text(&mut out, &summary(5, 1)).unwrap();
        let out = String::from_utf8(out).unwrap();
        assert!(
            out.starts_with("session 3: 2.0s, 0 libraries, 4 probes, 1 processes"),
            "{out}"
        );
        assert!(
            out.contains("events: 2 submitted, 2 read, 2 stored; dropped (ring full): 5"),
            "{out}"
        );
        assert!(
            out.contains("5 events were lost because the ring buffer was full: raise --ring-size"),
            "{out}"
        );
        assert!(out.contains("1 allocations were not tracked"), "{out}");
        // A failed tail call is its own loss, without the ring's advice.
        let mut failed = summary(0, 0);
        failed.counters.tail_call_failed = 3;
        let mut out = Vec::new();
        text(&mut out, &failed).unwrap();
        let out = String::from_utf8(out).unwrap();
        assert!(
            out.contains("3 events were lost because the call-site program could not be reached"),
            "{out}"
        );
        assert!(!out.contains("--ring-size"), "{out}");
        assert_eq!(json(&failed)["counters"]["tail_call_failed"], 3);
        let mut clean = Vec::new();
        text(&mut clean, &summary(0, 0)).unwrap();
        assert!(!String::from_utf8(clean).unwrap().contains("warning"));
    }

    #[test]
    fn json_carries_the_session_ops_and_counters() {
        let v = json(&summary(5, 0));
        assert_eq!(v["event"], "summary");
        assert_eq!(v["session"], 3);
        assert_eq!(v["status"], "interrupted");
        assert_eq!(v["counters"]["dropped_ring_full"], 5);
        assert_eq!(v["processes"], serde_json::json!([7]));
        let ops = v["ops"].as_array().unwrap();
        assert_eq!(ops.len(), 2);
        assert_eq!(ops[0]["op"], "cudaMalloc");
        assert_eq!(ops[0]["bytes"], 4096);
    }
}
