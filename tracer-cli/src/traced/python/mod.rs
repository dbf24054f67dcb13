//! CPython interpreters in traced processes: where their state is (for the kernel's frame walk)
//! and what their code objects say (file, qualified name, executing line). Everything is read
//! from the process's memory and files; the target's Python is never run.

pub(crate) mod linetable;

use std::{
    collections::HashMap,
    fs::File,
    os::unix::fs::FileExt as _,
    path::{Path, PathBuf},
};

use object::{Object as _, ObjectSegment as _, ObjectSymbol as _};
use tracer_common::{PyOffsets, PyProcess};

use crate::{
    decode::RawPyFrame,
    traced::maps::{self, Mapping},
};

const NONE: u32 = PyOffsets::NONE;

/// Where a code object keeps its name, file and line table.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CodeLayout {
    pub filename: u64,
    pub name: u64,
    /// co_qualname (3.11+).
    pub qualname: Option<u64>,
    pub firstlineno: u64,
    pub linetable: u64,
    /// Start of the bytecode inside the code object (3.11+; 3.10 counts f_lasti instead).
    pub code_adaptive: Option<u64>,
    /// Start of a compact ASCII string's characters.
    pub ascii_data: u64,
}

/// A supported interpreter found in a process.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Interpreter {
    pub version: (u32, u32),
    /// What the kernel needs.
    pub kernel: PyProcess,
    pub code: CodeLayout,
    /// The file holding `_PyRuntime` (python3.X or libpython3.X.so).
    pub file: PathBuf,
}

/// Offsets for 3.10-3.12 (../shared/cpython-notes.md, checked against the pyenv builds); 3.13
/// reads its own from `_Py_DebugOffsets`, with this as the cross-check.
fn table(version: (u32, u32), pthread_tid: u32) -> Option<(PyOffsets, CodeLayout)> {
    let o = |h, t, native, tid, f1, f2, prev, code, instr, lasti, owner, entry| PyOffsets {
        runtime_interp_head: h,
        interp_threads_head: t,
        tstate_next: 8,
        tstate_native_tid: native,
        tstate_thread_id: tid,
        pthread_tid,
        tstate_frame_1: f1,
        tstate_frame_2: f2,
        frame_previous: prev,
        frame_code: code,
        frame_instr: instr,
        instr_is_lasti: lasti,
        frame_owner: owner,
        frame_is_entry: entry,
    };
    let c = |first, file, name, qual, table, adaptive, ascii| CodeLayout {
        filename: file,
        name,
        qualname: qual,
        firstlineno: first,
        linetable: table,
        code_adaptive: adaptive,
        ascii_data: ascii,
    };
    Some(match version {
        (3, 10) => (
            o(32, 8, NONE, 176, 24, NONE, 24, 32, 96, 1, NONE, NONE),
            c(40, 104, 112, None, 120, None, 48),
        ),
        (3, 11) => (
            o(40, 16, 160, 152, 56, 8, 48, 32, 56, 0, NONE, 68),
            c(72, 112, 120, Some(128), 136, Some(184), 48),
        ),
        (3, 12) => (
            o(40, 72, 144, 136, 56, 0, 8, 0, 56, 0, 70, NONE),
            c(68, 112, 120, Some(128), 136, Some(192), 40),
        ),
        (3, 13) => (
            o(632, 7344, 160, 152, 72, NONE, 8, 0, 56, 0, 70, NONE),
            c(68, 112, 120, Some(128), 136, Some(200), 40),
        ),
        _ => return None,
    })
}

/// A process's memory, read through /proc/PID/mem.
pub struct Memory {
    file: File,
}

impl Memory {
    pub fn open(pid: u32) -> std::io::Result<Memory> {
        Ok(Memory {
            file: File::open(format!("/proc/{pid}/mem"))?,
        })
    }

    pub fn bytes(&self, addr: u64, len: usize) -> Option<Vec<u8>> {
        let mut buf = vec![0u8; len];
        self.file.read_exact_at(&mut buf, addr).ok()?;
        Some(buf)
    }

