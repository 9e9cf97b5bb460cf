//! The engine-facing half: [`KafkaSink`] turns events into outbox records and hands them to
//! the outbox writer thread without ever blocking; the writer appends them to the sled
//! outbox in batches and makes each batch durable with one fsync (group commit).
//!
//! Accounting: an event is `recorded` only once the fsync after its append succeeded. Until
//! then it is `queued` (accepted, waiting for the writer: lost if the process is killed) or
//! `unsynced` (appended, its fsync failed: retried every second). Every accepted event ends
//! up counted once as recorded or dropped, and the two gauges bound what a crash can lose.

use crate::metrics::{DropReason, KafkaMetrics};
use quantmesh_outbox::{Appended, Outbox, Record};
use quantmesh_types::{
    now_ms, wire_name, ConfigEvent, EventSink, FallbackEvent, WindowEvent,
    CONFIG_EVENT_SCHEMA_VERSION, FALLBACK_EVENT_SCHEMA_VERSION, WINDOW_EVENT_SCHEMA_VERSION,
};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, SyncSender, TrySendError};
use std::sync::Arc;
use tokio::sync::Notify;

/// Message headers every record carries.
pub const HEADER_EVENT_TYPE: &str = "event-type";
pub const HEADER_SCHEMA_VERSION: &str = "schema-version";
pub const HEADER_CONTENT_TYPE: &str = "content-type";
/// W3C trace context, when the event was produced under an active trace.
pub const HEADER_TRACEPARENT: &str = "traceparent";

/// Which stream (and topic) a record belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EventType {
    Fallback,
    Config,
    Window,
}

impl EventType {
    /// Every event type, in discriminant order (indexes per-type counters).
    pub const ALL: [EventType; 3] = [EventType::Fallback, EventType::Config, EventType::Window];

    pub fn as_str(self) -> &'static str {
        match self {
            EventType::Fallback => "fallback",
            EventType::Config => "config",
            EventType::Window => "window",
        }
    }

    /// The event type of a stored record (from its header).
    pub fn of(record: &Record) -> EventType {
        match record
            .headers
            .iter()
            .find(|(k, _)| k == HEADER_EVENT_TYPE)
            .map(|(_, v)| v.as_str())
        {
            Some("config") => EventType::Config,
            Some("window") => EventType::Window,
            _ => EventType::Fallback,
        }
    }
}

/// The partitioning key: model + layer group, so one group's events stay ordered in one
/// partition. Decisions without a group (request, batch) use the granularity in its place;
/// config events use `config`.
pub fn fallback_key(ev: &FallbackEvent) -> String {
    match &ev.group {
        Some(g) => format!("{}/{g}", ev.model),
        None => format!("{}/{}", ev.model, wire_name(&ev.granularity)),
    }
}

fn record(
    kind: EventType,
    key: String,
    payload: String,
    version: u32,
    traceparent: Option<String>,
) -> Record {
    let mut headers = vec![
        (HEADER_EVENT_TYPE.to_string(), kind.as_str().to_string()),
        (HEADER_SCHEMA_VERSION.to_string(), version.to_string()),
        (HEADER_CONTENT_TYPE.to_string(), "application/json".into()),
    ];
    if let Some(tp) = traceparent {
        headers.push((HEADER_TRACEPARENT.to_string(), tp));
    }
    Record {
        key,
        payload,
        headers,
        appended_ms: now_ms(),
    }
}

pub(crate) enum WriterMsg {
    Record(Record),
    Stop,
}

/// Implements [`EventSink`] for the engine: serialise, enqueue, return. Never blocks: when
/// the writer's queue is full the event is dropped and counted (`reason="queue_full"`).
pub struct KafkaSink {
    tx: SyncSender<WriterMsg>,
    metrics: KafkaMetrics,
    warned_full: AtomicBool,
    warned_gone: AtomicBool,
}

impl KafkaSink {
    pub(crate) fn new(tx: SyncSender<WriterMsg>, metrics: KafkaMetrics) -> Self {
        Self {
            tx,
            metrics,
            warned_full: AtomicBool::new(false),
            warned_gone: AtomicBool::new(false),
        }
    }

