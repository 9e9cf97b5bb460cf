//! The monitor's parameters (`engine.monitor` in the configuration file; thresholds and
//! per-group overrides also come from `sensitive_layers.json`, see `plan.rs`).

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct MonitorConfig {
    pub enabled: bool,
    /// Outlier bound: `mean + k·σ`.
    pub k: f64,
    /// A group whose outlier rate over a window exceeds this falls back.
    pub trigger_rate: f64,
    /// Requests per window (counters reset at each window end).
    pub window_requests: usize,
    /// A window with fewer tokens (per group) decides nothing for that group.
    pub min_window_tokens: u64,
    /// Rows per group before the detector may trigger (half to learn channels, half stats).
    pub warmup_tokens: usize,
    /// Quiet windows (rate < trigger_rate / 2) before a group returns to INT8.
    pub recovery_windows: usize,
    /// Per-token bound: rows above `mean + token_k·σ` run that group in float at once.
    pub token_k: f64,
    /// Token positions never counted (attention sinks).
    pub skip_positions: Vec<usize>,
    /// Share of warm-up rows in which a channel is the abs-argmax for it to be a massive
    /// fixed channel.
    pub massive_channel_share: f64,
    /// Extra channels to exclude in every group whose input is the residual stream
    /// (qkv, gate_up), e.g. from the pre-screen.
    pub massive_channels: Vec<usize>,
    /// Fraction of steps on which the float-path logits are computed too (shadow KL).
    pub shadow_sample_rate: f64,
    /// A request whose sampled KL(P_float ‖ P_served) exceeds this runs in float from then on.
    pub request_kl_limit: f64,
    /// More than this share of groups in fallback → every step runs in float.
    pub batch_group_share: f64,
    /// Per-group overrides of `k` and `trigger_rate`, keyed like `layers.1.down`.
    pub overrides: BTreeMap<String, GroupOverride>,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct GroupOverride {
    pub k: Option<f64>,
    pub trigger_rate: Option<f64>,
    /// Input channels this group's statistic ignores (from `sensitive_layers.json`).
    pub massive_channels: Vec<usize>,
}

impl Default for MonitorConfig {
    fn default() -> Self {
        Self {
            enabled: true,
            k: 4.0,
            trigger_rate: 0.01,
            window_requests: 1000,
            min_window_tokens: 64,
            warmup_tokens: 512,
            recovery_windows: 3,
            token_k: 16.0,
            skip_positions: vec![0],
            massive_channel_share: 0.5,
            massive_channels: Vec::new(),
            shadow_sample_rate: 0.01,
            request_kl_limit: 0.02,
            batch_group_share: 0.5,
            overrides: BTreeMap::new(),
        }
    }
}
