//! OpenAI-compatible request and response shapes.

use crate::error::ApiError;
pub use crate::error::{ErrorBody, ErrorDetail};
use quantmesh_engine::api::ChatMessage;
use schemars::JsonSchema;
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

/// An optional integer that also accepts a JSON number with no fractional part (`186.0`):
/// JSON Schema's `integer` and most JSON encoders treat the two alike.
fn integral<'de, D, T>(d: D) -> Result<Option<T>, D::Error>
where
    D: serde::Deserializer<'de>,
    T: TryFrom<i128>,
{
    use serde::de::Error;
    let Some(n) = Option::<serde_json::Number>::deserialize(d)? else {
        return Ok(None);
    };
    let whole = whole_number(&n)
        .ok_or_else(|| D::Error::custom(format!("expected an integer, got {n}")))?;
    T::try_from(whole)
        .map(Some)
        .map_err(|_| D::Error::custom(format!("integer {whole} is out of range")))
}

/// A JSON number's value when it is whole (`7` or `7.0`), `None` otherwise.
fn whole_number(n: &serde_json::Number) -> Option<i128> {
    n.as_i64()
        .map(i128::from)
        .or_else(|| n.as_u64().map(i128::from))
        .or_else(|| {
            n.as_f64()
                .filter(|f| f.fract() == 0.0 && f.abs() < 1e30)
                .map(|f| f as i128)
        })
}

/// A float that is positive in the request stays positive as an `f32` (JSON's smallest
/// positive numbers round to 0 in 32 bits).
pub fn positive_f32(x: f64) -> f32 {
    let y = x as f32;
    if x > 0.0 && y == 0.0 {
        f32::MIN_POSITIVE
    } else {
        y
    }
}

// ---- schema-only shapes: what the OpenAPI document states for fields whose Rust type is
// looser than the contract (checked in code; see `SamplingFields`).

