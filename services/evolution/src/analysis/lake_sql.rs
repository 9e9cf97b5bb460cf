//! DataFusion over the lake: the session with the lake's tables, and the evidence queries
//! run into [`EvidenceTables`].

use super::error::AnalysisError;
use super::evidence::Evidence;
use super::queries::{self, Params};
use super::tables::{EvidenceFile, EvidenceTables, Span, EVIDENCE_FORMAT};
use crate::lake::tables::{model_partition, Table};
use crate::lake::Lake;
use datafusion::arrow::array::RecordBatch;
use datafusion::arrow::datatypes::DataType;
use datafusion::datasource::file_format::parquet::ParquetFormat;
use datafusion::datasource::listing::{
    ListingOptions, ListingTable, ListingTableConfig, ListingTableUrl,
};
use datafusion::datasource::MemTable;
use datafusion::prelude::SessionContext;
use futures::TryStreamExt;
use serde::de::DeserializeOwned;
use std::sync::Arc;

/// The engine named in the evidence files this analysis writes.
pub const ENGINE: &str = "datafusion 55";

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

/// The rows of `batches` as `T` (through Arrow's JSON writer: column name = field name, a
/// NULL left out).
pub fn rows<T: DeserializeOwned>(batches: &[RecordBatch]) -> Result<Vec<T>, AnalysisError> {
    let mut writer = datafusion::arrow::json::ArrayWriter::new(Vec::new());
    let refs: Vec<&RecordBatch> = batches.iter().collect();
    writer
        .write_batches(&refs)
        .map_err(|e| AnalysisError::Query(e.to_string()))?;
    writer
        .finish()
        .map_err(|e| AnalysisError::Query(e.to_string()))?;
    let bytes = writer.into_inner();
    if bytes.is_empty() {
        return Ok(Vec::new());
    }
    serde_json::from_slice(&bytes).map_err(|e| AnalysisError::Query(format!("evidence rows: {e}")))
}

/// The evidence queries over the lake for `model` and `span`, as an evidence file.
/// `request_kl_limit`: the limit in force (splits healthy from triggering shadow-KL samples).
pub async fn evidence_tables(
    ctx: &SessionContext,
    model: &str,
    span: Span,
    request_kl_limit: f64,
) -> Result<EvidenceFile, AnalysisError> {
    let partition = model_partition(model);
    let params = Params {
        model_partition: &partition,
        span,
        request_kl_limit,
        ts_ms: queries::DATAFUSION_TS_MS,
    };
    let mut t = EvidenceTables::default();
    for (name, sql) in queries::filled(&params)? {
        let t0 = std::time::Instant::now();
        let b = query(ctx, &sql)
            .await
            .map_err(|e| AnalysisError::Query(format!("query {name}: {e}")))?;
        tracing::info!(target: "quantmesh::evolution", query = %name, ms = t0.elapsed().as_millis() as u64, "evidence query");
        match name.as_str() {
            "groups" => t.groups = rows(&b)?,
            "decisions" => t.decisions = rows(&b)?,
            "kl" => t.kl = rows(&b)?,
            "healthy" => t.healthy = rows(&b)?,
            "windows" => t.windows = rows(&b)?,
            "configs" => t.configs = rows(&b)?,
            other => {
                return Err(AnalysisError::Queries(format!("no table {other:?}")));
            }
        }
    }
    Ok(EvidenceFile {
        format: EVIDENCE_FORMAT.to_string(),
        engine: ENGINE.to_string(),
        model: model.to_string(),
        since_ms: span.since_ms,
        until_ms: span.until_ms,
        request_kl_limit,
        tables: t,
    })
}

/// The week's evidence for `model` over `span` (the tables, assembled).
pub async fn analyse(
    ctx: &SessionContext,
    model: &str,
    span: Span,
    request_kl_limit: f64,
) -> Result<Evidence, AnalysisError> {
    let f = evidence_tables(ctx, model, span, request_kl_limit).await?;
    Ok(Evidence::from_tables(model, span, &f.tables))
}
