//! The process registry, beside the reader: what a call's numbers do not say, read while the
//! process lives. At a process's first call: its /proc metadata, its threads for the scheduler
//! programs, its interpreter for the Python frame walk; for each new call site: its code objects
//! and native frames (--stack). Then the calls go on to the writer.

use std::{
    collections::HashSet,
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
    on_warning::WarningHook,
    procinfo,
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

/// The interpreters the kernel walks, and what tracer knows of their call sites (--stack).
pub struct Python {
    pub procs: PyProcs,
    pub sites: Sites,
    /// The --pid scope, or every process.
    pub scope: Option<Vec<u32>>,
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
        if let Some(interp) = self.sites.register(pid) {
            if let Err(e) = self.procs.insert(pid, interp) {
                eprintln!("tracer: {e:#}");
            }
        }
    }
}

pub struct Registry {
    pub join: Join,
    pub followed: Option<Followed>,
    pub python: Option<Python>,
    pub wall_offset_ns: i64,
    /// --on-warning's command.
    pub hook: Option<WarningHook>,
}

impl Registry {
    /// Turns the reader's records into deliveries for the writer until the reader is done.
    pub fn run(
        mut self,
        rx: Receiver<Vec<Record>>,
        tx: SyncSender<Delivery>,
        shared: &Shared,
    ) -> Result<()> {
        let result = (|| -> Result<()> {
            let boot = procinfo::boot_time_ns();
            let mut pids_seen: HashSet<u32> = HashSet::new();
            let mut last_python_scan = Instant::now();
            loop {
                let records = match rx.recv_timeout(PYTHON_SCAN_EVERY) {
                    Ok(records) => records,
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
        if let Ok(mut live) = shared.live.lock() {
            for c in &delivery.calls {
                live.add_one(c.pid, c.op, c.ret, c.size, c.duration_ns);
            }
        }
        if let Ok(mut allocators) = shared.allocators.lock() {
            for p in &delivery.processes {
                let env = env_map(p.env.as_deref());
                let get = |k: &str| env.get(k).map(String::as_str);
                allocators.describe(p.pid, AllocConf::from_env(get), Rank::from_env(get));
            }
            for c in &delivery.calls {
                let alarm = allocators.apply(&layout_event(c));
                if let (Some(alarm), Some(hook)) = (alarm, self.hook.as_mut()) {
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
            for &pid in &delivery.exited {
                allocators.exited(pid);
            }
        }
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
                    if let (Some(site), Some(python)) = (call.site.take(), self.python.as_mut()) {
                        call.stack = Some(python.sites.intern(call.pid, *site, &mut out.sites));
                    }
                    out.calls.push(call);
                }
                Record::OffCpu(off) => out.offcpu.push(off),
                Record::Message(m) => out.messages.push(m),
                Record::Exit(pid) => {
                    // Everything it made was read before this record: forget it, so that a
                    // process reusing the pid starts afresh.
                    pids_seen.remove(&pid);
                    self.join.forget_process(pid);
                    if let Some(python) = self.python.as_mut() {
                        python.sites.forget_process(pid);
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
