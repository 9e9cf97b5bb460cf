//! The import graph between the files of a crate.
//!
//! A file's references are the module paths its code names outside comments and unit
//! tests: `crate::a::b::X`, `super::X`, `self::a::X`, and paths through the modules it
//! declares (`mod a;` then `a::X`). Each resolves to the file of the deepest module on the
//! path, and a name that file re-exports (`pub use a::X`, `pub use a::*`) is followed to the
//! file that defines it, so a parent that re-exports its children is not thereby one of
//! their dependents. Declaring a module (`mod a;`) is not a reference. Every binary under
//! `src/bin` is a tree of its own (its `crate::` is its own root).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// An import graph: files (repository-relative display paths), or modules, → what they
/// reference.
pub type FileGraph = BTreeMap<String, BTreeSet<String>>;

/// One module tree: module path (`["backend", "cpu"]`) → its file.
type Tree = BTreeMap<Vec<String>, PathBuf>;

fn ident_at(text: &str) -> &str {
    let end = text
        .find(|c: char| !(c.is_alphanumeric() || c == '_'))
        .unwrap_or(text.len());
    &text[..end]
}

/// Every `a::b::{c, d::e}` path in `code`, expanded (`[a, b, c]`, `[a, b, d, e]`); a glob
/// ends in `*`, an alias is dropped (`a::B as C` → `[a, B]`).
pub fn paths(code: &str) -> Vec<Vec<String>> {
    paths_at(code).into_iter().map(|(_, p)| p).collect()
}

/// [`paths`] with the byte offset each starts at.
fn paths_at(code: &str) -> Vec<(usize, Vec<String>)> {
    let bytes = code.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while i < code.len() {
        let c = bytes[i] as char;
        let starts = (c.is_ascii_alphabetic() || c == '_')
            && (i == 0 || {
                let p = bytes[i - 1] as char;
                !(p.is_alphanumeric() || p == '_' || p == ':')
            });
        if !starts {
            i += 1;
            continue;
        }
        let head = ident_at(&code[i..]);
        if head.is_empty() {
            i += 1;
            continue;
        }
        let rest = &code[i + head.len()..];
        if rest.starts_with("::") {
            let (tails, used) = tail(rest);
            for t in tails {
                let mut p = vec![head.to_string()];
                p.extend(t);
                out.push((i, p));
            }
            i += head.len() + used;
        } else {
            i += head.len();
        }
    }
    out
}

/// The continuations of a path after its first segment (`::b::{c, d}` → `[[b, c], [b, d]]`)
/// and how many bytes they took.
fn tail(text: &str) -> (Vec<Vec<String>>, usize) {
    let mut segs = Vec::new();
    let mut at = 0;
    while text[at..].starts_with("::") {
        at += 2;
        let rest = &text[at..];
        let trimmed = rest.trim_start();
        at += rest.len() - trimmed.len();
        if let Some(list) = trimmed.strip_prefix('{') {
            // Find the matching brace.
            let mut depth = 1;
            let mut end = list.len();
            for (k, ch) in list.char_indices() {
                match ch {
                    '{' => depth += 1,
                    '}' => {
                        depth -= 1;
                        if depth == 0 {
                            end = k;
                            break;
                        }
                    }
                    _ => {}
                }
            }
            let mut out = Vec::new();
            for part in split_top(&list[..end]) {
                let part = part.trim();
                let part = part.split(" as ").next().unwrap_or(part).trim();
                if part.is_empty() {
                    continue;
                }
                let head = if part.starts_with('*') {
                    "*"
                } else {
                    ident_at(part)
                };
                if head.is_empty() {
                    continue;
                }
                let (tails, _) = tail(&part[head.len()..]);
                for t in tails {
                    let mut p = segs.clone();
                    p.push(head.to_string());
                    p.extend(t);
                    out.push(p);
                }
            }
            return (out, at + 1 + end + 1);
        }
        if trimmed.starts_with('*') {
            segs.push("*".to_string());
            at += 1;
            break;
        }
        let seg = ident_at(trimmed);
        if seg.is_empty() {
            break;
        }
        segs.push(seg.to_string());
        at += seg.len();
    }
    (vec![segs], at)
}

/// `a, b::{c, d}, e` split at the commas outside braces.
fn split_top(list: &str) -> Vec<&str> {
    let mut parts = Vec::new();
    let (mut depth, mut from) = (0, 0);
    for (k, ch) in list.char_indices() {
        match ch {
            '{' => depth += 1,
            '}' => depth -= 1,
            ',' if depth == 0 => {
                parts.push(&list[from..k]);
                from = k + 1;
            }
            _ => {}
        }
    }
    parts.push(&list[from..]);
    parts
}