/// A completions prompt: one non-empty string, or a list holding exactly one.
#[derive(JsonSchema)]
#[serde(untagged)]
#[allow(dead_code)]
enum PromptDoc {
    One(#[schemars(length(min = 1))] String),
    Many(#[schemars(length(min = 1, max = 1), inner(length(min = 1)))] Vec<String>),
}

/// Up to 4 stop strings, each 1 to 256 characters.
#[derive(JsonSchema)]
#[serde(untagged)]
#[allow(dead_code)]
enum StopDoc {
    One(#[schemars(length(min = 1, max = 256))] String),
    Many(#[schemars(length(max = 4), inner(length(min = 1, max = 256)))] Vec<String>),
}

/// Chat: `true` for the sampled token's log-probability (with `top_logprobs` alternatives);
/// completions: the number of alternatives per token (0 to 20).
#[derive(JsonSchema)]
#[serde(untagged)]
#[allow(dead_code)]
enum LogprobsDoc {
    Chat(bool),
    Completions(#[schemars(range(max = 20))] u32),
}

impl StringOrList {
    pub fn into_vec(self) -> Vec<String> {
        match self {
            StringOrList::One(s) => vec![s],
            StringOrList::Many(v) => v,
        }
    }
}

#[derive(Debug, Clone, Default, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct StreamOptions {
    /// Send a last chunk with the request's token usage (OpenAI's default: no).
    #[serde(default)]
    pub include_usage: Option<bool>,
}

/// Sampling fields common to both endpoints. The ranges stated for the OpenAPI document are
/// the ones `SamplingParams::validate` enforces.
#[derive(Debug, Clone, Default, Deserialize, JsonSchema)]
pub struct SamplingFields {
    /// The served model's id (GET /v1/models); optional.
    pub model: Option<String>,
    /// Most tokens to generate (default 16 for completions, 256 for chat).
    #[schemars(range(min = 1, max = 4_294_967_295u32))]
    #[serde(default, deserialize_with = "integral")]
    pub max_tokens: Option<u32>,
    /// Alias of `max_tokens` (wins when both are given).
    #[schemars(range(min = 1, max = 4_294_967_295u32))]
    #[serde(default, deserialize_with = "integral")]
    pub max_completion_tokens: Option<u32>,
    /// Sampling temperature: 0 is greedy (the most likely token every time); default 1.
    #[schemars(range(min = 0.0, max = 2.0))]
    pub temperature: Option<f32>,
    /// Nucleus sampling: draw from the smallest set of tokens whose probability reaches this.
    #[schemars(extend("exclusiveMinimum" = 0.0), range(max = 1.0))]
    pub top_p: Option<f64>,
    /// Extension: keep the k most likely tokens; 0 or -1 for all.
    #[schemars(range(min = -1))]
    #[serde(default, deserialize_with = "integral")]
    pub top_k: Option<i32>,
    /// A string or a list of strings that end the answer (not included in it).
    #[schemars(with = "Option<StopDoc>")]
    pub stop: Option<StringOrList>,
    /// Makes sampling repeatable: the same seed, prompt and parameters give the same answer.
    #[serde(default, deserialize_with = "integral")]
    #[schemars(range(max = 18_446_744_073_709_551_615u64))]
    pub seed: Option<u64>,
    /// Server-sent events, one chunk per piece of text, ending with `data: [DONE]`.
    #[serde(default)]
    pub stream: bool,
    /// With `stream`: `{"include_usage": true}` adds a usage chunk before `[DONE]`.
    pub stream_options: Option<StreamOptions>,
    /// How many answers to the prompt (1 to 8).
    #[schemars(range(min = 1, max = 8))]
    #[serde(default, deserialize_with = "integral")]
    pub n: Option<u32>,
    /// Extension: keep generating past the end-of-sequence token (benchmarks).
    #[serde(default)]
    pub ignore_eos: bool,
    /// Lowers the logit of every token already generated by this much.
    #[schemars(range(min = -2.0, max = 2.0))]
    pub presence_penalty: Option<f32>,
    /// Lowers the logit of a generated token by this much per time it was generated.
    #[schemars(range(min = -2.0, max = 2.0))]
    pub frequency_penalty: Option<f32>,
    /// Extension (HF/vLLM): 1 is off.
    #[schemars(extend("exclusiveMinimum" = 0.0), range(max = 2.0))]
    pub repetition_penalty: Option<f64>,
    /// Token id (as a string, OpenAI's shape) → bias in [-100, 100].
    #[schemars(extend(
        "maxProperties" = 300,
        "propertyNames" = {"pattern": "^[0-9]+$"},
        "additionalProperties" = {"type": "number", "minimum": -100, "maximum": 100}
    ))]
    pub logit_bias: Option<BTreeMap<String, f32>>,
    /// The end user, for abuse tracing: accepted and logged only as a hash.
    pub user: Option<String>,
    /// Completions: how many alternatives (an integer, 0 for the sampled token only); chat:
    /// a boolean, with `top_logprobs` alternatives.
    #[schemars(with = "Option<LogprobsDoc>")]
    pub logprobs: Option<Value>,
    /// Extension (vLLM): a prefix-cache partition; cached prompt pages are shared only
    /// among requests with the same salt (and, with `per_api_key` isolation, the same key).
    #[schemars(length(min = 1, max = 256))]
    pub cache_salt: Option<String>,
    /// Chat: alternatives per token (0 to 20), with `logprobs: true`.
    #[schemars(range(max = 20))]
    #[serde(default, deserialize_with = "integral")]
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
            (Some(v), false) => match v
                .as_number()
                .and_then(whole_number)
                .and_then(|n| u64::try_from(n).ok())
            {
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

/// POST /v1/completions. Fields not listed are refused (400 naming the field).
/// `logprobs` here is the number of alternatives per token; `top_logprobs` is chat's.
#[derive(Debug, Clone, Deserialize, JsonSchema)]
#[schemars(deny_unknown_fields)]
#[schemars(extend("allOf" = [
    {"properties": {"logprobs": {"type": ["integer", "null"], "minimum": 0, "maximum": 20}}},
    {"anyOf": [
        {"properties": {"top_logprobs": {"type": "null"}}},
        {"properties": {"top_logprobs": {"const": 0}, "logprobs": {"type": "null"}}}
    ]}
]))]
pub struct CompletionRequest {
    /// The text to complete: a string, or a list of one string.
    #[schemars(with = "PromptDoc")]
    pub prompt: StringOrList,
    #[serde(flatten)]
    pub sampling: SamplingFields,
    /// Whatever else the client sent (checked by [`SamplingFields::check_supported`]).
    #[serde(flatten)]
    #[schemars(skip)]
    pub rest: Map<String, Value>,
}

