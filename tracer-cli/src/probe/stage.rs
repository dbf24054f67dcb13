//! The per-CPU stages where the return program keeps call events until it has 32 of them to
//! write to the ring at once. Userspace empties them every round, each on its own CPU, so that
//! an idle CPU does not hold events back, and learns from it up to when the ring holds every
//! call that returned: the reader puts the records back in that order before the registry
//! joins them.

use std::os::fd::{AsFd as _, AsRawFd as _};

use anyhow::{anyhow, bail, Context as _, Result};
use aya::{
    maps::{MapData, PerCpuArray},
    programs::ProgramFd,
};
use tracer_common::maps::{FlushResult, Stage, STAGE_EVENTS};

/// BPF_PROG_TEST_RUN's command number and its flag to run the program on a given CPU
/// (uapi/linux/bpf.h; raw tracepoint programs only, kernel 5.10 and later).
const BPF_PROG_TEST_RUN: libc::c_long = 10;
const BPF_F_TEST_RUN_ON_CPU: u32 = 1;

/// The `test` member of `union bpf_attr`, up to `batch_size`.
#[repr(C)]
#[derive(Default)]
struct TestRunAttr {
    prog_fd: u32,
    retval: u32,
    data_size_in: u32,
    data_size_out: u32,
    data_in: u64,
    data_out: u64,
    repeat: u32,
    duration: u32,
    ctx_size_in: u32,
    ctx_size_out: u32,
    ctx_in: u64,
    ctx_out: u64,
    flags: u32,
    cpu: u32,
    batch_size: u32,
    _pad: u32,
}

/// What a round of flushes found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Round {
    /// Every stage was emptied into the ring: every call that returned before the round began
    /// is in the ring now.
    Complete,
    /// A stage was being written on its CPU and was left alone: the round proves nothing.
    Incomplete,
}

pub struct Stages {
    flush: ProgramFd,
    cpus: Vec<u32>,
    map: PerCpuArray<MapData, Stage>,
}

impl Stages {
    pub fn new(flush: ProgramFd, map: PerCpuArray<MapData, Stage>) -> Result<Stages> {
        let cpus = aya::util::online_cpus()
            .map_err(|(what, e)| anyhow!("read the online CPUs ({what}): {e}"))?;
        Ok(Stages { flush, cpus, map })
    }

    /// Empties every CPU's stage into the ring, each by the flush program run on that CPU.
    pub fn flush(&mut self) -> Result<Round> {
        // Read again each round: a CPU brought online since must be emptied too.
        if let Ok(cpus) = aya::util::online_cpus() {
            self.cpus = cpus;
        }
        let mut round = Round::Complete;
        for &cpu in &self.cpus {
            match self.flush_on(cpu)? {
                r if r == FlushResult::Busy as u32 => round = Round::Incomplete,
                // A full ring lost the stage's events; the kernel counted them.
                _ => {}
            }
        }
        Ok(round)
    }

    fn flush_on(&self, cpu: u32) -> Result<u32> {
        let mut attr = TestRunAttr {
            prog_fd: self.flush.as_fd().as_raw_fd() as u32,
            flags: BPF_F_TEST_RUN_ON_CPU,
            cpu,
            ..TestRunAttr::default()
        };
        // SAFETY: attr is a valid, fully initialised bpf_attr prefix of the size passed; the
        // kernel reads it and writes only `retval` (no data or context buffers are given).
        let rc = unsafe {
            libc::syscall(
                libc::SYS_bpf,
                BPF_PROG_TEST_RUN,
                &mut attr as *mut TestRunAttr,
                std::mem::size_of::<TestRunAttr>(),
            )
        };
        if rc < 0 {
            let err = std::io::Error::last_os_error();
            // A CPU taken offline since the start has nothing staged that the final read
            // (`take_left`) would not find.
            if err.raw_os_error() == Some(libc::ENXIO) {
                return Ok(FlushResult::Sent as u32);
            }
            bail!("run the stage flush program on CPU {cpu}: {err}");
        }
        Ok(attr.retval)
    }

    /// At the end, once no program runs: the events some stage still holds (a CPU gone
    /// offline, a flush that kept finding its stage busy), as the raw records the ring would
    /// have carried, emptied from the map.
    pub fn take_left(&mut self) -> Result<Vec<Vec<u8>>> {
        let values = self.map.get(&0, 0).context("read the per-CPU stages")?;
        let mut left = Vec::new();
        for stage in values.iter() {
            let len = (stage.len as usize).min(STAGE_EVENTS);
            left.extend(
                stage.events[..len]
                    .iter()
                    .map(|e| crate::decode::pod_bytes(e).to_vec()),
            );
        }
        if !left.is_empty() {
            let empty = aya::maps::PerCpuValues::try_from(vec![empty_stage(); values.len()])
                .context("build empty stages")?;
            self.map
                .set(0, empty, 0)
                .context("empty the per-CPU stages")?;
        }
        Ok(left)
    }
}

fn empty_stage() -> Stage {
    Stage {
        len: 0,
        busy: 0,
        events: [tracer_common::CallEvent::default(); STAGE_EVENTS],
    }
}
