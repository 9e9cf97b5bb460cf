//! The evidence tables: the rows each evidence query returns, and the file that carries
//! them from any engine to `quantmesh evolve --evidence`.
//!
//! The file is JSON (documented in `shared/schemas/EVIDENCE.md`):
//!
//! ```json
//! {"format": "quantmesh.evidence-tables.v1", "engine": "spark 4.0.1",
//!  "model": "SmolLM2-135M-Instruct", "since_ms": 0, "until_ms": 1, "request_kl_limit": 0.02,
//!  "tables": {"groups": [{"group": "layers.1.down", "windows": 12, ...}], "decisions": [...],
//!             "kl": [...], "healthy": [...], "windows": [...], "configs": [...]}}
//! ```
//!
//! Column names are the queries' aliases; a NULL may be written as `null` or left out.

use super::error::AnalysisError;
use serde::{Deserialize, Serialize};

/// The time range analysed, `[since, until)` in Unix milliseconds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Span {
    pub since_ms: i64,
    pub until_ms: i64,
}

/// The `format` an evidence file declares.
pub const EVIDENCE_FORMAT: &str = "quantmesh.evidence-tables.v1";

/// A row of `groups`: one group's windows in the span.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct GroupRow {
    pub group: Option<String>,
    pub windows: Option<i64>,
    pub tokens: Option<i64>,
    pub outliers: Option<i64>,
    pub rate_p50: Option<f64>,
    pub rate_p95: Option<f64>,
    pub rate_max: Option<f64>,
    pub float_windows: Option<i64>,
    pub unavailable_windows: Option<i64>,
    pub residency: Option<String>,
    /// Token-weighted mean harm over the windows that measured it.
    pub served_nsr: Option<f64>,
}

/// A row of `decisions`: fallback events counted by group, granularity, reason and action.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DecisionCount {
    pub group: Option<String>,
    pub granularity: Option<String>,
    pub reason: Option<String>,
    pub action: Option<String>,
    pub n: Option<i64>,
}

/// The row of `kl`: the shadow-KL distribution (nearest-rank percentiles).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct KlRow {
    pub n: Option<i64>,
    pub p50: Option<f64>,
    pub p90: Option<f64>,
    pub p99: Option<f64>,
    pub max: Option<f64>,
    pub healthy: Option<i64>,
    pub partial: Option<i64>,
}

/// The row of `healthy`: the 99th percentile of samples within the request limit.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct HealthyRow {
    pub p99: Option<f64>,
}

/// The row of `windows`: monitor windows, request-KL fallbacks, the newest window.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct WindowsRow {
    pub n: Option<i64>,
    pub request_kl: Option<i64>,
    pub last_ms: Option<i64>,
}

/// The row of `configs`: plans applied and rejected.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ConfigsRow {
    pub applied: Option<i64>,
    pub rejected: Option<i64>,
}

/// Every evidence query's rows.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EvidenceTables {
    pub groups: Vec<GroupRow>,
    pub decisions: Vec<DecisionCount>,
    pub kl: Vec<KlRow>,
    pub healthy: Vec<HealthyRow>,
    pub windows: Vec<WindowsRow>,
    pub configs: Vec<ConfigsRow>,
}

/// An evidence file: the tables and what they were computed for.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EvidenceFile {
    pub format: String,
    /// Which engine computed the rows (for the report), e.g. `datafusion 55`, `spark 4.0.1`.
    pub engine: String,
    /// The served model's name, as in the events.
    pub model: String,
    pub since_ms: i64,
    pub until_ms: i64,
    /// The per-request KL limit the `kl` and `healthy` tables were split by.
    pub request_kl_limit: f64,
    pub tables: EvidenceTables,
}

impl EvidenceFile {
    pub fn span(&self) -> Span {
        Span {
            since_ms: self.since_ms,
            until_ms: self.until_ms,
        }
    }

