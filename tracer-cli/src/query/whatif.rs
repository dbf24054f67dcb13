//! `tracer whatif`: a process's recorded requests (pytorch:malloc and pytorch:free on one
//! device, in order) replayed through the allocator simulator under the settings it ran with
//! and under others. First the fidelity gate: with the recorded settings the simulator must
//! make the same device allocations (count and sizes, in order) and put the blocks where the
//! allocator did; a session where it does not is said to be so, with the first divergence.
//!
//! Over 700 lines because the recorded run, its fidelity check and the settings' outcomes are one
//! walk over the same requests; the simulator itself is model/simulator.rs.

use std::{collections::HashMap, path::Path};

use anyhow::Result;
use serde::Serialize;
use tracer_common::{Library, Op, OpClass, Space};

use crate::{
    analysis::oom::{free_said, pytorch_tried, snapshot_free_said},
    exit::user_error,
    model::{
        attempts::OUT_OF_MEMORY,
        layout::{AllocConf, Layout, Pool, RunKind, SMALL_SEGMENT},
        simulator::{private_stream, Outcome, Request, SeedSegment, Settings, Simulator},
        Event,
    },
    store::{events, series, Access, Store},
};

/// Placement agreement the gate asks for when the trace began with the allocator already in
/// use (the state before it rebuilt); from an empty allocator every placement must agree.
const GATE_SHARE: f64 = 0.99;
/// The least-memory search stops at this granularity (the large pool's segment rounding).
const SEARCH_STEP: u64 = 2 << 20;

/// What one process recorded on one device, as the simulator takes it.
#[derive(Clone, Debug, Default)]
pub struct RecordedRun {
    pub pid: u32,
    pub device: i32,
    pub conf_text: String,
    pub settings: Option<Settings>,
    /// The state when the requests begin (a keyframe's, or one a snapshot's trace rebuilt).
    pub seed: Vec<SeedSegment>,
    pub requests: Vec<Request>,
    /// Where the allocator put each malloc (0: a request that failed, PyTorch's OOM).
    pub placed: Vec<u64>,
    /// The requests PyTorch refused (its OOMs): their index among the requests. No probe fires
    /// for them: their size is the segment they needed, the most they asked for.
    pub refused: Vec<usize>,
    /// The device allocations (cudaMalloc, or pages mapped): address and size, in order.
    pub device_allocs: Vec<(u64, u64)>,
    /// Address ranges reserved for expandable segments, in order.
    pub reserves: Vec<u64>,
    /// Bytes the allocator could hold (from cudaMemGetInfo, or bounded by a failed request).
    pub capacity: Option<u64>,
    /// Where [`RecordedRun::capacity`] comes from, in words.
    pub capacity_source: &'static str,
    /// The allocator's reserved bytes at each refused request (after its flush).
    pub reserved_at_refusals: Vec<u64>,
    pub device_total: Option<u64>,
    pub recorded_ooms: u64,
    pub recorded_peak_reserved: u64,
}

impl RecordedRun {
    fn settings(&self) -> Settings {
        self.settings.unwrap_or(Settings {
            conf: AllocConf::default(),
            expandable: false,
            gc_threshold: None,
        })
    }

    fn mallocs(&self) -> usize {
        self.placed.len()
    }
}

/// Settings from a PYTORCH_CUDA_ALLOC_CONF value.
pub fn parse_settings(text: &str) -> Settings {
    let gc_threshold = text.split(',').find_map(|item| {
        let (k, v) = item.split_once(':')?;
        (k.trim() == "garbage_collection_threshold")
            .then(|| v.trim().parse::<f64>().ok())
            .flatten()
            .filter(|t| *t > 0.0 && *t < 1.0)
    });
    Settings {
        conf: AllocConf::parse(text),
        expandable: AllocConf::expandable_from_env(|_| Some(text)),
        gc_threshold,
    }
}

/// Builds one device's run from the calls.
#[derive(Default)]
struct Builder {
    run: RecordedRun,
    live: HashMap<u64, u32>,
    handles: u32,
    /// A cudaMalloc failed since the last malloc: its cudaFrees are the retry's release.
    failed_since_malloc: bool,
    /// A device allocation failed and none succeeded after it (yet): the request it was for,
    /// refused unless a retry succeeds.
    refusal: Option<u64>,
    /// The reserved bytes when the refusal was seen.
    refusal_reserved: u64,
    last_stream: u64,
    released_since_malloc: bool,
    segment_sizes: HashMap<u64, u64>,
    reserved: u64,
    capacity_seen: Option<u64>,
    capacity_bound: Option<u64>,
    /// Physical pages made and not yet mapped (expandable segments map a request's pages once
    /// it has them all).
    unmapped: u64,
    /// Segments of private pools (an imported snapshot's `segment_pool_id`): address -> (size,
    /// pool). A block placed in one was routed to that pool.
    private: std::collections::BTreeMap<u64, (u64, crate::model::pools::PoolId)>,
}