    pub fn u64(&self, addr: u64) -> Option<u64> {
        let b = self.bytes(addr, 8)?;
        Some(u64::from_le_bytes(b.try_into().ok()?))
    }

    pub fn i32(&self, addr: u64) -> Option<i32> {
        let b = self.bytes(addr, 4)?;
        Some(i32::from_le_bytes(b.try_into().ok()?))
    }
}

/// Bytes of `_Py_DebugOffsets` read: the 8-byte cookie and 70 u64 fields.
const DEBUG_OFFSETS_LEN: usize = 8 + 8 * 70;

/// `_Py_DebugOffsets` (3.13): the interpreter's own description of its layout, at the start of
/// `_PyRuntime` (as the file initialises it). Field positions are those of 3.13's struct (u64
/// each after the 8-byte cookie).
fn debug_offsets(raw: &[u8], pthread_tid: u32) -> Result<(PyOffsets, CodeLayout), String> {
    if raw.len() < DEBUG_OFFSETS_LEN || &raw[..8] != b"xdebugpy" {
        return Err("no _Py_DebugOffsets cookie at _PyRuntime".into());
    }
    let field =
        |i: usize| u64::from_le_bytes(raw[8 + 8 * i..16 + 8 * i].try_into().unwrap_or_default());
    let version = field(0);
    if version >> 16 != 0x030d {
        return Err(format!(
            "_Py_DebugOffsets of version {version:#x}: tracer reads the 3.13 layout"
        ));
    }
    if field(1) != 0 {
        return Err("free-threaded build: not supported".into());
    }
    // Indexes below count u64 fields after the cookie: version, free_threaded, then the
    // runtime, interpreter, thread, frame and code sections.
    let f = |i: usize| u32::try_from(field(i)).unwrap_or(NONE);
    let offsets = PyOffsets {
        runtime_interp_head: f(4),
        interp_threads_head: f(8),
        tstate_next: f(20),
        tstate_native_tid: f(24),
        tstate_thread_id: f(23),
        pthread_tid,
        tstate_frame_1: f(22),
        tstate_frame_2: NONE,
        frame_previous: f(28),
        frame_code: f(29),
        frame_instr: f(30),
        instr_is_lasti: 0,
        frame_owner: f(32),
        frame_is_entry: NONE,
    };
    let code = CodeLayout {
        filename: field(34),
        name: field(35),
        qualname: Some(field(36)),
        linetable: field(37),
        firstlineno: field(38),
        code_adaptive: Some(field(42)),
        ascii_data: field(69),
    };
    Ok((offsets, code))
}

/// Offset of the kernel tid in glibc's `struct pthread` (what pthread_self() points to): found
/// in this process, in two threads, as the one slot holding each thread's own tid.
pub fn pthread_tid_offset() -> Option<u32> {
    fn candidates() -> Vec<usize> {
        // SAFETY: no preconditions.
        let tid = unsafe { libc::gettid() } as u32;
        // SAFETY: pthread_self() is this thread's descriptor, which glibc keeps mapped for the
        // thread's life; the reads stay within its first 2 KiB (struct pthread is larger).
        let base = unsafe { libc::pthread_self() } as *const u8;
        (0..2048)
            .step_by(4)
            // SAFETY: as above.
            .filter(|&off| unsafe { std::ptr::read_unaligned(base.add(off).cast::<u32>()) } == tid)
            .collect()
    }
    let a = std::thread::spawn(candidates).join().ok()?;
    let b = std::thread::spawn(candidates).join().ok()?;
    let common: Vec<usize> = a.into_iter().filter(|o| b.contains(o)).collect();
    match common.as_slice() {
        [one] => u32::try_from(*one).ok(),
        _ => None,
    }
}

/// What an ELF file says of the interpreter in it: where `_PyRuntime` is linked, the version
/// (`Py_Version`, 3.11+), the start of `_PyRuntime` as the file initialises it (3.13's
/// `_Py_DebugOffsets`), and its loadable segments (to turn a mapping's start into the load
/// bias). All read from the file: nothing of a process's memory is needed.
#[derive(Clone, Debug, Default)]
struct PyElf {
    runtime: u64,
    version_hex: Option<u64>,
    runtime_head: Vec<u8>,
    /// (virtual address, file offset) of each PT_LOAD segment.
    segments: Vec<(u64, u64)>,
}

