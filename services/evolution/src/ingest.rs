//! Lake ingest: a Kafka consumer (consumer group `evolution.group_id`, auto-commit off) that
//! lands fallback, config and window events in the Parquet lake.
//!
//! One batch at a time: consume up to `batch_records` records or `batch_interval`, turn each
//! into its table rows (records that cannot be read go to `rejected` with the reason —
//! nothing is skipped silently), drop duplicates by `event_id` (a bounded set of recent
//! ids), write one file per table × model × date × source partition, and only then commit
//! the offsets. A crash before the commit re-delivers the batch; its files are replaced,
//! not doubled (see [`crate::lake`]).

use crate::lake::tables::{
    config_rows, date_partition, fallback_rows, model_partition, rejected_row, window_rows, Routed,
    Rows, Table,
};
use crate::lake::{Lake, LakeError, Source};
use crate::metrics::EvolutionMetrics;
use quantmesh_kafka::client::{consumer_config, Context};
use quantmesh_kafka::KafkaSettings;
use quantmesh_types::{
    now_ms, ConfigEvent, FallbackEvent, WindowEvent, CONFIG_EVENT_SCHEMA_VERSION,
    FALLBACK_EVENT_SCHEMA_VERSION, WINDOW_EVENT_SCHEMA_VERSION,
};
use rdkafka::consumer::{CommitMode, Consumer, StreamConsumer};
use rdkafka::message::Message;
use rdkafka::{Offset, TopicPartitionList};
use std::collections::{BTreeMap, HashSet, VecDeque};
use std::time::{Duration, Instant};
use tokio::sync::watch;

#[derive(Debug, thiserror::Error)]
pub enum IngestError {
    #[error("Kafka: {0}")]
    Kafka(String),
    #[error(transparent)]
    Lake(#[from] LakeError),
}

/// What ingest needs besides the broker settings.
#[derive(Debug, Clone)]
pub struct IngestOptions {
    pub group_id: String,
    pub batch_records: usize,
    pub batch_interval: Duration,
    /// Event ids remembered for deduplication across batches.
    pub dedup_capacity: usize,
}

/// What a batch did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BatchReport {
    pub records: usize,
    pub duplicates: usize,
    pub rejected: usize,
    pub rows: usize,
    pub files: usize,
    pub bytes: u64,
    pub superseded: usize,
}

/// A bounded set of recently seen event ids (FIFO eviction).
struct RecentIds {
    set: HashSet<String>,
    order: VecDeque<String>,
    cap: usize,
}

impl RecentIds {
    fn new(cap: usize) -> Self {
        Self {
            set: HashSet::new(),
            order: VecDeque::new(),
            cap: cap.max(1),
        }
    }

    /// False when `id` was seen already.
    fn insert(&mut self, id: &str) -> bool {
        if self.set.contains(id) {
            return false;
        }
        if self.order.len() >= self.cap {
            if let Some(old) = self.order.pop_front() {
                self.set.remove(&old);
            }
        }
        self.set.insert(id.to_string());
        self.order.push_back(id.to_string());
        true
    }
}

/// One consumed record, reduced to what the lake needs.
pub struct Consumed {
    pub topic: String,
    pub partition: i32,
    pub offset: i64,
    pub event_type: Option<String>,
    pub payload: Result<String, String>,
}

/// Decode a record into its lake rows and its event id; or a `rejected` row.
fn decode(rec: &Consumed, settings: &KafkaSettings) -> Result<(String, Vec<Routed>), String> {
    let payload = rec.payload.as_ref().map_err(Clone::clone)?;
    let kind = rec.event_type.as_deref().unwrap_or_else(|| {
        if rec.topic == settings.config_topic {
            "config"
        } else if rec.topic == settings.window_topic {
            "window"
        } else {
            "fallback"
        }
    });
    let version = |v: u32, want: u32, what: &str| {
        if v == want {
            Ok(())
        } else {
            Err(format!(
                "{what} schema_version {v}, this ingester reads {want}"
            ))
        }
    };
    match kind {
        "fallback" => {
            let ev: FallbackEvent = serde_json::from_str(payload)
                .map_err(|e| format!("not a fallback event v1: {e}"))?;
            version(
                ev.schema_version,
                FALLBACK_EVENT_SCHEMA_VERSION,
                "fallback event",
            )?;
            Ok((ev.event_id.clone(), fallback_rows(&ev)))
        }
        "config" => {
            let ev: ConfigEvent =
                serde_json::from_str(payload).map_err(|e| format!("not a config event v1: {e}"))?;
            version(
                ev.schema_version,
                CONFIG_EVENT_SCHEMA_VERSION,
                "config event",
            )?;
            Ok((ev.event_id.clone(), config_rows(&ev)))
        }
        "window" => {
            let ev: WindowEvent =
                serde_json::from_str(payload).map_err(|e| format!("not a window event v1: {e}"))?;
            version(
                ev.schema_version,
                WINDOW_EVENT_SCHEMA_VERSION,
                "window event",
            )?;
            Ok((ev.event_id.clone(), window_rows(&ev)))
        }
        other => Err(format!("unknown event-type header {other:?}")),
    }
}

