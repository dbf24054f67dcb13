//! Who else held the GPU when a process ran out of memory: every other traced process on the
//! same physical GPU (model/process.rs `Placement`: two containers' "device 0" are one GPU only
//! when their roots say so), with the bytes it held at that instant, and the processes
//! PyTorch's own message names ("Process 516 has 129.79 GiB memory in use") that tracer did not
//! see allocate. Another job's process is a co-tenant, never a rank.

use std::collections::HashMap;

use super::{Chain, Proc};
use crate::{
    analysis::replay,
    model::{Gpu, Placement},
    units::{format_bytes_as_pytorch as pb, format_utc},
};

/// Another process on the GPU at the out-of-memory.
#[derive(Clone, Debug, PartialEq)]
pub struct Tenant {
    pub pid: u32,
    pub comm: Option<String>,
    pub bytes: u64,
    /// Its first call on the GPU that tracer saw.
    pub since_ns: Option<i64>,
    /// Known from PyTorch's message only: it allocated before the trace, or is not traced.
    pub from_message: bool,
}

/// Where processes run and what they are called, for naming co-tenants.
pub struct Who<'a> {
    pub placements: &'a HashMap<u32, Placement>,
    pub comms: &'a HashMap<u32, String>,
    /// The library that made each call site's call (`--stack`).
    pub owners: &'a HashMap<crate::model::StackId, String>,
}

impl Who<'_> {
    pub fn placement(&self, pid: u32) -> Placement {
        self.placements
            .get(&pid)
            .cloned()
            .unwrap_or_else(|| Placement::new(pid, &HashMap::new(), None))
    }
}

/// Device numbers a process may use (CUDA has at most this many in one process, in practice).
const MAX_ORDINALS: i32 = 64;

