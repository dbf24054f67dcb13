//! Discovery as it happens (issue 52). The kernel tells of every open of a file named like a
//! probed library (probe/libwatch.rs); the main thread, woken by it, probes the file before
//! the process goes on when the kernel stopped it (a new path), or as soon as it hears when it
//! did not (the parent a shell, a debugger attached, holding off). Each process that opened
//! one is recorded with what tracer saw of it (SCHEMA.md, `discovery`); one whose library was
//! probed only after it opened it is found late: the registry gives it a `found_late` gap from
//! that open to its first call seen, and explain treats the time before as not seen.

use std::{
    collections::{BTreeSet, HashMap},
    os::fd::{AsRawFd as _, FromRawFd as _, OwnedFd, RawFd},
    path::PathBuf,
    sync::{
        atomic::{AtomicBool, Ordering},
        mpsc, Arc,
    },
};

use anyhow::{anyhow, Context as _, Result};

use tracer_common::libwatch::{Hold, LibOpen, PATH_LEN};

use super::shared::Shared;
pub use crate::model::discovery::{DiscoveryRow, Found, Late, Outcome};
use crate::probe::{
    attach::{AttachedLibrary, Probes},
    discover::{self, Candidate, FileId, Origin, Scanner},
    libwatch::{LibWatch, OpensRing},
};

/// The longest the main thread may keep a process stopped: past it the opens' thread
/// continues it (and the main thread, finding it running, marks it found late).
const HOLD_MAX_NS: u64 = 10_000_000_000;

/// The opens' thread: reads the ring, hands each open to the main thread (waking it through
/// the eventfd), and continues a process the main thread kept stopped past [`HOLD_MAX_NS`] (a
/// main thread stuck in a slow attach, or wedged) so that no user's process waits for long.
/// On `quit`, it hands over what is left and ends.
fn read_opens(mut ring: OpensRing, tx: &mpsc::Sender<LibOpen>, wake: &OwnedFd, quit: &AtomicBool) {
    let mut held: HashMap<u32, (u32, u64)> = HashMap::new();
    loop {
        let last = quit.load(Ordering::SeqCst);
        if !last {
            wait_readable(ring.fd(), 250);
        }
        let opens = ring.drain();
        for open in &opens {
            if open.hold == Hold::Held as u32 {
                held.insert(open.pid, (open.tid, open.ts_ns));
            }
        }
        if !opens.is_empty() {
            for open in opens {
                if tx.send(open).is_err() {
                    return;
                }
            }
            let one = 1u64.to_ne_bytes();
            // SAFETY: writes 8 bytes from a buffer of 8 to the eventfd.
            unsafe { libc::write(wake.as_raw_fd(), one.as_ptr().cast(), 8) };
        }
        let now = super::arming::monotonic_ns();
        held.retain(|&pid, &mut (tid, since)| {
            // Not stopped yet is not continued: the stop may still be taking effect.
            if !running(pid)
                || (now.saturating_sub(since) > STOP_TAKES.as_nanos() as u64 && !stopped(pid, tid))
            {
                return false;
            }
            if now.saturating_sub(since) > HOLD_MAX_NS {
                resume(pid);
                return false;
            }
            true
        });
        if last {
            return;
        }
    }
}

/// Waits until `fd` is readable, at most `ms`.
fn wait_readable(fd: RawFd, ms: i32) {
    let mut pfd = libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one pollfd we own, for the length given.
    unsafe { libc::poll(&mut pfd, 1, ms) };
}

pub struct Watch {
    lib: LibWatch,
    opens: mpsc::Receiver<LibOpen>,
    /// Readable when the opens' thread handed something over.
    wake: OwnedFd,
    quit: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
    /// When each probed file's probes were on (CLOCK_MONOTONIC ns).
    probed_at: HashMap<FileId, u64>,
    /// The paths told to the kernel as probed, and their file.
    known: HashMap<[u8; PATH_LEN], FileId>,
    wall_offset_ns: i64,
    /// Processes stopped for tracer and continued, and the time they waited, in all.
    pub held: u64,
    pub held_us: u64,
    held_max_us: u64,
    /// The processes found late or never traced (the first [`UNSEEN_KEPT`]), and how many.
    unseen: Vec<DiscoveryRow>,
    unseen_count: u64,
    unseen_pids: std::collections::HashSet<u32>,
}