impl Builder {
    /// `unused`: every device allocation is the allocator's (a snapshot's), also those no
    /// block was seen in yet (a small pool's segment is 2 MiB, a large pool's never is).
    fn seed_from(&mut self, layout: &Layout, device: i32, unused: bool) {
        for s in layout
            .segment_maps(unused)
            .into_iter()
            .filter(|s| s.device == device)
        {
            let pool = s.pool.unwrap_or(if s.size == SMALL_SEGMENT {
                Pool::Small
            } else {
                Pool::Large
            });
            let blocks: Vec<(u64, u64)> = s
                .runs
                .iter()
                .filter(|r| matches!(r.kind, RunKind::Allocated | RunKind::Pending))
                .map(|r| (r.addr, r.size))
                .collect();
            for &(addr, _) in &blocks {
                self.live.insert(addr, self.handles);
                self.handles += 1;
            }
            let stream = layout.segment_stream(s.addr).unwrap_or(0);
            if let Some(id) = s.pool_id {
                self.private.insert(s.addr, (s.size, id));
            }
            self.run.seed.push(SeedSegment {
                addr: s.addr,
                size: s.size,
                pool,
                stream: s.pool_id.map_or(stream, |id| private_stream(id, stream)),
                blocks,
            });
            self.reserved += s.size;
            self.segment_sizes.insert(s.addr, s.size);
        }
        self.run.recorded_peak_reserved = self.reserved;
    }

    /// The stream a block at `ptr` was simulated on: its own, or its private pool's.
    fn routed(&self, ptr: u64, stream: u64) -> u64 {
        match self.private.range(..=ptr).next_back() {
            Some((&addr, &(size, id))) if ptr < addr + size => private_stream(id, stream),
            _ => stream,
        }
    }

    /// A failed device allocation no retry made good: PyTorch refused the request.
    fn settle_refusal(&mut self) {
        if let Some(size) = self.refusal.take() {
            self.run.refused.push(self.run.requests.len());
            self.run.reserved_at_refusals.push(self.refusal_reserved);
            self.run.requests.push(Request::Malloc {
                size,
                stream: self.last_stream,
            });
            self.run.placed.push(0);
            self.handles += 1;
        }
    }

    /// `routed`: the private pool a capture routes the call's stream to now.
    fn call(&mut self, e: &Event, routed: Option<crate::model::pools::PoolId>) {
        let spec = e.op.spec();
        if spec.space == Space::Device && spec.library == Library::Driver {
            // The allocator's segments come from the runtime (cudaMalloc); a driver call of
            // device memory is the one inside it, or another library's own (cuBLAS's
            // workspace): neither is a request of the allocator's.
            return;
        }
        if spec.class == OpClass::Alloc && e.ret != 0 && e.ret != OUT_OF_MEMORY {
            // Refused for another reason (a handle type not permitted): no memory asked.
            return;
        }
        if matches!(spec.class, OpClass::BlockAlloc | OpClass::BlockFree) {
            self.settle_refusal();
        }
        match (spec.class, spec.space) {
            (OpClass::BlockAlloc, _) => {
                self.last_stream = e.aux0;
                self.live.insert(e.ptr, self.handles);
                self.handles += 1;
                let stream = match routed {
                    Some(id) => private_stream(id, e.aux0),
                    None => self.routed(e.ptr, e.aux0),
                };
                self.run.requests.push(Request::Malloc {
                    size: e.size,
                    stream,
                });
                self.run.placed.push(e.ptr);
                self.failed_since_malloc = false;
                self.released_since_malloc = false;
            }
            (OpClass::BlockFree, _) => {
                if let Some(handle) = self.live.remove(&e.ptr) {
                    self.run.requests.push(Request::Free { handle });
                }
            }
            (OpClass::Alloc, Space::Device | Space::Handle) if e.ret != 0 => {
                self.failed_since_malloc = true;
                // A refused page of an expandable segment comes after the pages the same
                // request made (given back as it fails): the request was at least all of them.
                let made = if e.space() == Space::Handle {
                    self.unmapped
                } else {
                    0
                };
                self.refusal = Some(made + e.size);
                self.refusal_reserved = self.reserved;
                // A refused segment bounds the capacity, and so does a refused page with the
                // pages its request made before it (they hold memory no mapping shows yet).
                let bound = self
                    .reserved
                    .saturating_add(made + e.size)
                    .saturating_sub(1);
                self.capacity_bound = Some(self.capacity_bound.map_or(bound, |b| b.min(bound)));
            }
            (OpClass::Alloc, Space::Device) => {
                self.refusal = None;
                if let Some(id) = crate::model::pools::pool_id_in_aux1(e.aux1) {
                    self.private.insert(e.ptr, (e.size, id));
                }
                self.run.device_allocs.push((e.ptr, e.size));
                self.segment_sizes.insert(e.ptr, e.size);
                self.grew(e.size);
            }
            (OpClass::Alloc, Space::Handle) if e.ret == 0 => self.unmapped += e.size,
            (OpClass::Free, Space::Handle) if e.ret == 0 => {
                self.unmapped = self.unmapped.saturating_sub(e.size)
            }
            (OpClass::Alloc, Space::Mapping) if e.ret == 0 => {
                self.unmapped = 0;
                self.refusal = None;
                self.run.device_allocs.push((e.ptr, e.size));
                self.grew(e.size);
            }
            (OpClass::Alloc, Space::AddressRange) if e.ret == 0 => self.run.reserves.push(e.ptr),
            (OpClass::Free, Space::Device) if e.ret == 0 => {
                self.private.remove(&e.ptr);
                self.reserved = self
                    .reserved
                    .saturating_sub(self.segment_sizes.remove(&e.ptr).unwrap_or(0));
                self.released();
            }
            (OpClass::Free, Space::Mapping) if e.ret == 0 => {
                self.reserved = self.reserved.saturating_sub(e.size);
                self.released();
            }
            (OpClass::MemInfo, _) if e.ret == 0 && e.aux1 > 0 => {
                let capacity = e.aux0.saturating_add(self.reserved);
                self.capacity_seen = Some(self.capacity_seen.map_or(capacity, |c| c.min(capacity)));
                let total = self.run.device_total.unwrap_or(0).max(e.aux1);
                self.run.device_total = Some(total);
            }
            _ => {}
        }
    }

