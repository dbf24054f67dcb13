//! The per-CPU stages where the return program keeps call events until it has 32 of them to
//! write to the ring at once. Userspace empties each round those holding events old enough to
//! hand over, each on its own CPU, so that an idle CPU does not hold events back, and learns from it up to when the ring holds every
//! call that returned: the reader puts the records back in that order before the registry
//! joins them.

use std::os::fd::{AsFd as _, AsRawFd as _};

use anyhow::{anyhow, bail, Context as _, Result};
use aya::{
    maps::{MapData, PerCpuArray},
    programs::ProgramFd,
};
use std::time::{Duration, Instant};

use tracer_common::maps::{
    FlushResult, Stage, STAGE_CLAIMED, STAGE_EVENTS, STAGE_OLDEST, STAGE_OLDEST_CPUS,
};

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

impl Round {
    /// The round so far, after a flush that returned `flushed` ([`FlushResult`]; a full ring
    /// lost the stage's events, and the kernel counted them).
    fn and(self, flushed: u32) -> Round {
        if flushed == FlushResult::Busy as u32 {
            Round::Incomplete
        } else {
            self
        }
    }
}

pub struct Stages {
    flush: ProgramFd,
    cpus: Vec<u32>,
    cpus_read: Instant,
    map: PerCpuArray<MapData, Stage>,
    oldest: Oldest,
    visits: Visits,
}

/// How often the online CPUs are read again (a CPU brought online must be emptied too).
const CPUS_EVERY: Duration = Duration::from_secs(1);

impl Stages {
    pub fn new(
        flush: ProgramFd,
        map: PerCpuArray<MapData, Stage>,
        oldest: MapData,
    ) -> Result<Stages> {
        let cpus = aya::util::online_cpus()
            .map_err(|(what, e)| anyhow!("read the online CPUs ({what}): {e}"))?;
        Ok(Stages {
            flush,
            cpus,
            cpus_read: Instant::now(),
            map,
            oldest: Oldest::map(oldest)?,
            visits: Visits::new(),
        })
    }

    /// Empties into the ring every CPU's stage that holds an event sent by `until_ns` (or is
    /// being written), each by the flush program run on that CPU; the others are left alone, so
    /// an idle machine is not interrupted. Complete: every event sent by `until_ns` is in the
    /// ring.
    pub fn flush(&mut self, until_ns: u64) -> Result<Round> {
        if self.cpus_read.elapsed() >= CPUS_EVERY {
            if let Ok(cpus) = aya::util::online_cpus() {
                self.cpus = cpus;
            }
            self.cpus_read = Instant::now();
        }
        let due: Vec<u32> = self
            .cpus
            .iter()
            .copied()
            .filter(|&cpu| needs_flush(self.oldest.get(cpu), until_ns))
            .collect();
        let mut round = Round::Complete;
        // Each other CPU from itself, then back to this one, emptied last: the reader's own work
        // stays on the CPU the scheduler gave it (left on the job's, it slowed the step).
        let here = self.visits.here();
        let (local, remote): (Vec<u32>, Vec<u32>) = due.into_iter().partition(|&c| Some(c) == here);
        for &cpu in &remote {
            self.visits.go_to(cpu);
            round = round.and(self.flush_on(cpu)?);
        }
        if let (Some(here), false) = (here, remote.is_empty()) {
            self.visits.go_to(here);
        }
        for cpu in local {
            round = round.and(self.flush_on(cpu)?);
        }
        self.visits.go_home();
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

/// Whether a CPU whose stage says `oldest` ([`STAGE_OLDEST`]; None: a CPU past its room) must
/// be flushed for every event sent by `until_ns` to be in the ring. An empty stage must not; a
/// stage being written must (the flush then finds it busy, and the round proves nothing); a
/// stage whose oldest event is later than `until_ns` need not: events are staged in the order
/// they were sent.
fn needs_flush(oldest: Option<u64>, until_ns: u64) -> bool {
    match oldest {
        None => true,
        Some(0) => false,
        Some(STAGE_CLAIMED) => true,
        Some(sent) => sent <= until_ns,
    }
}

/// The flush program run on another CPU interrupts it and waits for it (an inter-processor call:
/// 40-80 us of the reader's CPU a flush on this 2-vCPU VM, 8 % of tracer's threads' CPU on the
/// step bench). Run from that CPU, it runs at once: the reader moves to each other CPU it
/// flushes and then back to its own (its affinity set to one CPU at a time: a migration, no
/// waiting), and is allowed the CPUs it had again at the round's end. A CPU it may not move to
/// (a cpuset, say) is flushed from where it is, by the kernel's call.
struct Visits {
    /// The CPUs the flushing thread was allowed to run on (read on its first round), or None
    /// where they could not be read.
    home: Option<Option<libc::cpu_set_t>>,
    /// Whether the thread's affinity was changed this round.
    away: bool,
}

impl Visits {
    fn new() -> Visits {
        Visits {
            home: None,
            away: false,
        }
    }

    fn home(&mut self) -> Option<&libc::cpu_set_t> {
        self.home
            .get_or_insert_with(|| {
                // SAFETY: a zeroed cpu_set_t is an empty set; the kernel fills it for this
                // thread (0) and it is kept only on success.
                unsafe {
                    let mut set: libc::cpu_set_t = std::mem::zeroed();
                    let size = std::mem::size_of::<libc::cpu_set_t>();
                    (libc::sched_getaffinity(0, size, &mut set) == 0).then_some(set)
                }
            })
            .as_ref()
    }

    /// The CPU this thread runs on now (it may move at any time: a hint).
    fn here(&self) -> Option<u32> {
        // SAFETY: no arguments; returns -1 on failure.
        let cpu = unsafe { libc::sched_getcpu() };
        u32::try_from(cpu).ok()
    }

    /// Moves this thread to `cpu` if it may run there; else it stays (the flush then reaches
    /// the CPU by an interrupt).
    fn go_to(&mut self, cpu: u32) {
        let Some(home) = self.home() else {
            return;
        };
        let cpu = cpu as usize;
        // SAFETY: CPU_ISSET reads a bit of a set we own; the index is checked against its size.
        if cpu >= libc::CPU_SETSIZE as usize || !unsafe { libc::CPU_ISSET(cpu, home) } {
            return;
        }
        // SAFETY: a set we own holding one CPU, of its size, for this thread (0).
        let moved = unsafe {
            let mut one: libc::cpu_set_t = std::mem::zeroed();
            libc::CPU_SET(cpu, &mut one);
            libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &one) == 0
        };
        self.away |= moved;
    }

    /// Back to the CPUs this thread was allowed (staying where it is: that CPU is among them).
    fn go_home(&mut self) {
        if !self.away {
            return;
        }
        let Some(home) = self.home() else {
            return;
        };
        // SAFETY: the set read at the start, of its size, for this thread (0).
        unsafe { libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), home) };
        self.away = false;
    }
}

