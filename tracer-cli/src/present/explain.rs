//! `tracer explain`'s report as text (its JSON is the report itself, serialized).

use std::io::Write;

use anyhow::Result;

use crate::{
    analysis::Explanation,
    query::explain::Explained,
    units::{bytes_column, format_bytes, format_ns, format_utc},
};

/// The report as text: the window, per-process tables (`per_process`), the top call sites and
/// the causal chains with their evidence.
pub fn text(out: &mut impl Write, explained: &Explained, per_process: bool) -> Result<()> {
    let r = &explained.report;
    let ends = if explained.to_given {
        "the time asked"
    } else if explained.running {
        "now: the trace is still running"
    } else {
        "the session's last event"
    };
    writeln!(
        out,
        "Session {}: {} .. {} ({:.0}s, ending at {ends}); {} calls in the window{}",
        r.session,
        format_utc(r.window.from_ns),
        format_utc(r.window.to_ns),
        r.window.secs(),
        r.events_in_window,
        if r.untimed {
            "; the snapshot has no times (an older PyTorch): its entries are in order only, so rates, latencies and bursts are not assessed"
        } else if r.host_context && r.host_while_armed {
            "; host context only while a process's allocator probes were armed (--allocator auto): CPU contention is assessed for the calls made then"
        } else if r.host_context {
            ""
        } else {
            "; no scheduler record (host context), so CPU contention is not assessed"
        }
    )?;
    coverage(out, r)?;
    arming(out, r, &explained.messages)?;
    if per_process {
        process_tables(out, r)?;
    }
    call_sites(out, r)?;
    devices(out, r)?;
    holders(out, r)?;
    writeln!(out)?;
    chains(out, r)
}

/// Rows of arming shown at most; the rest are counted.
const ARMING_ROWS: usize = 12;

/// When PyTorch's allocator probes were armed (`--allocator auto`), and what that means for
/// each out-of-memory: before the probes were armed, the layout was not known.
fn arming(
    out: &mut impl Write,
    r: &Explanation,
    messages: &[crate::model::MessageRow],
) -> Result<()> {
    use crate::model::arming::armed_at;
    if r.arming.is_empty() {
        return Ok(());
    }
    let armings = r.arming.iter().filter(|a| a.armed).count();
    writeln!(
        out,
        "PyTorch's allocator probes (--allocator auto): armed {armings} time(s); the block layout is known only while armed, and then only in segments made after arming"
    )?;
    let skipped = r.arming.len().saturating_sub(ARMING_ROWS);
    if skipped > 0 {
        writeln!(out, "  ({skipped} earlier change(s) not shown)")?;
    }
    for a in &r.arming[skipped..] {
        let figures = if a.total > 0 {
            format!(
                " ({} of {})",
                crate::units::format_bytes(a.held),
                crate::units::format_bytes(a.total)
            )
        } else {
            String::new()
        };
        writeln!(
            out,
            "  pid {} {} {}{figures}",
            a.pid,
            format_utc(a.ts_ns),
            a.says()
        )?;
    }
    for m in messages
        .iter()
        .filter(|m| m.op == tracer_common::Op::TorchOom.name())
    {
        let said = match armed_at(&r.arming, m.pid, m.ts_ns) {
            None => continue,
            Some(a) if !a.armed => "came while the probes were not armed: the request, allocated and reserved come from PyTorch's message and the CUDA calls; the block layout was not known (an OOM arms the probes for what follows; `--allocator always` sees it from the start)".to_owned(),
            Some(a) => format!(
                "came with the probes armed since {}: segments made before then have unknown contents, never counted free",
                format_utc(a.ts_ns)
            ),
        };
        writeln!(
            out,
            "  the out-of-memory of pid {} at {} {said}",
            m.pid,
            format_utc(m.ts_ns)
        )?;
    }
    Ok(())
}

/// Who held the GPU at each out-of-memory, in one line each.
fn holders(out: &mut impl Write, r: &Explanation) -> Result<()> {
    if r.holders.is_empty() {
        return Ok(());
    }
    writeln!(out)?;
    writeln!(out, "Who held the GPU at the out-of-memory:")?;
    for h in &r.holders {
        writeln!(
            out,
            "  pid {} at {}: {}",
            h.pid,
            format_utc(h.at_ns),
            h.split_said()
        )?;
    }
    Ok(())
}

fn coverage(out: &mut impl Write, r: &Explanation) -> Result<()> {
    for line in r.coverage.lines(r.window) {
        writeln!(out, "{line}")?;
    }
    Ok(())
}

