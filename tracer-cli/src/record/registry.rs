//! The process registry, beside the reader: what a call's numbers do not say, read while the
//! process lives. At a process's first call: its /proc metadata, its threads for the scheduler
//! programs, its interpreter for the Python frame walk; for each new call site: its code objects
//! and native frames (--stack). Then the calls go on to the writer.

mod deliver;
mod exits;

use std::{
    collections::{HashMap, HashSet},
    sync::{
        atomic::Ordering,
        mpsc::{Receiver, SyncSender},
    },
    time::{Duration, Instant},
};

use anyhow::{anyhow, Result};

use super::{
    join::{Join, JoinState},
    on_warning::WarningHook,
    shared::{thread_cpu_ns, Shared},
    writer::Delivery,
};
use crate::{
    decode::{Call, EventBytes, Record},
    model::{
        live::LiveAllocators,
        run_series::{GapRow, RunSeries},
        state::ProcessState,
        SeededSet,
    },
};
use crate::{
    probe::{
        attach::{Followed, NativeStacks, PyProcs},
        discover,
    },
    traced::{mappings::Notice, maps, procinfo, sites::Sites},
};

/// How often running processes are looked at for interpreters started since (--stack).
const PYTHON_SCAN_EVERY: Duration = Duration::from_secs(1);

/// What the registry is handed: the ring's events (decoded here), or what the kernel's side
/// band said of processes starting (--stack).
pub enum Inbound {
    Ring(EventBytes),
    Processes(Vec<Notice>),
}

/// The interpreters the kernel walks, and what tracer knows of their call sites (--stack).
pub struct Python {
    pub procs: PyProcs,
    /// The native stacks the call-site program keeps by id.
    pub stacks: NativeStacks,
    pub sites: Sites,
    /// The --pid scope, or every process.
    pub scope: Option<Vec<u32>>,
    /// When each process's interpreter was registered (monotonic ns, the calls' clock): its
    /// calls made before have no Python frames, and are counted.
    pub registered_at: HashMap<u32, u64>,
}

impl Python {
    /// Registers the interpreters running now in traced processes: the --pid ones, else those
    /// that map a probed library (done before the recording is announced, so a process told to
    /// go on by it has Python frames from its first call). No other process's memory is read.
    pub fn scan(&mut self, shared: &Shared) {
        let pids = match &self.scope {
            Some(pids) => pids.clone(),
            None => {
                let probed = shared
                    .probed_files
                    .lock()
                    .map(|f| f.clone())
                    .unwrap_or_default();
                discover::all_pids()
                    .into_iter()
                    .filter(|&pid| maps::maps_any(pid, &probed))
                    .collect()
            }
        };
        for pid in pids {
            self.register(pid);
        }
    }

    /// Puts `pid`'s interpreter, if it runs one tracer can walk, where the kernel finds it.
    fn register(&mut self, pid: u32) {
        let found = self.sites.register(pid);
        self.insert(pid, found);
    }

    fn insert(&mut self, pid: u32, found: Option<tracer_common::PyProcess>) {
        if let Some(interp) = found {
            match self.procs.insert(pid, interp) {
                Ok(()) => {
                    self.registered_at
                        .entry(pid)
                        .or_insert_with(super::arming::monotonic_ns);
                }
                Err(e) => eprintln!("tracer: {e:#}"),
            }
        }
    }

    fn in_scope(&self, pid: u32) -> bool {
        self.scope.as_ref().is_none_or(|s| s.contains(&pid))
    }

    /// Acts on the side band: a process that replaced its program loses its registration; an
    /// interpreter just mapped is registered before its program runs.
    fn on_notices(&mut self, notices: Vec<Notice>) {
        for notice in notices {
            log::debug!("side band: {notice:?}");
            match notice {
                Notice::Exec(pid) => {
                    if self.registered_at.remove(&pid).is_some() {
                        self.procs.remove(pid);
                    }
                    self.sites.exec(pid);
                }
                Notice::Interpreter(pid, mapping) if self.in_scope(pid) => {
                    if !self.registered_at.contains_key(&pid) {
                        let found = self.sites.register_mapped(pid, &mapping);
                        self.insert(pid, found);
                    }
                }
                Notice::Interpreter(..) => {}
            }
        }
    }

