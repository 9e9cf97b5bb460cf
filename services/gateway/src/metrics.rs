//! Prometheus metrics, names prefixed `quantmesh_`, following vLLM's concepts and buckets
//! where the concept is the same (TTFT, inter-token latency, end-to-end latency,
//! running/waiting requests, KV-cache usage).

use prometheus::{
    Counter, Encoder, Gauge, GaugeVec, Histogram, HistogramOpts, HistogramVec, IntCounter,
    IntCounterVec, IntGauge, Opts, Registry, TextEncoder,
};
use quantmesh_engine::monitor::{GroupMode, MonitorReport};
use quantmesh_engine::reload::ConfigStatus;
use quantmesh_engine::EngineStats;
use std::sync::Mutex;

/// vLLM's `time_to_first_token_seconds` buckets.
const TTFT_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
];
/// vLLM's `time_per_output_token_seconds` buckets.
const ITL_BUCKETS: &[f64] = &[
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
];
/// vLLM's `e2e_request_latency_seconds` buckets.
const E2E_BUCKETS: &[f64] = &[
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
];

pub struct Metrics {
    registry: Registry,
    pub requests: IntCounterVec,
    pub ttft: HistogramVec,
    pub itl: HistogramVec,
    pub e2e: HistogramVec,
    pub prompt_tokens: IntCounter,
    pub generation_tokens: IntCounter,
    running: IntGauge,
    waiting: IntGauge,
    in_flight: IntGauge,
    kv_used: IntGauge,
    kv_free: IntGauge,
    kv_usage: Gauge,
    kv_frag: Gauge,
    linear_rows: IntCounterVec,
    fallback_unavailable: IntCounter,
    prefix_hits: IntCounter,
    steps: IntCounter,
    resident_bytes: IntGauge,
    ready: IntGauge,
    outlier_rate: GaugeVec,
    groups_in_fallback: IntGauge,
    decisions: IntCounterVec,
    shadow_kl: Histogram,
    mask_check_seconds: Counter,
    batch_recomputes: IntCounter,
    monitor_dropped: IntCounter,
    config_info: GaugeVec,
    config_reloads: IntCounterVec,
    config_polls: IntCounter,
    config_apply_seconds: Gauge,
    config_applied_at: Gauge,
    /// Last engine counters seen, to turn snapshots into counter increments.
    last: Mutex<EngineStats>,
}

fn must<T>(r: prometheus::Result<T>) -> T {
    // Metric definitions are static; a failure here is a programming error caught by tests.
    r.unwrap_or_else(|e| panic!("invalid metric definition: {e}"))
}