    /// Read and check an evidence file (`path` names it in errors).
    pub fn parse(path: &str, bytes: &[u8]) -> Result<EvidenceFile, AnalysisError> {
        let err = |reason: String| AnalysisError::File {
            path: path.to_string(),
            reason,
        };
        let f: EvidenceFile = serde_json::from_slice(bytes).map_err(|e| err(e.to_string()))?;
        if f.format != EVIDENCE_FORMAT {
            return Err(err(format!(
                "format {:?}; this build reads {EVIDENCE_FORMAT:?}",
                f.format
            )));
        }
        if f.since_ms >= f.until_ms {
            return Err(err(format!(
                "empty span: since_ms {} is not before until_ms {}",
                f.since_ms, f.until_ms
            )));
        }
        if !(f.request_kl_limit.is_finite() && f.request_kl_limit > 0.0) {
            return Err(err(format!(
                "request_kl_limit {} is not a positive number",
                f.request_kl_limit
            )));
        }
        for (name, rows) in [
            ("kl", f.tables.kl.len()),
            ("healthy", f.tables.healthy.len()),
            ("windows", f.tables.windows.len()),
            ("configs", f.tables.configs.len()),
        ] {
            if rows != 1 {
                return Err(err(format!(
                    "table {name} has {rows} rows; its query returns exactly one"
                )));
            }
        }
        Ok(f)
    }

    /// The file's bytes (pretty JSON, newline-terminated).
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut b = serde_json::to_vec_pretty(self).unwrap_or_default();
        b.push(b'\n');
        b
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn file() -> EvidenceFile {
        EvidenceFile {
            format: EVIDENCE_FORMAT.into(),
            engine: "test".into(),
            model: "m".into(),
            since_ms: 0,
            until_ms: 10,
            request_kl_limit: 0.02,
            tables: EvidenceTables {
                groups: vec![GroupRow {
                    group: Some("layers.1.down".into()),
                    windows: Some(3),
                    rate_p95: Some(0.125),
                    ..Default::default()
                }],
                decisions: vec![],
                kl: vec![KlRow::default()],
                healthy: vec![HealthyRow::default()],
                windows: vec![WindowsRow::default()],
                configs: vec![ConfigsRow::default()],
            },
        }
    }

    #[test]
    fn a_file_round_trips_and_nulls_may_be_left_out() {
        let f = file();
        assert_eq!(EvidenceFile::parse("f", &f.to_bytes()).unwrap(), f);
        let mut v: serde_json::Value = serde_json::from_slice(&f.to_bytes()).unwrap();
        v["tables"]["groups"][0] =
            serde_json::json!({"group": "layers.1.down", "windows": 3, "rate_p95": 0.125});
        let again = EvidenceFile::parse("f", v.to_string().as_bytes()).unwrap();
        assert_eq!(again, f);
    }

    #[test]
    fn a_wrong_file_is_refused_by_name_and_reason() {
        let mut v: serde_json::Value = serde_json::from_slice(&file().to_bytes()).unwrap();
        v["format"] = "something else".into();
        let e = EvidenceFile::parse("ev.json", v.to_string().as_bytes()).unwrap_err();
        assert!(
            e.to_string().contains("ev.json") && e.to_string().contains("something else"),
            "{e}"
        );
        let mut v: serde_json::Value = serde_json::from_slice(&file().to_bytes()).unwrap();
        v["tables"]["groups"][0]["colour"] = "red".into();
        let e = EvidenceFile::parse("ev.json", v.to_string().as_bytes()).unwrap_err();
        assert!(e.to_string().contains("colour"), "{e}");
        let mut v: serde_json::Value = serde_json::from_slice(&file().to_bytes()).unwrap();
        v["tables"]["kl"] = serde_json::json!([]);
        let e = EvidenceFile::parse("ev.json", v.to_string().as_bytes()).unwrap_err();
        assert!(e.to_string().contains("table kl has 0 rows"), "{e}");
        let mut v: serde_json::Value = serde_json::from_slice(&file().to_bytes()).unwrap();
        v["until_ms"] = 0.into();
        assert!(EvidenceFile::parse("ev.json", v.to_string().as_bytes()).is_err());
    }
}