/// The inline modules of a file (`mod a { … }`): name and byte range.
fn inline_modules(code: &str) -> Vec<(String, std::ops::Range<usize>)> {
    let mut out = Vec::new();
    for (i, _) in code.match_indices("mod ") {
        if i > 0
            && code[..i]
                .chars()
                .last()
                .is_some_and(|c| c.is_alphanumeric() || c == '_')
        {
            continue;
        }
        let name = ident_at(&code[i + 4..]);
        let after = code[i + 4 + name.len()..].trim_start();
        if name.is_empty() || !after.starts_with('{') {
            continue;
        }
        let open = code.len() - after.len();
        let mut depth = 0;
        for (k, ch) in code[open..].char_indices() {
            match ch {
                '{' => depth += 1,
                '}' => {
                    depth -= 1;
                    if depth == 0 {
                        out.push((name.to_string(), open..open + k));
                        break;
                    }
                }
                _ => {}
            }
        }
    }
    out
}

/// The modules a file declares (`mod a;`, `pub(crate) mod a;`).
fn declared(code: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for stmt in code.split(';') {
        let words: Vec<&str> = stmt.split_whitespace().collect();
        if let [.., m, name] = words.as_slice() {
            if *m == "mod" && !name.is_empty() {
                out.insert(ident_at(name).to_string());
            }
        }
    }
    out
}

/// What a file re-exports: name → the path it comes from (as written); globs under `*`.
fn reexports(code: &str) -> BTreeMap<String, Vec<Vec<String>>> {
    let mut out: BTreeMap<String, Vec<Vec<String>>> = BTreeMap::new();
    for stmt in code.split(';') {
        let stmt = stmt.trim();
        let Some(body) = ["pub use ", "pub(crate) use ", "pub(super) use "]
            .iter()
            .find_map(|p| stmt.rsplit_once(p).map(|(_, b)| b))
        else {
            continue;
        };
        // `a::B as C` re-exports `C`.
        let aliases: BTreeMap<String, String> = body
            .split(['{', '}', ','])
            .filter_map(|p| p.split_once(" as "))
            .map(|(a, b)| {
                let from = a.trim().rsplit("::").next().unwrap_or("").to_string();
                (from, b.trim().to_string())
            })
            .collect();
        for p in paths(body) {
            let Some(last) = p.last() else { continue };
            let name = if last == "*" {
                "*".to_string()
            } else {
                aliases.get(last).cloned().unwrap_or_else(|| last.clone())
            };
            out.entry(name).or_default().push(p);
        }
    }
    out
}

/// Whether `code` defines an item called `name`.
fn defines(code: &str, name: &str) -> bool {
    [
        "fn ",
        "struct ",
        "enum ",
        "trait ",
        "type ",
        "const ",
        "static ",
        "mod ",
        "union ",
        "macro_rules! ",
    ]
    .iter()
    .any(|kw| {
        code.match_indices(&format!("{kw}{name}")).any(|(i, m)| {
            let after = code[i + m.len()..].chars().next();
            !after.is_some_and(|c| c.is_alphanumeric() || c == '_')
        })
    })
}

/// What one file says, read once.
struct File {
    code: String,
    /// The modules it declares.
    declared: BTreeSet<String>,
    /// What it re-exports.
    reexports: BTreeMap<String, Vec<Vec<String>>>,
}

struct Crate {
    trees: BTreeMap<String, Tree>,
    files: BTreeMap<PathBuf, File>,
}

impl Crate {
    /// The module `path` (from `at`, in `tree`) names, made absolute; `None` when it starts
    /// outside the crate.
    fn absolute(&self, file: &Path, at: &[String], path: &[String]) -> Option<Vec<String>> {
        let first = path.first()?;
        let mut base: Vec<String> = match first.as_str() {
            "crate" => return Some(path[1..].to_vec()),
            "self" => at.to_vec(),
            "super" => at.to_vec(),
            m if self.files[file].declared.contains(m) => {
                let mut b = at.to_vec();
                b.push(m.to_string());
                return Some(b.into_iter().chain(path[1..].iter().cloned()).collect());
            }
            _ => return None,
        };
        let mut rest = &path[1..];
        if first == "super" {
            base.pop();
            while rest.first().is_some_and(|s| s == "super") {
                base.pop();
                rest = &rest[1..];
            }
        }
        base.extend(rest.iter().cloned());
        Some(base)
    }

    /// The file that defines what the absolute `path` names (following re-exports).
    fn resolve(&self, tree: &Tree, path: &[String], depth: usize) -> Option<PathBuf> {
        let mut n = path.len();
        while !tree.contains_key(&path[..n]) {
            n = n.checked_sub(1)?;
        }
        let module = &path[..n];
        let file = tree[module].clone();
        let Some(name) = path.get(n).filter(|s| *s != "*") else {
            return Some(file);
        };
        if depth > 8 || defines(&self.files[&file].code, name) {
            return Some(file);
        }
        let re = &self.files[&file].reexports;
        let mut sources: Vec<&Vec<String>> = re.get(name).into_iter().flatten().collect();
        if sources.is_empty() {
            // A glob whose module defines the name.
            for g in re.get("*").into_iter().flatten() {
                let abs = self.absolute(&file, module, &g[..g.len() - 1]);
                if let Some(target) = abs.and_then(|a| self.resolve(tree, &a, depth + 1)) {
                    if defines(&self.files[&target].code, name) {
                        return Some(target);
                    }
                }
            }
        }
        match sources.pop() {
            Some(src) => self
                .absolute(&file, module, src)
                .and_then(|a| self.resolve(tree, &a, depth + 1))
                .or(Some(file)),
            None => Some(file),
        }
    }
}

