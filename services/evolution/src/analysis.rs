//! The weekly analysis: SQL over the lake with DataFusion.
//!
//! Every number the proposal rules use comes from one of the queries below (kept as SQL
//! text, so the same analysis runs on Spark, Trino or Ballista over the same files when a
//! week of events outgrows one machine). Rows are deduplicated on `event_id` inside each
//! query (`SELECT DISTINCT` over the event's columns): the lake is at-least-once at the
//! source, and the analysis must not count a redelivered event twice.

use crate::lake::tables::{model_partition, Table};
use crate::lake::Lake;
use datafusion::arrow::array::{
    Array, ArrayRef, Float64Array, Int64Array, RecordBatch, StringArray,
};
use datafusion::arrow::compute::cast;
use datafusion::arrow::datatypes::DataType;
use datafusion::datasource::file_format::parquet::ParquetFormat;
use datafusion::datasource::listing::{
    ListingOptions, ListingTable, ListingTableConfig, ListingTableUrl,
};
use datafusion::datasource::MemTable;
use datafusion::prelude::SessionContext;
use futures::TryStreamExt;
use serde::Serialize;
use std::collections::BTreeMap;
use std::sync::Arc;

#[derive(Debug, thiserror::Error)]
pub enum AnalysisError {
    #[error("query engine: {0}")]
    Query(String),
    #[error("lake: {0}")]
    Lake(String),
}

impl From<datafusion::error::DataFusionError> for AnalysisError {
    fn from(e: datafusion::error::DataFusionError) -> Self {
        AnalysisError::Query(e.to_string())
    }
}

/// The time range analysed, `[since, until)` in Unix milliseconds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Span {
    pub since_ms: i64,
    pub until_ms: i64,
}

/// One group's week.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct GroupEvidence {
    pub group: String,
    /// Monitor windows that measured this group, and its rows in them.
    pub windows: u64,
    pub tokens: u64,
    pub outliers: u64,
    /// Distribution of the per-window outlier rate.
    pub rate_p50: Option<f64>,
    pub rate_p95: Option<f64>,
    pub rate_max: Option<f64>,
    /// Windows that ended with the group in float, and their share of all windows.
    pub float_windows: u64,
    pub float_share: f64,
    /// Windows in which the group wanted float but holds no float copy.
    pub unavailable_windows: u64,
    /// The residency the engine reported last.
    pub residency: String,
    /// Layer decisions: entries into float, exits, "wanted but unavailable".
    pub enters: u64,
    pub exits: u64,
    pub unavailable: u64,
    /// Per-token decisions (rows routed to float inside a step).
    pub token_decisions: u64,
}

/// Shadow-KL distribution (nats) over the week's samples.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct KlEvidence {
    pub samples: u64,
    pub p50: Option<f64>,
    pub p90: Option<f64>,
    pub p99: Option<f64>,
    pub max: Option<f64>,
    /// Samples at or below the request limit in force ("healthy" traffic) and their 99th
    /// percentile.
    pub healthy_samples: u64,
    pub healthy_p99: Option<f64>,
    /// Samples whose reference lacked some float weights (`partial_float_weights`).
    pub partial_reference: u64,
}

/// A decision count, as `quantmesh_fallback_decisions_total` labels it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct DecisionRow {
    pub group: Option<String>,
    pub granularity: String,
    pub reason: String,
    pub action: String,
    pub count: u64,
}

/// Everything the proposal rules see.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Evidence {
    pub model: String,
    pub since_ms: i64,
    pub until_ms: i64,
    /// The newest window event in the span (what the proposal is stamped with, so that the
    /// same evidence gives the same bytes whenever it is analysed).
    pub last_window_ms: Option<i64>,
    pub windows: u64,
    pub fallback_events: u64,
    pub request_kl_fallbacks: u64,
    pub groups: Vec<GroupEvidence>,
    pub kl: KlEvidence,
    pub decisions: Vec<DecisionRow>,
    /// Config versions applied and rejected in the span.
    pub configs_applied: u64,
    pub configs_rejected: u64,
}

