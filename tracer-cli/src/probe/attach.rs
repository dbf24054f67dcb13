//! Loading the eBPF object and attaching its programs: the entry and return programs to every
//! probed symbol of a library, the USDT program to every PyTorch probe site, the OOM uprobe to
//! PyTorch's OutOfMemoryError constructor.
//!
//! Over 700 lines because loading, attaching by symbol, by USDT site and at the OOM constructor,
//! and the self-test share the loaded object's state.

use std::{
    collections::BTreeMap,
    num::NonZeroU32,
    os::fd::{AsFd as _, OwnedFd},
    path::Path,
};

use anyhow::{anyhow, bail, Context as _, Result};
use aya::{
    maps::{Array, MapData, PerCpuArray, RingBuf},
    programs::{
        trace_point::TracePointLinkId,
        uprobe::{UProbeAttachLocation, UProbeAttachPoint, UProbeScope},
        RawTracePoint, TracePoint, UProbe,
    },
    Ebpf, EbpfLoader,
};
use serde::Serialize;
use tracer_common::{maps as names, maps::Counter, Library, Op};

use super::{
    discover::{Candidate, FileId},
    perf, usdt,
};
use crate::traced::{elf, semaphore};

static EBPF_OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/tracer"));

#[derive(Clone, Copy, Debug)]
pub struct LoadOptions {
    pub ring_bytes: u32,
    /// Bytes waiting before the kernel wakes the reader.
    pub wakeup_bytes: u64,
    /// The benchmark floor: 0 off; 1 count calls only; 2 also read the clock twice a call.
    pub floor: u32,
    /// Capture each call's native and Python call site (--stack).
    pub stack: bool,
    /// Attach the scheduler programs (host context); off only to measure what they cost.
    pub host_context: bool,
    /// PyTorch's allocator probes in every process from the start, or per process when
    /// tracer arms them (`--allocator auto`; `off`: never).
    pub allocator: crate::model::arming::Mode,
}

/// One library as attached (stored with the session as JSON).
#[derive(Clone, Debug, Serialize)]
pub struct AttachedLibrary {
    pub path: String,
    pub origin: &'static str,
    pub pids: Vec<u32>,
    /// Symbols probed, e.g. "cudaMallocAsync_ptsz".
    pub symbols: Vec<String>,
    /// Probed APIs of its kind (runtime or driver) that it does not export.
    pub missing: Vec<&'static str>,
    /// Symbols that failed to attach, with the reason.
    pub failed: Vec<String>,
}

/// One program's own cost (kernel BPF statistics).
#[derive(Clone, Debug, Serialize)]
pub struct ProgramStat {
    pub name: &'static str,
    pub runs: u64,
    pub run_time_ns: u64,
    pub ns_per_run: f64,
}

/// Makes the kernel count every BPF program's runs and run time until the descriptor is
/// dropped (kernel.bpf_stats_enabled; about 20-40 ns a run more while on).
pub fn enable_program_stats() -> Result<std::os::fd::OwnedFd> {
    aya::sys::enable_stats(aya::sys::Stats::RunTime).context("enable BPF run-time statistics")
}

pub struct Probes {
    ebpf: Ebpf,
    /// The uprobe programs loaded for uprobe_multi links (probe/multi.rs), or None: the
    /// kernel has none, and aya's perf-event uprobes are used.
    multi: Option<super::multi::Programs>,
    /// The uprobe_multi links: each one program's probes in one file for every process or one.
    links: Vec<OwnedFd>,
    counters: PerCpuArray<MapData, u64>,
    attached: BTreeMap<FileId, AttachedLibrary>,
    /// USDT sites attached for every process (`--allocator always`): each a perf event (the
    /// uprobe, holding its semaphore up) and its link.
    usdt_links: Vec<(OwnedFd, OwnedFd)>,
    /// The plan map's slot of each site, by (file, offset): a site keeps its slot however
    /// often it is armed.
    usdt_slots: BTreeMap<(FileId, u64), u32>,
    /// The next free slot of the USDT plan map.
    usdt_next: u32,
    /// `--allocator`'s mode.
    allocator: crate::model::arming::Mode,
    /// Libraries with PyTorch's allocator probes, armed per process (`--allocator auto`), and
    /// their sites' semaphores (file offsets).
    armable: BTreeMap<FileId, Vec<u64>>,
    /// The processes armed now: the semaphores tracer raised in each (addresses).
    armed: BTreeMap<u32, Vec<u64>>,
    /// Whether PyTorch's probes can be attached (their programs loaded), or why not.
    pub torch_probes: Result<(), String>,
    /// Whether the scheduler tracepoints are attached (host context), or why not.
    pub host_context: Result<(), String>,
    /// `--allocator auto` with host context: the scheduler follows the processes armed now.
    sched_follow: Option<SchedFollow>,
    /// Whether task_struct's offsets were read from the kernel's BTF (discovery may then stop
    /// a process until its library is probed), or why not.
    pub task_offsets: Result<(), String>,
}

/// Field offsets in the sched_switch and sched_wakeup records.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SchedOffsets {
    pub prev_pid: u32,
    pub prev_state: u32,
    pub next_pid: u32,
    pub wakeup_pid: u32,
    pub fork_parent_pid: u32,
    pub fork_child_pid: u32,
}

impl Default for SchedOffsets {
    fn default() -> Self {
        SchedOffsets {
            prev_pid: 24,
            prev_state: 32,
            next_pid: 56,
            wakeup_pid: 24,
            fork_parent_pid: 12,
            fork_child_pid: 20,
        }
    }
}

fn sched_offsets() -> Result<SchedOffsets, String> {
    let dir = super::tracefs::tracefs()?;
    let read = |event: &str| {
        std::fs::read_to_string(format!("{dir}/events/sched/{event}/format"))
            .map_err(|e| format!("read the {event} format: {e}"))
    };
    let (switch, wakeup, fork) = (
        read("sched_switch")?,
        read("sched_wakeup")?,
        read("sched_process_fork")?,
    );
    let get = |format: &str, field: &str| {
        super::tracefs::field_offset(format, field)
            .ok_or_else(|| format!("no field {field} in the tracepoint format"))
    };
    Ok(SchedOffsets {
        prev_pid: get(&switch, "prev_pid")?,
        prev_state: get(&switch, "prev_state")?,
        next_pid: get(&switch, "next_pid")?,
        wakeup_pid: get(&wakeup, "pid")?,
        fork_parent_pid: get(&fork, "parent_pid")?,
        fork_child_pid: get(&fork, "child_pid")?,
    })
}

