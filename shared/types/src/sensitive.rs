//! `sensitive_layers.json`, schema v1: the precision plan and monitor thresholds a model is
//! served with. Written by the offline pre-screen (`quantmesh prescreen`), read (and
//! hot-reloaded) by the engine, rewritten weekly by the evolution job.
//!
//! Contract (also published as a JSON Schema, `shared/schemas/sensitive_layers.v1.schema.json`,
//! generated from these types and checked by a test):
//! * **Unknown fields are rejected**, everywhere, with the JSON path of the offending field.
//!   A typo in a threshold name must not silently leave the old value in force.
//! * Groups are keyed by *fused* group id (`layers.N.qkv|o|gate_up|down`): q/k/v and
//!   gate/up share one entry, so a mixed precision inside a fused group cannot be written.
//! * Everything but `schema_version` is optional. Thresholds that are absent keep the
//!   engine's configured value; groups that are absent keep the engine's configured residency.
//! * Additive changes only within v1 (new *optional* fields); anything else is v2.

use crate::precision::{GroupId, GroupKind, PrecisionClass, Residency};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

pub const SENSITIVE_LAYERS_SCHEMA_VERSION: u32 = 1;

/// The whole file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct SensitiveLayers {
    /// Always 1 for this schema.
    pub schema_version: u32,
    /// The checkpoint this file was computed for. When present the engine refuses the file
    /// for any other tensor layout.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<ModelFingerprint>,
    /// Who wrote the file, when, and from what.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub generator: Option<Generator>,
    /// Global activation-hook thresholds.
    #[serde(default)]
    pub thresholds: HookThresholds,
    /// Per fused linear group, keyed like `layers.1.down`.
    #[serde(default)]
    pub groups: BTreeMap<String, GroupEntry>,
    /// How many bytes float copies may take (`"10%"` of the INT8 linear weights, `"64MiB"`,
    /// `"unlimited"`); absent: the engine's `engine.float_budget`. Applied on every reload,
    /// like residencies (optional, added in v1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub float_budget: Option<crate::FloatBudget>,
    /// How the vocabulary tables (token embedding, `lm_head`) are stored: `q8_0`, `q4_s8`,
    /// `f16`, `f32` or `auto`; absent: the engine's `engine.embeddings`. Written by a weight
    /// budget that put the tables in 4 bits; applied on every reload (the tables are rebuilt
    /// off the serving thread and swapped between two steps, like groups).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tables: Option<crate::EmbeddingDtype>,
}

/// Identifies a checkpoint.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ModelFingerprint {
    pub num_layers: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    /// md5 (hex) over every tensor's name, dtype and shape in name order: cheap to compute
    /// at engine start, so the engine checks it.
    pub layout_md5: String,
    /// md5 (hex) over the layout and every tensor's bytes in name order (the pre-screen
    /// computes it while it reads the weights anyway); provenance only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub content_md5: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Generator {
    /// e.g. `quantmesh prescreen`.
    pub tool: String,
    pub version: String,
    /// RFC 3339, UTC.
    pub timestamp: String,
    /// md5 of the calibration file and how much of it was used.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub calibration: Option<CalibrationInfo>,
    /// The classification rules in force (see the pre-screen's rules file).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rules: Option<BTreeMap<String, f64>>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct CalibrationInfo {
    pub md5: String,
    pub prompts: usize,
    pub tokens: usize,
}

