//! The lake's tables: what one Kafka record becomes, as Arrow rows.
//!
//! Each event type has a table; a window event fans out to three (`windows`,
//! `window_groups`, `shadow_kl`) so that every question of the weekly analysis is a plain
//! `GROUP BY` without unnesting. Partition columns (`model`, `date`) are *not* stored in the
//! files — they are the Hive-style directories `model=…/date=…/`, which DataFusion, DuckDB,
//! Spark and Trino all read as columns. Documented for consumers in
//! `shared/schemas/LAKE.md`.

use datafusion::arrow::array::RecordBatch;
use datafusion::arrow::datatypes::{DataType, Field, Schema, SchemaRef, TimeUnit};
use datafusion::arrow::json::ReaderBuilder;
use quantmesh_types::{ConfigEvent, FallbackEvent, WindowEvent};
use serde::Serialize;
use std::sync::Arc;

/// One table of the lake.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Table {
    FallbackEvents,
    ConfigEvents,
    Windows,
    WindowGroups,
    ShadowKl,
    /// Records that could not be read as their event type (kept, with the reason).
    Rejected,
}

impl Table {
    pub const ALL: [Table; 6] = [
        Table::FallbackEvents,
        Table::ConfigEvents,
        Table::Windows,
        Table::WindowGroups,
        Table::ShadowKl,
        Table::Rejected,
    ];

    /// Directory name and SQL table name.
    pub fn name(self) -> &'static str {
        match self {
            Table::FallbackEvents => "fallback_events",
            Table::ConfigEvents => "config_events",
            Table::Windows => "windows",
            Table::WindowGroups => "window_groups",
            Table::ShadowKl => "shadow_kl",
            Table::Rejected => "rejected",
        }
    }

    /// The columns stored in the files (without the `model`/`date` partition columns).
    pub fn schema(self) -> SchemaRef {
        let utf8 = |n: &str, null: bool| Field::new(n, DataType::Utf8, null);
        let i64 = |n: &str, null: bool| Field::new(n, DataType::Int64, null);
        let f64 = |n: &str, null: bool| Field::new(n, DataType::Float64, null);
        let ts = Field::new(
            "ts",
            DataType::Timestamp(TimeUnit::Millisecond, Some("UTC".into())),
            false,
        );
        let fields = match self {
            Table::FallbackEvents => vec![
                utf8("event_id", false),
                ts,
                utf8("group", true),
                utf8("granularity", false),
                utf8("action", false),
                utf8("reason", false),
                f64("outlier_rate", true),
                f64("mean", true),
                f64("sigma", true),
                f64("k", true),
                f64("kl", true),
                utf8("kl_reference", true),
                i64("request_id", true),
                i64("tokens", false),
                utf8("config_md5", true),
                utf8("traceparent", true),
            ],
            Table::ConfigEvents => vec![
                utf8("event_id", false),
                ts,
                utf8("action", false),
                utf8("source", false),
                utf8("md5", false),
                utf8("previous_md5", true),
                utf8("error", true),
                utf8("changed_groups", false),
            ],
            Table::Windows => vec![
                utf8("event_id", false),
                ts,
                i64("duration_ms", false),
                i64("window", false),
                utf8("config_md5", true),
                i64("groups", false),
                i64("groups_in_float", false),
                i64("shadow_kl_seen", false),
                i64("shadow_kl_samples", false),
                utf8("kl_reference", true),
                i64("request_kl_fallbacks", false),
            ],
            Table::WindowGroups => vec![
                utf8("event_id", false),
                ts,
                i64("duration_ms", false),
                i64("window", false),
                utf8("config_md5", true),
                utf8("group", false),
                i64("tokens", false),
                i64("outliers", false),
                f64("outlier_rate", true),
                Field::new("in_float", DataType::Boolean, false),
                Field::new("wanted_unavailable", DataType::Boolean, false),
                utf8("residency", false),
                f64("mean_nsr", true),
            ],
            Table::ShadowKl => vec![
                utf8("event_id", false),
                ts,
                i64("sample", false),
                f64("kl", false),
                utf8("kl_reference", true),
            ],
            Table::Rejected => vec![
                utf8("topic", false),
                i64("partition", false),
                i64("offset", false),
                ts,
                utf8("error", false),
                utf8("payload", false),
            ],
        };
        Arc::new(Schema::new(fields))
    }
}

