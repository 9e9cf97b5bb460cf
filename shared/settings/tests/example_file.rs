//! The example configuration is the reference: it names every key the settings have, and
//! the configuration page's key tables are generated from it (`QUANTMESH_UPDATE_DOCS=1 cargo
//! test -p quantmesh-settings` rewrites them).

use quantmesh_settings::Settings;
use std::path::PathBuf;

fn repo(path: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .join(path)
}

fn read(path: &str) -> String {
    std::fs::read_to_string(repo(path)).unwrap_or_else(|e| panic!("{path}: {e}"))
}

/// One `key = value  # comment` line of the example (or a commented-out optional key).
#[derive(Debug)]
struct Key {
    name: String,
    value: String,
    /// Shown commented out: optional, unset by default.
    optional: bool,
    comment: String,
}

#[derive(Debug, Default)]
struct Section {
    name: String,
    comment: String,
    keys: Vec<Key>,
}

/// Where a `#` comment starts outside a quoted string.
fn comment_start(line: &str) -> Option<usize> {
    let mut quoted = false;
    for (i, c) in line.char_indices() {
        match c {
            '"' => quoted = !quoted,
            '#' if !quoted => return Some(i),
            _ => {}
        }
    }
    None
}

/// `key = value` with the key unquoted.
fn key_value(text: &str) -> Option<(String, String)> {
    let (k, v) = text.split_once('=')?;
    let k = k.trim();
    let plain = k
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '.');
    (plain && !k.is_empty()).then(|| (k.to_string(), v.trim().to_string()))
}

fn parse(example: &str) -> Vec<Section> {
    let mut sections = vec![Section::default()];
    // A comment line indented under a key continues that key's comment.
    let mut last_key_open = false;
    for line in example.lines() {
        let trimmed = line.trim();
        let Some(section) = sections.last_mut() else {
            unreachable!()
        };
        if trimmed.is_empty() {
            last_key_open = false;
            continue;
        }
        if let Some(rest) = trimmed.strip_prefix('[') {
            let (head, comment) = match comment_start(rest) {
                Some(i) => (&rest[..i], rest[i + 1..].trim()),
                None => (rest, ""),
            };
            sections.push(Section {
                name: head.trim().trim_end_matches(']').to_string(),
                comment: comment.to_string(),
                keys: Vec::new(),
            });
            last_key_open = false;
            continue;
        }
        let (code, comment) = match comment_start(line) {
            Some(i) => (&line[..i], line[i + 1..].trim()),
            None => (line, ""),
        };
        if let Some((name, value)) = key_value(code) {
            section.keys.push(Key {
                name,
                value,
                optional: false,
                comment: comment.to_string(),
            });
            last_key_open = true;
            continue;
        }
        // `# key = value   # comment`: an optional key, unset by default.
        let inner = trimmed.trim_start_matches('#').trim();
        let (icode, icomment) = match comment_start(inner) {
            Some(i) => (&inner[..i], inner[i + 1..].trim()),
            None => (inner, ""),
        };
        if line.starts_with('#') {
            if let Some((name, value)) = key_value(icode).filter(|(n, _)| !n.contains('"')) {
                section.keys.push(Key {
                    name,
                    value,
                    optional: true,
                    comment: icomment.to_string(),
                });
                last_key_open = true;
                continue;
            }
        }
        if last_key_open && line.starts_with(' ') {
            if let Some(k) = section.keys.last_mut() {
                k.comment = format!("{} {}", k.comment, comment).trim().to_string();
            }
            continue;
        }
        // A note for the whole section (or an example line).
        section.comment = format!("{} {}", section.comment, inner).trim().to_string();
        last_key_open = false;
    }
    sections
}

fn cell(s: &str) -> String {
    s.replace('|', "\\|")
}