    fn grew(&mut self, size: u64) {
        self.reserved = self.reserved.saturating_add(size);
        self.run.recorded_peak_reserved = self.run.recorded_peak_reserved.max(self.reserved);
    }

    /// Memory went back to the device not on a failed request's retry: the program released
    /// the cache (torch.cuda.empty_cache()), once per burst.
    fn released(&mut self) {
        if !self.failed_since_malloc && !self.released_since_malloc {
            self.run.requests.push(Request::EmptyCache);
        }
        self.released_since_malloc = true;
    }

    fn finish(mut self) -> RecordedRun {
        self.settle_refusal();
        (self.run.capacity, self.run.capacity_source) =
            match (self.capacity_seen, self.capacity_bound) {
                (Some(a), Some(b)) if a <= b => (Some(a), CAPACITY_SEEN),
                (_, Some(b)) => (Some(b), CAPACITY_BOUND),
                (a, None) => (a, CAPACITY_SEEN),
            };
        self.run
    }
}

/// The process (the one with an OOM, else the most requests) and device (its most requests)
/// to replay, unless given.
fn choose(conn: &rusqlite::Connection, session: i64, pid: Option<u32>) -> Result<u32> {
    if let Some(p) = pid {
        return Ok(p);
    }
    if let Some(m) = events::messages(conn, session)?
        .into_iter()
        .find(|m| m.op == Op::TorchOom.name())
    {
        return Ok(m.pid);
    }
    let mut requests: HashMap<u32, u64> = HashMap::new();
    let begin = super::begin(conn, session, i64::MIN, None)?;
    super::walk_calls(conn, session, &begin, i64::MAX, None, |e| {
        if e.class() == OpClass::BlockAlloc {
            *requests.entry(e.pid).or_default() += 1;
        }
    })?;
    let busiest = requests
        .into_iter()
        .max_by_key(|&(pid, n)| (n, pid))
        .map(|(pid, _)| pid);
    busiest.ok_or_else(|| {
        user_error(format!(
            "session {session} holds no pytorch:malloc events: whatif replays PyTorch's allocator requests (trace a PyTorch job, or import a memory snapshot with `tracer import --snapshot`)"
        ))
    })
}

/// One process's requests on one device (its busiest, unless given), from the session's start
/// or from the state a keyframe or a snapshot's rebuilt past holds.
pub fn recorded_run(
    db: &Path,
    session: Option<i64>,
    pid: Option<u32>,
    device: Option<i32>,
) -> Result<(i64, RecordedRun)> {
    let store = Store::open(db, Access::ReadOnly)?;
    let conn = store.conn();
    let info = events::session(conn, session)?;
    let pid = choose(conn, info.id, pid)?;
    let run = recorded_run_on(conn, info.id, pid, device)?;
    Ok((info.id, run))
}

/// [`recorded_run`] of `pid` in `session`, read through `conn` by a walk of its own.
fn recorded_run_on(
    conn: &rusqlite::Connection,
    session: i64,
    pid: u32,
    device: Option<i32>,
) -> Result<RecordedRun> {
    let begin = super::begin(conn, session, i64::MIN, Some(pid))?;
    let mut recordings = Recordings::new(conn, session, &begin)?;
    super::walk_calls(conn, session, &begin, i64::MAX, Some(pid), |e| {
        recordings.call(e);
    })?;
    recordings.take(conn, session, pid, device)
}

/// The recorded runs of the processes whose calls a walk hands on, built as it goes: a walk of
/// their own ([`recorded_run`]) or one made for something else (explain's, which then cites
/// its fixes without a second).
pub struct Recordings {
    snapshot: bool,
    confs: HashMap<u32, String>,
    /// Per process: where the requests begin after a snapshot's rebuilt past.
    begins_ns: HashMap<u32, i64>,
    /// Per process: the state the walk starts from (its keyframe's).
    starts: HashMap<u32, Layout>,
    keyframe: bool,
    runs: HashMap<u32, RunRecording>,
}

/// One process's run being built.
struct RunRecording {
    past: Layout,
    begins_ns: Option<i64>,
    builders: HashMap<i32, Builder>,
    /// What the process's captures route where (the builders are per device; a capture's
    /// calls may name none).
    captures: crate::model::pools::Captures,
    /// The pools marked use_on_oom the replays were last told of.
    on_oom: Vec<crate::model::pools::PoolId>,
    seeded: bool,
    snapshot: bool,
}

