//! Fallback events: every precision decision the engine takes, as a serde type.
//!
//! This is the payload of the fallback-event stream (an in-process channel and the logs
//! today; the Kafka topic later). Additive changes only within `schema_version` 1.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

pub const FALLBACK_EVENT_SCHEMA_VERSION: u32 = 1;

/// Event time: milliseconds since the Unix epoch (0 if the clock is before it).
pub fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// The name a unit enum variant has on the wire (its serde name, e.g. `extreme_token`).
pub fn wire_name<T: Serialize>(v: &T) -> String {
    serde_json::to_value(v)
        .ok()
        .and_then(|v| v.as_str().map(String::from))
        .unwrap_or_default()
}

/// The granularity a decision applies to.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize, JsonSchema,
)]
#[serde(rename_all = "snake_case")]
pub enum Granularity {
    Layer,
    Token,
    Request,
    Batch,
}

/// What happened.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize, JsonSchema,
)]
#[serde(rename_all = "snake_case")]
pub enum FallbackAction {
    /// Started running in float.
    Enter,
    /// Returned to INT8.
    Exit,
    /// Float was wanted but the group holds no float copy (INT8-only residency).
    Unavailable,
    /// Float was wanted, the group holds no float copy, and the rows were served with
    /// ≈ 16-bit activations on its quantized weights instead (`split_activations =
    /// "copyless"`, where every other row runs 8-bit activations): a fallback that costs no
    /// memory — per token, or per layer (every row of the group) when its outlier rate
    /// passed the trigger; such a layer fallback ends with `exit`. Added in v1 (consumers
    /// that list the actions must accept it).
    Split,
}

/// Why it happened.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize, JsonSchema,
)]
#[serde(rename_all = "snake_case")]
pub enum FallbackReason {
    /// A layer group's outlier rate over a window exceeded the trigger rate.
    OutlierRate,
    /// Quiet windows after a fallback: back to INT8.
    Recovered,
    /// A token's statistic exceeded the per-token bound.
    ExtremeToken,
    /// A request's sampled shadow KL exceeded the per-request limit.
    ShadowKl,
    /// NaN or Inf in activations or logits.
    NonFinite,
    /// Too large a share of layer groups in fallback.
    LayerShare,
    /// Forced by an operator through the admin API.
    Admin,
}

impl Granularity {
    /// The wire name (also the metric label value).
    pub fn as_str(self) -> &'static str {
        match self {
            Granularity::Layer => "layer",
            Granularity::Token => "token",
            Granularity::Request => "request",
            Granularity::Batch => "batch",
        }
    }
}

impl FallbackAction {
    /// The wire name (also the metric label value).
    pub fn as_str(self) -> &'static str {
        match self {
            FallbackAction::Enter => "enter",
            FallbackAction::Exit => "exit",
            FallbackAction::Unavailable => "unavailable",
            FallbackAction::Split => "split",
        }
    }
}

impl FallbackReason {
    /// The wire name (also the metric label value).
    pub fn as_str(self) -> &'static str {
        match self {
            FallbackReason::OutlierRate => "outlier_rate",
            FallbackReason::Recovered => "recovered",
            FallbackReason::ExtremeToken => "extreme_token",
            FallbackReason::ShadowKl => "shadow_kl",
            FallbackReason::NonFinite => "non_finite",
            FallbackReason::LayerShare => "layer_share",
            FallbackReason::Admin => "admin",
        }
    }
}

/// The float reference a shadow KL was measured against. Neither is the float model run
/// from scratch: earlier tokens' K/V come from the served cache (C8 where it is INT8).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum KlReference {
    /// Every linear group ran its exact float copy; the step's own K/V in float.
    FloatWeights,
    /// Some groups hold no float copy (residency `int8`) and ran INT8 in the reference too,
    /// so their quantization error is not in the number; the step's own K/V in float.
    PartialFloatWeights,
}

