//! Discovery in the kernel (tracer-ebpf/src/libwatch.rs): the two `openat` tracepoint programs
//! attached, the ring of library opens read, the paths already probed told to the kernel, and
//! the holding window kept renewed while tracer is there to continue what it stops.

use std::os::fd::{AsFd as _, AsRawFd as _, RawFd};

use anyhow::{anyhow, Context as _, Result};
use aya::{
    maps::{Array, HashMap, MapData, PerCpuArray, RingBuf},
    programs::TracePoint,
    Ebpf,
};
use tracer_common::{
    libwatch::{LibOpen, PATH_LEN},
    maps as names,
};

/// How long the kernel may stop processes after the last renewal: a tracer that stops
/// answering (killed, wedged) stops nobody new after this. Longer than a slow attach (seconds
/// while other tracers' probes are being removed), during which the main thread renews nothing.
const HOLD_WINDOW_NS: u64 = 20_000_000_000;

/// The openat tracepoints' field offsets (tracefs), the defaults of x86-64 when unreadable.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OpenatOffsets {
    pub filename: u32,
    pub flags: u32,
    pub ret: u32,
}

impl Default for OpenatOffsets {
    fn default() -> Self {
        OpenatOffsets {
            filename: 24,
            flags: 32,
            ret: 16,
        }
    }
}

/// The offsets from the tracepoints' format files.
pub fn openat_offsets(tracefs: &str) -> Result<OpenatOffsets> {
    let read = |event: &str| {
        std::fs::read_to_string(format!("{tracefs}/events/syscalls/{event}/format"))
            .with_context(|| format!("read the syscalls:{event} format"))
    };
    let (enter, exit) = (read("sys_enter_openat")?, read("sys_exit_openat")?);
    let get = |format: &str, field: &str| {
        super::tracefs::field_offset(format, field)
            .ok_or_else(|| anyhow!("no field {field} in the openat tracepoints' format"))
    };
    Ok(OpenatOffsets {
        filename: get(&enter, "filename")?,
        flags: get(&enter, "flags")?,
        ret: get(&exit, "ret")?,
    })
}

/// The ring of library opens, read on a thread of its own (record/discovery.rs).
pub struct OpensRing {
    ring: RingBuf<MapData>,
}

impl OpensRing {
    /// The opens the kernel sent since the last call.
    pub fn drain(&mut self) -> Vec<LibOpen> {
        let mut out = Vec::new();
        while let Some(item) = self.ring.next() {
            if item.len() >= LibOpen::LEN {
                // SAFETY: the record is at least a LibOpen's size, read unaligned; LibOpen is
                // plain integers and bytes, valid for any bit pattern.
                out.push(unsafe { std::ptr::read_unaligned(item.as_ptr().cast::<LibOpen>()) });
            }
        }
        out
    }

    /// The ring's descriptor, readable when an open waits.
    pub fn fd(&self) -> RawFd {
        self.ring.as_fd().as_raw_fd()
    }
}

/// The programs' maps: the paths probed, the holding window, the opens lost.
pub struct LibWatch {
    ring: Option<RingBuf<MapData>>,
    known: HashMap<MapData, [u8; PATH_LEN], u32>,
    state: Array<MapData, u64>,
    lost: PerCpuArray<MapData, u64>,
    hold: bool,
}

impl LibWatch {
    /// Loads and attaches the programs, and takes their maps out of the object.
    pub fn start(ebpf: &mut Ebpf, hold: bool) -> Result<LibWatch> {
        for (name, event) in [
            (names::PROG_LIB_OPEN_ENTER, "sys_enter_openat"),
            (names::PROG_LIB_OPEN_EXIT, "sys_exit_openat"),
        ] {
            let program: &mut TracePoint = ebpf
                .program_mut(name)
                .ok_or_else(|| anyhow!("eBPF object lacks program {name}"))?
                .try_into()
                .with_context(|| format!("{name} is not a tracepoint program"))?;
            program
                .load()
                .with_context(|| format!("verify and load program {name}"))?;
            program
                .attach("syscalls", event)
                .with_context(|| format!("attach tracepoint syscalls:{event}"))?;
        }
        let take = |ebpf: &mut Ebpf, name: &str| {
            ebpf.take_map(name)
                .ok_or_else(|| anyhow!("eBPF object lacks map {name}"))
        };
        let ring = RingBuf::try_from(take(ebpf, names::LIB_OPENS)?)
            .context("open the library opens' ring")?;
        let known = HashMap::try_from(take(ebpf, names::LIB_KNOWN)?)
            .context("open the probed paths' map")?;
        let state = Array::try_from(take(ebpf, names::LIB_STATE)?)
            .context("open the library watch's state")?;
        let lost = PerCpuArray::try_from(take(ebpf, names::LIB_LOST)?)
            .context("open the library watch's counters")?;
        Ok(LibWatch {
            ring: Some(ring),
            known,
            state,
            lost,
            hold,
        })
    }