/// Global thresholds of the activation hook. Each absent field keeps the engine's value.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct HookThresholds {
    /// Outlier bound `mean + k·σ` (> 0).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub k: Option<f64>,
    /// Relative floor of the outlier bound: a row counts only above `mean·(1 + min_excess)`
    /// too, i.e. when it would grow the row's INT8 scale materially (≥ 0; added in v1 as an
    /// optional field).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_excess: Option<f64>,
    /// Harm bound: a row counts as an outlier too when the group's quantized weights give
    /// its output a noise-to-signal ratio above this (≥ 0, 0 = off; added in v1 as an
    /// optional field).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_nsr: Option<f64>,
    /// Outlier share of a window above which a group falls back (0–1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub trigger_rate: Option<f64>,
    /// Finished requests per window (≥ 1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub window_requests: Option<usize>,
    /// Quiet windows before a group returns to INT8 (≥ 1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub recovery_windows: Option<usize>,
    /// Per-token bound `mean + token_k·σ` (> 0).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token_k: Option<f64>,
    /// Share of steps that also compute float logits for the shadow KL (0–1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shadow_sample_rate: Option<f64>,
    /// Per-request KL(P_float ‖ P_served) limit in nats (≥ 0).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub request_kl_limit: Option<f64>,
}

/// One fused linear group.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct GroupEntry {
    /// The pre-screen's class.
    pub class: PrecisionClass,
    /// What stays resident; absent = the class's default mapping (`fp16` → float,
    /// `w8a8_per_channel` → dual, `w8a8`/`w4a16` → int8).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub residency: Option<Residency>,
    /// The rule that chose the class (pre-screen).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rule: Option<String>,
    /// The weight metrics that justified the class.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metrics: Option<GroupMetrics>,
    /// Activation statistics of the group's input on the calibration set.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub activations: Option<ActivationStats>,
    /// Per-group monitor overrides.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub monitor: Option<MonitorOverride>,
    /// Input channels with massive, input-invariant activations: the monitor ignores them.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub massive_channels: Vec<usize>,
    /// What the activation monitor saw of this group in served traffic (written by the
    /// evolution service when it promotes a group); the float budget ranks such groups above
    /// those with pre-screen evidence only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed: Option<ObservedUse>,
    /// Scale migration (SmoothQuant) on the group's quantized path: per input channel a
    /// power-of-two factor moved from the activations into the quantized weights' columns,
    /// so an activation outlier channel no longer sets its block's step alone. Absent: none.
    /// The float copy stays the checkpoint's weight (optional, added in v1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub smoothing: Option<Smoothing>,
}

/// [`GroupEntry::smoothing`]: the factors `2^e` of every input channel. The quantized path
/// multiplies channel `j` of the input by `2^-e_j` before it is rotated and quantized, and
/// the weights' column `j` by `2^e_j` before they are: the same function in float, exactly
/// (powers of two scale without rounding).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Smoothing {
    /// The migration strength α the factors were computed with:
    /// `e_j = round(log2(max|x_j|^α / max|W_:,j|^(1-α)))` over the calibration rows.
    pub alpha: f64,
    /// `e_j` of every input channel in order, as space-separated integers in
    /// [-[`MAX_SMOOTHING_EXPONENT`], [`MAX_SMOOTHING_EXPONENT`]].
    pub log2_factors: String,
}

/// The largest |exponent| a smoothing factor may have (factors within 2^±20).
pub const MAX_SMOOTHING_EXPONENT: i32 = 20;

impl Smoothing {
    /// Encode exponents.
    pub fn new(alpha: f64, exponents: &[i8]) -> Self {
        let log2_factors = exponents
            .iter()
            .map(|e| e.to_string())
            .collect::<Vec<_>>()
            .join(" ");
        Self {
            alpha,
            log2_factors,
        }
    }

    /// The exponents, checked: each an integer within the range, `width` of them.
    pub fn exponents(&self, width: usize) -> Result<Vec<i8>, String> {
        let mut out = Vec::with_capacity(width);
        for (i, tok) in self.log2_factors.split_ascii_whitespace().enumerate() {
            let e: i32 = tok
                .parse()
                .map_err(|_| format!("log2_factors[{i}] = {tok:?} is not an integer"))?;
            if e.abs() > MAX_SMOOTHING_EXPONENT {
                return Err(format!(
                    "log2_factors[{i}] = {e} is outside ±{MAX_SMOOTHING_EXPONENT}"
                ));
            }
            out.push(e as i8);
        }
        if out.len() != width {
            return Err(format!(
                "log2_factors holds {} factors; the group's input width is {width}",
                out.len()
            ));
        }
        Ok(out)
    }
}

