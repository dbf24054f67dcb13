//! When PyTorch's allocator probes are armed in a process (`--allocator auto`): the CUDA calls
//! and PyTorch's out-of-memory message are always traced; the block events, one trap each
//! (about 1,000 a training step), only while memory is tight. Pure decisions over the calls:
//! the recording acts on them (probe/attach.rs arms, record/arming.rs carries them out) and
//! stores each arming and disarming in the call stream as a mark (`tracer:allocator_armed`,
//! `tracer:allocator_disarmed`) whose `ret` is its [`Reason`]; an arming is also marked where
//! it began (`tracer:allocator_arming`), before its semaphores were raised.

use std::collections::HashMap;

use serde::Serialize;
use tracer_common::{Op, OpClass, Space};

use super::Event;

/// Which block events tracer asks for.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    /// PyTorch's allocator probes in every process, from the start (the layout at every call).
    #[default]
    Always,
    /// Armed per process while memory is tight, disarmed after a quiet period.
    Auto,
    /// Never: the CUDA calls and PyTorch's message only.
    Off,
}

impl Mode {
    pub fn name(self) -> &'static str {
        match self {
            Mode::Always => "always",
            Mode::Auto => "auto",
            Mode::Off => "off",
        }
    }
}

/// Why the probes were armed or disarmed (the mark's `ret`; stable, stored).
#[repr(i32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Reason {
    /// Disarmed: the process was first seen, and the mode does not arm it yet.
    NotArmedYet = 1,
    /// Armed: the process's device memory reached the share of the device it may use.
    Reserved = 2,
    /// Armed: a device allocation after warm-up (the allocator's cache missed).
    CacheMiss = 3,
    /// Armed: a device allocation failed for want of memory (PyTorch retries after freeing
    /// its cache).
    FailedAllocation = 4,
    /// Armed: PyTorch raised out-of-memory.
    OutOfMemory = 5,
    /// Armed: root asked (SIGUSR1 to `tracer trace`).
    OnDemand = 6,
    /// Disarmed: nothing called for the probes for the quiet period.
    Quiet = 7,
    /// Disarmed: root asked (SIGUSR2).
    OnDemandEnded = 8,
    /// The probes could not be armed (the mark says so; the error is on stderr).
    Failed = 9,
    /// Disarmed: the process ended.
    Ended = 10,
}

impl Reason {
    pub fn from_i32(v: i32) -> Option<Reason> {
        use Reason::*;
        [
            NotArmedYet,
            Reserved,
            CacheMiss,
            FailedAllocation,
            OutOfMemory,
            OnDemand,
            Quiet,
            OnDemandEnded,
            Failed,
            Ended,
        ]
        .into_iter()
        .find(|r| *r as i32 == v)
    }

    /// Said after "armed" or "disarmed".
    pub fn says(self) -> &'static str {
        match self {
            Reason::NotArmedYet => "when first seen (not armed yet)",
            Reason::Reserved => "as its device memory passed its share of the device",
            Reason::CacheMiss => "at a device allocation after warm-up (the cache missed)",
            Reason::FailedAllocation => "at a device allocation that failed for want of memory",
            Reason::OutOfMemory => "at PyTorch's out-of-memory error",
            Reason::OnDemand => "on demand (SIGUSR1)",
            Reason::Quiet => "after a quiet period",
            Reason::OnDemandEnded => "on demand (SIGUSR2)",
            Reason::Failed => "but arming failed",
            Reason::Ended => "as the process ended",
        }
    }
}

/// When to arm and disarm.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Settings {
    /// Arm when a process holds this share of a device (0-1).
    pub arm_share: f64,
    /// The pressure lasts while it holds at least this share (hysteresis; below arm_share).
    pub hold_share: f64,
    /// Device allocations within this long of a process's first are its warm-up.
    pub warmup_ns: i64,
    /// Disarm after this long without a trigger...
    pub quiet_ns: i64,
    /// ...and never before this long armed.
    pub min_armed_ns: i64,
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            arm_share: 0.85,
            hold_share: 0.75,
            warmup_ns: 60_000_000_000,
            quiet_ns: 60_000_000_000,
            min_armed_ns: 30_000_000_000,
        }
    }
}

/// What the recording should do to a process's probes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Decision {
    pub pid: u32,
    pub arm: bool,
    pub reason: Reason,
    /// The figures behind it: the process's device bytes and the device's total (0: unknown).
    pub held: u64,
    pub total: u64,
    pub device: i32,
}

#[derive(Clone, Debug, Default)]
struct Process {
    /// Device allocations live: pointer -> (device, bytes). A driver call nested in the
    /// runtime's returns the same pointer and is counted once.
    live: HashMap<u64, (i32, u64)>,
    held: HashMap<i32, u64>,
    first_alloc_ns: Option<i64>,
    /// Armed since (wall ns), asked for, or neither.
    armed_at: Option<i64>,
    asked: bool,
    last_trigger_ns: i64,
    /// The latest trigger of its own (not root's asking): what keeps it armed once the asking
    /// ends.
    own_trigger_ns: Option<i64>,
    on_demand: bool,
}