/// The lake side of ingest, independent of Kafka (tests drive it directly).
pub struct Writer {
    lake: std::sync::Arc<Lake>,
    settings: KafkaSettings,
    recent: RecentIds,
    metrics: Option<EvolutionMetrics>,
}

impl Writer {
    pub fn new(
        lake: std::sync::Arc<Lake>,
        settings: KafkaSettings,
        dedup_capacity: usize,
        metrics: Option<EvolutionMetrics>,
    ) -> Self {
        Self {
            lake,
            settings,
            recent: RecentIds::new(dedup_capacity),
            metrics,
        }
    }

    /// Land one batch (records in consumption order). Durable when it returns `Ok`.
    pub async fn write_batch(&mut self, batch: &[Consumed]) -> Result<BatchReport, LakeError> {
        let mut report = BatchReport {
            records: batch.len(),
            ..Default::default()
        };
        // Offsets per source partition (over every consumed record, kept or not).
        let mut ranges: BTreeMap<(String, i32), (i64, i64)> = BTreeMap::new();
        // Rows per (source partition, table, model, date).
        type Key = ((String, i32), Table, String, String);
        let mut files: BTreeMap<Key, Rows> = BTreeMap::new();
        let now = now_ms();
        for rec in batch {
            let src = (rec.topic.clone(), rec.partition);
            let r = ranges
                .entry(src.clone())
                .or_insert((rec.offset, rec.offset));
            r.0 = r.0.min(rec.offset);
            r.1 = r.1.max(rec.offset);
            let routed = match decode(rec, &self.settings) {
                Ok((id, rows)) => {
                    if !self.recent.insert(&id) {
                        report.duplicates += 1;
                        continue;
                    }
                    rows
                }
                Err(e) => {
                    report.rejected += 1;
                    tracing::warn!(target: "quantmesh::evolution", topic = %rec.topic, partition = rec.partition, offset = rec.offset, error = %e, "record kept in the lake's `rejected` table");
                    let payload = rec.payload.as_deref().unwrap_or("");
                    vec![rejected_row(
                        &rec.topic,
                        rec.partition,
                        rec.offset,
                        now,
                        &e,
                        payload,
                    )]
                }
            };
            for r in routed {
                report.rows += 1;
                let key = (
                    src.clone(),
                    r.table,
                    model_partition(&r.model),
                    date_partition(r.timestamp_ms),
                );
                files.entry(key).or_default().values.push(r.row);
            }
        }
        for ((topic, partition), (first, _)) in &ranges {
            report.superseded += self.lake.supersede(topic, *partition, *first).await?;
        }
        for (((topic, partition), table, model, date), rows) in &files {
            let Some(&(first, last)) = ranges.get(&(topic.clone(), *partition)) else {
                continue;
            };
            let source = Source {
                topic: topic.clone(),
                partition: *partition,
                first,
                last,
            };
            let batch = rows
                .to_batch(*table)
                .map_err(|e| LakeError::Encode(table.name().into(), e))?;
            report.bytes += self
                .lake
                .write(*table, model, date, &source, &batch)
                .await?;
            report.files += 1;
            if let Some(m) = &self.metrics {
                m.rows
                    .with_label_values(&[table.name()])
                    .inc_by(rows.len() as u64);
            }
        }
        if let Some(m) = &self.metrics {
            m.records.inc_by(report.records as u64);
            m.duplicates.inc_by(report.duplicates as u64);
            m.rejected.inc_by(report.rejected as u64);
            m.lake_bytes_written.inc_by(report.bytes);
        }
        Ok(report)
    }
}

