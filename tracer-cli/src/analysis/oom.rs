//! The arithmetic of an out-of-memory: what was asked of the device, what the device could give
//! at that instant, the shortfall, and what stood in the way. The verdict follows from those
//! figures by the rules stated on [`Cause`]. One function ([`arithmetic`]) computes it; explain,
//! the report, mcp, `layout --at oom` and the metrics read its result through the OOM's holders.
//!
//! A refusal bounds the device's free memory: a device that refused N bytes had less than N
//! free. No figure given here says more; an estimate that did is shown beside the bound, with
//! the difference said as memory no traced call took.

use serde::Serialize;

use crate::units::format_bytes_as_pytorch as pb;

/// Where the device's free bytes at the failure come from, the most direct first.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case", tag = "kind")]
pub enum FreeSource {
    /// cudaMemGetInfo right after the failure (PyTorch reads it for its message, after its
    /// cache flush): exact.
    AfterFailure,
    /// PyTorch's out-of-memory message: cudaMemGetInfo read after its cache flush, to two
    /// decimals.
    Message,
    /// A memory snapshot's `oom` entry (`device_free`, read as the allocator failed).
    Snapshot,
    /// NVML, asked at the failure.
    Nvml,
    /// cudaMemGetInfo `age_ns` before, kept current with this process's own calls since.
    Estimate { age_ns: i64 },
    /// Nothing but the refusal itself: less than the refused size.
    Bound,
}

/// What the OOM's evidence holds, for [`arithmetic`].
#[derive(Clone, Debug, Default)]
pub struct Inputs {
    /// PyTorch's request ("Tried to allocate ...": the segment size it computed; a snapshot's
    /// `oom` entry: the rounded block).
    pub request: Option<u64>,
    /// What the device refused (the failed cudaMalloc's segment, or a page of an expandable
    /// segment); none when the refusal never reached the device.
    pub refused: Option<u64>,
    /// The refused size was one page of an expandable segment, not the whole request.
    pub page: bool,
    /// Pages the same request had made before its refused page, given back as it failed.
    pub given_back: u64,
    /// cudaMemGetInfo's free bytes read right after the failure.
    pub after_free: Option<u64>,
    pub message_free: Option<u64>,
    pub snapshot_free: Option<u64>,
    pub nvml_free: Option<u64>,
    /// cudaMemGetInfo kept current: the free bytes and their age at the failure.
    pub estimate: Option<(u64, i64)>,
    /// Free bytes in blocks inside live segments after the flush (PyTorch's "reserved but
    /// unallocated" after its flush, or tracer's layout at the retry).
    pub split: Option<u64>,
    /// Free bytes inside private pools (CUDA graphs', MemPools'): no default-pool request may
    /// use them, and PyTorch's message counts them "allocated in private pools".
    pub private: Option<u64>,
    /// Of those, the bytes in private-pool segments holding no live block: what a cache flush
    /// returns once no graph holds their pool (every graph captured into it reset).
    pub private_idle: Option<u64>,
    /// A CUDA graph capture was underway, so PyTorch flushed nothing: the bytes of the default
    /// pools' segments holding no live block (what a flush would have returned).
    pub capture_idle: Option<u64>,
    /// Bytes other processes held on the device.
    pub others: u64,
    /// This process's memory outside the allocator (libraries that call the driver directly).
    pub outside: u64,
    /// This process's memory no traced call took (its CUDA context, mostly).
    pub untraced: Option<u64>,
    /// In use on the device but held by no one traced or named.
    pub unattributed: Option<u64>,
    /// A per-process memory fraction's limit ("... N allowed;" in PyTorch's message).
    pub allowed: Option<u64>,
}