/// Processes found late or missed named in the summary (all are in the database).
const UNSEEN_KEPT: usize = 20;

/// What discovery did in a session, for its summary.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct DiscoverySummary {
    /// Processes stopped until their library was probed, and the longest wait.
    pub held: u64,
    pub held_max_us: u64,
    /// Processes found late or never traced (the first few named).
    pub unseen: u64,
    pub unseen_named: Vec<DiscoveryRow>,
    /// Library opens the kernel could not tell of (its ring or pending map full).
    pub lost: u64,
}

impl Watch {
    /// The watch, its holding window open from now; its ring read on a thread of its own,
    /// which also continues a process the main thread has kept stopped past [`HOLD_MAX_NS`].
    pub fn new(mut lib: LibWatch, wall_offset_ns: i64) -> Result<Watch> {
        let ring = lib
            .take_ring()
            .ok_or_else(|| anyhow!("the library opens' ring was taken already"))?;
        // SAFETY: eventfd has no memory preconditions; the descriptor is owned below.
        let raw = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
        if raw < 0 {
            return Err(std::io::Error::last_os_error()).context("make the opens' eventfd");
        }
        // SAFETY: a descriptor just made, owned by nothing else.
        let wake = unsafe { OwnedFd::from_raw_fd(raw) };
        let signal = wake.try_clone().context("duplicate the opens' eventfd")?;
        let (tx, opens) = mpsc::channel();
        let quit = Arc::new(AtomicBool::new(false));
        let stop = quit.clone();
        let thread = std::thread::Builder::new()
            .name("tracer-opens".into())
            .spawn(move || read_opens(ring, &tx, &signal, &stop))
            .context("start the library opens' thread")?;
        let mut w = Watch {
            lib,
            opens,
            wake,
            quit,
            thread: Some(thread),
            probed_at: HashMap::new(),
            known: HashMap::new(),
            wall_offset_ns,
            held: 0,
            held_us: 0,
            held_max_us: 0,
            unseen: Vec::new(),
            unseen_count: 0,
            unseen_pids: Default::default(),
        };
        w.renew();
        Ok(w)
    }

    pub fn summary(&self) -> DiscoverySummary {
        DiscoverySummary {
            held: self.held,
            held_max_us: self.held_max_us,
            unseen: self.unseen_count,
            unseen_named: self.unseen.clone(),
            lost: self.lost(),
        }
    }

    /// Waits until opens wait for the main thread, or `until` passes.
    pub fn wait(&self, until: std::time::Instant) {
        let ms = until
            .saturating_duration_since(std::time::Instant::now())
            .as_millis()
            .min(i32::MAX as u128) as i32;
        wait_readable(self.wake.as_raw_fd(), ms);
    }

    /// A file's probes are on from now.
    pub fn probed(&mut self, id: FileId) {
        self.probed_at
            .entry(id)
            .or_insert_with(super::arming::monotonic_ns);
    }

    /// Keeps the kernel's holding window open while this thread answers.
    pub fn renew(&mut self) {
        if let Err(e) = self.lib.renew(super::arming::monotonic_ns()) {
            log::warn!("{e:#}");
        }
    }

    /// Opens the kernel could not send.
    pub fn lost(&self) -> u64 {
        self.lib.lost()
    }

