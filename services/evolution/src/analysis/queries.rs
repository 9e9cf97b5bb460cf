//! The evidence queries as SQL text: one file for every engine.
//!
//! `services/evolution/sql/evidence.sql` holds each query after a `-- name: <name>` line,
//! with placeholders each engine fills in the same way (the Spark job parses the same file
//! with the same rules). Only `{ts_ms}`, the expression for a timestamp in Unix
//! milliseconds, differs between engines.

use super::error::AnalysisError;
use super::tables::Span;

/// The queries' text, as shipped.
pub const SQL: &str = include_str!("../../sql/evidence.sql");

/// The evidence tables, in the order the file defines them.
pub const NAMES: [&str; 6] = ["groups", "decisions", "kl", "healthy", "windows", "configs"];

/// DataFusion's spelling of `{ts_ms}` (`ts` is a millisecond timestamp).
pub const DATAFUSION_TS_MS: &str = "CAST(ts AS BIGINT)";

/// What fills the placeholders.
#[derive(Debug, Clone, Copy)]
pub struct Params<'a> {
    /// The model's partition value (`lake::tables::model_partition`).
    pub model_partition: &'a str,
    pub span: Span,
    pub request_kl_limit: f64,
    /// The engine's expression for `ts` in Unix milliseconds.
    pub ts_ms: &'a str,
}

/// An SQL string literal.
pub fn sql_string(s: &str) -> String {
    format!("'{}'", s.replace('\'', "''"))
}

/// The named queries of `text`, in file order (comments before the first name dropped, the
/// rest kept as written).
pub fn parse(text: &str) -> Result<Vec<(String, String)>, AnalysisError> {
    let mut out: Vec<(String, String)> = Vec::new();
    for line in text.lines() {
        if let Some(name) = line.strip_prefix("-- name:") {
            out.push((name.trim().to_string(), String::new()));
        } else if let Some((_, body)) = out.last_mut() {
            body.push_str(line);
            body.push('\n');
        }
    }
    for (name, body) in &mut out {
        *body = body.trim().trim_end_matches(';').trim_end().to_string();
        if body.is_empty() {
            return Err(AnalysisError::Queries(format!("query {name:?} is empty")));
        }
    }
    let names: Vec<&str> = out.iter().map(|(n, _)| n.as_str()).collect();
    if names != NAMES {
        return Err(AnalysisError::Queries(format!(
            "the file names the queries {names:?}; the analysis reads {NAMES:?}"
        )));
    }
    Ok(out)
}

/// `sql` with its placeholders filled in; a placeholder left over is an error.
pub fn fill(sql: &str, p: &Params<'_>) -> Result<String, AnalysisError> {
    let filled = sql
        .replace("{model}", &sql_string(p.model_partition))
        .replace("{since_ms}", &p.span.since_ms.to_string())
        .replace("{until_ms}", &p.span.until_ms.to_string())
        .replace("{ts_ms}", p.ts_ms)
        .replace("{request_kl_limit}", &format!("{:?}", p.request_kl_limit));
    if let Some(at) = filled.find('{') {
        let rest: String = filled[at..].chars().take(24).collect();
        return Err(AnalysisError::Queries(format!(
            "unknown placeholder at {rest:?}"
        )));
    }
    Ok(filled)
}

/// The shipped queries, filled in for one engine.
pub fn filled(p: &Params<'_>) -> Result<Vec<(String, String)>, AnalysisError> {
    parse(SQL)?
        .into_iter()
        .map(|(name, sql)| Ok((name, fill(&sql, p)?)))
        .collect()
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn params() -> Params<'static> {
        Params {
            model_partition: "m'x",
            span: Span {
                since_ms: 10,
                until_ms: 20,
            },
            request_kl_limit: 0.02,
            ts_ms: DATAFUSION_TS_MS,
        }
    }

    #[test]
    fn the_shipped_file_names_every_table_and_fills_completely() {
        let q = filled(&params()).unwrap();
        assert_eq!(q.len(), NAMES.len());
        for (name, sql) in &q {
            assert!(sql.contains("'m''x'"), "{name}: {sql}");
            assert!(sql.contains("CAST(ts AS BIGINT) < 20"), "{name}: {sql}");
            assert!(!sql.contains("-- name"), "{name}");
        }
        assert!(q[2].1.contains("CAST(0.02 AS DOUBLE)"));
    }

    #[test]
    fn a_missing_query_or_an_unknown_placeholder_is_refused() {
        let e = parse("-- name: groups\nSELECT 1\n").unwrap_err();
        assert!(e.to_string().contains("decisions"), "{e}");
        let e = fill("SELECT {nope}", &params()).unwrap_err();
        assert!(e.to_string().contains("{nope}"), "{e}");
    }
}