/// What decided the out-of-memory.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case", tag = "kind")]
pub enum Cause {
    /// It does not fit even with every split byte returned and no other process on the device.
    Capacity,
    /// The split bytes alone exceed the shortfall; other processes' bytes do not.
    Fragmentation,
    /// Other processes' bytes alone exceed the shortfall; the split bytes do not.
    OtherProcesses,
    /// Both stood in the way: each alone exceeds the shortfall (`each_enough`), or only the
    /// two together do.
    Both { each_enough: bool },
    /// Free blocks inside private pools (CUDA graphs', MemPools') alone exceed the shortfall:
    /// the request, routed to the default pools, could not use them; neither the split bytes
    /// nor other processes' cover it. `idle_enough`: the pools' segments holding no live block
    /// alone cover it (a flush returns those once no graph holds their pool).
    PrivatePools { idle_enough: bool },
    /// A CUDA graph capture was underway, so PyTorch ran no cache flush, and the cache's free
    /// bytes exceed the shortfall: the request could not use them. `idle_enough`: the cache's
    /// segments holding no live block alone cover it (a flush before the capture returns them).
    CaptureUnderway { idle_enough: bool },
    /// The allocator refused before asking the device: the request would pass the process's
    /// memory fraction (`torch.cuda.set_per_process_memory_fraction`).
    FractionLimit { allowed: u64 },
    /// The figures do not decide it: why, and what would settle it.
    Unknown { why: String },
}

impl Cause {
    /// Its name in JSON and the metrics.
    pub fn name(&self) -> &'static str {
        match self {
            Cause::Capacity => "capacity",
            Cause::Fragmentation => "fragmentation",
            Cause::OtherProcesses => "other_processes",
            Cause::Both { .. } => "fragmentation_and_other_processes",
            Cause::PrivatePools { .. } => "private_pools",
            Cause::CaptureUnderway { .. } => "capture_underway",
            Cause::FractionLimit { .. } => "memory_fraction",
            Cause::Unknown { .. } => "unknown",
        }
    }
}

/// The out-of-memory in figures, and the verdict that follows from them.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Arithmetic {
    /// What had to come from the device: the refused segment, or for an expandable segment
    /// PyTorch's request (its pages).
    pub asked: Option<u64>,
    pub request: Option<u64>,
    pub refused: Option<u64>,
    pub page: bool,
    /// What the device could give at that instant, and where the figure comes from.
    pub could_give: Option<u64>,
    pub source: FreeSource,
    /// The refusal's own bound on the free bytes (less than the refused size).
    pub bound: Option<u64>,
    /// An estimate of the free bytes that the refusal contradicts: its figure, its age, and
    /// the difference, memory no traced call took.
    pub contradicted: Option<(u64, i64)>,
    pub not_taken: Option<u64>,
    pub shortfall: Option<u64>,
    pub split: Option<u64>,
    /// Free bytes inside private pools (CUDA graphs', MemPools'): no default-pool request may
    /// use them, and PyTorch's message counts them "allocated in private pools".
    pub private: Option<u64>,
    pub private_idle: Option<u64>,
    pub capture_idle: Option<u64>,
    pub others: u64,
    pub outside: u64,
    pub untraced: Option<u64>,
    pub unattributed: Option<u64>,
    pub cause: Cause,
}

/// The arithmetic of one out-of-memory from its evidence.
pub fn arithmetic(i: &Inputs) -> Arithmetic {
    // A device that refused N bytes had less than N free at that instant; figures read after
    // the failure also hold the pages the request gave back as it failed.
    let bound = i.refused.map(|r| r.saturating_sub(1));
    let within = |free: u64| bound.is_none_or(|b| free <= b);
    let measured = [
        (i.after_free, FreeSource::AfterFailure),
        (i.message_free, FreeSource::Message),
        (i.snapshot_free, FreeSource::Snapshot),
        (i.nvml_free, FreeSource::Nvml),
    ]
    .into_iter()
    .find_map(|(free, source)| free.map(|f| (f, source)));
    let estimate = i.estimate.filter(|&(free, _)| within(free));
    let contradicted = i.estimate.filter(|&(free, _)| !within(free));
    let (could_give, source) = match (measured, estimate, bound) {
        (Some((f, s)), _, _) => (Some(f), s),
        (None, Some((f, age)), _) => (Some(f), FreeSource::Estimate { age_ns: age }),
        (None, None, Some(b)) => (Some(b), FreeSource::Bound),
        (None, None, None) => (None, FreeSource::Bound),
    };
    let not_taken = contradicted
        .zip(could_give)
        .map(|((est, _), free)| est.saturating_sub(free));
    let asked = if i.page {
        i.request
    } else {
        i.refused.or(i.request)
    };
    let shortfall = asked
        .zip(could_give)
        .map(|(a, f)| a.saturating_sub(f))
        .filter(|_| i.allowed.is_none());
    let cause = cause(i, asked, shortfall, source);
    Arithmetic {
        asked,
        request: i.request,
        refused: i.refused,
        page: i.page,
        could_give,
        source,
        bound,
        contradicted,
        not_taken,
        shortfall,
        split: i.split,
        private: i.private,
        private_idle: i.private_idle,
        capture_idle: i.capture_idle,
        others: i.others,
        outside: i.outside,
        untraced: i.untraced,
        unattributed: i.unattributed,
        cause,
    }
}

