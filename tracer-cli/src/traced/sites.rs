//! Call sites (--stack): the raw stacks the kernel sent, made into frames that stay meaningful
//! after the process exits. Python frames are read from the live process at first sight (once
//! per code object); native addresses become (file, offset) pairs, symbolized by the writer with
//! blazesym (C++ demangled, file:line where debug info exists), once per distinct frame.

use std::{
    collections::{HashMap, HashSet},
    path::{Path, PathBuf},
};

use blazesym::symbolize::{source::Elf, source::Source, Input, Symbolizer};
use tracer_common::PyProcess;

use super::mappings::SharedMappings;
use crate::{
    decode::{NativeStackRef, PyStatus, RawSite},
    store::{StackFrame, StackRow, Store},
    traced::maps::{self, Mapping},
    traced::python,
};

/// A native frame, located in its file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NativeFrame {
    pub addr: u64,
    /// The library or executable as the process mapped it, and where this process can open it.
    pub module: Option<(PathBuf, PathBuf)>,
    /// Offset in the file of the call instruction's last byte (the return address - 1).
    pub offset: u64,
}

/// A call site ready to be stored.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Site {
    pub pid: u32,
    /// Innermost first.
    pub native: Vec<NativeFrame>,
    pub py_status: PyStatus,
    /// Innermost first.
    pub python: Vec<python::Frame>,
}

/// A recording's own call-site ids start here, above any stored id (`stacks.id`): a layout
/// holding both (a process taken up from an earlier session's keyframe) tells them apart.
pub const LOCAL_SITE_BASE: i64 = 1 << 31;

/// Turns raw stacks into sites, each distinct one once.
pub struct Sites {
    finder: python::Finder,
    frames: python::Frames,
    maps: HashMap<u32, Vec<Mapping>>,
    /// Each live process's sites (dropped at its end: a long trace of many processes stays
    /// bounded).
    ids: HashMap<u32, HashMap<RawSite, i64>>,
    next_id: i64,
    /// Processes already looked at for an interpreter, with the executable they ran then (a
    /// process that exec'd, like pyenv's shim becoming python, is looked at again).
    checked: HashMap<u32, Option<PathBuf>>,
    /// Interpreters tracer cannot walk, reported once each.
    reported: HashSet<String>,
    /// Every process's mappings from its start, when the kernel's side band is followed.
    mappings: Option<SharedMappings>,
    /// The native stacks the kernel keeps by id, read once each (ids are never reused in a
    /// session).
    kept: HashMap<i64, Vec<u64>>,
}

/// Reads a native stack the kernel keeps, by id.
pub trait KeptStacks {
    fn get(&mut self, id: i64) -> Option<Vec<u64>>;
}

impl Default for Sites {
    fn default() -> Self {
        Sites {
            finder: python::Finder::new(),
            frames: python::Frames::default(),
            maps: HashMap::new(),
            ids: HashMap::new(),
            next_id: LOCAL_SITE_BASE,
            checked: HashMap::new(),
            reported: HashSet::new(),
            mappings: None,
            kept: HashMap::new(),
        }
    }
}

impl Sites {
    pub fn with_mappings(mappings: Option<SharedMappings>) -> Sites {
        Sites {
            mappings,
            ..Sites::default()
        }
    }

    /// Looks for a CPython interpreter in `pid` (once per process and executable): the kernel's
    /// description of it, to be put in PY_PROCS, when it is one tracer can walk.
    pub fn register(&mut self, pid: u32) -> Option<PyProcess> {
        let exe = std::fs::read_link(format!("/proc/{pid}/exe")).ok();
        if self.checked.get(&pid) == Some(&exe) {
            return None;
        }
        self.checked.insert(pid, exe);
        let found = self.finder.find(pid);
        self.registered(pid, found)
    }

