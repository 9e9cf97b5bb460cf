//! What can go wrong in the analysis.

#[derive(Debug, thiserror::Error)]
pub enum AnalysisError {
    #[error("query engine: {0}")]
    Query(String),
    #[error("lake: {0}")]
    Lake(String),
    #[error("evidence queries (services/evolution/sql/evidence.sql): {0}")]
    Queries(String),
    #[error("evidence file {path}: {reason}")]
    File { path: String, reason: String },
}

impl From<datafusion::error::DataFusionError> for AnalysisError {
    fn from(e: datafusion::error::DataFusionError) -> Self {
        AnalysisError::Query(e.to_string())
    }
}