/// A DataFusion session with the lake's tables registered (`model` and `date` as partition
/// columns). Tables with no file yet are empty tables of the same schema.
pub async fn session(lake: &Lake) -> Result<SessionContext, AnalysisError> {
    let ctx = SessionContext::new();
    ctx.register_object_store(lake.base_url(), lake.store());
    for table in Table::ALL {
        let url = lake.table_url(table);
        let has_files = {
            let prefix = lake_store::path::Path::from_url_path(
                url::Url::parse(&url)
                    .map_err(|e| AnalysisError::Lake(e.to_string()))?
                    .path(),
            )
            .map_err(|e| AnalysisError::Lake(e.to_string()))?;
            let mut list = lake.store().list(Some(&prefix));
            let mut found = false;
            while let Some(m) = list
                .try_next()
                .await
                .map_err(|e| AnalysisError::Lake(e.to_string()))?
            {
                if m.location.as_ref().ends_with(".parquet") {
                    found = true;
                    break;
                }
            }
            found
        };
        let file_schema = table.schema();
        if has_files {
            let opts = ListingOptions::new(Arc::new(ParquetFormat::default()))
                .with_file_extension(".parquet")
                .with_table_partition_cols(vec![
                    ("model".to_string(), DataType::Utf8),
                    ("date".to_string(), DataType::Utf8),
                ]);
            let config = ListingTableConfig::new(ListingTableUrl::parse(&url)?)
                .with_listing_options(opts)
                .with_schema(file_schema);
            ctx.register_table(table.name(), Arc::new(ListingTable::try_new(config)?))?;
        } else {
            let mut fields: Vec<_> = file_schema.fields().iter().cloned().collect();
            for p in ["model", "date"] {
                fields.push(Arc::new(datafusion::arrow::datatypes::Field::new(
                    p,
                    DataType::Utf8,
                    false,
                )));
            }
            let schema = Arc::new(datafusion::arrow::datatypes::Schema::new(fields));
            ctx.register_table(
                table.name(),
                Arc::new(MemTable::try_new(schema, vec![vec![]])?),
            )?;
        }
    }
    Ok(ctx)
}

/// Run one query and collect its batches.
pub async fn query(ctx: &SessionContext, sql: &str) -> Result<Vec<RecordBatch>, AnalysisError> {
    Ok(ctx.sql(sql).await?.collect().await?)
}

fn column(batch: &RecordBatch, name: &str, to: &DataType) -> Option<ArrayRef> {
    let idx = batch.schema().index_of(name).ok()?;
    cast(batch.column(idx), to).ok()
}

/// Column `name` of every row, as f64 (None for nulls).
pub fn f64s(batches: &[RecordBatch], name: &str) -> Vec<Option<f64>> {
    let mut out = Vec::new();
    for b in batches {
        if let Some(a) = column(b, name, &DataType::Float64) {
            if let Some(a) = a.as_any().downcast_ref::<Float64Array>() {
                out.extend((0..a.len()).map(|i| (!a.is_null(i)).then(|| a.value(i))));
            }
        }
    }
    out
}

/// Column `name` of every row, as u64 (nulls and negatives as 0).
pub fn u64s(batches: &[RecordBatch], name: &str) -> Vec<u64> {
    let mut out = Vec::new();
    for b in batches {
        if let Some(a) = column(b, name, &DataType::Int64) {
            if let Some(a) = a.as_any().downcast_ref::<Int64Array>() {
                out.extend((0..a.len()).map(|i| {
                    if a.is_null(i) {
                        0
                    } else {
                        a.value(i).max(0) as u64
                    }
                }));
            }
        }
    }
    out
}

/// Column `name` of every row, as i64 (None for nulls).
pub fn i64s(batches: &[RecordBatch], name: &str) -> Vec<Option<i64>> {
    let mut out = Vec::new();
    for b in batches {
        if let Some(a) = column(b, name, &DataType::Int64) {
            if let Some(a) = a.as_any().downcast_ref::<Int64Array>() {
                out.extend((0..a.len()).map(|i| (!a.is_null(i)).then(|| a.value(i))));
            }
        }
    }
    out
}

