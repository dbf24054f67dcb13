//! Who called a traced function, where that matters: a cudaEventRecord made by PyTorch's
//! caching allocator (from the library that holds its probes, libc10_cuda.so) keeps a freed
//! block from its pool until the event completes; one made by the program does not. The eBPF
//! program hands over the call's return address; this tells which library it lies in.

use std::collections::{BTreeMap, HashMap};

use crate::{
    probe::discover::{file_id, FileId},
    traced::{elf, maps},
};

/// Executable ranges of one process: (start, end, holds PyTorch's allocator probes).
type Ranges = Vec<(u64, u64, bool)>;

/// Per process, which executable mappings are PyTorch's allocator library; per file, whether
/// it holds the probes (read once).
#[derive(Default)]
pub struct Callers {
    processes: HashMap<u32, Ranges>,
    files: BTreeMap<FileId, bool>,
}

impl Callers {
    /// Whether `addr` in process `pid` lies in a library with PyTorch's allocator probes.
    /// The process's mappings are read again when the address is in none known (a library
    /// loaded since).
    pub fn in_allocator(&mut self, pid: u32, addr: u64) -> bool {
        if addr == 0 {
            return false;
        }
        if let Some(found) = lookup(self.processes.get(&pid), addr) {
            return found;
        }
        let ranges = self.ranges_of(pid);
        let found = lookup(Some(&ranges), addr).unwrap_or(false);
        self.processes.insert(pid, ranges);
        found
    }

    pub fn forget(&mut self, pid: u32) {
        self.processes.remove(&pid);
    }

    fn ranges_of(&mut self, pid: u32) -> Ranges {
        let Ok(maps) = maps::read(pid) else {
            return Vec::new();
        };
        let mut out = Vec::new();
        for m in maps.iter().filter(|m| m.executable) {
            let open = maps::open_path(pid, m);
            let torch = match file_id(&open) {
                Some(id) => *self
                    .files
                    .entry(id)
                    .or_insert_with(|| elf::has_torch_probes(&open)),
                None => false,
            };
            out.push((m.start, m.end, torch));
        }
        out
    }
}

fn lookup(ranges: Option<&Ranges>, addr: u64) -> Option<bool> {
    ranges?
        .iter()
        .find(|(s, e, _)| (*s..*e).contains(&addr))
        .map(|r| r.2)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// This test binary holds no PyTorch probes: an address in its own code is not the
    /// allocator's, and an address in no mapping is not either.
    #[test]
    fn an_address_outside_the_allocators_library_is_not_the_allocators() {
        let mut c = Callers::default();
        let here = an_address_outside_the_allocators_library_is_not_the_allocators as fn() as usize;
        assert!(!c.in_allocator(std::process::id(), here as u64));
        assert!(c.processes.contains_key(&std::process::id()));
        assert!(!c.in_allocator(std::process::id(), 8));
        assert!(!c.in_allocator(std::process::id(), 0));
    }
}
