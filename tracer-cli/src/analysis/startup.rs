//! A serving engine's start-up in figures: what each phase took of the device, from the calls
//! alone (not from any engine's names). An engine loads its weights, may run a profiling pass
//! and empty the cache (vLLM), takes its KV cache, then captures a CUDA graph per batch size
//! (vLLM, SGLang, TensorRT-LLM's PyTorch flow). The phases are told apart by what the calls
//! show: the cache flush before the first capture that the most kept memory followed (the end
//! of a profiling pass: torch.cuda.graph flushes right before each capture too, and nothing is
//! made between that flush and its capture), the
//! first capture, and the last capture seen. Bytes are the allocator's reserved bytes (its
//! segments: seen with or without PyTorch's block probes).

use serde::Serialize;
use tracer_common::{OpClass, Space};

use crate::model::{layout::Layout, pressure::Pressure, Event};

/// The engine's own budget, where its command line says it.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Budget {
    /// The option as given ("--gpu-memory-utilization").
    pub option: String,
    /// A share of the device (gpu_memory_utilization, mem_fraction_static), or bytes
    /// (kv_cache_memory).
    pub fraction: Option<f64>,
    pub bytes: Option<u64>,
}

/// Options engines take their memory budget from: (option, a fraction of the device).
const BUDGET_OPTIONS: [(&str, bool); 4] = [
    ("--gpu-memory-utilization", true),
    ("--mem-fraction-static", true),
    ("--kv-cache-memory-bytes", false),
    ("--kv-cache-memory", false),
];

impl Budget {
    /// From a process's command line (arguments joined by spaces): `--option VALUE` or
    /// `--option=VALUE`, with `_` or `-` between words.
    pub fn from_cmdline(cmdline: &str) -> Option<Budget> {
        let args: Vec<&str> = cmdline.split_whitespace().collect();
        for (i, arg) in args.iter().enumerate() {
            let arg = arg.replace('_', "-");
            for (option, fraction) in BUDGET_OPTIONS {
                let value = match arg.strip_prefix(option) {
                    Some("") => args.get(i + 1).copied(),
                    Some(rest) => rest.strip_prefix('='),
                    None => None,
                };
                let Some(value) = value else { continue };
                let budget = if fraction {
                    let f: f64 = value.parse().ok()?;
                    (f > 0.0 && f <= 1.0).then_some(Budget {
                        option: option.to_owned(),
                        fraction: Some(f),
                        bytes: None,
                    })?
                } else {
                    Budget {
                        option: option.to_owned(),
                        fraction: None,
                        bytes: Some(value.parse().ok()?),
                    }
                };
                return Some(budget);
            }
        }
        None
    }
}

/// One capture: its pool and what the device gave for it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct CaptureStep {
    pub begin_ns: i64,
    pub end_ns: Option<i64>,
    /// The private pools' reserved bytes after it, less before it.
    pub pool_grew: u64,
    /// The default pools' reserved bytes after it, less before it (warm-up runs between
    /// captures add to those).
    pub default_grew: i64,
}

/// The start-up as measured.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Ledger {
    pub device: i32,
    /// Reserved after the cache flush before the first capture that the most kept memory
    /// followed: the weights and what stays (None: no such flush before the captures).
    pub resident: Option<u64>,
    /// The most reserved before that flush: resident plus the profiling pass's peak.
    pub peak_before_flush: Option<u64>,
    /// Reserved when the first capture began.
    pub before_captures: u64,
    /// Allocated (in live blocks) after the flush and when the first capture began, where
    /// PyTorch's block probes were seen: the KV cache is their difference; reserved beyond
    /// allocated then is cache (warm-up runs' freed blocks).
    pub resident_allocated: Option<u64>,
    pub allocated_before_captures: Option<u64>,
    pub captures: Vec<CaptureStep>,
    /// The private pools' reserved bytes after the last capture.
    pub pools: u64,
    /// Reserved after the last capture (or at the failure).
    pub after: u64,
    /// This process's device memory outside the allocator then.
    pub outside: u64,
    /// The device's capacity and free bytes at the end, where cudaMemGetInfo said.
    pub device_total: Option<u64>,
    pub device_free: Option<u64>,
    /// An allocation failed during the captures: the bytes it asked for.
    pub failed_in_capture: Option<u64>,
    pub budget: Option<Budget>,
}

/// A process's start-up ledger, in explain's answer.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Startup {
    pub pid: u32,
    #[serde(flatten)]
    pub ledger: Ledger,
}

