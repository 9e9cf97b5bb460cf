//! The engine's Prometheus series, registered into the caller's registry (the gateway's)
//! and updated where things happen: the scheduler after each step, the executor per step,
//! the monitor per decision, the config actor per reload. Nothing is derived at scrape
//! time, so concurrent scrapes cannot double-count. Label values come from enums.

use crate::backend::WeightBytes;
use prometheus::{
    Counter, Gauge, GaugeVec, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge,
    IntGaugeVec, Opts, Registry,
};
use quantmesh_types::FallbackEvent;

/// The path rows took through a linear group (label `path`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RowPathLabel {
    Float,
    Int8,
    /// The quantized weights with split (≈ 16-bit) activations: rows that wanted float in
    /// a group without a float copy.
    Split,
}

impl RowPathLabel {
    pub fn as_str(self) -> &'static str {
        match self {
            RowPathLabel::Float => "float",
            RowPathLabel::Int8 => "int8",
            RowPathLabel::Split => "split",
        }
    }
}

/// The result of a reload that saw a new version (label `result`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReloadResult {
    Applied,
    Rejected,
    Failed,
    FetchError,
}

impl ReloadResult {
    pub fn as_str(self) -> &'static str {
        match self {
            ReloadResult::Applied => "applied",
            ReloadResult::Rejected => "rejected",
            ReloadResult::Failed => "failed",
            ReloadResult::FetchError => "fetch_error",
        }
    }
}

/// Every series the engine owns. Cheap to clone (handles to shared cells).
/// Why a step failed (the `cause` label of `quantmesh_engine_step_failures_total`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StepFailureCause {
    Panic,
    Error,
}

impl StepFailureCause {
    pub fn as_str(self) -> &'static str {
        match self {
            StepFailureCause::Panic => "panic",
            StepFailureCause::Error => "error",
        }
    }
}

#[derive(Clone)]
pub struct EngineMetrics {
    pub running: IntGauge,
    pub waiting: IntGauge,
    pub kv_used: IntGauge,
    pub kv_free: IntGauge,
    pub kv_usage: Gauge,
    pub kv_frag: Gauge,
    pub prefix_hits: IntCounter,
    pub steps: IntCounter,
    linear_rows: IntCounterVec,
    pub fallback_unavailable: IntCounter,
    pub mask_check_seconds: Counter,
    pub batch_recomputes: IntCounter,
    step_failures: IntCounterVec,
    pub resident_bytes: IntGauge,
    weight_bytes: IntGaugeVec,
    pub weight_f16_ratio: Gauge,
    pub monitor_dropped: IntCounter,
    outlier_rate: GaugeVec,
    harm_nsr: GaugeVec,
    pub groups_in_fallback: IntGauge,
    decisions: IntCounterVec,
    pub shadow_kl: HistogramVec,
    config_info: GaugeVec,
    activation_width: GaugeVec,
    config_reloads: IntCounterVec,
    pub config_polls: IntCounter,
    pub config_apply_seconds: Gauge,
    pub config_applied_at: Gauge,
}

/// Definitions are static: an error here is a programming error, caught by every test
/// that starts an engine.
fn must<T>(r: prometheus::Result<T>) -> T {
    r.unwrap_or_else(|e| panic!("invalid metric definition: {e}"))
}

