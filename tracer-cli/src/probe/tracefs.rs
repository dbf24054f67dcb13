//! The tracefs mount and its tracepoints' format files: the scheduler's and the openat
//! programs read their records' fields at the offsets these give.

use std::path::Path;

const TRACEFS: [&str; 2] = ["/sys/kernel/tracing", "/sys/kernel/debug/tracing"];

/// The tracefs mount, mounting it at /sys/kernel/tracing when missing (classic tracepoints are
/// attached by the id their tracefs entry gives).
pub fn tracefs() -> Result<&'static str, String> {
    if let Some(dir) = TRACEFS
        .iter()
        .find(|d| Path::new(d).join("events").is_dir())
    {
        return Ok(dir);
    }
    let status = std::process::Command::new("mount")
        .args(["-t", "tracefs", "nodev", TRACEFS[0]])
        .status()
        .map_err(|e| format!("mount tracefs: {e}"))?;
    if status.success() && Path::new(TRACEFS[0]).join("events").is_dir() {
        eprintln!(
            "tracer: mounted tracefs at {} (needed by the scheduler tracepoints)",
            TRACEFS[0]
        );
        Ok(TRACEFS[0])
    } else {
        Err(format!(
            "tracefs is not mounted and `mount -t tracefs nodev {}` failed",
            TRACEFS[0]
        ))
    }
}

/// Offset of `field` in a tracepoint format file ("field:pid_t prev_pid;\toffset:24;...").
pub fn field_offset(format: &str, field: &str) -> Option<u32> {
    format.lines().find_map(|line| {
        let decl = line.trim().strip_prefix("field:")?;
        let (name_part, rest) = decl.split_once(';')?;
        let name = name_part.rsplit([' ', '*']).next()?.split('[').next()?;
        if name != field {
            return None;
        }
        rest.trim()
            .strip_prefix("offset:")?
            .split(';')
            .next()?
            .parse()
            .ok()
    })
}