    /// Whether `call` was made by a Python process before its interpreter was registered.
    fn before_registration(&self, call: &Call) -> bool {
        self.registered_at
            .get(&call.pid)
            .is_some_and(|&at| call.ts_mono_ns < at)
    }
}

pub struct Registry {
    pub join: Join,
    pub followed: Option<Followed>,
    pub python: Option<Python>,
    pub wall_offset_ns: i64,
    /// --on-warning's command.
    pub hook: Option<WarningHook>,
    /// Calls of Python processes made before their interpreter was registered.
    pub before_interpreter: u64,
    /// When the session began (wall ns): a process that started earlier ran unseen until then.
    pub session_started_ns: i64,
    /// The whole-run series, kept as calls arrive.
    pub series: RunSeries,
    pub keyframes: KeyframeClock,
    /// Processes taken up from an earlier session's keyframe, and gaps not yet stored.
    pub taken_up: HashSet<u32>,
    pub gaps: Vec<GapRow>,
    /// Processes that ended since the last keyframe: their last state goes in the next one (a
    /// moment between a process's last call and its end reads it from there).
    pub ended: Vec<ProcessState>,
    /// The live pointers of processes whose end was read, until their state is kept.
    pub ended_joins: HashMap<u32, JoinState>,
    /// Processes' ends, held back a moment for calls read after them.
    pub exits: exits::Exits,
    /// Which library made a call, where it matters (the allocator's stream events).
    pub callers: super::callers::Callers,
    /// NVIDIA's management library, when loaded: who holds each GPU, asked at the start and
    /// at each out-of-memory.
    pub nvml: Option<NvmlWatch>,
    /// `--allocator`: when PyTorch's allocator probes are armed in each process.
    pub arming: super::arming::Auto,
}

/// NVML asked at the start and at out-of-memory evidence, at most once a second.
pub struct NvmlWatch {
    nvml: crate::traced::nvml::Nvml,
    /// The last out-of-memory sample.
    last: Option<Instant>,
}

impl NvmlWatch {
    pub fn new(nvml: crate::traced::nvml::Nvml) -> NvmlWatch {
        NvmlWatch { nvml, last: None }
    }

    /// Every GPU now (`at_start`), or at an out-of-memory unless one was sampled within the
    /// last second.
    fn sample(&mut self, at_start: bool) -> Vec<crate::model::GpuSample> {
        if !at_start {
            if self
                .last
                .is_some_and(|t| t.elapsed() < Duration::from_secs(1))
            {
                return Vec::new();
            }
            self.last = Some(Instant::now());
        }
        self.nvml.sample(wall_now_ns())
    }
}

/// A device allocation refused for want of memory, or PyTorch's out-of-memory message.
fn out_of_memory_in(delivery: &Delivery) -> bool {
    delivery
        .calls
        .iter()
        .any(|c| c.ret == 2 && c.op.spec().class == tracer_common::OpClass::Alloc)
        || delivery
            .messages
            .iter()
            .any(|m| m.op == tracer_common::Op::TorchOom)
}

/// A keyframe every [`KEYFRAME_EVERY`], or after [`KEYFRAME_EVENTS`] calls (more when the
/// processes hold many blocks: a keyframe costs in proportion to them), after
/// [`KEYFRAME_ENDED`] processes ended, or when --max-db needs one to evict.
pub struct KeyframeClock {
    /// Off only to measure what keyframes cost.
    on: bool,
    last: Instant,
    events: u64,
    /// The latest call taken in (wall ns): what a keyframe includes.
    latest_ns: i64,
}

impl KeyframeClock {
    pub fn new(on: bool) -> Self {
        KeyframeClock {
            on,
            last: Instant::now(),
            events: 0,
            latest_ns: 0,
        }
    }
}

