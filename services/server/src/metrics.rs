//! The gateway's Prometheus series (HTTP requests, latencies, tokens, admission, readiness),
//! names prefixed `quantmesh_`, following vLLM's concepts and buckets where the concept is
//! the same. The registry is shared: the engine registers its own series into it (queue,
//! KV cache, rows by path, monitor, config), and so does the Kafka event path; a scrape
//! only encodes what is there.

use prometheus::{
    Encoder, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge, Opts, Registry,
    TextEncoder,
};
use quantmesh_telemetry::must;

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
    /// vLLM's `request_success_total{finished_reason}`: finished requests by why they ended.
    pub request_success: IntCounterVec,
    /// vLLM's `prefix_cache_queries_total` / `prefix_cache_hits_total`, in prompt tokens.
    pub prefix_cache_queries: IntCounter,
    pub prefix_cache_hits: IntCounter,
    in_flight: IntGauge,
    ready: IntGauge,
}

impl Metrics {
    /// `engine`: when not empty, every series of this registry (the engine's, the Kafka
    /// path's, the HTTP ones) carries `engine="<engine>"`.
    pub fn new(model: &str, engine: &str) -> Self {
        let registry = if engine.is_empty() {
            Registry::new()
        } else {
            let labels =
                std::collections::HashMap::from([("engine".to_string(), engine.to_string())]);
            must(Registry::new_custom(None, Some(labels)))
        };
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
            request_success: must(IntCounterVec::new(
                label(Opts::new(
                    "quantmesh_request_success_total",
                    "Finished requests by finish reason (stop, length, abort), as vLLM's request_success_total.",
                )),
                &["finished_reason"],
            )),
            prefix_cache_queries: must(IntCounter::with_opts(label(Opts::new(
                "quantmesh_prefix_cache_queries_total",
                "Prompt tokens looked up in the prefix cache (vLLM's prefix_cache_queries_total).",
            )))),
            prefix_cache_hits: must(IntCounter::with_opts(label(Opts::new(
                "quantmesh_prefix_cache_hits_total",
                "Prompt tokens served from the prefix cache (vLLM's prefix_cache_hits_total).",
            )))),
            in_flight: must(IntGauge::with_opts(label(Opts::new(
                "quantmesh_http_requests_in_flight",
                "Generation requests accepted by the gateway and not finished.",
            )))),
            ready: must(IntGauge::with_opts(label(Opts::new(
                "quantmesh_ready",
                "1 when the model is loaded and serving.",
            )))),
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
            &m.prefix_cache_queries,
            &m.prefix_cache_hits,
        ] {
            must(r.register(Box::new(c.clone())));
        }
        must(r.register(Box::new(m.request_success.clone())));
        for reason in crate::openai::FinishReasonBody::SUCCESS {
            m.request_success.with_label_values(&[reason.as_str()]);
        }
        for g in [&m.in_flight, &m.ready] {
            must(r.register(Box::new(g.clone())));
        }
        must(r.register(Box::new(quantmesh_telemetry::export_counters().clone())));
        m
    }

    pub fn in_flight(&self) -> &IntGauge {
        &self.in_flight
    }

    /// The shared registry (the engine and the Kafka event path register into it).
    pub fn registry(&self) -> &Registry {
        &self.registry
    }

    /// Render the exposition text. `ready`: the engine is loaded and serving.
    pub fn render(&self, ready: bool) -> String {
        self.ready.set(i64::from(ready));
        let mut buf = Vec::new();
        if let Err(e) = TextEncoder::new().encode(&self.registry.gather(), &mut buf) {
            tracing::error!(error = %e, "encoding metrics failed");
        }
        String::from_utf8(buf).unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A named engine labels every series, its own and those registered into its registry
    /// later (the engine's, the Kafka path's); unnamed, nothing changes.
    #[test]
    fn an_engine_name_labels_every_series() {
        let named = Metrics::new("m", "engine-2");
        let later = IntGauge::new("quantmesh_test_later", "registered after")
            .unwrap_or_else(|e| panic!("{e}"));
        named
            .registry()
            .register(Box::new(later))
            .unwrap_or_else(|e| panic!("{e}"));
        let text = named.render(true);
        let series: Vec<&str> = text.lines().filter(|l| !l.starts_with('#')).collect();
        assert!(!series.is_empty());
        assert!(
            series.iter().all(|l| l.contains(r#"engine="engine-2""#)),
            "{text}"
        );
        assert!(Metrics::new("m", "")
            .render(true)
            .lines()
            .all(|l| !l.contains("engine=")));
    }
}