/// Loads the USDT program and the OOM uprobe (verified now, attached per library later).
/// The object's program `name` as the program type `P` (`kind` names it in the error).
fn typed_program<'a, P>(ebpf: &'a mut Ebpf, name: &str, kind: &str) -> Result<&'a mut P>
where
    &'a mut P: TryFrom<&'a mut aya::programs::Program, Error = aya::programs::ProgramError>,
{
    ebpf.program_mut(name)
        .ok_or_else(|| anyhow!("eBPF object lacks program {name}"))?
        .try_into()
        .with_context(|| format!("{name} is not a {kind}"))
}

fn load_torch_programs(ebpf: &mut Ebpf) -> Result<(), String> {
    for name in [names::PROG_USDT, names::PROG_TORCH_OOM] {
        let program: &mut UProbe = ebpf
            .program_mut(name)
            .ok_or_else(|| format!("eBPF object lacks program {name}"))?
            .try_into()
            .map_err(|e| format!("{name}: {e}"))?;
        program.load().map_err(|e| format!("load {name}: {e}"))?;
    }
    Ok(())
}

/// The scheduler programs that follow threads off and back onto the CPU; `--allocator auto`
/// attaches them only while some process is armed (each runs at every switch on the machine).
const SCHED_FOLLOW: [(&str, &str); 2] = [
    (names::PROG_SCHED_SWITCH, "sched_switch"),
    (names::PROG_SCHED_WAKEUP, "sched_wakeup"),
];

/// The tracepoint program `name` of the object.
fn sched_program<'a>(ebpf: &'a mut Ebpf, name: &str) -> Result<&'a mut TracePoint, String> {
    ebpf.program_mut(name)
        .ok_or_else(|| format!("eBPF object lacks program {name}"))?
        .try_into()
        .map_err(|e| format!("{name}: {e}"))
}

/// Loads the scheduler programs and attaches them; the two that follow threads only when
/// `follow_now` (else [`SchedFollow`] attaches them while a process is armed).
fn attach_sched(ebpf: &mut Ebpf, follow_now: bool) -> Result<(), String> {
    for (name, event) in SCHED_FOLLOW.into_iter().chain([
        (names::PROG_SCHED_FORK, "sched_process_fork"),
        (names::PROG_SCHED_EXIT, "sched_process_exit"),
    ]) {
        let program = sched_program(ebpf, name)?;
        program.load().map_err(|e| format!("load {name}: {e}"))?;
        if follow_now || !SCHED_FOLLOW.iter().any(|(n, _)| *n == name) {
            program
                .attach("sched", event)
                .map_err(|e| format!("attach tracepoint sched:{event}: {e}"))?;
        }
    }
    Ok(())
}

/// `--allocator auto` with host context: the scheduler follows a process's threads only while
/// it is armed, and the programs that follow them are attached only while some process is.
struct SchedFollow {
    /// The processes armed now, for the switch program.
    armed: aya::maps::HashMap<MapData, u32, u32>,
    /// Threads off the CPU since a switch the program saw: emptied once it is detached, so
    /// that an interval whose end it never saw is never sent. None while a detaching thread
    /// holds it.
    off_cpu: Option<OffCpuMap>,
    links: Vec<(&'static str, TracePointLinkId)>,
    /// Detaching waits for the kernel's grace period (about 0.1 s here): a thread does it,
    /// and hands the map back emptied.
    detaching: Option<std::thread::JoinHandle<OffCpuMap>>,
}

type OffCpuMap = aya::maps::HashMap<MapData, u32, tracer_common::sched::OffCpu>;

impl SchedFollow {
    fn take(ebpf: &mut Ebpf) -> Result<SchedFollow> {
        Ok(SchedFollow {
            armed: take_hash_map(ebpf, names::SCHED_ARMED)?,
            off_cpu: Some(take_hash_map(ebpf, names::OFFCPU)?),
            links: Vec::new(),
            detaching: None,
        })
    }

    /// Follows `pid`'s threads, attaching the programs if none was followed.
    fn follow(&mut self, ebpf: &mut Ebpf, pid: u32) -> Result<()> {
        self.armed
            .insert(pid, 1, 0)
            .with_context(|| format!("add process {pid} to {}", names::SCHED_ARMED))?;
        if self.links.is_empty() {
            // A detaching still under way empties the map: it must end before new intervals.
            self.detached();
            for (name, event) in SCHED_FOLLOW {
                let link = sched_program(ebpf, name)
                    .map_err(|e| anyhow!(e))?
                    .attach("sched", event)
                    .with_context(|| format!("attach tracepoint sched:{event}"))?;
                self.links.push((name, link));
            }
        }
        Ok(())
    }

    /// Stops following `pid`; with no process left, detaches the programs (in a thread).
    fn unfollow(&mut self, ebpf: &mut Ebpf, pid: u32) {
        // Absent when following it failed: nothing to undo.
        let _ = self.armed.remove(&pid);
        if self.links.is_empty() || self.armed.keys().next().is_some() {
            return;
        }
        let mut links = Vec::new();
        for (name, link) in self.links.drain(..) {
            match sched_program(ebpf, name).map(|p| p.take_link(link)) {
                Ok(Ok(link)) => links.push(link),
                Ok(Err(e)) => log::debug!("detach {name}: {e}"),
                Err(e) => log::debug!("detach {name}: {e}"),
            }
        }
        let Some(mut off_cpu) = self.off_cpu.take() else {
            return;
        };
        self.detaching = Some(std::thread::spawn(move || {
            drop(links);
            let threads: Vec<u32> = off_cpu.keys().filter_map(Result::ok).collect();
            for tid in threads {
                let _ = off_cpu.remove(&tid);
            }
            off_cpu
        }));
    }

    /// Waits for a detaching under way, taking the map back.
    fn detached(&mut self) {
        if let Some(thread) = self.detaching.take() {
            match thread.join() {
                Ok(map) => self.off_cpu = Some(map),
                Err(_) => log::warn!("detaching the scheduler programs failed"),
            }
        }
    }

