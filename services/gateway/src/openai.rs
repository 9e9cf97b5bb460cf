//! OpenAI-compatible request and response shapes.

use crate::error::ApiError;
use quantmesh_engine::api::ChatMessage;
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
use std::collections::BTreeMap;

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
    pub presence_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
    /// Extension (HF/vLLM): 1 is off.
    pub repetition_penalty: Option<f32>,
    /// Token id (as a string, OpenAI's shape) → bias in [-100, 100].
    pub logit_bias: Option<BTreeMap<String, f32>>,
    /// The end user, for abuse tracing: accepted and logged only as a hash.
    pub user: Option<String>,
    /// Completions: how many alternatives (an integer, 0 for the sampled token only); chat:
    /// a boolean, with `top_logprobs` alternatives.
    pub logprobs: Option<Value>,
    pub top_logprobs: Option<u32>,
}

/// Fields of the OpenAI API that quantmesh does not implement: a request naming one with a
/// value other than null (or the value meaning "off") is rejected, never silently ignored.
const NOT_IMPLEMENTED: &[&str] = &[
    "tools",
    "tool_choice",
    "functions",
    "function_call",
    "parallel_tool_calls",
    "response_format",
    "suffix",
    "echo",
    "best_of",
    "modalities",
    "audio",
    "prediction",
    "store",
    "metadata",
    "service_tier",
    "reasoning_effort",
    "web_search_options",
];

/// Whether `value` of an unimplemented field asks for nothing (null, or the default).
fn asks_for_nothing(field: &str, value: &Value) -> bool {
    match (field, value) {
        (_, Value::Null) => true,
        ("echo" | "store" | "parallel_tool_calls", Value::Bool(false)) => true,
        ("best_of", v) => v.as_u64() == Some(1),
        ("response_format", v) => v.get("type").and_then(Value::as_str) == Some("text"),
        ("tool_choice" | "function_call", v) => v.as_str() == Some("none"),
        ("tools" | "functions", Value::Array(a)) => a.is_empty(),
        _ => false,
    }
}

impl SamplingFields {
    /// Reject what this request asks for and the server would not do: unknown fields
    /// (`rest`, what serde did not match), unimplemented OpenAI fields, n > 1.
    pub fn check_supported(&self, rest: &Map<String, Value>) -> Result<(), ApiError> {
        for (k, v) in rest {
            if NOT_IMPLEMENTED.contains(&k.as_str()) {
                if !asks_for_nothing(k, v) {
                    return Err(unsupported(
                        k,
                        format!("`{k}` is not supported by this server"),
                    ));
                }
            } else {
                return Err(unsupported(
                    k,
                    format!("unknown request field `{k}`: it would be ignored, so it is refused"),
                ));
            }
        }
        let max_n = quantmesh_engine::api::MAX_N;
        if let Some(n) = self.n.filter(|&n| n == 0 || n as usize > max_n) {
            return Err(unsupported(
                "n",
                format!("n must be in 1..={max_n}, got {n}"),
            ));
        }
        Ok(())
    }

    /// How many alternatives to return log-probabilities for, `None` for none, in the
    /// endpoint's own shape of the fields.
    pub fn logprobs(&self, chat: bool) -> Result<Option<usize>, ApiError> {
        let top = self.top_logprobs.map(|n| n as usize);
        match (&self.logprobs, chat) {
            (None | Some(Value::Null), _) | (Some(Value::Bool(false)), true) => match top {
                Some(n) if n > 0 => Err(unsupported(
                    "top_logprobs",
                    "top_logprobs needs logprobs: true".into(),
                )),
                _ => Ok(None),
            },
            (Some(Value::Bool(true)), true) => Ok(Some(top.unwrap_or(0))),
            (Some(v), false) => match v.as_u64() {
                Some(n) if top.is_none() => Ok(Some(n as usize)),
                Some(_) => Err(unsupported(
                    "top_logprobs",
                    "completions take the number of alternatives in logprobs; top_logprobs is for chat".into(),
                )),
                None => Err(unsupported(
                    "logprobs",
                    format!("logprobs must be an integer (alternatives per token) here, got {v}"),
                )),
            },
            (Some(v), true) => Err(unsupported(
                "logprobs",
                format!("logprobs must be true or false here, got {v}"),
            )),
        }
    }

    /// `logit_bias` as (token id, bias), keys parsed.
    pub fn logit_bias(&self) -> Result<Vec<(u32, f32)>, ApiError> {
        let Some(map) = &self.logit_bias else {
            return Ok(Vec::new());
        };
        map.iter()
            .map(|(k, &b)| {
                k.parse::<u32>().map(|t| (t, b)).map_err(|_| {
                    unsupported(
                        "logit_bias",
                        format!("logit_bias keys are token ids, got {k:?}"),
                    )
                })
            })
            .collect()
    }
}

fn unsupported(param: &str, message: String) -> ApiError {
    ApiError::UnsupportedParam {
        param: param.to_string(),
        message,
    }
}

#[derive(Debug, Clone, Deserialize)]
pub struct CompletionRequest {
    pub prompt: StringOrList,
    #[serde(flatten)]
    pub sampling: SamplingFields,
    /// Whatever else the client sent (checked by [`SamplingFields::check_supported`]).
    #[serde(flatten)]
    pub rest: Map<String, Value>,
}

#[derive(Debug, Clone, Deserialize)]
pub struct ChatRequest {
    pub messages: Vec<ChatMessage>,
    #[serde(flatten)]
    pub sampling: SamplingFields,
    #[serde(flatten)]
    pub rest: Map<String, Value>,
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
