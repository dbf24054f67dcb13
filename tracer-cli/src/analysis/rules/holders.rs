//! Who held the GPU at an out-of-memory, as data: the other processes (tenants), this
//! process's share, the verdict, and the OOM's arithmetic; what the layout alone judged. Read
//! by the OOM rule (tenants.rs, arithmetic.rs) and by every command that shows the failure.

use crate::units::{format_bytes_as_pytorch as pb, format_utc};

/// Another process on the GPU at the out-of-memory.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct Tenant {
    pub pid: u32,
    pub comm: Option<String>,
    pub bytes: u64,
    /// Its first call on the GPU that tracer saw.
    pub since_ns: Option<i64>,
    /// Known from PyTorch's message only: it allocated before the trace, or is not traced.
    pub from_message: bool,
    /// Known from NVML only (tracer asked it at that time): it allocated before the trace, or
    /// is not traced.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub nvml_at_ns: Option<i64>,
    /// A traced process that PyTorch's message (else NVML, asked at the failure) says had more
    /// than tracer saw it take: the difference, its CUDA context mostly (to the message's two
    /// decimals).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub untraced: Option<u64>,
}

impl Tenant {
    /// All it held: what tracer saw it take and what the message or NVML adds.
    pub fn total(&self) -> u64 {
        self.bytes + self.untraced.unwrap_or(0)
    }
}

/// What the allocator's layout said of an out-of-memory (analysis/mod.rs `allocator_chains`).
pub struct Judged<'f> {
    /// The failure's figures.
    pub failure: &'f crate::analysis::allocator::Forensics,
    /// The cache held the bytes (fragmentation), did not (capacity), or that is not known.
    pub fragmentation: Option<bool>,
    /// Free bytes in split blocks inside live segments after the flush, where known.
    pub split: Option<u64>,
    /// The verdict from the cache alone, as a clause, and its fixes: said where the OOM's
    /// arithmetic decides nothing.
    pub clause: String,
    pub fixes: Vec<super::Fix>,
}

/// Who held the GPU when a process ran out of memory: its allocator, its memory outside the
/// allocator by library, the other processes on the GPU, and what no one traced held.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct Holders {
    pub pid: u32,
    pub device: i32,
    /// The physical GPU ("GPU 3").
    pub gpu: String,
    pub at_ns: i64,
    /// What the failed call asked the device for.
    pub requested: u64,
    /// The device's capacity and free bytes when cudaMemGetInfo last said (the failure's
    /// figures keep the free bytes current with this process's own calls since).
    pub device_total: Option<u64>,
    pub device_free: Option<u64>,
    /// This process's allocator: bytes in blocks handed out, and cached (reserved but
    /// unallocated), where PyTorch's probes were seen.
    pub allocated: Option<u64>,
    pub cached: Option<u64>,
    /// This process's device memory through the traced calls (segments and outside).
    pub held: u64,
    /// This process's memory outside the allocator, by the library that took it.
    pub outside: Vec<LibraryHeld>,
    /// What PyTorch's message (else NVML, asked at the failure) says this process has beyond
    /// what tracer saw it take: its CUDA context, mostly (to the message's two decimals).
    pub untraced: Option<u64>,
    pub others: Vec<Tenant>,
    /// Memory in use that no traced process held and no process PyTorch's message or NVML
    /// names.
    pub unattributed: Option<u64>,
    pub verdict: HeldBy,
    /// What was asked, what the device could give, the shortfall and what stood in the way.
    pub arithmetic: crate::analysis::oom::Arithmetic,
    /// The failed call's site (`--stack`): native and Python line.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub site: Option<String>,
}

/// The memory the request needed was...
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum HeldBy {
    /// ...held by other processes on the GPU: more than the request.
    OtherProcesses,
    /// ...in use by this process (its tensors; the cache did not hold it).
    ThisProcess,
    /// ...more than the device could give this process even with none of its own memory
    /// held: its capacity less what others and the CUDA context held.
    BeyondDevice,
    /// ...in this process's cache, in no block that fit.
    Fragmentation,
    /// ...not known: the figures do not tell (the chain says what would settle it).
    Unknown,
    /// ...both in this process's split blocks and in other processes' hands: each alone, or
    /// the two together, exceed the shortfall.
    FragmentationAndOtherProcesses,
    /// ...not the device's: the process's memory fraction refused it before any cudaMalloc.
    MemoryFraction,
    /// ...free inside CUDA graphs' (or MemPools') private pools, which the request could not
    /// use.
    PrivatePools,
    /// ...in this process's cache, which PyTorch does not flush while a CUDA graph capture is
    /// underway.
    CacheDuringCapture,
}