/// Flushes before the first capture kept to choose the profiling pass's from.
const FLUSHES_KEPT: usize = 64;

/// Follows one process's calls (with its layout after each) into a [`Ledger`].
#[derive(Clone, Debug, Default)]
pub struct StartupWatch {
    peak: u64,
    /// The flushes before the first capture, the latest last (at most [`FLUSHES_KEPT`]): (the
    /// most reserved before it, reserved and allocated after it).
    flushes: Vec<(u64, u64, u64)>,
    /// The last call was a segment given back in a flush: the next one belongs to it too.
    in_flush: bool,
    failed_since_block: bool,
    ledger: Option<Ledger>,
    /// The private pools' and default pools' reserved bytes when the open capture began.
    open: Option<(u64, u64)>,
    capturing: bool,
}

impl StartupWatch {
    /// After `layout` applied `e` (`pressure`: the device's free bytes kept current).
    pub fn feed(&mut self, e: &Event, layout: &Layout, pressure: &Pressure) {
        let class = e.class();
        let device = e.device;
        if device < 0 {
            return;
        }
        if self.ledger.is_none() {
            self.before_captures(e, layout);
        }
        if matches!(class, OpClass::PoolCapture | OpClass::CaptureBegin) && !self.capturing {
            self.begin(e, layout);
        } else if matches!(class, OpClass::CaptureEnd | OpClass::PoolCaptured) && self.capturing {
            self.end(e, layout);
            self.read_device(pressure);
        } else if self.capturing
            && e.ret != 0
            && class == OpClass::Alloc
            && matches!(e.space(), Space::Device | Space::Handle)
        {
            if let Some(l) = self
                .ledger
                .as_mut()
                .filter(|l| l.failed_in_capture.is_none())
            {
                l.failed_in_capture = Some(e.size);
                // What the capture took until it failed.
                self.measure_open(layout, None);
                self.read_device(pressure);
            }
        }
    }

    /// The device's free bytes and capacity now, as cudaMemGetInfo said last (kept current).
    fn read_device(&mut self, pressure: &Pressure) {
        let Some(l) = self.ledger.as_mut() else {
            return;
        };
        l.device_free = pressure.device_free(l.device).map(|d| d.free.max(0) as u64);
        l.device_total = pressure.device_total(l.device);
    }

    fn before_captures(&mut self, e: &Event, layout: &Layout) {
        let class = e.class();
        let total = layout.device_total(e.device);
        let reserved = total.reserved;
        if matches!(class, OpClass::Alloc | OpClass::BlockAlloc) {
            self.in_flush = false;
        }
        match class {
            OpClass::BlockAlloc => self.failed_since_block = false,
            OpClass::Alloc if e.ret != 0 => self.failed_since_block = true,
            // A segment given back not on a retry: the cache flushed (empty_cache()); its
            // figures are those after the whole burst of frees.
            OpClass::Free
                if e.ret == 0
                    && !self.failed_since_block
                    && matches!(e.space(), Space::Device | Space::Mapping) =>
            {
                let flush = (self.peak, reserved, total.allocated);
                match self.flushes.last_mut() {
                    Some(last) if self.in_flush => *last = (last.0, reserved, total.allocated),
                    _ => {
                        if self.flushes.len() == FLUSHES_KEPT {
                            self.flushes.remove(0);
                        }
                        self.flushes.push(flush);
                    }
                }
                self.in_flush = true;
            }
            _ => {}
        }
        self.peak = self.peak.max(reserved);
    }

    /// The flush the most kept memory followed up to now (`allocated`, `reserved`: now), where
    /// any did: the end of a profiling pass, before the KV cache.
    fn profiling_flush(&self, allocated: Option<u64>, reserved: u64) -> Option<(u64, u64, u64)> {
        let grew = |f: &(u64, u64, u64)| match allocated {
            Some(now) => now.saturating_sub(f.2),
            None => reserved.saturating_sub(f.1),
        };
        let best = self.flushes.iter().max_by_key(|f| grew(f))?;
        (grew(best) > 0).then_some(*best)
    }

    fn private_reserved(layout: &Layout, device: i32) -> u64 {
        layout
            .private_pools()
            .iter()
            .filter(|p| p.device == device)
            .map(|p| p.reserved)
            .sum()
    }