/// Every `.rs` file under `dir`.
pub fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
        let p = e.unwrap_or_else(|e| panic!("{e}")).path();
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// (tree, module path) of a file under `src`.
fn place(rel: &Path) -> (String, Vec<String>) {
    let mut segs: Vec<String> = rel
        .components()
        .filter_map(|c| c.as_os_str().to_str())
        .map(|s| s.trim_end_matches(".rs").to_string())
        .collect();
    let mut tree = "lib".to_string();
    if segs.first().is_some_and(|s| s == "bin") && segs.len() >= 2 {
        tree = format!("bin/{}", segs[1]);
        segs.drain(..2);
    } else if segs == ["main"] {
        tree = "main".to_string();
        segs.clear();
    }
    if segs
        .last()
        .is_some_and(|s| s == "mod" || s == "main" || s == "lib")
    {
        segs.pop();
    }
    (tree, segs)
}

/// The import graph between the files of the crate at `krate`, with `code_of` stripping
/// comments and unit tests. Paths are shown relative to `shown_from`.
pub fn file_graph(krate: &Path, shown_from: &Path, code_of: fn(&str) -> String) -> FileGraph {
    let src = krate.join("src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    let mut c = Crate {
        trees: BTreeMap::new(),
        files: BTreeMap::new(),
    };
    let mut places = Vec::new();
    for f in files {
        let rel = f.strip_prefix(&src).unwrap_or(&f).to_path_buf();
        let (tree, segs) = place(&rel);
        let text = std::fs::read_to_string(&f).unwrap_or_else(|e| panic!("{}: {e}", f.display()));
        let code = code_of(&text);
        c.files.insert(
            f.clone(),
            File {
                declared: declared(&code),
                reexports: reexports(&code),
                code,
            },
        );
        c.trees
            .entry(tree.clone())
            .or_default()
            .insert(segs.clone(), f.clone());
        places.push((f, tree, segs));
    }
    let show = |p: &Path| {
        p.strip_prefix(shown_from)
            .unwrap_or(p)
            .display()
            .to_string()
    };
    let mut graph = FileGraph::new();
    for (f, tree_name, at) in places {
        let tree = &c.trees[&tree_name];
        let deps = graph.entry(show(&f)).or_default();
        let code = &c.files[&f].code;
        let inline = inline_modules(code);
        for (pos, p) in paths_at(code) {
            // Inside `mod a { … }` a path starts from the inline module.
            let mut at = at.clone();
            at.extend(
                inline
                    .iter()
                    .filter(|(_, r)| r.contains(&pos))
                    .map(|(n, _)| n.clone()),
            );
            let Some(abs) = c.absolute(&f, &at, &p) else {
                continue;
            };
            if let Some(target) = c.resolve(tree, &abs, 0) {
                if target != f {
                    deps.insert(show(&target));
                }
            }
        }
    }
    graph
}

/// Every strongly connected set of more than one file (Tarjan's algorithm).
pub fn circles(graph: &FileGraph) -> Vec<Vec<String>> {
    struct T<'g> {
        g: &'g FileGraph,
        index: BTreeMap<&'g str, usize>,
        low: BTreeMap<&'g str, usize>,
        stack: Vec<&'g str>,
        on: BTreeSet<&'g str>,
        out: Vec<Vec<String>>,
    }
    fn visit<'g>(t: &mut T<'g>, n: &'g str) {
        let i = t.index.len();
        t.index.insert(n, i);
        t.low.insert(n, i);
        t.stack.push(n);
        t.on.insert(n);
        for d in t.g.get(n).into_iter().flatten() {
            let d = d.as_str();
            if !t.index.contains_key(d) {
                visit(t, d);
                let l = t.low[n].min(t.low[d]);
                t.low.insert(n, l);
            } else if t.on.contains(d) {
                let l = t.low[n].min(t.index[d]);
                t.low.insert(n, l);
            }
        }
        if t.low[n] == t.index[n] {
            let mut scc = Vec::new();
            while let Some(m) = t.stack.pop() {
                t.on.remove(m);
                scc.push(m.to_string());
                if m == n {
                    break;
                }
            }
            if scc.len() > 1 {
                scc.sort();
                t.out.push(scc);
            }
        }
    }
    let mut t = T {
        g: graph,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on: BTreeSet::new(),
        out: Vec::new(),
    };
    for n in graph.keys() {
        if !t.index.contains_key(n.as_str()) {
            visit(&mut t, n);
        }
    }
    t.out
}