impl HeldBy {
    /// Its name in JSON and the metrics.
    pub fn name(self) -> &'static str {
        match self {
            HeldBy::OtherProcesses => "other_processes",
            HeldBy::ThisProcess => "this_process",
            HeldBy::BeyondDevice => "beyond_device",
            HeldBy::Fragmentation => "fragmentation",
            HeldBy::Unknown => "unknown",
            HeldBy::FragmentationAndOtherProcesses => "fragmentation_and_other_processes",
            HeldBy::MemoryFraction => "memory_fraction",
            HeldBy::PrivatePools => "private_pools",
            HeldBy::CacheDuringCapture => "cache_during_capture",
        }
    }

    fn said(self) -> &'static str {
        match self {
            HeldBy::OtherProcesses => "held by other processes",
            HeldBy::ThisProcess => "held by this process (its tensors)",
            HeldBy::BeyondDevice => {
                "more than the device could give this process even with none of its memory held"
            }
            HeldBy::Fragmentation => {
                "lost to fragmentation (the cache held it, in no block that fit)"
            }
            HeldBy::Unknown => "not known (the chain says what would settle it)",
            HeldBy::FragmentationAndOtherProcesses => {
                "held by other processes and lost to fragmentation (each share said in the chain)"
            }
            HeldBy::MemoryFraction => {
                "refused by the process's memory fraction before the device was asked"
            }
            HeldBy::PrivatePools => {
                "free inside private pools (CUDA graphs', MemPools'), which this request could not use"
            }
            HeldBy::CacheDuringCapture => {
                "free in this process's cache, not flushed: a CUDA graph capture was underway"
            }
        }
    }
}

impl Holders {
    /// The split in one line: "GPU 0 (1.00 GiB, 0 bytes free): this process 256.00 MiB
    /// (...); other processes 768.00 MiB (...); ...: held by other processes".
    pub fn split_said(&self) -> String {
        let mut device = self.gpu.clone();
        if let (Some(total), Some(free)) = (self.device_total, self.device_free) {
            device.push_str(&format!(" ({} in all, {} free)", pb(total), pb(free)));
        }
        let mut mine = Vec::new();
        if let (Some(a), Some(c)) = (self.allocated, self.cached) {
            mine.push(format!("allocated {}, cached {}", pb(a), pb(c)));
        }
        for o in &self.outside {
            mine.push(format!("{} {}", o.library, pb(o.bytes)));
        }
        if let Some(u) = self.untraced {
            mine.push(format!(
                "{} more by PyTorch's message (its CUDA context)",
                pb(u)
            ));
        }
        let mut parts = vec![format!(
            "this process {} ({})",
            pb(self.held),
            mine.join(", ")
        )];
        if !self.others.is_empty() {
            let others: u64 = self.others.iter().map(Tenant::total).sum();
            let listed: Vec<String> = self.others.iter().map(said).collect();
            parts.push(format!(
                "other processes {} ({})",
                pb(others),
                listed.join("; ")
            ));
        }
        if let Some(u) = self.unattributed {
            parts.push(format!("held by no one traced or named {}", pb(u)));
        }
        format!(
            "{device}, {} asked: {}: {}",
            pb(self.requested),
            parts.join("; "),
            self.verdict.said()
        )
    }
}

/// Bytes of device memory a library took and still held.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct LibraryHeld {
    pub library: String,
    pub bytes: u64,
    pub allocations: u64,
}

/// "pid 516 (python3) 129.30 GiB since 2026-11-26 18:28:15.634 UTC".
pub(super) fn said(t: &Tenant) -> String {
    let name = t
        .comm
        .as_deref()
        .map(|c| format!(" ({c})"))
        .unwrap_or_default();
    let when = match (t.from_message, t.nvml_at_ns, t.since_ns) {
        (true, _, _) => {
            " (named by PyTorch's message: it allocated before the trace or is not traced)"
                .to_owned()
        }
        (false, Some(at), _) => format!(
            " (NVML at {}: it allocated before the trace or is not traced)",
            format_utc(at)
        ),
        (false, None, Some(ns)) => format!(" since {}", format_utc(ns)),
        (false, None, None) => String::new(),
    };
    let more = t
        .untraced
        .map(|u| {
            format!(
                ", and {} more by PyTorch's message or NVML (its CUDA context)",
                pb(u)
            )
        })
        .unwrap_or_default();
    format!("pid {}{name} {}{when}{more}", t.pid, pb(t.bytes))
}