    fn send(&self, rec: Record) {
        // Counted before it is sent, so the writer never takes it off the gauge first.
        self.metrics.queued.inc();
        match self.tx.try_send(WriterMsg::Record(rec)) {
            Ok(()) => {
                self.warned_full.store(false, Ordering::Relaxed);
            }
            Err(TrySendError::Full(_)) => {
                self.metrics.queued.dec();
                self.metrics.drop_event(DropReason::QueueFull, 1);
                if !self.warned_full.swap(true, Ordering::Relaxed) {
                    tracing::warn!(target: "quantmesh::kafka", "outbox writer queue full: dropping events (counted in quantmesh_events_dropped_total{{reason=\"queue_full\"}})");
                }
            }
            Err(TrySendError::Disconnected(_)) => {
                self.metrics.queued.dec();
                // The writer thread is gone: after shutdown (the engine is draining), or it
                // died. Either way the event is lost; say so once, never silently.
                self.metrics.drop_event(DropReason::WriterFailed, 1);
                if !self.warned_gone.swap(true, Ordering::Relaxed) {
                    tracing::error!(target: "quantmesh::kafka", "the outbox writer has stopped: dropping events (counted in quantmesh_events_dropped_total{{reason=\"writer_failed\"}})");
                }
            }
        }
    }
}

impl EventSink for KafkaSink {
    fn publish(&self, ev: &FallbackEvent) {
        let Ok(payload) = serde_json::to_string(ev) else {
            return;
        };
        let rec = record(
            EventType::Fallback,
            fallback_key(ev),
            payload,
            FALLBACK_EVENT_SCHEMA_VERSION,
            ev.traceparent.clone(),
        );
        self.send(rec);
    }

    fn publish_config(&self, ev: &ConfigEvent) {
        let Ok(payload) = serde_json::to_string(ev) else {
            return;
        };
        let rec = record(
            EventType::Config,
            format!("{}/config", ev.model),
            payload,
            CONFIG_EVENT_SCHEMA_VERSION,
            ev.traceparent.clone(),
        );
        self.send(rec);
    }

    fn publish_window(&self, ev: &WindowEvent) {
        let Ok(payload) = serde_json::to_string(ev) else {
            return;
        };
        let rec = record(
            EventType::Window,
            format!("{}/window", ev.model),
            payload,
            WINDOW_EVENT_SCHEMA_VERSION,
            None,
        );
        self.send(rec);
    }
}

/// Most records appended per fsync.
const WRITER_BATCH: usize = 4096;

/// How often the writer retries an fsync that failed while no new events arrive.
const SYNC_RETRY: std::time::Duration = std::time::Duration::from_secs(1);

/// The outbox writer thread: append what is queued, fsync once, count, wake the relay.
pub(crate) fn run_writer(
    rx: Receiver<WriterMsg>,
    outbox: Arc<Outbox>,
    metrics: KafkaMetrics,
    relay: Arc<Notify>,
) {
    let mut seen_dropped = outbox.stats.dropped.load(Ordering::Relaxed);
    let mut seen_no_space = outbox.stats.disk_full.load(Ordering::Relaxed);
    let mut full = false;
    let mut disk_full = false;
    // Appended, fsync not yet succeeded, by event type.
    let mut unsynced = [0u64; EventType::ALL.len()];
    loop {
        let first = match rx.recv_timeout(SYNC_RETRY) {
            Ok(m) => m,
            Err(RecvTimeoutError::Timeout) => {
                sync(&outbox, &metrics, &mut unsynced);
                continue;
            }
            Err(RecvTimeoutError::Disconnected) => break,
        };
        let mut batch = vec![first];
        while batch.len() < WRITER_BATCH {
            match rx.try_recv() {
                Ok(m) => batch.push(m),
                Err(_) => break,
            }
        }
        let mut stop = false;
        let mut records = Vec::with_capacity(batch.len());
        for m in batch {
            match m {
                WriterMsg::Stop => stop = true,
                WriterMsg::Record(r) => records.push(r),
            }
        }
        metrics.queued.sub(records.len() as i64);
        // A panic while storing a batch (a bug, a poisoned dependency) costs that batch,
        // counted and logged, not the event path: the writer goes on with the next one.
        let n = records.len();
        let stored =
            contained(&metrics, n, || store_batch(&outbox, &metrics, &records)).unwrap_or_default();
        for (u, s) in unsynced.iter_mut().zip(stored) {
            *u += s;
        }
        sync(&outbox, &metrics, &mut unsynced);
        // Drops by the outbox's policy (newest refused or oldest evicted).
        let dropped = outbox.stats.dropped.load(Ordering::Relaxed);
        if dropped > seen_dropped {
            metrics.drop_event(DropReason::OutboxFull, dropped - seen_dropped);
            if !full {
                tracing::warn!(target: "quantmesh::kafka", bytes = outbox.bytes(), max_bytes = metrics.outbox_max_bytes.get(), "outbox full: dropping events per kafka.full_policy (counted in quantmesh_events_dropped_total{{reason=\"outbox_full\"}})");
            }
            full = true;
            seen_dropped = dropped;
        } else if stored.iter().sum::<u64>() > 0 {
            full = false;
        }
        // Refused for want of disk space (the filesystem below kafka.outbox_min_free_bytes).
        let no_space = outbox.stats.disk_full.load(Ordering::Relaxed);
        if no_space > seen_no_space {
            metrics.drop_event(DropReason::DiskFull, no_space - seen_no_space);
            if !disk_full {
                tracing::error!(target: "quantmesh::kafka", "the outbox's filesystem is below kafka.outbox_min_free_bytes: dropping new events until it has room (counted in quantmesh_events_dropped_total{{reason=\"disk_full\"}})");
            }
            disk_full = true;
            seen_no_space = no_space;
        } else if stored.iter().sum::<u64>() > 0 {
            if disk_full {
                tracing::info!(target: "quantmesh::kafka", "the outbox's filesystem has room again: events are stored");
            }
            disk_full = false;
        }
        metrics.outbox_depth.set(outbox.depth() as i64);
        metrics.outbox_bytes.set(outbox.bytes() as i64);
        relay.notify_one();
        if stop {
            break;
        }
    }
    // Last chance for events whose fsync failed: at shutdown, one more try.
    sync(&outbox, &metrics, &mut unsynced);
}

