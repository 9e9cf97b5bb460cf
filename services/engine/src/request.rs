//! What a caller asks the engine for: a prompt and its sampling parameters, with the limits
//! the caller enforces on top of the model's own. Checked in one place, `Engine::submit`.

use quantmesh_model::ChatMessage;
use quantmesh_types::SamplingParams;

/// What to generate from.
#[derive(Debug, Clone)]
pub enum Prompt {
    /// Plain text (completions); `add_bos` puts the model's BOS first.
    Text { text: String, add_bos: bool },
    /// Chat messages, rendered with the model's chat template (roles `system`, `user`,
    /// `assistant`).
    Chat(Vec<ChatMessage>),
    /// Token ids.
    Tokens(Vec<u32>),
}

/// One generation request. Everything in it is checked by [`Engine::submit`]; a problem
/// is an [`EngineError::InvalidRequest`] (HTTP 400) and nothing is queued.
#[derive(Debug, Clone)]
pub struct GenerateRequest {
    pub prompt: Prompt,
    pub params: SamplingParams,
    /// Most prompt tokens accepted (beyond the model's own limit).
    pub max_input_tokens: Option<usize>,
    /// Most prompt + completion tokens accepted (beyond the model's own limit).
    pub max_total_tokens: Option<usize>,
    /// Prefix-cache partition (vLLM's `cache_salt`): requests share cached prompt pages only
    /// with requests of the same salt, so one tenant cannot time another's prompts. `None`:
    /// the shared partition.
    pub cache_salt: Option<String>,
    /// The caller's span for this request, when it is traced: the engine's phase spans
    /// (tokenize, queue, prefill, decode) become its children and the precision decisions
    /// that touch the request are noted in it (see [`crate::trace`]). `None`: no span is made.
    pub trace: Option<tracing::Span>,
}

impl GenerateRequest {
    pub fn new(prompt: Prompt, params: SamplingParams) -> Self {
        Self {
            prompt,
            params,
            max_input_tokens: None,
            max_total_tokens: None,
            cache_salt: None,
            trace: None,
        }
    }
}
