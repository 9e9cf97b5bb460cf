//! Engine configuration: cache geometry, batching limits, the default precision plan.

use crate::forms::{EmbeddingDtype, FloatDtype, Forms, SplitActivations};
use crate::kv::{KvFloatDtype, KvScale};
use quantmesh_types::{FloatBudget, Residency, WeightBudget};
use serde::{Deserialize, Serialize};

pub use quantmesh_types::DEFAULT_ROTATION_BLOCK;

/// [`EngineConfig::wide_activations`]'s default.
pub const DEFAULT_WIDE_ACTIVATIONS: f64 = 2.0;

/// How the engine runs: cache geometry, batching limits and the default precision plan.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct EngineConfig {
    /// Tokens per KV page.
    pub page_size: usize,
    /// Pages in the KV pool (shared by all layers: one page id addresses every layer).
    pub num_pages: usize,
    /// Most sequences in one step.
    pub max_num_seqs: usize,
    /// Most tokens in one step (prefill chunks + decodes).
    pub max_num_batched_tokens: usize,
    /// Most requests waiting for admission; beyond this `submit` fails with `Overloaded`.
    pub max_waiting: usize,
    /// Residency of every linear group unless `group_residency` says otherwise.
    pub default_residency: Residency,
    /// Per-group overrides, keyed like `layers.1.down`.
    pub group_residency: std::collections::BTreeMap<String, Residency>,
    /// How float copies of linear groups are stored (`f16`, `bf16`, `f32`).
    pub float_dtype: FloatDtype,
    /// Most bytes the float copies of linear groups may take: `unlimited`, a share of the
    /// INT8 linear weights (`"10%"`), or bytes (`"64MiB"`). Groups over budget become
    /// INT8-only, weakest pre-screen evidence first.
    pub float_budget: FloatBudget,
    /// Most bytes of resident weights for the first-load plan (bytes like `"100MiB"` or a
    /// share of the all-16-bit model like `"0.38x"`): the pre-screen puts each group in 4 or
    /// 8 bits to fit, least predicted loss first. Unset (the default): every group the rules
    /// put in 8 bits stays there (SmolLM2: 0.56x).
    pub weight_budget: Option<WeightBudget>,
    /// How the token embedding and `lm_head` are stored: `auto` (default: f16 when their
    /// bytes beyond Q8_0 fit in `float_budget`, which serves them first; else `q8_0`),
    /// `q8_0`, `q4_s8`, `f16` or `f32`. 16-bit tables are charged to the float budget either
    /// way. A plan's `tables` (a weight budget writes `q4_s8` there) wins over this.
    pub embeddings: EmbeddingDtype,
    /// Which rows on the quantized path carry ≈ 16-bit activations (no extra memory; one
    /// pass at the cost of 8-bit ones, on Q8_0 and 4-bit weights alike): `all` (default; the Q8_0 `lm_head` too), `copyless` (rows that want
    /// float in a group without a float copy, e.g. over the float budget) or `off` (the
    /// plain W8A8 product).
    pub split_activations: SplitActivations,
    /// Under `copyless`: a group whose served W8A8 output error on the plan's calibration
    /// rows (the pre-screen's `act8_nsr`, activations included) is at least this multiple
    /// of its 8-bit weights' own error (`nsr.w8a8`, activations at 16 bits) carries 16-bit
    /// activations on every row, not only on the rows the monitor wants at higher
    /// precision: where 8-bit activations would cost the group more than its weights'
    /// quantization does. 0: none (groups without those measurements never are).
    pub wide_activations: f64,
    /// Rotate activations by `H_b / √b` (a Walsh–Hadamard block of `b` channels, `b` a power
    /// of two; the widest power of two up to it that divides a group's input) before the
    /// quantized path quantizes them, the quantized weights rotated to match once at load:
    /// the product is unchanged in float, an outlier channel is spread over its block
    /// instead of setting the block's 8-bit step alone. Float copies keep the checkpoint's
    /// exact function either way. 0: none; default [`DEFAULT_ROTATION_BLOCK`].
    pub rotation_block: u32,
    /// KV cache precision at start for every layer: `true` = INT8 (C8).
    pub kv_int8: bool,
    pub kv_float_dtype: KvFloatDtype,
    /// Channels sharing one C8 scale: `token` (the whole K or V vector, the seed's) or
    /// `head` (one scale per KV head).
    pub kv_scale: KvScale,
    /// Reuse full KV pages across requests with the same prefix.
    pub prefix_caching: bool,
    /// The activation monitor (statistics, fallback decisions, shadow KL).
    pub monitor: crate::monitor::MonitorConfig,
    /// `sensitive_layers.json` to serve with and hot-reload: a local path or an object-store
    /// URL (`file://`, and `s3://`, `gs://`, `az://` when built with `--features cloud`).
    /// A versioned prefix's `latest` pointer is followed.
    pub sensitive_layers: Option<String>,
    /// An absent `sensitive_layers` object is not an error: serve `initial_plan` (or
    /// `default_residency` everywhere) until one is published there, then hot-reload it —
    /// for a plan store that starts empty (the compose stack's object store). Only a
    /// "not found" is tolerated; an unreachable store still fails the start.
    pub sensitive_layers_optional: bool,
    /// The plan served while an optional `sensitive_layers` source has no object yet (a
    /// local file; the gateway puts the first-load plan here).
    pub initial_plan: Option<std::path::PathBuf>,
    /// How often the source is polled for a new version (md5 of its bytes).
    #[serde(with = "humantime_serde")]
    pub reload_interval: std::time::Duration,
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            page_size: 16,
            num_pages: 2048,
            max_num_seqs: 32,
            max_num_batched_tokens: 512,
            max_waiting: 256,
            default_residency: Residency::Dual,
            group_residency: Default::default(),
            float_dtype: FloatDtype::default(),
            float_budget: FloatBudget::default(),
            weight_budget: None,
            embeddings: EmbeddingDtype::Auto,
            split_activations: SplitActivations::default(),
            wide_activations: DEFAULT_WIDE_ACTIVATIONS,
            rotation_block: DEFAULT_ROTATION_BLOCK,
            kv_int8: true,
            kv_float_dtype: KvFloatDtype::F16,
            kv_scale: KvScale::default(),
            prefix_caching: true,
            monitor: Default::default(),
            sensitive_layers: None,
            sensitive_layers_optional: false,
            initial_plan: None,
            reload_interval: std::time::Duration::from_secs(30),
        }
    }
}

