//! The engine's layout rules, checked on its own sources: no import circles between its
//! top-level modules; the gateway reaches the engine only through `api`; the pre-screen does
//! not depend on the engine at all.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
        let p = e.unwrap_or_else(|e| panic!("{e}")).path();
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// Top-level module of a file under `src/` (`backend/cpu/mod.rs` → `backend`).
fn module_of(src: &Path, file: &Path) -> Option<String> {
    let rel = file.strip_prefix(src).ok()?;
    let first = rel.components().next()?.as_os_str().to_str()?.to_string();
    let name = first.trim_end_matches(".rs").to_string();
    (name != "lib" && name != "bin").then_some(name)
}

/// The crate-local modules a source text refers to: `crate::x` anywhere, `use crate::{x, y}`.
fn referenced(text: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let ident = |s: &str| -> String {
        s.chars()
            .take_while(|c| c.is_alphanumeric() || *c == '_')
            .collect()
    };
    for (i, _) in text.match_indices("crate::") {
        // Skip `quantmesh_engine::…`-style paths that merely end in "crate::".
        let before = text[..i].chars().last();
        if before.is_some_and(|c| c.is_alphanumeric() || c == '_') {
            continue;
        }
        let rest = &text[i + "crate::".len()..];
        if let Some(list) = rest.strip_prefix('{') {
            let end = list.find('}').unwrap_or(list.len());
            for part in list[..end].split(',') {
                let m = ident(part.trim());
                if !m.is_empty() {
                    out.insert(m);
                }
            }
        } else {
            let m = ident(rest);
            if !m.is_empty() {
                out.insert(m);
            }
        }
    }
    out
}

fn engine_graph() -> BTreeMap<String, BTreeSet<String>> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    let mut graph: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for f in files {
        let Some(m) = module_of(&src, &f) else {
            continue;
        };
        let text = std::fs::read_to_string(&f).unwrap_or_else(|e| panic!("{}: {e}", f.display()));
        // Unit tests may reach anywhere; the layout rule is about the code itself.
        let code = text.split("#[cfg(test)]").next().unwrap_or("");
        let deps = graph.entry(m.clone()).or_default();
        for d in referenced(code) {
            if d != m {
                deps.insert(d);
            }
        }
    }
    graph
}

/// A cycle in `graph`, if any, as the list of modules around it.
fn find_cycle(graph: &BTreeMap<String, BTreeSet<String>>) -> Option<Vec<String>> {
    fn visit(
        n: &str,
        graph: &BTreeMap<String, BTreeSet<String>>,
        state: &mut BTreeMap<String, u8>,
        stack: &mut Vec<String>,
    ) -> Option<Vec<String>> {
        match state.get(n) {
            Some(2) => return None,
            Some(1) => {
                let at = stack.iter().position(|s| s == n).unwrap_or(0);
                let mut c = stack[at..].to_vec();
                c.push(n.to_string());
                return Some(c);
            }
            _ => {}
        }
        state.insert(n.to_string(), 1);
        stack.push(n.to_string());
        for d in graph.get(n).into_iter().flatten() {
            if let Some(c) = visit(d, graph, state, stack) {
                return Some(c);
            }
        }
        stack.pop();
        state.insert(n.to_string(), 2);
        None
    }
    let mut state = BTreeMap::new();
    for n in graph.keys() {
        if let Some(c) = visit(n, graph, &mut state, &mut Vec::new()) {
            return Some(c);
        }
    }
    None
}

#[test]
fn no_import_circles_between_engine_modules() {
    let graph = engine_graph();
    assert!(graph.contains_key("backend") && graph.contains_key("precision"));
    if let Some(c) = find_cycle(&graph) {
        panic!("import circle: {}\ngraph: {graph:#?}", c.join(" → "));
    }
    // The backend decides nothing about precision; the precision policy is backend-free.
    assert!(
        !graph["backend"].contains("precision"),
        "{:?}",
        graph["backend"]
    );
    assert!(
        !graph["backend"].contains("monitor"),
        "{:?}",
        graph["backend"]
    );
}

#[test]
fn the_cycle_finder_finds_cycles() {
    let mut g: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    g.entry("a".into()).or_default().insert("b".into());
    g.entry("b".into()).or_default().insert("c".into());
    g.entry("c".into()).or_default();
    assert_eq!(find_cycle(&g), None);
    g.entry("c".into()).or_default().insert("a".into());
    assert!(find_cycle(&g).is_some());
    assert_eq!(
        referenced("use crate::{a::X, b};\nlet x = crate::c::y(); quantmesh_engine::d"),
        ["a", "b", "c"].iter().map(|s| s.to_string()).collect()
    );
}

#[test]
fn gateway_uses_only_the_engine_api() {
    let gw = Path::new(env!("CARGO_MANIFEST_DIR")).join("../gateway/src");
    let mut files = Vec::new();
    rust_files(&gw, &mut files);
    for f in files {
        let text = std::fs::read_to_string(&f).unwrap_or_else(|e| panic!("{e}"));
        for (i, _) in text.match_indices("quantmesh_engine::") {
            let rest = &text[i + "quantmesh_engine::".len()..];
            assert!(
                rest.starts_with("api"),
                "{} reaches past the engine's api: quantmesh_engine::{}",
                f.display(),
                rest.lines().next().unwrap_or("")
            );
        }
    }
}

#[test]
fn prescreen_does_not_depend_on_the_engine() {
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR")).join("../prescreen/Cargo.toml");
    let text = std::fs::read_to_string(&manifest).unwrap_or_else(|e| panic!("{e}"));
    let deps = text
        .split("[dependencies]")
        .nth(1)
        .and_then(|s| s.split("\n[").next())
        .unwrap_or("");
    assert!(deps.contains("quantmesh-model"), "{deps}");
    assert!(!deps.contains("quantmesh-engine"), "{deps}");
}
