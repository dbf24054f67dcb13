//! The OOM chain's arithmetic: the failure's evidence (the refused call, PyTorch's message, the
//! allocator's layout, NVML, who else held the GPU) turned into analysis/oom.rs's inputs, its
//! verdict into who held the memory, and both said in the chain with the fixes that follow.

use tracer_common::Op;

use super::{entry, measured, Chain, Fix, Rule, Severity, FIX_EXPANDABLE, FIX_MAX_SPLIT};
use crate::{
    analysis::oom::{self, Arithmetic, Cause},
    units::format_bytes_as_pytorch as pb,
};

use super::holders::{HeldBy, Holders, Judged};

/// The fix when the process's memory fraction refused the request.
const FIX_FRACTION: Fix = Fix {
    text: std::borrow::Cow::Borrowed(
        "raise the process's memory fraction (torch.cuda.set_per_process_memory_fraction), or reduce peak memory: a smaller batch or sequence length, activation checkpointing",
    ),
    setting: None,
};

/// One failure's evidence, as the OOM rule found it.
pub struct Failure<'a, 'f> {
    /// The refused call (the failure for good, or its retry).
    pub failed: &'a crate::model::Event,
    pub at_ns: i64,
    pub judged: Option<&'a Judged<'f>>,
    pub message: Option<&'a str>,
    /// NVML, asked at the failure.
    pub nvml: Option<&'a crate::model::GpuSample>,
    /// The last cudaMemGetInfo of the device (or PyTorch's, right after the failure).
    pub reading: Option<&'a crate::model::Event>,
    pub others: u64,
    pub outside: u64,
    pub untraced: Option<u64>,
    pub unattributed: Option<u64>,
}

/// The arithmetic of the failure.
pub fn of_failure(f: &Failure<'_, '_>) -> Arithmetic {
    let forensics = f.judged.map(|j| j.failure);
    // A reading right after the failure is the device after the flush; one before it, an
    // estimate kept current with the process's own calls since.
    let after_free = f
        .reading
        .filter(|r| r.ts_ns >= f.at_ns)
        .map(|r| r.aux0.min(r.aux1));
    let before = f.reading.filter(|r| r.ts_ns < f.at_ns);
    let estimate = forensics
        .and_then(|x| {
            x.device_free
                .map(|free| (free, x.device_free_reported_ns.map_or(0, |t| f.at_ns - t)))
        })
        .filter(|&(_, age)| age >= 0)
        .or(before.map(|r| (r.aux0.min(r.aux1), f.at_ns - r.ts_ns)));
    let page = forensics.map_or(f.failed.op == Op::CuMemCreate, |x| !x.whole_segment);
    oom::arithmetic(&oom::Inputs {
        request: f.message.and_then(oom::pytorch_tried),
        refused: Some(f.failed.size).filter(|&s| s > 0),
        page,
        given_back: forensics.map_or(0, |x| x.pages_unmapped),
        after_free,
        // An imported snapshot's message carries its oom entry's bytes; PyTorch's own, two
        // decimals of them.
        message_free: f
            .message
            .filter(|m| oom::snapshot_free_said(m).is_none())
            .and_then(oom::free_said),
        snapshot_free: f.message.and_then(oom::snapshot_free_said),
        nvml_free: f.nvml.map(|s| s.total.saturating_sub(s.used)),
        estimate,
        split: f.judged.and_then(|j| j.split),
        private: forensics
            .map(|x| x.private_free)
            .filter(|&p| p > 0)
            .or_else(|| f.message.and_then(oom::pytorch_private)),
        private_idle: forensics
            .map(|x| x.private_idle)
            .filter(|_| forensics.is_some_and(|x| x.private_free > 0)),
        capture_idle: forensics
            .filter(|x| x.capture_underway)
            .map(|x| x.default_idle),
        others: f.others,
        outside: f.outside,
        untraced: f.untraced,
        unattributed: f.unattributed,
        allowed: f.message.and_then(oom::allowed_said),
    })
}

/// Who held the memory the request needed, by the arithmetic's verdict; `otherwise` where it
/// decides nothing.
pub fn held_by(a: &Arithmetic, otherwise: impl FnOnce() -> HeldBy) -> HeldBy {
    match a.cause {
        Cause::Fragmentation => HeldBy::Fragmentation,
        Cause::OtherProcesses => HeldBy::OtherProcesses,
        Cause::Both { .. } => HeldBy::FragmentationAndOtherProcesses,
        Cause::PrivatePools { .. } => HeldBy::PrivatePools,
        Cause::CaptureUnderway { .. } => HeldBy::CacheDuringCapture,
        Cause::FractionLimit { .. } => HeldBy::MemoryFraction,
        Cause::Capacity => match otherwise() {
            HeldBy::BeyondDevice => HeldBy::BeyondDevice,
            _ => HeldBy::ThisProcess,
        },
        Cause::Unknown { .. } => otherwise(),
    }
}

