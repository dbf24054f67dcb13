//! ARCHITECTURE.md's promise, checked on the sources: every import goes one way. Rooms import
//! only from rooms below them, and no module imports one that imports it back, in tracer-cli
//! and among the eBPF programs. Reads the code with `syn`; needs no root.

use std::{
    collections::{BTreeMap, BTreeSet},
    path::{Path, PathBuf},
};

use syn::visit::Visit;

use crate::common::workspace;

/// tracer-cli's rooms, lowest first: a room imports only from rooms of a lower layer.
const LAYERS: &[&[&str]] = &[
    &["exit", "units", "perf_event"],
    &["paths"],
    &["decode", "model"],
    &["store", "analysis"],
    &["query", "traced"],
    &["probe"],
    &["record"],
    &["present"],
    &["demo", "serve"],
    // The binary's subcommands (main.rs), over the library.
    &["cmd"],
];

/// Test-only modules, which may reach anywhere.
const TEST_ONLY: &[&str] = &["fuzz_tests"];

/// A crate's modules by path (`["record", "session"]`), each with the modules it names.
struct Crate {
    imports: BTreeMap<Vec<String>, BTreeSet<Vec<String>>>,
}

impl Crate {
    /// Reads every module file under `src` (the crate root `root_file`, e.g. lib.rs).
    fn read(src: &Path, root_file: &str) -> Crate {
        let mut files = Vec::new();
        collect_rs(src, &mut files);
        let modules: BTreeMap<Vec<String>, PathBuf> = files
            .into_iter()
            .filter_map(|f| Some((module_path(src, &f, root_file)?, f)))
            .collect();
        let known: BTreeSet<Vec<String>> = modules.keys().cloned().collect();
        let mut imports = BTreeMap::new();
        for (module, file) in &modules {
            let text = std::fs::read_to_string(file).unwrap();
            let ast =
                syn::parse_file(&text).unwrap_or_else(|e| panic!("parse {}: {e}", file.display()));
            let mut paths = Paths {
                module: module.clone(),
                inline: Vec::new(),
                found: BTreeSet::new(),
            };
            paths.visit_file(&ast);
            let named = paths
                .found
                .iter()
                .filter_map(|p| owning_module(p, &known))
                .filter(|m| m != module && !m.starts_with(module))
                .collect();
            imports.insert(module.clone(), named);
        }
        Crate { imports }
    }

    /// The groups of modules that import each other round a cycle (strongly connected
    /// components of more than one module, or a module importing itself), each sorted.
    fn cycles(&self) -> Vec<Vec<String>> {
        let names: Vec<&Vec<String>> = self.imports.keys().collect();
        let index: BTreeMap<&Vec<String>, usize> =
            names.iter().enumerate().map(|(i, m)| (*m, i)).collect();
        let edges: Vec<Vec<usize>> = names
            .iter()
            .map(|m| {
                self.imports[*m]
                    .iter()
                    .filter_map(|n| index.get(n).copied())
                    .collect()
            })
            .collect();
        // Kosaraju: finishing order on the graph, then components on its reverse.
        let mut order = Vec::new();
        let mut seen = vec![false; names.len()];
        for start in 0..names.len() {
            finish_order(start, &edges, &mut seen, &mut order);
        }
        let mut reverse = vec![Vec::new(); names.len()];
        for (from, tos) in edges.iter().enumerate() {
            for &to in tos {
                reverse[to].push(from);
            }
        }
        let mut component = vec![usize::MAX; names.len()];
        let mut groups = Vec::new();
        for &start in order.iter().rev() {
            if component[start] != usize::MAX {
                continue;
            }
            let mut group = Vec::new();
            let mut stack = vec![start];
            component[start] = groups.len();
            while let Some(m) = stack.pop() {
                group.push(names[m].join("::"));
                for &n in &reverse[m] {
                    if component[n] == usize::MAX {
                        component[n] = groups.len();
                        stack.push(n);
                    }
                }
            }
            group.sort();
            groups.push(group);
        }
        groups.into_iter().filter(|g| g.len() > 1).collect()
    }
}