/// Ranks and devices side by side, when there are several or they carry ranks.
fn devices(out: &mut impl Write, r: &Explanation) -> Result<()> {
    if r.devices.len() < 2 && r.devices.iter().all(|d| d.rank.is_none()) {
        return Ok(());
    }
    let outlier = r
        .chains
        .iter()
        .find(|c| c.rule == crate::analysis::Rule::RankOutlier)
        .map(|c| c.pid);
    writeln!(out)?;
    writeln!(out, "Ranks and devices (peaks in the window):")?;
    for d in &r.devices {
        let measured = if d.unknown {
            " | not fully seen (see the unknown_state chain): peaks not compared".to_owned()
        } else if d.view == "blocks" {
            format!(
                " | allocated {} | reserved {} | fragmentation {:.0}%",
                format_bytes(d.peak_allocated),
                format_bytes(d.peak_reserved),
                d.fragmentation * 100.0
            )
        } else {
            " | segments view (no allocator probes)".to_owned()
        };
        let forced = match d.forced_segments {
            0 => String::new(),
            n => format!(" | {n} segments forced ({})", format_bytes(d.forced_bytes)),
        };
        let failures = match d.failures {
            0 => String::new(),
            n => format!(
                " | {} failed: {} retried, {} raised",
                plural(n, "allocation"),
                d.retries,
                plural(d.ooms, "OOM")
            ),
        };
        let mark = if outlier == Some(d.pid) {
            "  <- outlier"
        } else {
            ""
        };
        writeln!(
            out,
            "  {:<32} held {}{measured}{forced}{failures}{mark}",
            d.who(),
            format_bytes(d.peak_held)
        )?;
    }
    Ok(())
}

/// "1 allocation", "2 allocations".
fn plural(n: u64, what: &str) -> String {
    if n == 1 {
        format!("1 {what}")
    } else {
        format!("{n} {what}s")
    }
}

/// Per process: each op's calls, latency and bytes, outstanding allocations, warnings.
fn process_tables(out: &mut impl Write, r: &Explanation) -> Result<()> {
    for p in &r.processes {
        writeln!(out)?;
        writeln!(
            out,
            "Process: {} (PID {})",
            p.comm.as_deref().unwrap_or("?"),
            p.pid
        )?;
        for op in &p.ops {
            let bytes = bytes_column(op.bytes);
            let errors = if op.errors > 0 {
                format!(" | {} errors", op.errors)
            } else {
                String::new()
            };
            // The allocator's probes mark instants: no latency to show.
            let latency = if op.max_ns == 0 {
                String::new()
            } else {
                format!(
                    " | p50={} | p99={} | max={}",
                    format_ns(op.p50_ns),
                    format_ns(op.p99_ns),
                    format_ns(op.max_ns)
                )
            };
            writeln!(
                out,
                "  {:<24} | {:>8} calls{latency}{bytes}{errors}",
                op.op, op.calls
            )?;
        }
        for o in &p.outstanding {
            writeln!(
                out,
                "  outstanding at the end: {} x{} ({})",
                o.op,
                o.count,
                format_bytes(o.bytes)
            )?;
        }
        for w in &p.warnings {
            writeln!(out, "  ! {w}")?;
        }
    }
    Ok(())
}

/// The busiest call sites of each op (--stack sessions).
fn call_sites(out: &mut impl Write, r: &Explanation) -> Result<()> {
    let mut current_op = None;
    for row in &r.call_sites {
        if current_op != Some((row.op, row.pid)) {
            current_op = Some((row.op, row.pid));
            writeln!(out)?;
            writeln!(out, "Top {} call sites (pid {}):", row.op, row.pid)?;
        }
        let bytes = bytes_column(row.bytes);
        // Point events (PyTorch's probes) and imported snapshots have no durations.
        let latency = if row.p99_ns == 0 {
            String::new()
        } else {
            format!(
                " | avg {} | p99 {}",
                format_ns(row.avg_ns),
                format_ns(row.p99_ns)
            )
        };
        writeln!(
            out,
            "  {} -> {} | {} calls{bytes}{latency}",
            row.site, row.op, row.calls,
        )?;
    }
    Ok(())
}

/// The causal chains, most severe first, with their evidence.
fn chains(out: &mut impl Write, r: &Explanation) -> Result<()> {
    if r.chains.is_empty() && r.coverage.window_evicted {
        writeln!(
            out,
            "No causal chain is drawn: every call of this window was evicted, so nothing is known of its calls beyond the series above. \
             A larger --max-db, or a window within the detail kept around incidents, would settle it."
        )?;
        return Ok(());
    }
    if r.chains.is_empty() {
        writeln!(
            out,
            "No causal chain: the calls in this window show no latency growth, fragmentation, allocator retry, \
             out-of-memory, leak, churn, driver bypass, synchronisation stall or periodic spike."
        )?;
        return Ok(());
    }
    writeln!(out, "Causal chains ({}):", r.chains.len())?;
    for c in &r.chains {
        writeln!(out, "{}", "-".repeat(72))?;
        writeln!(out, "[{:?}] {}  (pid {})", c.severity, c.title, c.pid)?;
        writeln!(out, "  Root:        {}", c.root)?;
        writeln!(out, "  Effect:      {}", c.effect)?;
        for comp in &c.compounding {
            writeln!(out, "  Compounding: {comp}")?;
        }
        if !c.timeline.is_empty() {
            writeln!(out, "  Timeline:")?;
            for e in &c.timeline {
                let rel = (e.ts_ns - r.window.from_ns) as f64 / 1e9;
                writeln!(out, "    +{rel:>8.3}s  {}", e.text)?;
            }
        }
        for (i, f) in c.fix.iter().enumerate() {
            writeln!(
                out,
                "  {}{f}",
                if i == 0 {
                    "Fix:         "
                } else {
                    "             "
                }
            )?;
        }
        writeln!(out, "  Evidence:    {}", c.evidence)?;
    }
    Ok(())
}