impl Recordings {
    /// For a walk of `session` that starts at `begin`.
    pub fn new(
        conn: &rusqlite::Connection,
        session: i64,
        begin: &super::Begin,
    ) -> Result<Recordings> {
        // The requests begin where the trace saw the allocator from: after a snapshot's
        // rebuilt past, or at the keyframe the walk starts from.
        let mut begins_ns: HashMap<u32, i64> = HashMap::new();
        for g in series::gaps(conn, session)? {
            if g.unseen_start() {
                let t = begins_ns.entry(g.pid).or_insert(g.to_ns);
                *t = (*t).max(g.to_ns);
            }
        }
        Ok(Recordings {
            snapshot: events::source(conn, session)?.starts_with("snapshot"),
            confs: events::alloc_confs(conn, session)?,
            begins_ns,
            starts: begin
                .states
                .iter()
                .map(|s| (s.pid, s.layout.clone()))
                .collect(),
            keyframe: begin.keyframe().is_some(),
            runs: HashMap::new(),
        })
    }

    pub fn call(&mut self, e: &Event) {
        let run = self.runs.entry(e.pid).or_insert_with(|| {
            let begins_ns = self.begins_ns.get(&e.pid).copied();
            let settings = parse_settings(self.confs.get(&e.pid).map_or("", String::as_str));
            RunRecording {
                past: self
                    .starts
                    .get(&e.pid)
                    .cloned()
                    .unwrap_or_else(|| Layout::new(settings.conf)),
                begins_ns,
                builders: HashMap::new(),
                captures: self
                    .starts
                    .get(&e.pid)
                    .map(|l| l.captures.clone())
                    .unwrap_or_default(),
                on_oom: Vec::new(),
                seeded: begins_ns.is_none() && !self.keyframe,
                snapshot: self.snapshot,
            }
        });
        run.call(e);
    }

    /// The run of `pid` on `device` (its busiest, unless given), taken out of the recordings.
    pub fn take(
        &mut self,
        conn: &rusqlite::Connection,
        session: i64,
        pid: u32,
        device: Option<i32>,
    ) -> Result<RecordedRun> {
        let builders = self
            .runs
            .remove(&pid)
            .map(|r| r.builders)
            .unwrap_or_default();
        let conf_text = self.confs.get(&pid).cloned().unwrap_or_default();
        finish_run(conn, session, pid, device, builders, conf_text)
    }
}

impl RunRecording {
    /// Tells every device's replay which pools an OOM may now fall back on.
    fn use_on_oom_changed(&mut self, device: i32) {
        let now = self.captures.use_on_oom();
        if now == self.on_oom {
            return;
        }
        self.builders.entry(device).or_default();
        for b in self.builders.values_mut() {
            for id in self.on_oom.iter().filter(|id| !now.contains(id)) {
                b.run
                    .requests
                    .push(Request::PoolUseOnOom(private_stream(*id, 0), false));
            }
            for id in now.iter().filter(|id| !self.on_oom.contains(id)) {
                b.run
                    .requests
                    .push(Request::PoolUseOnOom(private_stream(*id, 0), true));
            }
        }
        self.on_oom = now;
    }

    fn call(&mut self, e: &Event) {
        if !self.seeded {
            if self.begins_ns.is_some_and(|t| e.ts_ns < t) {
                self.past.apply(e);
                return;
            }
            self.seeded = true;
            let devices: std::collections::BTreeSet<i32> = self
                .past
                .segment_maps(true)
                .iter()
                .map(|s| s.device)
                .collect();
            for d in devices {
                self.builders
                    .entry(d)
                    .or_default()
                    .seed_from(&self.past, d, self.snapshot);
            }
            self.captures = self.past.captures.clone();
            // Pools marked use_on_oom before the requests begin still serve a refused one.
            self.use_on_oom_changed(e.device);
        }
        let was = self.captures.underway();
        // The pool a reset may free, or a capture hold again.
        let pool = match e.class() {
            OpClass::PoolReset => self.captures.pool_of_graph(e.ptr),
            OpClass::PoolRelease => Some((e.aux0, e.aux1)),
            _ => None,
        };
        self.captures.apply(e);
        let announced = match e.class() {
            OpClass::PoolCapture => self.captures.pool_of_graph(e.ptr),
            OpClass::CaptureBegin | OpClass::PoolRoute => self.captures.route(e.tid, e.aux0),
            _ => None,
        };
        for (id, freeable) in pool
            .filter(|&id| self.captures.pool(id).is_some_and(|p| p.freeable()))
            .map(|id| (id, true))
            .into_iter()
            .chain(announced.map(|id| (id, false)))
        {
            self.builders.entry(e.device).or_default();
            for b in self.builders.values_mut() {
                b.run
                    .requests
                    .push(Request::PoolFreeable(private_stream(id, 0), freeable));
            }
        }
        if e.class() == OpClass::PoolOnOom || e.class() == OpClass::PoolRelease {
            self.use_on_oom_changed(e.device);
        }
        if self.captures.underway() != was {
            // Every device's replay: PyTorch's no-flush rule holds for the whole process.
            let underway = self.captures.underway();
            self.builders.entry(e.device).or_default();
            for b in self.builders.values_mut() {
                b.run.requests.push(Request::CapturesUnderway(underway));
            }
        }
        let routed = self.captures.route(e.tid, e.aux0);
        self.builders.entry(e.device).or_default().call(e, routed);
    }
}