const KEYFRAME_EVERY: Duration = Duration::from_secs(30);
const KEYFRAME_EVENTS: u64 = 1 << 20;
/// Calls per block held between keyframes at least: keeps their cost a small share.
const KEYFRAME_EVENTS_PER_BLOCK: u64 = 64;
/// Ended processes whose last states wait for the next keyframe, at most: a node starting
/// thousands of short CUDA processes a minute would otherwise hold each one's state (about a
/// kilobyte and a half) until the 30 s keyframe.
const KEYFRAME_ENDED: usize = 512;

impl KeyframeClock {
    fn due(&self, wanted: bool, blocks_held: u64, ended: usize) -> bool {
        let calls = KEYFRAME_EVENTS.max(blocks_held.saturating_mul(KEYFRAME_EVENTS_PER_BLOCK));
        let many_ended = ended >= KEYFRAME_ENDED;
        self.on
            && (wanted
                || many_ended
                || self.events >= calls
                || self.last.elapsed() >= KEYFRAME_EVERY)
            && (self.events > 0 || wanted || many_ended)
    }
}

impl Registry {
    /// Turns the reader's records into deliveries for the writer until the reader is done.
    pub fn run(
        mut self,
        rx: Receiver<Inbound>,
        tx: SyncSender<Delivery>,
        shared: &Shared,
    ) -> Result<()> {
        let result = (|| -> Result<()> {
            let boot = procinfo::boot_time_ns();
            if let Some(watch) = self.nvml.as_mut() {
                // Who held each GPU when the trace began: the processes no probe will see
                // allocate what they hold.
                let start = Delivery {
                    gpu_samples: watch.sample(true),
                    ..Delivery::default()
                };
                self.arming.nvml_said(&start.gpu_samples);
                tx.send(start)
                    .map_err(|_| anyhow!("the database writer stopped"))?;
            }
            let mut pids_seen: SeededSet<u32> = SeededSet::default();
            let mut last_python_scan = Instant::now();
            loop {
                let wait = if self.arming.decides() { 25 } else { 250 };
                let received = rx.recv_timeout(Duration::from_millis(wait));
                if let Ok(Inbound::Processes(notices)) = received {
                    if let Some(python) = self.python.as_mut() {
                        python.on_notices(notices);
                    }
                    continue;
                }
                // Taken once the records are here: a call made after a mark was read after it
                // was pushed, so the mark is among these and goes first.
                let marks = self.arming.round(shared, self.wall_offset_ns);
                let events = match received {
                    Ok(Inbound::Ring(events)) => events,
                    Ok(Inbound::Processes(_)) => EventBytes::default(),
                    Err(std::sync::mpsc::RecvTimeoutError::Timeout) => EventBytes::default(),
                    Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => {
                        // Every call is in: the ends held back are acted on.
                        self.end_due(u64::MAX, &mut pids_seen, &tx, shared)?;
                        // The last state, so a later tracer takes up from the end.
                        let mut last = Delivery {
                            calls: marks,
                            ..Delivery::default()
                        };
                        self.add_keeping(&mut last, shared, true)?;
                        return tx
                            .send(last)
                            .map_err(|_| anyhow!("the database writer stopped"));
                    }
                };
                if let Some(python) = self.python.as_mut() {
                    if last_python_scan.elapsed() >= PYTHON_SCAN_EVERY {
                        last_python_scan = Instant::now();
                        python.scan(shared);
                    }
                }
                if events.is_empty() && marks.is_empty() {
                    let now = super::arming::monotonic_ns();
                    if self.end_due(now, &mut pids_seen, &tx, shared)? {
                        continue;
                    }
                    let mut idle = Delivery::default();
                    self.add_keeping(&mut idle, shared, false)?;
                    if idle.keyframe.is_some() || !idle.series.is_empty() || !idle.gaps.is_empty() {
                        tx.send(idle)
                            .map_err(|_| anyhow!("the database writer stopped"))?;
                    }
                    continue;
                }
                // Every record made after a mark comes after it (see above); one made before it
                // is judged by its own time (model/layout.rs `Sight`).
                let mut decode_errors = 0;
                let count = marks.len() + events.len();
                let records =
                    marks
                        .into_iter()
                        .map(Record::Call)
                        .chain(events.decode().filter_map(|r| {
                            decode_errors += u64::from(r.is_err());
                            r.ok()
                        }));
                let delivery = self.enrich(records, count, &mut pids_seen, boot, shared);
                shared
                    .decode_errors
                    .fetch_add(decode_errors, Ordering::SeqCst);
                shared
                    .allocs_not_tracked
                    .store(self.join.not_tracked, Ordering::SeqCst);
                self.deliver(delivery, &tx, shared)?;
            }
        })();
        if result.is_err() {
            shared.stop.store(true, Ordering::SeqCst);
        }
        if let Ok(mut maps) = shared.registry_maps.lock() {
            if let Some(f) = &self.followed {
                maps.push((tracer_common::maps::SCHED_TIDS, f.entries()));
            }
            if let Some(p) = &self.python {
                maps.push((tracer_common::maps::PY_PROCS, p.procs.entries()));
            }
        }
        result
    }