impl PyElf {
    /// The load bias of a mapping of this file that starts at `start` with file offset `offset`.
    fn bias(&self, start: u64, offset: u64) -> Option<u64> {
        let (vaddr, file_off) = self
            .segments
            .iter()
            .filter(|(_, o)| *o & !0xfff <= offset)
            .max_by_key(|(_, o)| *o)?;
        // The segment's address at the mapping's offset (which may precede the segment's own
        // offset within its page, or follow it where the mapping was split).
        let vaddr_at = vaddr.wrapping_add(offset.wrapping_sub(*file_off));
        Some(start.wrapping_sub(vaddr_at & !0xfff))
    }
}

fn read_py_elf(path: &Path) -> Option<PyElf> {
    // Bounded reads of a file a user may own (never a map their truncation could fault).
    match crate::traced::safe_file::bytes(path).ok()? {
        crate::traced::safe_file::Bytes::Mapped(map) => py_elf_of(&*map),
        crate::traced::safe_file::Bytes::Read(cache) => py_elf_of(&cache),
    }
}

fn py_elf_of<'a, R: object::ReadRef<'a>>(data: R) -> Option<PyElf> {
    let file = object::File::parse(data).ok()?;
    let (mut runtime, mut version_at) = (None, None);
    for sym in file
        .dynamic_symbols()
        .chain(file.symbols())
        .filter(|s| s.is_definition())
    {
        match sym.name() {
            Ok("_PyRuntime") => runtime = Some(sym.address()),
            Ok("Py_Version") => version_at = Some(sym.address()),
            _ => {}
        }
    }
    let runtime = runtime?;
    // The file bytes at a virtual address, from the segment holding them.
    let at = |addr: u64, len: u64| -> Option<&'a [u8]> {
        let seg = file.segments().find(|s| {
            let (_, file_size) = s.file_range();
            addr >= s.address() && addr.saturating_add(len) <= s.address().saturating_add(file_size)
        })?;
        let (off, _) = seg.file_range();
        data.read_bytes_at(off.checked_add(addr - seg.address())?, len)
            .ok()
    };
    Some(PyElf {
        runtime,
        version_hex: version_at
            .and_then(|a| at(a, 8))
            .and_then(|b| Some(u64::from_le_bytes(b.try_into().ok()?))),
        runtime_head: at(runtime, DEBUG_OFFSETS_LEN as u64)
            .map(<[u8]>::to_vec)
            .unwrap_or_default(),
        segments: file
            .segments()
            .map(|s| (s.address(), s.file_range().0))
            .collect(),
    })
}

/// "3.11" from ".../libpython3.11.so.1.0" or ".../python3.11".
fn version_from_path(path: &Path) -> Option<(u32, u32)> {
    let name = path.file_name()?.to_str()?;
    let rest = name.split("python").nth(1)?;
    let mut parts = rest.split('.');
    let major = parts.next()?.parse().ok()?;
    let minor: String = parts
        .next()?
        .chars()
        .take_while(char::is_ascii_digit)
        .collect();
    Some((major, minor.parse().ok()?))
}

/// Finds CPython interpreters, caching what each file's symbols say.
#[derive(Default)]
pub struct Finder {
    /// By file identity (device, inode), not path: a path may name another file by now.
    elves: HashMap<(u64, u64), Option<PyElf>>,
    pthread_tid: Option<u32>,
}

impl Finder {
    pub fn new() -> Finder {
        Finder {
            elves: HashMap::new(),
            pthread_tid: pthread_tid_offset(),
        }
    }