    /// Threads off the CPU now, as the programs saw them.
    fn off_cpu_entries(&mut self) -> Option<u64> {
        self.detached();
        Some(self.off_cpu.as_ref()?.keys().filter(Result::is_ok).count() as u64)
    }
}

/// Takes map `name` out of the object as a hash map.
fn take_hash_map<K: aya::Pod, V: aya::Pod>(
    ebpf: &mut Ebpf,
    name: &str,
) -> Result<aya::maps::HashMap<MapData, K, V>> {
    let map = ebpf
        .take_map(name)
        .ok_or_else(|| anyhow!("eBPF object lacks map {name}"))?;
    aya::maps::HashMap::try_from(map).with_context(|| format!("open map {name}"))
}

impl Probes {
    pub fn load(opts: LoadOptions) -> Result<Probes> {
        let floor = opts.floor;
        let stack: u32 = opts.stack.into();
        let sched_armed_only: u32 = (opts.allocator == crate::model::arming::Mode::Auto).into();
        let sched = sched_offsets();
        let offsets = sched.as_ref().map_or(SchedOffsets::default(), |o| *o);
        let openat = super::tracefs::tracefs()
            .ok()
            .and_then(|dir| super::libwatch::openat_offsets(dir).ok())
            .unwrap_or_default();
        let task = super::btf::task_offsets().map_err(|e| format!("{e:#}"));
        let task_offsets = task.clone().unwrap_or_default();
        let me = std::process::id();
        // signal_struct's pids[PIDTYPE_PGID] (2: PID, TGID, PGID, SID), a pointer each; the
        // pid's own number in the machine's namespace: numbers[0].nr.
        let signal_pgid = task_offsets.signal_pids + 2 * 8;
        let pid_nr = task_offsets.pid_numbers + task_offsets.upid_nr;
        let mut ebpf = EbpfLoader::new()
            .map_max_entries(names::EVENTS, opts.ring_bytes)
            .override_global(names::GLOBAL_OPENAT_FILENAME_OFF, &openat.filename, true)
            .override_global(names::GLOBAL_OPENAT_RET_OFF, &openat.ret, true)
            .override_global(names::GLOBAL_OPENAT_FLAGS_OFF, &openat.flags, true)
            .override_global(
                names::GLOBAL_TASK_REAL_PARENT_OFF,
                &task_offsets.real_parent,
                true,
            )
            .override_global(names::GLOBAL_TASK_COMM_OFF, &task_offsets.comm, true)
            .override_global(names::GLOBAL_TASK_PTRACE_OFF, &task_offsets.ptrace, true)
            .override_global(names::GLOBAL_SELF_TGID, &me, true)
            .override_global(names::GLOBAL_TASK_SIGNAL_OFF, &task_offsets.signal, true)
            .override_global(names::GLOBAL_SIGNAL_PGID_OFF, &signal_pgid, true)
            .override_global(names::GLOBAL_PID_NR_OFF, &pid_nr, true)
            .override_global(names::GLOBAL_WAKEUP_BYTES, &opts.wakeup_bytes, true)
            .override_global(names::GLOBAL_FLOOR_MODE, &floor, true)
            .override_global(names::GLOBAL_STACK_MODE, &stack, true)
            .override_global(names::GLOBAL_SCHED_ARMED_ONLY, &sched_armed_only, true)
            .override_global(names::GLOBAL_PREV_PID_OFF, &offsets.prev_pid, true)
            .override_global(names::GLOBAL_PREV_STATE_OFF, &offsets.prev_state, true)
            .override_global(names::GLOBAL_NEXT_PID_OFF, &offsets.next_pid, true)
            .override_global(names::GLOBAL_WAKEUP_PID_OFF, &offsets.wakeup_pid, true)
            .override_global(
                names::GLOBAL_FORK_PARENT_PID_OFF,
                &offsets.fork_parent_pid,
                true,
            )
            .override_global(
                names::GLOBAL_FORK_CHILD_PID_OFF,
                &offsets.fork_child_pid,
                true,
            )
            .load(EBPF_OBJECT)
            .context("load the eBPF programs into the kernel")?;
        let mut multi = load_multi(&ebpf, opts.stack)?;
        if multi.is_none() {
            for (name, kind) in [
                (names::PROG_ENTRY, "uprobe"),
                (names::PROG_RETURN, "uretprobe"),
            ] {
                typed_program::<UProbe>(&mut ebpf, name, kind)?
                    .load()
                    .with_context(|| format!("verify and load {kind} program {name}"))?;
            }
            if opts.stack {
                install_site_programs(&mut ebpf)?;
            }
        }
        // Never attached: userspace runs it on each CPU (record/stage.rs).
        typed_program::<RawTracePoint>(&mut ebpf, names::PROG_FLUSH_STAGE, "raw tracepoint")?
            .load()
            .with_context(|| format!("verify and load program {}", names::PROG_FLUSH_STAGE))?;
        let counters = ebpf
            .take_map(names::COUNTERS)
            .ok_or_else(|| anyhow!("eBPF object lacks map {}", names::COUNTERS))?;
        let counters = PerCpuArray::try_from(counters).context("open the counters map")?;
        let host_context = match sched {
            Ok(_) if opts.floor == 0 && opts.host_context => {
                attach_sched(&mut ebpf, sched_armed_only == 0)
            }
            Ok(_) if opts.floor != 0 => Err("not in --floor mode".into()),
            Ok(_) => Err("--no-host-context".into()),
            Err(e) => Err(e),
        };
        let sched_follow = match (&host_context, sched_armed_only) {
            (Ok(()), 1) => Some(SchedFollow::take(&mut ebpf)?),
            _ => None,
        };
        // In --floor mode the USDT program returns at once: the floor of a block event.
        let torch_probes = match multi.as_mut() {
            Some(programs) => load_torch_multi(programs),
            None => load_torch_programs(&mut ebpf),
        };
        Ok(Probes {
            ebpf,
            multi,
            links: Vec::new(),
            counters,
            attached: BTreeMap::new(),
            usdt_links: Vec::new(),
            usdt_slots: BTreeMap::new(),
            usdt_next: 0,
            allocator: opts.allocator,
            armable: BTreeMap::new(),
            armed: BTreeMap::new(),
            host_context,
            torch_probes,
            sched_follow,
            task_offsets: task.map(|_| ()),
        })
    }