    /// What is kept beside the calls when none arrive: the series' finished rows, gaps, and a
    /// keyframe when one is due (`last`: the recording ends, every row and a final keyframe).
    fn add_keeping(&mut self, d: &mut Delivery, shared: &Shared, last: bool) -> Result<()> {
        let allocators = shared.lock_allocators()?;
        let wanted = shared.keyframe_wanted.load(Ordering::SeqCst);
        if (last && self.keyframes.events > 0)
            || self
                .keyframes
                .due(wanted, allocators.blocks_held(), self.ended.len())
        {
            d.keyframe = Some(self.keyframe(&allocators, shared)?);
            shared.keyframe_wanted.store(false, Ordering::SeqCst);
        }
        d.series = self
            .series
            .take_closed(if last { i64::MAX } else { wall_now_ns() });
        d.gaps = std::mem::take(&mut self.gaps);
        Ok(())
    }

    /// Every followed process's state now, encoded for a keyframe: (the latest call it
    /// includes, the states).
    fn keyframe(
        &mut self,
        allocators: &LiveAllocators,
        shared: &Shared,
    ) -> Result<(i64, Vec<ProcessState>)> {
        let started = thread_cpu_ns();
        let mut joins = self.join.snapshot(self.wall_offset_ns);
        let mut states = Vec::new();
        let mut ts = self.keyframes.latest_ns;
        for pid in allocators.pids() {
            let Some(state) = allocators.state(pid) else {
                continue;
            };
            let mut state = state.clone();
            if let Some(join) = joins.remove(&pid) {
                state.take_join(join.live, join.devices);
            }
            ts = ts.max(state.last_ns);
            states.push(state);
        }
        let live: HashSet<u32> = states.iter().map(|s| s.pid).collect();
        for state in std::mem::take(&mut self.ended) {
            // A pid a live process reuses already has its row.
            if !live.contains(&state.pid) {
                states.push(state);
            }
        }
        self.keyframes = KeyframeClock {
            latest_ns: ts,
            ..KeyframeClock::new(true)
        };
        shared.keyframe_cpu_since(started);
        Ok((ts, states))
    }

    /// A process that started before the session ran unseen until it began.
    fn before_trace(&self, p: &crate::model::ProcessInfo) -> Option<GapRow> {
        let started = p.start_time_ns?;
        (started < self.session_started_ns - BEFORE_TRACE_SLACK_NS
            && !self.taken_up.contains(&p.pid))
        .then(|| GapRow {
            pid: p.pid,
            from_ns: Some(started),
            to_ns: self.session_started_ns,
            kind: "before_trace".into(),
            detail:
                "the process ran before this session began: what it allocated then was not seen"
                    .into(),
        })
    }