fn finish_order(start: usize, edges: &[Vec<usize>], seen: &mut [bool], order: &mut Vec<usize>) {
    if seen[start] {
        return;
    }
    // Iterative depth-first search: (node, next edge to follow).
    let mut stack = vec![(start, 0)];
    seen[start] = true;
    while let Some((node, next)) = stack.pop() {
        if let Some(&to) = edges[node].get(next) {
            stack.push((node, next + 1));
            if !seen[to] {
                seen[to] = true;
                stack.push((to, 0));
            }
        } else {
            order.push(node);
        }
    }
}

fn collect_rs(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            collect_rs(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// `src/record/session.rs` -> ["record", "session"]; the crate root -> []; None for a file
/// that is not part of the crate's module tree this test reads (main.rs beside lib.rs).
fn module_path(src: &Path, file: &Path, root_file: &str) -> Option<Vec<String>> {
    let rel = file.strip_prefix(src).unwrap();
    let mut parts: Vec<String> = rel
        .iter()
        .map(|p| p.to_string_lossy().into_owned())
        .collect();
    let last = parts.pop()?;
    match last.as_str() {
        l if l == root_file && parts.is_empty() => {}
        "lib.rs" | "main.rs" if parts.is_empty() => return None,
        "mod.rs" => {}
        other => parts.push(other.trim_end_matches(".rs").to_owned()),
    }
    Some(parts)
}

/// The longest prefix of `path` that is a module of the crate.
fn owning_module(path: &[String], known: &BTreeSet<Vec<String>>) -> Option<Vec<String>> {
    (1..=path.len())
        .rev()
        .map(|n| path[..n].to_vec())
        .find(|p| known.contains(p))
}

/// Every `crate::`, `super::` and `self::` path a module's code names, made absolute.
struct Paths {
    module: Vec<String>,
    /// Inline modules (`mod tests { ... }`) the visitor is inside.
    inline: Vec<String>,
    found: BTreeSet<Vec<String>>,
}

impl Paths {
    fn absolute(&self, segments: &[String]) -> Option<Vec<String>> {
        let mut here: Vec<String> = self.module.iter().chain(&self.inline).cloned().collect();
        let mut rest = segments;
        match rest.first().map(String::as_str) {
            Some("crate") => {
                here.clear();
                rest = &rest[1..];
            }
            Some("super") => {
                while rest.first().map(String::as_str) == Some("super") {
                    here.pop()?;
                    rest = &rest[1..];
                }
            }
            Some("self") => rest = &rest[1..],
            _ => return None,
        }
        here.extend(rest.iter().cloned());
        Some(here)
    }

    fn add(&mut self, segments: Vec<String>) {
        if let Some(p) = self.absolute(&segments) {
            self.found.insert(p);
        }
    }

    fn use_tree(&mut self, prefix: &mut Vec<String>, tree: &syn::UseTree) {
        match tree {
            syn::UseTree::Path(p) => {
                prefix.push(p.ident.to_string());
                self.use_tree(prefix, &p.tree);
                prefix.pop();
            }
            syn::UseTree::Name(n) => {
                let mut full = prefix.clone();
                if n.ident != "self" {
                    full.push(n.ident.to_string());
                }
                self.add(full);
            }
            syn::UseTree::Rename(r) => {
                let mut full = prefix.clone();
                full.push(r.ident.to_string());
                self.add(full);
            }
            syn::UseTree::Glob(_) => self.add(prefix.clone()),
            syn::UseTree::Group(g) => {
                for t in &g.items {
                    self.use_tree(prefix, t);
                }
            }
        }
    }
}

impl<'ast> Visit<'ast> for Paths {
    fn visit_item_use(&mut self, item: &'ast syn::ItemUse) {
        self.use_tree(&mut Vec::new(), &item.tree);
    }

    fn visit_path(&mut self, path: &'ast syn::Path) {
        self.add(path.segments.iter().map(|s| s.ident.to_string()).collect());
        syn::visit::visit_path(self, path);
    }

    /// Macro bodies are tokens to syn: read those that are expressions (assert!, format!,
    /// vec!, ...), so a path inside one counts too.
    fn visit_macro(&mut self, mac: &'ast syn::Macro) {
        let parser = syn::punctuated::Punctuated::<syn::Expr, syn::Token![,]>::parse_terminated;
        if let Ok(exprs) = mac.parse_body_with(parser) {
            for expr in &exprs {
                self.visit_expr(expr);
            }
        }
        syn::visit::visit_macro(self, mac);
    }

    fn visit_item_mod(&mut self, item: &'ast syn::ItemMod) {
        self.inline.push(item.ident.to_string());
        syn::visit::visit_item_mod(self, item);
        self.inline.pop();
    }
}

fn layer_of(room: &str) -> Option<usize> {
    LAYERS.iter().position(|rooms| rooms.contains(&room))
}

#[test]
fn rooms_import_only_from_rooms_below_them() {
    let krate = Crate::read(&workspace().join("tracer-cli/src"), "lib.rs");
    let mut rooms = BTreeSet::new();
    let mut wrong = Vec::new();
    for (module, named) in &krate.imports {
        let Some(room) = module.first() else { continue };
        rooms.insert(room.clone());
        if TEST_ONLY.contains(&room.as_str()) {
            continue;
        }
        let layer = layer_of(room).unwrap_or_else(|| {
            panic!("room {room} is in no layer: add it to LAYERS and to ARCHITECTURE.md")
        });
        for other in named {
            let Some(to) = other.first() else { continue };
            if to == room {
                continue;
            }
            match layer_of(to) {
                Some(l) if l < layer => {}
                _ => wrong.push(format!("{} -> {}", module.join("::"), other.join("::"))),
            }
        }
    }
    assert!(
        wrong.is_empty(),
        "imports against the layers:\n{}",
        wrong.join("\n")
    );
    // The test reads what it claims to: every layer's rooms exist.
    for room in LAYERS.iter().flat_map(|r| r.iter()) {
        assert!(rooms.contains(*room), "no room {room} in tracer-cli/src");
    }
}

#[test]
fn no_module_imports_one_that_imports_it_back() {
    for (src, root) in [
        ("tracer-cli/src", "lib.rs"),
        ("tracer-ebpf/src", "main.rs"),
        ("xtask/src", "main.rs"),
    ] {
        let krate = Crate::read(&workspace().join(src), root);
        assert!(
            krate.imports.len() > 5,
            "{src}: read {} modules",
            krate.imports.len()
        );
        let cycles = krate.cycles();
        assert!(
            cycles.is_empty(),
            "{src}: modules that import each other round a cycle:\n{}",
            cycles
                .iter()
                .map(|c| c.join(", "))
                .collect::<Vec<_>>()
                .join("\n")
        );
    }
}

/// The checker itself finds a cycle and an upward import when there is one.
#[test]
fn the_checker_sees_cycles_and_upward_imports() {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path();
    std::fs::create_dir(src.join("store")).unwrap();
    std::fs::write(src.join("lib.rs"), "pub mod store;\n").unwrap();
    std::fs::write(
        src.join("store/mod.rs"),
        "mod a;\nmod b;\n#[cfg(test)]\nmod tests { use super::a::X; }\n",
    )
    .unwrap();
    std::fs::write(src.join("store/a.rs"), "use super::b::Y;\npub struct X;\n").unwrap();
    std::fs::write(
        src.join("store/b.rs"),
        "pub struct Y;\nfn f() { assert!(crate::store::a::X == 1); let _ = crate::query::Z; }\n",
    )
    .unwrap();
    let krate = Crate::read(src, "lib.rs");
    assert_eq!(krate.cycles(), vec![vec!["store::a", "store::b"]]);
    let b = &krate.imports[&vec!["store".to_owned(), "b".to_owned()]];
    assert!(
        b.contains(&vec!["store".to_owned(), "a".to_owned()]),
        "{b:?}"
    );
    // crate::query is not a module here: the longest known prefix is the crate itself.
    assert!(
        krate.imports[&vec!["store".to_owned()]].is_empty(),
        "the inline test module's super is store itself, and a parent naming its child is not an import"
    );
}

/// A long file says why at its top: no file over 700 lines without a reason.
#[test]
fn a_file_over_700_lines_says_why() {
    let mut long = Vec::new();
    for src in [
        "tracer-cli/src",
        "tracer-ebpf/src",
        "tracer-common/src",
        "xtask/src",
    ] {
        let mut files = Vec::new();
        collect_rs(&workspace().join(src), &mut files);
        for file in files {
            let text = std::fs::read_to_string(&file).unwrap();
            let head: String = text
                .lines()
                .take_while(|l| l.starts_with("//!"))
                .collect::<Vec<_>>()
                .join(" ");
            if text.lines().count() > 700 && !head.contains("Over 700 lines because") {
                long.push(file.display().to_string());
            }
        }
    }
    assert!(
        long.is_empty(),
        "over 700 lines with no reason at the top: {long:?}"
    );
}

/// What keeps allocator state, and what moves it: none of it belongs in present/.
const STATE_MACHINES: &[&str] = &[
    "LiveAllocators",
    "Layout::new",
    "layout::Layout",
    "Figures::default",
    "ProcessState",
    "Tenants",
    ".apply(",
    ".restore(",
];

/// present/ only renders what it is given: no module there (outside its tests) keeps or moves
/// the allocator's state; the replays live on the query side.
#[test]
fn present_renders_only() {
    let mut files = Vec::new();
    collect_rs(&workspace().join("tracer-cli/src/present"), &mut files);
    assert!(files.len() > 10, "{files:?}");
    let mut found = Vec::new();
    for file in files {
        let text = std::fs::read_to_string(&file).unwrap();
        let code = text.split("#[cfg(test)]").next().unwrap_or("");
        for word in STATE_MACHINES {
            if code.contains(word) {
                found.push(format!("{}: {word}", file.display()));
            }
        }
    }
    assert!(found.is_empty(), "present/ keeps or moves state: {found:?}");
}

/// How the analysis runs the rules: the table's rows, stage by stage.
const RULE_STAGES: &[&str] = &["replayed", "scanned", "laid", "across", "merge"];

/// Every rule is run from the table (analysis/rules/rule.rs `RULES`): outside analysis/rules/,
/// the analysis calls the rules only through the stages that run its rows, never a rule by name
/// and never an edit of a chain after its rule returned it.
#[test]
fn every_rule_runs_from_the_table() {
    let mut files = Vec::new();
    collect_rs(&workspace().join("tracer-cli/src/analysis"), &mut files);
    let rules_dir = workspace().join("tracer-cli/src/analysis/rules");
    let mut found = Vec::new();
    let mut stages_called = BTreeSet::new();
    for file in files.iter().filter(|f| !f.starts_with(&rules_dir)) {
        let text = std::fs::read_to_string(file).unwrap();
        // Outside the unit tests (a test-only helper may come first).
        let code = text.split("#[cfg(test)]\nmod ").next().unwrap_or("");
        for (at, _) in code.match_indices("rules::") {
            let name: String = code[at + "rules::".len()..]
                .chars()
                .take_while(|c| c.is_alphanumeric() || *c == '_')
                .collect();
            let called = code[at + "rules::".len() + name.len()..].starts_with('(');
            if called {
                if RULE_STAGES.contains(&name.as_str()) {
                    stages_called.insert(name);
                } else {
                    found.push(format!("{}: rules::{name}(", file.display()));
                }
            }
        }
        for edit in [".effect = ", ".fix = ", ".fix.insert(", ".effect.push_str("] {
            if code.contains(edit) {
                found.push(format!("{}: a chain edited ({edit})", file.display()));
            }
        }
    }
    assert!(found.is_empty(), "rules run outside the table: {found:?}");
    let all: BTreeSet<String> = RULE_STAGES.iter().map(|s| s.to_string()).collect();
    assert_eq!(stages_called, all, "a stage the analysis never runs");
}
