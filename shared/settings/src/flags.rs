//! Command-line flags of the serving roles: they override the file and the environment.

use crate::{LogFormat, PlanMode, Settings, SettingsError};
use std::path::PathBuf;

/// Command-line flags of the serving binaries (`quantmesh serve`, `quantmesh engine`).
/// They override the file and the environment.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct ServeFlags {
    #[command(flatten)]
    pub listen: ListenFlags,
    /// What to serve [default: smollm2-135m-instruct, fetched into --models-dir on first
    /// run]: a model name from `quantmesh model list`; a path to a .gguf file, a directory
    /// holding one, or a Hugging Face directory (config.json, *.safetensors,
    /// tokenizer.json); or `bundled:tiny` (`small`, `medium`) for the synthetic model with
    /// random weights, written on first run: offline work and tests, no download.
    #[arg(long)]
    pub model: Option<String>,
    /// Where fetched and bundled models are kept [default: models].
    #[arg(long)]
    pub models_dir: Option<PathBuf>,
    /// Name clients use in the `model` field [default: the model's own name, e.g.
    /// smollm2-135m-instruct or quantmesh-tiny].
    #[arg(long)]
    pub model_name: Option<String>,
    /// Residency of every linear group: int8 (smallest), dual (INT8 + float copy,
    /// switchable) or float. Replaces the first-load plan (implies `--plan none`).
    #[arg(long)]
    pub residency: Option<quantmesh_types::Residency>,
    /// Precision plan when no --sensitive-layers is given: `auto` [default] pre-screens the
    /// model on first load and caches the plan beside it; `none` serves --residency
    /// (default dual) everywhere.
    #[arg(long, value_enum, env = "QUANTMESH_PLAN")]
    pub plan: Option<PlanMode>,
    /// Most memory the float copies may take: `unlimited`, a share of the INT8 weights
    /// (`10%`) or bytes (`64MiB`) [default: 10% with the first-load plan, else unlimited].
    #[arg(long, env = "QUANTMESH_FLOAT_BUDGET")]
    pub float_budget: Option<quantmesh_types::FloatBudget>,
    /// Resident weight bytes for the first-load plan: bytes (`100MiB`) or a share of the
    /// all-16-bit model (`0.38x`); the pre-screen puts each group in 4 or 8 bits to fit,
    /// least predicted quality loss first [default: unset, the rules' 8-bit classes].
    #[arg(long, env = "QUANTMESH_WEIGHT_BUDGET")]
    pub weight_budget: Option<quantmesh_types::WeightBudget>,
    /// Quantized-path rows whose activations carry ≈ 16 bits (no extra memory): `auto`
    /// [default] (measured at start: `copyless` where 16-bit activations cost at least
    /// 1.15x the 8-bit product on this CPU; else, for a plan with 4-bit groups,
    /// `copyless_q4` where they cost at least 1.15x the 4-bit product at one row; else
    /// `all`; logged), `all` (INT8 weights and the Q8_0 lm_head served W8A16), `copyless`
    /// (8-bit activations; 16 bits for rows that want float in a group without a float
    /// copy, and for wide groups), `copyless_q4` (`copyless` on the 4-bit groups, every Q8_0
    /// group wide) or `off` (plain W8A8).
    #[arg(long, env = "QUANTMESH_SPLIT_ACTIVATIONS")]
    pub split_activations: Option<quantmesh_config::SplitActivations>,
    /// Under `copyless` (and `copyless_q4`), carry every row of a group at 16-bit activations when the plan
    /// measured its 8-bit activations costing at least this many times its 8-bit weights'
    /// own output error on the calibration rows; 0: no group [default: 2].
    #[arg(long, env = "QUANTMESH_WIDE_ACTIVATIONS")]
    pub wide_activations: Option<f64>,
    /// Rotate activations in Walsh–Hadamard blocks of this many channels (a power of two;
    /// the quantized weights rotated to match at load, float copies untouched) before the
    /// quantized path quantizes them to 8 bits: an outlier channel no longer sets its
    /// block's step alone. 0: none [default: 128].
    #[arg(long, env = "QUANTMESH_ROTATION_BLOCK")]
    pub rotation_block: Option<u32>,
    /// How the token embedding and lm_head are stored: `auto` [default] (f16 when their
    /// bytes beyond Q8_0 fit in the float budget, which serves them first; else q8_0),
    /// `q8_0`, `q4_s8`, `f16` or `f32` (16-bit tables are charged to the float budget; a
    /// plan's `tables`, written by a weight budget, wins).
    #[arg(long, env = "QUANTMESH_EMBEDDINGS")]
    pub embeddings: Option<quantmesh_config::EmbeddingDtype>,
    /// sensitive_layers.json to serve with: a path, or an object-store URL (file://; s3://,
    /// gs://, az:// in builds with `--features cloud`). Polled for changes and applied
    /// without restart; SIGHUP or `POST /admin/config/reload` reloads at once.
    #[arg(long, env = "QUANTMESH_SENSITIVE_LAYERS")]
    pub sensitive_layers: Option<String>,
    /// Start even when --sensitive-layers has no object yet (an empty plan store): serve the
    /// first-load plan (--plan auto) or --residency until a plan is published there, then
    /// hot-reload it. Without it a missing plan fails the start. Env
    /// `QUANTMESH_SENSITIVE_LAYERS_OPTIONAL`, file `engine.sensitive_layers_optional`.
    #[arg(long)]
    pub sensitive_layers_optional: bool,
    /// How often to poll --sensitive-layers, e.g. `30s`, `500ms`, `2m` [default: 30s].
    #[arg(long, value_parser = humantime::parse_duration)]
    pub reload_interval: Option<std::time::Duration>,
    /// Kafka bootstrap brokers, HOST:PORT[,HOST:PORT…]: every fallback and config event is
    /// stored in a durable outbox and relayed there (at-least-once). Unset: events go to
    /// the log only. Env `QUANTMESH_KAFKA_BROKERS`, file `kafka.brokers`.
    #[arg(long)]
    pub kafka_brokers: Option<String>,
    /// Topic of fallback events [default: quantmesh.fallback-events.v1]; config events go
    /// to `kafka.config_topic` [default: quantmesh.config-events.v1], monitor windows to
    /// `kafka.window_topic` [default: quantmesh.monitor-windows.v1].
    #[arg(long)]
    pub kafka_topic: Option<String>,
    /// Refuse to start when no broker answers (default: serve, keep events in the outbox).
    #[arg(long)]
    pub kafka_required: bool,
    /// Directory of the durable event outbox [default: data/outbox].
    #[arg(long)]
    pub outbox_dir: Option<PathBuf>,
}