    /// Discovery in the kernel: the openat programs attached and their maps (`hold`: stop a
    /// process that opens a library not yet probed until it is). Holding needs the kernel's
    /// task offsets ([`Probes::task_offsets`]); without them the programs never stop anyone.
    pub fn take_libwatch(&mut self, hold: bool) -> Result<super::libwatch::LibWatch> {
        super::libwatch::LibWatch::start(&mut self.ebpf, hold && self.task_offsets.is_ok())
    }

    /// The interpreters the return program walks (--stack).
    pub fn take_py_procs(&mut self) -> Result<PyProcs> {
        Ok(PyProcs {
            map: take_hash_map(&mut self.ebpf, names::PY_PROCS)?,
        })
    }

    /// The native stacks the call-site program keeps by id (--stack).
    pub fn take_native_stacks(&mut self) -> Result<NativeStacks> {
        Ok(NativeStacks {
            map: take_hash_map(&mut self.ebpf, names::NATIVE_STACKS)?,
        })
    }

    /// The set of threads the scheduler programs follow, or None without host context.
    pub fn take_followed(&mut self) -> Result<Option<Followed>> {
        if self.host_context.is_err() {
            return Ok(None);
        }
        let map = self
            .ebpf
            .take_map(names::SCHED_TIDS)
            .ok_or_else(|| anyhow!("eBPF object lacks map {}", names::SCHED_TIDS))?;
        let map = aya::maps::HashMap::try_from(map).context("open the followed-threads map")?;
        Ok(Some(Followed { map }))
    }

    /// The per-CPU stages of call events and the program that empties them.
    pub fn take_stages(&mut self) -> Result<super::stage::Stages> {
        let flush = typed_program::<RawTracePoint>(
            &mut self.ebpf,
            names::PROG_FLUSH_STAGE,
            "raw tracepoint",
        )?;
        let fd = flush
            .fd()
            .with_context(|| format!("{} has no file descriptor", names::PROG_FLUSH_STAGE))?
            .try_clone()
            .context("duplicate the stage flush program's descriptor")?;
        let map = self
            .ebpf
            .take_map(names::STAGE)
            .ok_or_else(|| anyhow!("eBPF object lacks map {}", names::STAGE))?;
        let map = PerCpuArray::try_from(map).context("open the per-CPU stages")?;
        let oldest = match self.ebpf.take_map(names::STAGE_OLDEST) {
            Some(aya::maps::Map::Array(data)) => data,
            _ => bail!("eBPF object lacks the array map {}", names::STAGE_OLDEST),
        };
        super::stage::Stages::new(fd, map, oldest)
    }

    pub fn take_ring(&mut self) -> Result<RingBuf<MapData>> {
        let map = self
            .ebpf
            .take_map(names::EVENTS)
            .ok_or_else(|| anyhow!("eBPF object lacks map {}", names::EVENTS))?;
        RingBuf::try_from(map).context("open the event ring buffer")
    }

    pub fn libraries(&self) -> Vec<AttachedLibrary> {
        self.attached.values().cloned().collect()
    }

    pub fn library_count(&self) -> usize {
        self.attached.len()
    }

    pub fn probe_count(&self) -> usize {
        self.attached.values().map(|l| l.symbols.len()).sum()
    }

    /// Attaches entry and return probes to every probed symbol in `lib`, the USDT program to
    /// every PyTorch probe site it has, and the OOM uprobe to PyTorch's OutOfMemoryError
    /// constructor, for all processes or only `pids`. A library with nothing to probe is an
    /// error; missing APIs are reported.
    pub fn attach(&mut self, lib: &Candidate, pids: Option<&[u32]>) -> Result<&AttachedLibrary> {
        let symbols = elf::read_symbols(&lib.open_path)?;
        let sites: Vec<usdt::Site> = usdt::read_sites(&lib.open_path)?
            .into_iter()
            .filter(|s| s.plan().is_some())
            .collect();
        if symbols.targets.is_empty() && sites.is_empty() {
            return Err(crate::exit::user_error(format!(
                "{} exports none of the probed CUDA calls (cudaMalloc, cuMemAlloc_v2, ...) and has no PyTorch probes: pass libcudart.so, libcuda.so or libc10_cuda.so",
                lib.shown
            )));
        }
        let mut missing = Vec::new();
        for library in [Library::Runtime, Library::Driver] {
            if symbols.has_library(library) {
                missing.extend(symbols.missing(library));
            }
        }
        let scopes: Vec<Option<u32>> = match pids {
            None => vec![None],
            Some(pids) => pids.iter().map(|&p| Some(p)).collect(),
        };
        let mut attached = Vec::new();
        let mut failed = Vec::new();
        let mut failures: Vec<Vec<String>> = vec![Vec::new(); symbols.targets.len()];
        for prog_name in [names::PROG_ENTRY, names::PROG_RETURN, names::PROG_TORCH_OOM] {
            let mut chosen = Vec::new();
            let mut points = Vec::new();
            for (i, target) in symbols.targets.iter().enumerate() {
                if (target.op == Op::TorchOom) != (prog_name == names::PROG_TORCH_OOM) {
                    continue;
                }
                match self.torch_ready(target.op) {
                    Ok(()) => {
                        chosen.push(i);
                        points.push((target.offset, target.op as u64, 0));
                    }
                    Err(e) => failures[i].push(format!("{prog_name}: {e:#}")),
                }
            }
            let results = self.attach_points(prog_name, &lib.open_path, &points, &scopes);
            for (i, result) in chosen.into_iter().zip(results) {
                if let Err(e) = result {
                    failures[i].push(format!("{prog_name}: {e:#}"));
                }
            }
        }
        for (target, errors) in symbols.targets.iter().zip(failures) {
            let ok = errors.is_empty();
            failed.extend(
                errors
                    .into_iter()
                    .map(|e| format!("{} ({e})", target.symbol)),
            );
            if ok {
                // A C++ method's mangled name (the OOM constructor, PyTorch's CUDAGraph and
                // allocator methods) says less than the probe's.
                attached.push(if target.symbol.starts_with("_Z") {
                    target.op.name().to_owned()
                } else {
                    target.symbol.clone()
                });
            }
        }
        // `--allocator auto`/`off`: the sites are probed without raising their semaphores;
        // tracer raises them in the processes it arms (a site without one fires everywhere).
        let per_process = self.allocator != crate::model::arming::Mode::Always;
        let mut semaphores = Vec::new();
        let mut probed = Vec::new();
        let mut points = Vec::new();
        for site in &sites {
            let what = format!("{}:{} at {:#x}", site.provider, site.name, site.offset);
            let gated = per_process && site.semaphore != 0;
            if gated && self.allocator == crate::model::arming::Mode::Off {
                attached.push(format!("{what} (not probed: --allocator off)"));
                continue;
            }
            match self.site_slot(lib.id, site) {
                Ok(slot) => {
                    let semaphore = if gated { 0 } else { site.semaphore };
                    points.push((site.offset, u64::from(slot), semaphore));
                    probed.push((site, what, gated));
                }
                Err(e) => failed.push(format!("{what}: {e:#}")),
            }
        }
        let results = self.attach_points(names::PROG_USDT, &lib.open_path, &points, &scopes);
        for ((site, what, gated), result) in probed.into_iter().zip(results) {
            match result {
                Ok(()) if gated => {
                    semaphores.push(site.semaphore);
                    attached.push(format!(
                        "{what} (armed per process: --allocator {})",
                        self.allocator.name()
                    ));
                }
                Ok(()) => attached.push(what),
                Err(e) => failed.push(format!("{what}: {e:#}")),
            }
        }
        semaphores.sort_unstable();
        semaphores.dedup();
        if !semaphores.is_empty() {
            self.armable.insert(lib.id, semaphores);
        }
        if attached.is_empty() {
            return Err(anyhow!(
                "attach uprobes in {}: every probe failed: {}",
                lib.shown,
                failed
                    .first()
                    .map(String::as_str)
                    .unwrap_or("unknown error")
            ));
        }
        let record = AttachedLibrary {
            path: lib.shown.clone(),
            origin: lib.origin.name(),
            pids: lib.pids.iter().copied().collect(),
            symbols: attached,
            missing,
            failed,
        };
        Ok(self.attached.entry(lib.id).or_insert(record))
    }

