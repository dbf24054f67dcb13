//! Every process's executable mappings from the moment they appear (--stack): the kernel's perf
//! records of each exec, fork, exit and executable mmap in the system (a software dummy event
//! per CPU, like `perf record`'s side band). A call site is resolved with the mappings its
//! process had, even when the process is gone by then (a short script, a job killed by
//! SIGKILL); an interpreter mapped by a new process is registered at once, before its program's
//! first call.

use std::{
    collections::{HashMap, HashSet, VecDeque},
    os::fd::{AsFd as _, AsRawFd as _, FromRawFd as _, OwnedFd},
    path::{Path, PathBuf},
    sync::Arc,
    time::{Duration, Instant},
};

use anyhow::{anyhow, Context as _, Result};

use super::maps::Mapping;
use crate::perf_event::{PerfEventAttr, PERF_FLAG_FD_CLOEXEC};

const PERF_TYPE_SOFTWARE: u32 = 1;
const PERF_COUNT_SW_DUMMY: u64 = 9;
const PERF_SAMPLE_TIME: u64 = 1 << 2;
// perf_event_attr flag bits.
const MMAP: u64 = 1 << 8;
const COMM: u64 = 1 << 9;
const TASK: u64 = 1 << 13;
const SAMPLE_ID_ALL: u64 = 1 << 18;
const MMAP2: u64 = 1 << 23;
const COMM_EXEC: u64 = 1 << 24;
const USE_CLOCKID: u64 = 1 << 25;
const WATERMARK: u64 = 1 << 14;

// Record types and the misc bit of an exec's COMM record.
const RECORD_LOST: u32 = 2;
const RECORD_COMM: u32 = 3;
const RECORD_EXIT: u32 = 4;
const RECORD_FORK: u32 = 7;
const RECORD_MMAP2: u32 = 10;
const MISC_COMM_EXEC: u16 = 1 << 13;
const MISC_MMAP_BUILD_ID: u16 = 1 << 14;

/// Data pages of each CPU's ring (a power of two): 256 KiB, many thousand mmaps of slack.
const RING_PAGES: usize = 64;
/// How long an ended process's mappings are kept for call sites still on their way.
/// (Only processes that mapped a probed library are kept at all once they end: no other can have
/// made a call.)
const EXITED_GRACE: Duration = Duration::from_secs(30);

/// One record the kernel wrote, parsed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum PerfRecord {
    Mmap2 {
        pid: u32,
        mapping: Mapping,
    },
    Exec {
        pid: u32,
    },
    Fork {
        pid: u32,
        parent: u32,
    },
    Exit {
        pid: u32,
        tid: u32,
    },
    Lost(u64),
    /// A record type tracer does not use (a thread's rename, a thread's fork).
    Other,
}

fn u32_at(b: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_ne_bytes(b.get(at..at + 4)?.try_into().ok()?))
}

fn u64_at(b: &[u8], at: usize) -> Option<u64> {
    Some(u64::from_ne_bytes(b.get(at..at + 8)?.try_into().ok()?))
}

