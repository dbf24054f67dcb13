//! `tracer explain`: what went wrong in a recorded session, why, where, and what to change.
//! Works without privileges on the database a trace left behind.

use std::{io::Write as _, path::PathBuf, time::Duration};

use anyhow::Result;
use clap::Args;

use crate::{
    analysis::{self, Report, Window},
    exit::user_error,
    paths,
    store::{events, Access, Store},
    units::{bytes_column, format_bytes, format_ns, parse_duration},
};

#[derive(Debug, Args)]
pub struct ExplainArgs {
    /// The database (default: ~/.local/share/tracer/tracer.db, or TRACER_DB).
    #[arg(long, env = paths::DB_ENV)]
    pub db: Option<PathBuf>,
    /// The session to explain (default: the latest).
    #[arg(long)]
    pub session: Option<i64>,
    /// Only the last part of the session (e.g. 300s), ending at its last event (or now, while
    /// the trace runs).
    #[arg(long, value_parser = parse_duration, conflicts_with_all = ["from", "to"])]
    pub since: Option<Duration>,
    /// Window start: Unix time in seconds (e.g. 1795323312.5) or nanoseconds.
    #[arg(long, value_parser = parse_time)]
    pub from: Option<i64>,
    /// Window end: Unix time in seconds or nanoseconds.
    #[arg(long, value_parser = parse_time)]
    pub to: Option<i64>,
    /// Only this process.
    #[arg(long)]
    pub pid: Option<u32>,
    /// Per-process tables: calls, latency, bytes, outstanding allocations, warnings.
    #[arg(long)]
    pub per_process: bool,
    /// Everything as JSON on stdout.
    #[arg(long)]
    pub json: bool,
    /// Frames whose file contains this are not the user's code when naming call sites
    /// (repeatable; site-packages, dist-packages and the standard library always are).
    #[arg(long = "skip-frames", value_name = "TEXT")]
    pub skip_frames: Vec<String>,
}

/// Seconds (with a fraction) or nanoseconds since the epoch; values above 1e12 are nanoseconds.
fn parse_time(text: &str) -> Result<i64, String> {
    // Nanoseconds do not fit an f64 exactly: take integers as they are.
    if let Ok(ns) = text.trim().parse::<i64>() {
        if ns > 1_000_000_000_000 {
            return Ok(ns);
        }
    }
    let v: f64 = text.trim().parse().map_err(|_| {
        format!("invalid time {text:?}: give Unix seconds (1795323312.5) or nanoseconds")
    })?;
    if !v.is_finite() || v < 0.0 {
        return Err(format!(
            "invalid time {text:?}: must be a positive Unix time"
        ));
    }
    Ok(if v > 1e12 { v as i64 } else { (v * 1e9) as i64 })
}

/// 2026-11-22 05:01:02.345 UTC.
pub fn format_utc(ns: i64) -> String {
    let secs = ns.div_euclid(1_000_000_000);
    let ms = ns.rem_euclid(1_000_000_000) / 1_000_000;
    let (days, rem) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02} {:02}:{:02}:{:02}.{ms:03} UTC",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