    /// PyTorch's probes need their programs loaded.
    fn torch_ready(&self, op: Op) -> Result<()> {
        match (&self.torch_probes, op.spec().library) {
            (Err(why), Library::Torch) => Err(anyhow!("PyTorch's probes are off: {why}")),
            _ => Ok(()),
        }
    }

    /// Attaches program `prog_name` at each point (file offset, cookie, semaphore offset or
    /// 0) of `path`, for every process (None) or each process of `scopes`. Where the kernel
    /// has uprobe_multi links, one link per scope holds them all (a link refused is retried a
    /// point at a time, so that a point the kernel refuses costs only itself); else each point
    /// is a perf-event uprobe. One result per point.
    fn attach_points(
        &mut self,
        prog_name: &'static str,
        path: &Path,
        points: &[(u64, u64, u64)],
        scopes: &[Option<u32>],
    ) -> Vec<Result<()>> {
        let mut results: Vec<Result<()>> = points.iter().map(|_| Ok(())).collect();
        if points.is_empty() {
            return results;
        }
        for &pid in scopes {
            if self.multi.is_some() {
                if self.link_points(prog_name, path, points, pid).is_ok() {
                    continue;
                }
                for (i, point) in points.iter().enumerate() {
                    let one = std::slice::from_ref(point);
                    if let Err(e) = self.link_points(prog_name, path, one, pid) {
                        results[i] = Err(e);
                    }
                }
                continue;
            }
            for (i, &(offset, cookie, semaphore)) in points.iter().enumerate() {
                let result = if prog_name == names::PROG_USDT {
                    self.site_link(path, offset, semaphore, cookie, pid)
                        .map(|pair| self.usdt_links.push(pair))
                } else {
                    self.attach_one(prog_name, path, offset, cookie, pid)
                };
                if let Err(e) = result {
                    results[i] = Err(e);
                }
            }
        }
        results
    }

    /// One uprobe_multi link of `prog_name` at these points of `path`.
    fn link_points(
        &mut self,
        prog_name: &'static str,
        path: &Path,
        points: &[(u64, u64, u64)],
        pid: Option<u32>,
    ) -> Result<()> {
        let programs = self
            .multi
            .as_ref()
            .ok_or_else(|| anyhow!("no uprobe_multi programs"))?;
        let offsets: Vec<u64> = points.iter().map(|p| p.0).collect();
        let cookies: Vec<u64> = points.iter().map(|p| p.1).collect();
        let semaphores: Vec<u64> = if points.iter().any(|p| p.2 != 0) {
            points.iter().map(|p| p.2).collect()
        } else {
            Vec::new()
        };
        let link = super::multi::link(
            programs.fd(prog_name)?,
            &super::multi::Points {
                path,
                offsets: &offsets,
                cookies: &cookies,
                semaphores: &semaphores,
                retprobe: prog_name == names::PROG_RETURN,
                pid,
            },
        )?;
        self.links.push(link);
        Ok(())
    }

    /// The site's slot in the plan map, its plan stored there the first time.
    fn site_slot(&mut self, file: FileId, site: &usdt::Site) -> Result<u32> {
        if let Some(&slot) = self.usdt_slots.get(&(file, site.offset)) {
            return Ok(slot);
        }
        let plan = site
            .plan()
            .ok_or_else(|| anyhow!("no probe table entry"))??;
        self.torch_ready(Op::TorchMalloc)?;
        if self.usdt_next >= tracer_common::usdt::MAX_USDT_SITES {
            return Err(anyhow!(
                "more than {} USDT sites",
                tracer_common::usdt::MAX_USDT_SITES
            ));
        }
        let slot = self.usdt_next;
        let map = self
            .ebpf
            .map_mut(names::USDT_PLANS)
            .ok_or_else(|| anyhow!("eBPF object lacks map {}", names::USDT_PLANS))?;
        let mut plans: Array<_, tracer_common::usdt::UsdtPlan> =
            Array::try_from(map).context("open the USDT plan map")?;
        plans.set(slot, plan, 0).context("store the site's plan")?;
        self.usdt_next += 1;
        self.usdt_slots.insert((file, site.offset), slot);
        Ok(slot)
    }