/// The verdict from the figures: capacity when the request does not fit even with every split
/// byte and no other process; fragmentation or other processes when that alone exceeds the
/// shortfall; both when each does, or only the two together.
fn cause(i: &Inputs, asked: Option<u64>, shortfall: Option<u64>, source: FreeSource) -> Cause {
    if let Some(allowed) = i.allowed {
        return Cause::FractionLimit { allowed };
    }
    let Some(asked) = asked else {
        return Cause::Unknown {
            why: "what was asked of the device is not known (PyTorch's out-of-memory message names the request)".into(),
        };
    };
    if shortfall == Some(0) {
        return Cause::Unknown {
            why: format!(
                "by the figures {} would have fit: the refusal came from page rounding, another device, or memory taken between the reading and the call",
                pb(asked)
            ),
        };
    }
    // With only the refusal's bound the shortfall lies between one byte and all that was
    // asked: a share that covers all of it decides, anything less does not.
    let need = match (source, shortfall) {
        (FreeSource::Bound, _) | (_, None) => asked,
        (_, Some(s)) => s,
    };
    let Some(split) = i.split else {
        return if i.others >= need {
            Cause::OtherProcesses
        } else {
            Cause::Unknown {
                why: "the allocator's free bytes inside its segments are not known (PyTorch's out-of-memory message, or its allocator probes, would settle it)".into(),
            }
        };
    };
    if let Some(idle) = i.capture_idle.filter(|_| split >= need) {
        // Not split blocks a flush could not return: no flush ran.
        return Cause::CaptureUnderway {
            idle_enough: idle >= need,
        };
    }
    match (split >= need, i.others >= need) {
        (true, true) => Cause::Both { each_enough: true },
        (true, false) => Cause::Fragmentation,
        (false, true) => Cause::OtherProcesses,
        (false, false) if split > 0 && i.others > 0 && split + i.others >= need => {
            Cause::Both { each_enough: false }
        }
        (false, false) if i.private.is_some_and(|p| p >= need) => Cause::PrivatePools {
            idle_enough: i.private_idle.is_some_and(|p| p >= need),
        },
        // Memory no one traced or named would have covered the rest: not capacity, and who
        // held it is not known.
        (false, false) if split + i.others + i.unattributed.unwrap_or(0) >= need => Cause::Unknown {
            why: format!(
                "{} was in use on the device held by no one traced or named, enough to cover the {} short: who held it is not known (nvidia-smi, or a trace running before the other jobs start, would settle it)",
                pb(i.unattributed.unwrap_or(0)),
                pb(need)
            ),
        },
        (false, false) if source == FreeSource::Bound => Cause::Unknown {
            why: format!(
                "only that the device had under {} free is known: neither the split bytes ({}) nor other processes' ({}) cover all of it; PyTorch's out-of-memory message, or NVML at the failure, would settle it",
                pb(asked),
                pb(split),
                pb(i.others)
            ),
        },
        (false, false) => Cause::Capacity,
    }
}