/// The decisions for every process of a recording.
#[derive(Debug, Default)]
pub struct Arming {
    pub mode: Mode,
    pub settings: Settings,
    procs: HashMap<u32, Process>,
    /// Each (pid, device)'s total bytes, as the driver or NVML said.
    totals: HashMap<(u32, i32), u64>,
    /// Root's asking lasts (SIGUSR1 until SIGUSR2): processes seen meanwhile are armed too.
    asking: bool,
}

impl Arming {
    pub fn new(mode: Mode, settings: Settings) -> Arming {
        Arming {
            mode,
            settings,
            ..Default::default()
        }
    }

    /// Whether the probes are tracer's to arm (auto), rather than always on or never.
    pub fn decides(&self) -> bool {
        self.mode == Mode::Auto
    }

    /// The device's total memory, as `pid` numbers it.
    pub fn set_total(&mut self, pid: u32, device: i32, total: u64) {
        if total > 0 {
            self.totals.insert((pid, device), total);
        }
    }

    pub fn total(&self, pid: u32, device: i32) -> Option<u64> {
        self.totals.get(&(pid, device)).copied()
    }

    /// Takes in one call (in the order they returned); a decision to arm when it is a trigger
    /// and the process is neither armed nor asked for.
    pub fn observe(&mut self, e: &Event) -> Option<Decision> {
        if !self.decides() || e.op.spec().library == tracer_common::Library::Tracer {
            return None;
        }
        let spec = e.op.spec();
        if spec.class == OpClass::MemInfo && e.ret == 0 {
            self.set_total(e.pid, e.device.max(0), e.aux1);
        }
        let settings = self.settings;
        let p = self.procs.entry(e.pid).or_default();
        let device_memory = matches!(spec.space, Space::Device | Space::Handle);
        let reason = match (spec.class, device_memory) {
            (OpClass::Alloc, true) if e.ret == 2 => Some(Reason::FailedAllocation),
            (OpClass::Alloc, true) if e.ret == 0 && e.ptr != 0 => {
                let first = *p.first_alloc_ns.get_or_insert(e.ts_ns);
                let nested = p.live.contains_key(&e.ptr);
                if !nested {
                    p.live.insert(e.ptr, (e.device, e.size));
                    *p.held.entry(e.device).or_default() += e.size;
                }
                let warm = e.ts_ns - first >= settings.warmup_ns;
                (warm && !nested).then_some(Reason::CacheMiss)
            }
            (OpClass::Free, true) if e.ret == 0 => {
                if let Some((device, bytes)) = p.live.remove(&e.ptr) {
                    let h = p.held.entry(device).or_default();
                    *h = h.saturating_sub(bytes);
                }
                None
            }
            (OpClass::Oom, _) => Some(Reason::OutOfMemory),
            _ => None,
        };
        let held = p.held.get(&e.device).copied().unwrap_or(0);
        let total = self.totals.get(&(e.pid, e.device)).copied().unwrap_or(0);
        let share = if total > 0 {
            held as f64 / total as f64
        } else {
            0.0
        };
        let p = self.procs.get_mut(&e.pid)?;
        if share >= settings.hold_share && (p.armed_at.is_some() || p.asked) {
            // The pressure lasts: it keeps the probes armed.
            p.last_trigger_ns = p.last_trigger_ns.max(e.ts_ns);
            p.own_trigger_ns = Some(p.own_trigger_ns.map_or(e.ts_ns, |t| t.max(e.ts_ns)));
        }
        let own = reason.or((share >= settings.arm_share).then_some(Reason::Reserved));
        if own.is_some() {
            p.own_trigger_ns = Some(p.own_trigger_ns.map_or(e.ts_ns, |t| t.max(e.ts_ns)));
        }
        let reason = own.or(self.asking.then_some(Reason::OnDemand))?;
        if self.asking {
            p.on_demand = true;
        }
        p.last_trigger_ns = p.last_trigger_ns.max(e.ts_ns);
        if p.armed_at.is_some() || p.asked {
            return None;
        }
        p.asked = true;
        Some(Decision {
            pid: e.pid,
            arm: true,
            reason,
            held,
            total,
            device: e.device,
        })
    }

