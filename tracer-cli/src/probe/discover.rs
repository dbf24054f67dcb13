//! Finding the CUDA libraries to probe: those mapped by running processes (through
//! /proc/PID/root, so containers work), the usual install places, and executables that link
//! the runtime statically. Files are identified by device and inode, so each is probed once.

use std::{
    collections::{BTreeMap, BTreeSet, HashSet},
    os::unix::fs::MetadataExt as _,
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::Result;

use crate::{exit::user_error, traced::maps};

/// (device, inode): the identity of a file, whatever path reaches it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct FileId {
    pub dev: u64,
    pub ino: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Origin {
    /// Given with --lib.
    Explicit,
    /// Mapped by a running process.
    Mapped,
    /// Found in an install location.
    Installed,
    /// An executable with the runtime linked in.
    Static,
    /// Opened by a process, as the kernel told (probe/libwatch.rs).
    Opened,
}

impl Origin {
    pub fn name(self) -> &'static str {
        match self {
            Origin::Explicit => "--lib",
            Origin::Mapped => "mapped",
            Origin::Installed => "installed",
            Origin::Static => "static",
            Origin::Opened => "opened",
        }
    }
}

#[derive(Clone, Debug)]
pub struct Candidate {
    /// A path this process can open (through /proc/PID/root for mapped files).
    pub open_path: PathBuf,
    /// The path as its users see it.
    pub shown: String,
    pub id: FileId,
    pub origin: Origin,
    /// Processes seen mapping or running it.
    pub pids: BTreeSet<u32>,
}

/// libcudart.so.12, libcudart-abc123.so.11.0 (bundled in wheels), libcuda.so.1.
pub fn is_cuda_library_name(name: &str) -> bool {
    (name.starts_with("libcudart") && name.contains(".so")) || name.starts_with("libcuda.so")
}

pub fn file_id(path: &Path) -> Option<FileId> {
    let meta = std::fs::metadata(path).ok()?;
    meta.is_file().then(|| FileId {
        dev: meta.dev(),
        ino: meta.ino(),
    })
}

fn add(
    found: &mut BTreeMap<FileId, Candidate>,
    open_path: PathBuf,
    shown: String,
    origin: Origin,
    pid: Option<u32>,
) {
    let Some(id) = file_id(&open_path) else {
        return;
    };
    let entry = found.entry(id).or_insert_with(|| Candidate {
        open_path,
        shown,
        id,
        origin,
        pids: BTreeSet::new(),
    });
    entry.origin = entry.origin.min(origin);
    entry.pids.extend(pid);
}

pub fn all_pids() -> Vec<u32> {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    dir.filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
        .collect()
}

/// What was learned of files once: whether an executable links the CUDA runtime statically, and
/// whether a library carries PyTorch's probes.
#[derive(Default)]
pub struct FileCache {
    statics: BTreeMap<FileId, bool>,
    torch: BTreeMap<FileId, bool>,
}

/// Libraries mapped by `pids` (CUDA's, and those with PyTorch's probes), and their executables
/// when those export the runtime (static).
pub fn scan_processes(pids: &[u32], cache: &mut FileCache) -> Vec<Candidate> {
    let me = std::process::id();
    let mut found = BTreeMap::new();
    for &pid in pids {
        if pid == me {
            continue;
        }
        let proc_dir = PathBuf::from(format!("/proc/{pid}"));
        let Ok(maps) = maps::read(pid) else {
            continue;
        };
        let root = proc_dir.join("root");
        let mut seen = BTreeSet::new();
        for m in maps.iter().filter(|m| !m.deleted) {
            if !seen.insert(&m.path) {
                continue;
            }
            let name = m.path.file_name().and_then(|n| n.to_str()).unwrap_or("");
            let open_path = root.join(m.path.strip_prefix("/").unwrap_or(&m.path));
            let mut torch = || {
                name.contains(".so")
                    && file_id(&open_path).is_some_and(|id| {
                        *cache
                            .torch
                            .entry(id)
                            .or_insert_with(|| crate::traced::elf::has_torch_probes(&open_path))
                    })
            };
            if is_cuda_library_name(name) || torch() {
                add(
                    &mut found,
                    open_path,
                    m.path.display().to_string(),
                    Origin::Mapped,
                    Some(pid),
                );
            }
        }
        let exe = proc_dir.join("exe");
        if let (Some(id), Ok(target)) = (file_id(&exe), std::fs::read_link(&exe)) {
            let is_static = *cache
                .statics
                .entry(id)
                .or_insert_with(|| exports_runtime(&exe));
            if is_static {
                add(
                    &mut found,
                    exe.clone(),
                    target.display().to_string(),
                    Origin::Static,
                    Some(pid),
                );
            }
        }
    }
    found.into_values().collect()
}