    /// The uprobe at a site (the semaphore at file offset `semaphore` raised while it exists;
    /// 0: none) for every process or one, and the USDT program linked to it with the site's
    /// slot as cookie (kernels without uprobe_multi links).
    fn site_link(
        &self,
        path: &Path,
        offset: u64,
        semaphore: u64,
        slot: u64,
        pid: Option<u32>,
    ) -> Result<(OwnedFd, OwnedFd)> {
        let program: &UProbe = self
            .ebpf
            .program(names::PROG_USDT)
            .ok_or_else(|| anyhow!("eBPF object lacks program {}", names::PROG_USDT))?
            .try_into()?;
        let prog_fd = program
            .fd()
            .context("the USDT program is not loaded")?
            .as_fd();
        let perf = perf::uprobe(path, offset, semaphore, pid)?;
        let link = perf::link(prog_fd, perf.as_fd(), slot)?;
        Ok((perf, link))
    }

    /// Arms PyTorch's allocator probes in `pid` (`--allocator auto`): raises, in its memory,
    /// the semaphore of every site of every such library it maps (sites sharing a semaphore
    /// are armed together, and every site is probed), or none. Returns the semaphores raised.
    pub fn arm(&mut self, pid: u32) -> Result<usize> {
        if let Some(raised) = self.armed.get(&pid) {
            return Ok(raised.len());
        }
        let mappings = crate::traced::maps::read(pid)
            .with_context(|| format!("read the memory maps of process {pid}"))?;
        let mut addrs = Vec::new();
        for (file, semaphores) in &self.armable {
            if !mappings
                .iter()
                .any(|m| (m.dev, m.inode) == (file.dev, file.ino))
            {
                continue;
            }
            for &offset in semaphores {
                addrs.push(semaphore::address(
                    pid,
                    &mappings,
                    (file.dev, file.ino),
                    offset,
                )?);
            }
        }
        if addrs.is_empty() {
            return Err(anyhow!(
                "process {pid} maps no library with PyTorch's allocator probes"
            ));
        }
        let memory = semaphore::Memory::open(pid)?;
        for (i, &addr) in addrs.iter().enumerate() {
            if let Err(e) = memory.adjust(addr, 1) {
                for &done in &addrs[..i] {
                    // Undone as far as the process still lets it.
                    let _ = memory.adjust(done, -1);
                }
                return Err(e);
            }
        }
        let n = addrs.len();
        self.armed.insert(pid, addrs);
        if let Some(follow) = &mut self.sched_follow {
            if let Err(e) = follow.follow(&mut self.ebpf, pid) {
                log::warn!("follow the threads of armed process {pid} (host context): {e:#}");
            }
        }
        Ok(n)
    }

    /// Disarms `pid`'s allocator probes: lowers the semaphores tracer raised there. Whether
    /// it was armed (a process gone has nothing left to lower).
    pub fn disarm(&mut self, pid: u32) -> bool {
        let Some(addrs) = self.armed.remove(&pid) else {
            return false;
        };
        if let Some(follow) = &mut self.sched_follow {
            follow.unfollow(&mut self.ebpf, pid);
        }
        if let Ok(memory) = semaphore::Memory::open(pid) {
            for addr in addrs {
                if let Err(e) = memory.adjust(addr, -1) {
                    log::debug!("disarm process {pid}: {e:#}");
                }
            }
        }
        true
    }

    /// Disarms every process (the recording ends: their sites stop evaluating their
    /// arguments once the probes are gone).
    pub fn disarm_all(&mut self) {
        let pids: Vec<u32> = self.armed.keys().copied().collect();
        for pid in pids {
            self.disarm(pid);
        }
    }

    /// Whether the scheduler programs follow a process only while it is armed.
    pub fn follows_armed_only(&self) -> bool {
        self.sched_follow.is_some()
    }

    /// The processes armed now, and the plan slots taken (each site keeps one).
    pub fn armed_now(&self) -> (usize, u32) {
        (self.armed.len(), self.usdt_next)
    }

    /// Attaches one of the call programs at `offset` in `path` with `cookie` (the op), for
    /// every process or one (kernels without uprobe_multi links).
    fn attach_one(
        &mut self,
        prog_name: &'static str,
        path: &Path,
        offset: u64,
        cookie: u64,
        pid: Option<u32>,
    ) -> Result<()> {
        let program: &mut UProbe = self
            .ebpf
            .program_mut(prog_name)
            .ok_or_else(|| anyhow!("eBPF object lacks program {prog_name}"))?
            .try_into()?;
        let point = UProbeAttachPoint {
            location: UProbeAttachLocation::AbsoluteOffset(offset),
            cookie: Some(cookie),
        };
        let scope = match pid.and_then(NonZeroU32::new) {
            Some(pid) => UProbeScope::OneProcess(pid),
            None => UProbeScope::AllProcesses,
        };
        // The program keeps the link: it is removed with the object (`remove`).
        program.attach(point, path, scope)?;
        Ok(())
    }

    /// Each loaded program's own cost so far: how often it ran and for how long (the kernel
    /// counts only while BPF statistics are enabled, see [`enable_program_stats`]).
    pub fn program_stats(&self) -> Vec<ProgramStat> {
        let names = [
            names::PROG_ENTRY,
            names::PROG_RETURN,
            names::PROG_CALL_SITE,
            names::PROG_FLUSH_STAGE,
            names::PROG_USDT,
            names::PROG_TORCH_OOM,
            names::PROG_SCHED_SWITCH,
            names::PROG_SCHED_WAKEUP,
            names::PROG_SCHED_FORK,
        ];
        names
            .into_iter()
            .filter_map(|name| {
                let (runs, run_time_ns) = match self.multi.as_ref().and_then(|m| m.runs(name)) {
                    Some(figures) => figures,
                    None => {
                        let info = self.ebpf.program(name)?.info().ok()?;
                        (info.run_count(), info.run_time().as_nanos() as u64)
                    }
                };
                Some(ProgramStat {
                    name,
                    runs,
                    run_time_ns,
                    ns_per_run: if runs > 0 {
                        run_time_ns as f64 / runs as f64
                    } else {
                        0.0
                    },
                })
            })
            .collect()
    }

