//! `tracer stacks` as text: each call site with its merged native and Python frames.

use std::io::Write;

use anyhow::Result;

use crate::{store::events::StackSite, units::bytes_column};

pub fn text(out: &mut impl Write, stacks: &[StackSite]) -> Result<()> {
    for s in stacks {
        let bytes = bytes_column(s.bytes);
        writeln!(
            out,
            "{} x{}{bytes} | pid {} | python: {} | native frames: {}",
            s.op, s.calls, s.pid, s.python, s.native_depth
        )?;
        for f in &s.frames {
            let place = match (&f.file, f.line) {
                (Some(file), Some(line)) => format!("{file}:{line}"),
                (Some(file), None) => file.clone(),
                (None, _) => match (&f.module, f.address) {
                    (Some(m), Some(a)) => format!("{m}+{a:#x}"),
                    (Some(m), None) => m.clone(),
                    _ => "?".into(),
                },
            };
            writeln!(
                out,
                "    {:<6} {} ({place})",
                f.kind,
                f.function.as_deref().unwrap_or("??")
            )?;
        }
        writeln!(out)?;
    }
    Ok(())
}