impl Table {
    /// The stored columns as an SQL column list (`` `name` TYPE [NOT NULL], … ``), the form
    /// Spark takes for a schema: the Spark job reads `infra/spark/lake-tables.json`, made
    /// from this, to stand in an empty table for one with no file yet.
    pub fn ddl(self) -> String {
        self.schema()
            .fields()
            .iter()
            .map(|f| {
                let ty = match f.data_type() {
                    DataType::Utf8 => "STRING",
                    DataType::Int64 => "BIGINT",
                    DataType::Float64 => "DOUBLE",
                    DataType::Boolean => "BOOLEAN",
                    DataType::Timestamp(_, _) => "TIMESTAMP",
                    other => unreachable!("no lake column is {other:?}"),
                };
                let null = if f.is_nullable() { "" } else { " NOT NULL" };
                format!("`{}` {ty}{null}", f.name())
            })
            .collect::<Vec<_>>()
            .join(", ")
    }
}

/// Rows bound for one table of one partition, serialised as the JSON the Arrow decoder
/// reads (field names = column names).
#[derive(Debug, Default, Clone)]
pub struct Rows {
    pub values: Vec<serde_json::Value>,
}

impl Rows {
    pub fn push<T: Serialize>(&mut self, row: &T) {
        if let Ok(v) = serde_json::to_value(row) {
            self.values.push(v);
        }
    }

    pub fn len(&self) -> usize {
        self.values.len()
    }

    pub fn is_empty(&self) -> bool {
        self.values.is_empty()
    }

    /// The rows as one Arrow batch of `table`'s schema.
    pub fn to_batch(&self, table: Table) -> Result<RecordBatch, String> {
        let schema = table.schema();
        let mut decoder = ReaderBuilder::new(schema.clone())
            .with_batch_size(self.values.len().max(1))
            .build_decoder()
            .map_err(|e| e.to_string())?;
        decoder.serialize(&self.values).map_err(|e| e.to_string())?;
        Ok(decoder
            .flush()
            .map_err(|e| e.to_string())?
            .unwrap_or_else(|| RecordBatch::new_empty(schema)))
    }
}

/// A row and the table/partition it goes to.
#[derive(Debug, Clone)]
pub struct Routed {
    pub table: Table,
    pub model: String,
    pub timestamp_ms: u64,
    pub row: serde_json::Value,
}

fn routed<T: Serialize>(table: Table, model: &str, timestamp_ms: u64, row: &T) -> Option<Routed> {
    Some(Routed {
        table,
        model: model.to_string(),
        timestamp_ms,
        row: serde_json::to_value(row).ok()?,
    })
}

#[derive(Serialize)]
struct FallbackRow<'a> {
    event_id: &'a str,
    ts: u64,
    group: Option<&'a str>,
    granularity: &'static str,
    action: &'static str,
    reason: &'static str,
    outlier_rate: Option<f64>,
    mean: Option<f64>,
    sigma: Option<f64>,
    k: Option<f64>,
    kl: Option<f64>,
    kl_reference: Option<&'static str>,
    request_id: Option<u64>,
    tokens: usize,
    config_md5: Option<&'a str>,
    traceparent: Option<&'a str>,
}

