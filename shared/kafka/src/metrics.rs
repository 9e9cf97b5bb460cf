//! Prometheus metrics of the event path. Registered into the caller's registry (the
//! gateway's `/metrics`).

use prometheus::{Histogram, HistogramOpts, IntCounter, IntCounterVec, IntGauge, Opts, Registry};

/// Delivery latency buckets (seconds from recorded in the outbox to acknowledged by the
/// broker): milliseconds when the broker is up, minutes during an outage.
const LATENCY_BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
    300.0, 900.0, 3600.0,
];

/// Why an event was not kept.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DropReason {
    /// The outbox reached `outbox_max_bytes` (and the policy dropped this or the oldest).
    OutboxFull,
    /// The queue between the engine and the outbox writer was full.
    QueueFull,
    /// The outbox's filesystem had less than `kafka.outbox_min_free_bytes` left.
    DiskFull,
    /// The outbox could not store the record (disk error); logged.
    StorageError,
    /// A stored record could not be read back; removed and logged.
    Unreadable,
    /// The outbox writer panicked on the batch these events were in (the writer goes on with
    /// the next batch), or had stopped when they arrived; logged.
    WriterFailed,
}

impl DropReason {
    pub fn as_str(self) -> &'static str {
        match self {
            DropReason::OutboxFull => "outbox_full",
            DropReason::QueueFull => "queue_full",
            DropReason::DiskFull => "disk_full",
            DropReason::StorageError => "storage_error",
            DropReason::Unreadable => "unreadable",
            DropReason::WriterFailed => "writer_failed",
        }
    }
}

#[derive(Clone)]
pub struct KafkaMetrics {
    /// Events durably stored in the outbox, by `event_type` (fallback|config).
    pub recorded: IntCounterVec,
    /// Events acknowledged by the broker and removed from the outbox.
    pub delivered: IntCounterVec,
    /// Delivery attempts that failed (the record stays in the outbox and is retried).
    pub failures: IntCounter,
    /// Events lost on purpose, by reason.
    pub dropped: IntCounterVec,
    /// Events accepted from the engine and waiting in the queue to the outbox writer: not yet
    /// stored anywhere, so lost if the process is killed now (the bound of such a loss).
    pub queued: IntGauge,
    /// Events in the outbox whose fsync has not succeeded yet (retried; counted as recorded
    /// once it does).
    pub unsynced: IntGauge,
    pub outbox_depth: IntGauge,
    pub outbox_bytes: IntGauge,
    pub outbox_max_bytes: IntGauge,
    pub latency: Histogram,
    /// 1 while the last delivery round succeeded or a broker answered; 0 after a failure.
    pub broker_up: IntGauge,
    /// Producers re-created after a fatal producer error.
    pub producer_restarts: IntCounter,
    /// Topics created by quantmesh.
    pub topics_created: IntCounterVec,
}

fn must<T>(r: prometheus::Result<T>) -> T {
    // Metric definitions are static; a failure here is a programming error caught by tests.
    r.unwrap_or_else(|e| panic!("invalid metric definition: {e}"))
}

impl KafkaMetrics {
    pub fn new() -> Self {
        let dropped = must(IntCounterVec::new(
            Opts::new(
                "quantmesh_events_dropped_total",
                "Events not kept, by reason (outbox_full, queue_full, disk_full, storage_error, unreadable, writer_failed)",
            ),
            &["reason"],
        ));
        // Pre-create every reason so rate() and alerts see 0 rather than no series.
        for r in [
            DropReason::OutboxFull,
            DropReason::QueueFull,
            DropReason::DiskFull,
            DropReason::StorageError,
            DropReason::Unreadable,
            DropReason::WriterFailed,
        ] {
            dropped.with_label_values(&[r.as_str()]);
        }
        let recorded = must(IntCounterVec::new(
            Opts::new(
                "quantmesh_events_recorded_total",
                "Events durably stored in the outbox",
            ),
            &["event_type"],
        ));
        let delivered = must(IntCounterVec::new(
            Opts::new(
                "quantmesh_events_delivered_total",
                "Events acknowledged by the Kafka broker",
            ),
            &["event_type"],
        ));
        for t in ["fallback", "config", "window"] {
            recorded.with_label_values(&[t]);
            delivered.with_label_values(&[t]);
        }
        Self {
            recorded,
            delivered,
            failures: must(IntCounter::new(
                "quantmesh_events_delivery_failures_total",
                "Delivery attempts that failed; the events stay in the outbox and are retried",
            )),
            dropped,
            queued: must(IntGauge::new(
                "quantmesh_events_queued",
                "Events accepted from the engine and not yet stored in the outbox (lost if the process is killed now)",
            )),
            unsynced: must(IntGauge::new(
                "quantmesh_events_unsynced",
                "Events stored in the outbox whose fsync has not succeeded yet (retried each second; recorded once it does)",
            )),
            outbox_depth: must(IntGauge::new(
                "quantmesh_events_outbox_depth",
                "Events waiting in the outbox",
            )),
            outbox_bytes: must(IntGauge::new(
                "quantmesh_events_outbox_bytes",
                "Bytes of events waiting in the outbox",
            )),
            outbox_max_bytes: must(IntGauge::new(
                "quantmesh_events_outbox_max_bytes",
                "Configured bound of the outbox (kafka.outbox_max_bytes)",
            )),
            latency: must(Histogram::with_opts(
                HistogramOpts::new(
                    "quantmesh_events_delivery_latency_seconds",
                    "From stored in the outbox to acknowledged by the broker",
                )
                .buckets(LATENCY_BUCKETS.to_vec()),
            )),
            broker_up: must(IntGauge::new(
                "quantmesh_kafka_broker_up",
                "1 when the Kafka broker is reachable (last delivery or metadata request succeeded)",
            )),
            producer_restarts: must(IntCounter::new(
                "quantmesh_kafka_producer_restarts_total",
                "Kafka producers re-created after a fatal producer error",
            )),
            topics_created: must(IntCounterVec::new(
                Opts::new(
                    "quantmesh_kafka_topics_created_total",
                    "Times quantmesh created a missing topic since start",
                ),
                &["topic"],
            )),
        }
    }

    pub fn register(&self, registry: &Registry) -> prometheus::Result<()> {
        registry.register(Box::new(self.recorded.clone()))?;
        registry.register(Box::new(self.delivered.clone()))?;
        registry.register(Box::new(self.failures.clone()))?;
        registry.register(Box::new(self.dropped.clone()))?;
        registry.register(Box::new(self.queued.clone()))?;
        registry.register(Box::new(self.unsynced.clone()))?;
        registry.register(Box::new(self.outbox_depth.clone()))?;
        registry.register(Box::new(self.outbox_bytes.clone()))?;
        registry.register(Box::new(self.outbox_max_bytes.clone()))?;
        registry.register(Box::new(self.latency.clone()))?;
        registry.register(Box::new(self.broker_up.clone()))?;
        registry.register(Box::new(self.producer_restarts.clone()))?;
        registry.register(Box::new(self.topics_created.clone()))?;
        Ok(())
    }

    pub fn drop_event(&self, reason: DropReason, n: u64) {
        self.dropped.with_label_values(&[reason.as_str()]).inc_by(n);
    }
}

impl Default for KafkaMetrics {
    fn default() -> Self {
        Self::new()
    }
}
