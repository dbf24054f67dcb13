//! Carrying out `--allocator auto`'s decisions (model/arming.rs): the registry decides from
//! the calls; the recording's main thread, which holds the probes, arms and disarms; each is
//! stored as a mark in the call stream, which the registry hands on like a call.
//!
//! Arming raises the sites' semaphores in the process's memory (probe/attach.rs,
//! target/semaphore.rs): microseconds, no uprobe made or removed. The order is what makes the
//! layout right: an arming's mark is taken by the registry before the semaphores are raised,
//! so no block event can reach the layout before it; a disarming's mark is made after they are
//! lowered, so block events read after it are of before it, and dropped.

use std::{
    sync::atomic::Ordering,
    time::{Duration, Instant},
};

use super::shared::Shared;
use crate::{
    decode::Call,
    model::arming::{Decision, Reason},
    probe::attach::Probes,
};

/// What the registry and the main thread hand each other.
#[derive(Debug, Default)]
pub struct Queue {
    /// Decisions to carry out (registry -> main thread).
    pub requests: Vec<Decision>,
    /// Marks to hand on (main thread -> registry), each before any call made after it.
    pub marks: Vec<Call>,
    /// Whether each arming took (pid, armed, monotonic ns).
    pub results: Vec<(u32, bool, u64)>,
    /// Root asked to arm (true) or to stop asking (false): SIGUSR1, SIGUSR2.
    pub on_demand: Option<bool>,
}

/// How long the main thread waits for the registry to take an arming's mark.
const MARK_TAKEN_WITHIN: Duration = Duration::from_secs(2);

/// The mark of a decision carried out at `ts_mono_ns`.
pub fn mark(d: &Decision, armed: bool, ts_mono_ns: u64) -> Call {
    let (op, ret) = d.mark(armed);
    Call {
        ts_mono_ns,
        pid: d.pid,
        tid: 0,
        op,
        device: (d.device >= 0).then_some(d.device),
        ret,
        duration_ns: 0,
        size: (d.held > 0).then_some(d.held),
        ptr: None,
        aux0: d.total,
        aux1: 0,
        flags: 0,
        comm: String::new(),
        site: None,
        stack: None,
    }
}

/// The mark a process gets when first seen in a mode that does not arm it from the start.
pub fn not_armed_yet(pid: u32, ts_mono_ns: u64) -> Call {
    let d = Decision {
        pid,
        arm: false,
        reason: Reason::NotArmedYet,
        held: 0,
        total: 0,
        device: -1,
    };
    mark(&d, false, ts_mono_ns)
}

/// Carries out the registry's decisions (on the main thread, which holds the probes).
pub fn carry_out(probes: &mut Probes, shared: &Shared) {
    let requests = match shared.arming.lock() {
        Ok(mut q) => std::mem::take(&mut q.requests),
        Err(_) => return,
    };
    for d in requests {
        if d.arm {
            arm(probes, shared, &d);
        } else if probes.disarm(d.pid) {
            push_mark(shared, mark(&d, false, monotonic_ns()));
            shared.disarmings.fetch_add(1, Ordering::SeqCst);
        }
    }
    shared
        .armed_now
        .store(probes.armed_now().0 as u64, Ordering::SeqCst);
}

fn arm(probes: &mut Probes, shared: &Shared, d: &Decision) {
    let ts = monotonic_ns();
    push_mark(shared, mark(d, true, ts));
    wait_until_taken(shared);
    let ok = match probes.arm(d.pid) {
        Ok(_) => {
            shared.armings.fetch_add(1, Ordering::SeqCst);
            true
        }
        Err(e) => {
            eprintln!("tracer: {e:#}");
            push_mark(shared, mark(d, false, monotonic_ns()));
            false
        }
    };
    if let Ok(mut q) = shared.arming.lock() {
        q.results.push((d.pid, ok, ts));
    }
}

fn push_mark(shared: &Shared, call: Call) {
    if let Ok(mut q) = shared.arming.lock() {
        q.marks.push(call);
    }
}

/// Until the registry took every mark (or it stopped taking them).
fn wait_until_taken(shared: &Shared) {
    let deadline = Instant::now() + MARK_TAKEN_WITHIN;
    while Instant::now() < deadline && !shared.stop.load(Ordering::SeqCst) {
        if shared.arming.lock().map_or(true, |q| q.marks.is_empty()) {
            return;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// CLOCK_MONOTONIC in ns: the calls' clock.
pub fn monotonic_ns() -> u64 {
    nix::time::clock_gettime(nix::time::ClockId::CLOCK_MONOTONIC)
        .map(|t| t.tv_sec() as u64 * 1_000_000_000 + t.tv_nsec() as u64)
        .unwrap_or(0)
}