/// Served-traffic evidence for a group's float copy.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ObservedUse {
    /// Monitor windows that measured the group.
    pub windows: u64,
    /// Share of those windows in which the group was in float or wanted float it did not
    /// hold (0–1).
    pub wanted_float_share: f64,
}

impl GroupEntry {
    /// The served W8A8 harm of this entry as it stands: with its factors where it keeps
    /// them (`None`: not measured).
    pub fn served_act8_nsr(&self) -> Option<f64> {
        let a = self.metrics.as_ref()?.act8_nsr.as_ref()?;
        Some(if self.smoothing.is_some() {
            a.smoothed
        } else {
            a.plain
        })
    }

    pub fn effective_residency(&self) -> Residency {
        self.residency
            .unwrap_or_else(|| self.class.default_residency())
    }

    /// Give the group the harm bound of its bits: in `w4a16` its calibrated 4-bit bound
    /// ([`GroupMetrics::max_nsr_w4a16`]) as `monitor.max_nsr`; in any other class that bound
    /// removed again (the engine's default applies), an operator's own bound kept.
    pub fn fit_harm_bound_to_class(&mut self) {
        let Some(bound) = self.metrics.as_ref().and_then(|m| m.max_nsr_w4a16) else {
            return;
        };
        if self.class == PrecisionClass::W4a16 {
            self.monitor.get_or_insert_with(Default::default).max_nsr = Some(bound);
        } else if let Some(m) = self.monitor.as_mut() {
            if m.max_nsr == Some(bound) {
                m.max_nsr = None;
            }
            if *m == MonitorOverride::default() {
                self.monitor = None;
            }
        }
    }
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct MonitorOverride {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub k: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub trigger_rate: Option<f64>,
    /// This group's relative floor of the outlier bound (≥ 0).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_excess: Option<f64>,
    /// This group's harm bound (≥ 0, 0 = off).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_nsr: Option<f64>,
}

/// Weight metrics of a group (the fused members' weights taken together).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct GroupMetrics {
    /// Dispersion `(max − min) / (Q3 − Q1)` of the weights.
    pub r: f64,
    /// KL(P ‖ Q) in nats of the group's output histogram, float vs pseudo-quantized, per
    /// candidate format.
    pub kl: KlByFormat,
    /// Energy ratio σ1² / Σσᵢ² = σ1² / ‖W‖²_F (1 for a rank-1 matrix).
    pub energy: f64,
    /// The error each bit width adds to the residual stream, where the group's output lands
    /// after the rest of its layer's half (through attention and `o` for `qkv`, through
    /// SwiGLU and `down` for `gate_up`): ‖δ‖² over the calibration rows relative to the
    /// stream's ‖h‖² after the layer. What a weight budget's knapsack weighs (a group's own
    /// output KL cannot see that the next group amplifies its error).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub residual: Option<ResidualByBits>,
    /// The 4-bit form's harm bound: the output noise-to-signal ratio of a row (the monitor's
    /// harm statistic) that the calibration rows exceed at the plan's trigger rate when the
    /// group is in `w4a16`. A group put in 4 bits is served with it as its `monitor.max_nsr`,
    /// so its window outlier rate crosses the trigger only when traffic makes its 4-bit
    /// error larger than calibration did: the evidence that moves it to 8 bits.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_nsr_w4a16: Option<f64>,
    /// The mean harm of the group's served forms on the calibration rows (output
    /// noise-to-signal ratio, the monitor's statistic): what the evolution job divides the
    /// served harm by, to scale the bits costs to the traffic the engines saw.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nsr: Option<HarmByBits>,
    /// The served 8-bit-activation product's output noise-to-signal ratio on the calibration
    /// rows (Q8_0 weights, activations quantized per block of 32, both rotated as the engine
    /// rotates them): what W8A8 costs the group, activations included, unsmoothed and with
    /// its candidate smoothing factors (optional, added in v1). Where the engine serves 8-bit
    /// activations, the float budget ranks groups by it (the form served: `smoothed` when
    /// the entry keeps its factors, else `plain`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub act8_nsr: Option<Act8Nsr>,
}

