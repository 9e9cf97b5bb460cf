//! The workspace's layout rules, checked on its sources:
//!
//! - crates depend downward only (`LAYERS`; nothing under `shared/` depends on a service);
//! - no import circles between the files of any crate (`layout/files.rs` says what a
//!   file's references are), nor between the top-level modules of any crate (a module's
//!   references are its `crate::…` paths outside comments and unit tests; a name the crate
//!   root re-exports counts as its module);
//! - the engine's backend decides nothing about precision and knows nothing of the monitor;
//! - every other crate's code reaches the engine only through its `api` module (its own
//!   measuring tools, `services/engine-tools`, excepted);
//! - the pre-screen does not depend on the engine at all, and the mesh gateway holds the
//!   mesh alone (the HTTP server, settings and telemetry are crates of their own);
//! - no Rust file, code or test, is longer than one reading holds (800 lines);
//! - the docs point at what exists: every relative link resolves, every repository path they
//!   name in backticks is a file (paths may be written relative to the section's folder),
//!   and the README's test command is the one CI runs.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

#[path = "layout/files.rs"]
mod files;

type Graph = files::FileGraph;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn read(p: &Path) -> String {
    std::fs::read_to_string(p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

/// The workspace's member crates (their folders), from the root manifest.
fn members() -> Vec<PathBuf> {
    let manifest = read(&root().join("Cargo.toml"));
    let list = manifest
        .split("members = [")
        .nth(1)
        .and_then(|s| s.split(']').next())
        .unwrap_or_else(|| panic!("no workspace members in Cargo.toml"));
    let members: Vec<PathBuf> = list
        .split(',')
        .map(|m| m.trim().trim_matches('"'))
        .filter(|m| !m.is_empty())
        .map(|m| root().join(m))
        .collect();
    assert!(members.len() > 10, "{members:?}");
    members
}

/// The source without comments and without its unit tests (they may reach anywhere; the
/// rules are about the code itself).
fn code_of(text: &str) -> String {
    let code = text.split("#[cfg(test)]").next().unwrap_or("");
    code.lines()
        .filter(|l| !l.trim_start().starts_with("//"))
        .collect::<Vec<_>>()
        .join("\n")
}

fn ident(s: &str) -> String {
    s.chars()
        .take_while(|c| c.is_alphanumeric() || *c == '_')
        .collect()
}

/// The names after `prefix` in `text`: `prefix::x` anywhere, `prefix::{x, y::z}`.
fn paths_after(text: &str, prefix: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let pat = format!("{prefix}::");
    for (i, _) in text.match_indices(&pat) {
        // Skip `other_crate::…`-style paths that merely end in the prefix.
        let before = text[..i].chars().last();
        if before.is_some_and(|c| c.is_alphanumeric() || c == '_') {
            continue;
        }
        let rest = &text[i + pat.len()..];
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

/// Names the crate root re-exports, mapped to the module they come from
/// (`pub use q8::{PackedQ8, BLOCK};` → `PackedQ8 → q8`, `BLOCK → q8`).
fn root_reexports(lib: &str) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    for stmt in code_of(lib).split(';') {
        let Some(path) = stmt.trim().strip_prefix("pub use ") else {
            continue;
        };
        let path = path
            .trim_start_matches("crate::")
            .trim_start_matches("self::");
        let module = ident(path);
        let Some(rest) = path.strip_prefix(&format!("{module}::")) else {
            continue;
        };
        for n in rest.split(['{', '}', ',']) {
            // `a::B` re-exports `B`; `X as Y` re-exports `Y`.
            let n = n.trim();
            let n = n.rsplit(" as ").next().unwrap_or(n);
            let n = n.rsplit("::").next().unwrap_or(n).trim();
            if !n.is_empty() && n != "self" && n != "*" {
                out.insert(n.to_string(), module.clone());
            }
        }
    }
    out
}

/// The import graph between a crate's top-level modules (`src/backend/cpu/mod.rs` belongs
/// to `backend`); binaries are left out.
fn module_graph(krate: &Path) -> Graph {
    let src = krate.join("src");
    let lib = src.join("lib.rs");
    let reexports = if lib.exists() {
        root_reexports(&read(&lib))
    } else {
        BTreeMap::new()
    };
    let mut files = Vec::new();
    files::rust_files(&src, &mut files);
    let mut graph = Graph::new();
    for f in files {
        let Some(first) = f
            .strip_prefix(&src)
            .ok()
            .and_then(|r| r.components().next())
            .and_then(|c| c.as_os_str().to_str())
        else {
            continue;
        };
        let m = first.trim_end_matches(".rs").to_string();
        if ["lib", "main", "bin"].contains(&m.as_str()) {
            continue;
        }
        let code = code_of(&read(&f));
        let deps = graph.entry(m.clone()).or_default();
        for d in paths_after(&code, "crate") {
            let d = reexports.get(&d).cloned().unwrap_or(d);
            if d != m {
                deps.insert(d);
            }
        }
    }
    graph
}

#[test]
fn no_import_circles_in_any_crate() {
    let mut checked = 0;
    let mut circles = Vec::new();
    for krate in members() {
        if !krate.join("src").exists() {
            continue;
        }
        let graph = module_graph(&krate);
        checked += graph.len();
        for c in files::circles(&graph) {
            circles.push(format!("{}: {}", krate.display(), c.join(" ↔ ")));
        }
    }
    assert!(checked > 80, "only {checked} modules found");
    assert!(
        circles.is_empty(),
        "import circles:\n{}",
        circles.join("\n")
    );
}

#[test]
fn no_import_circles_between_files() {
    let mut checked = 0;
    let mut found = Vec::new();
    for krate in members() {
        if !krate.join("src").exists() {
            continue;
        }
        let graph = files::file_graph(&krate, &root(), code_of);
        checked += graph.len();
        for c in files::circles(&graph) {
            found.push(c.join(" ↔ "));
        }
    }
    assert!(checked > 120, "only {checked} files found");
    assert!(
        found.is_empty(),
        "{} import circles between files:\n{}",
        found.len(),
        found.join("\n")
    );
}

#[test]
fn the_engine_backend_decides_nothing_about_precision() {
    let graph = module_graph(&root().join("services/engine"));
    assert!(graph.contains_key("backend") && graph.contains_key("precision"));
    for banned in ["precision", "monitor"] {
        assert!(
            !graph["backend"].contains(banned),
            "backend reaches {banned}: {:?}",
            graph["backend"]
        );
    }
}

#[test]
fn other_crates_use_only_the_engine_api() {
    // The engine's own measuring tools (bench, evaluation suite) look inside it on purpose.
    let inside = [
        root().join("services/engine"),
        root().join("services/engine-tools"),
    ];
    let mut seen = 0;
    for krate in members().into_iter().filter(|k| !inside.contains(k)) {
        let mut files = Vec::new();
        if krate.join("src").exists() {
            files::rust_files(&krate.join("src"), &mut files);
        }
        for f in files {
            let text = read(&f);
            for (i, _) in text.match_indices("quantmesh_engine::") {
                seen += 1;
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
    assert!(seen > 10, "{seen}");
}

/// The `[dependencies]` table of a crate's manifest (`krate`: its folder, absolute or from
/// the repository's root).
fn dependencies(krate: impl AsRef<Path>) -> String {
    let text = read(&root().join(krate).join("Cargo.toml"));
    text.split("[dependencies]")
        .nth(1)
        .and_then(|s| s.split("\n[").next())
        .unwrap_or("")
        .to_string()
}

/// The workspace's crates from the bottom up: a crate depends (through `[dependencies]`;
/// tests may reach anywhere) only on crates of a lower layer, and a crate under `shared/`
/// only on crates under `shared/`.
const LAYERS: &[&[&str]] = &[
    &[
        "quantmesh-types",
        "quantmesh-kernels",
        "quantmesh-store",
        "quantmesh-outbox",
        "quantmesh-catalog",
    ],
    &["quantmesh-model", "quantmesh-kafka"],
    &["quantmesh-config"],
    &["quantmesh-settings"],
    &["quantmesh-telemetry"],
    &[
        "quantmesh-engine",
        "quantmesh-prescreen",
        "quantmesh-evolution",
    ],
    &["quantmesh-server", "quantmesh-engine-tools"],
    &["quantmesh-gateway"],
    &["quantmesh"],
    &["quantmesh-e2e", "quantmesh-s3-server"],
];

/// A crate's package name and the workspace crates its `[dependencies]` name.
fn crate_deps(krate: &Path) -> (String, Vec<String>) {
    let text = read(&krate.join("Cargo.toml"));
    let name = text
        .lines()
        .find_map(|l| l.strip_prefix("name = "))
        .map(|n| n.trim().trim_matches('"').to_string())
        .unwrap_or_else(|| panic!("{}: no package name", krate.display()));
    let deps = dependencies(krate)
        .lines()
        .map(|l| {
            l.trim()
                .chars()
                .take_while(|c| c.is_alphanumeric() || *c == '-' || *c == '_')
                .collect::<String>()
        })
        .filter(|d| d == "quantmesh" || d.starts_with("quantmesh-"))
        .collect();
    (name, deps)
}

#[test]
fn crates_depend_downward_only() {
    let layer_of = |name: &str| LAYERS.iter().position(|l| l.contains(&name));
    let mut wrong = Vec::new();
    let mut shared = BTreeSet::new();
    let mut all = Vec::new();
    for krate in members() {
        let (name, deps) = crate_deps(&krate);
        if krate.starts_with(root().join("shared")) {
            shared.insert(name.clone());
        }
        all.push((krate, name, deps));
    }
    for (krate, name, deps) in &all {
        let Some(own) = layer_of(name) else {
            wrong.push(format!("{name} has no layer in LAYERS"));
            continue;
        };
        for d in deps {
            match layer_of(d) {
                Some(l) if l < own => {}
                _ => wrong.push(format!("{name} depends on {d}, which is not below it")),
            }
            if shared.contains(name) && !shared.contains(d) {
                wrong.push(format!(
                    "{} ({name}) is shared but depends on {d}, a service",
                    krate.display()
                ));
            }
        }
    }
    assert!(all.len() > 10 && shared.len() > 5, "{all:?}");
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}

#[test]
fn the_prescreen_does_not_depend_on_the_engine() {
    let deps = dependencies("services/prescreen");
    assert!(deps.contains("quantmesh-model"), "{deps}");
    assert!(!deps.contains("quantmesh-engine"), "{deps}");
}

#[test]
fn the_gateway_crate_is_the_mesh_alone() {
    let graph = module_graph(&root().join("services/gateway"));
    assert_eq!(graph.keys().collect::<Vec<_>>(), ["mesh"], "{graph:#?}");
    // The settings and telemetry every binary uses know nothing of serving HTTP.
    for shared in ["shared/settings", "shared/telemetry"] {
        let deps = dependencies(shared);
        for serving in ["quantmesh-server", "quantmesh-gateway", "actix"] {
            assert!(!deps.contains(serving), "{shared} depends on {serving}");
        }
    }
}

/// Longest a Rust source file may be.
const MAX_LINES: usize = 800;

#[test]
fn no_source_file_is_longer_than_one_reading() {
    let mut files = Vec::new();
    for krate in members() {
        for dir in ["src", "tests", "benches", "examples"] {
            if krate.join(dir).exists() {
                files::rust_files(&krate.join(dir), &mut files);
            }
        }
    }
    assert!(files.len() > 150, "only {} files", files.len());
    let long: Vec<String> = files
        .iter()
        .map(|f| (f, read(f).lines().count()))
        .filter(|(_, n)| *n > MAX_LINES)
        .map(|(f, n)| format!("{}: {n} lines", f.display()))
        .collect();
    assert!(
        long.is_empty(),
        "files over {MAX_LINES} lines (split them by what they do):\n{}",
        long.join("\n")
    );
}

/// Every file in the repository (as `git ls-files` lists it, else walked from the root).
fn repo_files() -> Vec<String> {
    let out = std::process::Command::new("git")
        .arg("-C")
        .arg(root())
        .args(["ls-files"])
        .output();
    match out {
        Ok(o) if o.status.success() => String::from_utf8_lossy(&o.stdout)
            .lines()
            .map(str::to_string)
            .collect(),
        _ => panic!("git ls-files failed in {}", root().display()),
    }
}

/// The repository paths a markdown text names: `[..](path)` links and backticked
/// `dir/file.ext` paths.
fn named_paths(md: &str) -> (Vec<String>, Vec<String>) {
    let mut links = Vec::new();
    for (i, _) in md.match_indices("](") {
        let rest = &md[i + 2..];
        let Some(end) = rest.find(')') else { continue };
        let target = rest[..end].split('#').next().unwrap_or("");
        if !target.is_empty() && !target.contains("://") && !target.starts_with("mailto:") {
            links.push(target.to_string());
        }
    }
    let exts = [
        ".rs", ".md", ".toml", ".yml", ".yaml", ".py", ".sh", ".json", ".jsonl",
    ];
    let mut paths = Vec::new();
    // Code fences would shift which pieces are inside backticks.
    let md = md.replace("```", "");
    for part in md.split('`').skip(1).step_by(2) {
        let pathlike = part
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "_-./".contains(c));
        if pathlike
            && part.contains('/')
            && !part.starts_with('/')
            && exts.iter().any(|e| part.ends_with(e))
        {
            paths.push(part.to_string());
        }
    }
    (links, paths)
}

#[test]
fn the_docs_point_at_what_exists() {
    let files = repo_files();
    let docs: Vec<&String> = files.iter().filter(|f| f.ends_with(".md")).collect();
    assert!(docs.len() >= 5, "{docs:?}");
    let mut missing = Vec::new();
    let mut checked = 0;
    for doc in docs {
        let dir = Path::new(doc).parent().unwrap_or(Path::new(""));
        let (links, paths) = named_paths(&read(&root().join(doc)));
        for l in links {
            checked += 1;
            if !root().join(dir).join(&l).exists() {
                missing.push(format!("{doc}: link {l}"));
            }
        }
        for p in paths {
            checked += 1;
            let found = root().join(&p).exists()
                || root().join(dir).join(&p).exists()
                || files.iter().any(|f| f.ends_with(&format!("/{p}")));
            if !found {
                missing.push(format!("{doc}: `{p}`"));
            }
        }
    }
    assert!(checked > 100, "only {checked} references found");
    assert!(
        missing.is_empty(),
        "the docs name what does not exist:\n{}",
        missing.join("\n")
    );
}

#[test]
fn the_readme_test_command_is_what_ci_runs() {
    let readme = read(&root().join("README.md"));
    let quick = readme
        .split("## Quick start")
        .nth(1)
        .and_then(|s| s.split("\n## ").next())
        .unwrap_or_else(|| panic!("README has no Quick start"));
    let ci = read(&root().join(".ci/run"));
    let ci_tests: Vec<&str> = ci
        .lines()
        .filter(|l| l.trim_start().starts_with("./scripts/"))
        .collect();
    assert_eq!(ci_tests, ["./scripts/test.sh"], "{ci}");
    assert!(
        quick.lines().any(|l| l.trim() == "./scripts/test.sh"),
        "the quick start's test command is not CI's: {quick}"
    );
    assert!(quick.contains("cargo run --release -p quantmesh -- serve"));
}

/// A crate on disk for the file-graph checks.
fn fixture(files: &[(&str, &str)]) -> PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "quantmesh-layout-{}-{}",
        std::process::id(),
        files.len()
    ));
    for (path, text) in files {
        let p = dir.join("src").join(path);
        std::fs::create_dir_all(p.parent().unwrap_or(&dir)).unwrap_or_else(|e| panic!("{e}"));
        std::fs::write(&p, text).unwrap_or_else(|e| panic!("{e}"));
    }
    dir
}

#[test]
fn the_file_graph_sees_parents_children_and_reexports() {
    // A parent that defines what its child uses and re-exports the child: a circle.
    let circle = fixture(&[
        ("lib.rs", "mod a;\npub use a::Thing;"),
        ("a/mod.rs", "mod b;\npub use b::Thing;\npub struct Shared;"),
        ("a/b.rs", "use super::Shared;\npub struct Thing(Shared);"),
    ]);
    let g = files::file_graph(&circle, &circle, code_of);
    assert_eq!(files::circles(&g).len(), 1, "{g:#?}");
    // The same with the shared item in a sibling: no circle, and a name the parent
    // re-exports leads to the file that defines it.
    let fixed = fixture(&[
        ("lib.rs", "mod a;\npub use a::Thing;\nmod c;"),
        (
            "a/mod.rs",
            "mod b;\nmod shared;\npub use b::Thing;\npub use shared::*;",
        ),
        ("a/shared.rs", "pub struct Shared;"),
        (
            "a/b.rs",
            "use super::shared::Shared;\npub struct Thing(Shared);",
        ),
        (
            "c.rs",
            "use crate::a::Shared;\nmod inner { use super::X; }\npub struct X;",
        ),
    ]);
    let g = files::file_graph(&fixed, &fixed, code_of);
    assert!(files::circles(&g).is_empty(), "{g:#?}");
    let c = g.iter().find(|(f, _)| f.ends_with("c.rs")).map(|(_, d)| d);
    assert_eq!(
        c.map(|d| d.iter().map(|s| s.replace('\\', "/")).collect::<Vec<_>>()),
        Some(vec!["src/a/shared.rs".to_string()]),
        "{g:#?}"
    );
    let _ = std::fs::remove_dir_all(circle);
    let _ = std::fs::remove_dir_all(fixed);
}

#[test]
fn the_rules_see_what_they_check() {
    let mut g = Graph::new();
    g.entry("a".into()).or_default().insert("b".into());
    g.entry("b".into()).or_default().insert("c".into());
    g.entry("c".into()).or_default();
    assert!(files::circles(&g).is_empty());
    g.entry("c".into()).or_default().insert("a".into());
    assert_eq!(files::circles(&g), [["a", "b", "c"]]);
    assert_eq!(
        paths_after(
            "use crate::{a::X, b};\nlet x = crate::c::y(); quantmesh_engine::d",
            "crate"
        ),
        ["a", "b", "c"].iter().map(|s| s.to_string()).collect()
    );
    let code =
        code_of("/// see [`crate::doc`]\nuse crate::real;\n#[cfg(test)]\nuse crate::test_only;");
    assert_eq!(
        paths_after(&code, "crate"),
        ["real"].iter().map(|s| s.to_string()).collect()
    );
    let re = root_reexports(
        "mod q8;\npub use q8::{PackedQ8, BLOCK};\npub use isa::Isa;\npub use a::b::{C as D};",
    );
    assert_eq!(re.get("PackedQ8").map(String::as_str), Some("q8"));
    assert_eq!(re.get("BLOCK").map(String::as_str), Some("q8"));
    assert_eq!(re.get("Isa").map(String::as_str), Some("isa"));
    assert_eq!(re.get("D").map(String::as_str), Some("a"));
    let (links, paths) = named_paths(
        "see [a](docs/x.md#y) and [b](https://e.org), `services/a/b.rs`, `x.rs`, `a b/c.rs`",
    );
    assert_eq!(links, ["docs/x.md"]);
    assert_eq!(paths, ["services/a/b.rs"]);
}