/// [`STAGE_OLDEST`], mapped read-only: read with no system call.
struct Oldest {
    base: *const u64,
    len: usize,
    /// Kept open with its mapping.
    _map: MapData,
}

// SAFETY: the mapping is read-only here and lives as long as the struct; reading it from
// another thread only reads the kernel-shared pages.
unsafe impl Send for Oldest {}

impl Oldest {
    fn map(map: MapData) -> Result<Oldest> {
        let bytes = STAGE_OLDEST_CPUS as usize * std::mem::size_of::<u64>();
        // SAFETY: a fresh shared read-only mapping of the map's values (an array created with
        // BPF_F_MMAPABLE), offset 0, of its size; checked for failure below.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                bytes,
                libc::PROT_READ,
                libc::MAP_SHARED,
                map.fd().as_fd().as_raw_fd(),
                0,
            )
        };
        if base == libc::MAP_FAILED {
            bail!(
                "map {STAGE_OLDEST} into memory: {}",
                std::io::Error::last_os_error()
            );
        }
        Ok(Oldest {
            base: base as *const u64,
            len: STAGE_OLDEST_CPUS as usize,
            _map: map,
        })
    }

    /// The CPU's value, or None for a CPU past the array.
    fn get(&self, cpu: u32) -> Option<u64> {
        let i = cpu as usize;
        // SAFETY: within the mapping; the programs write whole aligned u64s, read volatile as
        // they change under us.
        (i < self.len).then(|| unsafe { std::ptr::read_volatile(self.base.add(i)) })
    }
}

impl Drop for Oldest {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `map`, of this size, unmapped once.
        unsafe {
            libc::munmap(
                self.base as *mut libc::c_void,
                self.len * std::mem::size_of::<u64>(),
            )
        };
    }
}

fn empty_stage() -> Stage {
    Stage {
        len: 0,
        busy: 0,
        events: [tracer_common::CallEvent::default(); STAGE_EVENTS],
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn affinity() -> Vec<usize> {
        // SAFETY: a zeroed set, filled by the kernel for this thread.
        let set = unsafe {
            let mut set: libc::cpu_set_t = std::mem::zeroed();
            assert_eq!(
                libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set),
                0
            );
            set
        };
        // SAFETY: reads bits of a set we own, below its size.
        (0..libc::CPU_SETSIZE as usize)
            .filter(|&c| unsafe { libc::CPU_ISSET(c, &set) })
            .collect()
    }

    /// The flushing thread runs on each CPU it visits (so the flush there is no call from
    /// another CPU), is allowed its CPUs again afterwards, and is not moved to a CPU it was
    /// never allowed.
    #[test]
    fn the_reader_runs_on_each_cpu_it_visits_and_gets_its_cpus_back() {
        std::thread::spawn(|| {
            let home = affinity();
            let mut visits = Visits::new();
            for &cpu in &home {
                visits.go_to(cpu as u32);
                assert_eq!(visits.here(), Some(cpu as u32), "moved to CPU {cpu}");
                assert_eq!(affinity(), [cpu]);
            }
            visits.go_home();
            assert_eq!(affinity(), home);
            assert!(!visits.away);
            // A CPU outside its set (here, one past the last possible): it stays.
            visits.go_to(libc::CPU_SETSIZE as u32);
            assert!(!visits.away);
            assert_eq!(affinity(), home);
        })
        .join()
        .expect("the visiting thread");
    }

    /// The reader interrupts a CPU only when its stage holds an event it can hand over, or a
    /// program is writing it; a CPU the array has no room for is always flushed.
    #[test]
    fn only_stages_with_events_to_hand_over_are_flushed() {
        let until = 5_000_000;
        assert!(!needs_flush(Some(0), until), "empty");
        assert!(needs_flush(Some(STAGE_CLAIMED), until), "being written");
        assert!(needs_flush(Some(until), until), "sent by then");
        assert!(!needs_flush(Some(until + 1), until), "every event later");
        assert!(needs_flush(None, until), "past the array");
        assert!(needs_flush(Some(until + 1), u64::MAX), "stopping");
    }
}
