//! The host side: synchronisation stalls (rule 7) and CPU contention inside CUDA calls.

use std::collections::BTreeMap;

use super::{entry, Chain, Rule, Severity};
use crate::{
    analysis::{select_quantile, select_quantile_with_zeros, Event, Host, Window},
    units::format_ns as t,
};

/// Rule 7: time spent waiting in synchronisation calls.
pub(super) fn sync_stall(pid: u32, syncs: &[&Event], window: Window, host: &Host) -> Option<Chain> {
    if syncs.len() < 5 {
        return None;
    }
    let total: u64 = syncs.iter().map(|e| e.duration_ns).sum();
    let mut d: Vec<u64> = syncs.iter().map(|e| e.duration_ns).collect();
    let share = total as f64 / (window.secs() * 1e9);
    let p99 = select_quantile(&mut d, 0.99);
    if share < 0.10 && p99 < 10_000_000 {
        return None;
    }
    let worst = syncs.iter().max_by_key(|e| e.duration_ns)?;
    Some(Chain {
        rule: Rule::SyncStall,
        severity: if share >= 0.25 { Severity::High } else { Severity::Medium },
        pid,
        title: "host waits on the GPU -> synchronisation stalls".into(),
        root: format!(
            "{} synchronisation calls took {} ({:.0}% of the window), p50 {}, p99 {}",
            syncs.len(),
            t(total),
            share * 100.0,
            t(select_quantile(&mut d, 0.5)),
            t(p99)
        ),
        effect: "the training loop is blocked while the GPU drains its queue".into(),
        compounding: host.compounding(syncs, "synchronisation calls").into_iter().collect(),
        timeline: vec![entry(worst.ts_ns, format!("longest: {} {}", worst.op.name(), t(worst.duration_ns)))],
        fix: vec!["avoid host syncs in the loop (.item(), .cpu(), printing tensors); use non_blocking copies".into()],
        evidence: format!("{} synchronisation calls", syncs.len()),
    })
}

/// Host context: the process's slow CUDA calls spent a large share of their time waiting for a
/// CPU (their own threads runnable but not running), measured where the calls ran.
pub(super) fn cpu_contention(
    pid: u32,
    evs: &[Event],
    durations: (Vec<u64>, u64),
    host: &Host,
) -> Option<Chain> {
    let (mut d, zeros) = durations;
    if !host.recorded || d.len() as u64 + zeros < 20 {
        return None;
    }
    let threshold = select_quantile_with_zeros(&mut d, zeros, 0.95).max(100_000);
    let slow: Vec<&Event> = evs.iter().filter(|e| e.duration_ns >= threshold).collect();
    let o = host.during(&slow);
    if o.calls < 10 || o.call_ns == 0 || o.run_queue_ns * 5 < o.call_ns {
        return None;
    }
    let share = o.run_queue_ns as f64 / o.call_ns as f64;
    let mut ops: BTreeMap<&str, u64> = BTreeMap::new();
    for e in slow.iter().filter(|e| host.saw(e)) {
        *ops.entry(e.op.name()).or_default() += 1;
    }
    let listing: Vec<String> = ops.iter().map(|(op, n)| format!("{op} x{n}")).collect();
    Some(Chain {
        rule: Rule::CpuContention,
        severity: if share >= 0.5 { Severity::High } else { Severity::Medium },
        pid,
        title: "CPU contention -> slow CUDA calls".into(),
        root: format!(
            "the calling threads waited {} for a CPU during the {} slowest calls ({}; at least {} each): {:.0}% of their {}",
            t(o.run_queue_ns),
            host.of_followed(o.calls, slow.len()),
            listing.join(", "),
            t(threshold),
            share * 100.0,
            t(o.call_ns)
        ),
        effect: format!("{} off the CPU in all while inside those calls; the GPU work behind them waits on the host", t(o.off_cpu_ns)),
        compounding: host
            .crowding_text(pid, &slow)
            .map(|c| format!("competing for the cores during those calls: {c}"))
            .into_iter()
            .collect(),
        timeline: Vec::new(),
        fix: vec![
            "fewer DataLoader workers (num_workers) than free cores, or pin them away from the training thread (taskset, cgroups)".into(),
            "torch.set_num_threads() so intra-op threads do not oversubscribe the cores".into(),
        ],
        evidence: format!("{} slow calls and the scheduler's record of their threads", o.calls),
    })
}