/// An executable that defines cudaMalloc itself links the runtime statically.
fn exports_runtime(exe: &Path) -> bool {
    // Bound the work: huge binaries (browsers, language runtimes) are not CUDA programs' norm,
    // but a 2 GiB limit still admits large statically linked trainers.
    if std::fs::metadata(exe)
        .map(|m| m.len() > (2 << 30))
        .unwrap_or(true)
    {
        return false;
    }
    crate::traced::elf::read_symbols(exe)
        .map(|s| {
            s.targets
                .iter()
                .any(|t| t.op == tracer_common::Op::CudaMalloc)
        })
        .unwrap_or(false)
}

/// Expands `*` inside path components (no recursion).
fn expand(pattern: &str) -> Vec<PathBuf> {
    let mut paths = vec![PathBuf::from("/")];
    for part in pattern.trim_start_matches('/').split('/') {
        let mut next = Vec::new();
        for base in &paths {
            if let Some((prefix, suffix)) = part.split_once('*') {
                let Ok(dir) = std::fs::read_dir(base) else {
                    continue;
                };
                let mut names: Vec<String> = dir
                    .filter_map(|e| e.ok()?.file_name().into_string().ok())
                    .filter(|n| {
                        n.starts_with(prefix)
                            && n.ends_with(suffix)
                            && n.len() >= prefix.len() + suffix.len()
                    })
                    .collect();
                names.sort();
                next.extend(names.into_iter().map(|n| base.join(n)));
            } else {
                let p = base.join(part);
                if p.exists() {
                    next.push(p);
                }
            }
        }
        paths = next;
    }
    paths
}

/// Folders where CUDA runtimes are installed: CUDA toolkits, pip wheels (system, user, pyenv,
/// conda), and the dynamic linker's cache.
pub fn install_dirs(homes: &[PathBuf]) -> Vec<PathBuf> {
    let mut patterns: Vec<String> = [
        "/usr/local/cuda*/lib64",
        "/usr/local/cuda*/targets/*/lib",
        "/usr/lib/x86_64-linux-gnu",
        "/usr/lib64",
        "/usr/lib/wsl/lib",
        "/opt/conda/lib",
        "/opt/conda/envs/*/lib",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let mut site_roots: Vec<String> = vec![
        "/usr/lib/python3*".into(),
        "/usr/local/lib/python3*".into(),
        "/opt/conda/lib/python3*".into(),
        "/opt/conda/envs/*/lib/python3*".into(),
    ];
    for home in homes {
        let h = home.display();
        site_roots.push(format!("{h}/.local/lib/python3*"));
        site_roots.push(format!("{h}/.pyenv/versions/*/lib/python3*"));
        site_roots.push(format!("{h}/miniconda3/lib/python3*"));
        site_roots.push(format!("{h}/anaconda3/lib/python3*"));
        site_roots.push(format!("{h}/.venv/lib/python3*"));
    }
    for root in site_roots {
        for site in ["site-packages", "dist-packages"] {
            patterns.push(format!("{root}/{site}/nvidia/*/lib"));
            patterns.push(format!("{root}/{site}/torch/lib"));
        }
    }
    let mut dirs: Vec<PathBuf> = patterns.iter().flat_map(|p| expand(p)).collect();
    dirs.sort();
    dirs.dedup();
    dirs
}

/// Libraries listed by `ldconfig -p` (the system binary; no target code is run).
fn ldconfig_libraries() -> Vec<PathBuf> {
    let Ok(out) = Command::new("ldconfig").arg("-p").output() else {
        return Vec::new();
    };
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| {
            let (name, path) = l.trim().split_once(" => ")?;
            is_cuda_library_name(name.split_whitespace().next()?)
                .then(|| PathBuf::from(path.trim()))
        })
        .collect()
}

pub fn scan_installed(homes: &[PathBuf]) -> Vec<Candidate> {
    let mut paths = ldconfig_libraries();
    for dir in install_dirs(homes) {
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        paths.extend(
            entries
                .flatten()
                .filter(|e| e.file_name().to_str().is_some_and(is_cuda_library_name))
                .map(|e| e.path()),
        );
    }
    let mut found = BTreeMap::new();
    for path in paths {
        add(
            &mut found,
            path.clone(),
            path.display().to_string(),
            Origin::Installed,
            None,
        );
    }
    found.into_values().collect()
}

/// Finds libraries to probe, now and during the trace.
pub struct Scanner {
    explicit: Vec<Candidate>,
    pids: Option<Vec<u32>>,
    homes: Vec<PathBuf>,
    cache: FileCache,
    seen: HashSet<FileId>,
    ticks: u64,
}