/// fsync the outbox when events wait for it: on success the `unsynced` events are recorded
/// (by type) and cleared; on failure they stay unsynced, shown by the gauge, for the next try.
fn sync(outbox: &Outbox, metrics: &KafkaMetrics, unsynced: &mut [u64; EventType::ALL.len()]) {
    if unsynced.iter().sum::<u64>() == 0 {
        return;
    }
    match outbox.flush() {
        Ok(()) => {
            for (kind, n) in EventType::ALL.into_iter().zip(unsynced.iter_mut()) {
                metrics
                    .recorded
                    .with_label_values(&[kind.as_str()])
                    .inc_by(*n);
                *n = 0;
            }
        }
        Err(e) => {
            tracing::error!(target: "quantmesh::kafka", error = %e, events = unsynced.iter().sum::<u64>(), "outbox fsync failed: these events are not durable yet (quantmesh_events_unsynced); retrying");
        }
    }
    metrics.unsynced.set(unsynced.iter().sum::<u64>() as i64);
}

/// Append a batch (not yet durable), by event type what was stored.
fn store_batch(
    outbox: &Outbox,
    metrics: &KafkaMetrics,
    records: &[Record],
) -> [u64; EventType::ALL.len()] {
    let mut stored = [0u64; EventType::ALL.len()];
    match outbox.append_batch(records) {
        Ok(results) => {
            for (a, r) in results.iter().zip(records) {
                if matches!(a, Appended::Stored { .. }) {
                    stored[EventType::of(r) as usize] += 1;
                }
            }
        }
        Err(e) => {
            tracing::error!(target: "quantmesh::kafka", error = %e, events = records.len(), "outbox append failed: events dropped");
            metrics.drop_event(DropReason::StorageError, records.len() as u64);
        }
    }
    stored
}

