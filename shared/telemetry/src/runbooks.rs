//! The runbooks, served by every quantmesh process at `GET /runbooks` (HTML, one section per
//! alert with the alert's lower-cased name as its anchor). The alert rules point their
//! `runbook_url` at the process that raised them: `http://{{ $labels.instance }}/runbooks#…`,
//! so the link resolves wherever the scraped address does, and it always shows the runbook of
//! the version that is running. The text is docs/runbooks.md, compiled in.

use std::sync::OnceLock;

/// The route.
pub const PATH: &str = "/runbooks";

/// The content type of [`html`].
pub const CONTENT_TYPE: &str = "text/html; charset=utf-8";

const SOURCE: &str = include_str!("../../../docs/runbooks.md");

/// The anchor of an alert's section: its name in lower case (what GitHub's Markdown anchors
/// give for these names too).
pub fn anchor(alert: &str) -> String {
    alert.to_ascii_lowercase()
}

/// The alerts that have a section.
pub fn alerts() -> impl Iterator<Item = &'static str> {
    SOURCE
        .lines()
        .filter_map(|l| l.strip_prefix("## "))
        .map(str::trim)
}

/// The page: the Markdown text in preformatted blocks, each `## Alert` heading an `<h2>` with
/// its [`anchor`].
pub fn html() -> &'static str {
    static PAGE: OnceLock<String> = OnceLock::new();
    PAGE.get_or_init(|| render(SOURCE))
}

fn render(markdown: &str) -> String {
    let mut out = String::from(
        "<!doctype html>\n<html><head><meta charset=\"utf-8\"><title>quantmesh runbooks</title></head>\n<body>\n<pre style=\"white-space: pre-wrap\">",
    );
    for line in markdown.lines() {
        if let Some(name) = line.strip_prefix("## ") {
            let name = name.trim();
            out.push_str(&format!(
                "</pre>\n<h2 id=\"{}\">{}</h2>\n<pre style=\"white-space: pre-wrap\">",
                escape(&anchor(name)),
                escape(name)
            ));
        } else {
            out.push_str(&escape(line));
            out.push('\n');
        }
    }
    out.push_str("</pre>\n</body></html>\n");
    out
}

fn escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_section_is_an_anchor_and_text_is_escaped() {
        let page = render("# Runbooks\n\nintro <b>\n\n## AlertOne\n\n**Means**: a & b\n");
        assert!(page.contains("<h2 id=\"alertone\">AlertOne</h2>"), "{page}");
        assert!(page.contains("intro &lt;b&gt;"), "{page}");
        assert!(page.contains("a &amp; b"), "{page}");
        assert!(alerts().count() >= 10, "docs/runbooks.md has its sections");
        for a in alerts() {
            assert!(html().contains(&format!("id=\"{}\"", anchor(a))), "{a}");
        }
    }
}
