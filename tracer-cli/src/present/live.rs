//! The live table `tracer trace` shows on stderr, and the summary it prints at the end.

use std::{io::Write, time::Duration};

use tracer_common::OpClass;

use crate::{
    model::{live::AllocatorRow, stats::LiveStats},
    store::SessionCounters,
    units::{format_bytes, format_ns},
};

pub struct Status<'a> {
    pub elapsed: Duration,
    pub libraries: usize,
    pub probes: usize,
    pub stats: &'a LiveStats,
    pub counters: &'a SessionCounters,
    pub allocators: &'a [AllocatorRow],
}

fn thousands(n: u64) -> String {
    let s = n.to_string();
    let mut out = String::with_capacity(s.len() + s.len() / 3);
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

pub fn headline(s: &Status<'_>) -> String {
    let c = s.counters;
    format!(
        "tracer {:>5}s | {} libraries, {} probes | {} processes | {} events | dropped {} | unmatched returns {}",
        s.elapsed.as_secs(),
        s.libraries,
        s.probes,
        s.stats.processes(),
        thousands(s.stats.events),
        thousands(c.dropped_ring_full),
        thousands(c.unmatched_returns),
    )
}

/// The per-op table: calls, rate, p50, p99, max, bytes, errors.
pub fn op_table(stats: &LiveStats, elapsed: Duration) -> Vec<String> {
    let secs = elapsed.as_secs_f64().max(1e-9);
    // As wide as the longest name shown (cudaThreadExchangeStreamCaptureMode is 35).
    let w = stats
        .ops
        .keys()
        .map(|op| op.name().len())
        .max()
        .unwrap_or(0)
        .max(26);
    let mut lines = vec![format!(
        "{:<w$} {:>12} {:>9} {:>9} {:>9} {:>9} {:>11} {:>8}",
        "OP", "CALLS", "RATE/s", "P50", "P99", "MAX", "BYTES", "ERRORS"
    )];
    for (op, s) in &stats.ops {
        // The allocator's probes mark instants: they have no duration.
        let timed = !matches!(
            op.spec().class,
            OpClass::BlockAlloc | OpClass::BlockFree | OpClass::Oom
        );
        let time = |ns: u64| if timed { format_ns(ns) } else { "-".to_owned() };
        lines.push(format!(
            "{:<w$} {:>12} {:>9.0} {:>9} {:>9} {:>9} {:>11} {:>8}",
            op.name(),
            thousands(s.calls),
            s.calls as f64 / secs,
            time(s.latency.quantile(0.5)),
            time(s.latency.quantile(0.99)),
            time(s.max_ns),
            format_bytes(s.bytes),
            thousands(s.errors),
        ));
    }
    lines
}

/// The allocators' table: per process and device, allocated, reserved, fragmentation, the
/// largest free block and the largest request of the last interval. Empty when no process
/// holds device memory.
pub fn allocator_table(rows: &[AllocatorRow]) -> Vec<String> {
    if rows.is_empty() {
        return Vec::new();
    }
    let mut lines = vec![format!(
        "{:<8} {:<10} {:>3} {:>10} {:>10} {:>6} {:>11} {:>11} {:>10}  VIEW",
        "PID",
        "RANK",
        "DEV",
        "ALLOCATED",
        "RESERVED",
        "FRAG",
        "LARGEST-FREE",
        "OUTSIDE",
        "LARGEST-REQ"
    )];
    for r in rows {
        let blocks = r.view == "blocks";
        let measured = |text: String| if blocks { text } else { "-".to_owned() };
        lines.push(format!(
            "{:<8} {:<10} {:>3} {:>10} {:>10} {:>6} {:>11} {:>11} {:>10}  {}",
            r.pid,
            r.rank.as_deref().unwrap_or("-"),
            r.device,
            measured(format_bytes(r.stats.allocated)),
            format_bytes(r.stats.reserved),
            measured(format!("{:.0}%", r.fragmentation * 100.0)),
            measured(format_bytes(r.stats.largest_free)),
            measured(format_bytes(r.outside)),
            format_bytes(r.largest_request),
            r.view,
        ));
    }
    lines
}

/// Redraws the table in place on a terminal.
pub struct LiveView {
    tty: bool,
    drawn: usize,
    ticks: u64,
}

impl LiveView {
    pub fn new(tty: bool) -> Self {
        LiveView {
            tty,
            drawn: 0,
            ticks: 0,
        }
    }

    pub fn draw(&mut self, status: &Status<'_>) {
        self.ticks += 1;
        if !self.tty {
            // Redirected output: a status line every 10 s keeps logs readable.
            if self.ticks % 10 == 1 {
                let _ = writeln!(std::io::stderr().lock(), "{}", headline(status));
            }
            return;
        }
        let mut lines = vec![headline(status)];
        lines.extend(op_table(status.stats, status.elapsed));
        lines.extend(allocator_table(status.allocators));
        self.redraw(&lines);
    }

    /// Replaces the lines drawn last with `lines` (on a terminal), or prints them.
    pub fn redraw(&mut self, lines: &[String]) {
        let mut out = String::new();
        if self.tty && self.drawn > 0 {
            out.push_str(&format!("\x1b[{}F\x1b[J", self.drawn));
        }
        for l in lines {
            out.push_str(l);
            out.push('\n');
        }
        self.drawn = if self.tty { lines.len() } else { 0 };
        let _ = std::io::stderr().lock().write_all(out.as_bytes());
    }

    /// Erases the lines drawn last, so that other output can follow the table's place.
    pub fn clear(&mut self) {
        if self.tty && self.drawn > 0 {
            let _ = write!(std::io::stderr().lock(), "\x1b[{}F\x1b[J", self.drawn);
        }
        self.drawn = 0;
    }

    pub fn is_tty(&self) -> bool {
        self.tty
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn thousands_separators() {
        assert_eq!(super::thousands(0), "0");
        assert_eq!(super::thousands(1234567), "1,234,567");
        assert_eq!(super::thousands(100), "100");
    }
}