    /// The interpreter in a file `pid` has just mapped (at its exec, or as it loads libpython),
    /// before its program makes a call.
    pub fn register_mapped(&mut self, pid: u32, mapping: &Mapping) -> Option<PyProcess> {
        let found = self.finder.from_mapping(pid, mapping);
        if matches!(found, Ok(Some(_))) {
            let exe = std::fs::read_link(format!("/proc/{pid}/exe")).ok();
            self.checked.insert(pid, exe);
        }
        self.registered(pid, found)
    }

    /// Forgets what was known of `pid`'s interpreter: it replaced its program.
    pub fn exec(&mut self, pid: u32) {
        self.checked.remove(&pid);
        self.frames.forget(pid);
    }

    fn registered(
        &mut self,
        pid: u32,
        found: Result<Option<python::Interpreter>, String>,
    ) -> Option<PyProcess> {
        match found {
            Ok(Some(interp)) => {
                let kernel = interp.kernel;
                log::debug!(
                    "pid {pid}: CPython {}.{} in {}",
                    interp.version.0,
                    interp.version.1,
                    interp.file.display()
                );
                self.frames.register(pid, interp);
                Some(kernel)
            }
            Ok(None) => None,
            Err(why) => {
                if self.reported.insert(why.clone()) {
                    eprintln!("tracer: pid {pid}: no Python frames: {why}");
                }
                None
            }
        }
    }

    /// The id of `raw`'s site in this trace; a site seen for the first time is resolved and
    /// pushed to `new`. A native stack kept by the kernel is read from `kept` at its id's
    /// first sight.
    pub fn intern(
        &mut self,
        pid: u32,
        raw: RawSite,
        kept: &mut dyn KeptStacks,
        new: &mut Vec<(i64, Site)>,
    ) -> i64 {
        if let Some(&id) = self.ids.get(&pid).and_then(|m| m.get(&raw)) {
            return id;
        }
        let id = self.next_id;
        self.next_id += 1;
        let addrs = match &raw.native {
            NativeStackRef::Inline(addrs) => addrs.clone(),
            NativeStackRef::Kept(stack) => self.kept_stack(*stack, kept),
        };
        let site = self.resolve(pid, &addrs, &raw);
        self.ids.entry(pid).or_default().insert(raw, id);
        new.push((id, site));
        id
    }

    fn kept_stack(&mut self, id: i64, kept: &mut dyn KeptStacks) -> Vec<u64> {
        if let Some(addrs) = self.kept.get(&id) {
            return addrs.clone();
        }
        let Some(addrs) = kept.get(id) else {
            // Never: the program keeps a stack before it sends its id, and never deletes one.
            log::warn!("native stack {id} is not in the kernel's map: its frames are missing");
            return Vec::new();
        };
        self.kept.insert(id, addrs.clone());
        addrs
    }

    fn resolve(&mut self, pid: u32, addrs: &[u64], raw: &RawSite) -> Site {
        if let Some(Ok(mut m)) = self.mappings.as_ref().map(|m| m.lock()) {
            // Everything the kernel wrote before this call was made is in the rings now.
            m.drain();
        }
        let mut native = Vec::with_capacity(addrs.len());
        for &addr in addrs {
            let mut located = self.locate(pid, addr);
            if located.is_none() && self.refresh_maps(pid) {
                // A library loaded since the maps were read.
                located = self.locate(pid, addr);
            }
            let maps_known = self.maps.get(&pid).is_some_and(|m| !m.is_empty())
                || self.mappings.as_ref().is_some_and(|m| {
                    m.lock()
                        .is_ok_and(|m| m.complete(pid).is_some_and(|x| !x.is_empty()))
                });
            if located.is_none() && maps_known {
                // Not code: frame-pointer unwinding went astray in a frame built without frame
                // pointers; nothing beyond it is trustworthy.
                break;
            }
            native.push(NativeFrame {
                addr,
                offset: located.as_ref().map_or(0, |(_, off)| off.saturating_sub(1)),
                module: located.map(|(m, _)| {
                    let open = maps::open_path(pid, &m);
                    (m.path, open)
                }),
            });
        }
        Site {
            pid,
            native,
            py_status: raw.py_status,
            python: self.frames.resolve(pid, &raw.py),
        }
    }