/// POST /v1/chat/completions. Fields not listed are refused (400 naming the field).
/// `top_logprobs` above 0 needs `logprobs: true`.
#[derive(Debug, Clone, Deserialize, JsonSchema)]
#[schemars(deny_unknown_fields)]
#[schemars(extend("allOf" = [
    {"properties": {"logprobs": {"type": ["boolean", "null"]}}},
    {"anyOf": [
        {"properties": {"top_logprobs": {"enum": [null, 0]}}},
        {"required": ["logprobs"], "properties": {"logprobs": {"const": true}}}
    ]}
]))]
pub struct ChatRequest {
    /// The conversation: `system`, `user` and `assistant` messages, rendered with the model's
    /// chat template.
    #[schemars(length(min = 1))]
    pub messages: Vec<ChatMessage>,
    #[serde(flatten)]
    pub sampling: SamplingFields,
    #[serde(flatten)]
    #[schemars(skip)]
    pub rest: Map<String, Value>,
}

#[derive(Debug, Clone, Copy, Serialize, JsonSchema)]
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

// ---------------------------------------------------------------- responses

/// Why a choice ended: `stop` (end of sequence or a stop string), `length` (`max_tokens`),
/// `abort` (cancelled), `error` (streaming only: the engine failed this choice after its
/// first chunk; a whole answer fails with a 500 instead).
#[derive(Debug, Clone, Copy, Serialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum FinishReasonBody {
    Stop,
    Length,
    Abort,
    Error,
}

impl FinishReasonBody {
    /// The reasons a choice finishes with when it does not fail.
    pub const SUCCESS: [FinishReasonBody; 3] = [Self::Stop, Self::Length, Self::Abort];

    /// The wire name (also the `finished_reason` metric label).
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Stop => "stop",
            Self::Length => "length",
            Self::Abort => "abort",
            Self::Error => "error",
        }
    }
}

impl From<quantmesh_types::FinishReason> for FinishReasonBody {
    fn from(r: quantmesh_types::FinishReason) -> Self {
        use quantmesh_types::FinishReason as F;
        match r {
            F::Stop => Self::Stop,
            F::Length => Self::Length,
            F::Cancelled => Self::Abort,
            F::Error => Self::Error,
        }
    }
}

/// One answer of a completion.
#[derive(Debug, Clone, Serialize, JsonSchema)]
pub struct CompletionChoice {
    pub index: usize,
    pub text: String,
    /// With `logprobs`: `tokens`, `token_logprobs`, `top_logprobs`, `text_offset`.
    pub logprobs: Option<Value>,
    pub finish_reason: Option<FinishReasonBody>,
}

/// The answer of POST /v1/completions without `stream`.
#[derive(Debug, Clone, Serialize, JsonSchema)]
pub struct CompletionResponse {
    pub id: String,
    /// `text_completion`.
    pub object: &'static str,
    pub created: u64,
    pub model: String,
    pub choices: Vec<CompletionChoice>,
    pub usage: UsageBody,
}

/// The assistant's message.
#[derive(Debug, Clone, Serialize, JsonSchema)]
pub struct AssistantMessage {
    /// `assistant`.
    pub role: &'static str,
    pub content: String,
}

/// One answer of a chat completion.
#[derive(Debug, Clone, Serialize, JsonSchema)]
pub struct ChatChoice {
    pub index: usize,
    pub message: AssistantMessage,
    /// With `logprobs: true`: `content`, one entry per generated token.
    pub logprobs: Option<Value>,
    pub finish_reason: Option<FinishReasonBody>,
}

/// The answer of POST /v1/chat/completions without `stream`.
#[derive(Debug, Clone, Serialize, JsonSchema)]
pub struct ChatCompletionResponse {
    pub id: String,
    /// `chat.completion`.
    pub object: &'static str,
    pub created: u64,
    pub model: String,
    pub choices: Vec<ChatChoice>,
    pub usage: UsageBody,
}

/// One served model.
#[derive(Debug, Clone, Serialize, JsonSchema)]
pub struct ModelCard {
    pub id: String,
    /// `model`.
    pub object: &'static str,
    pub created: u64,
    pub owned_by: &'static str,
    /// Prompt + completion tokens the model takes (null while loading).
    pub max_model_len: Option<usize>,
}

/// GET /v1/models.
#[derive(Debug, Clone, Serialize, JsonSchema)]
pub struct ModelList {
    /// `list`.
    pub object: &'static str,
    pub data: Vec<ModelCard>,
}

/// GET /health: the process answers.
#[derive(Debug, Clone, Serialize, JsonSchema)]
pub struct HealthBody {
    /// `ok`.
    pub status: &'static str,
}