    /// A process whose library was probed only after it opened it (record/discovery.rs): a
    /// `found_late` gap from then to its first call seen (`first_ns`, wall).
    fn found_late(&mut self, pid: u32, first_ns: i64, shared: &Shared) -> bool {
        let Some(late) = shared
            .discovery
            .lock()
            .ok()
            .and_then(|mut f| f.late.remove(&pid))
        else {
            return false;
        };
        let ago = late
            .from_ns
            .map(|from| format!(" {:.1} ms", (first_ns - from).max(0) as f64 / 1e6))
            .unwrap_or_default();
        let how = match late.how {
            "scan" => "mapped (found by the once-a-second scan)",
            _ => "opened",
        };
        self.gaps.push(GapRow {
            pid,
            from_ns: late.from_ns,
            to_ns: first_ns,
            kind: "found_late".into(),
            detail: format!(
                "found late: it {how} {}{ago} before its first call seen, and the library was probed only then: its calls before were not seen",
                late.library
            ),
        });
        true
    }

    /// Tracer saw every call of the process: it started after the trace began (a thread of
    /// it that set no device is then on device 0, CUDA's default).
    fn seen_from_start(&self, p: &crate::model::ProcessInfo) -> bool {
        p.start_time_ns
            .is_some_and(|started| started >= self.session_started_ns - BEFORE_TRACE_SLACK_NS)
            && !self.taken_up.contains(&p.pid)
    }

    /// Takes up processes an earlier session kept (tracer restarted while they ran).
    pub fn take_up(
        &mut self,
        taken: Vec<super::restore::TakenUp>,
        gaps: Vec<GapRow>,
        shared: &Shared,
    ) -> Result<()> {
        let mut allocators = shared.lock_allocators()?;
        for t in taken {
            let pid = t.state.pid;
            self.join.restore(
                pid,
                t.state.live.values(),
                &t.state.thread_devices,
                self.wall_offset_ns,
            );
            allocators.restore(t.state);
            self.taken_up.insert(pid);
        }
        self.gaps.extend(gaps);
        Ok(())
    }

    /// The records of one delivery (about `count`), each call completed from those before.
    fn enrich(
        &mut self,
        records: impl Iterator<Item = Record>,
        count: usize,
        pids_seen: &mut SeededSet<u32>,
        boot: Option<i64>,
        shared: &Shared,
    ) -> Delivery {
        let mut out = Delivery::default();
        out.calls.reserve(count);
        // The pid of the call before, in `pids_seen` (calls come in runs from one process);
        // None again whenever a pid leaves the set.
        let mut last_seen = None;
        for record in records {
            match record {
                Record::Call(mut call) => {
                    if let Some(ended) = self.exits.reused(call.pid, call.ts_mono_ns) {
                        // A new process under the pid of one whose end was held back.
                        self.end_process(call.pid, ended, pids_seen, &mut out);
                        last_seen = None;
                    }
                    // tracer's own marks belong to no process.
                    let a_process = call.op.spec().library != tracer_common::Library::Tracer;
                    if a_process && last_seen != Some(call.pid) && pids_seen.insert(call.pid) {
                        if self.exits.after_end(call.pid, call.ts_mono_ns) {
                            pids_seen.remove(&call.pid);
                            last_seen = None;
                            self.after_end(call, &mut out);
                            continue;
                        }
                        if self.arming.unarmed_at_first() {
                            // Its blocks are not seen until armed: the layout knows so.
                            let ts = call.ts_mono_ns.saturating_sub(1);
                            out.calls.push(super::arming::not_armed_yet(call.pid, ts));
                        }
                        let seen = call.ts_mono_ns as i64 + self.wall_offset_ns;
                        let info = procinfo::read(call.pid, seen, &call.comm, boot);
                        let late = self.found_late(call.pid, seen, shared);
                        if !late && self.seen_from_start(&info) {
                            self.join.seen_whole(call.pid);
                        }
                        out.processes.push(info);
                        if let Some(f) = self.followed.as_mut() {
                            f.process_tree(call.pid);
                        }
                        if let Some(python) = self.python.as_mut() {
                            python.sites.first_seen(call.pid);
                            python.register(call.pid);
                        }
                    }
                    if a_process {
                        last_seen = Some(call.pid);
                    }
                    if call.op == tracer_common::Op::CudaEventRecord {
                        // aux1: the return address, from the eBPF program.
                        call.aux1 = self.callers.in_allocator(call.pid, call.aux1) as u64;
                    }
                    self.join.apply(&mut call);
                    if let Some(python) = self.python.as_ref() {
                        if python.before_registration(&call) {
                            self.before_interpreter += 1;
                        }
                    }
                    if let (Some(site), Some(python)) = (call.site.take(), self.python.as_mut()) {
                        call.stack = Some(python.sites.intern(
                            call.pid,
                            *site,
                            &mut python.stacks,
                            &mut out.sites,
                        ));
                    }
                    out.calls.push(call);
                }
                Record::OffCpu(off) => out.offcpu.push(off),
                Record::Message(m) => out.messages.push(m),
                Record::Exit { pid, ts_mono_ns } => {
                    if let Some(earlier) = self.exits.hold(pid, ts_mono_ns) {
                        self.end_process(pid, earlier, pids_seen, &mut out);
                        last_seen = None;
                    }
                }
            }
        }
        for (pid, ts) in self.exits.due(super::arming::monotonic_ns()) {
            self.end_process(pid, ts, pids_seen, &mut out);
        }
        let offset = self.wall_offset_ns;
        out.learned = self
            .join
            .take_learned()
            .into_iter()
            .map(|l| crate::model::devices::Learned {
                from_ns: l.from_ns + offset,
                to_ns: l.to_ns + offset,
                ..l
            })
            .collect();
        out
    }

