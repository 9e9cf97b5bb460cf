//! Every role's settings, section by section, and how they are layered: built-in defaults →
//! TOML file → `QUANTMESH_*` environment (flags are applied by the binary).

use crate::mesh;
use quantmesh_config::EngineConfig;
use quantmesh_kafka::KafkaSettings;
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Settings {
    pub server: ServerSettings,
    pub model: ModelSettings,
    pub engine: EngineConfig,
    pub log: LogSettings,
    /// Fallback/config events to Kafka through the durable outbox (off while `brokers` is empty).
    pub kafka: KafkaSettings,
    /// Trace export over OTLP (off while no endpoint is set).
    pub telemetry: TelemetrySettings,
    /// The engines `quantmesh gateway` routes to (mesh mode only).
    pub mesh: mesh::MeshSettings,
    /// `[evolution]`: the evolution service's (`quantmesh evolve`); the serving roles check
    /// it like any section and ignore it.
    pub evolution: crate::evolution::EvolutionSettings,
}

/// OTLP transport.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub enum OtlpProtocol {
    /// OTLP over gRPC (collectors listen on 4317).
    #[serde(rename = "grpc")]
    Grpc,
    /// OTLP over HTTP with protobuf bodies (collectors listen on 4318); the
    /// OpenTelemetry specification's default.
    #[default]
    #[serde(rename = "http/protobuf")]
    HttpProtobuf,
}

impl OtlpProtocol {
    pub fn as_str(self) -> &'static str {
        match self {
            OtlpProtocol::Grpc => "grpc",
            OtlpProtocol::HttpProtobuf => "http/protobuf",
        }
    }
}

impl std::str::FromStr for OtlpProtocol {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "grpc" => Ok(OtlpProtocol::Grpc),
            "http/protobuf" => Ok(OtlpProtocol::HttpProtobuf),
            other => Err(format!("{other:?} is not grpc or http/protobuf")),
        }
    }
}

/// `[telemetry]`: where traces go. The standard OpenTelemetry variables win over the file:
/// `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` / `OTEL_EXPORTER_OTLP_ENDPOINT`,
/// `OTEL_EXPORTER_OTLP_TRACES_PROTOCOL` / `OTEL_EXPORTER_OTLP_PROTOCOL`,
/// `OTEL_EXPORTER_OTLP_TRACES_CERTIFICATE` / `OTEL_EXPORTER_OTLP_CERTIFICATE`, `OTEL_SERVICE_NAME`.
/// Sampling (`OTEL_TRACES_SAMPLER[_ARG]`, default parent-based always-on), resource
/// attributes (`OTEL_RESOURCE_ATTRIBUTES`) and batching (`OTEL_BSP_*`) are read by the
/// OpenTelemetry SDK itself.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TelemetrySettings {
    /// Collector URL, e.g. `http://localhost:4317` (gRPC) or `http://localhost:4318`
    /// (HTTP; `/v1/traces` is appended). Unset: no traces, no spans made.
    pub otlp_endpoint: Option<String>,
    pub otlp_protocol: OtlpProtocol,
    /// PEM file of the certificate authority that signed an `https://` collector's
    /// certificate, trusted besides the system's roots (a private CA). Needs the `otlp-tls`
    /// build feature, as any `https://` endpoint does.
    pub otlp_certificate: Option<std::path::PathBuf>,
    /// `service.name` of the exported spans.
    pub service_name: String,
}

impl Default for TelemetrySettings {
    fn default() -> Self {
        Self {
            otlp_endpoint: None,
            otlp_protocol: OtlpProtocol::default(),
            otlp_certificate: None,
            service_name: "quantmesh".into(),
        }
    }
}

