//! The runtime's layers import one way (see the crate docs, *Layers*):
//!
//! ```text
//! app (otel, the log writer) · connect · outbox      the front door
//!   └─> engine (delivery, session, startup, relay, runtime)
//!         └─> handler · store · broker                 siblings: none imports another
//!               └─> tls
//!                     └─> base (pure) · error · config
//! ```
//!
//! This test reads `src/` and fails on any `crate::…` or `super::…` path in code
//! that points up or sideways, on any `crate::…` path that names an item through
//! the crate root, and on any import circle between files (of the runtime, and of
//! the workspace's other crates). The CLI and the test kits are crates of their own
//! (`cli/`, `testing/`), above this one: checked for circles only.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// A file's layer: its rank, and its name for messages.
fn layer(module: &str) -> (u8, &'static str) {
    match module.split("::").next().unwrap_or("") {
        "base" | "error" | "config" => (0, "base"),
        "tls" => (1, "tls"),
        "handler" => (2, "handler"),
        "store" => (2, "store"),
        "broker" => (2, "broker"),
        "engine" => (3, "engine"),
        _ => (4, "app"), // app, connect, outbox, lib
    }
}

/// Every `.rs` file under `dir`, with its module path (`engine::delivery`).
fn files(dir: &Path, prefix: &str, out: &mut Vec<(String, PathBuf)>) {
    let mut entries: Vec<_> = std::fs::read_dir(dir).expect("read src").filter_map(Result::ok).collect();
    entries.sort_by_key(|entry| entry.path());
    for entry in entries {
        let path = entry.path();
        let name = path.file_stem().and_then(|s| s.to_str()).unwrap_or_default().to_owned();
        let module = match (prefix, name.as_str()) {
            (_, "mod") | ("", "lib" | "main") => prefix.to_owned(),
            ("", _) => name.clone(),
            _ => format!("{prefix}::{name}"),
        };
        if path.is_dir() {
            // `src/bin/*.rs` are crates of their own.
            if prefix.is_empty() && name == "bin" {
                continue;
            }
            let sub = if prefix.is_empty() { name } else { format!("{prefix}::{name}") };
            files(&path, &sub, out);
        } else if path.extension().is_some_and(|ext| ext == "rs") {
            out.push((module, path));
        }
    }
}

/// Every `crate::…` path in a file's code (comments skipped), without its
/// `crate::`, and whether it was `$crate::` (a macro's path to its own crate).
fn crate_paths(text: &str) -> Vec<(bool, String)> {
    paths_after(text, "crate::").into_iter().map(|(before, path)| (before.ends_with('$'), path)).collect()
}

/// Every path in a file's code (comments skipped) that follows `prefix`, without
/// it, with the code before it on its line.
fn paths_after<'a>(text: &'a str, prefix: &str) -> Vec<(&'a str, String)> {
    let mut found = Vec::new();
    for line in text.lines() {
        let code = line.trim_start();
        if code.starts_with("//") {
            continue;
        }
        let code = code.split(" //").next().unwrap_or(code);
        for (i, _) in code.match_indices(prefix) {
            // `super::` inside `super::super::` is counted once, from the first.
            if prefix == "super::" && code[..i].ends_with("super::") {
                continue;
            }
            let path: String = code[i + prefix.len()..]
                .chars()
                .take_while(|c| c.is_alphanumeric() || *c == '_' || *c == ':')
                .collect();
            found.push((&code[..i], path));
        }
    }
    found
}

/// The `super::…` paths of the file of `module`, made absolute (without
/// `crate::`): `super` is the module's parent (for a `mod.rs` too, whose module
/// is its folder's).
fn super_paths(text: &str, module: &str) -> Vec<String> {
    paths_after(text, "super::")
        .into_iter()
        .filter_map(|(_, path)| {
            let mut base: Vec<&str> = module.split("::").filter(|s| !s.is_empty()).collect();
            base.pop()?;
            let mut rest = path.as_str();
            while let Some(after) = rest.strip_prefix("super::") {
                base.pop()?;
                rest = after;
            }
            base.extend(rest.split("::").filter(|s| !s.is_empty()));
            Some(base.join("::"))
        })
        .collect()
}

/// The modules a file's code names with `crate::…` or `super::…` (the file's
/// module is `module`), longest known module prefix of each path.
fn uses(text: &str, module: &str, known: &BTreeSet<String>) -> BTreeSet<String> {
    crate_paths(text)
        .into_iter()
        .map(|(_, path)| path)
        .chain(super_paths(text, module))
        .filter_map(|path| {
            let segments: Vec<&str> = path.split("::").filter(|s| !s.is_empty()).collect();
            (1..=segments.len())
                .rev()
                .map(|n| segments[..n].join("::"))
                .find(|candidate| known.contains(candidate))
        })
        .collect()
}

/// The `crate::…` paths of a file's code whose first segment is not a module of
/// `src/`: items named through the crate root's re-exports. (`$crate::` in a macro
/// is the crate seen from outside: its root is right.)
fn through_the_root(text: &str, modules: &BTreeSet<&str>) -> Vec<String> {
    crate_paths(text)
        .into_iter()
        .filter(|(dollar, _)| !dollar)
        .map(|(_, path)| path.split("::").next().unwrap_or_default().to_owned())
        .filter(|first| !modules.contains(first.as_str()) && first != "__private")
        .map(|first| format!("crate::{first}"))
        .collect()
}

