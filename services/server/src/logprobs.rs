//! Log-probabilities in OpenAI's two shapes: the completions API's parallel lists and the
//! chat API's `content` entries.

use quantmesh_engine::api::LogprobsText;
use serde_json::{json, Value};

/// One sampled token with its text and alternatives.
#[derive(Debug, Clone)]
pub struct Entry {
    pub token: String,
    pub logprob: f32,
    pub top: Vec<(String, f32)>,
}

impl From<LogprobsText> for Entry {
    fn from(lp: LogprobsText) -> Self {
        Self {
            token: lp.token,
            logprob: lp.ids.logprob,
            top: lp
                .top
                .into_iter()
                .zip(lp.ids.top)
                .map(|(text, (_, l))| (text, l))
                .collect(),
        }
    }
}

/// OpenAI reports -9999 where a log-probability is -inf (JSON has no infinities).
fn finite(x: f32) -> f32 {
    if x.is_finite() {
        x
    } else {
        -9999.0
    }
}

/// Completions shape; `offset` is where the first entry's text starts in the completion.
pub fn completions(entries: &[Entry], mut offset: usize) -> Value {
    let mut text_offset = Vec::with_capacity(entries.len());
    for e in entries {
        text_offset.push(offset);
        offset += e.token.chars().count();
    }
    json!({
        "tokens": entries.iter().map(|e| e.token.as_str()).collect::<Vec<_>>(),
        "token_logprobs": entries.iter().map(|e| finite(e.logprob)).collect::<Vec<_>>(),
        "top_logprobs": entries
            .iter()
            .map(|e| {
                e.top
                    .iter()
                    .map(|(t, l)| (t.clone(), json!(finite(*l))))
                    .collect::<serde_json::Map<_, _>>()
            })
            .collect::<Vec<_>>(),
        "text_offset": text_offset,
    })
}

/// Chat shape.
pub fn chat(entries: &[Entry]) -> Value {
    let item = |t: &str, l: f32| json!({"token": t, "logprob": finite(l), "bytes": t.as_bytes()});
    json!({
        "content": entries
            .iter()
            .map(|e| {
                let mut v = item(&e.token, e.logprob);
                v["top_logprobs"] = e.top.iter().map(|(t, l)| item(t, *l)).collect();
                v
            })
            .collect::<Vec<_>>(),
    })
}