/// Of free bytes beside a verdict, those in `segments` holding no live block (`idle`): what a
/// flush returns (`returned`), enough to cover the shortfall or not (`rest`: where the others
/// lie).
fn idle_said(
    enough: bool,
    idle: Option<u64>,
    segments: &str,
    returned: &str,
    rest: &str,
) -> String {
    match (enough, idle) {
        (true, Some(idle)) => format!(
            "; {} of it lay in {segments} holding no live block, which {returned}",
            pb(idle)
        ),
        (false, Some(idle)) => format!(
            "; only {} of it lay in {segments} holding no live block: {rest}",
            pb(idle)
        ),
        (_, None) => String::new(),
    }
}

impl Arithmetic {
    /// The figures in one sentence: asked, could give, short by, in the way.
    pub fn figures(&self) -> String {
        if let Cause::FractionLimit { allowed } = self.cause {
            return format!(
                "asked {}; the process's memory fraction allows {} (torch.cuda.set_per_process_memory_fraction): the allocator refused without asking the device",
                self.request.map_or("an unknown size".into(), pb),
                pb(allowed)
            );
        }
        let mut parts = Vec::new();
        let asked = match (self.asked, self.refused, self.page) {
            (Some(a), Some(r), true) => format!(
                "asked {} (the device refused a {} page of an expandable segment)",
                pb(a),
                pb(r)
            ),
            (Some(a), _, false) if self.request.is_some_and(|q| q != a) => format!(
                "asked the device for a {} segment (PyTorch's request {})",
                pb(a),
                pb(self.request.unwrap_or(a))
            ),
            (Some(a), Some(_), _) => format!("asked the device for {}", pb(a)),
            (Some(a), None, _) => format!("asked {}", pb(a)),
            (None, Some(r), _) => format!("the device refused {}", pb(r)),
            (None, None, _) => "the request is not known".to_owned(),
        };
        parts.push(asked);
        parts.push(self.could_give_said());
        if let Some(s) = self.shortfall {
            parts.push(match self.source {
                FreeSource::Bound => format!("short by at least 1 byte, at most {}", pb(s.max(1))),
                _ => format!("short by {}", pb(s)),
            });
        }
        let mut way = Vec::new();
        match (self.split, self.capture_idle) {
            (Some(cached), Some(idle)) => way.push(format!(
                "{} free in the cache, not flushed: a CUDA graph capture was underway, and PyTorch runs no cache flush during one ({} of it in segments holding no live block, which a flush returns)",
                pb(cached),
                pb(idle)
            )),
            (Some(split), None) => way.push(format!(
                "{} free in split blocks inside live segments (no cache flush returns them)",
                pb(split)
            )),
            (None, _) => {}
        }
        if let Some(p) = self.private.filter(|&p| p > 0) {
            way.push(format!(
                "{} free inside private pools (CUDA graphs', MemPools'), which only requests routed to those pools may use",
                pb(p)
            ));
        }
        if self.others > 0 {
            way.push(format!("{} held by other processes", pb(self.others)));
        }
        if self.outside > 0 {
            way.push(format!(
                "{} of this process's outside PyTorch's allocator",
                pb(self.outside)
            ));
        }
        if let Some(u) = self.untraced {
            way.push(format!(
                "{} of this process's no traced call took (its CUDA context, mostly)",
                pb(u)
            ));
        }
        if let Some(u) = self.unattributed {
            way.push(format!("{} held by no one traced or named", pb(u)));
        }
        if !way.is_empty() {
            parts.push(format!("in the way: {}", way.join(", ")));
        }
        parts.join("; ")
    }