/// Parses one record (header included, `sample_id_all` trailer of one u64 time at its end):
/// its time and what it says. Lengths are checked before every read.
pub(crate) fn parse_record(b: &[u8]) -> Option<(u64, PerfRecord)> {
    let kind = u32_at(b, 0)?;
    let misc = u16::from_ne_bytes(b.get(4..6)?.try_into().ok()?);
    let size = usize::from(u16::from_ne_bytes(b.get(6..8)?.try_into().ok()?));
    if size < 8 || size > b.len() {
        return None;
    }
    let b = &b[..size];
    // Every record but LOST ends with the time (sample_id_all with PERF_SAMPLE_TIME).
    let time = |b: &[u8]| u64_at(b, b.len().checked_sub(8)?);
    let record = match kind {
        RECORD_MMAP2 => {
            let pid = u32_at(b, 8)?;
            let start = u64_at(b, 16)?;
            let len = u64_at(b, 24)?;
            let pgoff = u64_at(b, 32)?;
            let (dev, inode) = if misc & MISC_MMAP_BUILD_ID != 0 {
                (0, 0)
            } else {
                (
                    libc::makedev(u32_at(b, 40)?, u32_at(b, 44)?),
                    u64_at(b, 48)?,
                )
            };
            let prot = u32_at(b, 64)?;
            let name = b.get(72..b.len().checked_sub(8)?)?;
            let name = &name[..name.iter().position(|&c| c == 0)?];
            if !name.starts_with(b"/") || prot & libc::PROT_EXEC as u32 == 0 {
                return Some((time(b)?, PerfRecord::Other));
            }
            let text = String::from_utf8_lossy(name);
            let deleted = text.ends_with(" (deleted)");
            PerfRecord::Mmap2 {
                pid,
                mapping: Mapping {
                    start,
                    end: start.checked_add(len)?,
                    offset: pgoff,
                    executable: true,
                    writable: prot & libc::PROT_WRITE as u32 != 0,
                    path: PathBuf::from(text.strip_suffix(" (deleted)").unwrap_or(&text)),
                    deleted,
                    dev,
                    inode,
                },
            }
        }
        RECORD_COMM if misc & MISC_COMM_EXEC != 0 => PerfRecord::Exec { pid: u32_at(b, 8)? },
        RECORD_FORK => PerfRecord::Fork {
            pid: u32_at(b, 8)?,
            parent: u32_at(b, 12)?,
        },
        RECORD_EXIT => PerfRecord::Exit {
            pid: u32_at(b, 8)?,
            tid: u32_at(b, 16)?,
        },
        RECORD_LOST => return Some((0, PerfRecord::Lost(u64_at(b, 16)?))),
        _ => PerfRecord::Other,
    };
    Some((time(b)?, record))
}

/// One CPU's perf ring, mapped.
struct Ring {
    fd: OwnedFd,
    base: *mut u8,
    len: usize,
}

// SAFETY: the mapping belongs to this value alone; it is read and its tail written only
// through &mut self.
unsafe impl Send for Ring {}

