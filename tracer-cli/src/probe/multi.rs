//! The uprobe programs as uprobe_multi links (Linux >= 6.6): one link per program and library
//! holds all of its probes, and closing it removes them after one grace period.
//!
//! Through perf events (aya 0.14's only way) each probe is removed on its own, a grace period
//! each under the kernel's global trace-event lock: a library's hundred probes took 15 s here,
//! during which no tracer, perf or bpftrace on the machine could create a probe. aya 0.14 cannot
//! load a program for such links (it sets no expected attach type on uprobes), so the programs
//! are relocated against the maps aya created (aya-obj) and loaded here; on an older kernel,
//! which refuses the attach type, the caller loads them through aya as before.

use std::{
    collections::{BTreeMap, HashSet},
    ffi::CString,
    os::{
        fd::{AsFd as _, AsRawFd as _, BorrowedFd, FromRawFd as _, OwnedFd, RawFd},
        unix::ffi::OsStrExt as _,
    },
    path::Path,
};

use anyhow::{anyhow, Context as _, Result};
use aya::{maps::Map, Ebpf};
use aya_obj::generated::{bpf_attach_type, bpf_insn, bpf_prog_info, bpf_prog_type};

const BPF_PROG_LOAD: libc::c_long = 5;
const BPF_OBJ_GET_INFO_BY_FD: libc::c_long = 15;
const BPF_LINK_CREATE: libc::c_long = 28;
/// `uprobe_multi.flags`: every offset is a return probe.
const BPF_F_UPROBE_MULTI_RETURN: u32 = 1;
/// The verifier's log kept for an error message, at most.
const LOG_BYTES: usize = 1 << 20;

/// The `prog_load` member of `union bpf_attr`, as far as it is used (the kernel reads the
/// fields past the size given as zero).
#[repr(C)]
#[derive(Default)]
struct ProgLoad {
    prog_type: u32,
    insn_cnt: u32,
    insns: u64,
    license: u64,
    log_level: u32,
    log_size: u32,
    log_buf: u64,
    kern_version: u32,
    prog_flags: u32,
    prog_name: [u8; 16],
    prog_ifindex: u32,
    expected_attach_type: u32,
}

/// The `link_create` member of `union bpf_attr` for a uprobe_multi link.
#[repr(C)]
#[derive(Default)]
struct UprobeMultiLink {
    prog_fd: u32,
    target_fd: u32,
    attach_type: u32,
    flags: u32,
    path: u64,
    offsets: u64,
    ref_ctr_offsets: u64,
    cookies: u64,
    cnt: u32,
    multi_flags: u32,
    pid: u32,
    _pad: u32,
}

/// The `info` member of `union bpf_attr`.
#[repr(C)]
struct ObjInfo {
    bpf_fd: u32,
    info_len: u32,
    info: u64,
}

/// The uprobe programs, loaded for uprobe_multi links, by name.
pub struct Programs {
    /// The object relocated against the maps, for the programs loaded later.
    obj: aya_obj::Object,
    fds: BTreeMap<&'static str, OwnedFd>,
}

/// Why the programs could not be loaded for uprobe_multi links.
pub enum LoadError {
    /// The kernel has no uprobe_multi links (before 6.6): load them the perf-event way.
    Unsupported(anyhow::Error),
    /// It has them, and refused a program: an error of tracer's.
    Refused(anyhow::Error),
}

impl Programs {
    /// Loads `names` from `object` (the object `ebpf` was loaded from), their map references
    /// resolved to `ebpf`'s maps: call it before any map is taken out of `ebpf`.
    pub fn load(
        ebpf: &Ebpf,
        object: &[u8],
        names: &[&'static str],
    ) -> std::result::Result<Programs, LoadError> {
        let mut obj = aya_obj::Object::parse(object)
            .context("parse the eBPF object")
            .map_err(LoadError::Refused)?;
        let fds: std::collections::HashMap<&str, RawFd> = ebpf
            .maps()
            .filter_map(|(name, map)| Some((name, map_fd(map)?.as_raw_fd())))
            .collect();
        let maps: Vec<(String, aya_obj::Map)> = obj.maps.drain().collect();
        let text_sections: HashSet<usize> = obj.functions.keys().map(|(s, _)| *s).collect();
        obj.relocate_maps(
            maps.iter()
                .filter_map(|(name, map)| Some((name.as_str(), *fds.get(name.as_str())?, map))),
            &text_sections,
        )
        .context("resolve the programs' maps")
        .map_err(LoadError::Refused)?;
        obj.relocate_calls(&text_sections)
            .context("link the programs' functions")
            .map_err(LoadError::Refused)?;
        let mut programs = Programs {
            obj,
            fds: BTreeMap::new(),
        };
        for &name in names {
            match programs.load_one(name) {
                Ok(()) => {}
                // The attach type is checked before the verifier runs: refused with no log
                // at the first program, the kernel lacks it.
                Err((e, log)) if programs.fds.is_empty() && log.is_empty() => {
                    return Err(LoadError::Unsupported(e))
                }
                Err((e, log)) => return Err(LoadError::Refused(with_log(e, &log))),
            }
        }
        Ok(programs)
    }

    /// Loads one more program of the object.
    pub fn add(&mut self, name: &'static str) -> Result<()> {
        self.load_one(name).map_err(|(e, log)| with_log(e, &log))
    }

    fn load_one(&mut self, name: &'static str) -> std::result::Result<(), (anyhow::Error, String)> {
        let program = self
            .obj
            .programs
            .get(name)
            .ok_or_else(|| (anyhow!("eBPF object lacks program {name}"), String::new()))?;
        let function = self
            .obj
            .functions
            .get(&program.function_key())
            .ok_or_else(|| (anyhow!("program {name} has no code"), String::new()))?;
        let fd = load_program(name, &function.instructions, &program.license)?;
        self.fds.insert(name, fd);
        Ok(())
    }

    pub fn fd(&self, name: &str) -> Result<BorrowedFd<'_>> {
        self.fds
            .get(name)
            .map(|fd| fd.as_fd())
            .ok_or_else(|| anyhow!("program {name} is not loaded"))
    }

