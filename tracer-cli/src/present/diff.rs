//! `tracer diff` as text: the two runs side by side, then the call sites that changed most.

use std::io::Write;

use anyhow::Result;

use crate::{query::diff::Diff, units::format_bytes};

fn change(a: u64, b: u64) -> String {
    if a == 0 {
        return String::new();
    }
    format!("{:+.1} %", (b as f64 - a as f64) * 100.0 / a as f64)
}

fn at(s: Option<f64>) -> String {
    s.map_or("never".to_owned(), |s| format!("after {s:.1} s"))
}

pub fn text(out: &mut impl Write, d: &Diff) -> Result<()> {
    let (a, b) = (&d.a, &d.b);
    let conf = |c: &str| {
        if c.is_empty() {
            "defaults".to_owned()
        } else {
            c.to_owned()
        }
    };
    writeln!(
        out,
        "A: session {} pid {} ({}), {} requests\nB: session {} pid {} ({}), {} requests",
        a.session, a.pid, a.command, a.requests, b.session, b.pid, b.command, b.requests
    )?;
    writeln!(out, "{:<22} {:>16} {:>16} {:>10}", "", "A", "B", "change")?;
    let rows = [
        ("peak allocated", a.peak_allocated, b.peak_allocated),
        ("peak reserved", a.peak_reserved, b.peak_reserved),
        ("peak cached", a.peak_cached, b.peak_cached),
    ];
    for (what, x, y) in rows {
        writeln!(
            out,
            "{what:<22} {:>16} {:>16} {:>10}",
            format_bytes(x),
            format_bytes(y),
            change(x, y)
        )?;
    }
    writeln!(
        out,
        "{:<22} {:>15.0}% {:>15.0}%",
        "worst fragmentation",
        a.worst_fragmentation * 100.0,
        b.worst_fragmentation * 100.0
    )?;
    writeln!(
        out,
        "{:<22} {:>16} {:>16}",
        "first early warning",
        at(a.first_warning_s),
        at(b.first_warning_s)
    )?;
    writeln!(
        out,
        "{:<22} {:>16} {:>16}",
        "first OOM",
        at(a.first_oom_s),
        at(b.first_oom_s)
    )?;
    writeln!(
        out,
        "{:<22} {:>16} {:>16}",
        "allocator settings",
        conf(&a.conf),
        conf(&b.conf)
    )?;
    if d.sites.is_empty() {
        return Ok(());
    }
    writeln!(out, "\nCall sites whose peak held bytes changed most:")?;
    for s in &d.sites {
        writeln!(
            out,
            "  {}: {} -> {} ({})",
            s.site,
            format_bytes(s.a),
            format_bytes(s.b),
            if s.b >= s.a {
                format!("+{}", format_bytes(s.b - s.a))
            } else {
                format!("-{}", format_bytes(s.a - s.b))
            }
        )?;
    }
    Ok(())
}
