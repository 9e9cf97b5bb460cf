//! Model configuration (Hugging Face `config.json`) and engine configuration.

use crate::error::EngineError;
use quantmesh_shared::Residency;
use serde::{Deserialize, Serialize};
use std::path::Path;

/// The subset of a Hugging Face Llama/Qwen2 `config.json` the engine needs.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelConfig {
    #[serde(default = "default_model_type")]
    pub model_type: String,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    #[serde(default)]
    pub num_key_value_heads: Option<usize>,
    #[serde(default)]
    pub head_dim: Option<usize>,
    pub vocab_size: usize,
    #[serde(default = "default_eps")]
    pub rms_norm_eps: f64,
    #[serde(default = "default_theta")]
    pub rope_theta: f64,
    #[serde(default = "default_max_pos")]
    pub max_position_embeddings: usize,
    #[serde(default)]
    pub tie_word_embeddings: bool,
    /// Llama's flag for q/k/v/o biases; Qwen2 always has q/k/v biases.
    #[serde(default)]
    pub attention_bias: bool,
    #[serde(default)]
    pub bos_token_id: Option<u32>,
    #[serde(default)]
    pub eos_token_id: Option<EosIds>,
    #[serde(default)]
    pub torch_dtype: Option<String>,
    /// The model's own name (`_name_or_path` in `config.json`, `general.name` in GGUF).
    #[serde(
        default,
        rename = "_name_or_path",
        skip_serializing_if = "Option::is_none"
    )]
    pub name_or_path: Option<String>,
}

/// `eos_token_id` is a number or a list in the wild.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum EosIds {
    One(u32),
    Many(Vec<u32>),
}

fn default_model_type() -> String {
    "llama".into()
}
fn default_eps() -> f64 {
    1e-5
}
fn default_theta() -> f64 {
    10_000.0
}
fn default_max_pos() -> usize {
    4096
}

impl ModelConfig {
    /// The configuration of the model at `path`: a `.gguf` file (or a directory holding
    /// one), read from its metadata, or a Hugging Face directory's `config.json`.
    pub fn load(path: &Path) -> Result<Self, EngineError> {
        match crate::gguf::find_gguf(path)? {
            Some(file) => crate::gguf::GgufFile::open(&file)?.model_config(),
            None => Self::from_file(&path.join("config.json")),
        }
    }

    pub fn from_file(path: &Path) -> Result<Self, EngineError> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| EngineError::io(format!("reading {}", path.display()), e))?;
        let cfg: ModelConfig = serde_json::from_str(&text).map_err(|e| {
            EngineError::Config(format!("{}: not a valid model config: {e}", path.display()))
        })?;
        cfg.validate()
            .map_err(|m| EngineError::Config(format!("{}: {m}", path.display())))?;
        Ok(cfg)
    }

    pub fn validate(&self) -> Result<(), String> {
        if !matches!(self.model_type.as_str(), "llama" | "qwen2" | "mistral") {
            return Err(format!(
                "model_type {:?} is not supported (llama, qwen2, mistral)",
                self.model_type
            ));
        }
        if [
            self.num_attention_heads,
            self.num_kv_heads(),
            self.hidden_size,
            self.num_hidden_layers,
        ]
        .contains(&0)
        {
            return Err("hidden_size, num_attention_heads, num_key_value_heads and num_hidden_layers must be > 0".into());
        }
        if !self.num_attention_heads.is_multiple_of(self.num_kv_heads()) {
            return Err("num_attention_heads must be a multiple of num_key_value_heads".into());
        }
        if !self.head_dim().is_multiple_of(2) {
            return Err("head_dim must be even for RoPE".into());
        }
        Ok(())
    }

    pub fn num_kv_heads(&self) -> usize {
        self.num_key_value_heads.unwrap_or(self.num_attention_heads)
    }

    pub fn head_dim(&self) -> usize {
        self.head_dim
            .unwrap_or(self.hidden_size / self.num_attention_heads)
    }

    /// Width of one token's K (or V) in one layer.
    pub fn kv_dim(&self) -> usize {
        self.num_kv_heads() * self.head_dim()
    }

    pub fn has_qkv_bias(&self) -> bool {
        self.model_type == "qwen2" || self.attention_bias
    }

    pub fn eos_ids(&self) -> Vec<u32> {
        match &self.eos_token_id {
            None => Vec::new(),
            Some(EosIds::One(id)) => vec![*id],
            Some(EosIds::Many(ids)) => ids.clone(),
        }
    }
}