/// The arithmetic and its verdict in the chain's effect, and the fixes that follow from it.
pub fn say(chain: &mut Chain, h: &Holders, judged: Option<&Judged<'_>>) {
    let a = &h.arithmetic;
    if !chain.effect.is_empty() {
        chain.effect.push_str("; ");
    }
    chain.effect.push_str(&a.figures());
    let decided = !matches!(a.cause, Cause::Unknown { .. });
    match (decided, judged) {
        (true, _) => {
            chain.effect.push_str(": ");
            chain.effect.push_str(&a.verdict_on(&h.gpu));
        }
        // What the cache alone said stands where it said fragmentation or what it does not
        // know; where it said capacity, what the device's figures leave open is said instead.
        (false, Some(j)) if j.fragmentation != Some(false) => chain.effect.push_str(&j.clause),
        (false, _) => {
            chain.effect.push_str(": ");
            chain.effect.push_str(&a.verdict_on(&h.gpu));
        }
    }
    if h.verdict == HeldBy::Unknown && h.others.is_empty() && h.unattributed.is_some() {
        chain.effect.push_str(&format!(
            ": {} of {} was held outside this process and no traced process held it: who held it is not known (nvidia-smi, or a trace running before the other jobs start, would settle it)",
            pb(h.unattributed.unwrap_or(0)),
            h.gpu
        ));
    }
    if let Some(fixes) = fixes(h, judged) {
        chain.fix = fixes;
    }
    if h.others.is_empty() {
        chain
            .fix
            .retain(|f| !f.text.starts_with("leave the device to this job"));
    }
}

/// The fixes for the verdict; none where the chain's own stand.
fn fixes(h: &Holders, judged: Option<&Judged<'_>>) -> Option<Vec<Fix>> {
    let run_alone = || -> Fix {
        format!(
            "run this job where it has {} to itself, or bound the other processes there ({} held)",
            h.gpu,
            pb(h.arithmetic.others)
        )
        .into()
    };
    Some(match h.verdict {
        HeldBy::Fragmentation => vec![FIX_EXPANDABLE, FIX_MAX_SPLIT],
        HeldBy::OtherProcesses => vec![run_alone()],
        HeldBy::FragmentationAndOtherProcesses => vec![run_alone(), FIX_EXPANDABLE, FIX_MAX_SPLIT],
        HeldBy::ThisProcess | HeldBy::BeyondDevice => measured::fixes_for_capacity(),
        HeldBy::MemoryFraction => vec![FIX_FRACTION],
        HeldBy::PrivatePools => {
            measured::fixes_for_private_pools(&h.arithmetic, judged.map(|j| j.failure))
        }
        HeldBy::CacheDuringCapture => measured::fixes_for_capture(&h.arithmetic),
        HeldBy::Unknown => return judged.map(|j| j.fixes.clone()),
    })
}

/// An out-of-memory PyTorch raised with no failed device call before it: the allocator refused
/// without asking the device (a per-process memory fraction's limit, a pool's own allocator),
/// or the call was not traced. Its chain from the message alone.
pub fn from_message(pid: u32, m: &crate::model::MessageRow) -> Chain {
    let text = m.text.as_str();
    let a = oom::arithmetic(&oom::Inputs {
        request: oom::pytorch_tried(text),
        message_free: oom::free_said(text),
        split: oom::pytorch_cached(text),
        private: oom::pytorch_private(text),
        allowed: oom::allowed_said(text),
        ..oom::Inputs::default()
    });
    let fraction = matches!(a.cause, Cause::FractionLimit { .. });
    let tried = a.request.map_or("an unknown size".into(), pb);
    Chain {
        rule: Rule::Oom,
        severity: Severity::High,
        pid,
        title: if fraction {
            format!("out of memory: PyTorch refused {tried} without asking the device (its memory fraction)")
        } else {
            format!("out of memory: PyTorch raised for {tried}, with no failed device call traced")
        },
        root: format!(
            "PyTorch raised out of memory for {tried}; no cudaMalloc or page of it failed in the trace{}",
            if fraction {
                ": the allocator checks the process's memory fraction before it asks the device"
            } else {
                " (the device call was not traced, or a pool's own allocator refused)"
            }
        ),
        effect: format!("{}{}: {}", a.figures(), reserved_said(text, &a), a.verdict()),
        compounding: Vec::new(),
        timeline: vec![entry(m.ts_ns, format!("PyTorch raises out of memory ({tried})"))],
        fix: if fraction {
            vec![FIX_FRACTION]
        } else {
            vec!["reduce peak memory: a smaller batch or sequence length, activation checkpointing, mixed precision".into()]
        },
        evidence: format!("PyTorch's out-of-memory message and no failed device call: {text}"),
    }
}

/// The fraction's sum as PyTorch checks it: what the allocator reserved (allocated and cached,
/// by its message) and the request, against what the fraction allows.
fn reserved_said(text: &str, a: &Arithmetic) -> String {
    let allocated = text
        .split_once("Of the allocated memory ")
        .and_then(|(_, rest)| oom::pytorch_size(rest.split(" is allocated by PyTorch").next()?));
    match (a.cause.clone(), allocated, oom::pytorch_cached(text), a.request) {
        (Cause::FractionLimit { allowed }, Some(allocated), Some(cached), Some(request)) => format!(
            "; reserved {} (allocated {}, cached {}) and the {} asked make {}, more than the {} allowed",
            pb(allocated + cached),
            pb(allocated),
            pb(cached),
            pb(request),
            pb(allocated + cached + request),
            pb(allowed)
        ),
        _ => String::new(),
    }
}