/// The runtime's import graph.
fn graph() -> BTreeMap<String, BTreeSet<String>> {
    graph_of(&Path::new(env!("CARGO_MANIFEST_DIR")).join("src"))
}

/// The import graph of the crate whose sources are `src`: each file's module and
/// the modules it names.
fn graph_of(src: &Path) -> BTreeMap<String, BTreeSet<String>> {
    let mut all = Vec::new();
    files(src, "", &mut all);
    let known: BTreeSet<String> =
        all.iter().map(|(module, _)| module.clone()).filter(|m| !m.is_empty()).collect();
    all.iter()
        .map(|(module, path)| {
            let text = std::fs::read_to_string(path).expect("read a source file");
            let mut used = uses(&text, module, &known);
            used.remove(module);
            (module.clone(), used)
        })
        .collect()
}

#[test]
fn imports_point_down_the_layers_only() {
    let mut wrong = Vec::new();
    for (module, used) in graph() {
        let (rank, name) = layer(&module);
        for target in used {
            let (target_rank, target_name) = layer(&target);
            let sideways = rank == target_rank && rank == 2 && name != target_name;
            if target_rank > rank || sideways {
                wrong.push(format!("{module} ({name}) uses {target} ({target_name})"));
            }
        }
    }
    assert!(wrong.is_empty(), "imports against the layers:\n  {}", wrong.join("\n  "));
}

/// The workspace's crates whose files are checked for circles: the runtime and
/// every crate that has modules of its own.
const CRATES: [&str; 8] = ["runtime", "idemq", "cli", "testing", "macros", "examples", "bench", "tests"];

#[test]
fn no_file_imports_itself_back_through_others() {
    let workspace = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let circles: Vec<String> = CRATES
        .iter()
        .flat_map(|krate| {
            circles(&graph_of(&workspace.join(krate).join("src")))
                .into_iter()
                .map(move |c| format!("{krate}: {c}"))
        })
        .collect();
    assert!(circles.is_empty(), "import circles:\n  {}", circles.join("\n  "));
}

/// The circles of `graph`, each as the modules around it.
fn circles(graph: &BTreeMap<String, BTreeSet<String>>) -> Vec<String> {
    // Depth-first search; a back edge is a circle.
    fn visit<'a>(
        node: &'a str,
        graph: &'a BTreeMap<String, BTreeSet<String>>,
        state: &mut BTreeMap<&'a str, bool>,
        stack: &mut Vec<&'a str>,
        circles: &mut Vec<String>,
    ) {
        state.insert(node, false);
        stack.push(node);
        for next in graph.get(node).into_iter().flatten() {
            // A module and its parent `mod.rs` (which declares it) are one unit.
            if node.starts_with(&format!("{next}::")) || next.starts_with(&format!("{node}::")) {
                continue;
            }
            match state.get(next.as_str()) {
                None => visit(next, graph, state, stack, circles),
                Some(false) => {
                    let from = stack.iter().position(|m| *m == next).unwrap_or(0);
                    circles.push(format!("{} -> {next}", stack[from..].join(" -> ")));
                }
                Some(true) => {}
            }
        }
        stack.pop();
        state.insert(node, true);
    }
    let mut state = BTreeMap::new();
    let mut circles = Vec::new();
    for node in graph.keys() {
        if !state.contains_key(node.as_str()) {
            visit(node, graph, &mut state, &mut Vec::new(), &mut circles);
        }
    }
    circles
}

/// `lib.rs` only re-exports: the code of every other file names an item by the
/// module it is defined in (`crate::handler::key::Key`), never through the root
/// (`crate::Key`), where an import running back up the layers would hide from the
/// two tests above.
#[test]
fn code_names_items_by_their_home_not_through_the_crate_root() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut all = Vec::new();
    files(&src, "", &mut all);
    let modules: BTreeSet<&str> =
        all.iter().filter_map(|(module, _)| module.split("::").next()).filter(|m| !m.is_empty()).collect();
    let mut wrong = Vec::new();
    for (module, path) in &all {
        if module.is_empty() {
            continue; // lib.rs: the re-exports themselves
        }
        let text = std::fs::read_to_string(path).expect("read a source file");
        for named in through_the_root(&text, &modules) {
            wrong.push(format!("{module}: {named}"));
        }
    }
    assert!(wrong.is_empty(), "items named through the crate root:\n  {}", wrong.join("\n  "));
}

#[test]
fn super_paths_resolve_from_the_files_module() {
    let text =
        "use super::tx::{Step, Tx};\n// use super::gone;\nlet x = super::super::base::verdict::around(1, 0);";
    assert_eq!(
        super_paths(text, "engine::delivery::claim"),
        ["engine::delivery::tx", "engine::base::verdict::around"],
        "a file's super is its folder's module; super::super the one above"
    );
    assert_eq!(super_paths("use super::faults::Fault;", "engine::delivery"), ["engine::faults::Fault"]);
}
