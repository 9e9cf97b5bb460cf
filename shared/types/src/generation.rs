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
    #[error("at most 4 stop strings are allowed, each non-empty and at most 256 bytes")]
    Stop,
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
        if self.stop.len() > 4 || self.stop.iter().any(|s| s.is_empty() || s.len() > 256) {
            return Err(SamplingError::Stop);
        }
        Ok(())
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
    }
}
