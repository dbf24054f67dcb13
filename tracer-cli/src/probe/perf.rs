//! The two system calls aya 0.14 does not make for us: a uprobe perf event with a reference
//! counter (the USDT semaphore the kernel raises while the probe exists, Linux >= 4.20), and a
//! BPF link on it that carries a cookie (PERF_EVENT_IOC_SET_BPF carries none).

use std::{
    ffi::CString,
    os::{
        fd::{AsRawFd as _, BorrowedFd, FromRawFd as _, OwnedFd},
        unix::ffi::OsStrExt as _,
    },
    path::Path,
};

use anyhow::{anyhow, Context as _, Result};

use crate::perf_event::{PerfEventAttr, PERF_FLAG_FD_CLOEXEC};

/// The `link_create` member of `union bpf_attr` for a perf-event link.
#[repr(C)]
#[derive(Default)]
struct LinkCreate {
    prog_fd: u32,
    target_fd: u32,
    attach_type: u32,
    flags: u32,
    bpf_cookie: u64,
    rest: [u64; 6],
}

const BPF_LINK_CREATE: libc::c_long = 28;
const BPF_PERF_EVENT: u32 = 41;
const PMU_TYPE: &str = "/sys/bus/event_source/devices/uprobe/type";

/// A uprobe at `offset` in `path`, with the u16 semaphore at file offset `ref_ctr` (0: none),
/// in every process (`pid` None) or one.
pub fn uprobe(path: &Path, offset: u64, ref_ctr: u64, pid: Option<u32>) -> Result<OwnedFd> {
    let kind: u32 = std::fs::read_to_string(PMU_TYPE)
        .with_context(|| format!("read {PMU_TYPE}"))?
        .trim()
        .parse()
        .with_context(|| format!("parse {PMU_TYPE}"))?;
    if ref_ctr >= 1 << 32 {
        return Err(anyhow!(
            "semaphore offset {ref_ctr:#x} does not fit the reference counter field"
        ));
    }
    let path_c = CString::new(path.as_os_str().as_bytes())
        .with_context(|| format!("{} holds a NUL byte", path.display()))?;
    let attr = PerfEventAttr {
        kind,
        size: std::mem::size_of::<PerfEventAttr>() as u32,
        // Bit 0 would make it a uretprobe; bits 32-63 hold the reference counter's offset.
        config: ref_ctr << 32,
        config1: path_c.as_ptr() as u64,
        config2: offset,
        ..Default::default()
    };
    let (pid, cpu) = match pid {
        Some(p) => (p as libc::pid_t, -1),
        None => (-1, 0),
    };
    // SAFETY: `attr` is a complete, zero-padded perf_event_attr of the size it declares, and
    // `path_c` outlives the call; the kernel copies both.
    let fd = unsafe {
        libc::syscall(
            libc::SYS_perf_event_open,
            &attr as *const PerfEventAttr,
            pid,
            cpu,
            -1 as libc::c_int,
            PERF_FLAG_FD_CLOEXEC,
        )
    };
    if fd < 0 {
        return Err(anyhow!(
            "perf_event_open of a uprobe at {}+{offset:#x} (semaphore {ref_ctr:#x}): {}",
            path.display(),
            std::io::Error::last_os_error()
        ));
    }
    // SAFETY: a descriptor the kernel just returned, owned by nobody else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

/// Attaches program `prog` to perf event `perf` with `cookie`.
pub fn link(prog: BorrowedFd<'_>, perf: BorrowedFd<'_>, cookie: u64) -> Result<OwnedFd> {
    let attr = LinkCreate {
        prog_fd: prog.as_raw_fd() as u32,
        target_fd: perf.as_raw_fd() as u32,
        attach_type: BPF_PERF_EVENT,
        bpf_cookie: cookie,
        ..Default::default()
    };
    // SAFETY: the link_create member of bpf_attr, zero-padded, holding no address.
    unsafe { super::multi::bpf_fd(BPF_LINK_CREATE, &attr) }
        .map_err(|e| anyhow!("BPF_LINK_CREATE on a uprobe perf event: {e}"))
}
