//! A snapshot of the engine's state for metrics and health endpoints.

use std::sync::{Arc, Mutex};

#[derive(Debug, Clone, Default, PartialEq)]
pub struct EngineStats {
    pub running: usize,
    pub waiting: usize,
    pub kv_pages_used: usize,
    pub kv_pages_free: usize,
    pub kv_pages_total: usize,
    pub kv_fragmentation: f64,
    pub prefix_cache_hit_pages: u64,
    pub steps: u64,
    pub tokens_processed: u64,
    /// Linear-group rows computed in float / INT8 since start.
    pub float_rows: u64,
    pub int8_rows: u64,
    /// Of the rows that wanted float in a group without a float copy, those computed with
    /// split (≈ 16-bit) activations on the quantized weights.
    pub split_rows: u64,
    /// Rows that asked for float in a group holding only INT8 ("wanted fallback, unavailable").
    pub fallback_unavailable_rows: u64,
    pub mask_version: u64,
    pub resident_weight_bytes: usize,
    /// Resident weights by form, and the all-f16 baseline.
    pub weights: crate::backend::WeightBytes,
    pub linear_weight_bytes: usize,
    pub kv_bytes_per_token_int8: usize,
    pub kv_bytes_per_token_float: usize,
    /// Total time spent choosing paths (mask checks, per-token routing).
    pub mask_check_ns: u64,
    /// Steps that also ran the float shadow pass.
    pub shadow_steps: u64,
    /// Steps recomputed in float after NaN/Inf.
    pub batch_recomputes: u64,
    /// Observations the monitor's full mailbox could not take.
    pub monitor_observations_dropped: u64,
    /// Steps that failed (their requests failed with them), and how many of those panicked.
    pub step_failures: u64,
    pub step_panics: u64,
}

/// Shared, cheaply readable stats cell (written by the scheduler after every step).
#[derive(Debug, Clone, Default)]
pub struct StatsCell(Arc<Mutex<EngineStats>>);

impl StatsCell {
    pub fn new(initial: EngineStats) -> Self {
        Self(Arc::new(Mutex::new(initial)))
    }

    pub fn get(&self) -> EngineStats {
        match self.0.lock() {
            Ok(g) => g.clone(),
            Err(p) => p.into_inner().clone(),
        }
    }

    pub fn update(&self, f: impl FnOnce(&mut EngineStats)) {
        let mut g = match self.0.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        };
        f(&mut g);
    }
}