/// GET /ready: the engine can serve.
#[derive(Debug, Clone, Serialize, JsonSchema)]
pub struct ReadyBody {
    /// `ready`.
    pub status: &'static str,
    pub model: String,
    pub load_seconds: f64,
}

#[cfg(test)]
mod tests {
    //! Request JSON is outside input: whatever bytes arrive, parsing and field checks end in
    //! a 4xx error or an accepted request, never a panic; and an accepted request holds only
    //! fields the OpenAPI document lists (nothing silently ignored).
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::error::parse_json;
    use actix_web::ResponseError;
    use proptest::prelude::*;

    const KNOWN: &[&str] = &[
        "prompt",
        "messages",
        "model",
        "max_tokens",
        "max_completion_tokens",
        "temperature",
        "top_p",
        "top_k",
        "stop",
        "seed",
        "stream",
        "stream_options",
        "n",
        "ignore_eos",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "logit_bias",
        "user",
        "logprobs",
        "top_logprobs",
        "cache_salt",
        "tools",
        "response_format",
        "echo",
        "unknown_field",
        "role",
        "content",
    ];

    fn value() -> impl Strategy<Value = Value> {
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::Bool),
            any::<i64>().prop_map(Value::from),
            (-1e6f64..1e6).prop_map(Value::from),
            "[a-z0-9 ]{0,12}".prop_map(Value::String),
        ];
        leaf.prop_recursive(3, 24, 4, |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
                prop::collection::btree_map(prop::sample::select(KNOWN), inner, 0..4).prop_map(
                    |m| Value::Object(m.into_iter().map(|(k, v)| (k.to_string(), v)).collect())
                ),
            ]
        })
    }

    /// Random fields with random values, most often beside a valid prompt and messages (so
    /// that parsing gets past the required fields and the checks behind it run).
    fn body() -> impl Strategy<Value = Map<String, Value>> {
        (
            prop::collection::btree_map(prop::sample::select(KNOWN), value(), 0..6),
            prop::bool::weighted(0.8),
        )
            .prop_map(|(m, base)| {
                let mut b: Map<String, Value> =
                    m.into_iter().map(|(k, v)| (k.to_string(), v)).collect();
                if base {
                    b.insert("prompt".into(), "hi".into());
                    b.insert(
                        "messages".into(),
                        serde_json::json!([{"role": "user", "content": "hi"}]),
                    );
                }
                b
            })
    }

    /// The property names the OpenAPI document gives a request schema.
    fn documented(name: &str) -> Vec<String> {
        let doc = crate::openapi::document(false, false);
        doc["components"]["schemas"][name]["properties"]
            .as_object()
            .unwrap()
            .keys()
            .cloned()
            .collect()
    }

    fn check<T: serde::de::DeserializeOwned>(
        bytes: &[u8],
        fields: impl Fn(&T) -> (&SamplingFields, &Map<String, Value>),
    ) -> Result<(), ApiError> {
        let r: T = parse_json(bytes)?;
        let (f, rest) = fields(&r);
        f.check_supported(rest)?;
        f.logprobs(true)?;
        f.logit_bias()?;
        Ok(())
    }

    fn assert_4xx(e: &ApiError) {
        assert!(e.status_code().is_client_error(), "{e:?}");
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]

        #[test]
        fn any_bytes_give_an_error_or_a_request(bytes in prop::collection::vec(any::<u8>(), 0..256)) {
            if let Err(e) = check::<CompletionRequest>(&bytes, |r| (&r.sampling, &r.rest)) {
                assert_4xx(&e);
            }
        }

        #[test]
        fn accepted_requests_hold_only_documented_fields(b in body()) {
            for (schema, chat) in [("CompletionRequest", false), ("ChatRequest", true)] {
                // Each endpoint's own required field only.
                let mut b = b.clone();
                b.remove(if chat { "prompt" } else { "messages" });
                let bytes = serde_json::to_vec(&b).unwrap();
                let result = if chat {
                    check::<ChatRequest>(&bytes, |r| (&r.sampling, &r.rest))
                } else {
                    check::<CompletionRequest>(&bytes, |r| (&r.sampling, &r.rest))
                };
                match result {
                    Err(e) => assert_4xx(&e),
                    Ok(()) => {
                        let listed = documented(schema);
                        for (k, v) in &b {
                            prop_assert!(
                                listed.contains(k) || (NOT_IMPLEMENTED.contains(&k.as_str()) && asks_for_nothing(k, v)),
                                "{schema} accepted {k} = {v}, which it does not document"
                            );
                        }
                    }
                }
            }
        }
    }
}