    /// The ring, for the thread that reads it (once).
    pub fn take_ring(&mut self) -> Option<OpensRing> {
        self.ring.take().map(|ring| OpensRing { ring })
    }

    /// Lets the kernel stop processes for the next [`HOLD_WINDOW_NS`] (when holding is on).
    pub fn renew(&mut self, now_mono_ns: u64) -> Result<()> {
        if self.hold {
            self.set_until(now_mono_ns + HOLD_WINDOW_NS)?;
        }
        Ok(())
    }

    /// No process is stopped from now on.
    pub fn stop_holding(&mut self) -> Result<()> {
        self.hold = false;
        self.set_until(0)
    }

    fn set_until(&mut self, until: u64) -> Result<()> {
        self.state
            .set(names::LIB_HOLD_UNTIL, until, 0)
            .with_context(|| format!("set {}'s holding window", names::LIB_STATE))
    }

    /// A path whose file is probed: the processes that open it later go on unstopped.
    pub fn know(&mut self, path: &[u8; PATH_LEN]) -> Result<()> {
        self.known
            .insert(path, 1, 0)
            .with_context(|| format!("add a path to {}", names::LIB_KNOWN))
    }

    /// Opens the kernel could not send (its ring or its pending map full).
    pub fn lost(&self) -> u64 {
        [names::LIB_LOST_RING, names::LIB_LOST_PENDING]
            .iter()
            .filter_map(|&slot| self.lost.get(&slot, 0).ok())
            .map(|per_cpu| per_cpu.iter().sum::<u64>())
            .sum()
    }
}

// The kernel program's name matching, shared with tracer-common (which has no tests of its own).
#[cfg(test)]
mod tests {
    use tracer_common::libwatch::*;

    fn watched(s: &str) -> bool {
        let mut p = [0u8; PATH_LEN];
        let n = s.len().min(PATH_LEN);
        p[..n].copy_from_slice(&s.as_bytes()[..n]);
        is_watched(&p, n)
    }

    #[test]
    fn watched_names_are_matched_by_their_last_component() {
        assert!(watched(
            "/home/u/.venv/lib/nvidia/cuda_runtime/lib/libcudart.so.12"
        ));
        assert!(watched("libcuda.so.1"));
        assert!(watched("/x/torch/lib/libc10_cuda.so"));
        assert!(watched("/x/libcudart-abc123.so.11.0"));
        assert!(!watched("/x/libcudart/libfoo.so"));
        assert!(!watched("/x/libcudnn.so.9"));
        assert!(!watched("/usr/lib/libc.so.6"));
        assert!(!watched("/x/libcudar"));
        assert!(!watched(""));
        // A path longer than the bytes kept is judged by what was kept.
        let long = format!("/{}/libcudart.so.12", "d".repeat(300));
        assert!(!watched(&long));
    }

    #[test]
    fn shells_are_matched_whole() {
        let comm = |s: &str| {
            let mut c = [0u8; 16];
            c[..s.len()].copy_from_slice(s.as_bytes());
            c
        };
        assert!(is_no_hold_parent(&comm("bash")));
        assert!(is_no_hold_parent(&comm("sh")));
        assert!(!is_no_hold_parent(&comm("bash2")));
        assert!(!is_no_hold_parent(&comm("python3")));
        assert!(!is_no_hold_parent(&comm("shx")));
        assert!(!is_no_hold_parent(&comm("torchrun")));
        assert!(is_tracer_comm(&comm("tracer")));
        assert!(is_tracer_comm(&comm("tracer-mappings")));
        assert!(!is_tracer_comm(&comm("trace")));
        assert!(!is_tracer_comm(&comm("python3")));
    }
}
