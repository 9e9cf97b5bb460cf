//! `[evolution]` configuration (the `[kafka]` section of the same file names the brokers and
//! topics).

use crate::forge::{ForgeSettings, GitSettings};
use crate::proposal::Rules;
use serde::{Deserialize, Serialize};
use std::path::PathBuf;
use std::time::Duration;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct EvolutionSettings {
    /// The served model's name, as in the events' `model` field.
    pub model: String,
    /// The model's checkpoint directory: proposals are validated against it exactly as a
    /// hot reload would (empty: schema validation only, with a warning).
    pub checkpoint: Option<PathBuf>,
    /// The lake: a local directory or `s3://…`, `gs://…`, `az://…` (`cloud` feature).
    pub lake: String,
    /// Where the plan in force is read when the repository's base branch has none (path or
    /// URL, as `--sensitive-layers`).
    pub plan: Option<String>,
    /// Kafka consumer group of the ingest.
    pub group_id: String,
    /// Records per lake batch, and the longest a batch collects.
    pub batch_records: usize,
    #[serde(with = "humantime_serde")]
    pub batch_interval: Duration,
    /// Event ids remembered for deduplication across batches.
    pub dedup_capacity: usize,
    /// When runs happen (cron: minute hour day-of-month month day-of-week; UTC).
    pub schedule: String,
    /// How far back a run looks.
    #[serde(with = "humantime_serde")]
    pub window: Duration,
    /// Metrics and health (`/metrics`, `/health`) of the long-running service.
    pub listen: String,
    /// The engine's monitor defaults where the plan says nothing.
    pub trigger_rate: f64,
    pub request_kl_limit: f64,
    pub rules: Rules,
    pub git: GitSettings,
    pub forge: ForgeSettings,
}

impl Default for EvolutionSettings {
    fn default() -> Self {
        Self {
            model: String::new(),
            checkpoint: None,
            lake: "data/lake".into(),
            plan: None,
            group_id: "quantmesh-evolution".into(),
            batch_records: 50_000,
            batch_interval: Duration::from_secs(10),
            dedup_capacity: 1_000_000,
            schedule: "0 3 * * 1".into(),
            window: Duration::from_secs(7 * 24 * 3600),
            listen: "127.0.0.1:9465".into(),
            trigger_rate: 0.01,
            request_kl_limit: 0.02,
            rules: Rules::default(),
            git: GitSettings::default(),
            forge: ForgeSettings::default(),
        }
    }
}

impl EvolutionSettings {
    /// From the `[evolution]` table of a quantmesh config file, then `QUANTMESH_EVOLUTION_*`
    /// environment variables.
    pub fn from_table(table: Option<toml::Table>) -> Result<Self, String> {
        let mut s: Self = match table {
            Some(t) => toml::Value::Table(t)
                .try_into()
                .map_err(|e| format!("[evolution]: {e}"))?,
            None => Self::default(),
        };
        let env = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
        if let Some(v) = env("QUANTMESH_EVOLUTION_MODEL") {
            s.model = v;
        }
        if let Some(v) = env("QUANTMESH_EVOLUTION_LAKE") {
            s.lake = v;
        }
        if let Some(v) = env("QUANTMESH_EVOLUTION_LISTEN") {
            s.listen = v;
        }
        if let Some(v) = env("QUANTMESH_EVOLUTION_CHECKPOINT") {
            s.checkpoint = Some(PathBuf::from(v));
        }
        if let Some(v) = env("QUANTMESH_EVOLUTION_PLAN") {
            s.plan = Some(v);
        }
        if let Some(v) = env("QUANTMESH_EVOLUTION_SCHEDULE") {
            s.schedule = v;
        }
        if let Some(v) = env("QUANTMESH_EVOLUTION_GIT_REMOTE") {
            s.git.remote = v;
        }
        if let Some(v) = env("QUANTMESH_EVOLUTION_FORGE_API") {
            s.forge.api_url = v;
        }
        if let Some(v) = env("QUANTMESH_EVOLUTION_FORGE_KIND") {
            s.forge.kind = toml::Value::String(v.clone()).try_into().map_err(|_| {
                format!("QUANTMESH_EVOLUTION_FORGE_KIND={v:?}: expected none, github or gitea")
            })?;
        }
        if let Some(v) = env("QUANTMESH_EVOLUTION_FORGE_REPOSITORY") {
            s.forge.repository = v;
        }
        Ok(s)
    }

    pub fn validate(&self) -> Result<(), String> {
        if self.model.is_empty() {
            return Err(
                "evolution.model is empty: name the served model (as in the events' `model` field)"
                    .into(),
            );
        }
        if self.batch_records == 0 {
            return Err("evolution.batch_records must be ≥ 1".into());
        }
        self.schedule
            .parse::<croner::Cron>()
            .map_err(|e| format!("evolution.schedule {:?}: {e}", self.schedule))?;
        self.rules.validate()
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    /// The documented example is exactly the defaults (so the file cannot drift from the
    /// code), and validates once a model is named.
    #[test]
    fn the_example_config_is_the_defaults() {
        let text = include_str!("../../../infra/quantmesh.example.toml");
        let all: toml::Table = text.parse().unwrap();
        let section = all["evolution"].as_table().cloned();
        let mut s = EvolutionSettings::from_table(section).unwrap();
        assert_eq!(s, EvolutionSettings::default());
        assert!(s.validate().unwrap_err().contains("evolution.model"));
        s.model = "m".into();
        s.validate().unwrap();
        s.schedule = "every tuesday".into();
        assert!(s.validate().unwrap_err().contains("evolution.schedule"));
    }
}