    /// Every open the kernel sent: probes what is new, continues what it stopped.
    pub fn serve(
        &mut self,
        probes: &mut Probes,
        scanner: &mut Scanner,
        shared: &Shared,
        scope: Option<&[u32]>,
    ) {
        let mut count = [0u8; 8];
        // SAFETY: reads at most 8 bytes into a buffer of 8; it only clears the eventfd.
        unsafe { libc::read(self.wake.as_raw_fd(), count.as_mut_ptr().cast(), 8) };
        while let Ok(open) = self.opens.try_recv() {
            let held = open.hold == Hold::Held as u32;
            let row = self.one(&open, probes, scanner, shared, scope);
            if held {
                resume(open.pid);
            }
            if let Some(mut row) = row {
                if held && row.outcome == Outcome::Held {
                    let waited = super::arming::monotonic_ns().saturating_sub(open.ts_ns) / 1000;
                    row.held_us = Some(waited);
                    self.held += 1;
                    self.held_us += waited;
                    self.held_max_us = self.held_max_us.max(waited);
                }
                if row.outcome.unseen() && self.unseen_pids.insert(row.pid) {
                    self.unseen_count += 1;
                    if self.unseen.len() < UNSEEN_KEPT {
                        self.unseen.push(row.clone());
                    }
                }
                if let Ok(mut found) = shared.discovery.lock() {
                    found.rows.push(row);
                }
            }
        }
    }

    /// At the end: nobody is stopped from now; the opens' thread hands over what the kernel
    /// sent and ends (a last [`Watch::serve`] probes and continues those it stopped).
    pub fn finish(&mut self) {
        if let Err(e) = self.lib.stop_holding() {
            log::warn!("{e:#}");
        }
        self.quit.store(true, Ordering::SeqCst);
        if let Some(thread) = self.thread.take() {
            if thread.join().is_err() {
                log::warn!("the library opens' thread panicked");
            }
        }
    }

    fn wall(&self, mono: u64) -> i64 {
        mono as i64 + self.wall_offset_ns
    }

    fn one(
        &mut self,
        open: &LibOpen,
        probes: &mut Probes,
        scanner: &mut Scanner,
        shared: &Shared,
        scope: Option<&[u32]>,
    ) -> Option<DiscoveryRow> {
        if scope.is_some_and(|pids| !pids.contains(&open.pid)) {
            return None;
        }
        let mut hold = Hold::from_u32(open.hold).unwrap_or(Hold::Off);
        let mut continued = false;
        if hold == Hold::Held && !comes_to_a_stop(open.pid, open.tid) {
            // Continued already (another tracer that probed first, or a SIGCONT): it may have
            // called before this tracer's probes are on.
            hold = Hold::Off;
            continued = true;
        }
        let (open_path, shown) = resolve(open, hold == Hold::Held);
        if hold == Hold::Known {
            // The kernel knew the path as probed: traced from its first call, gone or not.
            if let Some(&at) = self
                .known
                .get(&open.path)
                .and_then(|id| self.probed_at.get(id))
            {
                return Some(DiscoveryRow {
                    pid: open.pid,
                    comm: comm_of(open),
                    library: shown,
                    opened_ns: self.wall(open.ts_ns),
                    probed_ns: Some(self.wall(at)),
                    held_us: None,
                    outcome: Outcome::Probed,
                    why: None,
                });
            }
        }
        let mut row = DiscoveryRow {
            pid: open.pid,
            comm: comm_of(open),
            library: shown.clone(),
            opened_ns: self.wall(open.ts_ns),
            probed_ns: None,
            held_us: None,
            outcome: Outcome::Missed,
            why: why_not_held(hold),
        };
        // tracer's own descriptor of the file: the attach goes through it, whatever the
        // process does meanwhile (continued, it may close its own or end).
        let (Some(id), Some(file)) = (discover::file_id(&open_path), open_file(&open_path)) else {
            row.why = Some("the file was gone before tracer could read it".into());
            return Some(row);
        };
        let open_path = PathBuf::from(format!("/proc/self/fd/{}", file.as_raw_fd()));
        let before = self.probed_at.get(&id).copied();
        if let Some(at) = before.filter(|&at| at <= open.ts_ns) {
            row.outcome = Outcome::Probed;
            row.probed_ns = Some(self.wall(at));
            self.know(open, id);
            return Some(row);
        }
        // Whether this open marked the process late (another of its opens may have already):
        // only then is the mark taken back when this one turns out not late.
        let mut marked = false;
        if hold != Hold::Held {
            // Before the probes go on: its first call may reach the registry at once.
            marked = self.mark_late(shared, open, &shown);
        }
        // Gone before the probes went on: nothing of it can have been seen.
        let alive_before = running(open.pid);
        if before.is_none() {
            if let Err(why) = self.attach(probes, scanner, shared, open, open_path, shown, id) {
                if marked {
                    unmark_late(shared, open.pid);
                }
                row.outcome = Outcome::Unprobeable;
                row.why = Some(why);
                self.know(open, id);
                return Some(row);
            }
        }
        self.know(open, id);
        row.probed_ns = self.probed_at.get(&id).map(|&at| self.wall(at));
        if hold == Hold::Held && !stopped(open.pid, open.tid) {
            // Continued while this tracer attached: what it did meanwhile was not seen.
            marked |= self.mark_late(shared, open, &row.library);
            hold = Hold::Off;
            continued = true;
        }
        if continued {
            row.why = Some("continued before this tracer had probed its library (another tracer's, or a SIGCONT)".into());
        }
        row.outcome = if hold == Hold::Held {
            Outcome::Held
        } else if !alive_before {
            Outcome::Missed
        } else if !continued && only_reads(open.pid, id) {
            // A loader maps what it opened; a copy does not.
            Outcome::Read
        } else {
            // Running when the probes went on (ended since, or not): its calls from then on
            // were seen, those before not.
            Outcome::Late
        };
        if marked && row.outcome != Outcome::Late {
            unmark_late(shared, open.pid);
        }
        if row.outcome == Outcome::Missed {
            row.why = Some(format!(
                "it ended before its library was probed ({}); whether it mapped the library or only read it is not known",
                row.why.as_deref().unwrap_or("not stopped")
            ));
        }
        Some(row)
    }

