//! The weekly analysis: the evidence queries over the lake, and the evidence they yield.
//!
//! Every number the proposal rules use comes from one of the queries in
//! `services/evolution/sql/evidence.sql`, kept as portable SQL text so that the same
//! analysis runs on DataFusion here and on Spark (`infra/spark/evidence.py`) when a week of
//! events outgrows one machine. Either engine's rows are an [`EvidenceFile`]; the rows become
//! the [`Evidence`] the rules read in one place ([`Evidence::from_tables`]), so both engines
//! give the same proposal from the same rows.
//!
//! * [`queries`] — the SQL text and its placeholders.
//! * [`tables`] — the rows each query returns and the evidence file that carries them.
//! * [`evidence`] — what the rules see, assembled from the rows.
//! * [`lake_sql`] — DataFusion over the lake: the session and the run of the queries.

mod error;
pub mod evidence;
pub mod lake_sql;
pub mod queries;
pub mod tables;

pub use error::AnalysisError;
pub use evidence::{DecisionRow, Evidence, GroupEvidence, KlEvidence};
pub use lake_sql::{analyse, evidence_tables, query, rows, session};
pub use tables::{EvidenceFile, EvidenceTables, Span, EVIDENCE_FORMAT};