impl KlReference {
    /// The wire name (also the metric label value).
    pub fn as_str(self) -> &'static str {
        match self {
            KlReference::FloatWeights => "float_weights",
            KlReference::PartialFloatWeights => "partial_float_weights",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct FallbackEvent {
    pub schema_version: u32,
    /// Unique id (UUID v4); consumers deduplicate on it.
    pub event_id: String,
    /// Milliseconds since the Unix epoch.
    pub timestamp_ms: u64,
    pub model: String,
    /// Layer group, like `layers.1.down`; absent for batch/request decisions.
    pub group: Option<String>,
    pub granularity: Granularity,
    pub action: FallbackAction,
    pub reason: FallbackReason,
    /// Outlier share of the group's tokens in the window that decided (0–1).
    pub outlier_rate: Option<f64>,
    /// Running mean and standard deviation of the statistic (per-token abs-max).
    pub mean: Option<f64>,
    pub sigma: Option<f64>,
    /// The k of the `mean + k·σ` bound in force.
    pub k: Option<f64>,
    /// Sampled KL(P_float ‖ P_served) in nats, when known.
    pub kl: Option<f64>,
    /// What the float reference of `kl` was (optional, added in v1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kl_reference: Option<KlReference>,
    /// Per-token decisions: their positions, and the token ids when the server opts in
    /// (`engine.monitor.event_token_ids`; empty by default).
    pub token_ids: Vec<u32>,
    pub positions: Vec<usize>,
    /// Engine request (sequence) id for per-token and per-request decisions.
    pub request_id: Option<u64>,
    /// md5 of the `sensitive_layers.json` in force, when one is loaded.
    pub config_md5: Option<String>,
    /// W3C `traceparent` of the trace this decision belongs to: the request's for per-token
    /// and per-request decisions, the monitor decision's own otherwise. Only when the server
    /// exports traces (OTLP); also sent as the Kafka header `traceparent` (optional, added in
    /// v1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub traceparent: Option<String>,
}

pub const CONFIG_EVENT_SCHEMA_VERSION: u32 = 1;

/// What a configuration reload did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum ConfigAction {
    /// A new `sensitive_layers.json` is in force.
    Applied,
    /// The new version was invalid; the previous one stays in force.
    Rejected,
    /// The new version was valid but could not be applied (e.g. the checkpoint could not be
    /// read to load float weights); the previous one stays in force.
    Failed,
}

/// A change (or refused change) of the engine's live configuration.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct ConfigEvent {
    pub schema_version: u32,
    /// Unique id (UUID v4).
    pub event_id: String,
    /// Milliseconds since the Unix epoch.
    pub timestamp_ms: u64,
    pub model: String,
    pub action: ConfigAction,
    /// Where the file came from (path or URL).
    pub source: String,
    /// md5 of the version this event is about.
    pub md5: String,
    /// md5 of the version in force before (and still in force after a rejection).
    pub previous_md5: Option<String>,
    /// Why it was rejected or failed.
    pub error: Option<String>,
    /// Groups whose residency changed (applied only).
    pub changed_groups: Vec<String>,
    /// W3C `traceparent` of the reload's trace (a child of the admin request's trace when
    /// an operator asked for it). Only when the server exports traces (OTLP); also sent as
    /// the Kafka header `traceparent` (optional, added in v1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub traceparent: Option<String>,
}

pub const WINDOW_EVENT_SCHEMA_VERSION: u32 = 1;

/// At most this many shadow-KL samples ride in one [`WindowEvent`]; more are counted in
/// `shadow_kl_seen` and sampled evenly (so the event stays bounded whatever the traffic).
pub const MAX_WINDOW_KL_SAMPLES: usize = 256;

/// One group's evidence over one monitor window.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct WindowGroup {
    /// Layer group, like `layers.1.down`.
    pub group: String,
    /// Measured rows (tokens) in the window and how many were outliers.
    pub tokens: u64,
    pub outliers: u64,
    /// Whether the group ran its float path at the window's end (fallback, coupled or
    /// forced, holding a float copy).
    pub in_float: bool,
    /// Whether the group wanted float in this window but holds no float copy (also when
    /// its rows were served split instead, under `split_activations = "copyless"`).
    pub wanted_unavailable: bool,
    /// The group's residency (`int8`, `dual`, `float`).
    pub residency: String,
    /// Mean harm over the window's measured rows: the output noise-to-signal ratio the
    /// group's quantized weights give them (the monitor's harm statistic). Absent when it
    /// was not measured (no quantized form, harm test off). Added in v1 as an optional field.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mean_nsr: Option<f64>,
}