pub fn run(args: ExplainArgs) -> Result<()> {
    let path = paths::db_path(args.db.as_deref(), &paths::invoker())?;
    let store = Store::open(&path, Access::ReadOnly)?;
    let info = events::session(store.conn(), args.session)?;
    let running = info.status == "running";
    let t0 = std::time::Instant::now();
    // Everything up to --to (earlier calls tell which allocations are live); the session's own
    // span comes from the calls themselves.
    let all = events::load(&path, info.id, args.to.unwrap_or(i64::MAX), args.pid)?;
    let Some((first, last)) = analysis::span(&all) else {
        return Err(user_error(match (args.pid, args.to) {
            (Some(pid), _) => format!(
                "session {} recorded no calls of pid {pid}: nothing to explain",
                info.id
            ),
            (None, Some(_)) => format!(
                "session {} recorded no calls before --to: nothing to explain",
                info.id
            ),
            (None, None) => format!("session {} recorded no calls: nothing to explain", info.id),
        }));
    };
    let end = if running {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(last, |d| d.as_nanos() as i64)
    } else {
        last
    };
    let window = match (args.since, args.from, args.to) {
        (Some(since), _, _) => Window {
            from_ns: end - since.as_nanos() as i64,
            to_ns: end,
        },
        (None, from, to) => Window {
            from_ns: from.unwrap_or(first),
            to_ns: to.unwrap_or(end),
        },
    };
    if window.from_ns >= window.to_ns {
        return Err(user_error(format!(
            "empty window: --from {} is not before --to {}",
            format_utc(window.from_ns),
            format_utc(window.to_ns)
        )));
    }
    let comms = events::comms(store.conn(), info.id)?;
    let sites = events::site_labels(store.conn(), info.id, &args.skip_frames)?;
    let t1 = std::time::Instant::now();
    let host = events::host(store.conn(), info.id, window.to_ns, args.pid)?;
    let report = analysis::analyze(info.id, &all, &host, window, &comms, &sites);
    if std::env::var_os("TRACER_TIMING").is_some() {
        eprintln!("explain: load {:?}, analyze {:?}", t1 - t0, t1.elapsed());
    }
    let mut out = std::io::BufWriter::new(std::io::stdout().lock());
    if args.json {
        serde_json::to_writer_pretty(&mut out, &report)?;
        writeln!(out)?;
    } else {
        let ends = if running {
            "now: the trace is still running"
        } else {
            "the session's last event"
        };
        render(&mut out, &report, ends, args.per_process)?;
    }
    out.flush()?;
    Ok(())
}

fn render(out: &mut impl std::io::Write, r: &Report, ends: &str, per_process: bool) -> Result<()> {
    writeln!(
        out,
        "Session {}: {} .. {} ({:.0}s, ending at {ends}); {} calls in the window{}",
        r.session,
        format_utc(r.window.from_ns),
        format_utc(r.window.to_ns),
        r.window.secs(),
        r.events_in_window,
        if r.host_context {
            ""
        } else {
            "; no scheduler record (host context), so CPU contention is not assessed"
        }
    )?;
    if per_process {
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
                writeln!(
                    out,
                    "  {:<24} | {:>8} calls | p50={} | p99={} | max={}{bytes}{errors}",
                    op.op,
                    op.calls,
                    format_ns(op.p50_ns),
                    format_ns(op.p99_ns),
                    format_ns(op.max_ns)
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
    }
    let mut current_op = None;
    for row in &r.call_sites {
        if current_op != Some((row.op, row.pid)) {
            current_op = Some((row.op, row.pid));
            writeln!(out)?;
            writeln!(out, "Top {} call sites (pid {}):", row.op, row.pid)?;
        }
        let bytes = bytes_column(row.bytes);
        writeln!(
            out,
            "  {} -> {} | {} calls{bytes} | avg {} | p99 {}",
            row.site,
            row.op,
            row.calls,
            format_ns(row.avg_ns),
            format_ns(row.p99_ns)
        )?;
    }
    writeln!(out)?;
    if r.chains.is_empty() {
        writeln!(
            out,
            "No causal chain: the calls in this window show no fragmentation pressure, allocator retry, \
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

#[cfg(test)]
mod tests {
    #[test]
    fn utc_dates() {
        assert_eq!(super::format_utc(0), "1970-01-01 00:00:00.000 UTC");
        assert_eq!(
            super::format_utc(1_795_323_312_817_067_163),
            "2026-11-22 04:55:12.817 UTC"
        );
        assert_eq!(
            super::format_utc(951_782_400_000_000_000),
            "2000-02-29 00:00:00.000 UTC"
        );
    }

    #[test]
    fn times() {
        assert_eq!(
            super::parse_time("1795323312.5"),
            Ok(1_795_323_312_500_000_000)
        );
        assert_eq!(
            super::parse_time("1795323312817067163"),
            Ok(1_795_323_312_817_067_163)
        );
        assert!(super::parse_time("yesterday").is_err());
    }
}
