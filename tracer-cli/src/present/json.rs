//! JSON on stdout: whole documents (pretty) and records one per line (flushed at once, for a
//! program waiting on them).

use std::io::Write as _;

use anyhow::Result;
use serde::Serialize;

/// One value as an indented document.
pub fn document(value: &impl Serialize) -> Result<()> {
    let mut out = std::io::BufWriter::new(std::io::stdout().lock());
    serde_json::to_writer_pretty(&mut out, value)?;
    writeln!(out)?;
    out.flush()?;
    Ok(())
}

/// One value on its own line, flushed.
pub fn line(value: &impl Serialize) -> Result<()> {
    let mut out = std::io::stdout().lock();
    serde_json::to_writer(&mut out, value)?;
    writeln!(out)?;
    out.flush()?;
    Ok(())
}