impl EngineMetrics {
    /// Define the series (const label `model_name`) and register them into `registry`.
    /// Fails when they are already registered there (one engine per registry).
    pub fn register(registry: &Registry, model: &str) -> prometheus::Result<Self> {
        let o = |name: &str, help: &str| Opts::new(name, help).const_label("model_name", model);
        let ig = |name, help| must(IntGauge::with_opts(o(name, help)));
        let ic = |name, help| must(IntCounter::with_opts(o(name, help)));
        let g = |name, help| must(Gauge::with_opts(o(name, help)));
        let m = Self {
            running: ig(
                "quantmesh_num_requests_running",
                "Sequences in the running batch.",
            ),
            waiting: ig(
                "quantmesh_num_requests_waiting",
                "Sequences waiting for admission (KV pages or batch slots).",
            ),
            kv_used: ig(
                "quantmesh_kv_cache_pages_used",
                "KV pages referenced by sequences.",
            ),
            kv_free: ig(
                "quantmesh_kv_cache_pages_free",
                "KV pages free or reusable (cached, unreferenced).",
            ),
            kv_usage: g(
                "quantmesh_kv_cache_usage_perc",
                "Fraction of KV pages in use (0-1).",
            ),
            kv_frag: g(
                "quantmesh_kv_cache_fragmentation_ratio",
                "(allocated capacity - tokens stored) / allocated capacity.",
            ),
            prefix_hits: ic(
                "quantmesh_prefix_cache_hit_pages_total",
                "KV pages served from the prefix cache.",
            ),
            steps: ic(
                "quantmesh_engine_steps_total",
                "Batched forward steps executed.",
            ),
            linear_rows: must(IntCounterVec::new(
                o(
                    "quantmesh_linear_rows_total",
                    "Token rows through linear groups, by path taken.",
                ),
                &["path"],
            )),
            fallback_unavailable: ic(
                "quantmesh_fallback_unavailable_rows_total",
                "Rows that wanted the float path in a group holding only INT8 and got no higher precision than their neighbours (plain INT8 with engine.split_activations = \"off\", the same 16-bit activations as every row with \"all\"); under \"copyless\" such rows are served with 16-bit activations and counted in quantmesh_linear_rows_total{path=\"split\"} instead.",
            ),
            mask_check_seconds: must(Counter::with_opts(o(
                "quantmesh_mask_check_seconds_total",
                "Time spent choosing each group's path (mask checks, per-token routing).",
            ))),
            batch_recomputes: ic(
                "quantmesh_batch_recomputes_total",
                "Steps recomputed in float after NaN/Inf.",
            ),
            step_failures: must(IntCounterVec::new(
                o(
                    "quantmesh_engine_step_failures_total",
                    "Steps that failed, by cause (panic: caught and contained; error: a typed error). Only the requests in the failed step fail.",
                ),
                &["cause"],
            )),
            resident_bytes: ig(
                "quantmesh_weight_resident_bytes",
                "Bytes of resident model weights under the current precision plan.",
            ),
            weight_bytes: must(IntGaugeVec::new(
                o(
                    "quantmesh_weight_bytes",
                    "Resident weight bytes by form: int8 (linear groups' Q8_0), int4 (w4a16 groups' 4-bit q4_s8), float (their float copies), other (embeddings, norms, lm_head, biases).",
                ),
                &["form"],
            )),
            weight_f16_ratio: g(
                "quantmesh_weight_f16_ratio",
                "Resident weight bytes / the same model with every weight in 16 bits.",
            ),
            monitor_dropped: ic(
                "quantmesh_monitor_observations_dropped_total",
                "Step observations the monitor's full mailbox did not take.",
            ),
            outlier_rate: must(GaugeVec::new(
                o(
                    "quantmesh_monitor_outlier_rate",
                    "Outlier share of a group's tokens in the last completed window.",
                ),
                &["group"],
            )),
            harm_nsr: must(GaugeVec::new(
                o(
                    "quantmesh_monitor_harm_nsr",
                    "Mean output noise-to-signal ratio a group's quantized weights gave its rows in the last completed window (the harm statistic).",
                ),
                &["group"],
            )),
            groups_in_fallback: ig(
                "quantmesh_monitor_groups_in_fallback",
                "Linear groups running their float path (monitor or admin).",
            ),
            decisions: must(IntCounterVec::new(
                o(
                    "quantmesh_fallback_decisions_total",
                    "Fallback decisions by granularity, reason and action.",
                ),
                &["granularity", "reason", "action"],
            )),
            shadow_kl: must(HistogramVec::new(
                HistogramOpts::new(
                    "quantmesh_shadow_kl",
                    "Sampled KL(P_float || P_served) of the next-token distribution, in nats; reference: float_weights (every group on its float copy) or partial_float_weights (groups without a float copy ran INT8 in the reference too). Earlier tokens' K/V are the served cache's in both.",
                )
                .const_label("model_name", model)
                .buckets(vec![
                    1e-5, 1e-4, 5e-4, 1e-3, 5e-3, 0.01, 0.02, 0.05, 0.1, 0.5, 1.0,
                ]),
                &["reference"],
            )),
            config_info: must(GaugeVec::new(
                o(
                    "quantmesh_config_info",
                    "1 for the sensitive_layers.json version in force (md5 \"none\" when none is loaded).",
                ),
                &["md5"],
            )),
            activation_width: must(GaugeVec::new(
                o(
                    "quantmesh_activation_width_info",
                    "The quantized path's activation width in force (engine.split_activations, \"auto\" resolved: mode off, copyless, copyless_q4 or all; source measured, remembered, forced or configured); the value is the measured time of 16-bit activations over 8-bit ones on this machine (0 when not measured).",
                ),
                &["mode", "source"],
            )),
            config_reloads: must(IntCounterVec::new(
                o(
                    "quantmesh_config_reloads_total",
                    "sensitive_layers.json reload attempts that found a new version, by result (applied, rejected, failed, fetch_error).",
                ),
                &["result"],
            )),
            config_polls: ic(
                "quantmesh_config_polls_total",
                "Polls of the sensitive_layers.json source.",
            ),
            config_apply_seconds: g(
                "quantmesh_config_last_apply_seconds",
                "Seconds from reading the last applied version to its plan being in force.",
            ),
            config_applied_at: g(
                "quantmesh_config_applied_timestamp_seconds",
                "Unix time the version in force was applied.",
            ),
        };
        let collectors: Vec<Box<dyn prometheus::core::Collector>> = vec![
            Box::new(m.running.clone()),
            Box::new(m.waiting.clone()),
            Box::new(m.kv_used.clone()),
            Box::new(m.kv_free.clone()),
            Box::new(m.kv_usage.clone()),
            Box::new(m.kv_frag.clone()),
            Box::new(m.prefix_hits.clone()),
            Box::new(m.steps.clone()),
            Box::new(m.linear_rows.clone()),
            Box::new(m.fallback_unavailable.clone()),
            Box::new(m.mask_check_seconds.clone()),
            Box::new(m.batch_recomputes.clone()),
            Box::new(m.step_failures.clone()),
            Box::new(m.resident_bytes.clone()),
            Box::new(m.weight_bytes.clone()),
            Box::new(m.weight_f16_ratio.clone()),
            Box::new(m.monitor_dropped.clone()),
            Box::new(m.outlier_rate.clone()),
            Box::new(m.harm_nsr.clone()),
            Box::new(m.groups_in_fallback.clone()),
            Box::new(m.decisions.clone()),
            Box::new(m.shadow_kl.clone()),
            Box::new(m.config_info.clone()),
            Box::new(m.activation_width.clone()),
            Box::new(m.config_reloads.clone()),
            Box::new(m.config_polls.clone()),
            Box::new(m.config_apply_seconds.clone()),
            Box::new(m.config_applied_at.clone()),
        ];
        for c in collectors {
            registry.register(c)?;
        }
        m.set_config_md5(None);
        // Every known label value exported from the start (at 0), so rates, dashboards and
        // alerts see the series before the first failure or reload.
        for cause in [StepFailureCause::Panic, StepFailureCause::Error] {
            m.step_failures.with_label_values(&[cause.as_str()]);
        }
        for r in [
            ReloadResult::Applied,
            ReloadResult::Rejected,
            ReloadResult::Failed,
            ReloadResult::FetchError,
        ] {
            m.config_reloads.with_label_values(&[r.as_str()]);
        }
        Ok(m)
    }