/// Consume until `stop` turns true (finishing the batch in hand), or — with `idle` — until
/// no record arrived for that long. Returns the total over all batches.
pub async fn run(
    settings: &KafkaSettings,
    opts: &IngestOptions,
    lake: std::sync::Arc<Lake>,
    metrics: Option<EvolutionMetrics>,
    mut stop: watch::Receiver<bool>,
    idle: Option<Duration>,
) -> Result<BatchReport, IngestError> {
    let indexed = lake.sweep().await?;
    let mut cfg = consumer_config(settings, &opts.group_id, true);
    cfg.set("enable.auto.commit", "false")
        .set("enable.auto.offset.store", "false");
    let consumer: StreamConsumer<Context> = cfg
        .create_with_context(Context::default())
        .map_err(|e| IngestError::Kafka(format!("creating the consumer: {e}")))?;
    let topics = settings.topics();
    consumer
        .subscribe(&topics)
        .map_err(|e| IngestError::Kafka(format!("subscribing to {topics:?}: {e}")))?;
    tracing::info!(target: "quantmesh::evolution", lake = %lake.location(), files = indexed, group = %opts.group_id, ?topics, "lake ingest started");
    let mut writer = Writer::new(
        lake.clone(),
        settings.clone(),
        opts.dedup_capacity,
        metrics.clone(),
    );
    let mut total = BatchReport::default();
    let mut last_record = Instant::now();
    let started = Instant::now();
    let mut assigned = false;
    let pause_before_commit = std::env::var("QUANTMESH_EVOLUTION_PAUSE_BEFORE_COMMIT")
        .ok()
        .and_then(|v| humantime::parse_duration(&v).ok());
    loop {
        let mut batch: Vec<Consumed> = Vec::new();
        let deadline = tokio::time::Instant::now() + opts.batch_interval;
        while batch.len() < opts.batch_records && !*stop.borrow() {
            let msg = tokio::select! {
                m = consumer.recv() => m,
                _ = tokio::time::sleep_until(deadline) => break,
                _ = stop.changed() => break,
            };
            match msg {
                Ok(m) => {
                    last_record = Instant::now();
                    assigned = true;
                    let event_type = m.headers().and_then(|h| {
                        use rdkafka::message::Headers;
                        h.iter()
                            .find(|x| x.key == quantmesh_kafka::sink::HEADER_EVENT_TYPE)
                            .and_then(|x| x.value)
                            .and_then(|v| std::str::from_utf8(v).ok())
                            .map(String::from)
                    });
                    let payload = match m.payload_view::<str>() {
                        Some(Ok(p)) => Ok(p.to_string()),
                        Some(Err(_)) => Err("payload is not UTF-8".to_string()),
                        None => Err("empty payload".to_string()),
                    };
                    batch.push(Consumed {
                        topic: m.topic().to_string(),
                        partition: m.partition(),
                        offset: m.offset(),
                        event_type,
                        payload,
                    });
                }
                Err(e) => {
                    tracing::warn!(target: "quantmesh::evolution", error = %e, "consumer error");
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
            }
        }
        if !batch.is_empty() {
            let r = writer.write_batch(&batch).await?;
            tracing::info!(target: "quantmesh::evolution", records = r.records, files = r.files, "batch written, committing offsets");
            if let Some(pause) = pause_before_commit {
                // Test hook: widen the window between "durable" and "committed" so a test
                // can SIGKILL the process inside it.
                tokio::time::sleep(pause).await;
            }
            // Durable: now commit (next offset to read = last + 1, per partition).
            let mut tpl = TopicPartitionList::new();
            let mut next: BTreeMap<(String, i32), i64> = BTreeMap::new();
            for rec in &batch {
                let e = next.entry((rec.topic.clone(), rec.partition)).or_insert(0);
                *e = (*e).max(rec.offset + 1);
            }
            for ((t, p), o) in &next {
                tpl.add_partition_offset(t, *p, Offset::Offset(*o))
                    .map_err(|e| IngestError::Kafka(e.to_string()))?;
            }
            consumer
                .commit(&tpl, CommitMode::Sync)
                .map_err(|e| IngestError::Kafka(format!("committing offsets: {e}")))?;
            tracing::info!(target: "quantmesh::evolution", records = r.records, rows = r.rows, files = r.files, bytes = r.bytes, duplicates = r.duplicates, rejected = r.rejected, "batch landed");
            if let Some(m) = &metrics {
                m.last_commit.set(now_ms() as i64 / 1000);
            }
            total.records += r.records;
            total.duplicates += r.duplicates;
            total.rejected += r.rejected;
            total.rows += r.rows;
            total.files += r.files;
            total.bytes += r.bytes;
            total.superseded += r.superseded;
        }
        if *stop.borrow() {
            break;
        }
        // The idle clock runs from the moment the group gave this consumer its partitions
        // (joining a group can take seconds); without an assignment it waits up to 60 s.
        if !assigned {
            if consumer.assignment().is_ok_and(|a| a.count() > 0) {
                assigned = true;
                last_record = Instant::now();
            } else if idle.is_some() && started.elapsed() >= Duration::from_secs(60) {
                tracing::warn!(target: "quantmesh::evolution", "no partitions assigned within 60 s: nothing ingested");
                break;
            }
        }
        if assigned && idle.is_some_and(|d| last_record.elapsed() >= d) {
            break;
        }
    }
    tracing::info!(target: "quantmesh::evolution", records = total.records, files = total.files, "lake ingest stopped");
    Ok(total)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn recent_ids_forget_the_oldest() {
        let mut r = RecentIds::new(2);
        assert!(r.insert("a"));
        assert!(!r.insert("a"));
        assert!(r.insert("b"));
        assert!(r.insert("c"));
        assert!(r.insert("a"));
    }
}
