//! Who else held the GPU when a process ran out of memory: every other traced process on the
//! same physical GPU (model/process.rs `Placement`: two containers' "device 0" are one GPU only
//! when their roots say so), with the bytes it held at that instant, and the processes
//! PyTorch's own message names ("Process 516 has 129.79 GiB memory in use") that tracer did not
//! see allocate. Another job's process is a co-tenant, never a rank.
//! The account's types are in holders.rs.

use std::collections::HashMap;

pub use super::holders::{HeldBy, Holders, Judged, LibraryHeld, Tenant};
use super::{holders::said, Chain, Proc};
use crate::analysis::oom::{processes_named, this_process_said, MESSAGE_ROUNDING};
use crate::{
    analysis::replay,
    model::{Gpu, Placement},
    units::format_bytes_as_pytorch as pb,
};

/// Where processes run and what they are called, for naming co-tenants.
pub struct Who<'a> {
    pub placements: &'a HashMap<u32, Placement>,
    pub comms: &'a HashMap<u32, String>,
    /// The library that made each call site's call (`--stack`).
    pub owners: &'a HashMap<crate::model::StackId, String>,
    /// What NVML said of each GPU, in time order.
    pub gpu_samples: &'a [crate::model::GpuSample],
}

impl Who<'_> {
    pub fn placement(&self, pid: u32) -> Placement {
        Placement::of(self.placements, pid)
    }
}

/// Device numbers a process may use (CUDA has at most this many in one process, in practice).
const MAX_ORDINALS: i32 = 64;

/// The other processes on `gpu` at `at_ns`: traced ones with what they held, then those
/// PyTorch's `message` names, then those NVML's `sample` lists.
fn on_gpu(
    p: &Proc<'_>,
    gpu: &Gpu,
    at_ns: i64,
    everyone: &[Proc<'_>],
    who: &Who<'_>,
    message: Option<&str>,
    sample: Option<&crate::model::GpuSample>,
) -> Vec<Tenant> {
    let named = message.map(processes_named).unwrap_or_default();
    // NVML's figures count for a traced process only when asked at the failure.
    let nvml_then = sample.filter(|s| s.ts_ns >= at_ns);
    let said_of = |pid: u32| {
        named
            .iter()
            .find(|&&(q, _)| q == pid)
            .or_else(|| nvml_then?.processes.iter().find(|&&(q, _)| q == pid))
            .map(|&(_, b)| b)
    };
    let mut tenants: Vec<Tenant> = everyone
        .iter()
        .filter(|q| q.pid != p.pid)
        .filter_map(|q| {
            let bytes = held_on(q, gpu, at_ns, who);
            (bytes > 0).then(|| Tenant {
                pid: q.pid,
                comm: who.comms.get(&q.pid).cloned(),
                bytes,
                since_ns: calls_on(q, gpu, who).next().map(|e| e.ts_ns),
                from_message: false,
                nvml_at_ns: None,
                untraced: said_of(q.pid)
                    .map(|said| said.saturating_sub(bytes))
                    .filter(|&b| b > MESSAGE_ROUNDING),
            })
        })
        .collect();
    for &(pid, bytes) in &named {
        if pid != p.pid && !tenants.iter().any(|t| t.pid == pid) {
            tenants.push(Tenant {
                pid,
                comm: who.comms.get(&pid).cloned(),
                bytes,
                since_ns: None,
                from_message: true,
                nvml_at_ns: None,
                untraced: None,
            });
        }
    }
    if let Some(sample) = sample {
        for &(pid, bytes) in &sample.processes {
            if pid != p.pid && bytes > 0 && !tenants.iter().any(|t| t.pid == pid) {
                tenants.push(Tenant {
                    pid,
                    comm: who.comms.get(&pid).cloned(),
                    bytes,
                    since_ns: None,
                    from_message: false,
                    nvml_at_ns: Some(sample.ts_ns),
                    untraced: None,
                });
            }
        }
    }
    tenants.sort_by_key(|t| std::cmp::Reverse(t.total()));
    tenants
}

/// How long after an out-of-memory tracer's own NVML sample (made when it saw the failure) is
/// taken for that instant.
const NVML_AFTER_NS: i64 = 5_000_000_000;

/// What NVML said of the GPU of `pid` nearest the out-of-memory at `at_ns`: the sample tracer
/// took when it saw the failure, else the latest before (the trace's start, for processes that
/// allocated before it). The GPU is the one NVML numbers as `gpu` where the process's root
/// named it, else the one NVML lists the process on.
fn nvml_at<'a>(
    pid: u32,
    gpu: &Gpu,
    at_ns: i64,
    samples: &'a [crate::model::GpuSample],
) -> Option<&'a crate::model::GpuSample> {
    let when = samples
        .iter()
        .map(|s| s.ts_ns)
        .filter(|&t| t >= at_ns && t - at_ns <= NVML_AFTER_NS)
        .min()
        .or_else(|| samples.iter().map(|s| s.ts_ns).filter(|&t| t < at_ns).max())?;
    let at_once = || samples.iter().filter(move |s| s.ts_ns == when);
    let host_gpu = gpu.key == gpu.label;
    at_once()
        .find(|s| host_gpu && s.gpu == gpu.label)
        .or_else(|| at_once().find(|s| s.processes.iter().any(|&(p, b)| p == pid && b > 0)))
}