/// The monitor's evidence for one window (every `window_requests` finished requests): per
/// group the outlier counts and whether it ran in float, and the shadow-KL samples taken
/// in the window. Sampled and bounded by construction (one event per window, at most
/// [`MAX_WINDOW_KL_SAMPLES`] samples); the input of the weekly evolution job. Topic
/// `quantmesh.monitor-windows` by default; schema version 1 of its own.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct WindowEvent {
    pub schema_version: u32,
    /// Unique id (UUID v4); consumers deduplicate on it.
    pub event_id: String,
    /// Milliseconds since the Unix epoch at the window's end.
    pub timestamp_ms: u64,
    /// Window length in milliseconds (end − previous end, or − monitor start).
    pub duration_ms: u64,
    pub model: String,
    /// Windows completed by this engine since it started (1 for the first).
    pub window: u64,
    /// md5 of the `sensitive_layers.json` in force, when one is loaded.
    pub config_md5: Option<String>,
    pub groups: Vec<WindowGroup>,
    /// Sampled KL(P_float ‖ P_served) in nats of the window's shadow steps (≤
    /// [`MAX_WINDOW_KL_SAMPLES`]), and how many were taken in all.
    pub shadow_kl: Vec<f64>,
    pub shadow_kl_seen: u64,
    /// What the shadow passes' reference was (absent when no sample was taken).
    pub kl_reference: Option<KlReference>,
    /// Requests put in float by a shadow KL above the limit in this window.
    pub request_kl_fallbacks: u64,
}

/// Where events go: the seam between the engine (which decides) and the transports (the log,
/// an in-process broadcast, the Kafka outbox). Implementations must never block the caller:
/// the monitor actor publishes from the serving path.
pub trait EventSink: Send + Sync {
    /// Publish one fallback decision.
    fn publish(&self, ev: &FallbackEvent);
    /// Publish a configuration change (hot reload applied / rejected / failed).
    fn publish_config(&self, ev: &ConfigEvent);
    /// Publish a monitor window's evidence. Sinks that do not carry it ignore it.
    fn publish_window(&self, _ev: &WindowEvent) {}
}

/// The JSON Schemas of the event payloads (what `shared/schemas/` publishes for consumers).
pub fn event_schemas() -> [(&'static str, serde_json::Value); 3] {
    [
        (
            "fallback_event.v1.schema.json",
            serde_json::to_value(schemars::schema_for!(FallbackEvent)).unwrap_or_default(),
        ),
        (
            "config_event.v1.schema.json",
            serde_json::to_value(schemars::schema_for!(ConfigEvent)).unwrap_or_default(),
        ),
        (
            "window_event.v1.schema.json",
            serde_json::to_value(schemars::schema_for!(WindowEvent)).unwrap_or_default(),
        ),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn label_names_are_the_wire_names() {
        for g in [
            Granularity::Layer,
            Granularity::Token,
            Granularity::Request,
            Granularity::Batch,
        ] {
            assert_eq!(g.as_str(), wire_name(&g));
        }
        for a in [
            FallbackAction::Enter,
            FallbackAction::Exit,
            FallbackAction::Unavailable,
            FallbackAction::Split,
        ] {
            assert_eq!(a.as_str(), wire_name(&a));
        }
        for r in [
            FallbackReason::OutlierRate,
            FallbackReason::Recovered,
            FallbackReason::ExtremeToken,
            FallbackReason::ShadowKl,
            FallbackReason::NonFinite,
            FallbackReason::LayerShare,
            FallbackReason::Admin,
        ] {
            assert_eq!(r.as_str(), wire_name(&r));
        }
    }

    #[test]
    fn published_event_schemas_are_current() {
        for (name, schema) in event_schemas() {
            let path = format!("{}/../schemas/{name}", env!("CARGO_MANIFEST_DIR"));
            let want = serde_json::to_string_pretty(&schema).unwrap() + "\n";
            if std::env::var_os("QUANTMESH_UPDATE_SCHEMAS").is_some() {
                std::fs::write(&path, &want).unwrap();
            }
            let have = std::fs::read_to_string(&path).unwrap_or_default();
            assert!(
                have == want,
                "{path} is stale: run `QUANTMESH_UPDATE_SCHEMAS=1 cargo test -p quantmesh-types`"
            );
        }
    }
}
