//! The gateway's own series, labelled by engine.

use prometheus::{IntCounterVec, IntGaugeVec, Opts, Registry};
use quantmesh_telemetry::must;

/// The `kind` labels of `quantmesh_gateway_engine_failures_total`: what `Failure::kind`
/// (`client.rs`) names.
pub const FAILURE_KINDS: [&str; 7] = [
    "connect",
    "closed",
    "first_byte",
    "idle",
    "request",
    "stalled",
    "body",
];

/// The gateway's routing series, labelled by engine.
#[derive(Clone)]
pub struct MeshMetrics {
    up: IntGaugeVec,
    outstanding: IntGaugeVec,
    pub routed: IntCounterVec,
    pub retries: IntCounterVec,
    pub rejected: IntCounterVec,
    pub stream_failures: IntCounterVec,
    /// Calls to an engine that failed in transport or passed a deadline, by kind.
    pub failures: IntCounterVec,
    /// Engines taken out of routing after `mesh.outlier_failures` consecutive failures.
    pub ejections: IntCounterVec,
    /// Engines a `dns+http://` service resolves to now, by service.
    pub discovered: IntGaugeVec,
    /// Failed or empty DNS answers for a service (its engines are kept as they were).
    pub discovery_errors: IntCounterVec,
}

impl MeshMetrics {
    pub fn register(registry: &Registry) -> Self {
        let gauge = |n: &str, h: &str| must(IntGaugeVec::new(Opts::new(n, h), &["engine"]));
        let counter = |n: &str, h: &str, l: &[&str]| must(IntCounterVec::new(Opts::new(n, h), l));
        let m = Self {
            up: gauge("quantmesh_gateway_engine_up", "1 when the engine's /ready answers 200."),
            outstanding: gauge(
                "quantmesh_gateway_engine_outstanding",
                "Requests in flight on the engine (streams until their last byte).",
            ),
            routed: counter(
                "quantmesh_gateway_routed_total",
                "Requests answered by the engine, by how it was chosen (affinity, least, random).",
                &["engine", "choice"],
            ),
            retries: counter(
                "quantmesh_gateway_retries_total",
                "Requests moved to another engine before their first byte, by the engine that failed.",
                &["engine"],
            ),
            rejected: counter(
                "quantmesh_gateway_rejected_total",
                "Requests no engine could take: saturated (429) or none up (503).",
                &["reason"],
            ),
            stream_failures: counter(
                "quantmesh_gateway_stream_failures_total",
                "Streams that had started and ended with an error event because their engine failed.",
                &["engine"],
            ),
            failures: counter(
                "quantmesh_gateway_engine_failures_total",
                "Calls to the engine that failed before a whole answer: connect (refused or unreachable), closed (the connection ended before the answer began), first_byte / idle / request (a deadline passed), stalled (its /ready stopped answering), body (the answer broke off).",
                &["engine", "kind"],
            ),
            ejections: counter(
                "quantmesh_gateway_engine_ejections_total",
                "Times the engine was ejected from routing after mesh.outlier_failures consecutive failures.",
                &["engine"],
            ),
            discovered: must(IntGaugeVec::new(
                Opts::new(
                    "quantmesh_gateway_discovered_engines",
                    "Addresses the service's DNS name resolved to at the last lookup (dns+http:// engines).",
                ),
                &["service"],
            )),
            discovery_errors: counter(
                "quantmesh_gateway_discovery_errors_total",
                "DNS lookups of an engine service that failed or answered no address (engines kept as they were).",
                &["service"],
            ),
        };
        for c in [&m.up, &m.outstanding, &m.discovered] {
            must(registry.register(Box::new(c.clone())));
        }
        for c in [
            &m.routed,
            &m.retries,
            &m.rejected,
            &m.stream_failures,
            &m.failures,
            &m.ejections,
            &m.discovery_errors,
        ] {
            must(registry.register(Box::new(c.clone())));
        }
        for r in ["saturated", "no_engine"] {
            m.rejected.with_label_values(&[r]);
        }
        m
    }

    /// Export an engine's series at 0 from the moment it is known.
    pub fn label(&self, engine: &str) {
        self.up.with_label_values(&[engine]);
        self.outstanding.with_label_values(&[engine]);
        self.retries.with_label_values(&[engine]);
        self.stream_failures.with_label_values(&[engine]);
        self.ejections.with_label_values(&[engine]);
        for kind in FAILURE_KINDS {
            self.failures.with_label_values(&[engine, kind]);
        }
        for choice in ["affinity", "least", "random"] {
            self.routed.with_label_values(&[engine, choice]);
        }
    }

    pub fn up(&self, engine: &str, up: bool) {
        self.up.with_label_values(&[engine]).set(i64::from(up));
    }

    pub fn outstanding(&self, engine: &str, n: usize) {
        self.outstanding.with_label_values(&[engine]).set(n as i64);
    }
}