    #[allow(clippy::too_many_arguments)] // reason: the main thread's parts, lent for one attach
    fn attach(
        &mut self,
        probes: &mut Probes,
        scanner: &mut Scanner,
        shared: &Shared,
        open: &LibOpen,
        open_path: PathBuf,
        shown: String,
        id: FileId,
    ) -> Result<(), String> {
        let lib = Candidate {
            open_path,
            shown,
            id,
            origin: Origin::Opened,
            pids: BTreeSet::from([open.pid]),
        };
        scanner.mark_seen(id);
        match probes.attach(&lib, None) {
            Ok(att) => {
                report_attached(att);
                note_probed(shared, &lib);
                self.probed(id);
                Ok(())
            }
            Err(e) => {
                eprintln!("tracer: skipping {}: {e:#}", lib.shown);
                Err(format!("{e:#}"))
            }
        }
    }

    /// Marks the process found late for the registry; true if this made the mark.
    fn mark_late(&self, shared: &Shared, open: &LibOpen, library: &str) -> bool {
        let Ok(mut found) = shared.discovery.lock() else {
            return false;
        };
        if found.late.contains_key(&open.pid) {
            return false;
        }
        found.late.insert(
            open.pid,
            Late {
                from_ns: Some(self.wall(open.ts_ns)),
                library: library.to_owned(),
                how: "opened",
            },
        );
        true
    }

    /// Later opens of this path go on unstopped.
    fn know(&mut self, open: &LibOpen, id: FileId) {
        if self.known.insert(open.path, id).is_none() {
            if let Err(e) = self.lib.know(&open.path) {
                log::warn!("{e:#}");
            }
        }
    }
}

/// Remembers a probed library's identity: processes that map it are traced.
pub fn note_probed(shared: &Shared, lib: &Candidate) {
    if let Ok(mut files) = shared.probed_files.lock() {
        files.insert((lib.id.dev, lib.id.ino));
    }
}

/// Says on stderr what was attached in a library, and what not.
pub fn report_attached(att: &AttachedLibrary) {
    eprintln!(
        "tracer: probing {} ({}, {} symbols)",
        att.path,
        att.origin,
        att.symbols.len()
    );
    if !att.missing.is_empty() {
        eprintln!(
            "tracer:   not exported there (not traced): {}",
            att.missing.join(", ")
        );
    }
    for f in &att.failed {
        eprintln!("tracer:   failed to attach {f}");
    }
}

