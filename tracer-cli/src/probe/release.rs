//! Removing the probes without making anyone wait for the kernel.
//!
//! The kernel removes a uprobe attached through a perf event by waiting out a grace period,
//! one probe at a time under a global lock, from one thread or many: about 0.15 s a probe on
//! kernel 6.18 (the simulated runtime and driver's 51 symbols, entry and return, took 15 s);
//! a uprobe_multi link (probe/multi.rs) waits out one for all of its probes (the same probes
//! and the scheduler tracepoints, 1.8-2.0 s).
//! By then everything recorded is stored and the probes are paused, so nothing needs to wait:
//! a background process holds a copy of each probe's descriptor, this process drops its own
//! (cheap while another copy is open) and goes on, and the background process closes its
//! copies, the last ones, once this process has closed all of its own.

use std::{
    ffi::OsStr,
    os::{fd::RawFd, unix::ffi::OsStrExt as _},
};

/// The descriptors whose last close removes a probe: BPF links and perf events.
const PROBE_DESCRIPTORS: [&[u8]; 2] = [b"anon_inode:bpf_link", b"anon_inode:[perf_event]"];

/// Drops `held` (what holds the probes' descriptors) and has a background process make the
/// kernel's slow removals, in the order that keeps this process from waiting. Where no
/// background process can be made, `held` is dropped here, the slow way.
pub fn drop_in_background<T>(held: T) {
    let Some((probes, highest)) = probe_descriptors() else {
        log::debug!("no list of this process's descriptors: the probes are removed here");
        return drop(held);
    };
    let mut ends = [0 as RawFd; 2];
    // SAFETY: pipe2 writes two descriptors into the two-element array it is given.
    if unsafe { libc::pipe2(ends.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        log::debug!("no pipe: the probes are removed here");
        return drop(held);
    }
    let [read_end, write_end] = ends;
    // SAFETY: the child of a threaded process runs only async-signal-safe calls (fork, close,
    // close_range, prctl, signal, read, _exit) on memory made before the fork, and never returns.
    match unsafe { libc::fork() } {
        -1 => {
            log::debug!("no fork: the probes are removed here");
            close_both(ends);
            drop(held);
        }
        0 => unsafe { close_after_parent(&probes, highest, read_end, write_end) },
        child => {
            // SAFETY: closing a descriptor this function opened; reaping the intermediate
            // child, which exits at once (its own child is adopted and never waited for).
            unsafe {
                libc::close(read_end);
                libc::waitpid(child, std::ptr::null_mut(), 0);
            }
            drop(held);
            // SAFETY: closing the last write end here tells the background process that this
            // process's copies are closed.
            unsafe { libc::close(write_end) };
        }
    }
}

/// The probes' descriptors this process holds, sorted, and the highest descriptor open.
fn probe_descriptors() -> Option<(Vec<RawFd>, RawFd)> {
    let mut probes = Vec::new();
    let mut highest = 0;
    for entry in std::fs::read_dir("/proc/self/fd").ok()? {
        let entry = entry.ok()?;
        let Some(fd) = entry
            .file_name()
            .to_str()
            .and_then(|name| name.parse::<RawFd>().ok())
        else {
            continue;
        };
        highest = highest.max(fd);
        // The listing's own descriptor is gone by now: no link to read.
        let Ok(target) = std::fs::read_link(entry.path()) else {
            continue;
        };
        if PROBE_DESCRIPTORS.contains(&OsStr::as_bytes(target.as_os_str())) {
            probes.push(fd);
        }
    }
    probes.sort_unstable();
    Some((probes, highest))
}

fn close_both(ends: [RawFd; 2]) {
    for fd in ends {
        // SAFETY: closing descriptors this module opened.
        unsafe { libc::close(fd) };
    }
}

/// In the forked child: leaves a grandchild (adopted by init, so nobody need wait for it) that
/// closes everything but the probes at once (the caller's terminal, pipes, database and
/// sockets), then the probes once the parent has dropped its own copies.
///
/// # Safety
/// Called only in the child of `fork`, with `probes` sorted.
unsafe fn close_after_parent(
    probes: &[RawFd],
    highest: RawFd,
    read_end: RawFd,
    write_end: RawFd,
) -> ! {
    // SAFETY (for the block): async-signal-safe system calls only; `probes` was made before
    // the fork and is only read.
    unsafe {
        // The intermediate child exits at once, also when it could not fork: the parent waits
        // for it, so it must not wait for the parent (the parent's closes are then the last).
        if libc::fork() != 0 {
            libc::_exit(0);
        }
        libc::prctl(libc::PR_SET_NAME, c"tracer-detach".as_ptr());
        // The stop signals' handlers are tracer's; here they would stop nothing.
        for signal in [libc::SIGINT, libc::SIGTERM, libc::SIGHUP] {
            libc::signal(signal, libc::SIG_DFL);
        }
        libc::close(write_end);
        for fd in 0..=highest {
            if fd != read_end && probes.binary_search(&fd).is_err() {
                libc::close(fd);
            }
        }
        libc::syscall(libc::SYS_close_range, highest + 1, libc::c_uint::MAX, 0);
        // End of file: the parent has closed its copies (or died).
        let mut byte = 0u8;
        loop {
            let n = libc::read(read_end, (&raw mut byte).cast(), 1);
            if n == 0 || (n < 0 && *libc::__errno_location() != libc::EINTR) {
                break;
            }
        }
        for &fd in probes {
            libc::close(fd);
        }
        libc::_exit(0)
    }
}