/// Part of the OOM rule (runs.rs `oom`), before its chain is returned: adds to the chain of `p`
/// (its last timeline entry: the failure PyTorch raised for) who else held the GPU, and, when
/// they held more than the request, says the memory was theirs.
pub fn name_in_oom(
    chain: &mut Chain,
    p: &Proc<'_>,
    everyone: &[Proc<'_>],
    who: &Who<'_>,
    message: Option<&str>,
    judged: Option<Judged<'_>>,
) -> Option<Holders> {
    let at_ns = chain.timeline.last().map(|t| t.ts_ns)?;
    let failed = p
        .all
        .iter()
        .rev()
        .find(|e| e.ts_ns == at_ns && e.ret != 0)?;
    let gpu = who.placement(p.pid).gpu(failed.device);
    let sample = nvml_at(p.pid, &gpu, at_ns, who.gpu_samples);
    let tenants = on_gpu(p, &gpu, at_ns, everyone, who, message, sample);
    let outside = outside_by_library(p, &gpu, at_ns, who);
    let held = held_on(p, &gpu, at_ns, who);
    let reading = last_reading(p, failed.device, at_ns);
    // What NVML said of this process counts only when asked at the failure.
    let nvml = sample.filter(|s| s.ts_ns >= at_ns);
    let nvml_self = nvml.and_then(|s| {
        s.processes
            .iter()
            .find(|&&(q, _)| q == p.pid)
            .map(|&(_, b)| b)
    });
    // PyTorch's figure (and NVML's) is read after the failure, as the device reading is: the
    // traced bytes to set beside it are those of that instant (a refused request has given back
    // the pages it made by then).
    let held_then = reading
        .filter(|r| r.ts_ns > at_ns)
        .map_or(held, |r| held_on(p, &gpu, r.ts_ns, who));
    let untraced = message
        .and_then(this_process_said)
        .or(nvml_self)
        .map(|said| said.saturating_sub(held_then))
        .filter(|&b| b > MESSAGE_ROUNDING);
    let unseen = reading.map(|r| held_by_no_one_traced(p, &gpu, r, everyone, who));
    // What no traced call held but the message or NVML names: processes tracer did not see
    // allocate, and traced processes' contexts.
    let named: u64 = tenants
        .iter()
        .map(|t| {
            if t.from_message || t.nvml_at_ns.is_some() {
                t.bytes
            } else {
                t.untraced.unwrap_or(0)
            }
        })
        .sum();
    let unattributed = unseen
        .map(|u| u.saturating_sub(named + untraced.unwrap_or(0)))
        .filter(|&b| b > MESSAGE_ROUNDING);
    let others: u64 = tenants.iter().map(Tenant::total).sum();
    let arithmetic = super::arithmetic::of_failure(&super::arithmetic::Failure {
        failed,
        at_ns,
        judged: judged.as_ref(),
        message,
        nvml,
        reading,
        others,
        outside: outside.iter().map(|o| o.bytes).sum(),
        untraced,
        unattributed,
    });
    let verdict = super::arithmetic::held_by(&arithmetic, || {
        old_verdict(
            judged.as_ref().and_then(|j| j.fragmentation),
            others,
            failed.size,
            unattributed,
            untraced,
            reading,
        )
    });
    let holders = Holders {
        pid: p.pid,
        device: failed.device,
        gpu: gpu.label.clone(),
        at_ns,
        requested: failed.size,
        device_total: reading.map(|r| r.aux1).or(nvml.map(|s| s.total)),
        device_free: arithmetic.could_give,
        allocated: judged.as_ref().map(|j| j.failure.total.allocated),
        cached: judged.as_ref().map(|j| j.failure.total.cached()),
        held,
        outside,
        untraced,
        others: tenants,
        unattributed,
        verdict,
        arithmetic,
        site: None,
    };
    say_in_chain(chain, &holders, reading, message.is_some());
    super::arithmetic::say(chain, &holders, judged.as_ref());
    Some(holders)
}

/// Who held the memory by the cache's own verdict and the figures beside it, where the OOM's
/// arithmetic decides nothing.
fn old_verdict(
    fragmentation: Option<bool>,
    others: u64,
    requested: u64,
    unattributed: Option<u64>,
    untraced: Option<u64>,
    reading: Option<&crate::model::Event>,
) -> HeldBy {
    match fragmentation {
        Some(true) => HeldBy::Fragmentation,
        _ if others >= requested => HeldBy::OtherProcesses,
        Some(false) if unattributed.is_some_and(|u| u >= requested) => HeldBy::Unknown,
        Some(false)
            if reading.is_some_and(|r| {
                requested
                    > r.aux1
                        .saturating_sub(others + unattributed.unwrap_or(0) + untraced.unwrap_or(0))
            }) =>
        {
            HeldBy::BeyondDevice
        }
        Some(false) => HeldBy::ThisProcess,
        None => HeldBy::Unknown,
    }
}

/// The figures, said in the chain; the verdict said in its effect and fixes.
fn say_in_chain(
    chain: &mut Chain,
    h: &Holders,
    reading: Option<&crate::model::Event>,
    has_message: bool,
) {
    if !h.outside.is_empty() {
        let listed: Vec<String> = h
            .outside
            .iter()
            .map(|o| {
                format!(
                    "{} {} ({} allocation(s))",
                    o.library,
                    pb(o.bytes),
                    o.allocations
                )
            })
            .collect();
        chain.compounding.push(format!(
            "this process's memory outside PyTorch's allocator on {} (taken past the CUDA runtime): {}",
            h.gpu,
            listed.join("; ")
        ));
    }
    if let Some(untraced) = h.untraced {
        chain.compounding.push(format!(
            "this process had {} on {} that tracer did not see it take (PyTorch's message or NVML, less its traced calls): its CUDA context, mostly",
            pb(untraced),
            h.gpu
        ));
    }
    if let (Some(u), Some(r)) = (h.unattributed, reading) {
        chain.compounding.push(format!(
            "{} of {} was held by no traced process when cudaMemGetInfo last said ({} in all, {} free){}: the CUDA context, processes that allocated before the trace, or libraries not traced; nvidia-smi, or PyTorch's message where it lists processes, names them",
            pb(u),
            h.gpu,
            pb(r.aux1),
            pb(r.aux0.min(r.aux1)),
            if h.others.iter().any(|t| t.from_message || t.nvml_at_ns.is_some()) {
                " and no process PyTorch's message or NVML names"
            } else {
                ""
            }
        ));
    }
    if h.others.is_empty() {
        chain.compounding.push(format!(
            "no other traced process held memory on {} then{}",
            h.gpu,
            if has_message {
                " and PyTorch's message names none"
            } else {
                " (processes that allocated before the trace are not seen: PyTorch's out-of-memory message or nvidia-smi names them)"
            }
        ));
    } else {
        let others: u64 = h.others.iter().map(Tenant::total).sum();
        let listed: Vec<String> = h.others.iter().map(said).collect();
        chain.compounding.push(format!(
            "other processes held {} on {}: {}",
            pb(others),
            h.gpu,
            listed.join("; ")
        ));
    }
}

/// This process's device memory on `gpu` through its traced calls, at `at_ns`.
fn held_on(p: &Proc<'_>, gpu: &Gpu, at_ns: i64, who: &Who<'_>) -> u64 {
    replay::held_bytes_at(calls_on(p, gpu, who), at_ns)
}

/// This process's calls on `gpu` (under whichever of its device numbers stands for it).
fn calls_on<'a>(
    p: &Proc<'a>,
    gpu: &Gpu,
    who: &Who<'_>,
) -> impl Iterator<Item = &'a crate::model::Event> {
    let place = who.placement(p.pid);
    let ordinals: Vec<i32> = (0..MAX_ORDINALS)
        .filter(|&d| place.gpu(d).key == gpu.key)
        .collect();
    p.all.iter().filter(move |e| ordinals.contains(&e.device))
}