    /// The interpreter of `pid`: Ok(None) when it runs no CPython, Err(why) when it runs one
    /// tracer cannot walk.
    pub fn find(&mut self, pid: u32) -> Result<Option<Interpreter>, String> {
        // A process that is gone or not ours to read runs no interpreter we can walk.
        let Ok(maps) = maps::read(pid) else {
            return Ok(None);
        };
        let mut seen = std::collections::HashSet::new();
        for m in &maps {
            if !crate::traced::mappings::looks_like_python(&m.path)
                || !m.executable
                || !seen.insert(m.path.clone())
            {
                continue;
            }
            if let Some(interp) = self.from_mapping(pid, m)? {
                return Ok(Some(interp));
            }
        }
        Ok(None)
    }

    /// The interpreter in the file `pid` mapped as `m` (an executable mapping), if that file
    /// holds one: read from the file alone, so it works from the moment the file is mapped.
    pub fn from_mapping(&mut self, pid: u32, m: &Mapping) -> Result<Option<Interpreter>, String> {
        let elf = match self.elves.get(&(m.dev, m.inode)) {
            Some(elf) => elf.clone(),
            None => {
                let elf = read_py_elf(&maps::path_in(pid, &m.path));
                self.elves.insert((m.dev, m.inode), elf.clone());
                elf
            }
        };
        let Some(elf) = elf else { return Ok(None) };
        let bias = elf
            .bias(m.start, m.offset)
            .ok_or_else(|| format!("{}: no segment at the mapped offset", m.path.display()))?;
        let runtime = bias.wrapping_add(elf.runtime);
        let version = match elf.version_hex {
            Some(hex) => (((hex >> 24) & 0xff) as u32, ((hex >> 16) & 0xff) as u32),
            None => version_from_path(&m.path)
                .ok_or_else(|| format!("unknown CPython version in {}", m.path.display()))?,
        };
        let pthread_tid = self.pthread_tid.unwrap_or(NONE);
        let (offsets, code) = if version >= (3, 13) {
            let (o, c) = debug_offsets(&elf.runtime_head, pthread_tid)?;
            if version == (3, 13) && Some((o, c)) != table(version, pthread_tid) {
                log::debug!("3.13 debug offsets differ from the table: using the interpreter's");
            }
            (o, c)
        } else {
            table(version, pthread_tid).ok_or_else(|| {
                format!(
                    "CPython {}.{} in {}: tracer walks 3.10-3.13 frames; native stacks still work",
                    version.0,
                    version.1,
                    m.path.display()
                )
            })?
        };
        if offsets.tstate_native_tid == NONE && offsets.pthread_tid == NONE {
            return Err(
                "cannot find the tid inside glibc's struct pthread (needed for 3.10)".into(),
            );
        }
        Ok(Some(Interpreter {
            version,
            kernel: PyProcess {
                runtime,
                offsets,
                version: (version.0 << 8) | version.1,
                _pad: 0,
            },
            code,
            file: m.path.clone(),
        }))
    }
}

/// A code object, read once.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Code {
    pub filename: String,
    pub qualname: String,
    pub first_line: i32,
    linetable: Vec<u8>,
    /// Address of the first instruction (3.11+).
    code_start: Option<u64>,
    version: (u32, u32),
}

impl Code {
    /// The executing line of a frame of this code.
    pub fn line(&self, instr: u64) -> Option<i32> {
        match self.code_start {
            // 3.11+: the instruction pointer, in 2-byte code units from the start.
            Some(start) => {
                let units = instr.checked_sub(start)? / 2;
                linetable::line_from_locations(&self.linetable, self.first_line, units)
            }
            // 3.10: f_lasti counts code units; the table counts bytes.
            None if self.version == (3, 10) => {
                linetable::line_from_linetable_310(&self.linetable, self.first_line, instr * 2)
            }
            None => None,
        }
    }
}