impl Ring {
    fn open(cpu: u32) -> Result<Ring> {
        let attr = PerfEventAttr {
            kind: PERF_TYPE_SOFTWARE,
            size: std::mem::size_of::<PerfEventAttr>() as u32,
            config: PERF_COUNT_SW_DUMMY,
            sample_type: PERF_SAMPLE_TIME,
            flags: MMAP | COMM | TASK | SAMPLE_ID_ALL | MMAP2 | COMM_EXEC | USE_CLOCKID | WATERMARK,
            // Wake the reader at each record (a watermark of one byte: side-band records are
            // not samples, which wakeup_events counts): an interpreter mapped must be seen at
            // once, before its program's first call.
            wakeup_events: 1,
            clockid: libc::CLOCK_MONOTONIC,
            ..Default::default()
        };
        // SAFETY: `attr` is a complete, zero-padded perf_event_attr of the size it declares.
        let fd = unsafe {
            libc::syscall(
                libc::SYS_perf_event_open,
                &attr as *const PerfEventAttr,
                -1 as libc::pid_t,
                cpu as libc::c_int,
                -1 as libc::c_int,
                PERF_FLAG_FD_CLOEXEC,
            )
        };
        if fd < 0 {
            return Err(anyhow!(
                "perf_event_open of the mmap side band on CPU {cpu}: {}",
                std::io::Error::last_os_error()
            ));
        }
        // SAFETY: a descriptor the kernel just returned, owned by nobody else.
        let fd = unsafe { OwnedFd::from_raw_fd(fd as i32) };
        let len = (RING_PAGES + 1) * page_size();
        // SAFETY: maps the event's ring (metadata page and data pages) as the perf ABI
        // defines; the result is checked before use and unmapped on drop.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                0,
            )
        };
        if base == libc::MAP_FAILED {
            return Err(anyhow!(
                "map the mmap side band ring of CPU {cpu}: {}",
                std::io::Error::last_os_error()
            ));
        }
        Ok(Ring {
            fd,
            base: base.cast(),
            len,
        })
    }

    /// Copies out every record written since the last call.
    fn drain(&mut self, out: &mut Vec<Vec<u8>>) {
        let page = page_size();
        let data_size = (self.len - page) as u64;
        // SAFETY: data_head (offset 1024) and data_tail (1032) are u64 fields of the metadata
        // page, aligned; the kernel writes head and we write tail, as the perf ABI defines.
        let (head_ptr, tail_ptr) = unsafe {
            (
                &*(self.base.add(1024) as *const std::sync::atomic::AtomicU64),
                &*(self.base.add(1032) as *const std::sync::atomic::AtomicU64),
            )
        };
        let head = head_ptr.load(std::sync::atomic::Ordering::Acquire);
        let mut tail = tail_ptr.load(std::sync::atomic::Ordering::Relaxed);
        while tail + 8 <= head {
            let header = self.read(tail, 8, data_size);
            let size = u64::from(u16::from_ne_bytes([header[6], header[7]]));
            if size < 8 || tail + size > head || size > data_size {
                break;
            }
            out.push(self.read(tail, size as usize, data_size));
            tail += size;
        }
        tail_ptr.store(head.max(tail), std::sync::atomic::Ordering::Release);
    }

    /// `len` (at most the ring's size) bytes at ring position `pos`, across the wrap.
    fn read(&self, pos: u64, len: usize, data_size: u64) -> Vec<u8> {
        let page = page_size();
        let start = (pos % data_size) as usize;
        let first = len.min(data_size as usize - start);
        let mut out = vec![0u8; len];
        // SAFETY: both copies stay inside the data pages of the mapping (page..self.len):
        // `first` bytes from `start`, then the rest from the data's beginning; len <= size.
        unsafe {
            std::ptr::copy_nonoverlapping(self.base.add(page + start), out.as_mut_ptr(), first);
            std::ptr::copy_nonoverlapping(
                self.base.add(page),
                out.as_mut_ptr().add(first),
                len - first,
            );
        }
        out
    }
}

impl Drop for Ring {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `open`, of this length, unmapped once.
        unsafe { libc::munmap(self.base.cast(), self.len) };
    }
}

fn page_size() -> usize {
    // SAFETY: no preconditions.
    usize::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) }).unwrap_or(4096)
}

/// A process's executable mappings as known.
#[derive(Clone, Debug, Default)]
struct ProcMaps {
    maps: Vec<Mapping>,
    /// Known from its fork or exec on: nothing is missing.
    complete: bool,
    /// When it ended (its entry goes EXITED_GRACE later, unless the pid is reused).
    exited_at: Option<Instant>,
    /// It mapped a probed library (or inherited one): it may have made calls.
    uses_probed: bool,
}

/// What a drain found that the registry acts on.
#[derive(Debug, PartialEq, Eq)]
pub enum Notice {
    /// The process replaced its program: what tracer knew of its interpreter is stale.
    Exec(u32),
    /// The process mapped a file named like a CPython interpreter.
    Interpreter(u32, Mapping),
}

/// The mappings of every process, kept from the kernel's records.
pub struct Mappings {
    rings: Vec<Ring>,
    procs: HashMap<u32, ProcMaps>,
    exited: VecDeque<(Instant, u32)>,
    notices: Vec<Notice>,
    /// The probed libraries as (dev, inode), as last told.
    probed: HashSet<(u64, u64)>,
    /// Records the kernel could not write (a full ring): some mappings may be missing.
    pub lost: u64,
}