/// `quantmesh gateway`: the OpenAI API in front of engine processes.
#[derive(Debug, Clone, clap::Args)]
pub struct GatewayFlags {
    #[command(flatten)]
    pub listen: ListenFlags,
    /// An engine's base URL, e.g. `http://127.0.0.1:8081`, or a DNS name whose every
    /// address is an engine, e.g. `dns+http://engine:8080` (re-resolved every
    /// `mesh.discovery_interval`) (repeat for each; env `QUANTMESH_ENGINES`,
    /// comma-separated; file `mesh.engines`).
    #[arg(long = "engine")]
    pub engines: Vec<String>,
    /// How requests are spread: least-outstanding (with prefix affinity) or random.
    #[arg(long, value_enum)]
    pub routing: Option<crate::mesh::Routing>,
    /// Requests in flight per engine before it counts as saturated [default: 64].
    #[arg(long)]
    pub max_outstanding: Option<usize>,
}

/// What every serving process takes: the config file, where to listen, the log format.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct ListenFlags {
    /// TOML config file; keys as in infra/quantmesh.example.toml. Env `QUANTMESH_*` overrides
    /// the file, flags override both.
    #[arg(long, env = "QUANTMESH_CONFIG")]
    pub config: Option<PathBuf>,
    /// Address to listen on [default: 127.0.0.1].
    #[arg(long)]
    pub host: Option<String>,
    /// Port to listen on [default: 8080].
    #[arg(long)]
    pub port: Option<u16>,
    /// Log format [default: text].
    #[arg(long, value_enum)]
    pub log_format: Option<LogFormat>,
}

impl ListenFlags {
    /// Defaults → file → environment → these flags (not yet validated).
    fn settings(&self) -> Result<Settings, SettingsError> {
        let mut s = Settings::load(self.config.as_deref())?;
        if let Some(h) = &self.host {
            s.server.host = h.clone();
        }
        if let Some(p) = self.port {
            s.server.port = p;
        }
        if let Some(f) = self.log_format {
            s.log.format = f;
        }
        Ok(s)
    }
}

impl GatewayFlags {
    /// Defaults → file → environment → these flags, validated.
    pub fn settings(&self) -> Result<Settings, SettingsError> {
        let mut s = self.listen.settings()?;
        if !self.engines.is_empty() {
            s.mesh.engines = self.engines.clone();
        }
        if let Some(r) = self.routing {
            s.mesh.routing = r;
        }
        if let Some(m) = self.max_outstanding {
            s.mesh.max_outstanding = m;
        }
        s.validate()?;
        s.mesh.validate().map_err(SettingsError::Invalid)?;
        Ok(s)
    }
}

impl ServeFlags {
    /// Defaults → file → environment → these flags, validated.
    pub fn settings(&self) -> Result<Settings, SettingsError> {
        let mut s = self.listen.settings()?;
        if let Some(m) = &self.model {
            s.model.source = m.clone();
        }
        if let Some(d) = &self.models_dir {
            s.model.models_dir = d.clone();
        }
        if let Some(n) = &self.model_name {
            s.model.name = n.clone();
        }
        if let Some(r) = self.residency {
            s.engine.default_residency = r;
            s.model.plan = PlanMode::None;
        }
        if let Some(p) = self.plan {
            s.model.plan = p;
        }
        if let Some(b) = self.float_budget {
            s.engine.float_budget = b;
        }
        if let Some(b) = self.weight_budget {
            s.engine.weight_budget = Some(b);
        }
        if let Some(e) = self.embeddings {
            s.engine.embeddings = e;
        }
        if let Some(m) = self.split_activations {
            s.engine.split_activations = m;
        }
        if let Some(r) = self.wide_activations {
            s.engine.wide_activations = r;
        }
        if let Some(b) = self.rotation_block {
            s.engine.rotation_block = b;
        }
        if let Some(p) = &self.sensitive_layers {
            s.engine.sensitive_layers = Some(p.clone());
        }
        if self.sensitive_layers_optional {
            s.engine.sensitive_layers_optional = true;
        }
        if let Some(i) = self.reload_interval {
            s.engine.reload_interval = i;
        }
        if let Some(b) = &self.kafka_brokers {
            s.kafka.brokers = b.clone();
        }
        if let Some(t) = &self.kafka_topic {
            s.kafka.topic = t.clone();
        }
        if self.kafka_required {
            s.kafka.required = true;
        }
        if let Some(d) = &self.outbox_dir {
            s.kafka.outbox_dir = d.clone();
        }
        s.validate()?;
        Ok(s)
    }
}