/// The last cudaMemGetInfo of `device` before the failure (or the one PyTorch makes for its
/// message right after).
fn last_reading<'a>(p: &Proc<'a>, device: i32, at_ns: i64) -> Option<&'a crate::model::Event> {
    use tracer_common::OpClass;
    p.all
        .iter()
        .rev()
        .filter(|e| e.ts_ns <= at_ns + 1_000_000_000)
        .find(|e| e.class() == OpClass::MemInfo && e.ret == 0 && e.aux1 > 0 && e.device == device)
}

/// The process's device memory taken past the CUDA runtime (cuMemAlloc* by cuBLAS, NCCL, an
/// extension: not the allocator's segments, which come from cudaMalloc) and still held at
/// `at_ns` on `gpu`, by the library that took it (its call site's, under `--stack`).
fn outside_by_library(p: &Proc<'_>, gpu: &Gpu, at_ns: i64, who: &Who<'_>) -> Vec<LibraryHeld> {
    use crate::model::attempts::Outermost;
    use tracer_common::{Library, OpClass, Space};
    let place = who.placement(p.pid);
    let on_gpu = |d: i32| place.gpu(d).key == gpu.key;
    let mut live: HashMap<u64, crate::model::Event> = HashMap::new();
    let mut outermost = Outermost::default();
    let mut take = |e: crate::model::Event| {
        if e.space() != Space::Device || e.ret != 0 || e.ptr == 0 {
            return;
        }
        match e.class() {
            OpClass::Alloc if e.op.spec().library == Library::Driver && on_gpu(e.device) => {
                live.insert(e.ptr, e);
            }
            OpClass::Free => {
                live.remove(&e.ptr);
            }
            _ => {}
        }
    };
    for e in p.all.iter().take_while(|e| e.ts_ns <= at_ns) {
        outermost.push(e, &mut take);
    }
    outermost.finish(&mut take);
    let mut by_owner: HashMap<String, (u64, u64)> = HashMap::new();
    for e in live.values() {
        let owner = e
            .stack
            .and_then(|id| who.owners.get(&id).cloned())
            .unwrap_or_else(|| "a library not known (trace with --stack to name it)".into());
        let o = by_owner.entry(owner).or_default();
        o.0 += 1;
        o.1 += e.size;
    }
    let mut owners: Vec<LibraryHeld> = by_owner
        .into_iter()
        .map(|(library, (allocations, bytes))| LibraryHeld {
            library,
            bytes,
            allocations,
        })
        .collect();
    owners.sort_by_key(|o| (std::cmp::Reverse(o.bytes), o.library.clone()));
    owners
}