    /// Sums the per-CPU counters.
    pub fn counters(&self) -> Result<[u64; Counter::COUNT as usize]> {
        let mut out = [0u64; Counter::COUNT as usize];
        for counter in Counter::ALL {
            let per_cpu = self
                .counters
                .get(&(counter as u32), 0)
                .with_context(|| format!("read counter {}", counter.name()))?;
            out[counter as usize] = per_cpu.iter().sum();
        }
        Ok(out)
    }

    /// Calls entered and not yet returned: entry states still held in the slots and the
    /// fallback map.
    pub fn calls_in_flight(&self) -> Result<u64> {
        let slots = self
            .ebpf
            .map(names::SLOTS)
            .ok_or_else(|| anyhow!("eBPF object lacks map {}", names::SLOTS))?;
        let slots: Array<_, names::Slot> = Array::try_from(slots).context("open the slots")?;
        let mut n = 0;
        for slot in slots.iter() {
            n += u64::from(slot.context("read a slot")?.state.ts_ns != 0);
        }
        let inflight = self
            .ebpf
            .map(names::INFLIGHT)
            .ok_or_else(|| anyhow!("eBPF object lacks map {}", names::INFLIGHT))?;
        let inflight: aya::maps::HashMap<_, names::InflightKey, names::Inflight> =
            aya::maps::HashMap::try_from(inflight).context("open the in-flight map")?;
        for entry in inflight.iter() {
            let (_, state) = entry.context("read the in-flight map")?;
            n += u64::from(state.ts_ns != 0);
        }
        Ok(n)
    }

    /// Entries held now by the per-thread kernel maps (each thread's go when it exits), by
    /// map name.
    pub fn map_entries(&mut self) -> Vec<(&'static str, u64)> {
        fn keys<K: aya::Pod, V: aya::Pod>(ebpf: &Ebpf, name: &'static str) -> Option<u64> {
            let map: aya::maps::HashMap<_, K, V> =
                aya::maps::HashMap::try_from(ebpf.map(name)?).ok()?;
            Some(map.keys().filter(Result::is_ok).count() as u64)
        }
        [
            (
                names::SCHED_TIDS,
                keys::<u32, u32>(&self.ebpf, names::SCHED_TIDS),
            ),
            (
                names::OFFCPU,
                match &mut self.sched_follow {
                    // Taken out of the object: `auto` empties it when it stops following.
                    Some(follow) => follow.off_cpu_entries(),
                    None => keys::<u32, tracer_common::sched::OffCpu>(&self.ebpf, names::OFFCPU),
                },
            ),
            (
                names::INFLIGHT,
                keys::<names::InflightKey, names::Inflight>(&self.ebpf, names::INFLIGHT),
            ),
            (
                names::PY_THREADS,
                keys::<u64, u64>(&self.ebpf, names::PY_THREADS),
            ),
        ]
        .into_iter()
        .filter_map(|(name, n)| Some((name, n?)))
        .collect()
    }

    /// Stops recording new calls (calls already entered still report their return).
    pub fn pause(&mut self) -> Result<()> {
        let map = self
            .ebpf
            .map_mut(names::CONTROL)
            .ok_or_else(|| anyhow!("eBPF object lacks map {}", names::CONTROL))?;
        let mut control: Array<_, u32> = Array::try_from(map).context("open the control map")?;
        control.set(0, 1, 0).context("pause the probes")?;
        Ok(())
    }

    /// Removes every probe (closing a site's link and perf event also lowers its semaphore).
    /// The kernel's part, a grace period per probe, is left to a background process
    /// ([`super::release`]): call this once the probes are paused and what they recorded is
    /// read.
    pub fn remove(self) {
        super::release::drop_in_background(self);
    }
}

/// Adds threads to the set the scheduler programs follow.
pub struct Followed {
    map: aya::maps::HashMap<MapData, u32, u32>,
}

impl Followed {
    /// Follows every thread of `pid` and of its descendants, under `pid`: threads that never
    /// make a CUDA call (DataLoader workers) still compete with those that do.
    pub fn process_tree(&mut self, pid: u32) -> usize {
        let mut added = Vec::new();
        for tid in crate::traced::procinfo::thread_tree(pid) {
            // A tid already followed keeps its process (a traced child stays its own).
            if self.map.get(&tid, 0).is_err() && self.map.insert(tid, pid, 0).is_ok() {
                added.push(tid);
            }
        }
        // A thread that exited between the listing and the insert is past its exit program,
        // which would have removed it: remove it here, or it stays for good.
        for &tid in &added {
            if !crate::traced::procinfo::thread_alive(tid) {
                // Absent already if its exit came after all.
                let _ = self.map.remove(&tid);
            }
        }
        added.len()
    }

    /// Threads followed now (each goes when it exits).
    pub fn entries(&self) -> u64 {
        self.map.keys().filter(Result::is_ok).count() as u64
    }
}

/// CPython interpreters registered for the kernel's frame walk.
pub struct PyProcs {
    map: aya::maps::HashMap<MapData, u32, tracer_common::PyProcess>,
}

impl PyProcs {
    /// Interpreters registered now (each goes when its process exits).
    pub fn entries(&self) -> u64 {
        self.map.keys().filter(Result::is_ok).count() as u64
    }

    pub fn insert(&mut self, pid: u32, interp: tracer_common::PyProcess) -> Result<()> {
        self.map
            .insert(pid, interp, 0)
            .with_context(|| format!("register the interpreter of pid {pid}"))
    }

