//! librdkafka clients (producer, admin, consumer) built from [`KafkaSettings`], with their
//! logs and errors routed to `tracing`, and topic management.

use crate::metrics::KafkaMetrics;
use crate::settings::KafkaSettings;
use crate::KafkaError;
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::ClientContext;
use rdkafka::config::{ClientConfig, RDKafkaLogLevel};
use rdkafka::consumer::ConsumerContext;
use rdkafka::error::{KafkaError as RdError, RDKafkaErrorCode};
use rdkafka::producer::FutureProducer;
use std::sync::Arc;
use std::time::Duration;

/// Routes librdkafka's logs to `tracing` (target `quantmesh::kafka`) and tracks whether
/// any broker is reachable.
#[derive(Clone, Default)]
pub struct Context {
    pub metrics: Option<KafkaMetrics>,
}

impl ClientContext for Context {
    fn log(&self, level: RDKafkaLogLevel, fac: &str, msg: &str) {
        use RDKafkaLogLevel::*;
        match level {
            Emerg | Alert | Critical | Error => {
                tracing::error!(target: "quantmesh::kafka", facility = fac, "{msg}")
            }
            Warning => tracing::warn!(target: "quantmesh::kafka", facility = fac, "{msg}"),
            Notice | Info => tracing::info!(target: "quantmesh::kafka", facility = fac, "{msg}"),
            Debug => tracing::debug!(target: "quantmesh::kafka", facility = fac, "{msg}"),
        }
    }

    fn error(&self, error: RdError, reason: &str) {
        if matches!(
            error.rdkafka_error_code(),
            Some(RDKafkaErrorCode::AllBrokersDown)
        ) {
            if let Some(m) = &self.metrics {
                m.broker_up.set(0);
            }
        }
        // librdkafka also logs these through `log`; the relay logs the state changes.
        tracing::debug!(target: "quantmesh::kafka", error = %error, "{reason}");
    }
}

impl ConsumerContext for Context {}

fn base_config(s: &KafkaSettings) -> ClientConfig {
    let mut c = ClientConfig::new();
    c.set("bootstrap.servers", s.brokers.trim())
        .set("client.id", &s.client_id)
        .set("reconnect.backoff.ms", "100")
        .set("reconnect.backoff.max.ms", "2000")
        .set("socket.connection.setup.timeout.ms", "5000")
        .set_log_level(RDKafkaLogLevel::Warning);
    c
}

fn with_properties(mut c: ClientConfig, s: &KafkaSettings) -> ClientConfig {
    for (k, v) in &s.properties {
        c.set(k, v);
    }
    c
}

/// The idempotent producer: `acks=all`, bounded in-flight requests (≤ 5 keeps idempotent
/// ordering), compression, `message.timeout.ms` = `delivery_timeout`.
pub fn producer(
    s: &KafkaSettings,
    metrics: &KafkaMetrics,
) -> Result<FutureProducer<Context>, KafkaError> {
    let mut c = base_config(s);
    c.set("enable.idempotence", "true")
        .set("acks", "all")
        .set("max.in.flight.requests.per.connection", "5")
        .set("compression.type", &s.compression)
        .set("linger.ms", "5")
        .set("batch.num.messages", "10000")
        .set("queue.buffering.max.messages", "200000")
        .set(
            "message.timeout.ms",
            s.delivery_timeout.as_millis().to_string(),
        );
    with_properties(c, s)
        .create_with_context(Context {
            metrics: Some(metrics.clone()),
        })
        .map_err(|e| KafkaError::Client(format!("creating the Kafka producer: {e}")))
}

pub fn admin(s: &KafkaSettings) -> Result<Arc<AdminClient<Context>>, KafkaError> {
    with_properties(base_config(s), s)
        .create_with_context(Context::default())
        .map(Arc::new)
        .map_err(|e| KafkaError::Client(format!("creating the Kafka admin client: {e}")))
}

/// A consumer config for `group` (`auto.offset.reset` = earliest when `from_beginning`).
pub fn consumer_config(s: &KafkaSettings, group: &str, from_beginning: bool) -> ClientConfig {
    let mut c = base_config(s);
    c.set("group.id", group)
        .set(
            "auto.offset.reset",
            if from_beginning { "earliest" } else { "latest" },
        )
        .set("enable.partition.eof", "false")
        .set("session.timeout.ms", "10000");
    with_properties(c, s)
}

/// Which of `topics` the cluster knows. Blocking (librdkafka metadata request): call from a
/// blocking context.
pub fn existing_topics(
    admin: &AdminClient<Context>,
    topics: &[&str],
    timeout: Duration,
) -> Result<Vec<String>, KafkaError> {
    let md = admin
        .inner()
        .fetch_metadata(None, timeout)
        .map_err(|e| KafkaError::Unreachable(e.to_string()))?;
    Ok(md
        .topics()
        .iter()
        .filter(|t| t.error().is_none() && !t.partitions().is_empty())
        .map(|t| t.name().to_string())
        .filter(|n| topics.contains(&n.as_str()))
        .collect())
}

/// Create whichever of the event topics is missing. Returns the topics it created. A broker
/// that cannot be reached within `timeout` is [`KafkaError::Unreachable`].
pub async fn ensure_topics(
    s: &KafkaSettings,
    admin: &Arc<AdminClient<Context>>,
    metrics: Option<&KafkaMetrics>,
    timeout: Duration,
) -> Result<Vec<String>, KafkaError> {
    let wanted = s.topics();
    let have = {
        let (a, w) = (admin.clone(), wanted.map(String::from));
        tokio::task::spawn_blocking(move || {
            let names: Vec<&str> = w.iter().map(String::as_str).collect();
            existing_topics(&a, &names, timeout)
        })
        .await
        .map_err(|e| KafkaError::Client(format!("metadata task: {e}")))??
    };
    if let Some(m) = metrics {
        m.broker_up.set(1);
    }
    let missing: Vec<&str> = wanted
        .iter()
        .copied()
        .filter(|t| !have.iter().any(|h| h == t))
        .collect();
    if missing.is_empty() || !s.create_topics {
        if !missing.is_empty() {
            tracing::warn!(target: "quantmesh::kafka", topics = ?missing, "topics missing and kafka.create_topics is false");
        }
        return Ok(Vec::new());
    }
    let new: Vec<NewTopic> = missing
        .iter()
        .map(|t| {
            NewTopic::new(
                t,
                s.partitions,
                TopicReplication::Fixed(s.replication_factor),
            )
        })
        .collect();
    let results = admin
        .create_topics(&new, &AdminOptions::new().operation_timeout(Some(timeout)))
        .await
        .map_err(|e| KafkaError::Unreachable(format!("creating topics: {e}")))?;
    let mut created = Vec::new();
    for r in results {
        match r {
            Ok(t) => {
                tracing::info!(target: "quantmesh::kafka", topic = %t, partitions = s.partitions, replication_factor = s.replication_factor, "created topic");
                if let Some(m) = metrics {
                    m.topics_created.with_label_values(&[t.as_str()]).inc();
                }
                created.push(t);
            }
            // Someone else (another engine) created it meanwhile: fine.
            Err((_, RDKafkaErrorCode::TopicAlreadyExists)) => {}
            Err((t, code)) => {
                return Err(KafkaError::Topic(format!("creating topic {t}: {code}")));
            }
        }
    }
    Ok(created)
}