/// [`GroupMetrics::act8_nsr`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Act8Nsr {
    /// Without smoothing factors.
    pub plain: f64,
    /// With the candidate factors; equal to `plain` where none were computed (scale
    /// migration off, or fewer calibration tokens than the rules ask for).
    pub smoothed: f64,
}

/// [`GroupMetrics::nsr`]: the calibration rows' mean harm in each served width.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct HarmByBits {
    /// Q8_0, the form every 8-bit class is served in.
    pub w8a8: f64,
    pub w4a16: f64,
}

impl GroupMetrics {
    /// What the group costs in 4 bits and in 8 (`(w4a16, w8a8_per_channel)`) when a weight
    /// budget chooses its width: the error it adds to the residual stream, or its own output
    /// KL in a plan written before that was measured.
    pub fn bits_cost(&self) -> (f64, f64) {
        match &self.residual {
            Some(r) => (r.w4a16, r.w8a8_per_channel),
            None => (self.kl.w4a16, self.kl.w8a8_per_channel),
        }
    }
}

/// [`GroupMetrics::residual`]: per bit width a weight budget chooses between.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ResidualByBits {
    pub w8a8_per_channel: f64,
    pub w4a16: f64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct KlByFormat {
    pub w8a8: f64,
    pub w8a8_per_channel: f64,
    pub w4a16: f64,
}

/// Statistics of a group's input activations on the calibration set (position 0 excluded).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ActivationStats {
    /// Largest |x| over all tokens and channels.
    pub absmax: f64,
    /// Excess kurtosis of all input values (0 for a Gaussian).
    pub kurtosis: f64,
    /// absmax / 99.9th percentile of |x|: how far the extreme values sit from the bulk.
    pub quantile_score: f64,
    /// The channels with the largest abs-max, as `[channel, absmax]`, largest first.
    pub top_channels: Vec<(usize, f64)>,
}

/// The shape facts validation needs from the loaded model.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelShape {
    pub num_layers: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    /// Width of the attention output (`num_heads · head_dim`), the input of `o`.
    pub attn_dim: usize,
    pub layout_md5: String,
}

