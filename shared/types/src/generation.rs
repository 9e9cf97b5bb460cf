//! What a client asks the engine for, and how a generation ends.

use serde::{Deserialize, Serialize};

/// Sampling parameters, with the OpenAI API's meanings.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SamplingParams {
    /// 0 means greedy.
    pub temperature: f32,
    /// Nucleus sampling mass in (0, 1].
    pub top_p: f32,
    /// 0 disables top-k.
    pub top_k: usize,
    pub max_tokens: usize,
    /// Stop strings: generation ends before the first occurrence.
    pub stop: Vec<String>,
    /// Seed for the request's own RNG: same seed, same output.
    pub seed: Option<u64>,
    /// Stop at the end-of-sequence token (false only for benchmarks).
    pub stop_at_eos: bool,
    /// OpenAI `presence_penalty` in [-2, 2]: subtracted once from the logit of every token
    /// already generated.
    #[serde(default)]
    pub presence_penalty: f32,
    /// OpenAI `frequency_penalty` in [-2, 2]: subtracted per occurrence in the generated text.
    #[serde(default)]
    pub frequency_penalty: f32,
    /// `repetition_penalty` (HF/vLLM extension) in (0, 2]; 1 is off. A token seen in the prompt
    /// or the generated text has a positive logit divided by it, a negative one multiplied.
    #[serde(default = "one")]
    pub repetition_penalty: f32,
    /// OpenAI `logit_bias`: (token id, bias in [-100, 100]) added to the logits.
    #[serde(default)]
    pub logit_bias: Vec<(u32, f32)>,
    /// Return each sampled token's log-probability and this many most likely alternatives
    /// (at most [`MAX_TOP_LOGPROBS`]); `None`: no log-probabilities.
    #[serde(default)]
    pub logprobs: Option<usize>,
}

/// Most alternatives a request may ask log-probabilities for (OpenAI's limit).
pub const MAX_TOP_LOGPROBS: usize = 20;

/// Log-probabilities of one sampled token, from the model's distribution (before
/// temperature, penalties and bias, as vLLM reports them).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TokenLogprobs {
    pub logprob: f32,
    /// The most likely tokens, most likely first.
    pub top: Vec<(u32, f32)>,
}

fn one() -> f32 {
    1.0
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 1.0,
            top_p: 1.0,
            top_k: 0,
            max_tokens: 16,
            stop: Vec::new(),
            seed: None,
            stop_at_eos: true,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            repetition_penalty: 1.0,
            logit_bias: Vec::new(),
            logprobs: None,
        }
    }
}

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SamplingError {
    #[error("temperature must be a finite number in [0, 2], got {0}")]
    Temperature(f32),
    #[error("top_p must be in (0, 1], got {0}")]
    TopP(f32),
    #[error("max_tokens must be at least 1")]
    MaxTokens,
    #[error("at most 4 stop strings are allowed, each non-empty and at most 256 characters")]
    Stop,
    #[error("{0} must be a finite number in [-2, 2], got {1}")]
    Penalty(&'static str, f32),
    #[error("repetition_penalty must be in (0, 2], got {0}")]
    RepetitionPenalty(f32),
    #[error("logit_bias takes at most 300 tokens, each bias a finite number in [-100, 100]")]
    LogitBias,
    #[error("at most {MAX_TOP_LOGPROBS} top log-probabilities per token, got {0}")]
    TopLogprobs(usize),
}

impl SamplingError {
    /// The request field at fault (its OpenAI name).
    pub fn param(&self) -> &'static str {
        match self {
            SamplingError::Temperature(_) => "temperature",
            SamplingError::TopP(_) => "top_p",
            SamplingError::MaxTokens => "max_tokens",
            SamplingError::Stop => "stop",
            SamplingError::Penalty(name, _) => name,
            SamplingError::RepetitionPenalty(_) => "repetition_penalty",
            SamplingError::LogitBias => "logit_bias",
            SamplingError::TopLogprobs(_) => "logprobs",
        }
    }
}

impl SamplingParams {
    pub fn validate(&self) -> Result<(), SamplingError> {
        if !self.temperature.is_finite() || !(0.0..=2.0).contains(&self.temperature) {
            return Err(SamplingError::Temperature(self.temperature));
        }
        if !self.top_p.is_finite() || self.top_p <= 0.0 || self.top_p > 1.0 {
            return Err(SamplingError::TopP(self.top_p));
        }
        if self.max_tokens == 0 {
            return Err(SamplingError::MaxTokens);
        }
        if self.stop.len() > 4
            || self
                .stop
                .iter()
                .any(|s| s.is_empty() || s.chars().count() > 256)
        {
            return Err(SamplingError::Stop);
        }
        for (name, v) in [
            ("presence_penalty", self.presence_penalty),
            ("frequency_penalty", self.frequency_penalty),
        ] {
            if !v.is_finite() || !(-2.0..=2.0).contains(&v) {
                return Err(SamplingError::Penalty(name, v));
            }
        }
        let rp = self.repetition_penalty;
        if !rp.is_finite() || rp <= 0.0 || rp > 2.0 {
            return Err(SamplingError::RepetitionPenalty(rp));
        }
        if self.logit_bias.len() > 300
            || self
                .logit_bias
                .iter()
                .any(|(_, b)| !b.is_finite() || !(-100.0..=100.0).contains(b))
        {
            return Err(SamplingError::LogitBias);
        }
        if let Some(n) = self.logprobs.filter(|&n| n > MAX_TOP_LOGPROBS) {
            return Err(SamplingError::TopLogprobs(n));
        }
        Ok(())
    }

    /// Whether any penalty or bias changes the logits before sampling.
    pub fn adjusts_logits(&self) -> bool {
        self.presence_penalty != 0.0
            || self.frequency_penalty != 0.0
            || self.repetition_penalty != 1.0
            || !self.logit_bias.is_empty()
    }
}

/// Why a generation ended (OpenAI's `finish_reason`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// End-of-sequence token or a stop string.
    Stop,
    /// `max_tokens` reached.
    Length,
    /// The client went away or the request was cancelled.
    Cancelled,
    /// The engine failed this request.
    Error,
}

impl FinishReason {
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::Cancelled => "cancelled",
            FinishReason::Error => "error",
        }
    }
}

/// Token accounting of one request.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub total_tokens: usize,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn validation_rejects_out_of_range() {
        let ok = SamplingParams::default();
        assert!(ok.validate().is_ok());
        let bad = |f: fn(&mut SamplingParams)| {
            let mut p = SamplingParams::default();
            f(&mut p);
            p.validate().is_err()
        };
        assert!(bad(|p| p.temperature = -1.0));
        assert!(bad(|p| p.temperature = f32::NAN));
        assert!(bad(|p| p.top_p = 0.0));
        assert!(bad(|p| p.top_p = 1.5));
        assert!(bad(|p| p.max_tokens = 0));
        assert!(bad(|p| p.stop = vec![String::new()]));
        assert!(bad(|p| p.presence_penalty = 2.5));
        assert!(bad(|p| p.frequency_penalty = f32::INFINITY));
        assert!(bad(|p| p.repetition_penalty = 0.0));
        assert!(bad(|p| p.logit_bias = vec![(1, 101.0)]));
    }
}
