//! One answer's stream: text, token ids and log-probabilities as they are produced; dropping
//! it cancels the request.

use crate::kv::SeqId;
use crate::sched::Cancel;
use crate::sched::{SchedulerActor, SeqEvent};
use actix::prelude::*;
use quantmesh_model::{IncrementalDecoder, TextTokenizer};
use quantmesh_types::{FinishReason, TokenLogprobs, Usage};
use std::sync::Arc;
use tokio::sync::mpsc;

/// One item of a generation stream.
#[derive(Debug, Clone, PartialEq)]
pub enum GenerationEvent {
    /// New text; may be empty while a multi-byte character or a possible stop string is
    /// held back. `token` is the sampled token, `None` for text flushed at the end;
    /// `logprobs` its log-probabilities, with their tokens' text, when the request asked
    /// for them.
    Text {
        text: String,
        token: Option<u32>,
        logprobs: Option<LogprobsText>,
    },
    Done {
        reason: FinishReason,
        usage: Usage,
        cached_tokens: usize,
    },
}

/// A sampled token's log-probabilities with the text of the token and of each alternative,
/// each decoded alone (a byte-level token inside a multi-byte character decodes lossily).
#[derive(Debug, Clone, PartialEq)]
pub struct LogprobsText {
    /// The log-probabilities by token id.
    pub ids: TokenLogprobs,
    /// The sampled token's text.
    pub token: String,
    /// The alternatives' texts, in the order of `ids.top`.
    pub top: Vec<String>,
}

impl LogprobsText {
    fn new(tokenizer: &TextTokenizer, token: u32, ids: TokenLogprobs) -> Self {
        let text = |id: u32| tokenizer.decode(&[id]).unwrap_or_default();
        Self {
            token: text(token),
            top: ids.top.iter().map(|&(t, _)| text(t)).collect(),
            ids,
        }
    }
}

/// A running request. Yields text deltas, then one `Done`. Dropping it before `Done`
/// cancels the request and frees its KV pages.
pub struct Generation {
    id: SeqId,
    rx: mpsc::UnboundedReceiver<SeqEvent>,
    decoder: IncrementalDecoder,
    tokenizer: Arc<TextTokenizer>,
    scheduler: Addr<SchedulerActor>,
    stop: Vec<String>,
    /// All text decoded so far; `text[..emitted]` has been handed out.
    text: String,
    emitted: usize,
    prompt_tokens: usize,
    completion_tokens: usize,
    /// Set once the end is known; the next call reports it.
    finish: Option<(FinishReason, usize)>,
    /// The engine no longer holds the request (finished, or cancelled by us).
    released: bool,
    done: bool,
}

impl Generation {
    /// The stream of the queued sequence `id`, whose events arrive on `rx`.
    pub(super) fn new(
        id: SeqId,
        rx: mpsc::UnboundedReceiver<SeqEvent>,
        tokenizer: Arc<TextTokenizer>,
        scheduler: Addr<SchedulerActor>,
        stop: Vec<String>,
        prompt_tokens: usize,
    ) -> Self {
        Self {
            id,
            rx,
            decoder: IncrementalDecoder::default(),
            tokenizer,
            scheduler,
            stop,
            text: String::new(),
            emitted: 0,
            prompt_tokens,
            completion_tokens: 0,
            finish: None,
            released: false,
            done: false,
        }
    }

    pub fn id(&self) -> SeqId {
        self.id
    }

    /// Tokens in the prompt.
    pub fn prompt_tokens(&self) -> usize {
        self.prompt_tokens
    }

    /// Longest suffix of `text[emitted..]` that could still grow into a stop string.
    fn holdback(&self) -> usize {
        let pending = &self.text[self.emitted..];
        let mut hold = 0;
        for s in &self.stop {
            if let Some((i, _)) = pending.char_indices().find(|(i, _)| {
                let tail = &pending[*i..];
                tail.len() < s.len() && s.starts_with(tail)
            }) {
                hold = hold.max(pending.len() - i);
            }
        }
        hold
    }

    fn find_stop(&self) -> Option<usize> {
        let pending = &self.text[self.emitted..];
        self.stop
            .iter()
            .filter_map(|s| pending.find(s.as_str()))
            .min()
            .map(|p| self.emitted + p)
    }

    fn usage(&self) -> Usage {
        Usage {
            prompt_tokens: self.prompt_tokens,
            completion_tokens: self.completion_tokens,
            total_tokens: self.prompt_tokens + self.completion_tokens,
        }
    }

    fn release(&mut self) {
        if !self.released {
            self.released = true;
            self.scheduler.do_send(Cancel(self.id));
        }
    }

    /// The next event, or `None` after `Done`.
    pub async fn next(&mut self) -> Option<GenerationEvent> {
        if self.done {
            return None;
        }
        if let Some((reason, cached_tokens)) = self.finish.take() {
            self.done = true;
            return Some(GenerationEvent::Done {
                reason,
                usage: self.usage(),
                cached_tokens,
            });
        }
        match self.rx.recv().await {
            Some(SeqEvent::Token {
                token, logprobs, ..
            }) => {
                self.completion_tokens += 1;
                let delta = self
                    .decoder
                    .push(&self.tokenizer, token)
                    .unwrap_or_else(|e| {
                        tracing::warn!(error = %e, "detokenization failed");
                        None
                    });
                self.text.push_str(&delta.unwrap_or_default());
                let upto = match self.find_stop() {
                    Some(at) => {
                        // A stop string: end here, free the engine's pages now.
                        self.release();
                        self.finish = Some((FinishReason::Stop, 0));
                        at
                    }
                    None => self.text.len() - self.holdback(),
                };
                let text = self.text[self.emitted..upto].to_string();
                self.emitted = upto;
                Some(GenerationEvent::Text {
                    text,
                    token: Some(token),
                    logprobs: logprobs.map(|lp| LogprobsText::new(&self.tokenizer, token, lp)),
                })
            }
            Some(SeqEvent::Finished {
                reason,
                cached_tokens,
                ..
            }) => {
                self.released = true;
                let tail = self.decoder.flush(&self.tokenizer).unwrap_or_default();
                self.text.push_str(&tail);
                let (end, reason) = match self.find_stop() {
                    Some(at) => (at, FinishReason::Stop),
                    None => (self.text.len(), reason),
                };
                let text = self.text[self.emitted..end].to_string();
                self.emitted = end;
                if text.is_empty() {
                    self.done = true;
                    return Some(GenerationEvent::Done {
                        reason,
                        usage: self.usage(),
                        cached_tokens,
                    });
                }
                self.finish = Some((reason, cached_tokens));
                Some(GenerationEvent::Text {
                    text,
                    token: None,
                    logprobs: None,
                })
            }
            None => {
                self.done = true;
                self.released = true;
                Some(GenerationEvent::Done {
                    reason: FinishReason::Error,
                    usage: self.usage(),
                    cached_tokens: 0,
                })
            }
        }
    }

    /// Run to the end and collect the text (non-streaming use).
    pub async fn collect(mut self) -> (String, FinishReason, Usage, usize) {
        let mut text = String::new();
        while let Some(ev) = self.next().await {
            match ev {
                GenerationEvent::Text { text: t, .. } => text.push_str(&t),
                GenerationEvent::Done {
                    reason,
                    usage,
                    cached_tokens,
                } => return (text, reason, usage, cached_tokens),
            }
        }
        (text, FinishReason::Error, self.usage(), 0)
    }
}

impl Drop for Generation {
    fn drop(&mut self) {
        self.release();
    }
}