impl Metrics {
    pub fn new(model: &str) -> Self {
        let registry = Registry::new();
        let label = |o: Opts| o.const_label("model_name", model);
        let hist = |name: &str, help: &str, b: &[f64]| {
            must(HistogramVec::new(
                HistogramOpts::new(name, help)
                    .const_label("model_name", model)
                    .buckets(b.to_vec()),
                &["endpoint"],
            ))
        };
        let m = Self {
            requests: must(IntCounterVec::new(
                label(Opts::new(
                    "quantmesh_requests_total",
                    "HTTP requests by endpoint and status code.",
                )),
                &["endpoint", "status"],
            )),
            ttft: hist(
                "quantmesh_time_to_first_token_seconds",
                "Time from request arrival to the first generated token.",
                TTFT_BUCKETS,
            ),
            itl: hist(
                "quantmesh_inter_token_latency_seconds",
                "Time between consecutive generated tokens of one request.",
                ITL_BUCKETS,
            ),
            e2e: hist(
                "quantmesh_e2e_request_latency_seconds",
                "Time from request arrival to its last token.",
                E2E_BUCKETS,
            ),
            prompt_tokens: must(IntCounter::with_opts(label(Opts::new(
                "quantmesh_prompt_tokens_total",
                "Prompt tokens processed.",
            )))),
            generation_tokens: must(IntCounter::with_opts(label(Opts::new(
                "quantmesh_generation_tokens_total",
                "Tokens generated.",
            )))),
            running: must(IntGauge::with_opts(label(Opts::new(
                "quantmesh_num_requests_running",
                "Sequences in the running batch.",
            )))),
            waiting: must(IntGauge::with_opts(label(Opts::new(
                "quantmesh_num_requests_waiting",
                "Sequences waiting for admission (KV pages or batch slots).",
            )))),
            in_flight: must(IntGauge::with_opts(label(Opts::new(
                "quantmesh_http_requests_in_flight",
                "Generation requests accepted by the gateway and not finished.",
            )))),
            kv_used: must(IntGauge::with_opts(label(Opts::new(
                "quantmesh_kv_cache_pages_used",
                "KV pages referenced by sequences.",
            )))),
            kv_free: must(IntGauge::with_opts(label(Opts::new(
                "quantmesh_kv_cache_pages_free",
                "KV pages free or reusable (cached, unreferenced).",
            )))),
            kv_usage: must(Gauge::with_opts(label(Opts::new(
                "quantmesh_kv_cache_usage_perc",
                "Fraction of KV pages in use (0-1).",
            )))),
            kv_frag: must(Gauge::with_opts(label(Opts::new(
                "quantmesh_kv_cache_fragmentation_ratio",
                "(allocated capacity - tokens stored) / allocated capacity.",
            )))),
            linear_rows: must(IntCounterVec::new(
                label(Opts::new(
                    "quantmesh_linear_rows_total",
                    "Token rows through linear groups, by path taken.",
                )),
                &["path"],
            )),
            fallback_unavailable: must(IntCounter::with_opts(label(Opts::new(
                "quantmesh_fallback_unavailable_rows_total",
                "Rows that wanted the float path in a group holding only INT8.",
            )))),
            prefix_hits: must(IntCounter::with_opts(label(Opts::new(
                "quantmesh_prefix_cache_hit_pages_total",
                "KV pages served from the prefix cache.",
            )))),
            steps: must(IntCounter::with_opts(label(Opts::new(
                "quantmesh_engine_steps_total",
                "Batched forward steps executed.",
            )))),
            resident_bytes: must(IntGauge::with_opts(label(Opts::new(
                "quantmesh_weight_resident_bytes",
                "Bytes of resident model weights under the current precision plan.",
            )))),
            ready: must(IntGauge::with_opts(label(Opts::new(
                "quantmesh_ready",
                "1 when the model is loaded and serving.",
            )))),
            outlier_rate: must(GaugeVec::new(
                label(Opts::new(
                    "quantmesh_monitor_outlier_rate",
                    "Outlier share of a group's tokens in the last completed window.",
                )),
                &["group"],
            )),
            groups_in_fallback: must(IntGauge::with_opts(label(Opts::new(
                "quantmesh_monitor_groups_in_fallback",
                "Linear groups running their float path (monitor or admin).",
            )))),
            decisions: must(IntCounterVec::new(
                label(Opts::new(
                    "quantmesh_fallback_decisions_total",
                    "Fallback decisions by granularity, reason and action.",
                )),
                &["granularity", "reason", "action"],
            )),
            shadow_kl: must(Histogram::with_opts(
                HistogramOpts::new(
                    "quantmesh_shadow_kl",
                    "Sampled KL(P_float || P_served) of the next-token distribution, in nats.",
                )
                .const_label("model_name", model)
                .buckets(vec![
                    1e-5, 1e-4, 5e-4, 1e-3, 5e-3, 0.01, 0.02, 0.05, 0.1, 0.5, 1.0,
                ]),
            )),
            mask_check_seconds: must(Counter::with_opts(label(Opts::new(
                "quantmesh_mask_check_seconds_total",
                "Time spent choosing each group's path (mask checks, per-token routing).",
            )))),
            batch_recomputes: must(IntCounter::with_opts(label(Opts::new(
                "quantmesh_batch_recomputes_total",
                "Steps recomputed in float after NaN/Inf.",
            )))),
            monitor_dropped: must(IntCounter::with_opts(label(Opts::new(
                "quantmesh_monitor_observations_dropped_total",
                "Step observations the monitor's full mailbox did not take.",
            )))),
            config_info: must(GaugeVec::new(
                label(Opts::new(
                    "quantmesh_config_info",
                    "1 for the sensitive_layers.json version in force (md5 \"none\" when none is loaded).",
                )),
                &["md5"],
            )),
            config_reloads: must(IntCounterVec::new(
                label(Opts::new(
                    "quantmesh_config_reloads_total",
                    "sensitive_layers.json reload attempts that found a new version, by result (applied, rejected, failed, fetch_error).",
                )),
                &["result"],
            )),
            config_polls: must(IntCounter::with_opts(label(Opts::new(
                "quantmesh_config_polls_total",
                "Polls of the sensitive_layers.json source.",
            )))),
            config_apply_seconds: must(Gauge::with_opts(label(Opts::new(
                "quantmesh_config_last_apply_seconds",
                "Seconds from reading the last applied version to its plan being in force.",
            )))),
            config_applied_at: must(Gauge::with_opts(label(Opts::new(
                "quantmesh_config_applied_timestamp_seconds",
                "Unix time the version in force was applied.",
            )))),
            last: Mutex::new(EngineStats::default()),
            registry,
        };
        let r = &m.registry;
        must(r.register(Box::new(m.requests.clone())));
        for h in [&m.ttft, &m.itl, &m.e2e] {
            must(r.register(Box::new(h.clone())));
        }
        for c in [
            &m.prompt_tokens,
            &m.generation_tokens,
            &m.fallback_unavailable,
            &m.prefix_hits,
            &m.steps,
        ] {
            must(r.register(Box::new(c.clone())));
        }
        for g in [
            &m.running,
            &m.waiting,
            &m.in_flight,
            &m.kv_used,
            &m.kv_free,
            &m.resident_bytes,
            &m.ready,
        ] {
            must(r.register(Box::new(g.clone())));
        }
        must(r.register(Box::new(m.kv_usage.clone())));
        must(r.register(Box::new(m.kv_frag.clone())));
        must(r.register(Box::new(m.linear_rows.clone())));
        must(r.register(Box::new(m.outlier_rate.clone())));
        must(r.register(Box::new(m.groups_in_fallback.clone())));
        must(r.register(Box::new(m.decisions.clone())));
        must(r.register(Box::new(m.shadow_kl.clone())));
        must(r.register(Box::new(m.mask_check_seconds.clone())));
        must(r.register(Box::new(m.batch_recomputes.clone())));
        must(r.register(Box::new(m.monitor_dropped.clone())));
        must(r.register(Box::new(m.config_info.clone())));
        must(r.register(Box::new(m.config_reloads.clone())));
        must(r.register(Box::new(m.config_polls.clone())));
        must(r.register(Box::new(m.config_apply_seconds.clone())));
        must(r.register(Box::new(m.config_applied_at.clone())));
        m
    }