/// Run `f` for a batch of `events`; a panic is caught, logged and the batch counted as
/// dropped (`writer_failed`).
fn contained<T>(metrics: &KafkaMetrics, events: usize, f: impl FnOnce() -> T) -> Option<T> {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
        Ok(v) => Some(v),
        Err(panic) => {
            let why = panic
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "a non-string panic".into());
            tracing::error!(target: "quantmesh::kafka", events, why, "the outbox writer panicked on a batch: its events are dropped, the writer goes on");
            metrics.drop_event(DropReason::WriterFailed, events as u64);
            None
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use quantmesh_types::{FallbackAction, FallbackReason, Granularity};

    pub(crate) fn event(group: Option<&str>, g: Granularity) -> FallbackEvent {
        FallbackEvent {
            schema_version: 1,
            event_id: "e".into(),
            timestamp_ms: 1,
            model: "m".into(),
            group: group.map(String::from),
            granularity: g,
            action: FallbackAction::Enter,
            reason: FallbackReason::Admin,
            outlier_rate: None,
            mean: None,
            sigma: None,
            k: None,
            kl: None,
            kl_reference: None,
            token_ids: vec![],
            positions: vec![],
            request_id: None,
            config_md5: None,
            traceparent: Some("00-abc-def-01".into()),
        }
    }

    #[test]
    fn keys_keep_a_group_in_one_partition() {
        assert_eq!(
            fallback_key(&event(Some("layers.1.down"), Granularity::Layer)),
            "m/layers.1.down"
        );
        assert_eq!(
            fallback_key(&event(Some("layers.1.down"), Granularity::Token)),
            "m/layers.1.down"
        );
        assert_eq!(fallback_key(&event(None, Granularity::Batch)), "m/batch");
    }

    #[test]
    fn writer_records_durably_and_counts_drops() {
        let dir = tempfile::tempdir().unwrap();
        let outbox = Arc::new(
            Outbox::open(dir.path(), 1500, quantmesh_outbox::FullPolicy::DropNewest).unwrap(),
        );
        let metrics = KafkaMetrics::new();
        let (tx, rx) = std::sync::mpsc::sync_channel(16);
        let notify = Arc::new(Notify::new());
        let sink = KafkaSink::new(tx.clone(), metrics.clone());
        let (o, m, n) = (outbox.clone(), metrics.clone(), notify.clone());
        let writer = std::thread::spawn(move || run_writer(rx, o, m, n));
        for _ in 0..10 {
            sink.publish(&event(Some("layers.0.qkv"), Granularity::Layer));
        }
        tx.send(WriterMsg::Stop).unwrap();
        writer.join().unwrap();
        let recorded = metrics.recorded.with_label_values(&["fallback"]).get();
        let dropped = metrics.dropped.with_label_values(&["outbox_full"]).get();
        let queue = metrics.dropped.with_label_values(&["queue_full"]).get();
        assert!(recorded > 0 && dropped > 0, "{recorded} {dropped}");
        assert_eq!(recorded + dropped + queue, 10);
        assert_eq!(outbox.depth() as u64, recorded);
        assert!(outbox.bytes() <= 1500);
        let (_, rec) = outbox.peek(1).pop().unwrap().unwrap();
        assert_eq!(EventType::of(&rec), EventType::Fallback);
        assert_eq!(rec.key, "m/layers.0.qkv");
        assert!(rec
            .headers
            .contains(&("traceparent".into(), "00-abc-def-01".into())));
        assert!(rec.headers.contains(&("schema-version".into(), "1".into())));
    }

    #[test]
    fn an_event_is_recorded_only_once_its_fsync_succeeded() {
        let dir = tempfile::tempdir().unwrap();
        let outbox = Arc::new(
            Outbox::open(
                dir.path(),
                1 << 20,
                quantmesh_outbox::FullPolicy::DropNewest,
            )
            .unwrap(),
        );
        outbox.fail_next_flushes(1);
        let metrics = KafkaMetrics::new();
        let (tx, rx) = std::sync::mpsc::sync_channel(16);
        let sink = KafkaSink::new(tx.clone(), metrics.clone());
        // Accepted before the writer runs: queued, not yet stored anywhere.
        for _ in 0..3 {
            sink.publish(&event(Some("layers.0.qkv"), Granularity::Layer));
        }
        assert_eq!(metrics.queued.get(), 3);
        let (o, m) = (outbox.clone(), metrics.clone());
        let writer = std::thread::spawn(move || run_writer(rx, o, m, Arc::new(Notify::new())));
        let recorded = || metrics.recorded.with_label_values(&["fallback"]).get();
        // The batch's fsync fails: appended (the relay may send them) but not recorded.
        let t0 = std::time::Instant::now();
        while metrics.unsynced.get() != 3 {
            assert!(t0.elapsed().as_secs() < 10, "never unsynced");
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        assert_eq!(
            (recorded(), metrics.queued.get(), outbox.depth()),
            (0, 0, 3)
        );
        // The writer retries on its own while nothing new arrives.
        while recorded() != 3 {
            assert!(
                t0.elapsed().as_secs() < 10,
                "the failed fsync was never retried"
            );
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        assert_eq!(metrics.unsynced.get(), 0);
        tx.send(WriterMsg::Stop).unwrap();
        writer.join().unwrap();
    }

    #[test]
    fn a_panicking_batch_is_counted_and_a_stopped_writer_is_not_silent() {
        let metrics = KafkaMetrics::new();
        let failed = || metrics.dropped.with_label_values(&["writer_failed"]).get();
        assert_eq!(contained(&metrics, 3, || 7), Some(7));
        assert_eq!(failed(), 0);
        let r: Option<()> = contained(&metrics, 3, || panic!("index out of bounds"));
        assert_eq!((r, failed()), (None, 3));
        // A writer that is gone: each event published after is counted, not lost silently.
        let (tx, rx) = std::sync::mpsc::sync_channel(4);
        drop(rx);
        let sink = KafkaSink::new(tx, metrics.clone());
        sink.publish(&event(Some("layers.0.o"), Granularity::Layer));
        sink.publish(&event(Some("layers.0.o"), Granularity::Layer));
        assert_eq!(failed(), 5);
        assert_eq!(metrics.dropped.with_label_values(&["queue_full"]).get(), 0);
    }
}
