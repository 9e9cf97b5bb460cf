//! The evidence a window gathers while it runs: shadow-KL samples and request fallbacks.

use quantmesh_types::{now_ms, KlReference, MAX_WINDOW_KL_SAMPLES};

/// Shadow-KL samples and request fallbacks of the window in progress. Samples are a
/// reservoir of at most [`MAX_WINDOW_KL_SAMPLES`] (deterministic generator), so the window
/// event stays bounded and unbiased whatever the traffic.
#[derive(Debug, Clone)]
pub(super) struct WindowEvidence {
    pub(super) started_ms: u64,
    pub(super) kl: Vec<f64>,
    pub(super) kl_seen: u64,
    pub(super) kl_reference: Option<KlReference>,
    pub(super) request_kl_fallbacks: u64,
    rng: u64,
}

impl WindowEvidence {
    pub(super) fn new() -> Self {
        Self {
            started_ms: now_ms(),
            kl: Vec::new(),
            kl_seen: 0,
            kl_reference: None,
            request_kl_fallbacks: 0,
            rng: 0x9E37_79B9_7F4A_7C15,
        }
    }

    pub(super) fn sample(&mut self, kl: f64, reference: Option<KlReference>) {
        self.kl_seen += 1;
        // A partial reference anywhere in the window labels the whole window partial.
        self.kl_reference = match (self.kl_reference, reference) {
            (Some(KlReference::PartialFloatWeights), _)
            | (_, Some(KlReference::PartialFloatWeights)) => Some(KlReference::PartialFloatWeights),
            (a, b) => b.or(a),
        };
        if self.kl.len() < MAX_WINDOW_KL_SAMPLES {
            self.kl.push(kl);
            return;
        }
        self.rng = self
            .rng
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        let j = (self.rng >> 11) % self.kl_seen;
        if let Some(slot) = self.kl.get_mut(j as usize) {
            *slot = kl;
        }
    }
}
