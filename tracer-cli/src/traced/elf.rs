//! Reading a library's symbol tables: which probed APIs it exports, and at which file offsets.

use std::{collections::BTreeMap, path::Path};

use anyhow::Result;
use object::{
    Object as _, ObjectSection as _, ObjectSegment as _, ObjectSymbol as _, ReadRef, SymbolKind,
};
use tracer_common::{probes::VARIANT_SUFFIXES, Library, Op, PROBES};

use super::safe_file::{self, Bytes};
use crate::exit::user_error;

/// One symbol to attach to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Target {
    pub op: Op,
    pub symbol: String,
    /// File offset of the symbol's first instruction (what a uprobe is placed at).
    pub offset: u64,
}

/// What the symbol tables say about one file.
#[derive(Debug, Default)]
pub struct Symbols {
    pub targets: Vec<Target>,
}

impl Symbols {
    /// Probed APIs of `library` that the file does not export.
    pub fn missing(&self, library: Library) -> Vec<&'static str> {
        PROBES
            .iter()
            .filter(|p| {
                p.library == library
                    && !p.symbol.is_empty()
                    && !self.targets.iter().any(|t| t.op == p.op)
            })
            .map(|p| p.symbol)
            .collect()
    }

    pub fn has_library(&self, library: Library) -> bool {
        self.targets.iter().any(|t| t.op.spec().library == library)
    }
}

/// The op a symbol name stands for: the base name or a per-thread-stream variant of it.
pub fn op_for_symbol(name: &str) -> Option<Op> {
    let name = name.split('@').next().unwrap_or(name);
    PROBES
        .iter()
        .filter(|p| !p.symbol.is_empty())
        .find_map(|p| {
            let rest = name.strip_prefix(p.symbol)?;
            (rest.is_empty() || VARIANT_SUFFIXES.contains(&rest)).then_some(p.op)
        })
}

pub fn read_symbols(path: &Path) -> Result<Symbols> {
    let bytes = safe_file::bytes(path).map_err(|e| {
        user_error(format!(
            "{e:#}: pass a CUDA library such as libcudart.so.12"
        ))
    })?;
    match &bytes {
        Bytes::Mapped(map) => symbols_of(&**map, path),
        Bytes::Read(cache) => symbols_of(cache, path),
    }
}

/// Where a virtual address lies in the file: through the segment holding it (what a uprobe's
/// offset and a USDT semaphore's reference counter need).
pub struct FileOffsets(Vec<(u64, u64, u64)>);

impl FileOffsets {
    pub fn of<'data>(obj: &impl object::Object<'data>) -> FileOffsets {
        FileOffsets(
            obj.segments()
                .map(|s| (s.address(), s.size(), s.file_range().0))
                .collect(),
        )
    }

    /// The file offset of `addr`, None when no segment holds it.
    pub fn of_address(&self, addr: u64) -> Option<u64> {
        self.0
            .iter()
            .find(|(start, size, _)| addr >= *start && addr < start + size)
            .map(|(start, _, off)| addr - start + off)
    }
}

fn symbols_of<'a, R: ReadRef<'a>>(data: R, path: &Path) -> Result<Symbols> {
    if data.read_bytes_at(0, 4).ok() != Some(b"\x7fELF".as_slice()) {
        return Err(user_error(format!(
            "{} is not an ELF file: pass a CUDA library such as libcudart.so.12",
            path.display()
        )));
    }
    let obj = object::File::parse(data).map_err(|e| {
        user_error(format!(
            "{} is not a readable ELF file: {e}",
            path.display()
        ))
    })?;
    let segments = FileOffsets::of(&obj);
    let file_offset = |addr: u64| segments.of_address(addr);
    // Several names may share an address (aliases): one probe per address, first name wins.
    let mut by_offset: BTreeMap<u64, Target> = BTreeMap::new();
    for sym in obj.dynamic_symbols().chain(obj.symbols()) {
        if !sym.is_definition() || sym.kind() != SymbolKind::Text || sym.address() == 0 {
            continue;
        }
        let Ok(name) = sym.name() else { continue };
        let Some(op) = op_for_symbol(name) else {
            continue;
        };
        let Some(offset) = file_offset(sym.address()) else {
            continue;
        };
        by_offset.entry(offset).or_insert_with(|| Target {
            op,
            symbol: name.split('@').next().unwrap_or(name).to_owned(),
            offset,
        });
    }
    let mut targets: Vec<Target> = by_offset.into_values().collect();
    targets.sort_by(|a, b| (a.op, &a.symbol).cmp(&(b.op, &b.symbol)));
    Ok(Symbols { targets })
}

/// Whether a shared library carries PyTorch's own probes: USDT sites of provider `pytorch`
/// (libc10_cuda) or c10::OutOfMemoryError's constructor (libc10). Reads only the section
/// headers, the notes and the dynamic symbols.
pub fn has_torch_probes(path: &Path) -> bool {
    match safe_file::bytes(path) {
        Ok(Bytes::Mapped(map)) => torch_probes_in(&*map),
        Ok(Bytes::Read(cache)) => torch_probes_in(&cache),
        Err(_) => false,
    }
}

fn torch_probes_in<'a, R: ReadRef<'a>>(data: R) -> bool {
    let Ok(obj) = object::File::parse(data) else {
        return false;
    };
    let notes_name_pytorch = obj
        .section_by_name(".note.stapsdt")
        .and_then(|s| s.data().ok())
        .is_some_and(|d| d.windows(8).any(|w| w == b"pytorch\0"));
    notes_name_pytorch
        || obj.dynamic_symbols().any(|s| {
            s.is_definition()
                && s.name().is_ok_and(|name| {
                    op_for_symbol(name).is_some_and(|op| op.spec().library == Library::Torch)
                })
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn variants_map_to_their_base_op() {
        assert_eq!(op_for_symbol("cudaMalloc"), Some(Op::CudaMalloc));
        assert_eq!(
            op_for_symbol("cudaMallocAsync_ptsz"),
            Some(Op::CudaMallocAsync)
        );
        assert_eq!(
            op_for_symbol("cudaMalloc@@libcudart.so.12"),
            Some(Op::CudaMalloc)
        );
        assert_eq!(op_for_symbol("cuMemAlloc_v2"), Some(Op::CuMemAlloc));
        assert_eq!(op_for_symbol("cudaMallocHost"), Some(Op::CudaMallocHost));
        assert_eq!(op_for_symbol("cudaMalloc3D"), None);
        assert_eq!(
            op_for_symbol("cuMemAlloc"),
            None,
            "the 32-bit v1 API is not probed"
        );
    }

    #[test]
    fn not_elf_is_a_clear_error() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("libcudart.so.12");
        std::fs::write(&p, b"hello").unwrap();
        let err = read_symbols(&p).unwrap_err().to_string();
        assert!(err.contains("is not an ELF file"), "{err}");
    }

    #[test]
    fn own_executable_has_no_probed_symbols() {
        let exe = std::env::current_exe().unwrap();
        let symbols = read_symbols(&exe).unwrap();
        assert!(symbols.targets.is_empty());
    }

    #[test]
    fn a_library_truncated_under_the_reader_is_an_error_not_a_crash() {
        use crate::traced::safe_file::truncation::{truncate, writable_elf};
        let dir = tempfile::tempdir().unwrap();
        let lib = writable_elf(dir.path());
        assert!(read_symbols(&lib).is_ok(), "the whole file reads");
        truncate(&lib, 0);
        assert!(read_symbols(&lib).is_err());
        assert!(!has_torch_probes(&lib));
    }
}