    /// Forgets an ended process (its sites, all resolved before its end, stay): a process that
    /// reuses the pid is read afresh.
    pub fn forget_process(&mut self, pid: u32) {
        self.maps.remove(&pid);
        self.ids.remove(&pid);
        if let Some(Ok(mut m)) = self.mappings.as_ref().map(|m| m.lock()) {
            m.forget(pid);
        }
        self.checked.remove(&pid);
        self.frames.forget(pid);
    }

    /// Reads a new process's maps now, while it lives: a short-lived process's call sites may
    /// be resolved after it has exited.
    pub fn first_seen(&mut self, pid: u32) {
        self.refresh_maps(pid);
    }

    /// Reads the process's maps again; keeps those read before when it has exited since (its
    /// last calls' sites are still resolved with them). Whether anything new was read.
    fn refresh_maps(&mut self, pid: u32) -> bool {
        match maps::read(pid) {
            Ok(maps) if !maps.is_empty() => {
                self.maps.insert(pid, maps);
                true
            }
            _ => false,
        }
    }

    fn locate(&mut self, pid: u32, addr: u64) -> Option<(Mapping, u64)> {
        if let Some(mappings) = &self.mappings {
            if let Ok(m) = mappings.lock() {
                if let Some(maps) = m.complete(pid) {
                    return maps::locate(maps, addr).map(|(m, off)| (m.clone(), off));
                }
                if !self.maps.contains_key(&pid) && !alive(pid) {
                    // Gone before its maps were read: what the side band saw is all there is.
                    let maps = m.known(pid)?;
                    return maps::locate(maps, addr).map(|(m, off)| (m.clone(), off));
                }
            }
        }
        let maps = self
            .maps
            .entry(pid)
            .or_insert_with(|| maps::read(pid).unwrap_or_default());
        maps::locate(maps, addr).map(|(m, off)| (m.clone(), off))
    }
}

fn alive(pid: u32) -> bool {
    Path::new(&format!("/proc/{pid}")).exists()
}

/// A symbolized native frame.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NativeSymbol {
    pub function: Option<String>,
    pub file: Option<String>,
    pub line: Option<u32>,
}

/// blazesym over files, cached per (file, offset). blazesym maps what it reads, so a file its
/// owner could truncate under the map (and crash tracer with SIGBUS) is given to it as a
/// private copy.
#[derive(Default)]
pub struct NativeSymbols {
    symbolizer: Symbolizer,
    cache: HashMap<(PathBuf, u64), NativeSymbol>,
    copies: super::safe_file::PrivateCopies,
}

impl NativeSymbols {
    pub fn symbolize(&mut self, open_path: &Path, offset: u64) -> NativeSymbol {
        if let Some(s) = self.cache.get(&(open_path.to_owned(), offset)) {
            return s.clone();
        }
        let Ok(mappable) = self.copies.mappable(open_path) else {
            return NativeSymbol::default();
        };
        let src = Source::Elf(Elf::new(&mappable));
        let sym = self
            .symbolizer
            .symbolize_single(&src, Input::FileOffset(offset))
            .ok()
            .and_then(|s| s.as_sym().cloned().map(|s| s.into_owned()))
            .map(|s| NativeSymbol {
                function: Some(s.name.to_string()),
                file: s.code_info.as_ref().map(|c| {
                    let file = Path::new(&c.file);
                    c.dir
                        .as_ref()
                        .map_or_else(|| file.to_path_buf(), |d| d.join(file))
                        .display()
                        .to_string()
                }),
                line: s.code_info.as_ref().and_then(|c| c.line),
            })
            .unwrap_or_default();
        self.cache
            .insert((open_path.to_owned(), offset), sym.clone());
        sym
    }
}