/// The run of `pid` on `device` from its builders: its settings, OOMs and refused requests.
fn finish_run(
    conn: &rusqlite::Connection,
    session: i64,
    pid: u32,
    device: Option<i32>,
    mut builders: HashMap<i32, Builder>,
    conf_text: String,
) -> Result<RecordedRun> {
    let settings = parse_settings(&conf_text);
    let device = match device {
        Some(d) => d,
        None => builders
            .iter()
            .max_by_key(|(_, b)| b.run.placed.len())
            .map(|(&d, _)| d)
            .unwrap_or(0),
    };
    let mut run = builders.remove(&device).unwrap_or_default().finish();
    if run.placed.is_empty() {
        return Err(user_error(format!(
            "pid {pid} made no pytorch:malloc on device {device} in session {}: name another with --pid or --device",
            session
        )));
    }
    run.pid = pid;
    run.device = device;
    // Address ranges reserved and pages mapped are expandable segments, whatever the
    // environment said (an allocator can turn them on in code).
    let (conf_text, settings) = if !run.reserves.is_empty() && !settings.expandable {
        let text = if conf_text.is_empty() {
            "expandable_segments:True".to_owned()
        } else {
            format!("{conf_text},expandable_segments:True")
        };
        let settings = parse_settings(&text);
        (text, settings)
    } else {
        (conf_text, settings)
    };
    run.conf_text = conf_text;
    run.settings = Some(settings);
    let ooms: Vec<_> = events::messages(conn, session)?
        .into_iter()
        .filter(|m| m.pid == pid && m.op == Op::TorchOom.name())
        .collect();
    // Without PyTorch's message, the requests it refused are its OOMs all the same.
    run.recorded_ooms = (ooms.len()).max(run.refused.len()) as u64;
    // The device's free bytes at the failure, as PyTorch's message (or a snapshot's oom entry)
    // says them, beside what the allocator held then: the best capacity there is.
    let said: Option<u64> = run
        .reserved_at_refusals
        .iter()
        .zip(&ooms)
        .filter_map(|(&reserved, m)| {
            snapshot_free_said(&m.text)
                .or_else(|| free_said(&m.text))
                .map(|free| reserved + free)
        })
        .min();
    if let Some(capacity) = said {
        run.capacity = Some(capacity);
        run.capacity_source = CAPACITY_SAID;
    }
    // A refused page (expandable segments) says little of the request: PyTorch's message says
    // how much it tried to allocate (to its two decimals).
    for (&i, m) in run.refused.iter().zip(&ooms) {
        if let (Some(asked), Some(Request::Malloc { size, .. })) =
            (pytorch_tried(&m.text), run.requests.get_mut(i))
        {
            *size = (*size).max(asked);
        }
    }
    Ok(run)
}

/// Where the capacity comes from.
const CAPACITY_SAID: &str = "the device's free bytes at the failure by PyTorch's message (or the snapshot's oom entry), beside what the allocator held";
const CAPACITY_SEEN: &str = "cudaMemGetInfo's free bytes beside what the allocator held";
const CAPACITY_BOUND: &str =
    "an upper bound: the request the device refused, beside what the allocator held";

/// Whether the simulator, under the recorded settings, made the recorded run's decisions.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct Fidelity {
    pub holds: bool,
    pub device_allocs_recorded: usize,
    pub device_allocs_simulated: usize,
    /// The first device allocation that differs (index, recorded size, simulated size).
    pub first_device_divergence: Option<(usize, u64, u64)>,
    pub placements_matched: usize,
    pub placements: usize,
    /// The first malloc placed elsewhere (index, recorded address, simulated address).
    pub first_placement_divergence: Option<(usize, u64, u64)>,
    /// The share the gate asks for: all of them from an empty allocator.
    pub required_share: f64,
    /// The requests PyTorch refused, and those the simulator refuses (the first ten).
    pub refused_recorded: Vec<usize>,
    pub refused_simulated: Vec<usize>,
}