    /// How often program `name` ran and for how long (while BPF statistics are on).
    pub fn runs(&self, name: &str) -> Option<(u64, u64)> {
        let fd = self.fds.get(name)?;
        // SAFETY: bpf_prog_info is plain data; all zeroes is a valid value.
        let mut info: bpf_prog_info = unsafe { std::mem::zeroed() };
        let attr = ObjInfo {
            bpf_fd: fd.as_raw_fd() as u32,
            info_len: std::mem::size_of::<bpf_prog_info>() as u32,
            info: &mut info as *mut bpf_prog_info as u64,
        };
        // SAFETY: the info member of bpf_attr; the kernel writes at most `info_len` bytes into
        // `info`, which lives past the call.
        unsafe { bpf(BPF_OBJ_GET_INFO_BY_FD, &attr) }.ok()?;
        Some((info.run_cnt, info.run_time_ns))
    }
}

/// What one link probes: offsets in one file, each with its cookie and semaphore (0: none).
pub struct Points<'a> {
    pub path: &'a Path,
    pub offsets: &'a [u64],
    pub cookies: &'a [u64],
    pub semaphores: &'a [u64],
    pub retprobe: bool,
    /// One process only, else every process mapping the file.
    pub pid: Option<u32>,
}

/// Links `prog` to every point in one uprobe_multi link (closing it removes them all).
pub fn link(prog: BorrowedFd<'_>, points: &Points<'_>) -> Result<OwnedFd> {
    let n = points.offsets.len();
    if points.cookies.len() != n || (!points.semaphores.is_empty() && points.semaphores.len() != n)
    {
        return Err(anyhow!("a uprobe_multi link's arrays differ in length"));
    }
    let path = CString::new(points.path.as_os_str().as_bytes())
        .with_context(|| format!("{} holds a NUL byte", points.path.display()))?;
    let attr = UprobeMultiLink {
        prog_fd: prog.as_raw_fd() as u32,
        attach_type: bpf_attach_type::BPF_TRACE_UPROBE_MULTI as u32,
        path: path.as_ptr() as u64,
        offsets: points.offsets.as_ptr() as u64,
        ref_ctr_offsets: if points.semaphores.is_empty() {
            0
        } else {
            points.semaphores.as_ptr() as u64
        },
        cookies: points.cookies.as_ptr() as u64,
        cnt: n as u32,
        multi_flags: if points.retprobe {
            BPF_F_UPROBE_MULTI_RETURN
        } else {
            0
        },
        pid: points.pid.unwrap_or(0),
        ..Default::default()
    };
    // SAFETY: the link_create member of bpf_attr; the path and the arrays it points to
    // outlive the call, and the kernel only reads them.
    unsafe { bpf_fd(BPF_LINK_CREATE, &attr) }.map_err(|e| {
        anyhow!(
            "BPF_LINK_CREATE of a uprobe_multi link on {} ({n} offsets): {e}",
            points.path.display()
        )
    })
}