/// The other processes on the GPU behind device `device` of `p`, at `at_ns`.
pub fn on_gpu(
    p: &Proc<'_>,
    device: i32,
    at_ns: i64,
    everyone: &[Proc<'_>],
    who: &Who<'_>,
    message: Option<&str>,
) -> (Gpu, Vec<Tenant>) {
    let gpu = who.placement(p.pid).gpu(device);
    let mut tenants: Vec<Tenant> = everyone
        .iter()
        .filter(|q| q.pid != p.pid)
        .filter_map(|q| {
            let place = who.placement(q.pid);
            let ordinals: Vec<i32> = (0..MAX_ORDINALS)
                .filter(|&d| place.gpu(d).key == gpu.key)
                .collect();
            let mine = || q.all.iter().filter(|e| ordinals.contains(&e.device));
            let bytes = replay::held_bytes_at(mine(), at_ns);
            (bytes > 0).then(|| Tenant {
                pid: q.pid,
                comm: who.comms.get(&q.pid).cloned(),
                bytes,
                since_ns: mine().next().map(|e| e.ts_ns),
                from_message: false,
            })
        })
        .collect();
    for (pid, bytes) in message.map(processes_named).unwrap_or_default() {
        if pid != p.pid && !tenants.iter().any(|t| t.pid == pid) {
            tenants.push(Tenant {
                pid,
                comm: who.comms.get(&pid).cloned(),
                bytes,
                since_ns: None,
                from_message: true,
            });
        }
    }
    tenants.sort_by_key(|t| std::cmp::Reverse(t.bytes));
    (gpu, tenants)
}

/// "Process 516 has 129.79 GiB memory in use": the processes PyTorch's message names, with
/// their bytes (its two decimals).
pub fn processes_named(message: &str) -> Vec<(u32, u64)> {
    message
        .split("Process ")
        .skip(1)
        .filter_map(|rest| {
            let (pid, rest) = rest.split_once(" has ")?;
            let mut words = rest.split_whitespace();
            let value: f64 = words.next()?.parse().ok()?;
            let unit = match words.next()? {
                "bytes" => 1.0,
                "KiB" => 1024.0,
                "MiB" => 1048576.0,
                "GiB" => 1073741824.0,
                _ => return None,
            };
            Some((pid.trim().parse().ok()?, (value * unit) as u64))
        })
        .collect()
}

/// Adds to the OOM chain of `p` (its last timeline entry: the failure PyTorch raised for) who
/// else held the GPU, and, when they held more than the request, says the memory was theirs.
pub fn name_in_oom(
    chain: &mut Chain,
    p: &Proc<'_>,
    everyone: &[Proc<'_>],
    who: &Who<'_>,
    message: Option<&str>,
) {
    let Some(at_ns) = chain.timeline.last().map(|t| t.ts_ns) else {
        return;
    };
    let Some(failed) = p.all.iter().rev().find(|e| e.ts_ns == at_ns && e.ret != 0) else {
        return;
    };
    let (gpu, tenants) = on_gpu(p, failed.device, at_ns, everyone, who, message);
    if let Some(line) = outside_by_library(p, &gpu, at_ns, who) {
        chain.compounding.push(line);
    }
    let unseen = held_by_no_one_traced(p, failed, at_ns, everyone, who);
    if let Some(u) = &unseen {
        chain.compounding.push(format!(
            "{} of {} was held by no traced process when cudaMemGetInfo last said ({} in all, {} free): the CUDA context, processes that allocated before the trace, or libraries not traced; nvidia-smi, or PyTorch's message where it lists processes, names them",
            pb(u.bytes),
            gpu.label,
            pb(u.total),
            pb(u.free)
        ));
    }
    if tenants.is_empty() {
        chain.compounding.push(format!(
            "no other traced process held memory on {} then{}",
            gpu.label,
            if message.is_some() {
                " and PyTorch's message names none"
            } else {
                " (processes that allocated before the trace are not seen: PyTorch's out-of-memory message or nvidia-smi names them)"
            }
        ));
        chain
            .fix
            .retain(|f| !f.starts_with("leave the device to this job"));
        if let Some(u) = unseen.filter(|u| u.bytes >= failed.size) {
            if !chain.effect.contains("(fragmentation)") {
                chain.effect.push_str(&format!(
                    ": {} of {} was held outside this process and no traced process held it: who held it is not known (nvidia-smi, or a trace running before the other jobs start, would settle it)",
                    pb(u.bytes),
                    gpu.label
                ));
            }
        }
        return;
    }
    let others: u64 = tenants.iter().map(|t| t.bytes).sum();
    let listed: Vec<String> = tenants.iter().map(said).collect();
    chain.compounding.push(format!(
        "other processes held {} on {}: {}",
        pb(others),
        gpu.label,
        listed.join("; ")
    ));
    // The request would have fit in what the others held: the memory was theirs.
    if others >= failed.size && !chain.effect.contains("(fragmentation)") {
        chain.effect = chain
            .effect
            .replace(
                "the memory is in use, not lost to fragmentation (capacity)",
                "the memory is in use, by other processes",
            )
            .to_string();
        chain.effect.push_str(&format!(
            ": held by other processes on {} ({}), more than the {} requested",
            gpu.label,
            pb(others),
            pb(failed.size)
        ));
        chain.fix.insert(
            0,
            format!(
                "run this job where it has {} to itself, or bound the other processes there ({} held)",
                gpu.label,
                pb(others)
            ),
        );
        chain.fix.retain(|f| {
            !f.starts_with("reduce the batch size") && !f.starts_with("reduce peak memory")
        });
    }
}

/// The process's device memory taken past the CUDA runtime (cuMemAlloc* by cuBLAS, NCCL, an
/// extension: not the allocator's segments, which come from cudaMalloc) and still held at
/// `at_ns` on `gpu`, by the library that took it (its call site's, under `--stack`).
fn outside_by_library(p: &Proc<'_>, gpu: &Gpu, at_ns: i64, who: &Who<'_>) -> Option<String> {
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
    if live.is_empty() {
        return None;
    }
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
    let mut owners: Vec<(String, (u64, u64))> = by_owner.into_iter().collect();
    owners.sort_by_key(|(name, (_, bytes))| (std::cmp::Reverse(*bytes), name.clone()));
    let listed: Vec<String> = owners
        .iter()
        .map(|(name, (n, bytes))| format!("{name} {} ({n} allocation(s))", pb(*bytes)))
        .collect();
    Some(format!(
        "this process's memory outside PyTorch's allocator on {} (taken past the CUDA runtime): {}",
        gpu.label,
        listed.join("; ")
    ))
}

/// Device memory in use that no traced process held, when the device last said.
struct Unseen {
    bytes: u64,
    total: u64,
    free: u64,
}

/// At the last cudaMemGetInfo of the failed call's device before the failure (or the one PyTorch
/// makes for its message right after): the bytes in use that neither this process nor any other
/// traced process on the GPU held then.
fn held_by_no_one_traced(
    p: &Proc<'_>,
    failed: &crate::model::Event,
    at_ns: i64,
    everyone: &[Proc<'_>],
    who: &Who<'_>,
) -> Option<Unseen> {
    use tracer_common::OpClass;
    let reading = p
        .all
        .iter()
        .rev()
        .filter(|e| e.ts_ns <= at_ns + 1_000_000_000)
        .find(|e| {
            e.class() == OpClass::MemInfo && e.ret == 0 && e.aux1 > 0 && e.device == failed.device
        })?;
    let (total, free) = (reading.aux1, reading.aux0.min(reading.aux1));
    let gpu = who.placement(p.pid).gpu(failed.device);
    let held = |q: &Proc<'_>| {
        let place = who.placement(q.pid);
        let ordinals: Vec<i32> = (0..MAX_ORDINALS)
            .filter(|&d| place.gpu(d).key == gpu.key)
            .collect();
        replay::held_bytes_at(
            q.all.iter().filter(|e| ordinals.contains(&e.device)),
            reading.ts_ns,
        )
    };
    let traced: u64 = held(p)
        + everyone
            .iter()
            .filter(|q| q.pid != p.pid)
            .map(held)
            .sum::<u64>();
    let bytes = (total - free).saturating_sub(traced);
    (bytes > 0).then_some(Unseen { bytes, total, free })
}

/// "pid 516 (python3) 129.30 GiB since 2026-11-26 18:28:15.634 UTC".
fn said(t: &Tenant) -> String {
    let name = t
        .comm
        .as_deref()
        .map(|c| format!(" ({c})"))
        .unwrap_or_default();
    let when = match (t.from_message, t.since_ns) {
        (true, _) => {
            " (named by PyTorch's message: it allocated before the trace or is not traced)"
                .to_owned()
        }
        (false, Some(ns)) => format!(" since {}", format_utc(ns)),
        (false, None) => String::new(),
    };
    format!("pid {}{name} {}{when}", t.pid, pb(t.bytes))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pytorchs_message_names_other_processes() {
        let m = "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 139.80 GiB of which 1.23 GiB is free. Process 516 has 129.79 GiB memory in use. Including non-PyTorch memory, this process has 8.50 GiB memory in use.";
        assert_eq!(processes_named(m), [(516, (129.79 * 1073741824.0) as u64)]);
        assert!(processes_named("CUDA out of memory. Tried to allocate 2.00 GiB.").is_empty());
    }
}