    /// Root asked to arm (`arm` true) or to end its asking for every process seen. Ending it
    /// disarms the processes only the asking kept armed; one with a trigger of its own within
    /// the quiet period stays armed until that period passes.
    pub fn on_demand(&mut self, arm: bool, now_ns: i64) -> Vec<Decision> {
        if !self.decides() {
            return Vec::new();
        }
        self.asking = arm;
        let mut out = Vec::new();
        for (&pid, p) in &mut self.procs {
            p.on_demand = arm;
            if arm {
                p.last_trigger_ns = now_ns;
                if p.armed_at.is_none() && !p.asked {
                    p.asked = true;
                    out.push(decision(pid, true, Reason::OnDemand));
                }
            } else if p.armed_at.is_some() {
                match p.own_trigger_ns {
                    Some(t) if now_ns - t < self.settings.quiet_ns => p.last_trigger_ns = t,
                    _ => {
                        p.armed_at = None;
                        out.push(decision(pid, false, Reason::OnDemandEnded));
                    }
                }
            }
        }
        out.sort_by_key(|d| d.pid);
        out
    }

    /// The recording armed (or failed to arm) the process at `ts`.
    pub fn armed(&mut self, pid: u32, ok: bool, ts: i64) {
        let p = self.procs.entry(pid).or_default();
        p.asked = false;
        if ok {
            p.armed_at = Some(ts);
            p.last_trigger_ns = p.last_trigger_ns.max(ts);
        }
    }

    /// The processes to disarm at `now_ns`: quiet for the quiet period and armed for at least
    /// the minimum (never while root's asking lasts).
    pub fn due(&mut self, now_ns: i64) -> Vec<Decision> {
        let s = self.settings;
        let mut out = Vec::new();
        for (&pid, p) in &mut self.procs {
            let Some(at) = p.armed_at else {
                continue;
            };
            if !p.on_demand
                && now_ns - p.last_trigger_ns >= s.quiet_ns
                && now_ns - at >= s.min_armed_ns
            {
                p.armed_at = None;
                out.push(decision(pid, false, Reason::Quiet));
            }
        }
        out.sort_by_key(|d| d.pid);
        out
    }

    /// The process ended: its probes go with it (a decision to disarm when it was armed).
    pub fn exited(&mut self, pid: u32) -> Option<Decision> {
        let p = self.procs.remove(&pid)?;
        self.totals.retain(|(p, _), _| *p != pid);
        p.armed_at.map(|_| decision(pid, false, Reason::Ended))
    }

    /// Processes armed now.
    pub fn armed_pids(&self) -> Vec<u32> {
        let mut v: Vec<u32> = self
            .procs
            .iter()
            .filter(|(_, p)| p.armed_at.is_some())
            .map(|(&pid, _)| pid)
            .collect();
        v.sort_unstable();
        v
    }
}

fn decision(pid: u32, arm: bool, reason: Reason) -> Decision {
    Decision {
        pid,
        arm,
        reason,
        held: 0,
        total: 0,
        device: -1,
    }
}

impl Decision {
    /// The mark made before an arming's semaphores are raised (its armed mark follows once
    /// they are up): op and `ret`.
    pub fn arming_mark(&self) -> (Op, i32) {
        (Op::AllocatorArming, self.reason as i32)
    }

    /// The mark's op and `ret` once carried out (`armed`: whether the probes are armed now).
    pub fn mark(&self, armed: bool) -> (Op, i32) {
        let op = if armed {
            Op::AllocatorArmed
        } else {
            Op::AllocatorDisarmed
        };
        let reason = if self.arm && !armed {
            Reason::Failed
        } else {
            self.reason
        };
        (op, reason as i32)
    }
}

/// One arming or disarming as a reader of the session sees it (explain, the report).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ArmingRow {
    pub pid: u32,
    pub ts_ns: i64,
    pub armed: bool,
    pub reason: Option<Reason>,
    /// The process's device bytes and the device's total behind it (0: not said).
    pub held: u64,
    pub total: u64,
}

impl ArmingRow {
    /// The row of a mark in the call stream; None for any other call.
    pub fn of(e: &Event) -> Option<ArmingRow> {
        let armed = match e.op {
            Op::AllocatorArmed => true,
            Op::AllocatorDisarmed => false,
            _ => return None,
        };
        Some(ArmingRow {
            pid: e.pid,
            ts_ns: e.ts_ns,
            armed,
            reason: Reason::from_i32(e.ret),
            held: e.size,
            total: e.aux0,
        })
    }

    /// "armed at <time> at a device allocation after warm-up" (the time by the caller).
    pub fn says(&self) -> String {
        format!(
            "{} {}",
            if self.armed { "armed" } else { "disarmed" },
            self.reason
                .map_or("(reason unknown to this tracer)", Reason::says)
        )
    }
}

/// Whether `pid`'s allocator probes were armed at `ts_ns`, from the rows in time order: None
/// where no row says (always on, or a session before `--allocator`).
pub fn armed_at(rows: &[ArmingRow], pid: u32, ts_ns: i64) -> Option<&ArmingRow> {
    rows.iter().rfind(|r| r.pid == pid && r.ts_ns <= ts_ns)
}

#[cfg(test)]
mod tests;
