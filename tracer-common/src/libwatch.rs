//! A CUDA library being opened, seen in the kernel as it happens: the notice that lets
//! discovery probe a library before the process that opens it can call into it (issue 52).
//!
//! The programs watch `openat` system-wide. One whose file's name begins like a probed library
//! (the table below) is remembered at entry and, if the open succeeds, sent to userspace at
//! exit; unless its path is already known (probed), the process is also stopped there
//! (SIGSTOP, delivered before the open returns to it) while userspace attaches, then continued.

/// Bytes of a path kept (a longer one is cut, and still matched by its name if it fits).
pub const PATH_LEN: usize = 256;

/// The beginnings of the file names watched: the CUDA runtime (and the copies wheels bundle,
/// `libcudart-abc123.so.12`), the driver, PyTorch's CUDA allocator (its USDT probes), and the
/// simulated allocator of tracer's demos and tests.
pub const WATCHED: [&[u8]; 4] = [
    b"libcudart",
    b"libcuda.so",
    b"libc10_cuda.so",
    b"libsimtorch",
];

/// The parents whose child is not stopped when it leads its own process group (a job a shell
/// started): a shell with job control would report the stop as the user's (`[1]+ Stopped`) and
/// keep the job in the background after it continues, and sudo and su pass a child's stop on
/// to their own shell. A script's child (`bash -c`, no job control) stays in the script's group
/// and is stopped. Matched against the parent's `comm` (up to its first NUL).
pub const NO_HOLD_PARENTS: [&[u8]; 13] = [
    b"bash", b"zsh", b"fish", b"sh", b"dash", b"ksh", b"mksh", b"tcsh", b"csh", b"sudo", b"su",
    b"doas", b"runuser",
];

/// The beginning of tracer's threads' names: a thread of another tracer (a DaemonSet's beside
/// a user's) is never stopped, or two tracers could each wait for the other to continue them.
pub const TRACER_COMM: &[u8] = b"tracer";

/// Whether a thread's `comm` is one of a tracer's.
#[inline(always)]
pub fn is_tracer_comm(comm: &[u8; 16]) -> bool {
    let mut j = 0usize;
    while j < TRACER_COMM.len() {
        if comm[j] != TRACER_COMM[j] {
            return false;
        }
        j += 1;
    }
    true
}

/// Why a process that opened a watched library was or was not stopped.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Hold {
    /// Its path is one tracer already probed: nothing to wait for.
    Known = 0,
    /// Stopped until userspace has attached and continues it.
    Held = 1,
    /// Not stopped: a job a shell or sudo started (see [`NO_HOLD_PARENTS`]).
    ParentShell = 2,
    /// Not stopped: a debugger traces it (it would see the stop).
    Ptraced = 3,
    /// Not stopped: holding is off (`--no-hold`, or userspace stopped renewing it).
    Off = 4,
    /// Not stopped: it is another tracer.
    Tracer = 5,
}

impl Hold {
    pub fn from_u32(v: u32) -> Option<Hold> {
        Some(match v {
            0 => Hold::Known,
            1 => Hold::Held,
            2 => Hold::ParentShell,
            3 => Hold::Ptraced,
            4 => Hold::Off,
            5 => Hold::Tracer,
            _ => return None,
        })
    }
}

/// One successful open of a watched library (ring [`crate::maps::LIB_OPENS`]).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct LibOpen {
    /// CLOCK_MONOTONIC ns at the open's entry.
    pub ts_ns: u64,
    pub pid: u32,
    pub tid: u32,
    /// The descriptor the open returned (valid while the process is held).
    pub fd: i32,
    /// A [`Hold`].
    pub hold: u32,
    /// The opening thread's name (NUL-padded): the process may be gone when it is read.
    pub comm: [u8; 16],
    /// The path as the process passed it, NUL-terminated (relative to its working directory
    /// when it does not begin with '/').
    pub path: [u8; PATH_LEN],
}

impl LibOpen {
    pub const LEN: usize = core::mem::size_of::<Self>();

    pub const fn zeroed() -> LibOpen {
        LibOpen {
            ts_ns: 0,
            pid: 0,
            tid: 0,
            fd: 0,
            hold: 0,
            comm: [0; 16],
            path: [0; PATH_LEN],
        }
    }

    /// The path's bytes up to its NUL.
    pub fn path_bytes(&self) -> &[u8] {
        let end = self.path.iter().position(|&b| b == 0).unwrap_or(PATH_LEN);
        &self.path[..end]
    }
}

/// Whether `path`'s first `len` bytes name a watched library: its last component begins
/// with one of [`WATCHED`]. The eBPF program and userspace's tests share it; written for the
/// verifier (indices masked to the array, the '/' looked for backwards, one exit per byte).
#[inline(always)]
pub fn is_watched(path: &[u8; PATH_LEN], len: usize) -> bool {
    const MASK: usize = PATH_LEN - 1;
    let len = if len > PATH_LEN { PATH_LEN } else { len };
    let mut base = 0usize;
    let mut k = 0usize;
    while k < PATH_LEN && k < len {
        let i = (len - 1 - k) & MASK;
        if path[i] == b'/' {
            base = i + 1;
            break;
        }
        k += 1;
    }
    let mut w = 0usize;
    while w < WATCHED.len() {
        let prefix = WATCHED[w];
        let mut same = base + prefix.len() <= len;
        let mut j = 0usize;
        while same && j < prefix.len() {
            same = path[(base + j) & MASK] == prefix[j];
            j += 1;
        }
        if same {
            return true;
        }
        w += 1;
    }
    false
}

/// Whether a `comm` (NUL-padded) is one of [`NO_HOLD_PARENTS`].
#[inline(always)]
pub fn is_no_hold_parent(comm: &[u8; 16]) -> bool {
    let mut k = 0usize;
    while k < NO_HOLD_PARENTS.len() {
        let name = NO_HOLD_PARENTS[k];
        let mut same = name.len() < 16 && comm[name.len() % 16] == 0;
        let mut j = 0usize;
        while same && j < name.len() {
            same = comm[j] == name[j];
            j += 1;
        }
        if same {
            return true;
        }
        k += 1;
    }
    false
}

#[cfg(feature = "user")]
// SAFETY: repr(C), only integers and byte arrays; 4+4+4+4 after the u64, then 16 and 256
// bytes: 296 bytes, 8-aligned, no implicit padding.
unsafe impl aya::Pod for LibOpen {}