    fn could_give_said(&self) -> String {
        let Some(free) = self.could_give else {
            return "what the device could give is not known".into();
        };
        let mut said = match self.source {
            FreeSource::AfterFailure if self.capture_idle.is_some() => format!(
                "the device had {} free (cudaMemGetInfo right after the failure, with no cache flush before it: a capture was underway)",
                pb(free)
            ),
            FreeSource::AfterFailure => format!(
                "the device had {} free (cudaMemGetInfo right after the failure, after the cache flush: the reading PyTorch's message is made from)",
                pb(free)
            ),
            FreeSource::Message => format!(
                "the device had {} free (PyTorch's message, read after its cache flush)",
                pb(free)
            ),
            FreeSource::Snapshot => format!(
                "the device had {} free (the memory snapshot's oom entry)",
                pb(free)
            ),
            FreeSource::Nvml => format!("the device had {} free (NVML at the failure)", pb(free)),
            FreeSource::Estimate { age_ns } => format!(
                "the device had {} free (cudaMemGetInfo {} before, kept current with this process's calls since)",
                pb(free),
                crate::units::format_ns(age_ns.max(0) as u64)
            ),
            FreeSource::Bound => format!(
                "the device had at most {} free (it refused {})",
                pb(free),
                pb(self.refused.unwrap_or(free + 1))
            ),
        };
        if let (Some((est, age)), Some(diff)) = (self.contradicted, self.not_taken) {
            said.push_str(&format!(
                "; cudaMemGetInfo {} before, kept current with this process's calls, said {}: {} went where no traced call took it (lazily loaded modules, the CUDA context growing, another process)",
                crate::units::format_ns(age.max(0) as u64),
                pb(est),
                pb(diff)
            ));
        }
        said
    }

    /// The verdict, with the figures that decide it.
    pub fn verdict(&self) -> String {
        self.verdict_on("the device")
    }

    /// The verdict, naming the GPU (`on`: "GPU 0").
    pub fn verdict_on(&self, on: &str) -> String {
        let short = self.shortfall.map_or("the request".into(), pb);
        let split = self.split.unwrap_or(0);
        match &self.cause {
            Cause::Capacity => format!(
                "capacity: it does not fit even with every split byte ({}) returned and no other process on the device ({} short)",
                pb(split),
                short
            ),
            Cause::Fragmentation => format!(
                "fragmentation decided it: {} lay free in split blocks, more than the {} it was short, in no block that fit",
                pb(split),
                short
            ),
            Cause::CaptureUnderway { idle_enough } => format!(
                "a capture in progress decided it: {} lay free in this process's cache, more than the {} it was short, and PyTorch flushes no cache while a CUDA graph capture (or any routing to a private pool: use_mem_pool) is underway{}",
                pb(split),
                short,
                idle_said(
                    *idle_enough,
                    self.capture_idle,
                    "segments",
                    "a flush before the capture returns",
                    "the rest is split blocks beside live ones"
                )
            ),
            Cause::PrivatePools { idle_enough } => format!(
                "private pools decided it: {} lay free inside CUDA graphs' (or MemPools') private pools, more than the {} it was short, which this request (routed to the default pools) may not use; the split bytes ({}) and other processes ({}) were not enough{}",
                pb(self.private.unwrap_or(0)),
                short,
                pb(split),
                pb(self.others),
                idle_said(
                    *idle_enough,
                    self.private_idle,
                    "pool segments",
                    "a cache flush returns once no graph holds their pool",
                    "the rest sits beside blocks the graphs keep"
                )
            ),
            Cause::OtherProcesses => format!(
                "other processes decided it: held by other processes on {on} ({}), more than the {} it was short{}",
                pb(self.others),
                short,
                if self.split.is_some() {
                    format!("; the split bytes ({}) were not enough", pb(split))
                } else {
                    String::new()
                }
            ),
            Cause::Both { each_enough: true } => format!(
                "fragmentation and other processes each decided it: the split bytes ({}) and what other processes held on {on} ({}) each exceed the {} it was short",
                pb(split),
                pb(self.others),
                short
            ),
            Cause::Both { each_enough: false } => format!(
                "fragmentation and other processes together decided it: {} short, the split bytes {} of it, what other processes held on {on} {}",
                short,
                pb(split),
                pb(self.others)
            ),
            Cause::FractionLimit { allowed } => format!(
                "the process's memory fraction decided it: {} allowed, and the request would pass it (no cudaMalloc was made)",
                pb(*allowed)
            ),
            Cause::Unknown { why } => format!("not decided: {why}"),
        }
    }
}

/// "... 2.81 GiB allowed; ...": a per-process memory fraction's limit in PyTorch's message.
pub fn allowed_said(message: &str) -> Option<u64> {
    let head = message.split_once(" allowed;")?.0;
    let words: Vec<&str> = head.split_whitespace().collect();
    let n = words.len();
    (n >= 2)
        .then(|| pytorch_size(&words[n - 2..].join(" ")))
        .flatten()
}