/// Attaches to a library found, saying so on stderr; a discovered library that fails is
/// skipped, a --lib one is an error.
/// Takes back a found-late mark this tracer made for an open that was not late after all.
fn unmark_late(shared: &Shared, pid: u32) {
    if let Ok(mut found) = shared.discovery.lock() {
        found.late.remove(&pid);
    }
}

/// What the session says of discovery at its end: processes found late or never traced
/// (named), library opens lost.
pub fn said(d: &DiscoverySummary) -> Vec<String> {
    let mut out = Vec::new();
    if d.unseen > 0 {
        let named: Vec<String> = d
            .unseen_named
            .iter()
            .map(|r| {
                let after = r
                    .probed_ns
                    .map(|p| {
                        format!(
                            ", probed {:.1} ms after it opened it",
                            (p - r.opened_ns).max(0) as f64 / 1e6
                        )
                    })
                    .unwrap_or_default();
                format!(
                    "pid {} ({}) {} {}{after}",
                    r.pid,
                    r.comm.as_deref().unwrap_or("?"),
                    r.outcome.name(),
                    r.library
                )
            })
            .collect();
        out.push(format!(
            "{} process(es) opened a CUDA library before tracer had probed it (late: calls before the probes not seen; missed: none seen): {}{}",
            d.unseen,
            named.join("; "),
            if d.unseen as usize > named.len() { "; the rest in the discovery table" } else { "" }
        ));
    }
    if d.lost > 0 {
        out.push(format!(
            "{} library open(s) were not told by the kernel (its ring or pending map was full): processes that opened a CUDA library then may have been found late, unmarked",
            d.lost
        ));
    }
    out
}

/// Why the kernel did not stop the process, said in the row.
fn why_not_held(hold: Hold) -> Option<String> {
    match hold {
        Hold::Known | Hold::Held => None,
        Hold::ParentShell => Some(
            "not stopped: a job of a shell or sudo, which would report the stop as the user's"
                .into(),
        ),
        Hold::Ptraced => Some("not stopped: a debugger traces it".into()),
        Hold::Off => Some("not stopped: holding is off".into()),
        Hold::Tracer => Some("not stopped: it is another tracer".into()),
    }
}

/// The file the process opened: through its descriptor while it is stopped (exactly that
/// file); else by its path as is where that reaches the same file as through /proc/PID/root
/// (or the process is gone), so that it can still be probed once a short process has ended;
/// else through /proc/PID/root (a container). And the path as the process named it, absolute.
fn resolve(open: &LibOpen, held: bool) -> (PathBuf, String) {
    let named = String::from_utf8_lossy(open.path_bytes()).into_owned();
    let pid = open.pid;
    let shown = if named.starts_with('/') {
        named.clone()
    } else {
        std::fs::read_link(format!("/proc/{pid}/cwd"))
            .map(|cwd| cwd.join(&named).display().to_string())
            .unwrap_or_else(|_| named.clone())
    };
    if held && open.fd >= 0 {
        let fd = PathBuf::from(format!("/proc/{pid}/fd/{}", open.fd));
        if discover::file_id(&fd).is_some() {
            return (fd, shown);
        }
    }
    let in_process = match shown.strip_prefix('/') {
        Some(rest) => PathBuf::from(format!("/proc/{pid}/root")).join(rest),
        None => PathBuf::from(format!("/proc/{pid}/cwd")).join(&named),
    };
    let plain = PathBuf::from(&shown);
    let there = discover::file_id(&in_process);
    // The same file by its own path outlives the process (a short one ends before the attach).
    if plain.is_absolute() && (there.is_none() || discover::file_id(&plain) == there) {
        return (plain, shown);
    }
    (in_process, shown)
}

/// The file, opened without blocking (a FIFO put in its place would never answer) and only if
/// it is a regular file.
fn open_file(path: &std::path::Path) -> Option<std::fs::File> {
    use std::os::unix::fs::OpenOptionsExt as _;
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY)
        .open(path)
        .ok()?;
    file.metadata().ok()?.is_file().then_some(file)
}

/// The opening thread's name, as the kernel gave it.
fn comm_of(open: &LibOpen) -> Option<String> {
    let end = open
        .comm
        .iter()
        .position(|&b| b == 0)
        .unwrap_or(open.comm.len());
    (end > 0).then(|| String::from_utf8_lossy(&open.comm[..end]).into_owned())
}