/// Eval-loop functions of CPython: where the interpreter's frames run.
pub fn is_eval_loop(function: &str) -> bool {
    matches!(
        function,
        "_PyEval_EvalFrameDefault" | "_PyEval_EvalFrame" | "PyEval_EvalFrameEx"
    )
}

/// A site's frames as stored, innermost first: each eval-loop native frame is replaced by the
/// Python frames it was running (up to the next frame entered from C); Python frames the native
/// unwinder did not reach (it stops at the first library built without frame pointers) follow
/// the native ones.
pub fn merged_frames(site: &Site, symbols: &[NativeSymbol]) -> Vec<StackFrame> {
    let mut python = site.python.iter().peekable();
    let py_frame = |p: &python::Frame| StackFrame {
        kind: "python",
        function: Some(p.function.clone()),
        file: Some(p.file.clone()),
        line: p.line.map(i64::from),
        module: None,
        address: None,
    };
    let mut out = Vec::with_capacity(site.native.len() + site.python.len());
    for (frame, sym) in site.native.iter().zip(symbols) {
        if sym.function.as_deref().is_some_and(is_eval_loop) && python.peek().is_some() {
            for p in python.by_ref() {
                out.push(py_frame(p));
                if p.entry {
                    break;
                }
            }
            continue;
        }
        out.push(StackFrame {
            kind: "native",
            function: sym.function.clone(),
            file: sym.file.clone(),
            line: sym.line.map(i64::from),
            module: frame.module.as_ref().map(|(p, _)| p.display().to_string()),
            address: frame.module.as_ref().map(|_| frame.offset),
        });
    }
    out.extend(python.map(py_frame));
    out
}

/// The writer's side: symbolizes new sites' native frames and stores them, remembering which
/// stored id each of the reader's ids became.
#[derive(Default)]
pub struct SiteWriter {
    symbols: NativeSymbols,
    /// Per live process: the stored id of each of the reader's ids.
    stored: HashMap<u32, HashMap<i64, i64>>,
    /// Per live process: sites that differ only in addresses resolving to the same frames are
    /// stored once.
    by_content: HashMap<u32, HashMap<(&'static str, Vec<StackFrame>), i64>>,
}

impl SiteWriter {
    pub fn store(
        &mut self,
        store: &mut Store,
        session: i64,
        sites: &[(i64, Site)],
    ) -> anyhow::Result<()> {
        for (local, site) in sites {
            let symbols: Vec<NativeSymbol> = site
                .native
                .iter()
                .map(|f| match &f.module {
                    Some((_, open)) => self.symbols.symbolize(open, f.offset),
                    None => NativeSymbol::default(),
                })
                .collect();
            let frames = merged_frames(site, &symbols);
            let key = (site.py_status.name(), frames);
            let known = self.by_content.entry(site.pid).or_default();
            let id = match known.get(&key) {
                Some(&id) => id,
                None => {
                    let id = store.insert_stack(
                        session,
                        &StackRow {
                            pid: site.pid,
                            native_depth: site.native.len() as u32,
                            python: site.py_status.name(),
                            frames: &key.1,
                        },
                    )?;
                    known.insert(key, id);
                    id
                }
            };
            self.stored.entry(site.pid).or_default().insert(*local, id);
        }
        Ok(())
    }

    /// The stored id of `pid`'s site `local` (the reader's id).
    pub fn stored_id(&self, pid: u32, local: i64) -> Option<i64> {
        self.stored.get(&pid)?.get(&local).copied()
    }

    /// Forgets an ended process's sites: its calls, all delivered before its end, point at
    /// their stored ids already.
    pub fn forget_process(&mut self, pid: u32) {
        self.stored.remove(&pid);
        self.by_content.remove(&pid);
    }
}
