//! The evolution service's series (`quantmesh_evolution_*`).

use prometheus::{Gauge, IntCounter, IntCounterVec, IntGauge, Opts, Registry};

#[derive(Clone)]
pub struct EvolutionMetrics {
    /// Kafka records consumed into the lake.
    pub records: IntCounter,
    /// Lake rows written, by table.
    pub rows: IntCounterVec,
    pub duplicates: IntCounter,
    pub rejected: IntCounter,
    pub lake_bytes_written: IntCounter,
    /// Unix seconds of the last offset commit.
    pub last_commit: IntGauge,
    /// Analysis runs by result (`proposed`, `unchanged`, `failed`).
    pub runs: IntCounterVec,
    /// Unix seconds of the last successful run (any result but `failed`).
    pub last_success: IntGauge,
    /// Duration of the last run in seconds.
    pub last_run_seconds: Gauge,
    /// 1 while the lake ingest consumes, 0 while it is failing (and retrying).
    pub ingest_up: IntGauge,
    /// Unix seconds when this process started (the staleness alert's grace period).
    pub started: IntGauge,
    /// Pull requests by what happened (`opened`, `updated`, `unchanged`).
    pub pull_requests: IntCounterVec,
}

fn must<T>(r: prometheus::Result<T>) -> T {
    match r {
        Ok(v) => v,
        Err(e) => panic!("static metric definition is invalid: {e}"),
    }
}

impl EvolutionMetrics {
    pub fn register(registry: &Registry) -> prometheus::Result<Self> {
        let c = |n: &str, h: &str| must(IntCounter::new(n, h));
        let m = Self {
            records: c(
                "quantmesh_evolution_records_total",
                "Kafka records consumed into the lake.",
            ),
            rows: must(IntCounterVec::new(
                Opts::new(
                    "quantmesh_evolution_lake_rows_total",
                    "Rows written to the lake, by table.",
                ),
                &["table"],
            )),
            duplicates: c(
                "quantmesh_evolution_duplicates_total",
                "Records skipped because their event_id was already landed.",
            ),
            rejected: c(
                "quantmesh_evolution_rejected_total",
                "Records that could not be read as their event type (kept in `rejected`).",
            ),
            lake_bytes_written: c(
                "quantmesh_evolution_lake_bytes_written_total",
                "Parquet bytes written to the lake.",
            ),
            last_commit: must(IntGauge::new(
                "quantmesh_evolution_last_commit_timestamp_seconds",
                "Unix time of the last Kafka offset commit (after the data was durable).",
            )),
            runs: must(IntCounterVec::new(
                Opts::new(
                    "quantmesh_evolution_runs_total",
                    "Evolution runs by result (proposed, unchanged, failed).",
                ),
                &["result"],
            )),
            last_success: must(IntGauge::new(
                "quantmesh_evolution_last_success_timestamp_seconds",
                "Unix time of the last evolution run that did not fail.",
            )),
            last_run_seconds: must(Gauge::new(
                "quantmesh_evolution_last_run_duration_seconds",
                "Duration of the last evolution run (analysis, proposal, push and pull request).",
            )),
            ingest_up: must(IntGauge::new(
                "quantmesh_evolution_ingest_up",
                "1 while the lake ingest consumes, 0 while it fails and retries (no brokers: absent).",
            )),
            started: must(IntGauge::new(
                "quantmesh_evolution_started_timestamp_seconds",
                "Unix time this evolution service started.",
            )),
            pull_requests: must(IntCounterVec::new(
                Opts::new(
                    "quantmesh_evolution_pull_requests_total",
                    "Pull requests by outcome (opened, updated, unchanged).",
                ),
                &["outcome"],
            )),
        };
        registry.register(Box::new(m.records.clone()))?;
        registry.register(Box::new(m.rows.clone()))?;
        registry.register(Box::new(m.duplicates.clone()))?;
        registry.register(Box::new(m.rejected.clone()))?;
        registry.register(Box::new(m.lake_bytes_written.clone()))?;
        registry.register(Box::new(m.last_commit.clone()))?;
        registry.register(Box::new(m.runs.clone()))?;
        registry.register(Box::new(m.last_success.clone()))?;
        registry.register(Box::new(m.last_run_seconds.clone()))?;
        registry.register(Box::new(m.started.clone()))?;
        registry.register(Box::new(m.ingest_up.clone()))?;
        m.started.set(quantmesh_types::now_ms() as i64 / 1000);
        registry.register(Box::new(m.pull_requests.clone()))?;
        for r in ["proposed", "unchanged", "failed"] {
            m.runs.with_label_values(&[r]);
        }
        for o in ["opened", "updated", "unchanged"] {
            m.pull_requests.with_label_values(&[o]);
        }
        Ok(m)
    }
}