/// `Debug` is written by hand: API keys and the admin token print as `<redacted>`.
#[derive(Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ServerSettings {
    pub host: String,
    pub port: u16,
    /// Largest accepted request body.
    pub max_body_bytes: usize,
    /// Longest accepted prompt, in tokens.
    pub max_input_tokens: usize,
    /// Longest prompt + max_tokens, in tokens.
    pub max_total_tokens: usize,
    /// Requests in flight at once (running + waiting in the engine); beyond → 429.
    pub max_concurrent_requests: usize,
    /// Bearer tokens accepted on /v1 routes; empty = no auth.
    pub api_keys: Vec<String>,
    /// Seconds to let in-flight requests finish on SIGINT/SIGTERM.
    pub shutdown_timeout_secs: u64,
    /// HTTP worker threads (0 = one per core, at most 4).
    pub workers: usize,
    /// Who shares the prefix cache: `shared` (everyone: best hit rate), or `per_api_key`
    /// (each API key its own partition, so one tenant cannot learn from time-to-first-token
    /// whether another sent a prompt). A request's `cache_salt` field partitions further.
    pub prefix_cache_isolation: PrefixCacheIsolation,
    /// This process's name in the mesh: when set, every series on its `/metrics` carries
    /// `engine="<name>"` (the gateway's `engine` label names the same engine). Empty = no
    /// label (`QUANTMESH_ENGINE_NAME`).
    pub engine_name: String,
    /// Bearer token for /admin routes. Only from the environment (`QUANTMESH_ADMIN_TOKEN`),
    /// never from a file; unset disables admin routes.
    #[serde(skip)]
    pub admin_token: Option<String>,
}

impl std::fmt::Debug for ServerSettings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        const R: &str = "<redacted>";
        f.debug_struct("ServerSettings")
            .field("host", &self.host)
            .field("port", &self.port)
            .field("max_body_bytes", &self.max_body_bytes)
            .field("max_input_tokens", &self.max_input_tokens)
            .field("max_total_tokens", &self.max_total_tokens)
            .field("max_concurrent_requests", &self.max_concurrent_requests)
            .field("api_keys", &vec![R; self.api_keys.len()])
            .field("shutdown_timeout_secs", &self.shutdown_timeout_secs)
            .field("workers", &self.workers)
            .field("prefix_cache_isolation", &self.prefix_cache_isolation)
            .field("engine_name", &self.engine_name)
            .field("admin_token", &self.admin_token.as_ref().map(|_| R))
            .finish()
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ModelSettings {
    /// What to serve: a model to fetch by name (see `quantmesh model list`), `bundled:tiny`
    /// (`small`, `medium`: the synthetic offline model), or a path to a `.gguf` file, a
    /// directory holding one, or a Hugging Face directory.
    pub source: String,
    /// Where fetched and bundled models are kept.
    pub models_dir: PathBuf,
    /// Name served in /v1/models and expected in requests' `model` field; empty = the
    /// model's own (catalog name, `quantmesh-<size>`, file stem or `_name_or_path`).
    pub name: String,
    /// Fetch (or write, for `bundled:`) the model on first run when it is not there yet.
    pub fetch_if_missing: bool,
    /// The precision plan when no `engine.sensitive_layers` is given: `auto` runs the
    /// pre-screen on the model on first load and caches the result beside it
    /// (`.quantmesh/sensitive_layers.<md5>.r<revision>.json`); `none` serves
    /// `engine.default_residency` everywhere. `--residency` implies `none`.
    pub plan: PlanMode,
    /// Calibration prompts the first-load pre-screen uses (0 = all 304 bundled prompts, about
    /// 4 700 tokens: enough for scale migration, which needs `smoothing_min_tokens`; fewer
    /// prompts start sooner the first time and carry no scale-migration factors).
    pub plan_prompts: usize,
    /// The float budget with the first-load plan, unless `engine.float_budget` is set.
    pub plan_float_budget: quantmesh_types::FloatBudget,
}

/// Where the precision plan comes from when none is given.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum PlanMode {
    /// Pre-screen on first load, cached beside the model.
    #[default]
    Auto,
    /// `engine.default_residency` for every group.
    None,
}