/// "... GPU 0 has a total capacity of 79.19 GiB of which 10.50 MiB is free.": the free bytes
/// PyTorch read after its flush.
pub fn free_said(message: &str) -> Option<u64> {
    if let Some((_, rest)) = message.split_once(" of which ") {
        return pytorch_size(rest.split(" is free").next()?);
    }
    // An imported snapshot's `oom` entry: "GPU 0 has 10.00 MiB free (PyTorch's memory
    // snapshot ...)".
    let rest = message.split_once("GPU ")?.1.split_once(" has ")?.1;
    let (size, after) = rest.split_once(" free")?;
    (size.split_whitespace().count() == 2 && !after.starts_with('d'))
        .then(|| pytorch_size(size))
        .flatten()
}

/// What an imported snapshot's `oom` entry recorded to the byte (its `device_free`), which the
/// import writes into the message it makes of the entry: "... (PyTorch's memory snapshot: ...,
/// 60358656 bytes free)". None for PyTorch's own messages, which say two decimals.
pub fn snapshot_free_said(message: &str) -> Option<u64> {
    let (_, rest) = message.split_once(SNAPSHOT_OOM_SAYS)?;
    let (digits, _) = rest.split_once(" bytes free")?;
    digits.trim().parse().ok()
}

/// Where the import's message of a snapshot's `oom` entry says the exact free bytes.
pub const SNAPSHOT_OOM_SAYS: &str =
    "(PyTorch's memory snapshot: the allocator's trace entry of the failure, ";

/// "... with 22.00 MiB allocated in private pools (e.g., CUDA Graphs)": the free blocks inside
/// private pools, which PyTorch counts as allocated.
pub fn pytorch_private(message: &str) -> Option<u64> {
    let before = message
        .split(" allocated in private pools")
        .next()
        .filter(|b| b.len() < message.len())?;
    pytorch_size(before.rsplit(", with ").next()?)
}

/// "... and 55.66 MiB is reserved by PyTorch but unallocated": the allocator's own cached bytes.
pub fn pytorch_cached(message: &str) -> Option<u64> {
    let before = message
        .split(" is reserved by PyTorch but unallocated")
        .next()?;
    pytorch_size(before.rsplit(", and ").next()?)
}

/// PyTorch's figures have two decimals: a difference this small is the rounding. Memory held by
/// no one traced or named is said only above it, by every command.
pub const MESSAGE_ROUNDING: u64 = 8 << 20;

/// A size as PyTorch's format_size writes it ("55.66 MiB", "512 bytes").
pub fn pytorch_size(text: &str) -> Option<u64> {
    let compact = text
        .trim()
        .trim_end_matches(['.', ';', ','])
        .replace("bytes", "B")
        .replace(' ', "");
    if compact.trim_start_matches('0').starts_with(['B', '.']) || compact == "0" {
        return Some(0);
    }
    crate::units::parse_size(&compact).ok()
}

/// "Tried to allocate 22.00 MiB.": the request PyTorch names.
pub fn pytorch_tried(message: &str) -> Option<u64> {
    let rest = message.split_once("Tried to allocate ")?.1;
    pytorch_size(rest.split(". ").next()?)
}

/// "Process 516 has 129.79 GiB memory in use": the processes PyTorch's message names, with
/// their bytes (its two decimals).
pub fn processes_named(message: &str) -> Vec<(u32, u64)> {
    message
        .split("Process ")
        .skip(1)
        .filter_map(|rest| {
            let (pid, rest) = rest.split_once(" has ")?;
            let bytes = pytorch_size(rest.split(" memory in use").next()?)?;
            Some((pid.trim().parse().ok()?, bytes))
        })
        .collect()
}

/// "Including non-PyTorch memory, this process has 1.24 GiB memory in use": NVML's figure for
/// the process, its CUDA context included.
pub fn this_process_said(message: &str) -> Option<u64> {
    let rest = message.split_once("this process has ")?.1;
    pytorch_size(rest.split(" memory in use").next()?)
}

#[cfg(test)]
mod tests;