/// At cudaMemGetInfo's `reading`: the bytes in use that neither this process nor any other
/// traced process on the GPU held then.
fn held_by_no_one_traced(
    p: &Proc<'_>,
    gpu: &Gpu,
    reading: &crate::model::Event,
    everyone: &[Proc<'_>],
    who: &Who<'_>,
) -> u64 {
    let (total, free) = (reading.aux1, reading.aux0.min(reading.aux1));
    let traced: u64 = held_on(p, gpu, reading.ts_ns, who)
        + everyone
            .iter()
            .filter(|q| q.pid != p.pid)
            .map(|q| held_on(q, gpu, reading.ts_ns, who))
            .sum::<u64>();
    (total - free).saturating_sub(traced)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nvml_is_read_at_the_oom_else_before_it_on_the_processes_gpu() {
        let sample = |ts_ns, gpu: &str, processes: Vec<(u32, u64)>| crate::model::GpuSample {
            ts_ns,
            gpu: gpu.into(),
            total: 100,
            used: 50,
            processes,
        };
        let samples = [
            sample(10, "GPU 0", vec![(7, 5), (9, 40)]),
            sample(10, "GPU 1", vec![(8, 5)]),
            sample(2_000, "GPU 0", vec![(7, 30), (9, 40)]),
            sample(2_000, "GPU 1", vec![(8, 5)]),
        ];
        let host = |n: u32| Gpu {
            label: format!("GPU {n}"),
            key: format!("GPU {n}"),
        };
        let unknown = Gpu {
            label: "GPU 0".into(),
            key: "GPU 0 (mount namespace 4)".into(),
        };
        // The sample tracer took at the failure; the GPU the process's root named.
        assert_eq!(nvml_at(7, &host(1), 1_000, &samples), Some(&samples[3]));
        // A GPU not named by the root: the one NVML lists the process on.
        assert_eq!(nvml_at(7, &unknown, 1_000, &samples), Some(&samples[2]));
        // No sample after the failure within 5 s: the latest before (the trace's start).
        assert_eq!(
            nvml_at(7, &unknown, 10_000_000_000, &samples),
            Some(&samples[2])
        );
        assert_eq!(nvml_at(7, &unknown, 5, &samples), Some(&samples[0]));
        assert_eq!(
            nvml_at(3, &unknown, 5, &samples),
            None,
            "a process NVML does not list"
        );
        assert_eq!(nvml_at(7, &unknown, 5, &[]), None);
    }

    #[test]
    fn pytorchs_message_names_other_processes() {
        let m = "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 139.80 GiB of which 1.23 GiB is free. Process 516 has 129.79 GiB memory in use. Including non-PyTorch memory, this process has 8.50 GiB memory in use.";
        assert_eq!(processes_named(m), [(516, (129.79 * 1073741824.0) as u64)]);
        assert!(processes_named("CUDA out of memory. Tried to allocate 2.00 GiB.").is_empty());
    }
}
