//! The serving engine's start-up ledger as a chain: what each phase took (analysis/startup.rs
//! measures it), the engine's own budget where its command line gives one, and which way to
//! move the budget, with the figures the move rests on.

use super::{entry, Chain, Fix, Rule, Severity};
use crate::{analysis::startup::Ledger, units::format_bytes as b};

/// The chain of a process that captured CUDA graphs at start-up.
pub fn startup_chain(pid: u32, l: &Ledger) -> Option<Chain> {
    if l.captures.is_empty() {
        return None;
    }
    let captured = l.captures.iter().filter(|c| c.end_ns.is_some()).count();
    let graphs: u64 = l.captures.iter().map(|c| c.pool_grew).sum();
    let warmup: i64 = l.captures.iter().map(|c| c.default_grew).sum();
    let title = match l.failed_in_capture {
        Some(asked) => format!(
            "serving start-up ran out of memory during capture {} of the graphs (device {}): {} asked with {} free",
            l.captures.len(),
            l.device,
            b(asked),
            l.device_free.map_or("an unknown amount".into(), b)
        ),
        None => format!(
            "serving start-up (device {}): {captured} graph captures took {} in private pools",
            l.device,
            b(graphs)
        ),
    };
    Some(Chain {
        rule: Rule::StartupLedger,
        severity: if l.failed_in_capture.is_some() {
            Severity::High
        } else {
            Severity::Low
        },
        pid,
        title,
        root: phases(l, graphs, warmup),
        effect: budget_said(l, graphs),
        compounding: Vec::new(),
        timeline: l
            .captures
            .iter()
            .enumerate()
            .map(|(i, c)| {
                entry(
                    c.begin_ns,
                    match c.end_ns {
                        Some(_) => format!(
                            "capture {}: the private pools grew {}, the default pools {}",
                            i + 1,
                            b(c.pool_grew),
                            signed(c.default_grew)
                        ),
                        None => format!("capture {} began and did not end", i + 1),
                    },
                )
            })
            .collect(),
        fix: fixes(l),
        evidence: format!(
            "{} capture(s) seen ({} ended); phases told apart by the calls: the last cache flush before the first capture{}, the first capture, the last capture",
            l.captures.len(),
            captured,
            if l.resident.is_some() { "" } else { " (none here)" }
        ),
    })
}

fn signed(v: i64) -> String {
    if v < 0 {
        format!("-{}", b(v.unsigned_abs()))
    } else {
        b(v as u64)
    }
}

/// The phases, in order.
fn phases(l: &Ledger, graphs: u64, warmup: i64) -> String {
    let mut parts = Vec::new();
    match (l.resident, l.peak_before_flush) {
        (Some(resident), Some(peak)) => {
            parts.push(format!(
                "held through the cache flush before the captures (the weights and what stays): {}",
                b(resident)
            ));
            parts.push(format!(
                "before that flush the cache peaked {} above it (a profiling pass)",
                b(peak.saturating_sub(resident))
            ));
            match (l.resident_allocated, l.allocated_before_captures) {
                (Some(held), Some(now)) => parts.push(format!(
                    "allocated after the flush and held at the first capture (the KV cache and the rest): {}; cached then beside it (warm-up runs' freed blocks): {}",
                    b(now.saturating_sub(held)),
                    b(l.before_captures.saturating_sub(now))
                )),
                _ => parts.push(format!(
                    "reserved after the flush and held at the first capture (the KV cache, the rest, and cache): {}",
                    b(l.before_captures.saturating_sub(resident))
                )),
            }
        }
        _ => parts.push(format!(
            "held when the first capture began (the weights and the KV cache: no cache flush between them tells them apart): {}",
            b(l.before_captures)
        )),
    }
    parts.push(format!(
        "{} capture(s): the private pools took {}, the default pools grew {} meanwhile (warm-up runs)",
        l.captures.len(),
        b(graphs),
        signed(warmup)
    ));
    if l.outside > 0 {
        parts.push(format!("outside PyTorch's allocator: {}", b(l.outside)));
    }
    if let (Some(free), Some(total)) = (l.device_free, l.device_total) {
        parts.push(format!("the device then: {} free of {}", b(free), b(total)));
    }
    parts.join("; ")
}

/// The engine's budget beside what the phases took.
fn budget_said(l: &Ledger, graphs: u64) -> String {
    let Some(budget) = &l.budget else {
        return format!(
            "reserved {} after the start-up ({} of it the graphs' pools); the engine's budget is not on its command line (--gpu-memory-utilization, --mem-fraction-static, --kv-cache-memory-bytes)",
            b(l.after),
            b(graphs)
        );
    };
    let limit = match (budget.fraction, budget.bytes, l.device_total) {
        (Some(f), _, Some(total)) => format!(
            "{} {} of {} is {}",
            budget.option,
            f,
            b(total),
            b((f * total as f64) as u64)
        ),
        (Some(f), _, None) => format!("{} {f} (the device's capacity not read)", budget.option),
        (None, Some(bytes), _) => format!("{} {}", budget.option, b(bytes)),
        (None, None, _) => budget.option.clone(),
    };
    format!(
        "the engine's budget: {limit}; held before the captures {}, the graphs' pools {} beyond it, reserved {} after",
        b(l.before_captures),
        b(graphs),
        b(l.after)
    )
}

/// Which way to move the budget: down by what a failed capture lacked, or where the start-up
/// ended with room, what is left for the KV cache (the captures measured stay what they took).
fn fixes(l: &Ledger) -> Vec<Fix> {
    let Some(budget) = &l.budget else {
        return Vec::new();
    };
    let (Some(free), Some(total)) = (l.device_free, l.device_total) else {
        return Vec::new();
    };
    if total == 0 {
        return Vec::new();
    }
    let moved = |delta: i64| -> String {
        match (budget.fraction, budget.bytes) {
            (Some(f), _) => {
                let step = delta as f64 / total as f64;
                // Rounded away from the failure: down to the hundredth below, up to the one below.
                let to = ((f + step) * 100.0).floor() / 100.0;
                format!("{} {} (from {f})", budget.option, to.max(0.0))
            }
            (None, Some(bytes)) => format!(
                "{} {} (from {bytes})",
                budget.option,
                (bytes as i64 + delta).max(0)
            ),
            (None, None) => budget.option.clone(),
        }
    };
    match l.failed_in_capture {
        Some(asked) => {
            let short = asked.saturating_sub(free);
            vec![format!(
                "lower the budget by at least the {} the capture lacked: {}, so that the KV cache leaves the captures room",
                b(short),
                moved(-(short as i64))
            )
            .into()]
        }
        None => vec![format!(
            "the start-up left {} free: the budget may rise by up to that much for a larger KV cache ({}) with the graphs as measured; move it down by the activations' growth if requests later run out",
            b(free),
            moved(free as i64)
        )
        .into()],
    }
}