    /// Acts on a process's end (held back until calls read late have come): forgets it, so
    /// that a process reusing the pid starts afresh.
    fn end_process(
        &mut self,
        pid: u32,
        ts: u64,
        pids_seen: &mut SeededSet<u32>,
        out: &mut Delivery,
    ) {
        pids_seen.remove(&pid);
        self.callers.forget(pid);
        self.ended_joins
            .insert(pid, self.join.snapshot_of(pid, self.wall_offset_ns));
        self.join.forget_process(pid);
        if let Some(python) = self.python.as_mut() {
            python.sites.forget_process(pid);
            python.registered_at.remove(&pid);
        }
        out.exited.push(pid);
        self.arming.exited(pid);
        self.exits.acted(pid, ts);
    }

    /// A call read after its process's end was acted on: stored with its site, kept out of
    /// the live figures (the process is gone from them) and of any later process's tables.
    fn after_end(&mut self, mut call: Call, out: &mut Delivery) {
        log::debug!(
            "a call of ended process {} read after its end: stored, not applied",
            call.pid
        );
        if let (Some(site), Some(python)) = (call.site.take(), self.python.as_mut()) {
            call.stack = Some(python.sites.intern(
                call.pid,
                *site,
                &mut python.stacks,
                &mut out.sites,
            ));
            python.sites.forget_process(call.pid);
            out.sites_done.push(call.pid);
        }
        out.after_end.push(call);
    }

    /// Acts on the ends whose grace has passed by `now`, delivered on their own; whether any
    /// were.
    fn end_due(
        &mut self,
        now: u64,
        pids_seen: &mut SeededSet<u32>,
        tx: &SyncSender<Delivery>,
        shared: &Shared,
    ) -> Result<bool> {
        let due = self.exits.due(now);
        if due.is_empty() {
            return Ok(false);
        }
        let mut ended = Delivery::default();
        for (pid, ts) in due {
            self.end_process(pid, ts, pids_seen, &mut ended);
        }
        self.deliver(ended, tx, shared)?;
        Ok(true)
    }
}

/// How much earlier than the session a process must have started to have run unseen (tracer
/// attaches its probes before it begins the session).
const BEFORE_TRACE_SLACK_NS: i64 = 1_000_000_000;

fn wall_now_ns() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as i64)
}
