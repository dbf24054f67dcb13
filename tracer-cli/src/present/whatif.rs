//! `tracer whatif` as text: the recorded run, whether the simulator reproduces it (said before
//! any figure), then one line per setting.

use std::io::Write;

use anyhow::Result;

use crate::{query::whatif::WhatIf, units::format_bytes};

/// Sizes in the table: GiB to two decimals (the settings often differ by less than a tenth).
fn size(bytes: u64) -> String {
    const GIB: f64 = (1u64 << 30) as f64;
    if bytes as f64 >= GIB {
        format!("{:.2} GiB", bytes as f64 / GIB)
    } else {
        format_bytes(bytes)
    }
}

pub fn text(out: &mut impl Write, w: &WhatIf) -> Result<()> {
    let conf = if w.recorded_conf.is_empty() {
        "PyTorch's defaults".to_owned()
    } else {
        format!("PYTORCH_CUDA_ALLOC_CONF={}", w.recorded_conf)
    };
    writeln!(
        out,
        "Session {}, pid {}, device {}: {} requests ({} allocations), run with {conf}; {} OOMs recorded, peak reserved {}.",
        w.session,
        w.pid,
        w.device,
        w.requests,
        w.mallocs,
        w.recorded_ooms,
        size(w.recorded_peak_reserved)
    )?;
    match w.capacity {
        Some(c) => writeln!(out, "The allocator could hold {} on that device ({}).", size(c), w.capacity_source)?,
        None => writeln!(out, "The device's capacity is unknown (no cudaMemGetInfo and no refused request): simulated without a limit; 'least memory' still holds.")?,
    }
    if w.seeded_blocks > 0 {
        writeln!(
            out,
            "The requests begin with {} blocks already live (a keyframe's, or the state a snapshot's trace rebuilt).",
            w.seeded_blocks
        )?;
    }
    fidelity(out, w)?;
    writeln!(
        out,
        "{:<52} {:>14} {:>14} {:>12} {:>8} {:>8} {:>13}",
        "settings", "OOM", "peak reserved", "peak cached", "allocs", "retries", "least memory"
    )?;
    for r in &w.rows {
        let label = match (r.recorded_settings, r.conf.is_empty()) {
            (true, true) => "(as run: defaults)".to_owned(),
            (true, false) => format!("(as run) {}", r.conf),
            (false, _) => r.conf.clone(),
        };
        let oom = r
            .oom_request
            .map_or("none".to_owned(), |i| format!("request {i}"));
        writeln!(
            out,
            "{label:<52} {oom:>14} {:>14} {:>12} {:>8} {:>8} {:>13}",
            size(r.peak_reserved),
            size(r.peak_cached),
            r.device_allocs,
            r.retries,
            r.least_memory.map_or("-".to_owned(), size)
        )?;
    }
    if let Some(r) = &w.without_graphs {
        writeln!(
            out,
            "Without CUDA graphs, as run otherwise (an estimate: the eager requests the graphs' replays stand in for were never made, so they are not in it): OOM {}, peak reserved {}, peak cached {}.",
            r.oom_request.map_or("none".to_owned(), |i| format!("at request {i}")),
            size(r.peak_reserved),
            size(r.peak_cached)
        )?;
    }
    Ok(())
}

fn fidelity(out: &mut impl Write, w: &WhatIf) -> Result<()> {
    let f = &w.fidelity;
    let share = 100.0 * f.placements_matched as f64 / f.placements.max(1) as f64;
    if f.holds {
        writeln!(
            out,
            "Fidelity: with the recorded settings the simulator makes the same {} device allocations and places {} of {} blocks where the allocator did ({share:.1} %).",
            f.device_allocs_recorded, f.placements_matched, f.placements
        )?;
        return Ok(());
    }
    writeln!(
        out,
        "Fidelity NOT met: the simulator does not reproduce this run, so the figures below are the simulator's, not a prediction for this job."
    )?;
    if let Some((i, rec, sim)) = f.first_device_divergence {
        writeln!(
            out,
            "  device allocation #{i}: recorded {}, simulated {} ({} recorded, {} simulated in all)",
            format_bytes(rec),
            format_bytes(sim),
            f.device_allocs_recorded,
            f.device_allocs_simulated
        )?;
    }
    writeln!(
        out,
        "  placements: {} of {} agree ({share:.1} %, {:.0} % needed){}",
        f.placements_matched,
        f.placements,
        100.0 * f.required_share,
        f.first_placement_divergence
            .map(|(i, a, b)| format!(
                "; the first that differs is allocation #{i}: {a:#x} recorded, {b:#x} simulated"
            ))
            .unwrap_or_default()
    )?;
    Ok(())
}
