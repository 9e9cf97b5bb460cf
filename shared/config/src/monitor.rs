//! The monitor's parameters (`engine.monitor` in the configuration file; thresholds and
//! per-group overrides also come from `sensitive_layers.json`, merged by the engine's plan).

use quantmesh_model::massive::{DEFAULT_MASSIVE_RATIO, DEFAULT_MASSIVE_SHARE};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct MonitorConfig {
    pub enabled: bool,
    /// Outlier bound: `mean + k·σ`.
    pub k: f64,
    /// Relative floor of the outlier bound: a row is an outlier only above
    /// `mean·(1 + min_excess)` as well (a material growth of its INT8 scale).
    pub min_excess: f64,
    /// A row also counts as an outlier when the group's quantized weights give its output a
    /// noise-to-signal ratio above this (the harm statistic, `ColumnError::nsr`: per input
    /// column, the weights' squared quantization error against their energy, weighted by
    /// the row's squared inputs). It sees what the activation spike test cannot: weights
    /// that their quantization hurts on the inputs they get. 0 turns it off.
    pub max_nsr: f64,
    /// Confidence of the fallback decision: a window enters fallback only when its outlier
    /// rate exceeds `trigger_rate` by `trigger_z` binomial standard errors.
    pub trigger_z: f64,
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
    /// Share of warm-up rows in which a channel must be massive (see
    /// `massive_channel_ratio`) for it to be a massive fixed channel.
    pub massive_channel_share: f64,
    /// A channel is massive in a row when its magnitude exceeds this multiple of the row's
    /// median magnitude (`quantmesh_model::massive`).
    pub massive_channel_ratio: f32,
    /// Extra channels to exclude in every group whose input is the residual stream
    /// (qkv, gate_up), e.g. from the pre-screen.
    pub massive_channels: Vec<usize>,
    /// Fraction of steps on which the float-path logits are computed too (shadow KL).
    pub shadow_sample_rate: f64,
    /// Where the shadow pass takes the float weights of groups that hold no float copy:
    /// `resident` (default: they run INT8 in the reference too; the KL is labelled
    /// `partial_float_weights`) or `checkpoint` (exact: read from the memory-mapped
    /// checkpoint, the first `shadow_reference_cache_mib` of them kept).
    pub shadow_reference: ShadowReference,
    /// MiB of checkpoint weights the shadow reference keeps in memory (in the engine's
    /// `float_dtype`); groups beyond it are read again on every shadow pass.
    pub shadow_reference_cache_mib: usize,
    /// A request whose sampled KL(P_float ‖ P_served) exceeds this runs in float from then on.
    pub request_kl_limit: f64,
    /// More than this share of groups in fallback → every step runs in float.
    pub batch_group_share: f64,
    /// Put the token ids of per-token decisions into events (logs, Kafka). Off by default:
    /// they are the user's text; positions and counts are always there.
    pub event_token_ids: bool,
    /// Per-group overrides of `k` and `trigger_rate`, keyed like `layers.1.down`.
    pub overrides: BTreeMap<String, GroupOverride>,
}

/// Where the shadow pass's reference takes float weights for groups without a float copy.
/// Measured on SmolLM2-135M (`quantmesh-engine-bench --shadow-cost`, INT8-only, batch 1):
/// reading every group from the checkpoint makes a shadow pass 28× a served decode step
/// (+28 % compute at the default 1 % sampling), 1.6× when all are kept (+202 MiB), so the
/// exact reference is opt-in.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ShadowReference {
    /// The checkpoint's weights (exact reference; costs reads on shadow passes).
    Checkpoint,
    /// Only resident float copies (groups without one run INT8 in the reference too; the
    /// KL is labelled `partial_float_weights`).
    #[default]
    Resident,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct GroupOverride {
    pub k: Option<f64>,
    pub trigger_rate: Option<f64>,
    pub min_excess: Option<f64>,
    pub max_nsr: Option<f64>,
    /// Input channels this group's statistic ignores (from `sensitive_layers.json`).
    pub massive_channels: Vec<usize>,
}

/// The harm bound's default (see docs/design/monitor.md).
pub const DEFAULT_MAX_NSR: f64 = 0.01;

impl Default for MonitorConfig {
    fn default() -> Self {
        Self {
            enabled: true,
            k: 4.0,
            min_excess: 1.0,
            max_nsr: DEFAULT_MAX_NSR,
            trigger_z: 2.0,
            trigger_rate: 0.01,
            window_requests: 1000,
            min_window_tokens: 64,
            warmup_tokens: 512,
            recovery_windows: 3,
            token_k: 16.0,
            skip_positions: vec![0],
            massive_channel_share: DEFAULT_MASSIVE_SHARE,
            massive_channel_ratio: DEFAULT_MASSIVE_RATIO,
            massive_channels: Vec::new(),
            shadow_sample_rate: 0.01,
            shadow_reference: ShadowReference::Resident,
            shadow_reference_cache_mib: 0,
            request_kl_limit: 0.02,
            batch_group_share: 0.5,
            event_token_ids: false,
            overrides: BTreeMap::new(),
        }
    }
}