/// The lake rows of a fallback event.
pub fn fallback_rows(ev: &FallbackEvent) -> Vec<Routed> {
    let row = FallbackRow {
        event_id: &ev.event_id,
        ts: ev.timestamp_ms,
        group: ev.group.as_deref(),
        granularity: ev.granularity.as_str(),
        action: ev.action.as_str(),
        reason: ev.reason.as_str(),
        outlier_rate: ev.outlier_rate,
        mean: ev.mean,
        sigma: ev.sigma,
        k: ev.k,
        kl: ev.kl.filter(|v| v.is_finite()),
        kl_reference: ev.kl_reference.map(|r| r.as_str()),
        request_id: ev.request_id,
        tokens: ev.positions.len(),
        config_md5: ev.config_md5.as_deref(),
        traceparent: ev.traceparent.as_deref(),
    };
    routed(Table::FallbackEvents, &ev.model, ev.timestamp_ms, &row)
        .into_iter()
        .collect()
}

#[derive(Serialize)]
struct ConfigRow<'a> {
    event_id: &'a str,
    ts: u64,
    action: String,
    source: &'a str,
    md5: &'a str,
    previous_md5: Option<&'a str>,
    error: Option<&'a str>,
    /// Comma-separated (`split_part`/`string_to_array` in SQL).
    changed_groups: String,
}

/// The lake rows of a config event.
pub fn config_rows(ev: &ConfigEvent) -> Vec<Routed> {
    let row = ConfigRow {
        event_id: &ev.event_id,
        ts: ev.timestamp_ms,
        action: quantmesh_types::wire_name(&ev.action),
        source: &ev.source,
        md5: &ev.md5,
        previous_md5: ev.previous_md5.as_deref(),
        error: ev.error.as_deref(),
        changed_groups: ev.changed_groups.join(","),
    };
    routed(Table::ConfigEvents, &ev.model, ev.timestamp_ms, &row)
        .into_iter()
        .collect()
}

#[derive(Serialize)]
struct WindowRow<'a> {
    event_id: &'a str,
    ts: u64,
    duration_ms: u64,
    window: u64,
    config_md5: Option<&'a str>,
    groups: usize,
    groups_in_float: usize,
    shadow_kl_seen: u64,
    shadow_kl_samples: usize,
    kl_reference: Option<&'static str>,
    request_kl_fallbacks: u64,
}

#[derive(Serialize)]
struct WindowGroupRow<'a> {
    event_id: &'a str,
    ts: u64,
    duration_ms: u64,
    window: u64,
    config_md5: Option<&'a str>,
    group: &'a str,
    tokens: u64,
    outliers: u64,
    outlier_rate: Option<f64>,
    in_float: bool,
    wanted_unavailable: bool,
    residency: &'a str,
    mean_nsr: Option<f64>,
}

#[derive(Serialize)]
struct ShadowKlRow<'a> {
    event_id: &'a str,
    ts: u64,
    sample: usize,
    kl: f64,
    kl_reference: Option<&'static str>,
}

/// The lake rows of a window event: one `windows` row, one `window_groups` row per group,
/// one `shadow_kl` row per sample.
pub fn window_rows(ev: &WindowEvent) -> Vec<Routed> {
    let (m, t) = (ev.model.as_str(), ev.timestamp_ms);
    let mut out = Vec::with_capacity(1 + ev.groups.len() + ev.shadow_kl.len());
    out.extend(routed(
        Table::Windows,
        m,
        t,
        &WindowRow {
            event_id: &ev.event_id,
            ts: t,
            duration_ms: ev.duration_ms,
            window: ev.window,
            config_md5: ev.config_md5.as_deref(),
            groups: ev.groups.len(),
            groups_in_float: ev.groups.iter().filter(|g| g.in_float).count(),
            shadow_kl_seen: ev.shadow_kl_seen,
            shadow_kl_samples: ev.shadow_kl.len(),
            kl_reference: ev.kl_reference.map(|r| r.as_str()),
            request_kl_fallbacks: ev.request_kl_fallbacks,
        },
    ));
    for g in &ev.groups {
        out.extend(routed(
            Table::WindowGroups,
            m,
            t,
            &WindowGroupRow {
                event_id: &ev.event_id,
                ts: t,
                duration_ms: ev.duration_ms,
                window: ev.window,
                config_md5: ev.config_md5.as_deref(),
                group: &g.group,
                tokens: g.tokens,
                outliers: g.outliers,
                outlier_rate: (g.tokens > 0).then(|| g.outliers as f64 / g.tokens as f64),
                in_float: g.in_float,
                wanted_unavailable: g.wanted_unavailable,
                residency: &g.residency,
                mean_nsr: g.mean_nsr.filter(|v| v.is_finite()),
            },
        ));
    }
    for (i, kl) in ev
        .shadow_kl
        .iter()
        .enumerate()
        .filter(|(_, k)| k.is_finite())
    {
        out.extend(routed(
            Table::ShadowKl,
            m,
            t,
            &ShadowKlRow {
                event_id: &ev.event_id,
                ts: t,
                sample: i,
                kl: *kl,
                kl_reference: ev.kl_reference.map(|r| r.as_str()),
            },
        ));
    }
    out
}