/// Who shares cached prompt pages (see `server.prefix_cache_isolation`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum PrefixCacheIsolation {
    #[default]
    Shared,
    PerApiKey,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum LogFormat {
    #[default]
    Text,
    Json,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LogSettings {
    pub format: LogFormat,
    /// `tracing` filter, e.g. `info` or `quantmesh_engine=debug,info`. `RUST_LOG` wins.
    pub level: String,
}

impl Default for ServerSettings {
    fn default() -> Self {
        Self {
            host: "127.0.0.1".into(),
            port: 8080,
            max_body_bytes: 1 << 20,
            max_input_tokens: 1536,
            max_total_tokens: 2048,
            max_concurrent_requests: 128,
            api_keys: Vec::new(),
            shutdown_timeout_secs: 30,
            workers: 0,
            prefix_cache_isolation: PrefixCacheIsolation::Shared,
            engine_name: String::new(),
            admin_token: None,
        }
    }
}

impl Default for ModelSettings {
    fn default() -> Self {
        Self {
            source: quantmesh_catalog::DEFAULT_MODEL.into(),
            models_dir: PathBuf::from("models"),
            name: String::new(),
            fetch_if_missing: true,
            plan: PlanMode::Auto,
            plan_prompts: 0,
            plan_float_budget: quantmesh_types::FloatBudget::Percent(10.0),
        }
    }
}

impl Default for LogSettings {
    fn default() -> Self {
        Self {
            format: LogFormat::Text,
            level: "info".into(),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum SettingsError {
    #[error("reading config file {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("config file {path}: {message}")]
    Parse { path: PathBuf, message: String },
    #[error("environment variable {var}: {message}")]
    Env { var: String, message: String },
    #[error("invalid setting: {0}")]
    Invalid(String),
}

impl Settings {
    /// Defaults, then `file` (if given), then the environment.
    pub fn load(file: Option<&Path>) -> Result<Self, SettingsError> {
        let mut s = match file {
            Some(path) => {
                let text = std::fs::read_to_string(path).map_err(|source| SettingsError::Read {
                    path: path.into(),
                    source,
                })?;
                toml::from_str(&text).map_err(|e| SettingsError::Parse {
                    path: path.into(),
                    message: e.to_string(),
                })?
            }
            None => Settings::default(),
        };
        s.apply_env(|k| std::env::var(k).ok())?;
        Ok(s)
    }

    /// Apply `QUANTMESH_*` overrides read through `get` (injectable for tests).
    pub fn apply_env(&mut self, get: impl Fn(&str) -> Option<String>) -> Result<(), SettingsError> {
        fn parse<T: std::str::FromStr>(var: &str, v: String) -> Result<T, SettingsError>
        where
            T::Err: std::fmt::Display,
        {
            v.parse().map_err(|e: T::Err| SettingsError::Env {
                var: var.into(),
                message: e.to_string(),
            })
        }
        if let Some(v) = get("QUANTMESH_HOST") {
            self.server.host = v;
        }
        if let Some(v) = get("QUANTMESH_ENGINE_NAME") {
            self.server.engine_name = v;
        }
        if let Some(v) = get("QUANTMESH_PORT") {
            self.server.port = parse("QUANTMESH_PORT", v)?;
        }
        if let Some(v) = get("QUANTMESH_MODEL") {
            self.model.source = v;
        }
        if let Some(v) = get("QUANTMESH_MODELS_DIR") {
            self.model.models_dir = v.into();
        }
        if let Some(v) = get("QUANTMESH_MODEL_NAME") {
            self.model.name = v;
        }
        if let Some(v) = get("QUANTMESH_PLAN") {
            self.model.plan = match v.as_str() {
                "auto" => PlanMode::Auto,
                "none" => PlanMode::None,
                other => {
                    return Err(SettingsError::Env {
                        var: "QUANTMESH_PLAN".into(),
                        message: format!("{other:?} is not auto or none"),
                    })
                }
            };
        }
        if let Some(v) = get("QUANTMESH_FLOAT_BUDGET") {
            self.engine.float_budget = parse("QUANTMESH_FLOAT_BUDGET", v)?;
        }
        if let Some(v) = get("QUANTMESH_WEIGHT_BUDGET") {
            self.engine.weight_budget = Some(parse("QUANTMESH_WEIGHT_BUDGET", v)?);
        }
        if let Some(v) = get("QUANTMESH_EMBEDDINGS") {
            self.engine.embeddings = parse("QUANTMESH_EMBEDDINGS", v)?;
        }
        if let Some(v) = get("QUANTMESH_SPLIT_ACTIVATIONS") {
            self.engine.split_activations = parse("QUANTMESH_SPLIT_ACTIVATIONS", v)?;
        }
        if let Some(v) = get("QUANTMESH_WIDE_ACTIVATIONS") {
            self.engine.wide_activations = parse("QUANTMESH_WIDE_ACTIVATIONS", v)?;
        }
        if let Some(v) = get("QUANTMESH_ROTATION_BLOCK") {
            self.engine.rotation_block = parse("QUANTMESH_ROTATION_BLOCK", v)?;
        }
        if let Some(v) = get("QUANTMESH_API_KEYS") {
            self.server.api_keys = v
                .split(',')
                .map(str::trim)
                .filter(|s| !s.is_empty())
                .map(String::from)
                .collect();
        }
        if let Some(v) = get("QUANTMESH_PREFIX_CACHE_ISOLATION") {
            self.server.prefix_cache_isolation = match v.as_str() {
                "shared" => PrefixCacheIsolation::Shared,
                "per_api_key" => PrefixCacheIsolation::PerApiKey,
                other => {
                    return Err(SettingsError::Env {
                        var: "QUANTMESH_PREFIX_CACHE_ISOLATION".into(),
                        message: format!("{other:?} is not shared or per_api_key"),
                    })
                }
            };
        }
        if let Some(v) = get("QUANTMESH_MAX_CONCURRENT_REQUESTS") {
            self.server.max_concurrent_requests = parse("QUANTMESH_MAX_CONCURRENT_REQUESTS", v)?;
        }
        if let Some(v) = get("QUANTMESH_KV_PAGES") {
            self.engine.num_pages = parse("QUANTMESH_KV_PAGES", v)?;
        }
        if let Some(v) = get("QUANTMESH_LOG_FORMAT") {
            self.log.format = match v.as_str() {
                "json" => LogFormat::Json,
                "text" => LogFormat::Text,
                other => {
                    return Err(SettingsError::Env {
                        var: "QUANTMESH_LOG_FORMAT".into(),
                        message: format!("{other:?} is not text or json"),
                    })
                }
            };
        }
        if let Some(v) = get("QUANTMESH_ADMIN_TOKEN") {
            self.server.admin_token = Some(v).filter(|t| !t.is_empty());
        }
        if let Some(v) = get("QUANTMESH_SENSITIVE_LAYERS") {
            self.engine.sensitive_layers = Some(v).filter(|v| !v.is_empty());
        }
        if let Some(v) = get("QUANTMESH_SENSITIVE_LAYERS_OPTIONAL") {
            self.engine.sensitive_layers_optional =
                parse("QUANTMESH_SENSITIVE_LAYERS_OPTIONAL", v)?;
        }
        if let Some(v) = get("QUANTMESH_RELOAD_INTERVAL") {
            self.engine.reload_interval =
                humantime::parse_duration(&v).map_err(|e| SettingsError::Env {
                    var: "QUANTMESH_RELOAD_INTERVAL".into(),
                    message: e.to_string(),
                })?;
        }
        let first = |vars: [&'static str; 2]| {
            vars.into_iter()
                .find_map(|k| get(k).filter(|v| !v.is_empty()).map(|v| (k, v)))
        };
        if let Some((_, v)) = first([
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
            "OTEL_EXPORTER_OTLP_ENDPOINT",
        ]) {
            self.telemetry.otlp_endpoint = Some(v);
        }
        if let Some((var, v)) = first([
            "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
            "OTEL_EXPORTER_OTLP_PROTOCOL",
        ]) {
            self.telemetry.otlp_protocol = parse(var, v)?;
        }
        if let Some((_, v)) = first([
            "OTEL_EXPORTER_OTLP_TRACES_CERTIFICATE",
            "OTEL_EXPORTER_OTLP_CERTIFICATE",
        ]) {
            self.telemetry.otlp_certificate = Some(v.into());
        }
        if let Some(v) = get("OTEL_SERVICE_NAME").filter(|v| !v.is_empty()) {
            self.telemetry.service_name = v;
        }
        if let Some(v) = get("QUANTMESH_ENGINES").filter(|v| !v.is_empty()) {
            self.mesh.engines = v.split(',').map(|e| e.trim().to_string()).collect();
        }
        if let Some(v) = get("QUANTMESH_LOG_LEVEL") {
            self.log.level = v;
        }
        if let Some(v) = get("QUANTMESH_KAFKA_BROKERS") {
            self.kafka.brokers = v;
        }
        if let Some(v) = get("QUANTMESH_KAFKA_TOPIC") {
            self.kafka.topic = v;
        }
        if let Some(v) = get("QUANTMESH_KAFKA_CONFIG_TOPIC") {
            self.kafka.config_topic = v;
        }
        if let Some(v) = get("QUANTMESH_KAFKA_WINDOW_TOPIC") {
            self.kafka.window_topic = v;
        }
        if let Some(v) = get("QUANTMESH_KAFKA_REQUIRED") {
            self.kafka.required = parse("QUANTMESH_KAFKA_REQUIRED", v)?;
        }
        if let Some(v) = get("QUANTMESH_OUTBOX_DIR") {
            self.kafka.outbox_dir = v.into();
        }
        if let Some(v) = get("QUANTMESH_OUTBOX_MAX_BYTES") {
            self.kafka.outbox_max_bytes = parse("QUANTMESH_OUTBOX_MAX_BYTES", v)?;
        }
        if let Some(v) = get("QUANTMESH_OUTBOX_MIN_FREE_BYTES") {
            self.kafka.outbox_min_free_bytes = parse("QUANTMESH_OUTBOX_MIN_FREE_BYTES", v)?;
        }
        Ok(())
    }

    pub fn validate(&self) -> Result<(), SettingsError> {
        let s = &self.server;
        if s.max_input_tokens == 0 || s.max_total_tokens <= s.max_input_tokens {
            return Err(SettingsError::Invalid(
                "server.max_total_tokens must exceed server.max_input_tokens > 0".into(),
            ));
        }
        if s.max_concurrent_requests == 0 {
            return Err(SettingsError::Invalid(
                "server.max_concurrent_requests must be > 0".into(),
            ));
        }
        if s.max_body_bytes < 64 {
            return Err(SettingsError::Invalid(
                "server.max_body_bytes must be at least 64".into(),
            ));
        }
        self.kafka.validate().map_err(SettingsError::Invalid)?;
        self.engine
            .validate()
            .map_err(|e| SettingsError::Invalid(e.to_string()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formatted_settings_hold_no_secret() {
        let mut s = Settings::default();
        s.server.api_keys = vec!["sk-api-key-one".into(), "sk-api-key-two".into()];
        s.server.admin_token = Some("admin-secret-token".into());
        for (k, v) in [
            ("sasl.password", "kafka-sasl-password"),
            ("sasl.oauthbearer.config", "kafka-bearer-token"),
            ("ssl.key.password", "kafka-key-password"),
            ("security.protocol", "SASL_SSL"),
        ] {
            s.kafka.properties.insert(k.into(), v.into());
        }
        for text in [format!("{s:?}"), format!("{s:#?}")] {
            for secret in [
                "sk-api-key-one",
                "sk-api-key-two",
                "admin-secret-token",
                "kafka-sasl-password",
                "kafka-key-password",
                "kafka-bearer-token",
            ] {
                assert!(!text.contains(secret), "{secret} printed in {text}");
            }
            // What is not secret still prints (the output stays useful).
            assert!(
                text.contains("SASL_SSL") && text.contains("<redacted>"),
                "{text}"
            );
        }
    }

    #[test]
    fn file_then_env() {
        let dir = tempfile_dir();
        let path = dir.join("q.toml");
        std::fs::write(
            &path,
            "[server]\nport = 9000\nmax_concurrent_requests = 3\n[engine]\nnum_pages = 64\n",
        )
        .unwrap();
        let mut s: Settings = toml::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        assert_eq!(s.server.port, 9000);
        assert_eq!(s.engine.num_pages, 64);
        s.apply_env(|k| (k == "QUANTMESH_PORT").then(|| "9100".to_string()))
            .unwrap();
        assert_eq!(s.server.port, 9100);
        assert!(s
            .apply_env(|k| (k == "QUANTMESH_PORT").then(|| "x".to_string()))
            .is_err());
        assert!(
            toml::from_str::<Settings>("[server]\nprot = 1\n").is_err(),
            "unknown keys are rejected"
        );
        let _ = std::fs::remove_dir_all(dir);
    }

    #[test]
    fn split_activations_kv_scale_and_tables_from_file_and_env() {
        use quantmesh_config::{KvScale, SplitActivations};
        let mut s: Settings =
            toml::from_str("[engine]\nsplit_activations = \"copyless\"\nkv_scale = \"head\"\n")
                .unwrap();
        assert_eq!(s.engine.split_activations, SplitActivations::Copyless);
        assert_eq!(s.engine.kv_scale, KvScale::Head);
        s.apply_env(|k| (k == "QUANTMESH_SPLIT_ACTIVATIONS").then(|| "all".to_string()))
            .unwrap();
        assert_eq!(s.engine.split_activations, SplitActivations::All);
        let err = s
            .apply_env(|k| (k == "QUANTMESH_SPLIT_ACTIVATIONS").then(|| "some".to_string()))
            .unwrap_err()
            .to_string();
        assert!(err.contains("QUANTMESH_SPLIT_ACTIVATIONS"), "{err}");
        assert!(toml::from_str::<Settings>("[engine]\nsplit_activations = \"yes\"\n").is_err());
        assert_eq!(
            Settings::default().engine.split_activations,
            SplitActivations::Auto
        );
        let s: Settings =
            toml::from_str("[engine]\nsplit_activations = \"auto\"\nrotation_block = 32\n")
                .unwrap();
        assert_eq!(s.engine.split_activations, SplitActivations::Auto);
        assert_eq!(s.engine.rotation_block, 32);
        // Wide groups' ratio: default, file, env; a negative one refused.
        assert_eq!(s.engine.wide_activations, 2.0);
        let mut s: Settings = toml::from_str("[engine]\nwide_activations = 1.5\n").unwrap();
        assert_eq!(s.engine.wide_activations, 1.5);
        s.apply_env(|k| (k == "QUANTMESH_WIDE_ACTIVATIONS").then(|| "0".to_string()))
            .unwrap();
        assert_eq!(s.engine.wide_activations, 0.0);
        assert!(
            toml::from_str::<Settings>("[engine]\nwide_activations = -1\n")
                .unwrap()
                .validate()
                .is_err()
        );
        assert!(
            toml::from_str::<Settings>("[engine]\nrotation_block = 48\n")
                .unwrap()
                .validate()
                .is_err()
        );
        // The vocabulary tables: file, env, default `auto`, bad values refused by name.
        use quantmesh_config::EmbeddingDtype;
        let mut s: Settings = toml::from_str("[engine]\nembeddings = \"f16\"\n").unwrap();
        assert_eq!(s.engine.embeddings, EmbeddingDtype::F16);
        s.apply_env(|k| (k == "QUANTMESH_EMBEDDINGS").then(|| "q8_0".to_string()))
            .unwrap();
        assert_eq!(s.engine.embeddings, EmbeddingDtype::Q8_0);
        let err = s
            .apply_env(|k| (k == "QUANTMESH_EMBEDDINGS").then(|| "int4".to_string()))
            .unwrap_err()
            .to_string();
        assert!(err.contains("QUANTMESH_EMBEDDINGS"), "{err}");
        assert_eq!(Settings::default().engine.embeddings, EmbeddingDtype::Auto);
        // The weight budget: file, env, unset by default, bad values refused by name.
        use quantmesh_types::WeightBudget;
        let mut s: Settings = toml::from_str("[engine]\nweight_budget = \"0.38x\"\n").unwrap();
        assert_eq!(s.engine.weight_budget, Some(WeightBudget::Ratio(0.38)));
        s.apply_env(|k| (k == "QUANTMESH_WEIGHT_BUDGET").then(|| "100MiB".to_string()))
            .unwrap();
        assert_eq!(s.engine.weight_budget, Some(WeightBudget::Bytes(100 << 20)));
        let err = s
            .apply_env(|k| (k == "QUANTMESH_WEIGHT_BUDGET").then(|| "half".to_string()))
            .unwrap_err()
            .to_string();
        assert!(err.contains("QUANTMESH_WEIGHT_BUDGET"), "{err}");
        let err = toml::from_str::<Settings>("[engine]\nweight_budget = \"5x\"\n")
            .unwrap_err()
            .to_string();
        assert!(err.contains("weight_budget"), "{err}");
        assert_eq!(Settings::default().engine.weight_budget, None);
    }

    #[test]
    fn otel_variables_win_over_the_file() {
        let mut s: Settings = toml::from_str(
            "[telemetry]\notlp_endpoint = \"http://file:4318\"\notlp_protocol = \"http/protobuf\"\n",
        )
        .unwrap();
        assert_eq!(
            s.telemetry.otlp_endpoint.as_deref(),
            Some("http://file:4318")
        );
        let env = |vars: &'static [(&'static str, &'static str)]| {
            move |k: &str| {
                vars.iter()
                    .find(|(n, _)| *n == k)
                    .map(|(_, v)| v.to_string())
            }
        };
        s.apply_env(env(&[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://base:4317"),
            ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://traces:4317"),
            ("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc"),
            ("OTEL_SERVICE_NAME", "qm-a"),
        ]))
        .unwrap();
        // The signal-specific variable wins over the general one.
        assert_eq!(
            s.telemetry.otlp_endpoint.as_deref(),
            Some("http://traces:4317")
        );
        assert_eq!(s.telemetry.otlp_protocol, OtlpProtocol::Grpc);
        assert_eq!(s.telemetry.service_name, "qm-a");
        let err = s
            .apply_env(env(&[("OTEL_EXPORTER_OTLP_PROTOCOL", "http/json")]))
            .unwrap_err()
            .to_string();
        assert!(err.contains("OTEL_EXPORTER_OTLP_PROTOCOL"), "{err}");
        assert!(toml::from_str::<Settings>("[telemetry]\notlp_protocol = \"udp\"\n").is_err());
    }

    fn tempfile_dir() -> PathBuf {
        let d = std::env::temp_dir().join(format!("qm-settings-{}", std::process::id()));
        std::fs::create_dir_all(&d).unwrap();
        d
    }
}

#[cfg(test)]
mod example_file {
    use super::*;

    /// The documented example must parse and equal the built-in defaults.
    #[test]
    fn example_config_is_the_defaults() {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../infra/quantmesh.example.toml"
        );
        let text = std::fs::read_to_string(path).unwrap();
        let s: Settings = toml::from_str(&text).unwrap();
        let d = Settings::default();
        assert_eq!(toml::to_string(&s).unwrap(), toml::to_string(&d).unwrap());
        // `[evolution]` validates once a model is named, and refuses a bad schedule.
        let mut e = s.evolution;
        assert!(e.validate().unwrap_err().contains("evolution.model"));
        e.model = "m".into();
        e.validate().unwrap();
        e.schedule = "every tuesday".into();
        assert!(e.validate().unwrap_err().contains("evolution.schedule"));
    }
}