/// Precision of the float KV path. The seed's "FP16"; f32 exists for exactness tests.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum KvFloatDtype {
    F16,
    F32,
}

/// How the engine runs: cache geometry, batching limits and the default precision plan.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct EngineConfig {
    /// Tokens per KV page.
    pub page_size: usize,
    /// Pages in the KV pool (shared by all layers: one page id addresses every layer).
    pub num_pages: usize,
    /// Most sequences in one step.
    pub max_num_seqs: usize,
    /// Most tokens in one step (prefill chunks + decodes).
    pub max_num_batched_tokens: usize,
    /// Most requests waiting for admission; beyond this `submit` fails with `Overloaded`.
    pub max_waiting: usize,
    /// Residency of every linear group unless `group_residency` says otherwise.
    pub default_residency: Residency,
    /// Per-group overrides, keyed like `layers.1.down`.
    pub group_residency: std::collections::BTreeMap<String, Residency>,
    /// KV cache precision at start for every layer: `true` = INT8 (C8).
    pub kv_int8: bool,
    pub kv_float_dtype: KvFloatDtype,
    /// Reuse full KV pages across requests with the same prefix.
    pub prefix_caching: bool,
    /// The activation monitor (statistics, fallback decisions, shadow KL).
    pub monitor: crate::monitor::MonitorConfig,
    /// `sensitive_layers.json` to serve with and hot-reload: a local path or an object-store
    /// URL (`file://`, and `s3://`, `gs://`, `az://` when built with `--features cloud`).
    /// A versioned prefix's `latest` pointer is followed.
    pub sensitive_layers: Option<String>,
    /// How often the source is polled for a new version (md5 of its bytes).
    #[serde(with = "humantime_serde")]
    pub reload_interval: std::time::Duration,
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            page_size: 16,
            num_pages: 2048,
            max_num_seqs: 32,
            max_num_batched_tokens: 512,
            max_waiting: 256,
            default_residency: Residency::Dual,
            group_residency: Default::default(),
            kv_int8: true,
            kv_float_dtype: KvFloatDtype::F16,
            prefix_caching: true,
            monitor: Default::default(),
            sensitive_layers: None,
            reload_interval: std::time::Duration::from_secs(30),
        }
    }
}

impl EngineConfig {
    pub fn validate(&self) -> Result<(), EngineError> {
        let bad = |m: &str| Err(EngineError::Config(m.to_string()));
        if self.page_size == 0 || self.page_size > 1024 {
            return bad("page_size must be in 1..=1024");
        }
        if self.num_pages == 0 {
            return bad("num_pages must be > 0");
        }
        if self.max_num_seqs == 0 || self.max_num_batched_tokens == 0 {
            return bad("max_num_seqs and max_num_batched_tokens must be > 0");
        }
        let m = &self.monitor;
        if !(m.k > 0.0
            && m.token_k > 0.0
            && (0.0..=1.0).contains(&m.trigger_rate)
            && (0.0..=1.0).contains(&m.shadow_sample_rate)
            && (0.0..=1.0).contains(&m.batch_group_share)
            && m.request_kl_limit >= 0.0)
        {
            return bad("monitor: k and token_k must be > 0; trigger_rate, shadow_sample_rate and batch_group_share in [0, 1]; request_kl_limit >= 0");
        }
        if self.reload_interval < std::time::Duration::from_millis(10) {
            return bad("reload_interval must be at least 10ms");
        }
        if m.window_requests == 0 || m.warmup_tokens < 2 {
            return bad("monitor: window_requests must be > 0 and warmup_tokens >= 2");
        }
        for key in self.group_residency.keys().chain(m.overrides.keys()) {
            key.parse::<quantmesh_shared::GroupId>()
                .map_err(EngineError::Config)?;
        }
        Ok(())
    }
}