    /// A step failed (`panic` or `error`).
    pub fn step_failed(&self, cause: StepFailureCause) {
        self.step_failures
            .with_label_values(&[cause.as_str()])
            .inc();
    }

    /// The resident weights by form (at start and after every swap).
    pub fn set_weights(&self, w: &WeightBytes) {
        self.resident_bytes.set(w.total() as i64);
        for (form, b) in [
            ("int8", w.int8),
            ("int4", w.int4),
            ("float", w.float),
            ("other", w.other),
        ] {
            self.weight_bytes.with_label_values(&[form]).set(b as i64);
        }
        self.weight_f16_ratio.set(w.ratio_to_f16());
    }

    pub fn rows(&self, path: RowPathLabel, n: u64) {
        self.linear_rows
            .with_label_values(&[path.as_str()])
            .inc_by(n);
    }

    /// Count one fallback decision under its (granularity, reason, action).
    pub fn decision(&self, ev: &FallbackEvent) {
        self.decisions
            .with_label_values(&[
                ev.granularity.as_str(),
                ev.reason.as_str(),
                ev.action.as_str(),
            ])
            .inc();
    }

    pub fn harm_nsr(&self, group: &str, nsr: f64) {
        self.harm_nsr.with_label_values(&[group]).set(nsr);
    }

    pub fn outlier_rate(&self, group: &str, rate: f64) {
        self.outlier_rate.with_label_values(&[group]).set(rate);
    }

    pub fn reload(&self, result: ReloadResult) {
        self.config_reloads
            .with_label_values(&[result.as_str()])
            .inc();
    }

    /// The activation width `auto` chose (or the configured one).
    pub fn set_activation_width(&self, w: &crate::backend::cpu::width::WidthChoice) {
        self.activation_width.reset();
        self.activation_width
            .with_label_values(&[w.mode.as_str(), w.source.as_str()])
            .set(w.ratio.unwrap_or(0.0));
    }

    /// The version in force (`None`: no file loaded).
    pub fn set_config_md5(&self, md5: Option<&str>) {
        self.config_info.reset();
        self.config_info
            .with_label_values(&[md5.unwrap_or("none")])
            .set(1.0);
    }
}