    /// Withdraws `pid`'s registration (it replaced its program); absent is fine.
    pub fn remove(&mut self, pid: u32) {
        if let Err(e) = self.map.remove(&pid) {
            log::debug!("withdraw the interpreter of pid {pid}: {e}");
        }
    }
}

/// The call-site programs (--stack) and their slots in the program array the return program
/// and the first of them tail-call.
const SITE_PROGRAMS: [(&str, u32); 2] = [
    (names::PROG_CALL_SITE, names::SITE_SLOT_READ),
    (names::PROG_SITE_SEND, names::SITE_SLOT_SEND),
];

/// The uprobe programs loaded for uprobe_multi links, the call-site programs (--stack) put in
/// the program array the return program and the first of them tail-call; None where the
/// kernel has no such links.
fn load_multi(ebpf: &Ebpf, stack: bool) -> Result<Option<super::multi::Programs>> {
    if !multi_links_wanted() {
        return Ok(None);
    }
    let mut wanted = vec![names::PROG_ENTRY, names::PROG_RETURN];
    if stack {
        wanted.extend([names::PROG_CALL_SITE, names::PROG_SITE_SEND]);
    }
    let programs = match super::multi::Programs::load(ebpf, EBPF_OBJECT, &wanted) {
        Ok(programs) => programs,
        Err(super::multi::LoadError::Unsupported(e)) => {
            log::debug!("no uprobe_multi links ({e:#}): a perf-event uprobe per probe");
            return Ok(None);
        }
        Err(super::multi::LoadError::Refused(e)) => {
            return Err(e.context("verify and load the uprobe programs"))
        }
    };
    if stack {
        for (name, slot) in SITE_PROGRAMS {
            super::multi::set_program_slot(ebpf, names::SITE_PROG, slot, programs.fd(name)?)
                .with_context(|| format!("install program {name}"))?;
        }
    }
    Ok(Some(programs))
}

/// Whether uprobe_multi links are tried: `TRACER_UPROBE_MULTI=0` keeps every probe a perf
/// event, as on kernels before 6.6 (the fallback's tests; a kernel whose links misbehave).
fn multi_links_wanted() -> bool {
    match std::env::var("TRACER_UPROBE_MULTI").as_deref() {
        Err(_) | Ok("1") => true,
        Ok("0") => false,
        Ok(other) => {
            eprintln!("tracer: TRACER_UPROBE_MULTI={other:?} is neither 0 nor 1: uprobe_multi links are tried (set 0 for a perf event per probe)");
            true
        }
    }
}

/// PyTorch's programs for uprobe_multi links (their failure leaves only them off).
fn load_torch_multi(programs: &mut super::multi::Programs) -> Result<(), String> {
    for name in [names::PROG_USDT, names::PROG_TORCH_OOM] {
        programs
            .add(name)
            .map_err(|e| format!("load {name}: {e:#}"))?;
    }
    Ok(())
}

/// Loads the call-site programs (--stack) and puts them in the program array the return
/// program and the first of them tail-call.
fn install_site_programs(ebpf: &mut Ebpf) -> Result<()> {
    for (name, slot) in SITE_PROGRAMS {
        typed_program::<UProbe>(ebpf, name, "uretprobe")?
            .load()
            .with_context(|| format!("verify and load program {name}"))?;
        let program = ebpf
            .program(name)
            .ok_or_else(|| anyhow!("eBPF object lacks program {name}"))?;
        let fd = program
            .fd()
            .with_context(|| format!("{name} has no file descriptor"))?;
        super::multi::set_program_slot(ebpf, names::SITE_PROG, slot, fd.as_fd())
            .with_context(|| format!("install program {name}"))?;
    }
    Ok(())
}

/// The native stacks the call-site program keeps, each under its id for the whole session.
pub struct NativeStacks {
    map: aya::maps::HashMap<MapData, i64, tracer_common::stack::NativeStack>,
}

impl crate::traced::sites::KeptStacks for NativeStacks {
    fn get(&mut self, id: i64) -> Option<Vec<u64>> {
        let stack = self.map.get(&id, 0).ok()?;
        let depth = (stack.depth as usize).min(stack.ips.len());
        Some(stack.ips[..depth].to_vec())
    }
}

/// What `tracer check` probes in tracer itself: a real function, called once under a uprobe.
#[unsafe(no_mangle)]
#[inline(never)]
pub extern "C" fn tracer_self_test_target(x: u64) -> u64 {
    std::hint::black_box(x).wrapping_add(1)
}

/// Proves that tracing works on this machine, end to end: loads the programs, attaches the
/// entry and return probes to [`tracer_self_test_target`] in this very process, calls it, and
/// waits for its event to come out of the ring buffer. Returns how long the probed call took.
pub fn self_test() -> Result<u64> {
    let mut probes = Probes::load(LoadOptions {
        ring_bytes: 1 << 16,
        wakeup_bytes: 1,
        floor: 0,
        host_context: true,
        stack: false,
        allocator: crate::model::arming::Mode::Always,
    })?;
    let mut ring = probes.take_ring()?;
    let mut stages = probes.take_stages()?;
    let (path, offset) = own_code_offset(tracer_self_test_target as *const () as usize)?;
    let op = tracer_common::Op::CudaDeviceSynchronize;
    for prog_name in [names::PROG_ENTRY, names::PROG_RETURN] {
        probes
            .attach_points(prog_name, &path, &[(offset, op as u64, 0)], &[None])
            .remove(0)
            .with_context(|| {
                format!(
                    "attach a uprobe to {} at offset {offset:#x}",
                    path.display()
                )
            })?;
    }
    std::hint::black_box(tracer_self_test_target(std::hint::black_box(41)));
    let me = std::process::id();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(2);
    let found = loop {
        let mut seen = None;
        stages.flush(u64::MAX)?;
        while let Some(item) = ring.next() {
            for record in crate::decode::decode_all(&item) {
                if let Ok(crate::decode::Record::Call(call)) = record {
                    if call.pid == me && call.op == op {
                        seen = Some(call.duration_ns);
                    }
                }
            }
        }
        if seen.is_some() || std::time::Instant::now() >= deadline {
            break seen;
        }
        std::thread::sleep(std::time::Duration::from_millis(5));
    };
    let entries = probes.counters()?[Counter::Entries as usize];
    probes.remove();
    found.ok_or_else(|| {
        anyhow!(
            "the probes attached, but no event came through the ring buffer within 2 s ({entries} probe hits counted)"
        )
    })
}

/// The file holding this process's code at `addr`, and the address's offset in it.
fn own_code_offset(addr: usize) -> Result<(std::path::PathBuf, u64)> {
    let addr = addr as u64;
    let maps = crate::traced::maps::read(std::process::id()).context("read /proc/self/maps")?;
    let m = maps
        .iter()
        .find(|m| m.executable && (m.start..m.end).contains(&addr))
        .ok_or_else(|| anyhow!("no executable mapping holds tracer's own code at {addr:#x}"))?;
    Ok((m.path.clone(), addr - m.start + m.offset))
}
