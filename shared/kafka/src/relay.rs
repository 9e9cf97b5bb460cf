//! The relay: reads the oldest records from the outbox, hands them to the idempotent
//! producer, and removes each one only after its delivery report succeeded. Runs on its own
//! thread (a single-threaded tokio runtime) so nothing on the serving path waits for it.
//!
//! Failure handling: a failed delivery leaves the record in the outbox; the relay backs off
//! (250 ms doubling to 5 s) and sends it again. While deliveries are slow it checks the
//! topics and re-creates missing ones (a broker restarted without its data). A fatal producer
//! error (e.g. the broker lost the idempotent producer's state) drops the producer and builds
//! a new one; the outbox still holds everything not acknowledged.

use crate::client::{self, Context};
use crate::metrics::{DropReason, KafkaMetrics};
use crate::settings::KafkaSettings;
use crate::sink::EventType;
use quantmesh_outbox::{Outbox, OutboxError};
use quantmesh_types::now_ms;
use rdkafka::admin::AdminClient;
use rdkafka::error::RDKafkaErrorCode;
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord, Producer};
use rdkafka::util::Timeout;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::{watch, Notify};

pub(crate) struct Relay {
    pub settings: KafkaSettings,
    pub outbox: Arc<Outbox>,
    pub metrics: KafkaMetrics,
    pub admin: Arc<AdminClient<Context>>,
    pub wake: Arc<Notify>,
    pub stop: watch::Receiver<bool>,
}

const BACKOFF_MIN: Duration = Duration::from_millis(250);
const BACKOFF_MAX: Duration = Duration::from_secs(5);
/// While a round's deliveries are outstanding this long, check the topics.
const SLOW_ROUND: Duration = Duration::from_secs(2);

impl Relay {
    pub fn run(self) {
        let rt = match tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
        {
            Ok(rt) => rt,
            Err(e) => {
                tracing::error!(target: "quantmesh::kafka", error = %e, "cannot start the relay runtime: events stay in the outbox");
                return;
            }
        };
        rt.block_on(self.relay());
    }

    fn gauges(&self) {
        self.metrics.outbox_depth.set(self.outbox.depth() as i64);
        self.metrics.outbox_bytes.set(self.outbox.bytes() as i64);
    }

    /// Ask the broker for our topics (creating missing ones). A broker that does not answer
    /// within `SLOW_ROUND` marks `broker_up` 0; one that answers marks it 1.
    async fn topics_ok(&self) -> bool {
        match client::ensure_topics(&self.settings, &self.admin, Some(&self.metrics), SLOW_ROUND)
            .await
        {
            Ok(_) => true,
            Err(e) => {
                self.metrics.broker_up.set(0);
                tracing::debug!(target: "quantmesh::kafka", error = %e, "topic check failed");
                false
            }
        }
    }

    async fn pause(&mut self, d: Duration) {
        let mut stop = self.stop.clone();
        tokio::select! {
            _ = tokio::time::sleep(d) => {}
            _ = stop.changed() => {}
        }
    }