/// Whether the process maps the file (None: its mappings could not be read).
fn maps_file(pid: u32, id: FileId) -> Option<bool> {
    let maps = crate::traced::maps::read(pid).ok()?;
    // An ending process's mappings are gone before it is a zombie: not an answer.
    (!maps.is_empty()).then(|| maps.iter().any(|m| m.dev == id.dev && m.inode == id.ino))
}

/// Whether a running process only read the file it opened: not mapping it after MAP_TAKES (a
/// loader held off a busy CPU was once judged a copy); one ending meanwhile, by its last look.
fn only_reads(pid: u32, id: FileId) -> bool {
    let (deadline, mut unmapped) = (std::time::Instant::now() + MAP_TAKES, false);
    while let (true, Some(maps)) = (running(pid), maps_file(pid, id)) {
        if maps || std::time::Instant::now() >= deadline {
            return !maps;
        }
        unmapped = true;
        std::thread::sleep(std::time::Duration::from_millis(2));
    }
    unmapped
}

/// Whether the process still runs (a zombie has made its last call).
fn running(pid: u32) -> bool {
    state(pid).is_some_and(|s| s != 'Z' && s != 'X')
}

/// Whether the thread that opened the library is stopped (for tracer, unless something else
/// continued it).
fn stopped(pid: u32, tid: u32) -> bool {
    stat_state(&format!("/proc/{pid}/task/{tid}/stat")).is_some_and(|s| s == 'T')
}

/// Whether the thread stops: the kernel's signal takes effect as the open returns, which may
/// be a little after tracer hears of it (a busy CPU).
fn comes_to_a_stop(pid: u32, tid: u32) -> bool {
    let deadline = std::time::Instant::now() + STOP_TAKES;
    while !stopped(pid, tid) {
        if std::time::Instant::now() >= deadline || !running(pid) {
            return false;
        }
        std::thread::sleep(std::time::Duration::from_micros(200));
    }
    true
}

/// The longest a stop is waited for to take effect; a loader, to map what it opened.
const STOP_TAKES: std::time::Duration = std::time::Duration::from_millis(100);
const MAP_TAKES: std::time::Duration = std::time::Duration::from_millis(50);

/// The process's state letter in /proc/PID/stat.
fn state(pid: u32) -> Option<char> {
    stat_state(&format!("/proc/{pid}/stat"))
}

fn stat_state(path: &str) -> Option<char> {
    let stat = std::fs::read_to_string(path).ok()?;
    stat.rsplit_once(')')?.1.trim_start().chars().next()
}

/// Continues a process the kernel stopped for tracer.
fn resume(pid: u32) {
    // SAFETY: kill has no memory preconditions. The pid is the one the kernel stopped; were it
    // killed and its pid reused meanwhile, SIGCONT to a running process changes nothing.
    let rc = unsafe { libc::kill(pid as libc::pid_t, libc::SIGCONT) };
    if rc != 0 {
        log::debug!(
            "continue process {pid}: {}",
            std::io::Error::last_os_error()
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_zombie_or_a_missing_process_is_not_running() {
        assert!(running(std::process::id()));
        assert!(!running(u32::MAX - 1));
        let mut child = std::process::Command::new("true")
            .spawn()
            .expect("spawn true");
        let pid = child.id();
        // Not yet reaped: a zombie once it has exited.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        while running(pid) && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        assert!(!running(pid), "an exited, unreaped child is a zombie");
        child.wait().expect("reap");
    }

    #[test]
    fn a_relative_path_is_resolved_in_the_processs_directory() {
        let mut open = LibOpen::zeroed();
        open.pid = std::process::id();
        open.fd = -1;
        open.path[..12].copy_from_slice(b"libcudart.so");
        let (path, shown) = resolve(&open, false);
        let cwd = std::env::current_dir().expect("cwd");
        assert_eq!(shown, cwd.join("libcudart.so").display().to_string());
        // tracer's own root: the path itself, which outlives the process.
        assert_eq!(path, cwd.join("libcudart.so"));
    }
}