impl Scanner {
    pub fn new(
        explicit: Vec<Candidate>,
        pids: Option<Vec<u32>>,
        who: &crate::paths::Invoker,
    ) -> Self {
        let mut homes: Vec<PathBuf> = who.home.iter().cloned().collect();
        if let Some(h) = std::env::var_os("HOME").map(PathBuf::from) {
            if !homes.contains(&h) {
                homes.push(h);
            }
        }
        Scanner {
            explicit,
            pids,
            homes,
            cache: FileCache::default(),
            seen: HashSet::new(),
            ticks: 0,
        }
    }

    /// Marks a file found elsewhere (a process opening it): no scan returns it again. False
    /// when a scan already had.
    pub fn mark_seen(&mut self, id: FileId) -> bool {
        self.seen.insert(id)
    }

    /// Candidates not returned before. With --lib, only those; with --pid, only what those map.
    pub fn scan(&mut self, first: bool) -> Vec<Candidate> {
        self.ticks += 1;
        let mut found = Vec::new();
        if !self.explicit.is_empty() {
            if first {
                found = self.explicit.clone();
            }
        } else {
            let pids = self.pids.clone().unwrap_or_else(all_pids);
            found.extend(scan_processes(&pids, &mut self.cache));
            // Installed copies change rarely: look every 30 s, and not when scoped to pids.
            if self.pids.is_none() && (first || self.ticks.is_multiple_of(30)) {
                found.extend(scan_installed(&self.homes));
            }
        }
        found.retain(|c| self.seen.insert(c.id));
        found
    }
}

/// The --lib files, checked: each must exist and export at least one probed call or carry
/// PyTorch's probes.
pub fn explicit_libraries(libs: &[PathBuf]) -> Result<Vec<Candidate>> {
    let mut out = Vec::new();
    for path in libs {
        let id = file_id(path).ok_or_else(|| {
            user_error(format!(
                "--lib {}: no such file (pass the path of libcudart.so.* or libcuda.so.*)",
                path.display()
            ))
        })?;
        let symbols = crate::traced::elf::read_symbols(path)
            .map_err(|e| user_error(format!("--lib {}: {e:#}", path.display())))?;
        if symbols.targets.is_empty() && !crate::traced::elf::has_torch_probes(path) {
            return Err(user_error(format!(
                "--lib {}: the file exports none of the probed CUDA calls (cudaMalloc, cuMemAlloc_v2, ...) and has no PyTorch probes: pass libcudart.so.*, libcuda.so.* or libc10_cuda.so",
                path.display()
            )));
        }
        let open_path = path.canonicalize().unwrap_or_else(|_| path.clone());
        out.push(Candidate {
            shown: open_path.display().to_string(),
            open_path,
            id,
            origin: Origin::Explicit,
            pids: Default::default(),
        });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn library_names() {
        assert!(is_cuda_library_name("libcudart.so.12"));
        assert!(is_cuda_library_name("libcudart.so"));
        assert!(is_cuda_library_name("libcudart-d0da41ae.so.11.0"));
        assert!(is_cuda_library_name("libcuda.so.1"));
        assert!(!is_cuda_library_name("libcudnn.so.8"));
        assert!(!is_cuda_library_name("libcudart_static.a"));
        assert!(!is_cuda_library_name("libcuda_wrapper.py"));
    }

    #[test]
    fn expands_wildcards_per_component() {
        let dir = tempfile::tempdir().unwrap();
        for sub in ["a1/lib", "a2/lib", "b/lib"] {
            std::fs::create_dir_all(dir.path().join(sub)).unwrap();
        }
        let found = expand(&format!("{}/a*/lib", dir.path().display()));
        assert_eq!(
            found,
            vec![dir.path().join("a1/lib"), dir.path().join("a2/lib")]
        );
    }

    #[test]
    fn same_file_through_two_paths_is_one_candidate() {
        let dir = tempfile::tempdir().unwrap();
        let lib = dir.path().join("libcudart.so.12");
        std::fs::write(&lib, b"x").unwrap();
        std::os::unix::fs::symlink(&lib, dir.path().join("libcudart.so")).unwrap();
        let mut found = BTreeMap::new();
        add(&mut found, lib.clone(), "a".into(), Origin::Installed, None);
        add(
            &mut found,
            dir.path().join("libcudart.so"),
            "b".into(),
            Origin::Mapped,
            Some(7),
        );
        assert_eq!(found.len(), 1);
        let c = found.values().next().unwrap();
        assert_eq!(c.origin, Origin::Mapped);
        assert!(c.pids.contains(&7));
    }
}