/// Runs the recorded settings against the recorded decisions.
pub fn fidelity(run: &RecordedRun) -> Fidelity {
    let settings = run.settings();
    let addresses = if settings.expandable {
        run.reserves.clone()
    } else {
        run.device_allocs.iter().map(|&(a, _)| a).collect()
    };
    let capacity = run.capacity.unwrap_or(u64::MAX / 4);
    let mut sim = Simulator::new(
        settings,
        capacity,
        run.device_total.unwrap_or(capacity),
        addresses,
    )
    .recording();
    sim.seed(&run.seed);
    let (outcome, placed, sizes) = sim.run(&run.requests);
    let (placed, sizes) = (placed.unwrap_or_default(), sizes.unwrap_or_default());
    let recorded: Vec<u64> = run.device_allocs.iter().map(|&(_, s)| s).collect();
    let first_device_divergence = (0..recorded.len().max(sizes.len()))
        .find(|&i| recorded.get(i) != sizes.get(i))
        .map(|i| {
            (
                i,
                recorded.get(i).copied().unwrap_or(0),
                sizes.get(i).copied().unwrap_or(0),
            )
        });
    let matched = run
        .placed
        .iter()
        .zip(&placed)
        .filter(|(a, b)| a == b)
        .count();
    let first_placement_divergence = run
        .placed
        .iter()
        .zip(&placed)
        .position(|(a, b)| a != b)
        .map(|i| (i, run.placed[i], placed[i]));
    let refused_simulated: Vec<usize> = outcome.refused.iter().take(10).copied().collect();
    let refused_recorded: Vec<usize> = run.refused.iter().take(10).copied().collect();
    let required_share = if run.seed.is_empty() { 1.0 } else { GATE_SHARE };
    let share = matched as f64 / run.mallocs().max(1) as f64;
    Fidelity {
        holds: first_device_divergence.is_none()
            && share >= required_share
            && refused_recorded == refused_simulated,
        device_allocs_recorded: recorded.len(),
        device_allocs_simulated: sizes.len(),
        first_device_divergence,
        placements_matched: matched,
        placements: run.mallocs(),
        first_placement_divergence,
        required_share,
        refused_recorded,
        refused_simulated,
    }
}

/// The run as recorded, replayed as the gate replays it (the recorded settings, the device's
/// own segment addresses): the "as run" row and what every setting is compared with.
pub fn as_run(run: &RecordedRun, capacity: u64) -> Outcome {
    let settings = run.settings();
    let addresses = if settings.expandable {
        run.reserves.clone()
    } else {
        run.device_allocs.iter().map(|&(a, _)| a).collect()
    };
    let mut sim = Simulator::new(
        settings,
        capacity,
        run.device_total.unwrap_or(capacity),
        addresses,
    );
    sim.seed(&run.seed);
    sim.run(&run.requests).0
}

/// The recorded settings with `setting` added; none when the run already had it.
pub fn with_setting(recorded: &str, setting: &str) -> Option<String> {
    let had = |item: &&str| recorded.split(',').any(|r| r.trim() == item.trim());
    let new: Vec<&str> = setting.split(',').filter(|item| !had(item)).collect();
    if new.is_empty() {
        return None;
    }
    let mut all: Vec<&str> = recorded
        .split(',')
        .filter(|r| !r.trim().is_empty())
        .collect();
    all.extend(new);
    Some(all.join(","))
}

/// The run under `settings` on a device where the allocator may hold `capacity` bytes.
pub fn simulate(run: &RecordedRun, settings: Settings, capacity: u64) -> Outcome {
    let mut sim = Simulator::new(
        settings,
        capacity,
        run.device_total.unwrap_or(capacity),
        Vec::new(),
    );
    sim.seed(&run.seed);
    sim.run(&run.requests).0
}

