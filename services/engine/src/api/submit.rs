//! Admission: a request checked (every check of a request lives here), its prompt
//! tokenized, its sequences queued.

use super::generation::Generation;
use super::handle::*;
use crate::error::EngineError;
use crate::error::Result;
use crate::kv::SeqId;
use crate::request::{GenerateRequest, Prompt};
use crate::sched::Submit;
use crate::sched::{Sequence, SubmitError};
use quantmesh_types::SamplingParams;
use std::sync::atomic::Ordering;
use tokio::sync::mpsc;

impl Engine {
    /// Validate a request, tokenize its prompt and queue it. The returned [`Generation`]
    /// yields text as it is produced; dropping it cancels the request and frees its KV
    /// pages. Every check of a request lives here.
    pub async fn submit(&self, req: GenerateRequest) -> Result<Generation> {
        self.submit_n(req, 1)
            .await?
            .into_iter()
            .next()
            .ok_or(EngineError::Stopped)
    }

    /// [`Engine::submit`] sampling `n` answers to one prompt (OpenAI's `n`, at most
    /// [`MAX_N`]): the prompt is computed once and the answers share its KV pages
    /// (copy-on-write); with a `seed`, answer `i` uses `seed + i`.
    pub async fn submit_n(&self, req: GenerateRequest, n: usize) -> Result<Vec<Generation>> {
        if n == 0 || n > MAX_N {
            return Err(EngineError::InvalidParam {
                param: "n",
                message: format!("n must be in 1..={MAX_N}, got {n}"),
            });
        }
        let invalid = |m: String| Err(EngineError::InvalidRequest(m));
        let GenerateRequest {
            prompt,
            params,
            max_input_tokens,
            max_total_tokens,
            cache_salt,
            trace,
        } = req;
        params.validate().map_err(|e| EngineError::InvalidParam {
            param: e.param(),
            message: e.to_string(),
        })?;
        match &prompt {
            Prompt::Text { text, .. } if text.is_empty() => {
                return invalid("the prompt is empty".into())
            }
            Prompt::Chat(messages) => {
                if messages.is_empty() {
                    return invalid("messages must not be empty".into());
                }
                if let Some(m) = messages
                    .iter()
                    .find(|m| !matches!(m.role.as_str(), "system" | "user" | "assistant"))
                {
                    return invalid(format!(
                        "unknown role {:?}: expected system, user or assistant",
                        m.role
                    ));
                }
            }
            _ => {}
        }
        let ids = match prompt {
            // Already ids: no tokenizer round trip.
            Prompt::Tokens(ids) => ids,
            p => match &trace {
                Some(request) => {
                    use tracing::Instrument;
                    let span = tracing::info_span!(target: crate::trace::TARGET, parent: request, "quantmesh.tokenize");
                    self.tokenize(p).instrument(span).await?
                }
                None => self.tokenize(p).await?,
            },
        };
        if ids.is_empty() {
            return invalid("the prompt is empty".into());
        }
        let vocab = self.inner.info.config.vocab_size as u32;
        if let Some((bad, _)) = params.logit_bias.iter().find(|(t, _)| *t >= vocab) {
            return invalid(format!(
                "logit_bias names token id {bad}, outside the vocabulary (size {vocab})"
            ));
        }
        if let Some(bad) = ids.iter().find(|&&t| t >= vocab) {
            return invalid(format!(
                "token id {bad} is outside the vocabulary (size {vocab})"
            ));
        }
        if let Some(max) = max_input_tokens {
            if ids.len() > max {
                return invalid(format!(
                    "the prompt has {} tokens; max_input_tokens is {max}",
                    ids.len()
                ));
            }
        }
        if let Some(max) = max_total_tokens {
            if ids.len() + params.max_tokens > max {
                return invalid(format!(
                    "prompt ({} tokens) + max_tokens ({}) exceeds max_total_tokens {max}",
                    ids.len(),
                    params.max_tokens
                ));
            }
        }
        let max_len = self.inner.info.max_model_len;
        if ids.len() + params.max_tokens > max_len {
            return invalid(format!(
                "prompt ({} tokens) + max_tokens ({}) exceeds the model's maximum length {max_len}",
                ids.len(),
                params.max_tokens
            ));
        }
        let salt = cache_salt.as_deref().map_or(0, crate::kv::salt_of);
        self.enqueue(ids, params, n, salt, trace).await
    }

    /// [`Engine::submit`] for a tokenized prompt.
    pub async fn generate(&self, prompt: Vec<u32>, params: SamplingParams) -> Result<Generation> {
        self.submit(GenerateRequest::new(Prompt::Tokens(prompt), params))
            .await
    }

    async fn enqueue(
        &self,
        prompt: Vec<u32>,
        params: SamplingParams,
        n: usize,
        cache_salt: u64,
        trace: Option<tracing::Span>,
    ) -> Result<Vec<Generation>> {
        let ids: Vec<SeqId> = (0..n)
            .map(|_| self.inner.next_id.fetch_add(1, Ordering::Relaxed))
            .collect();
        let prompt_len = prompt.len();
        let mut channels = Vec::with_capacity(n);
        let mut sequences = Vec::with_capacity(n);
        for (i, &id) in ids.iter().enumerate() {
            let (tx, rx) = mpsc::unbounded_channel();
            let mut p = params.clone();
            p.seed = params.seed.map(|s| s.wrapping_add(i as u64));
            sequences.push(Sequence::new(id, prompt.clone(), p, self.inner.eos.clone()));
            channels.push((id, tx, rx));
        }
        let mut sequences = sequences.into_iter();
        let Some(first) = sequences.next() else {
            return Ok(Vec::new());
        };
        let seq = first
            .with_forks(sequences.collect())
            .with_cache_salt(cache_salt)
            .with_trace(trace);
        let mut senders = channels.iter().map(|(id, tx, _)| (*id, tx.clone()));
        let Some((_, events)) = senders.next() else {
            return Ok(Vec::new());
        };
        let fork_events = senders.collect();
        self.inner
            .scheduler
            .send(Submit {
                seq,
                events,
                fork_events,
            })
            .await
            .map_err(|_| EngineError::Stopped)?
            .map_err(|e| match e {
                SubmitError::QueueFull { .. } | SubmitError::ShuttingDown => {
                    EngineError::Overloaded(e.to_string())
                }
                SubmitError::NeverFits { .. } => EngineError::InvalidRequest(e.to_string()),
            })?;
        Ok(channels
            .into_iter()
            .map(|(id, tx, rx)| {
                drop(tx);
                Generation::new(
                    id,
                    rx,
                    self.inner.tokenizer.clone(),
                    self.inner.scheduler.clone(),
                    params.stop.clone(),
                    prompt_len,
                )
            })
            .collect())
    }
}