impl EngineConfig {
    /// How the backend stores what the plan does not decide, with the vocabulary tables
    /// in `tables` (the plan's resolution of `embeddings`: `LivePlan::forms`).
    pub fn forms_with(&self, tables: EmbeddingDtype) -> Forms {
        Forms {
            float: self.float_dtype,
            embeddings: tables,
            split: self.split_activations,
            rotation: self.rotation_block,
        }
    }

    pub fn validate(&self) -> Result<(), ConfigError> {
        let bad = |m: &str| Err(ConfigError(m.to_string()));
        if self.page_size == 0 || self.page_size > 1024 {
            return bad("page_size must be in 1..=1024");
        }
        if self.num_pages == 0 {
            return bad("num_pages must be > 0");
        }
        if self.max_num_seqs == 0 || self.max_num_batched_tokens == 0 {
            return bad("max_num_seqs and max_num_batched_tokens must be > 0");
        }
        let b = self.rotation_block;
        if b != 0 && (!b.is_power_of_two() || b > 4096) {
            return bad("rotation_block must be 0 (none) or a power of two up to 4096");
        }
        if !(self.wide_activations >= 0.0 && self.wide_activations.is_finite()) {
            return bad("wide_activations must be a finite ratio >= 0 (0: no group)");
        }
        let m = &self.monitor;
        if !(m.k > 0.0
            && m.token_k > 0.0
            && (0.0..=1.0).contains(&m.trigger_rate)
            && (0.0..=1.0).contains(&m.shadow_sample_rate)
            && (0.0..=1.0).contains(&m.batch_group_share)
            && m.request_kl_limit >= 0.0)
        {
            return bad("monitor: k and token_k must be > 0; trigger_rate, shadow_sample_rate and batch_group_share in [0, 1]; request_kl_limit >= 0");
        }
        if self.reload_interval < std::time::Duration::from_millis(10) {
            return bad("reload_interval must be at least 10ms");
        }
        if m.window_requests == 0 || m.warmup_tokens < 2 {
            return bad("monitor: window_requests must be > 0 and warmup_tokens >= 2");
        }
        for key in self.group_residency.keys().chain(m.overrides.keys()) {
            key.parse::<quantmesh_types::GroupId>()
                .map_err(ConfigError)?;
        }
        Ok(())
    }
}

/// A configuration value out of its range, in words that name it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct ConfigError(pub String);
