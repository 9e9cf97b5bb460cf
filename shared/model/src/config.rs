//! Model configuration: a Hugging Face `config.json`, or GGUF metadata mapped onto it.

use crate::error::ModelError;
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
    pub fn from_file(path: &Path) -> Result<Self, ModelError> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| ModelError::io(format!("reading {}", path.display()), e))?;
        let cfg: ModelConfig = serde_json::from_str(&text).map_err(|e| {
            ModelError::Config(format!("{}: not a valid model config: {e}", path.display()))
        })?;
        cfg.validate()
            .map_err(|m| ModelError::Config(format!("{}: {m}", path.display())))?;
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