impl Mappings {
    /// Opens a ring on every online CPU.
    pub fn open() -> Result<Mappings> {
        let cpus = aya::util::online_cpus()
            .map_err(|(path, e)| anyhow!("read the online CPUs from {path}: {e}"))?;
        let rings = cpus
            .into_iter()
            .map(Ring::open)
            .collect::<Result<Vec<_>>>()
            .context("follow processes' mappings (--stack)")?;
        Ok(Mappings {
            rings,
            procs: HashMap::new(),
            exited: VecDeque::new(),
            notices: Vec::new(),
            probed: HashSet::new(),
            lost: 0,
        })
    }

    /// Descriptors to wait on without holding the mappings.
    pub fn poll_fds(&self) -> Result<Vec<OwnedFd>> {
        self.rings
            .iter()
            .map(|r| r.fd.try_clone().context("duplicate a side-band descriptor"))
            .collect()
    }

    /// Waits up to `timeout` for a record on any of `fds`.
    pub fn wait(fds: &[OwnedFd], timeout: Duration) {
        let mut fds: Vec<nix::poll::PollFd> = fds
            .iter()
            .map(|fd| nix::poll::PollFd::new(fd.as_fd(), nix::poll::PollFlags::POLLIN))
            .collect();
        let ms = u16::try_from(timeout.as_millis()).unwrap_or(u16::MAX);
        let _ = nix::poll::poll(&mut fds, nix::poll::PollTimeout::from(ms));
    }

    /// Applies every record written so far, in time order across CPUs.
    pub fn drain(&mut self) {
        let mut raw = Vec::new();
        for ring in &mut self.rings {
            ring.drain(&mut raw);
        }
        let mut records: Vec<(u64, PerfRecord)> =
            raw.iter().filter_map(|b| parse_record(b)).collect();
        records.sort_by_key(|(t, _)| *t);
        for (_, record) in records {
            self.apply(record);
        }
        let now = Instant::now();
        while let Some(&(at, pid)) = self.exited.front() {
            if now.duration_since(at) < EXITED_GRACE {
                break;
            }
            self.exited.pop_front();
            if self.procs.get(&pid).and_then(|p| p.exited_at) == Some(at) {
                self.procs.remove(&pid);
            }
        }
    }

    pub(crate) fn apply(&mut self, record: PerfRecord) {
        match record {
            PerfRecord::Mmap2 { pid, mapping } => {
                let p = self.procs.entry(pid).or_default();
                p.uses_probed |= self.probed.contains(&(mapping.dev, mapping.inode));
                p.maps
                    .retain(|m| m.end <= mapping.start || m.start >= mapping.end);
                if looks_like_python(&mapping.path) {
                    self.notices.push(Notice::Interpreter(pid, mapping.clone()));
                }
                p.maps.push(mapping);
            }
            PerfRecord::Exec { pid } => {
                self.procs.insert(
                    pid,
                    ProcMaps {
                        complete: true,
                        ..Default::default()
                    },
                );
                self.notices.push(Notice::Exec(pid));
            }
            PerfRecord::Fork { pid, parent } if pid != parent => {
                // A new process starts with its parent's mappings (none are reported again).
                let mut child = self.procs.get(&parent).cloned().unwrap_or_default();
                child.exited_at = None;
                if let Some(own) = self.procs.remove(&pid) {
                    // Read before the fork record: they came after the fork.
                    child.maps.retain(|m| {
                        own.maps
                            .iter()
                            .all(|o| m.end <= o.start || m.start >= o.end)
                    });
                    child.maps.extend(own.maps);
                }
                self.procs.insert(pid, child);
            }
            PerfRecord::Exit { pid, tid } if pid == tid => {
                match self.procs.get_mut(&pid) {
                    Some(p) if p.uses_probed => {
                        let now = Instant::now();
                        p.exited_at = Some(now);
                        self.exited.push_back((now, pid));
                    }
                    // It never mapped a probed library: it made no call to resolve.
                    Some(_) => {
                        self.procs.remove(&pid);
                    }
                    None => {}
                }
            }
            PerfRecord::Lost(n) => {
                // Whose records were lost is not said: no process's mappings are known whole
                // now, so live ones are read from /proc again.
                self.lost += n;
                for p in self.procs.values_mut() {
                    p.complete = false;
                }
            }
            _ => {}
        }
    }