impl ModelShape {
    /// Input width of a group (the range of valid channel indices).
    pub fn input_dim(&self, kind: GroupKind) -> usize {
        match kind {
            GroupKind::Qkv | GroupKind::GateUp => self.hidden_size,
            GroupKind::O => self.attn_dim,
            GroupKind::Down => self.intermediate_size,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum SensitiveLayersError {
    #[error("not valid sensitive_layers.json: {0}")]
    Parse(String),
    #[error("sensitive_layers.json rejected: {}", .0.join("; "))]
    Invalid(Vec<String>),
}

/// A file that parsed and validated, with the group ids resolved.
#[derive(Debug, Clone, PartialEq)]
pub struct ValidatedPlan {
    pub file: SensitiveLayers,
    pub groups: BTreeMap<GroupId, GroupEntry>,
}

impl SensitiveLayers {
    /// Parse strictly: unknown fields and wrong types fail with the JSON path.
    pub fn parse(bytes: &[u8]) -> Result<Self, SensitiveLayersError> {
        let de = &mut serde_json::Deserializer::from_slice(bytes);
        serde_path_to_error::deserialize(de).map_err(|e| {
            let path = e.path().to_string();
            let inner = e.into_inner();
            SensitiveLayersError::Parse(if path == "." {
                inner.to_string()
            } else {
                format!("at {path}: {inner}")
            })
        })
    }

    /// The file as it is written (pretty JSON, a trailing newline): what the pre-screen, the
    /// first-load plan's cache and the evolution job's proposals store.
    pub fn to_bytes(&self) -> Result<Vec<u8>, serde_json::Error> {
        let mut bytes = serde_json::to_vec_pretty(self)?;
        bytes.push(b'\n');
        Ok(bytes)
    }

    /// Parse and validate against a model in one go.
    pub fn parse_for(
        bytes: &[u8],
        shape: &ModelShape,
    ) -> Result<ValidatedPlan, SensitiveLayersError> {
        Self::parse(bytes)?.validate(shape)
    }

    /// Check every field against the model; collects every problem, not just the first.
    pub fn validate(self, shape: &ModelShape) -> Result<ValidatedPlan, SensitiveLayersError> {
        let mut errs = Vec::new();
        if self.schema_version != SENSITIVE_LAYERS_SCHEMA_VERSION {
            errs.push(format!(
                "schema_version is {}, this engine reads {SENSITIVE_LAYERS_SCHEMA_VERSION}",
                self.schema_version
            ));
        }
        if let Some(m) = &self.model {
            if m.num_layers != shape.num_layers
                || m.hidden_size != shape.hidden_size
                || m.intermediate_size != shape.intermediate_size
            {
                errs.push(format!(
                    "model: file is for {} layers, hidden {}, intermediate {}; the loaded model has {}, {}, {}",
                    m.num_layers, m.hidden_size, m.intermediate_size,
                    shape.num_layers, shape.hidden_size, shape.intermediate_size
                ));
            } else if m.layout_md5 != shape.layout_md5 {
                errs.push(format!(
                    "model.layout_md5 {} does not match the loaded checkpoint ({})",
                    m.layout_md5, shape.layout_md5
                ));
            }
        }
        let t = &self.thresholds;
        let mut check = |name: &str, v: Option<f64>, ok: fn(f64) -> bool, want: &str| {
            if let Some(v) = v {
                if !ok(v) {
                    errs.push(format!("{name} = {v}: must be {want}"));
                }
            }
        };
        check("thresholds.k", t.k, |v| v > 0.0 && v.is_finite(), "> 0");
        check(
            "thresholds.token_k",
            t.token_k,
            |v| v > 0.0 && v.is_finite(),
            "> 0",
        );
        check("thresholds.trigger_rate", t.trigger_rate, unit, "in [0, 1]");
        check(
            "thresholds.min_excess",
            t.min_excess,
            |v| v >= 0.0 && v.is_finite(),
            ">= 0",
        );
        check(
            "thresholds.max_nsr",
            t.max_nsr,
            |v| v >= 0.0 && v.is_finite(),
            ">= 0",
        );
        check(
            "thresholds.shadow_sample_rate",
            t.shadow_sample_rate,
            unit,
            "in [0, 1]",
        );
        check(
            "thresholds.request_kl_limit",
            t.request_kl_limit,
            |v| v >= 0.0 && v.is_finite(),
            ">= 0",
        );
        if t.window_requests == Some(0) {
            errs.push("thresholds.window_requests must be >= 1".into());
        }
        if t.recovery_windows == Some(0) {
            errs.push("thresholds.recovery_windows must be >= 1".into());
        }
        let mut groups = BTreeMap::new();
        for (key, entry) in &self.groups {
            let g = match key.parse::<GroupId>() {
                Ok(g) => g,
                Err(e) => {
                    errs.push(format!(
                        "groups: {e} (fused groups only: q/k/v are `qkv`, gate/up are `gate_up`)"
                    ));
                    continue;
                }
            };
            if g.layer >= shape.num_layers {
                errs.push(format!(
                    "groups.{key}: the model has {} layers (0..{})",
                    shape.num_layers,
                    shape.num_layers.saturating_sub(1)
                ));
                continue;
            }
            let dim = shape.input_dim(g.kind);
            if let Some(c) = entry.massive_channels.iter().find(|&&c| c >= dim) {
                errs.push(format!(
                    "groups.{key}.massive_channels: channel {c} is out of range (input width {dim})"
                ));
            }
            if let Some(m) = &entry.monitor {
                if m.k.is_some_and(|k| !(k > 0.0 && k.is_finite())) {
                    errs.push(format!("groups.{key}.monitor.k must be > 0"));
                }
                if m.trigger_rate.is_some_and(|r| !unit(r)) {
                    errs.push(format!(
                        "groups.{key}.monitor.trigger_rate must be in [0, 1]"
                    ));
                }
                if m.min_excess.is_some_and(|e| !(e >= 0.0 && e.is_finite())) {
                    errs.push(format!("groups.{key}.monitor.min_excess must be >= 0"));
                }
                if m.max_nsr.is_some_and(|e| !(e >= 0.0 && e.is_finite())) {
                    errs.push(format!("groups.{key}.monitor.max_nsr must be >= 0"));
                }
            }
            if let Some(sm) = &entry.smoothing {
                if !unit(sm.alpha) {
                    errs.push(format!("groups.{key}.smoothing.alpha must be in [0, 1]"));
                }
                if let Err(e) = sm.exponents(dim) {
                    errs.push(format!("groups.{key}.smoothing: {e}"));
                }
            }
            if let Some(o) = &entry.observed {
                if !unit(o.wanted_float_share) {
                    errs.push(format!(
                        "groups.{key}.observed.wanted_float_share must be in [0, 1]"
                    ));
                }
            }
            if let Some(m) = &entry.metrics {
                let vals = [m.r, m.energy, m.kl.w8a8, m.kl.w8a8_per_channel, m.kl.w4a16];
                let measured = m
                    .residual
                    .iter()
                    .flat_map(|r| [r.w8a8_per_channel, r.w4a16]);
                if vals
                    .into_iter()
                    .chain(measured)
                    .chain(m.max_nsr_w4a16)
                    .chain(m.nsr.iter().flat_map(|n| [n.w8a8, n.w4a16]))
                    .chain(m.act8_nsr.iter().flat_map(|n| [n.plain, n.smoothed]))
                    .any(|v| !v.is_finite() || v < 0.0)
                {
                    errs.push(format!(
                        "groups.{key}.metrics: every metric must be finite and >= 0"
                    ));
                }
            }
            groups.insert(g, entry.clone());
        }
        if errs.is_empty() {
            Ok(ValidatedPlan { file: self, groups })
        } else {
            Err(SensitiveLayersError::Invalid(errs))
        }
    }

    /// The JSON Schema of this format (what `shared/schemas/` publishes).
    pub fn json_schema() -> serde_json::Value {
        serde_json::to_value(schemars::schema_for!(SensitiveLayers)).unwrap_or_default()
    }
}

fn unit(v: f64) -> bool {
    (0.0..=1.0).contains(&v)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape() -> ModelShape {
        ModelShape {
            num_layers: 2,
            hidden_size: 64,
            intermediate_size: 128,
            attn_dim: 64,
            layout_md5: "abc".into(),
        }
    }

    #[test]
    fn minimal_file_is_valid() {
        let p = SensitiveLayers::parse_for(br#"{"schema_version": 1}"#, &shape()).unwrap();
        assert!(p.groups.is_empty());
    }

    #[test]
    fn unknown_field_is_named_with_its_path() {
        let e = SensitiveLayers::parse(
            br#"{"schema_version": 1, "thresholds": {"k": 4, "trigger": 0.1}}"#,
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("thresholds") && e.contains("trigger"), "{e}");
    }

    #[test]
    fn truncated_file_is_a_parse_error() {
        let e = SensitiveLayers::parse(br#"{"schema_version": 1, "thresholds": {"k": 4"#);
        assert!(matches!(e, Err(SensitiveLayersError::Parse(_))));
    }

    #[test]
    fn validation_collects_every_problem() {
        let text = r#"{"schema_version": 2,
            "thresholds": {"k": -1, "trigger_rate": 1.5, "window_requests": 0},
            "groups": {
                "layers.5.down": {"class": "fp16"},
                "layers.0.q_proj": {"class": "fp16"},
                "layers.1.gate_up": {"class": "w8a8", "massive_channels": [64]},
                "layers.1.o": {"class": "w8a8", "monitor": {"trigger_rate": 2}}
            }}"#;
        let e = SensitiveLayers::parse_for(text.as_bytes(), &shape()).unwrap_err();
        let SensitiveLayersError::Invalid(errs) = e else {
            panic!("expected Invalid")
        };
        assert_eq!(errs.len(), 8, "{errs:#?}");
    }

    #[test]
    fn smoothing_factors_are_checked_against_the_input_width() {
        let ok = Smoothing::new(0.5, &[0; 64]);
        assert_eq!(ok.exponents(64).unwrap(), vec![0i8; 64]);
        let mut short = Smoothing::new(0.5, &[1, -2, 3]);
        assert_eq!(short.exponents(3).unwrap(), vec![1, -2, 3]);
        assert!(short
            .exponents(64)
            .unwrap_err()
            .contains("input width is 64"));
        short.log2_factors = "1 x 3".into();
        assert!(short.exponents(3).unwrap_err().contains("log2_factors[1]"));
        short.log2_factors = "1 21 3".into();
        assert!(short.exponents(3).unwrap_err().contains("outside"));
        let text = format!(
            r#"{{"schema_version": 1, "groups": {{
            "layers.0.qkv": {{"class": "w8a8", "smoothing": {{"alpha": 0.5, "log2_factors": "{}"}}}},
            "layers.1.down": {{"class": "w8a8", "smoothing": {{"alpha": 2, "log2_factors": "1 2"}}}}}}}}"#,
            ok.log2_factors
        );
        let SensitiveLayersError::Invalid(errs) =
            SensitiveLayers::parse_for(text.as_bytes(), &shape()).unwrap_err()
        else {
            panic!("expected Invalid")
        };
        assert_eq!(errs.len(), 2, "{errs:#?}");
        assert!(errs
            .iter()
            .all(|e| e.starts_with("groups.layers.1.down.smoothing")));
    }