/// Column `name` of every row, as strings (None for nulls).
pub fn strings(batches: &[RecordBatch], name: &str) -> Vec<Option<String>> {
    let mut out = Vec::new();
    for b in batches {
        if let Some(a) = column(b, name, &DataType::Utf8) {
            if let Some(a) = a.as_any().downcast_ref::<StringArray>() {
                out.extend((0..a.len()).map(|i| (!a.is_null(i)).then(|| a.value(i).to_string())));
            }
        }
    }
    out
}

fn sql_str(s: &str) -> String {
    format!("'{}'", s.replace('\'', "''"))
}

/// The week's evidence for `model` over `span`. `request_kl_limit`: the limit in force
/// (splits healthy from triggering shadow-KL samples).
pub async fn analyse(
    ctx: &SessionContext,
    model: &str,
    span: Span,
    request_kl_limit: f64,
) -> Result<Evidence, AnalysisError> {
    let filter = format!(
        "model = {} AND CAST(ts AS BIGINT) >= {} AND CAST(ts AS BIGINT) < {}",
        sql_str(&model_partition(model)),
        span.since_ms,
        span.until_ms
    );
    let groups = query(
        ctx,
        &format!(
            r#"SELECT "group",
                COUNT(*) AS windows,
                SUM(tokens) AS tokens,
                SUM(outliers) AS outliers,
                approx_percentile_cont(0.5) WITHIN GROUP (ORDER BY outlier_rate) AS rate_p50,
                approx_percentile_cont(0.95) WITHIN GROUP (ORDER BY outlier_rate) AS rate_p95,
                MAX(outlier_rate) AS rate_max,
                SUM(CASE WHEN in_float THEN 1 ELSE 0 END) AS float_windows,
                SUM(CASE WHEN wanted_unavailable THEN 1 ELSE 0 END) AS unavailable_windows,
                last_value(residency ORDER BY ts) AS residency
            FROM (SELECT DISTINCT event_id, "group", ts, tokens, outliers, outlier_rate,
                         in_float, wanted_unavailable, residency
                  FROM window_groups WHERE {filter})
            GROUP BY "group" ORDER BY "group""#
        ),
    )
    .await?;
    let decisions = query(
        ctx,
        &format!(
            r#"SELECT "group", granularity, reason, action, COUNT(*) AS n
            FROM (SELECT DISTINCT event_id, "group", granularity, reason, action
                  FROM fallback_events WHERE {filter})
            GROUP BY "group", granularity, reason, action
            ORDER BY "group", granularity, reason, action"#
        ),
    )
    .await?;
    let kl = query(
        ctx,
        &format!(
            r#"SELECT COUNT(*) AS n,
                approx_percentile_cont(0.5) WITHIN GROUP (ORDER BY kl) AS p50,
                approx_percentile_cont(0.9) WITHIN GROUP (ORDER BY kl) AS p90,
                approx_percentile_cont(0.99) WITHIN GROUP (ORDER BY kl) AS p99,
                MAX(kl) AS max,
                SUM(CASE WHEN kl <= {request_kl_limit} THEN 1 ELSE 0 END) AS healthy,
                SUM(CASE WHEN kl_reference = 'partial_float_weights' THEN 1 ELSE 0 END) AS partial
            FROM (SELECT DISTINCT event_id, sample, kl, kl_reference FROM shadow_kl WHERE {filter})"#
        ),
    )
    .await?;
    let healthy = query(
        ctx,
        &format!(
            r#"SELECT approx_percentile_cont(0.99) WITHIN GROUP (ORDER BY kl) AS p99
            FROM (SELECT DISTINCT event_id, sample, kl FROM shadow_kl
                  WHERE {filter} AND kl <= {request_kl_limit})"#
        ),
    )
    .await?;
    let windows = query(
        ctx,
        &format!(
            r#"SELECT COUNT(*) AS n, SUM(request_kl_fallbacks) AS request_kl,
                      MAX(CAST(ts AS BIGINT)) AS last_ms
            FROM (SELECT DISTINCT event_id, request_kl_fallbacks, ts FROM windows WHERE {filter})"#
        ),
    )
    .await?;
    let configs = query(
        ctx,
        &format!(
            r#"SELECT SUM(CASE WHEN action = 'applied' THEN 1 ELSE 0 END) AS applied,
                      SUM(CASE WHEN action <> 'applied' THEN 1 ELSE 0 END) AS rejected
            FROM (SELECT DISTINCT event_id, action FROM config_events WHERE {filter})"#
        ),
    )
    .await?;

    let decision_rows: Vec<DecisionRow> = {
        let g = strings(&decisions, "group");
        let gr = strings(&decisions, "granularity");
        let r = strings(&decisions, "reason");
        let a = strings(&decisions, "action");
        let n = u64s(&decisions, "n");
        (0..n.len())
            .map(|i| DecisionRow {
                group: g[i].clone(),
                granularity: gr[i].clone().unwrap_or_default(),
                reason: r[i].clone().unwrap_or_default(),
                action: a[i].clone().unwrap_or_default(),
                count: n[i],
            })
            .collect()
    };
    let mut by_group: BTreeMap<String, GroupEvidence> = BTreeMap::new();
    {
        let name = strings(&groups, "group");
        let windows = u64s(&groups, "windows");
        let tokens = u64s(&groups, "tokens");
        let outliers = u64s(&groups, "outliers");
        let p50 = f64s(&groups, "rate_p50");
        let p95 = f64s(&groups, "rate_p95");
        let max = f64s(&groups, "rate_max");
        let fw = u64s(&groups, "float_windows");
        let uw = u64s(&groups, "unavailable_windows");
        let res = strings(&groups, "residency");
        for i in 0..name.len() {
            let Some(g) = name[i].clone() else { continue };
            by_group.insert(
                g.clone(),
                GroupEvidence {
                    group: g,
                    windows: windows[i],
                    tokens: tokens[i],
                    outliers: outliers[i],
                    rate_p50: p50[i],
                    rate_p95: p95[i],
                    rate_max: max[i],
                    float_windows: fw[i],
                    float_share: fw[i] as f64 / windows[i].max(1) as f64,
                    unavailable_windows: uw[i],
                    residency: res[i].clone().unwrap_or_default(),
                    ..Default::default()
                },
            );
        }
    }
    let mut fallback_events = 0;
    for d in &decision_rows {
        fallback_events += d.count;
        let Some(g) = d.group.as_ref().and_then(|g| by_group.get_mut(g)) else {
            continue;
        };
        match (d.granularity.as_str(), d.action.as_str()) {
            ("layer", "enter") => g.enters += d.count,
            ("layer", "exit") => g.exits += d.count,
            ("layer", "unavailable") => g.unavailable += d.count,
            ("token", _) => g.token_decisions += d.count,
            _ => {}
        }
    }
    let first_f = |b: &[RecordBatch], c: &str| f64s(b, c).first().copied().flatten();
    let first_u = |b: &[RecordBatch], c: &str| u64s(b, c).first().copied().unwrap_or(0);
    Ok(Evidence {
        model: model.to_string(),
        since_ms: span.since_ms,
        until_ms: span.until_ms,
        windows: first_u(&windows, "n"),
        last_window_ms: i64s(&windows, "last_ms").first().copied().flatten(),
        fallback_events,
        request_kl_fallbacks: first_u(&windows, "request_kl"),
        groups: by_group.into_values().collect(),
        kl: KlEvidence {
            samples: first_u(&kl, "n"),
            p50: first_f(&kl, "p50"),
            p90: first_f(&kl, "p90"),
            p99: first_f(&kl, "p99"),
            max: first_f(&kl, "max"),
            healthy_samples: first_u(&kl, "healthy"),
            healthy_p99: first_f(&healthy, "p99"),
            partial_reference: first_u(&kl, "partial"),
        },
        decisions: decision_rows,
        configs_applied: first_u(&configs, "applied"),
        configs_rejected: first_u(&configs, "rejected"),
    })
}