    /// The probed libraries, as (dev, inode): only a process that maps one is kept once it ends.
    pub fn set_probed(&mut self, probed: &HashSet<(u64, u64)>) {
        if probed.len() != self.probed.len() {
            self.probed = probed.clone();
        }
    }

    /// What the records drained so far asked of the registry.
    pub fn take_notices(&mut self) -> Vec<Notice> {
        std::mem::take(&mut self.notices)
    }

    /// The mappings of `pid` when they are known from its start (fork or exec) on.
    pub fn complete(&self, pid: u32) -> Option<&[Mapping]> {
        self.procs
            .get(&pid)
            .filter(|p| p.complete)
            .map(|p| p.maps.as_slice())
    }

    /// Whatever is known of `pid`'s mappings (for a process that is gone).
    pub fn known(&self, pid: u32) -> Option<&[Mapping]> {
        self.procs.get(&pid).map(|p| p.maps.as_slice())
    }

    /// Forgets an ended process whose calls have all been resolved.
    pub fn forget(&mut self, pid: u32) {
        self.procs.remove(&pid);
    }

    /// Processes whose mappings are held (for the summary's occupancy figures).
    pub fn processes(&self) -> usize {
        self.procs.len()
    }
}

/// "python3.12", "libpython3.12.so.1.0": files that may hold `_PyRuntime` (not extension
/// modules such as "_ctypes.cpython-311-x86_64-linux-gnu.so").
pub fn looks_like_python(path: &Path) -> bool {
    path.file_name()
        .and_then(|n| n.to_str())
        .is_some_and(|n| n.starts_with("python") || n.starts_with("libpython"))
}

/// The mappings, shared between the thread that follows them and the registry.
pub type SharedMappings = Arc<std::sync::Mutex<Mappings>>;

#[cfg(test)]
mod tests {
    use super::*;

    fn record(kind: u32, misc: u16, body: &[u8], time: u64) -> Vec<u8> {
        let size = (8 + body.len() + 8) as u16;
        let mut b = Vec::new();
        b.extend_from_slice(&kind.to_ne_bytes());
        b.extend_from_slice(&misc.to_ne_bytes());
        b.extend_from_slice(&size.to_ne_bytes());
        b.extend_from_slice(body);
        b.extend_from_slice(&time.to_ne_bytes());
        b
    }

    fn mmap2(pid: u32, start: u64, len: u64, pgoff: u64, name: &str) -> Vec<u8> {
        let mut body = Vec::new();
        for v in [pid, pid] {
            body.extend_from_slice(&v.to_ne_bytes());
        }
        for v in [start, len, pgoff] {
            body.extend_from_slice(&v.to_ne_bytes());
        }
        body.extend_from_slice(&8u32.to_ne_bytes());
        body.extend_from_slice(&1u32.to_ne_bytes());
        body.extend_from_slice(&42u64.to_ne_bytes());
        body.extend_from_slice(&0u64.to_ne_bytes());
        body.extend_from_slice(&((libc::PROT_READ | libc::PROT_EXEC) as u32).to_ne_bytes());
        body.extend_from_slice(&0u32.to_ne_bytes());
        let mut name = name.as_bytes().to_vec();
        name.push(0);
        while !name.len().is_multiple_of(8) {
            name.push(0);
        }
        body.extend_from_slice(&name);
        record(RECORD_MMAP2, 0, &body, 7)
    }

