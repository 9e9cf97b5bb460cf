//! Generated parts of hand-written documents: a block between two marker lines that a test
//! renders from the code and keeps current.

use std::path::Path;

/// Check that the block of `page` between `begin` and `end` (marker lines, e.g. HTML
/// comments) is `generated`. A stale block fails the test naming `rerun` (the command that
/// rewrites it), unless `QUANTMESH_UPDATE_DOCS` is set: then the page is rewritten.
pub fn keep_block_current(page: &Path, begin: &str, end: &str, generated: &str, rerun: &str) {
    let text = std::fs::read_to_string(page).unwrap_or_else(|e| panic!("{}: {e}", page.display()));
    let (Some(b), Some(e)) = (text.find(begin), text.find(end)) else {
        panic!(
            "{} has no generated block ({begin:?} … {end:?})",
            page.display()
        );
    };
    if text[b + begin.len()..e] == *generated {
        return;
    }
    if std::env::var_os("QUANTMESH_UPDATE_DOCS").is_some() {
        let new = format!("{}{begin}{generated}{}", &text[..b], &text[e..]);
        std::fs::write(page, new).unwrap_or_else(|e| panic!("{}: {e}", page.display()));
    } else {
        panic!(
            "{} is stale against what generates it: run `QUANTMESH_UPDATE_DOCS=1 {rerun}`",
            page.display()
        );
    }
}
