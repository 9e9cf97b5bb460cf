//! `[evolution]`: the evolution service's settings (`quantmesh evolve`; the serving roles
//! read and check them like every other section, and ignore them). The `[kafka]` section of
//! the same file names the brokers and topics.

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
    /// URL, as `--sensitive-layers`); unset, `quantmesh evolve` reads the config's
    /// `engine.sensitive_layers`.
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
    /// These settings with the `QUANTMESH_EVOLUTION_*` environment variables applied (an
    /// invalid value is refused by name).
    pub fn with_env(self) -> Result<Self, String> {
        let mut s = self;
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
        self.git.validate()?;
        self.rules.validate()
    }
}

impl GitSettings {
    /// The token variable and the username go into git's credential helper: a variable name
    /// and a plain account name, nothing a shell would read as more.
    pub fn validate(&self) -> Result<(), String> {
        let name = |c: char| c.is_ascii_alphanumeric() || c == '_';
        if !self.token_env.is_empty()
            && (!self.token_env.chars().all(name)
                || self.token_env.starts_with(|c: char| c.is_ascii_digit()))
        {
            return Err(format!(
                "evolution.git.token_env {:?} is not an environment variable name",
                self.token_env
            ));
        }
        if self.username.is_empty()
            || !self
                .username
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || "._@+-".contains(c))
        {
            return Err(format!(
                "evolution.git.username {:?}: letters, digits and . _ @ + - only",
                self.username
            ));
        }
        Ok(())
    }
}

/// `[evolution.git]`: where the plan lives in version control.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct GitSettings {
    /// The repository to push to (URL or path; empty: no pull request, `--dry-run` only).
    pub remote: String,
    /// Local working clone (created on first run).
    pub checkout: PathBuf,
    /// The branch pull requests target.
    pub base: String,
    /// Path of the plan inside the repository.
    pub plan_path: String,
    /// Branch prefix; the model's partition name is appended.
    pub branch_prefix: String,
    pub author_name: String,
    pub author_email: String,
    /// Name of the environment variable holding the token git pushes with over HTTPS (set:
    /// git gets it from a credential helper in its environment, never from a file, the URL or
    /// an argument; unset or empty: git's own credentials, e.g. SSH keys or a local path).
    pub token_env: String,
    /// The username sent with that token (`x-access-token` for GitHub's tokens; Gitea and
    /// Forgejo take the token's owner).
    pub username: String,
}

impl Default for GitSettings {
    fn default() -> Self {
        Self {
            remote: String::new(),
            checkout: PathBuf::from("data/evolution/checkout"),
            base: "main".into(),
            plan_path: "sensitive_layers.json".into(),
            branch_prefix: "quantmesh/evolve/".into(),
            author_name: "quantmesh-evolve".into(),
            author_email: "quantmesh-evolve@localhost".into(),
            token_env: "QUANTMESH_FORGE_TOKEN".into(),
            username: "x-access-token".into(),
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ForgeKind {
    /// Push the branch only.
    None,
    Github,
    /// Gitea and Forgejo (GitHub-compatible pulls API under `/api/v1`).
    Gitea,
}

/// `[evolution.forge]`.
#[derive(Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ForgeSettings {
    pub kind: ForgeKind,
    /// API base: `https://api.github.com`, `https://gitea.example/api/v1`.
    pub api_url: String,
    /// `owner/name`.
    pub repository: String,
    /// Name of the environment variable holding the token (the token itself is never in a
    /// file or a log).
    pub token_env: String,
    pub labels: Vec<String>,
}

impl std::fmt::Debug for ForgeSettings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ForgeSettings")
            .field("kind", &self.kind)
            .field("api_url", &self.api_url)
            .field("repository", &self.repository)
            .field("token_env", &self.token_env)
            .field("labels", &self.labels)
            .finish()
    }
}

impl Default for ForgeSettings {
    fn default() -> Self {
        Self {
            kind: ForgeKind::None,
            api_url: "https://api.github.com".into(),
            repository: String::new(),
            token_env: "QUANTMESH_FORGE_TOKEN".into(),
            labels: vec!["quantmesh".into(), "evolution".into()],
        }
    }
}

/// Rule parameters (`[evolution.rules]`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Rules {
    pub min_windows: u64,
    pub min_tokens: u64,
    pub min_kl_samples: u64,
    pub kl_margin: f64,
    pub kl_limit_bounds: (f64, f64),
    pub kl_min_change: f64,
    pub promote_share: f64,
    pub float_share: f64,
    pub demote_kl: f64,
    pub flap_enters: u64,
    pub max_trigger: f64,
}

impl Default for Rules {
    fn default() -> Self {
        Self {
            min_windows: 20,
            min_tokens: 5_000,
            min_kl_samples: 200,
            kl_margin: 1.5,
            kl_limit_bounds: (0.002, 0.2),
            kl_min_change: 0.1,
            promote_share: 0.25,
            float_share: 0.9,
            demote_kl: 1e-3,
            flap_enters: 4,
            max_trigger: 0.2,
        }
    }
}

impl Rules {
    pub fn validate(&self) -> Result<(), String> {
        let (lo, hi) = self.kl_limit_bounds;
        if !(lo > 0.0 && hi > lo && hi.is_finite()) {
            return Err("evolution.rules.kl_limit_bounds must be (lo, hi) with 0 < lo < hi".into());
        }
        for (n, v) in [
            ("promote_share", self.promote_share),
            ("float_share", self.float_share),
            ("max_trigger", self.max_trigger),
        ] {
            if !(0.0..=1.0).contains(&v) {
                return Err(format!("evolution.rules.{n} = {v}: must be in [0, 1]"));
            }
        }
        if !(self.kl_margin >= 1.0 && self.kl_margin.is_finite()) {
            return Err("evolution.rules.kl_margin must be ≥ 1".into());
        }
        Ok(())
    }
}