/// Loads one program for uprobe_multi links; on failure the error and the verifier's log.
fn load_program(
    name: &str,
    insns: &[bpf_insn],
    license: &CString,
) -> std::result::Result<OwnedFd, (anyhow::Error, String)> {
    let mut prog_name = [0u8; 16];
    for (dst, src) in prog_name.iter_mut().zip(name.bytes().take(15)) {
        *dst = src;
    }
    let mut attr = ProgLoad {
        prog_type: bpf_prog_type::BPF_PROG_TYPE_KPROBE as u32,
        insn_cnt: insns.len() as u32,
        insns: insns.as_ptr() as u64,
        license: license.as_ptr() as u64,
        prog_name,
        expected_attach_type: bpf_attach_type::BPF_TRACE_UPROBE_MULTI as u32,
        ..Default::default()
    };
    let first = bpf_prog_load(&attr);
    let Err(e) = first else {
        return first.map_err(|e| (e, String::new()));
    };
    // Again with the verifier's log, for the message.
    let mut log = vec![0u8; LOG_BYTES];
    attr.log_level = 1;
    attr.log_size = LOG_BYTES as u32;
    attr.log_buf = log.as_mut_ptr() as u64;
    match bpf_prog_load(&attr) {
        Ok(fd) => Ok(fd),
        Err(_) => {
            let end = log.iter().position(|&b| b == 0).unwrap_or(log.len());
            let text = String::from_utf8_lossy(&log[..end]).into_owned();
            Err((
                e.context(format!("load program {name} for uprobe_multi links")),
                text,
            ))
        }
    }
}

fn bpf_prog_load(attr: &ProgLoad) -> Result<OwnedFd> {
    // SAFETY: the prog_load member of bpf_attr; the instructions and license it points to
    // outlive the call, and the log buffer (written, at most log_size bytes) too.
    unsafe { bpf_fd(BPF_PROG_LOAD, attr) }.map_err(|e| anyhow!("BPF_PROG_LOAD: {e}"))
}

/// bpf(2) with `attr`: its result.
///
/// # Safety
/// `attr` is the `#[repr(C)]` member of `union bpf_attr` that `cmd` reads, zero-padded, and
/// every address in it is of memory that lives past the call and that the kernel may read, or
/// write where `cmd` writes.
pub(super) unsafe fn bpf<T>(cmd: libc::c_long, attr: &T) -> std::io::Result<i64> {
    // SAFETY: as the caller promised; the kernel reads at most size_of::<T>() bytes of `attr`.
    let ret = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            cmd,
            attr as *const T,
            std::mem::size_of::<T>() as u32,
        )
    };
    if ret < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(ret)
}

/// [`bpf`] for a command that returns a new descriptor.
///
/// # Safety
/// As for [`bpf`].
pub(super) unsafe fn bpf_fd<T>(cmd: libc::c_long, attr: &T) -> std::io::Result<OwnedFd> {
    // SAFETY: as the caller promised.
    let fd = unsafe { bpf(cmd, attr) }?;
    // SAFETY: a descriptor the kernel just returned, owned by nobody else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

/// The error with the verifier log's last lines (where it says why), if any.
fn with_log(e: anyhow::Error, log: &str) -> anyhow::Error {
    if log.is_empty() {
        return e;
    }
    let lines: Vec<&str> = log.lines().collect();
    let from = lines.len().saturating_sub(20);
    e.context(format!("verifier: {}", lines[from..].join("\n")))
}

/// The descriptor of any kind of map.
fn map_fd(map: &Map) -> Option<BorrowedFd<'_>> {
    let data = match map {
        Map::Array(d)
        | Map::BloomFilter(d)
        | Map::HashMap(d)
        | Map::LruHashMap(d)
        | Map::PerCpuArray(d)
        | Map::PerCpuHashMap(d)
        | Map::PerCpuLruHashMap(d)
        | Map::PerfEventArray(d)
        | Map::ProgramArray(d)
        | Map::Queue(d)
        | Map::RingBuf(d)
        | Map::Stack(d)
        | Map::StackTraceMap(d)
        | Map::LpmTrie(d)
        | Map::Unsupported(d) => d,
        _ => return None,
    };
    Some(data.fd().as_fd())
}

/// Puts program `prog` in slot `slot` of the program array `map` of `ebpf`.
pub fn set_program_slot(ebpf: &Ebpf, map: &str, slot: u32, prog: BorrowedFd<'_>) -> Result<()> {
    let array = ebpf
        .map(map)
        .and_then(map_fd)
        .ok_or_else(|| anyhow!("eBPF object lacks map {map}"))?;
    let value = prog.as_raw_fd() as u32;
    let attr = MapUpdate {
        map_fd: array.as_raw_fd() as u32,
        _pad: 0,
        key: &slot as *const u32 as u64,
        value: &value as *const u32 as u64,
        flags: 0,
    };
    // SAFETY: the map-element member of bpf_attr; key and value outlive the call.
    unsafe { bpf(BPF_MAP_UPDATE_ELEM, &attr) }
        .map_err(|e| anyhow!("put a program in slot {slot} of {map}: {e}"))?;
    Ok(())
}

const BPF_MAP_UPDATE_ELEM: libc::c_long = 2;

/// The map-element member of `union bpf_attr`.
#[repr(C)]
struct MapUpdate {
    map_fd: u32,
    _pad: u32,
    key: u64,
    value: u64,
    flags: u64,
}
