//! OpenAI-compatible request and response shapes.

use quantmesh_engine::api::ChatMessage;
use serde::{Deserialize, Serialize};

/// `prompt` / `stop` may be a string or a list of strings.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum StringOrList {
    One(String),
    Many(Vec<String>),
}

impl StringOrList {
    pub fn into_vec(self) -> Vec<String> {
        match self {
            StringOrList::One(s) => vec![s],
            StringOrList::Many(v) => v,
        }
    }
}

#[derive(Debug, Clone, Default, Deserialize)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: Option<bool>,
}

/// Sampling fields common to both endpoints.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct SamplingFields {
    pub model: Option<String>,
    pub max_tokens: Option<u32>,
    pub max_completion_tokens: Option<u32>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<i32>,
    pub stop: Option<StringOrList>,
    pub seed: Option<u64>,
    #[serde(default)]
    pub stream: bool,
    pub stream_options: Option<StreamOptions>,
    pub n: Option<u32>,
    /// Extension: keep generating past the end-of-sequence token (benchmarks).
    #[serde(default)]
    pub ignore_eos: bool,
}

#[derive(Debug, Clone, Deserialize)]
pub struct CompletionRequest {
    pub prompt: StringOrList,
    #[serde(flatten)]
    pub sampling: SamplingFields,
}

#[derive(Debug, Clone, Deserialize)]
pub struct ChatRequest {
    pub messages: Vec<ChatMessage>,
    #[serde(flatten)]
    pub sampling: SamplingFields,
}

#[derive(Debug, Clone, Serialize)]
pub struct UsageBody {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub total_tokens: usize,
}

impl From<quantmesh_types::Usage> for UsageBody {
    fn from(u: quantmesh_types::Usage) -> Self {
        Self {
            prompt_tokens: u.prompt_tokens,
            completion_tokens: u.completion_tokens,
            total_tokens: u.total_tokens,
        }
    }
}
