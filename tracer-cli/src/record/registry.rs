//! The process registry, beside the reader: what a call's numbers do not say, read while the
//! process lives. At a process's first call: its /proc metadata, its threads for the scheduler
//! programs, its interpreter for the Python frame walk; for each new call site: its code objects
//! and native frames (--stack). Then the calls go on to the writer.

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
    attach::{Followed, PyProcs},
    join::Join,
    mappings::Notice,
    on_warning::WarningHook,
    pods, procinfo,
    shared::Shared,
    sites::Sites,
    writer::Delivery,
};
use crate::{
    decode::{Call, Record},
    model::{env_map, layout::AllocConf, Event, Rank, NO_DEVICE},
};

/// How often running processes are looked at for interpreters started since (--stack).
const PYTHON_SCAN_EVERY: Duration = Duration::from_secs(1);

/// What the registry is handed: the ring's records, or what the kernel's side band said of
/// processes starting (--stack).
pub enum Inbound {
    Ring(Vec<Record>),
    Processes(Vec<Notice>),
}

/// The interpreters the kernel walks, and what tracer knows of their call sites (--stack).
pub struct Python {
    pub procs: PyProcs,
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
                super::discover::all_pids()
                    .into_iter()
                    .filter(|&pid| super::memmap::maps_any(pid, &probed))
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
                    self.registered_at.entry(pid).or_insert_with(monotonic_ns);
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

/// CLOCK_MONOTONIC in ns: bpf_ktime_get_ns's clock.
fn monotonic_ns() -> u64 {
    nix::time::clock_gettime(nix::time::ClockId::CLOCK_MONOTONIC)
        .map(|t| t.tv_sec() as u64 * 1_000_000_000 + t.tv_nsec() as u64)
        .unwrap_or(0)
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
            let mut pids_seen: HashSet<u32> = HashSet::new();
            let mut last_python_scan = Instant::now();
            loop {
                let records = match rx.recv_timeout(PYTHON_SCAN_EVERY) {
                    Ok(Inbound::Ring(records)) => records,
                    Ok(Inbound::Processes(notices)) => {
                        if let Some(python) = self.python.as_mut() {
                            python.on_notices(notices);
                        }
                        continue;
                    }
                    Err(std::sync::mpsc::RecvTimeoutError::Timeout) => Vec::new(),
                    Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => return Ok(()),
                };
                if let Some(python) = self.python.as_mut() {
                    if last_python_scan.elapsed() >= PYTHON_SCAN_EVERY {
                        last_python_scan = Instant::now();
                        python.scan(shared);
                    }
                }
                if records.is_empty() {
                    continue;
                }
                let delivery = self.enrich(records, &mut pids_seen, boot);
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

    /// Counts the delivery, updates the live figures (firing --on-warning's command on an
    /// early warning) and hands it to the writer.
    fn deliver(
        &mut self,
        delivery: Delivery,
        tx: &SyncSender<Delivery>,
        shared: &Shared,
    ) -> Result<()> {
        shared.events_read.fetch_add(
            (delivery.calls.len() + delivery.messages.len()) as u64,
            Ordering::SeqCst,
        );
        shared
            .calls_before_interpreter
            .store(self.before_interpreter, Ordering::SeqCst);
        if let Ok(mut live) = shared.live.lock() {
            for c in &delivery.calls {
                live.add_one(c.pid, c.op, c.ret, c.size, c.duration_ns);
            }
            for &pid in &delivery.exited {
                live.exited(pid);
            }
        }
        let (Ok(mut allocators), Ok(mut figures)) =
            (shared.allocators.lock(), shared.figures.lock())
        else {
            return Err(anyhow!("the live figures' lock is poisoned"));
        };
        for p in &delivery.processes {
            let env = env_map(p.env.as_deref());
            let get = |k: &str| env.get(k).map(String::as_str);
            let rank = Rank::from_env(get);
            allocators.describe(p.pid, AllocConf::from_env(get), rank);
            figures.describe(
                p.pid,
                p.comm.as_deref().unwrap_or_default(),
                rank.map(|r| r.label()),
                p.cgroup.as_deref().and_then(pods::pod_of),
            );
        }
        for c in &delivery.calls {
            let event = layout_event(c);
            figures.apply(&event);
            let Some(alarm) = allocators.apply(&event) else {
                continue;
            };
            figures.warned(c.pid, alarm.device);
            if let Some(hook) = self.hook.as_mut() {
                hook.fire(
                    c.pid,
                    allocators.rank(c.pid),
                    &alarm,
                    alarm.ts_ns + self.wall_offset_ns,
                );
                shared
                    .on_warning_skipped
                    .store(hook.skipped, Ordering::SeqCst);
            }
        }
        for m in &delivery.messages {
            if m.op.spec().class == tracer_common::OpClass::Oom {
                figures.oom(m.pid, &m.text);
            }
        }
        let now = std::time::Instant::now();
        for &pid in &delivery.exited {
            allocators.exited(pid);
            figures.exited(pid, now);
        }
        drop((allocators, figures));
        tx.send(delivery)
            .map_err(|_| anyhow!("the database writer stopped"))
    }

    fn enrich(
        &mut self,
        records: Vec<Record>,
        pids_seen: &mut HashSet<u32>,
        boot: Option<i64>,
    ) -> Delivery {
        let mut out = Delivery::default();
        for record in records {
            match record {
                Record::Call(mut call) => {
                    if pids_seen.insert(call.pid) {
                        let seen = call.ts_mono_ns as i64 + self.wall_offset_ns;
                        out.processes
                            .push(procinfo::read(call.pid, seen, &call.comm, boot));
                        if let Some(f) = self.followed.as_mut() {
                            f.process_tree(call.pid);
                        }
                        if let Some(python) = self.python.as_mut() {
                            python.sites.first_seen(call.pid);
                            python.register(call.pid);
                        }
                    }
                    self.join.apply(&mut call);
                    if let Some(python) = self.python.as_ref() {
                        if python.before_registration(&call) {
                            self.before_interpreter += 1;
                        }
                    }
                    if let (Some(site), Some(python)) = (call.site.take(), self.python.as_mut()) {
                        call.stack = Some(python.sites.intern(call.pid, *site, &mut out.sites));
                    }
                    out.calls.push(call);
                }
                Record::OffCpu(off) => out.offcpu.push(off),
                Record::Message(m) => out.messages.push(m),
                Record::Exit { pid, .. } => {
                    // Everything it made was read before this record: forget it, so that a
                    // process reusing the pid starts afresh.
                    pids_seen.remove(&pid);
                    self.join.forget_process(pid);
                    if let Some(python) = self.python.as_mut() {
                        python.sites.forget_process(pid);
                        python.registered_at.remove(&pid);
                    }
                    out.exited.push(pid);
                }
            }
        }
        out
    }
}

/// A call as the layout needs it (times are not: the live table shows the present).
fn layout_event(c: &Call) -> Event {
    Event {
        ts_ns: c.ts_mono_ns as i64,
        duration_ns: c.duration_ns,
        size: c.size.unwrap_or(0),
        ptr: c.ptr.unwrap_or(0),
        aux0: c.aux0,
        aux1: c.aux1,
        pid: c.pid,
        tid: c.tid,
        ret: c.ret,
        device: c.device.unwrap_or(NO_DEVICE),
        stack: None,
        op: c.op,
    }
}