/// The configuration page's key tables.
fn render(sections: &[Section]) -> String {
    let mut out = String::new();
    for s in sections.iter().filter(|s| !s.name.is_empty()) {
        out.push_str(&format!("### `[{}]`\n\n", s.name));
        if !s.comment.is_empty() {
            out.push_str(&format!("{}\n\n", s.comment));
        }
        if s.keys.is_empty() {
            continue;
        }
        out.push_str(
            "| key | default | what it does (environment variable, flag) |\n|---|---|---|\n",
        );
        for k in &s.keys {
            let default = if k.optional {
                format!("unset (e.g. `{}`)", k.value)
            } else {
                format!("`{}`", k.value)
            };
            out.push_str(&format!(
                "| `{}` | {} | {} |\n",
                k.name,
                cell(&default),
                cell(&k.comment)
            ));
        }
        out.push('\n');
    }
    out
}

const BEGIN: &str = "<!-- keys: generated from infra/quantmesh.example.toml; do not edit -->\n";
const END: &str = "<!-- end of keys -->";

#[test]
fn the_configuration_page_lists_every_key_of_the_example() {
    let tables = render(&parse(&read("infra/quantmesh.example.toml")));
    quantmesh_testkit::generated::keep_block_current(
        &repo("docs/configuration.md"),
        BEGIN,
        END,
        &tables,
        "cargo test -p quantmesh-settings --test example_file",
    );
}

/// Dotted paths of every value the defaults serialize (maps that start empty count as
/// their section).
fn leaves(prefix: &str, v: &toml::Value, out: &mut Vec<(String, String)>) {
    match v {
        toml::Value::Table(t) if !t.is_empty() => {
            for (k, v) in t {
                let p = if prefix.is_empty() {
                    k.clone()
                } else {
                    format!("{prefix}.{k}")
                };
                leaves(&p, v, out);
            }
        }
        toml::Value::Table(_) => out.push((prefix.to_string(), String::new())),
        _ => {
            let (section, key) = prefix.rsplit_once('.').unwrap_or(("", prefix));
            out.push((section.to_string(), key.to_string()));
        }
    }
}

#[test]
fn the_example_names_every_key_the_settings_have() {
    let sections = parse(&read("infra/quantmesh.example.toml"));
    let defaults = toml::Value::try_from(Settings::default()).unwrap_or_else(|e| panic!("{e}"));
    let mut all = Vec::new();
    leaves("", &defaults, &mut all);
    assert!(all.len() > 60, "{all:?}");
    let missing: Vec<String> = all
        .iter()
        .filter(|(section, key)| {
            !sections.iter().any(|s| {
                s.name == *section && (key.is_empty() || s.keys.iter().any(|k| k.name == *key))
            })
        })
        .map(|(s, k)| format!("[{s}] {k}"))
        .collect();
    assert!(
        missing.is_empty(),
        "infra/quantmesh.example.toml does not document: {missing:?}"
    );
    // And it names nothing the settings do not have.
    let unknown: Vec<String> = sections
        .iter()
        .filter(|s| !s.name.is_empty())
        .flat_map(|s| s.keys.iter().map(move |k| (s, k)))
        .filter(|(s, k)| !k.optional && !all.iter().any(|(a, b)| *a == s.name && *b == k.name))
        .map(|(s, k)| format!("[{}] {}", s.name, k.name))
        .collect();
    assert!(
        unknown.is_empty(),
        "unknown keys in the example: {unknown:?}"
    );
}

#[test]
fn the_reader_sees_keys_comments_and_optional_keys() {
    let s = parse(
        "[a]   # the a section\nx = \"#1\"    # first\n               # continued\n# y = 2   # optional\n\n[a.b]\n# \"k\" = 1\n",
    );
    assert_eq!(s.len(), 3, "{s:?}");
    assert_eq!(s[1].name, "a");
    assert_eq!(s[1].comment, "the a section");
    assert_eq!(s[1].keys[0].value, "\"#1\"");
    assert_eq!(s[1].keys[0].comment, "first continued");
    assert!(s[1].keys[1].optional && s[1].keys[1].name == "y");
    assert!(s[2].keys.is_empty() && s[2].comment.contains("\"k\" = 1"));
}
