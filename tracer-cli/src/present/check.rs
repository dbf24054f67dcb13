//! `tracer check` as text.

use std::io::Write;

use anyhow::Result;

use crate::probe::check::CheckReport;

/// One line per check, its fix when it failed, then the libraries found.
pub fn text(out: &mut impl Write, report: &CheckReport, verbose: bool) -> Result<()> {
    for c in &report.checks {
        let mark = match (c.ok, c.required) {
            (true, _) => "ok  ",
            (false, true) => "FAIL",
            (false, false) => "warn",
        };
        writeln!(out, "[{mark}] {:<15} {}", c.name, c.detail)?;
        if let (false, Some(fix)) = (c.ok, &c.fix) {
            writeln!(out, "       fix: {fix}")?;
        }
    }
    for lib in &report.libraries {
        let pids: Vec<String> = lib.pids.iter().map(|p| p.to_string()).collect();
        let users = if pids.is_empty() {
            String::new()
        } else if verbose || pids.len() <= 5 {
            format!(" used by pid {}", pids.join(", "))
        } else {
            format!(" used by {} processes", pids.len())
        };
        writeln!(out, "       {} ({}){users}", lib.path, lib.origin)?;
    }
    Ok(())
}