    fn begin(&mut self, e: &Event, layout: &Layout) {
        let total = layout.device_total(e.device);
        let reserved = total.reserved;
        let blocks = layout.blocks_seen > 0;
        let flush = self.profiling_flush(blocks.then_some(total.allocated), reserved);
        let ledger = self.ledger.get_or_insert_with(|| Ledger {
            device: e.device,
            resident: flush.map(|(_, r, _)| r),
            peak_before_flush: flush.map(|(p, _, _)| p),
            before_captures: reserved,
            resident_allocated: flush.map(|(_, _, a)| a).filter(|_| blocks),
            allocated_before_captures: blocks.then_some(total.allocated),
            ..Ledger::default()
        });
        if ledger.device != e.device {
            return;
        }
        let private = Self::private_reserved(layout, e.device);
        self.open = Some((private, reserved - private.min(reserved)));
        self.capturing = true;
        ledger.captures.push(CaptureStep {
            begin_ns: e.ts_ns,
            ..CaptureStep::default()
        });
    }

    fn end(&mut self, e: &Event, layout: &Layout) {
        self.capturing = false;
        self.measure_open(layout, Some(e.ts_ns));
        self.open = None;
    }

    /// What the open capture took so far (`ended`: when it ended).
    fn measure_open(&mut self, layout: &Layout, ended: Option<i64>) {
        let (Some(ledger), Some((private0, default0))) = (self.ledger.as_mut(), self.open) else {
            return;
        };
        let reserved = layout.device_total(ledger.device).reserved;
        let private = Self::private_reserved(layout, ledger.device);
        if let Some(step) = ledger.captures.last_mut() {
            step.end_ns = ended;
            step.pool_grew = private.saturating_sub(private0);
            step.default_grew = (reserved - private.min(reserved)) as i64 - default0 as i64;
        }
        ledger.pools = private;
        ledger.after = reserved;
        ledger.outside = layout.outside(ledger.device);
    }

    /// The ledger, where the process captured.
    pub fn finish(self, budget: Option<Budget>) -> Option<Ledger> {
        let mut l = self.ledger?;
        if l.after == 0 {
            l.after = l.before_captures;
        }
        l.budget = budget;
        Some(l)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// vLLM's order through torch.cuda.graph: the profiling pass's flush, the KV cache, then
    /// the flush torch.cuda.graph makes right before the capture. The profiling flush is the one
    /// the KV cache followed; a flush nothing kept followed says nothing.
    #[test]
    fn the_profiling_flush_is_the_one_the_kept_memory_followed() {
        let gib = 1u64 << 30;
        let watch = StartupWatch {
            // (peak before, reserved after, allocated after): the profiling flush leaves the
            // 2 GiB of weights; the graph context's flush leaves weights and a 10 GiB KV cache.
            flushes: vec![(3 * gib, 2 * gib, 2 * gib), (13 * gib, 12 * gib, 12 * gib)],
            ..StartupWatch::default()
        };
        assert_eq!(
            watch.profiling_flush(Some(12 * gib), 12 * gib),
            Some((3 * gib, 2 * gib, 2 * gib))
        );
        // Segments only (no block probes): by reserved bytes.
        assert_eq!(
            watch.profiling_flush(None, 12 * gib),
            Some((3 * gib, 2 * gib, 2 * gib))
        );
        // SGLang's order: only the graph context's flush, nothing kept after it.
        let sglang = StartupWatch {
            flushes: vec![(13 * gib, 12 * gib, 12 * gib)],
            ..StartupWatch::default()
        };
        assert_eq!(sglang.profiling_flush(Some(12 * gib), 12 * gib), None);
    }

    #[test]
    fn budgets_are_read_from_the_engines_options() {
        let b = Budget::from_cmdline(
            "python3 -m vllm.entrypoints.openai.api_server --model m --gpu-memory-utilization 0.85",
        )
        .unwrap();
        assert_eq!(
            (b.option.as_str(), b.fraction),
            ("--gpu-memory-utilization", Some(0.85))
        );
        let b = Budget::from_cmdline("python -m sglang.launch_server --mem_fraction_static=0.7")
            .unwrap();
        assert_eq!(
            (b.option.as_str(), b.fraction),
            ("--mem-fraction-static", Some(0.7))
        );
        let b = Budget::from_cmdline("vllm serve m --kv-cache-memory-bytes 8589934592").unwrap();
        assert_eq!(b.bytes, Some(8 << 30));
        assert_eq!(Budget::from_cmdline("python train.py --lr 0.1"), None);
        assert_eq!(Budget::from_cmdline("x --gpu-memory-utilization 7"), None);
    }
}