/// The least memory the allocator needs under `settings` for the run to end without an OOM,
/// to [`SEARCH_STEP`] (a search: taken as monotonic, which allocators nearly are).
pub fn least_memory(run: &RecordedRun, settings: Settings) -> u64 {
    let unlimited = simulate(run, settings, u64::MAX / 4);
    let (mut lo, mut hi) = (unlimited.peak_allocated, unlimited.peak_reserved.max(1));
    while hi - lo > SEARCH_STEP {
        let mid = lo + (hi - lo) / 2;
        if simulate(run, settings, mid).oom.is_some() {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    hi.div_ceil(SEARCH_STEP) * SEARCH_STEP
}

/// The settings tried by default, each added to what the job ran with: PyTorch's documented
/// remedies for fragmentation and their useful pairs.
pub const CANDIDATES: [&str; 11] = [
    "expandable_segments:True",
    "max_split_size_mb:64",
    "max_split_size_mb:128",
    "max_split_size_mb:256",
    "max_split_size_mb:512",
    "roundup_power2_divisions:4",
    "roundup_power2_divisions:16",
    "garbage_collection_threshold:0.8",
    "max_split_size_mb:128,garbage_collection_threshold:0.8",
    "expandable_segments:True,roundup_power2_divisions:4",
    "max_split_size_mb:256,roundup_power2_divisions:4",
];

/// What to replay, and under which settings.
#[derive(Clone, Debug, Default)]
pub struct WhatIfQuery {
    pub session: Option<i64>,
    pub pid: Option<u32>,
    pub device: Option<i32>,
    /// Settings to try (default: [`CANDIDATES`]), each added to the recorded ones.
    pub confs: Vec<String>,
    /// Search each setting's least memory.
    pub search: bool,
}

/// One setting's simulated run.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct WhatIfRow {
    /// PYTORCH_CUDA_ALLOC_CONF as simulated ("" for PyTorch's defaults).
    pub conf: String,
    pub recorded_settings: bool,
    /// The first request that fails on the recorded device (index among the requests).
    pub oom_request: Option<usize>,
    pub oom_size: Option<u64>,
    pub peak_reserved: u64,
    pub peak_allocated: u64,
    pub peak_cached: u64,
    pub device_allocs: u64,
    pub retries: u64,
    /// The least memory the allocator needs for no OOM under these settings (not searched:
    /// absent).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub least_memory: Option<u64>,
}

/// The run without the requests CUDA graphs' captures made (their pools never taken), under
/// the recorded settings: an estimate, since the eager requests each graph's replays stand in
/// for were never made and are not in it. Pools a snapshot's trace began with stay.
pub fn without_graphs(run: &RecordedRun, capacity: u64) -> Option<WhatIfRow> {
    let private = |stream: u64| stream & crate::model::simulator::PRIVATE_POOL_STREAM != 0;
    if !run
        .requests
        .iter()
        .any(|r| matches!(r, Request::Malloc { stream, .. } if private(*stream)))
    {
        return None;
    }
    let requests: Vec<Request> = run
        .requests
        .iter()
        .filter(|r| {
            !matches!(
                r,
                Request::CapturesUnderway(_)
                    | Request::PoolFreeable(..)
                    | Request::PoolUseOnOom(..)
            )
        })
        .map(|r| match r {
            Request::Malloc { stream, .. } if private(*stream) => Request::Skipped,
            other => *other,
        })
        .collect();
    let estimate = RecordedRun {
        requests,
        ..run.clone()
    };
    let mut row = row(&estimate, &run.conf_text, false, capacity, false);
    row.recorded_settings = true;
    Some(row)
}

/// The answer: the recorded run, whether the simulator reproduces it, and each setting.
#[derive(Clone, Debug, Serialize)]
pub struct WhatIf {
    pub session: i64,
    pub pid: u32,
    pub device: i32,
    pub recorded_conf: String,
    pub requests: usize,
    pub mallocs: usize,
    /// Blocks live when the requests begin (a keyframe's or a snapshot's rebuilt state).
    pub seeded_blocks: usize,
    pub capacity: Option<u64>,
    pub capacity_source: &'static str,
    pub recorded_ooms: u64,
    pub recorded_peak_reserved: u64,
    pub fidelity: Fidelity,
    /// The recorded settings without the captures' requests (an estimate, said so), where the
    /// run captured CUDA graphs.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub without_graphs: Option<WhatIfRow>,
    pub rows: Vec<WhatIfRow>,
}

/// Replays the session's requests under the recorded settings and each of `q.confs`.
pub fn whatif(db: &Path, q: &WhatIfQuery) -> Result<WhatIf> {
    let (session, run) = recorded_run(db, q.session, q.pid, q.device)?;
    let fidelity = fidelity(&run);
    let capacity = run.capacity.unwrap_or(u64::MAX / 4);
    let tried: Vec<String> = if q.confs.is_empty() {
        CANDIDATES.iter().map(|c| c.to_string()).collect()
    } else {
        q.confs.clone()
    };
    let mut confs = vec![(run.conf_text.clone(), true)];
    for c in tried {
        if let Some(text) = with_setting(&run.conf_text, &c) {
            confs.push((text, false));
        }
    }
    let rows = std::thread::scope(|scope| {
        let handles: Vec<_> = confs
            .iter()
            .map(|(conf, recorded)| {
                let run = &run;
                scope.spawn(move || row(run, conf, *recorded, capacity, q.search))
            })
            .collect();
        handles
            .into_iter()
            .filter_map(|h| h.join().ok())
            .collect::<Vec<_>>()
    });
    Ok(WhatIf {
        session,
        pid: run.pid,
        device: run.device,
        recorded_conf: run.conf_text.clone(),
        requests: run.requests.len(),
        mallocs: run.mallocs(),
        seeded_blocks: run.seed.iter().map(|s| s.blocks.len()).sum(),
        capacity: run.capacity,
        capacity_source: run.capacity_source,
        recorded_ooms: run.recorded_ooms,
        recorded_peak_reserved: run.recorded_peak_reserved,
        without_graphs: without_graphs(&run, capacity),
        fidelity,
        rows,
    })
}

fn row(run: &RecordedRun, conf: &str, recorded: bool, capacity: u64, search: bool) -> WhatIfRow {
    let settings = parse_settings(conf);
    let o = if recorded {
        as_run(run, capacity)
    } else {
        simulate(run, settings, capacity)
    };
    WhatIfRow {
        conf: conf.to_owned(),
        recorded_settings: recorded,
        oom_request: o.oom.map(|(i, _)| i),
        oom_size: o.oom.map(|(_, s)| s),
        peak_reserved: o.peak_reserved,
        peak_allocated: o.peak_allocated,
        peak_cached: o.peak_cached,
        device_allocs: o.device_allocs,
        retries: o.retries,
        least_memory: search.then(|| least_memory(run, settings)),
    }
}

/// explain simulates the settings its fixes name only for runs up to this many requests (a
/// simulation per setting; `tracer whatif` takes any size).
const CITE_REQUESTS: usize = 1_000_000;

/// Appends to each fix of `chains` that names an allocator setting what the simulator says the
/// recorded requests would have done under it, beside what they did as run; or why it could
/// not say.
pub fn cite_in_fixes(
    conn: &rusqlite::Connection,
    session: i64,
    chains: &mut [crate::analysis::Chain],
    mut recorded: Option<Recordings>,
) -> Result<()> {
    // Per process: its run, what the run did as simulated, and whether the gate holds (each
    // computed once, however many chains cite it).
    let mut runs: HashMap<u32, Option<(RecordedRun, Outcome, bool)>> = HashMap::new();
    for chain in chains.iter_mut().filter(|c| c.rule.cites_settings()) {
        if !chain.fix.iter().any(|f| f.setting.is_some()) {
            continue;
        }
        let entry = match runs.entry(chain.pid) {
            std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::hash_map::Entry::Vacant(v) => {
                // From the walk that made the chains where it saw the whole run, else a walk
                // of the process's calls from the session's start.
                let run = match recorded.as_mut() {
                    Some(r) => r.take(conn, session, chain.pid, None),
                    None => recorded_run_on(conn, session, chain.pid, None),
                };
                let run = run.ok().filter(|run| run.requests.len() <= CITE_REQUESTS);
                v.insert(run.map(|run| {
                    let capacity = run.capacity.unwrap_or(u64::MAX / 4);
                    let as_run = as_run(&run, capacity);
                    let holds = fidelity(&run).holds;
                    (run, as_run, holds)
                }))
            }
        };
        let Some((run, as_run, holds)) = entry.as_ref() else {
            continue;
        };
        let holds = *holds;
        let mut disproved = Vec::new();
        chain.fix.retain_mut(|fix| {
            let Some(setting) = fix.setting else {
                return true;
            };
            if !holds {
                fix.text.to_mut().push_str(" [not simulated: the simulator does not reproduce this run's decisions (`tracer whatif` shows where)]");
                return true;
            }
            // A setting the run already had is no fix of it.
            let Some(conf) = with_setting(&run.conf_text, setting) else {
                return false;
            };
            let capacity = run.capacity.unwrap_or(u64::MAX / 4);
            let o = simulate(run, parse_settings(&conf), capacity);
            if let Some((i, _)) = o.oom {
                // Replayed, it still runs out of memory: not a fix, said after those that help.
                disproved.push(crate::analysis::Fix::from(format!(
                    "not a fix: PYTORCH_CUDA_ALLOC_CONF={setting} would not have avoided it (replayed from the {} recorded requests: an OOM at request {i}; as run: {})",
                    run.requests.len(),
                    ending(as_run)
                )));
                return false;
            }
            fix.text.to_mut().push_str(&format!(
                " [simulated from the {} recorded requests: {}, peak reserved {}; as run: {}, peak reserved {} (`tracer whatif`)]",
                run.requests.len(),
                ending(&o),
                crate::units::format_bytes(o.peak_reserved),
                ending(as_run),
                crate::units::format_bytes(as_run.peak_reserved)
            ));
            true
        });
        chain.fix.extend(disproved);
    }
    Ok(())
}

fn ending(o: &Outcome) -> String {
    match o.oom {
        Some((i, _)) => format!("an OOM at request {i}"),
        None => "no OOM".to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A candidate is added to what the run had, never the recorded setting a second time.
    #[test]
    fn the_recorded_setting_is_not_added_to_itself() {
        assert_eq!(
            with_setting("", "max_split_size_mb:128").as_deref(),
            Some("max_split_size_mb:128")
        );
        assert_eq!(
            with_setting("expandable_segments:True", "expandable_segments:True"),
            None
        );
        assert_eq!(
            with_setting(
                "expandable_segments:True",
                "expandable_segments:True,roundup_power2_divisions:4"
            )
            .as_deref(),
            Some("expandable_segments:True,roundup_power2_divisions:4")
        );
        assert_eq!(
            with_setting("max_split_size_mb:256", "garbage_collection_threshold:0.8").as_deref(),
            Some("max_split_size_mb:256,garbage_collection_threshold:0.8")
        );
    }

    #[test]
    fn pytorchs_message_gives_the_request_and_the_free_bytes() {
        assert_eq!(
            pytorch_tried("CUDA out of memory. Tried to allocate 1.50 GiB. GPU 0 has"),
            Some(3 << 29)
        );
        assert_eq!(pytorch_tried("Tried to allocate 512 bytes."), Some(512));
        assert_eq!(
            free_said("Tried to allocate 20.00 MiB. GPU 0 has a total capacity of 79.19 GiB of which 10.50 MiB is free."),
            Some(10_500 * 1024 * 1024 / 1000)
        );
        assert_eq!(
            free_said("CUDA out of memory. Tried to allocate 100.00 MiB. GPU 0 has 10.00 MiB free (PyTorch's memory snapshot)"),
            Some(10 << 20)
        );
        assert_eq!(free_said("Tried to allocate 2.00 MiB."), None);
        assert_eq!(pytorch_tried("out of memory"), None);
        let s = parse_settings(
            "expandable_segments:True,garbage_collection_threshold:0.8,max_split_size_mb:128",
        );
        assert!(s.expandable);
        assert_eq!(s.gc_threshold, Some(0.8));
        assert_eq!(s.conf.max_split_size, 128 << 20);
        assert_eq!(
            parse_settings("garbage_collection_threshold:1.5").gc_threshold,
            None
        );
    }
}