    async fn relay(mut self) {
        let mut producer: Option<FutureProducer<Context>> = None;
        let mut backoff = BACKOFF_MIN;
        let mut deadline: Option<Instant> = None;
        let mut failing = false;
        let mut failed_rounds = 0u32;
        loop {
            // Stopping: asked to, or the pipeline handle is gone.
            if *self.stop.borrow() || self.stop.has_changed().is_err() {
                let d = *deadline
                    .get_or_insert_with(|| Instant::now() + self.settings.shutdown_timeout);
                if self.outbox.depth() == 0 || Instant::now() >= d {
                    break;
                }
            }
            let batch = self.outbox.peek(self.settings.batch_size);
            if batch.is_empty() {
                if deadline.is_some() {
                    break;
                }
                // Idle and the broker was down: find out when it is back (and re-create
                // topics a restarted broker lost).
                if self.metrics.broker_up.get() == 0 && self.topics_ok().await {
                    tracing::info!(target: "quantmesh::kafka", "broker reachable again");
                }
                let mut stop = self.stop.clone();
                tokio::select! {
                    _ = self.wake.notified() => {}
                    _ = tokio::time::sleep(Duration::from_secs(1)) => {}
                    _ = stop.changed() => {}
                }
                continue;
            }
            let p = match producer.take() {
                Some(p) => p,
                None => match client::producer(&self.settings, &self.metrics) {
                    Ok(p) => p,
                    Err(e) => {
                        tracing::error!(target: "quantmesh::kafka", error = %e, "events stay in the outbox");
                        self.pause(BACKOFF_MAX).await;
                        continue;
                    }
                },
            };
            let mut pending = Vec::with_capacity(batch.len());
            for item in batch {
                let (seq, rec) = match item {
                    Ok(r) => r,
                    Err(OutboxError::Corrupt { seq, reason }) => {
                        tracing::error!(target: "quantmesh::kafka", seq, %reason, "unreadable outbox record removed");
                        let _ = self.outbox.ack(seq);
                        self.metrics.drop_event(DropReason::Unreadable, 1);
                        continue;
                    }
                    Err(e) => {
                        tracing::error!(target: "quantmesh::kafka", error = %e, "reading the outbox");
                        break;
                    }
                };
                let kind = EventType::of(&rec);
                let topic = match kind {
                    EventType::Fallback => self.settings.topic.as_str(),
                    EventType::Config => self.settings.config_topic.as_str(),
                    EventType::Window => self.settings.window_topic.as_str(),
                };
                let mut headers = OwnedHeaders::new_with_capacity(rec.headers.len());
                for (k, v) in &rec.headers {
                    headers = headers.insert(Header {
                        key: k,
                        value: Some(v.as_bytes()),
                    });
                }
                let fr = FutureRecord::to(topic)
                    .key(rec.key.as_str())
                    .payload(rec.payload.as_str())
                    .headers(headers);
                match p.send_result(fr) {
                    Ok(fut) => pending.push((seq, rec.appended_ms, kind, fut)),
                    // librdkafka's local queue is full: send the rest next round.
                    Err(_) => break,
                }
            }
            let (meta, futs): (Vec<_>, Vec<_>) = pending
                .into_iter()
                .map(|(s, t, k, f)| ((s, t, k), f))
                .unzip();
            let all = futures::future::join_all(futs);
            tokio::pin!(all);
            let results = loop {
                tokio::select! {
                    r = &mut all => break r,
                    // Slow: the broker is down, or up without our topics.
                    _ = tokio::time::sleep(SLOW_ROUND) => { self.topics_ok().await; }
                }
            };
            let mut first_error = None;
            let mut producer_state_lost = false;
            let now = now_ms();
            let mut acked = Vec::with_capacity(meta.len());
            for ((seq, appended_ms, kind), res) in meta.into_iter().zip(results) {
                match res {
                    Ok(Ok(_)) => {
                        acked.push(seq);
                        self.metrics
                            .delivered
                            .with_label_values(&[kind.as_str()])
                            .inc();
                        self.metrics
                            .latency
                            .observe(now.saturating_sub(appended_ms) as f64 / 1000.0);
                    }
                    Ok(Err((e, _))) => {
                        self.metrics.failures.inc();
                        producer_state_lost |= matches!(
                            e.rdkafka_error_code(),
                            Some(
                                RDKafkaErrorCode::UnknownProducerId
                                    | RDKafkaErrorCode::OutOfOrderSequenceNumber
                                    | RDKafkaErrorCode::InvalidProducerEpoch
                                    | RDKafkaErrorCode::InvalidProducerIdMapping
                            )
                        );
                        first_error.get_or_insert(e.to_string());
                    }
                    Err(_canceled) => {
                        self.metrics.failures.inc();
                        first_error.get_or_insert("producer dropped the message".into());
                    }
                }
            }
            if let Err(e) = self.outbox.ack_batch(&acked) {
                tracing::error!(target: "quantmesh::kafka", error = %e, events = acked.len(), "removing delivered records (they will be sent again)");
            }
            self.gauges();
            match first_error {
                None => {
                    self.metrics.broker_up.set(1);
                    if failing {
                        tracing::info!(target: "quantmesh::kafka", depth = self.outbox.depth(), "deliveries succeed again");
                    }
                    failing = false;
                    failed_rounds = 0;
                    backoff = BACKOFF_MIN;
                    producer = Some(p);
                }
                Some(err) => {
                    if !failing {
                        tracing::warn!(target: "quantmesh::kafka", error = %err, depth = self.outbox.depth(), "deliveries failing: events kept in the outbox and retried");
                    }
                    failing = true;
                    failed_rounds += 1;
                    let reachable = self.topics_ok().await;
                    // A new producer (new idempotent producer id) when the old one cannot
                    // recover: a fatal error, the broker forgot our producer id (restarted
                    // without its state), or deliveries keep failing although the broker
                    // answers. Nothing is lost: the outbox still holds every record.
                    let fatal = p.client().fatal_error();
                    if fatal.is_some() || producer_state_lost || (reachable && failed_rounds >= 2) {
                        tracing::warn!(target: "quantmesh::kafka", fatal = ?fatal, producer_state_lost, failed_rounds, "creating a new producer");
                        self.metrics.producer_restarts.inc();
                        failed_rounds = 0;
                    } else {
                        producer = Some(p);
                    }
                    self.pause(backoff).await;
                    backoff = (backoff * 2).min(BACKOFF_MAX);
                }
            }
        }
        if let Some(p) = producer {
            let _ = p.flush(Timeout::After(Duration::from_secs(1)));
        }
        self.gauges();
        let left = self.outbox.depth();
        if left > 0 {
            tracing::warn!(target: "quantmesh::kafka", events = left, "relay stopped with events in the outbox: they are sent at the next start");
        } else {
            tracing::info!(target: "quantmesh::kafka", "relay stopped: outbox empty");
        }
    }
}