    #[test]
    fn parses_the_kernels_records() {
        let (t, r) =
            parse_record(&mmap2(10, 0x1000, 0x2000, 0x3000, "/usr/bin/python3.12")).unwrap();
        assert_eq!(t, 7);
        let PerfRecord::Mmap2 { pid, mapping } = r else {
            panic!("{r:?}")
        };
        assert_eq!(
            (pid, mapping.start, mapping.end, mapping.offset),
            (10, 0x1000, 0x3000, 0x3000)
        );
        assert_eq!(mapping.path, Path::new("/usr/bin/python3.12"));
        assert_eq!((mapping.dev, mapping.inode), (libc::makedev(8, 1), 42));
        let mut body = 11u32.to_ne_bytes().to_vec();
        body.extend_from_slice(&11u32.to_ne_bytes());
        body.extend_from_slice(b"python3\0");
        assert_eq!(
            parse_record(&record(RECORD_COMM, MISC_COMM_EXEC, &body, 9)),
            Some((9, PerfRecord::Exec { pid: 11 }))
        );
        assert_eq!(
            parse_record(&record(RECORD_COMM, 0, &body, 9)),
            Some((9, PerfRecord::Other))
        );
        // Truncated or lying about its size: refused, never read past.
        let m = mmap2(10, 0x1000, 0x2000, 0, "/x");
        for cut in 0..m.len() {
            assert_eq!(parse_record(&m[..cut]), None, "cut at {cut}");
        }
    }

    #[test]
    fn a_child_inherits_its_parents_mappings_and_an_exec_clears_them() {
        let mut m = Mappings {
            rings: Vec::new(),
            procs: HashMap::new(),
            exited: VecDeque::new(),
            notices: Vec::new(),
            probed: HashSet::new(),
            lost: 0,
        };
        m.apply(PerfRecord::Exec { pid: 1 });
        for r in [
            mmap2(1, 0x1000, 0x1000, 0, "/bin/a"),
            mmap2(1, 0x5000, 0x1000, 0, "/lib/libc.so.6"),
        ] {
            m.apply(parse_record(&r).unwrap().1);
        }
        // The child's own mmap read before its fork record overrides what it inherited.
        m.apply(
            parse_record(&mmap2(2, 0x5000, 0x1000, 0, "/lib/other.so"))
                .unwrap()
                .1,
        );
        m.apply(PerfRecord::Fork { pid: 2, parent: 1 });
        let child: Vec<_> = m
            .complete(2)
            .unwrap()
            .iter()
            .map(|x| x.path.clone())
            .collect();
        assert_eq!(
            child,
            [PathBuf::from("/bin/a"), PathBuf::from("/lib/other.so")]
        );
        m.apply(PerfRecord::Exec { pid: 2 });
        assert_eq!(m.complete(2).unwrap().len(), 0);
        // A process known only from a later mmap is not complete.
        m.apply(
            parse_record(&mmap2(3, 0x1000, 0x1000, 0, "/bin/b"))
                .unwrap()
                .1,
        );
        assert!(m.complete(3).is_none() && m.known(3).is_some());
        assert_eq!(m.take_notices(), [Notice::Exec(1), Notice::Exec(2)]);
        // An ended process is kept (for its calls' sites) only if it mapped a probed library.
        m.set_probed(&HashSet::from([(libc::makedev(8, 1), 42)]));
        m.apply(PerfRecord::Exec { pid: 4 });
        m.apply(
            parse_record(&mmap2(4, 0x1000, 0x1000, 0, "/lib/libcudart.so.12"))
                .unwrap()
                .1,
        );
        m.apply(PerfRecord::Exit { pid: 4, tid: 4 });
        assert!(
            m.known(4).is_some(),
            "a process that could have called is kept a while"
        );
        m.apply(PerfRecord::Exec { pid: 5 });
        m.set_probed(&HashSet::from([(1, 1), (2, 2)]));
        m.apply(
            parse_record(&mmap2(5, 0x1000, 0x1000, 0, "/bin/ls"))
                .unwrap()
                .1,
        );
        m.apply(PerfRecord::Exit { pid: 5, tid: 5 });
        assert!(
            m.known(5).is_none(),
            "one that could not is dropped at once"
        );
    }
}