#[derive(Serialize)]
struct RejectedRow<'a> {
    topic: &'a str,
    partition: i32,
    offset: i64,
    ts: u64,
    error: &'a str,
    payload: &'a str,
}

/// A record that could not be read: kept in `rejected` (partition `model=_unknown`).
pub fn rejected_row(
    topic: &str,
    partition: i32,
    offset: i64,
    now_ms: u64,
    error: &str,
    payload: &str,
) -> Routed {
    Routed {
        table: Table::Rejected,
        model: "_unknown".into(),
        timestamp_ms: now_ms,
        row: serde_json::to_value(RejectedRow {
            topic,
            partition,
            offset,
            ts: now_ms,
            error,
            payload,
        })
        .unwrap_or_default(),
    }
}

/// The partition directory value of a model name: characters outside `[A-Za-z0-9._-]`
/// become `_` (so a Hugging Face id `org/name` is `org_name`).
pub fn model_partition(model: &str) -> String {
    let s: String = model
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-') {
                c
            } else {
                '_'
            }
        })
        .collect();
    if s.is_empty() {
        "_unknown".into()
    } else {
        s
    }
}

/// `YYYY-MM-DD` (UTC) of a timestamp in milliseconds.
pub fn date_partition(timestamp_ms: u64) -> String {
    chrono::DateTime::<chrono::Utc>::from_timestamp_millis(timestamp_ms as i64)
        .unwrap_or_default()
        .format("%Y-%m-%d")
        .to_string()
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use quantmesh_types::WindowGroup;

    #[test]
    fn a_window_fans_out_and_decodes_to_each_schema() {
        let ev = WindowEvent {
            schema_version: 1,
            event_id: "e1".into(),
            timestamp_ms: 1_700_000_000_000,
            duration_ms: 5000,
            model: "org/m".into(),
            window: 3,
            config_md5: None,
            groups: vec![WindowGroup {
                group: "layers.0.down".into(),
                tokens: 100,
                outliers: 4,
                in_float: true,
                wanted_unavailable: false,
                residency: "dual".into(),
                mean_nsr: Some(0.002),
            }],
            shadow_kl: vec![0.001, 0.5],
            shadow_kl_seen: 2,
            kl_reference: None,
            request_kl_fallbacks: 1,
        };
        let rows = window_rows(&ev);
        assert_eq!(rows.len(), 4);
        for t in [Table::Windows, Table::WindowGroups, Table::ShadowKl] {
            let mut r = Rows::default();
            for x in rows.iter().filter(|x| x.table == t) {
                r.values.push(x.row.clone());
            }
            let b = r.to_batch(t).unwrap();
            assert_eq!(b.num_rows(), r.len(), "{t:?}");
            assert_eq!(b.schema(), t.schema());
        }
        assert_eq!(model_partition("org/m"), "org_m");
        assert_eq!(date_partition(1_700_000_000_000), "2023-11-14");
    }
}
