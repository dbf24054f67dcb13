//! Carrying out `--allocator auto`'s decisions (model/arming.rs): the registry decides from
//! the calls; the recording's main thread, which holds the probes, arms and disarms; each is
//! stored as a mark in the call stream, which the registry hands on like a call.
//!
//! Arming raises the sites' semaphores in the process's memory (probe/attach.rs,
//! traced/semaphore.rs): microseconds, no uprobe made or removed. The order is what makes the
//! layout right: an arming's mark is taken by the registry before the semaphores are raised,
//! so no block event can reach the layout before it; a disarming's mark is made after they are
//! lowered, so block events read after it are of before it, and dropped.

use std::{
    sync::atomic::{AtomicU8, Ordering},
    time::{Duration, Instant},
};

use std::collections::HashMap;

use super::shared::Shared;
use crate::{
    decode::Call,
    model::{
        arming::{Arming, Decision, Mode, Reason},
        Event, GpuSample, Placement,
    },
    probe::attach::Probes,
};

/// The latest SIGUSR1 (1) or SIGUSR2 (2) not yet taken.
pub static ON_DEMAND: AtomicU8 = AtomicU8::new(0);

/// Root's latest asking: Some(true) to arm (SIGUSR1), Some(false) to stop asking (SIGUSR2).
pub fn take_on_demand() -> Option<bool> {
    match ON_DEMAND.swap(0, Ordering::SeqCst) {
        1 => Some(true),
        2 => Some(false),
        _ => None,
    }
}

/// The registry's part: the decisions, and what they need that the calls do not say.
pub struct Auto {
    arming: Arming,
    /// Each GPU's total memory as NVML said at the start, by its label ("GPU 3").
    nvml_totals: HashMap<String, u64>,
    /// Where each process runs (its device numbers to the host's GPUs).
    placements: HashMap<u32, Placement>,
    /// Decisions not yet handed to the main thread.
    requests: Vec<Decision>,
    /// Processes that ended since the last round.
    ended: Vec<u32>,
}

impl Auto {
    pub fn new(arming: Arming) -> Auto {
        Auto {
            arming,
            nvml_totals: HashMap::new(),
            placements: HashMap::new(),
            requests: Vec::new(),
            ended: Vec::new(),
        }
    }

    /// Whether tracer decides when to arm (`--allocator auto`).
    pub fn decides(&self) -> bool {
        self.arming.decides()
    }

    /// A process first seen gets a mark saying its blocks are not seen (`auto`, `off`).
    pub fn unarmed_at_first(&self) -> bool {
        self.arming.mode != Mode::Always
    }

    pub fn nvml_said(&mut self, samples: &[GpuSample]) {
        for s in samples {
            self.nvml_totals.insert(s.gpu.clone(), s.total);
        }
    }

    pub fn placed(&mut self, pid: u32, placement: Placement) {
        self.placements.insert(pid, placement);
    }

    /// Feeds one call to the decisions, with its device's total from NVML when the process's
    /// own calls did not say it.
    pub fn observe(&mut self, event: &Event) {
        let (pid, device) = (event.pid, event.device);
        if device >= 0 && self.arming.total(pid, device).is_none() {
            let label = self.placements.get(&pid).map(|p| p.gpu(device).label);
            if let Some(&total) = label.and_then(|l| self.nvml_totals.get(&l)) {
                self.arming.set_total(pid, device, total);
            }
        }
        self.requests.extend(self.arming.observe(event));
    }

    /// The process ended: forgotten at the next round, once the delivery holding its exit
    /// (and its last messages, read before it) was taken in.
    pub fn exited(&mut self, pid: u32) {
        self.ended.push(pid);
    }

    /// What the main thread did since (its results, and its marks: handed on before any
    /// record read after this), root's asking, and the quiet processes to disarm; the
    /// decisions made go to the main thread.
    pub fn round(&mut self, shared: &Shared, wall_offset_ns: i64) -> Vec<Call> {
        if self.arming.mode == Mode::Always {
            return Vec::new();
        }
        let now = monotonic_ns() as i64 + wall_offset_ns;
        let Ok(mut q) = shared.arming.lock() else {
            return Vec::new();
        };
        for (pid, ok, ts) in q.results.drain(..) {
            self.arming.armed(pid, ok, ts as i64 + wall_offset_ns);
        }
        for pid in std::mem::take(&mut self.ended) {
            self.placements.remove(&pid);
            self.requests.extend(self.arming.exited(pid));
        }
        if let Some(arm) = q.on_demand.take() {
            self.requests.extend(self.arming.on_demand(arm, now));
        }
        self.requests.extend(self.arming.due(now));
        q.requests.append(&mut self.requests);
        std::mem::take(&mut q.marks)
    }
}

/// How long the main thread waits for the registry to take an arming's mark.
const MARK_TAKEN_WITHIN: Duration = Duration::from_secs(2);

/// The mark of a decision carried out at `ts_mono_ns`.
pub fn mark(d: &Decision, armed: bool, ts_mono_ns: u64) -> Call {
    mark_of(d, d.mark(armed), ts_mono_ns)
}

/// The mark (op, `ret`) of decision `d` at `ts_mono_ns`.
fn mark_of(d: &Decision, (op, ret): (tracer_common::Op, i32), ts_mono_ns: u64) -> Call {
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
        } else {
            let t = Instant::now();
            let was_armed = probes.disarm(d.pid);
            add_time(shared, t);
            if was_armed {
                push_mark(shared, mark(&d, false, monotonic_ns()));
                shared.disarmings.fetch_add(1, Ordering::SeqCst);
            }
        }
    }
    shared
        .armed_now
        .store(probes.armed_now().0 as u64, Ordering::SeqCst);
}

/// Arms `d`'s process: the arming mark first (the registry takes it before any block event
/// can exist), then the semaphores, then the armed mark, once they are up: a segment made
/// between the two may hold blocks made before they were up, so the layout counts only
/// segments made after the armed mark as seen whole.
fn arm(probes: &mut Probes, shared: &Shared, d: &Decision) {
    push_mark(shared, mark_of(d, d.arming_mark(), monotonic_ns()));
    wait_until_taken(shared);
    let t = Instant::now();
    let armed = probes.arm(d.pid);
    add_time(shared, t);
    let ts = monotonic_ns();
    let ok = match armed {
        Ok(_) => {
            push_mark(shared, mark(d, true, ts));
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

fn add_time(shared: &Shared, since: Instant) {
    let ns = u64::try_from(since.elapsed().as_nanos()).unwrap_or(u64::MAX);
    shared.arming_ns.fetch_add(ns, Ordering::SeqCst);
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
