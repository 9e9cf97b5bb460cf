//! One evolution run end to end, and the schedule that repeats it.

use crate::analysis::{self, Evidence, EvidenceFile, Span};
use crate::forge::{Checkout, Forge, PrOutcome};
use crate::lake::tables::model_partition;
use crate::lake::Lake;
use crate::metrics::EvolutionMetrics;
use crate::proposal::{self, EngineDefaults, Proposal};
use crate::settings::EvolutionSettings;
use quantmesh_types::SensitiveLayers;
use std::time::Instant;

#[derive(Debug, thiserror::Error)]
pub enum RunError {
    #[error(transparent)]
    Analysis(#[from] analysis::AnalysisError),
    #[error(transparent)]
    Forge(#[from] crate::forge::ForgeError),
    #[error("the plan in force ({0}) is not readable: {1}")]
    CurrentPlan(String, String),
    #[error("the proposal does not validate: {0}")]
    Invalid(String),
    #[error("checkpoint {0}: {1}")]
    Checkpoint(String, String),
    #[error("evidence file {0}: {1}")]
    Evidence(String, String),
}

/// Where a run's evidence comes from.
#[derive(Clone)]
pub enum EvidenceSource<'a> {
    /// The lake, analysed here with DataFusion over `span`.
    Lake { lake: &'a Lake, span: Span },
    /// Evidence tables another engine computed over the same lake (Spark's job writes
    /// them), read from `path`; the span is the file's.
    File {
        path: String,
        file: Box<EvidenceFile>,
    },
}

/// What a run did.
#[derive(Debug, Clone)]
pub struct RunReport {
    pub evidence: Evidence,
    /// The evidence tables the evidence was assembled from (what `--evidence-out` writes).
    pub tables: EvidenceFile,
    /// Which engine computed them, and where (for the report).
    pub evidence_from: String,
    pub proposal: Proposal,
    /// `None` on a dry run.
    pub outcome: Option<PrOutcome>,
    pub analysis_ms: u128,
}

impl RunReport {
    /// The evidence and the changes, as the dry run prints them and the PR carries them.
    pub fn markdown(&self, current: &SensitiveLayers) -> String {
        let when = |ms: i64| {
            chrono::DateTime::<chrono::Utc>::from_timestamp_millis(ms)
                .unwrap_or_default()
                .to_rfc3339_opts(chrono::SecondsFormat::Secs, true)
        };
        let mut s = format!(
            "## quantmesh evolution: `{}`, {} → {}\n\n### Changes\n\n{}",
            self.evidence.model,
            when(self.evidence.since_ms),
            when(self.evidence.until_ms),
            proposal::changes_table(&self.proposal)
        );
        if !self.proposal.too_little_evidence.is_empty() {
            s.push_str("\nLeft alone for lack of evidence:\n");
            for t in &self.proposal.too_little_evidence {
                s.push_str(&format!("- {t}\n"));
            }
        }
        s.push_str("\n### Evidence\n\n");
        s.push_str(&proposal::evidence_table(&self.evidence, current));
        s.push_str(&format!(
            "\nEvidence from {}. Queries: `services/evolution/sql/evidence.sql`; rules: `services/evolution/src/proposal/mod.rs`.\n",
            self.evidence_from
        ));
        s
    }
}

/// The plan a run starts from: the repository's base branch, else `evolution.plan` (which
/// `quantmesh evolve` fills from the config's `engine.sensitive_layers` when unset), else an
/// empty plan (the engine's defaults).
async fn current_plan(
    s: &EvolutionSettings,
    checkout: Option<&Checkout>,
) -> Result<SensitiveLayers, RunError> {
    if let Some(bytes) = checkout.and_then(Checkout::base_plan) {
        return SensitiveLayers::parse(&bytes).map_err(|e| {
            RunError::CurrentPlan(format!("{}@{}", s.git.plan_path, s.git.base), e.to_string())
        });
    }
    if let Some(src) = &s.plan {
        let loc = quantmesh_store::Location::parse(src)
            .map_err(|e| RunError::CurrentPlan(src.clone(), e.to_string()))?;
        let bytes = loc
            .read()
            .await
            .map_err(|e| RunError::CurrentPlan(src.clone(), e.to_string()))?;
        return SensitiveLayers::parse(&bytes)
            .map_err(|e| RunError::CurrentPlan(src.clone(), e.to_string()));
    }
    SensitiveLayers::parse(br#"{"schema_version": 1}"#)
        .map_err(|e| RunError::CurrentPlan("(empty)".into(), e.to_string()))
}

/// Validate the proposal as the engine's hot reload would: schema, then the model.
fn validate(s: &EvolutionSettings, p: &Proposal) -> Result<(), RunError> {
    let bytes = p.bytes();
    match &s.checkpoint {
        Some(dir) => {
            let name = dir.display().to_string();
            let ck = quantmesh_model::Checkpoint::open(dir)
                .map_err(|e| RunError::Checkpoint(name.clone(), e.to_string()))?;
            let cfg = quantmesh_model::ModelConfig::load(dir)
                .map_err(|e| RunError::Checkpoint(name.clone(), e.to_string()))?;
            let shape = quantmesh_model::model_shape(&ck, &cfg)
                .map_err(|e| RunError::Checkpoint(name, e.to_string()))?;
            SensitiveLayers::parse_for(&bytes, &shape)
                .map_err(|e| RunError::Invalid(e.to_string()))?;
        }
        None => {
            tracing::warn!(target: "quantmesh::evolution", "evolution.checkpoint is not set: the proposal is checked against the schema only");
            SensitiveLayers::parse(&bytes).map_err(|e| RunError::Invalid(e.to_string()))?;
        }
    }
    Ok(())
}

/// One run over `span`: analyse, propose, validate, and (unless `dry_run`) push and open or
/// update the pull request.
pub async fn run_once(
    s: &EvolutionSettings,
    source: EvidenceSource<'_>,
    dry_run: bool,
    metrics: Option<&EvolutionMetrics>,
) -> Result<(RunReport, SensitiveLayers), RunError> {
    let started = Instant::now();
    let result = run_inner(s, source, dry_run).await;
    if let Some(m) = metrics {
        m.last_run_seconds.set(started.elapsed().as_secs_f64());
        match &result {
            Ok((r, _)) => {
                let label = if r.proposal.changes.is_empty() {
                    "unchanged"
                } else {
                    "proposed"
                };
                m.runs.with_label_values(&[label]).inc();
                m.last_success.set(quantmesh_types::now_ms() as i64 / 1000);
                if let Some(o) = &r.outcome {
                    m.pull_requests.with_label_values(&[o.label()]).inc();
                }
            }
            Err(_) => m.runs.with_label_values(&["failed"]).inc(),
        }
    }
    result
}

/// The evidence tables for this run: computed over the lake, or read from a file that must
/// be for the same model and the same request limit.
async fn evidence_tables(
    s: &EvolutionSettings,
    source: EvidenceSource<'_>,
    limit: f64,
) -> Result<(EvidenceFile, String, u128), RunError> {
    match source {
        EvidenceSource::Lake { lake, span } => {
            tracing::info!(target: "quantmesh::evolution", model = %s.model, lake = %lake.location(), since_ms = span.since_ms, until_ms = span.until_ms, "analysing");
            let t = Instant::now();
            let ctx = analysis::session(lake).await?;
            let tables = analysis::evidence_tables(&ctx, &s.model, span, limit).await?;
            let ms = t.elapsed().as_millis();
            Ok((
                tables,
                format!("DataFusion over the Parquet lake ({ms} ms)"),
                ms,
            ))
        }
        EvidenceSource::File { path, file } => {
            if file.model != s.model {
                return Err(RunError::Evidence(
                    path,
                    format!(
                        "computed for model {:?}, this run is for {:?}",
                        file.model, s.model
                    ),
                ));
            }
            if file.request_kl_limit != limit {
                return Err(RunError::Evidence(
                    path,
                    format!(
                        "split by request_kl_limit {}, the limit in force is {limit} (compute it again with that limit)",
                        file.request_kl_limit
                    ),
                ));
            }
            let from = format!("{} (evidence file {path})", file.engine);
            Ok((*file, from, 0))
        }
    }
}

async fn run_inner(
    s: &EvolutionSettings,
    source: EvidenceSource<'_>,
    dry_run: bool,
) -> Result<(RunReport, SensitiveLayers), RunError> {
    let checkout = if s.git.remote.is_empty() {
        None
    } else {
        let g = s.git.clone();
        Some(
            tokio::task::spawn_blocking(move || Checkout::open(&g))
                .await
                .map_err(|e| {
                    RunError::Forge(crate::forge::ForgeError::Git("clone".into(), e.to_string()))
                })??,
        )
    };
    let current = current_plan(s, checkout.as_ref()).await?;
    let limit = current
        .thresholds
        .request_kl_limit
        .unwrap_or(s.request_kl_limit);
    let (tables, evidence_from, analysis_ms) = evidence_tables(s, source, limit).await?;
    let evidence = Evidence::from_tables(&s.model, tables.span(), &tables.tables);
    tracing::info!(target: "quantmesh::evolution", groups = evidence.groups.len(), windows = evidence.windows, kl_samples = evidence.kl.samples, ms = analysis_ms, "evidence gathered");
    let proposal = proposal::propose(
        &current,
        &evidence,
        &s.rules,
        EngineDefaults {
            trigger_rate: s.trigger_rate,
            request_kl_limit: s.request_kl_limit,
        },
    );
    validate(s, &proposal)?;
    let mut report = RunReport {
        evidence,
        tables,
        evidence_from,
        proposal,
        outcome: None,
        analysis_ms,
    };
    if dry_run {
        return Ok((report, current));
    }
    let Some(checkout) = checkout else {
        tracing::warn!(target: "quantmesh::evolution", "evolution.git.remote is empty: nothing pushed (the proposal is in the log)");
        return Ok((report, current));
    };
    if report.proposal.changes.is_empty() {
        report.outcome = Some(PrOutcome::NothingToPropose);
        return Ok((report, current));
    }
    let body = report.markdown(&current);
    let title = format!(
        "quantmesh evolution: {} change(s) to {} for {}",
        report.proposal.changes.len(),
        s.git.plan_path,
        s.model
    );
    let message = format!("{title}\n\n{}", proposal::changes_table(&report.proposal));
    let bytes = report.proposal.bytes();
    let part = model_partition(&s.model);
    let (branch, pushed) = {
        let (bytes, message) = (bytes.clone(), message.clone());
        tokio::task::spawn_blocking(move || {
            checkout
                .push(&part, &bytes, &message)
                .map(|r| (r, checkout))
        })
        .await
        .map_err(|e| RunError::Forge(crate::forge::ForgeError::Git("push".into(), e.to_string())))?
        .map(|(r, _)| r)?
    };
    let forge = Forge::new(&s.forge)?;
    let outcome = match (pushed, forge) {
        (None, _) => PrOutcome::NothingToPropose,
        (Some(false), None) => PrOutcome::Unchanged { branch },
        (Some(true), None) => PrOutcome::Pushed { branch },
        // The branch already holds this proposal: leave an open PR alone, and do not reopen
        // one a reviewer closed without merging (a changed proposal moves the branch and
        // opens a new one).
        (Some(false), Some(f)) => match f.latest(&branch).await? {
            Some(p) if p.open => PrOutcome::Unchanged { branch },
            Some(p) if !p.merged => PrOutcome::Declined {
                branch,
                number: p.number,
                url: p.url,
            },
            _ => {
                f.open_or_update(&branch, &s.git.base, &title, &body)
                    .await?
            }
        },
        (Some(true), Some(f)) => {
            f.open_or_update(&branch, &s.git.base, &title, &body)
                .await?
        }
    };
    tracing::info!(target: "quantmesh::evolution", ?outcome, "pull request");
    report.outcome = Some(outcome);
    Ok((report, current))
}

/// The next time the schedule fires after `after` (UTC).
pub fn next_run(
    schedule: &str,
    after: chrono::DateTime<chrono::Utc>,
) -> Result<chrono::DateTime<chrono::Utc>, String> {
    schedule
        .parse::<croner::Cron>()
        .map_err(|e| e.to_string())?
        .find_next_occurrence(&after, false)
        .map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn the_default_schedule_is_weekly() {
        let t0 = chrono::DateTime::parse_from_rfc3339("2026-11-24T12:00:00Z")
            .unwrap()
            .with_timezone(&chrono::Utc);
        let a = next_run("0 3 * * 1", t0).unwrap();
        let b = next_run("0 3 * * 1", a).unwrap();
        assert_eq!((b - a).num_days(), 7);
        assert_eq!(a.to_rfc3339(), "2026-11-30T03:00:00+00:00");
        assert!(next_run("not cron", t0).is_err());
    }
}