    /// Refresh the hot-reload series from the config actor's status.
    pub fn observe_config(&self, st: &ConfigStatus) {
        self.config_info.reset();
        self.config_info
            .with_label_values(&[st.md5.as_deref().unwrap_or("none")])
            .set(1.0);
        for (result, n) in [
            ("applied", st.applied_total),
            ("rejected", st.rejected_total),
            ("failed", st.failed_total),
            ("fetch_error", st.fetch_errors_total),
        ] {
            let c = self.config_reloads.with_label_values(&[result]);
            c.inc_by(n.saturating_sub(c.get()));
        }
        self.config_polls
            .inc_by(st.polls.saturating_sub(self.config_polls.get()));
        if let Some(s) = st.last_apply_seconds {
            self.config_apply_seconds.set(s);
        }
        if let Some(ms) = st.applied_at_ms {
            self.config_applied_at.set(ms as f64 / 1000.0);
        }
    }

    /// Refresh the monitor's series from its report and the new shadow-KL samples.
    pub fn observe_monitor(&self, report: Option<&MonitorReport>, kl_samples: &[f64]) {
        for kl in kl_samples {
            self.shadow_kl.observe(*kl);
        }
        let Some(r) = report else { return };
        let mut in_fallback = 0;
        for g in &r.groups {
            if let Some(rate) = g.last_window_rate {
                self.outlier_rate
                    .with_label_values(&[g.group.as_str()])
                    .set(rate);
            }
            if matches!(
                g.mode,
                GroupMode::Fallback | GroupMode::Coupled | GroupMode::ForcedFloat
            ) && g.residency.has_float()
            {
                in_fallback += 1;
            }
        }
        self.groups_in_fallback.set(in_fallback);
        for (key, &n) in &r.decisions {
            let parts: Vec<&str> = key.split('/').collect();
            if let [gran, reason, action] = parts[..] {
                let c = self.decisions.with_label_values(&[gran, reason, action]);
                c.inc_by(n.saturating_sub(c.get()));
            }
        }
    }

    pub fn in_flight(&self) -> &IntGauge {
        &self.in_flight
    }

    /// Refresh engine-derived series and render the exposition text.
    /// Registry for metrics owned by other parts (the Kafka event path).
    pub fn registry(&self) -> &Registry {
        &self.registry
    }

    pub fn render(&self, stats: Option<&EngineStats>) -> String {
        self.ready.set(i64::from(stats.is_some()));
        if let Some(s) = stats {
            self.running.set(s.running as i64);
            self.waiting.set(s.waiting as i64);
            self.kv_used.set(s.kv_pages_used as i64);
            self.kv_free.set(s.kv_pages_free as i64);
            self.kv_usage.set(if s.kv_pages_total == 0 {
                0.0
            } else {
                s.kv_pages_used as f64 / s.kv_pages_total as f64
            });
            self.kv_frag.set(s.kv_fragmentation);
            self.resident_bytes.set(s.resident_weight_bytes as i64);
            if let Ok(mut last) = self.last.lock() {
                let d = |now: u64, before: u64| now.saturating_sub(before);
                self.linear_rows
                    .with_label_values(&["float"])
                    .inc_by(d(s.float_rows, last.float_rows));
                self.linear_rows
                    .with_label_values(&["int8"])
                    .inc_by(d(s.int8_rows, last.int8_rows));
                self.fallback_unavailable.inc_by(d(
                    s.fallback_unavailable_rows,
                    last.fallback_unavailable_rows,
                ));
                self.prefix_hits
                    .inc_by(d(s.prefix_cache_hit_pages, last.prefix_cache_hit_pages));
                self.steps.inc_by(d(s.steps, last.steps));
                self.batch_recomputes
                    .inc_by(d(s.batch_recomputes, last.batch_recomputes));
                self.monitor_dropped.inc_by(d(
                    s.monitor_observations_dropped,
                    last.monitor_observations_dropped,
                ));
                self.mask_check_seconds
                    .inc_by(d(s.mask_check_ns, last.mask_check_ns) as f64 * 1e-9);
                *last = s.clone();
            }
        }
        let mut buf = Vec::new();
        if let Err(e) = TextEncoder::new().encode(&self.registry.gather(), &mut buf) {
            tracing::error!(error = %e, "encoding metrics failed");
        }
        String::from_utf8(buf).unwrap_or_default()
    }
}