    #[test]
    fn layout_mismatch_is_rejected() {
        let text = r#"{"schema_version": 1, "model": {"num_layers": 2, "hidden_size": 64,
            "intermediate_size": 128, "layout_md5": "other"}}"#;
        assert!(SensitiveLayers::parse_for(text.as_bytes(), &shape()).is_err());
    }

    #[test]
    fn residency_defaults_to_the_class_mapping() {
        let text = r#"{"schema_version": 1, "groups": {
            "layers.0.qkv": {"class": "w8a8_per_channel"},
            "layers.1.down": {"class": "w8a8", "residency": "dual"}}}"#;
        let p = SensitiveLayers::parse_for(text.as_bytes(), &shape()).unwrap();
        let r: Vec<Residency> = p
            .groups
            .values()
            .map(GroupEntry::effective_residency)
            .collect();
        assert_eq!(r, vec![Residency::Dual, Residency::Dual]);
    }

    #[test]
    fn published_schema_file_is_current() {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../schemas/sensitive_layers.v1.schema.json"
        );
        let want = serde_json::to_string_pretty(&SensitiveLayers::json_schema()).unwrap() + "\n";
        if std::env::var_os("QUANTMESH_UPDATE_SCHEMAS").is_some() {
            std::fs::write(path, &want).unwrap();
        }
        let have = std::fs::read_to_string(path).unwrap_or_default();
        assert!(
            have == want,
            "{path} is stale: run `QUANTMESH_UPDATE_SCHEMAS=1 cargo test -p quantmesh-types`"
        );
    }
}