/// Reads a str object (compact ASCII or compact 1/2/4-byte kinds).
fn read_str(mem: &Memory, addr: u64, ascii_data: u64) -> Option<String> {
    let len = mem.u64(addr + 16)? as usize;
    if len > 4096 {
        return None;
    }
    let state = mem.i32(addr + 32)? as u32;
    let kind = (state >> 2) & 7;
    let ascii = state & (1 << 6) != 0;
    if ascii {
        return String::from_utf8(mem.bytes(addr + ascii_data, len)?).ok();
    }
    // PyCompactUnicodeObject: utf8_length and utf8 follow the ASCII header (and wstr_length
    // before 3.12, whose header still has wstr).
    let data = addr + ascii_data + if ascii_data == 48 { 24 } else { 16 };
    let raw = mem.bytes(data, len * kind.max(1) as usize)?;
    Some(match kind {
        1 => raw.iter().map(|&b| char::from(b)).collect(),
        2 => String::from_utf16_lossy(
            &raw.chunks_exact(2)
                .map(|c| u16::from_le_bytes([c[0], c[1]]))
                .collect::<Vec<_>>(),
        ),
        4 => raw
            .chunks_exact(4)
            .filter_map(|c| char::from_u32(u32::from_le_bytes([c[0], c[1], c[2], c[3]])))
            .collect(),
        _ => return None,
    })
}

pub fn read_code(mem: &Memory, interp: &Interpreter, addr: u64) -> Option<Code> {
    let l = &interp.code;
    let filename = read_str(mem, mem.u64(addr + l.filename)?, l.ascii_data)?;
    let qualname = read_str(
        mem,
        mem.u64(addr + l.qualname.unwrap_or(l.name))?,
        l.ascii_data,
    )?;
    let first_line = mem.i32(addr + l.firstlineno)?;
    // co_linetable is a bytes object: ob_size at 16, data at 32.
    let table = mem.u64(addr + l.linetable)?;
    let table_len = mem.u64(table + 16)? as usize;
    if table_len > 1 << 20 {
        return None;
    }
    Some(Code {
        filename,
        qualname,
        first_line,
        linetable: mem.bytes(table + 32, table_len)?,
        code_start: l.code_adaptive.map(|off| addr + off),
        version: interp.version,
    })
}

/// A resolved Python frame.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Frame {
    pub file: String,
    pub function: String,
    pub line: Option<i32>,
    /// Entered from C (native frames separate it from the next outer frame).
    pub entry: bool,
}

/// Symbolizes the Python frames of registered processes, reading each code object once.
#[derive(Default)]
pub struct Frames {
    processes: HashMap<u32, (Interpreter, Option<Memory>)>,
    codes: HashMap<(u32, u64), Option<Code>>,
}

impl Frames {
    /// Forgets an ended process: its memory handle and the code objects read from it.
    pub fn forget(&mut self, pid: u32) {
        self.processes.remove(&pid);
        self.codes.retain(|(p, _), _| *p != pid);
    }

    pub fn register(&mut self, pid: u32, interp: Interpreter) {
        let mem = Memory::open(pid).ok();
        self.processes.insert(pid, (interp, mem));
        self.codes.retain(|(p, _), _| *p != pid);
    }

    pub fn resolve(&mut self, pid: u32, raw: &[RawPyFrame]) -> Vec<Frame> {
        let Some((interp, mem)) = self.processes.get(&pid) else {
            return Vec::new();
        };
        raw.iter()
            .map(|f| {
                let code = self
                    .codes
                    .entry((pid, f.code))
                    .or_insert_with(|| mem.as_ref().and_then(|m| read_code(m, interp, f.code)));
                match code {
                    Some(c) => Frame {
                        file: c.filename.clone(),
                        function: c.qualname.clone(),
                        line: c.line(f.instr),
                        entry: f.entry,
                    },
                    None => Frame {
                        file: "<unreadable>".into(),
                        function: format!("<code {:#x}>", f.code),
                        line: None,
                        entry: f.entry,
                    },
                }
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_from_file_names() {
        assert_eq!(
            version_from_path(Path::new("/x/libpython3.11.so.1.0")),
            Some((3, 11))
        );
        assert_eq!(
            version_from_path(Path::new("/usr/bin/python3.10")),
            Some((3, 10))
        );
        assert_eq!(version_from_path(Path::new("/usr/bin/python3")), None);
    }

    #[test]
    fn pthread_tid_offset_is_found_in_this_process() {
        let off = pthread_tid_offset().expect("glibc keeps the tid in struct pthread");
        assert!(off > 0 && off < 2048 && off.is_multiple_of(4), "{off}");
    }
}
