//! `[kafka]` configuration (file section; `QUANTMESH_KAFKA_*` environment and `--kafka-*`
//! flags are applied by the gateway's settings loader).

use quantmesh_outbox::FullPolicy;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

/// Default topic of fallback events.
pub const DEFAULT_TOPIC: &str = "quantmesh.fallback-events.v1";
/// Default topic of configuration events.
pub const DEFAULT_CONFIG_TOPIC: &str = "quantmesh.config-events.v1";
/// Default topic of monitor windows (sampled evidence for the evolution job).
pub const DEFAULT_WINDOW_TOPIC: &str = "quantmesh.monitor-windows.v1";

#[derive(Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct KafkaSettings {
    /// Bootstrap brokers, `HOST:PORT[,HOST:PORT…]`. Empty: events go to the log and the
    /// in-process stream only (no outbox, no relay).
    pub brokers: String,
    /// Topic of fallback events (payload: `shared/schemas/fallback_event.v1.schema.json`).
    pub topic: String,
    /// Topic of configuration events (payload: `config_event.v1.schema.json`).
    pub config_topic: String,
    /// Topic of monitor windows (payload: `window_event.v1.schema.json`): one event per
    /// monitor window with per-group outlier counts and sampled shadow KL.
    pub window_topic: String,
    /// Create missing topics with these settings (at start and whenever the broker says a
    /// topic is unknown).
    pub create_topics: bool,
    pub partitions: i32,
    pub replication_factor: i32,
    /// Refuse to start when no broker answers within `connect_timeout`. Otherwise serve and
    /// keep events in the outbox until a broker is reachable.
    pub required: bool,
    #[serde(with = "humantime_serde")]
    pub connect_timeout: Duration,
    /// Directory of the durable outbox (sled). One engine process per directory.
    pub outbox_dir: PathBuf,
    /// Bound on the stored payload bytes; what happens beyond is `full_policy`.
    pub outbox_max_bytes: u64,
    /// `drop_newest` (default: keep the onset of an incident) or `drop_oldest`.
    pub full_policy: FullPolicy,
    /// Space left free on the outbox's filesystem: below it new events are refused and
    /// counted (`reason="disk_full"`) instead of filling the disk (the store would not
    /// reopen from a full one).
    pub outbox_min_free_bytes: u64,
    /// Events waiting between the engine and the outbox writer (memory); beyond, events are
    /// dropped and counted (`reason="queue_full"`) rather than blocking the engine.
    pub queue_capacity: usize,
    /// Records the relay hands to the producer per round.
    pub batch_size: usize,
    /// How long one delivery attempt may take (librdkafka `message.timeout.ms`) before the
    /// record is retried from the outbox.
    #[serde(with = "humantime_serde")]
    pub delivery_timeout: Duration,
    /// `none`, `gzip`, `snappy`, `lz4` or `zstd`.
    pub compression: String,
    pub client_id: String,
    /// On shutdown, keep relaying for at most this long; the rest stays in the outbox.
    #[serde(with = "humantime_serde")]
    pub shutdown_timeout: Duration,
    /// Extra librdkafka properties (e.g. `security.protocol`, `sasl.mechanism`); they win
    /// over the built-in ones.
    pub properties: BTreeMap<String, String>,
}

/// Whether a librdkafka property may hold a secret (its value is never printed).
pub fn is_secret_property(key: &str) -> bool {
    let k = key.to_ascii_lowercase();
    [
        "password",
        "secret",
        "jaas",
        "token",
        "key",
        "credential",
        "bearer",
    ]
    .iter()
    .any(|w| k.contains(w))
}

/// By hand: the values of properties that may hold secrets (SASL passwords, keys, tokens)
/// print as `<redacted>`.
impl std::fmt::Debug for KafkaSettings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let properties: BTreeMap<&str, &str> = self
            .properties
            .iter()
            .map(|(k, v)| {
                let shown = if is_secret_property(k) {
                    "<redacted>"
                } else {
                    v.as_str()
                };
                (k.as_str(), shown)
            })
            .collect();
        f.debug_struct("KafkaSettings")
            .field("brokers", &self.brokers)
            .field("topic", &self.topic)
            .field("config_topic", &self.config_topic)
            .field("window_topic", &self.window_topic)
            .field("create_topics", &self.create_topics)
            .field("partitions", &self.partitions)
            .field("replication_factor", &self.replication_factor)
            .field("required", &self.required)
            .field("connect_timeout", &self.connect_timeout)
            .field("outbox_dir", &self.outbox_dir)
            .field("outbox_max_bytes", &self.outbox_max_bytes)
            .field("full_policy", &self.full_policy)
            .field("outbox_min_free_bytes", &self.outbox_min_free_bytes)
            .field("queue_capacity", &self.queue_capacity)
            .field("batch_size", &self.batch_size)
            .field("delivery_timeout", &self.delivery_timeout)
            .field("compression", &self.compression)
            .field("client_id", &self.client_id)
            .field("shutdown_timeout", &self.shutdown_timeout)
            .field("properties", &properties)
            .finish()
    }
}

impl Default for KafkaSettings {
    fn default() -> Self {
        Self {
            brokers: String::new(),
            topic: DEFAULT_TOPIC.into(),
            config_topic: DEFAULT_CONFIG_TOPIC.into(),
            window_topic: DEFAULT_WINDOW_TOPIC.into(),
            create_topics: true,
            partitions: 6,
            replication_factor: 1,
            required: false,
            connect_timeout: Duration::from_secs(10),
            outbox_dir: PathBuf::from("data/outbox"),
            outbox_max_bytes: 256 << 20,
            full_policy: FullPolicy::DropNewest,
            outbox_min_free_bytes: quantmesh_outbox::DEFAULT_MIN_FREE_BYTES,
            queue_capacity: 65_536,
            batch_size: 10_000,
            delivery_timeout: Duration::from_secs(30),
            compression: "lz4".into(),
            client_id: "quantmesh".into(),
            shutdown_timeout: Duration::from_secs(5),
            properties: BTreeMap::new(),
        }
    }
}

impl KafkaSettings {
    pub fn enabled(&self) -> bool {
        !self.brokers.trim().is_empty()
    }

    /// The event topics: fallback, config, window.
    pub fn topics(&self) -> [&str; 3] {
        [
            self.topic.as_str(),
            self.config_topic.as_str(),
            self.window_topic.as_str(),
        ]
    }

    /// Check the values that librdkafka would otherwise reject later and less clearly.
    pub fn validate(&self) -> Result<(), String> {
        if !self.enabled() {
            return Ok(());
        }
        for b in self.brokers.split(',').map(str::trim) {
            let ok = b
                .rsplit_once(':')
                .is_some_and(|(h, p)| !h.is_empty() && p.parse::<u16>().is_ok());
            if !ok {
                return Err(format!(
                    "kafka.brokers: {b:?} is not HOST:PORT (list: HOST:PORT[,HOST:PORT…])"
                ));
            }
        }
        let topics = self.topics();
        if topics.iter().any(|t| t.is_empty()) {
            return Err(
                "kafka.topic, kafka.config_topic and kafka.window_topic must not be empty".into(),
            );
        }
        if topics[0] == topics[1] || topics[0] == topics[2] || topics[1] == topics[2] {
            return Err("kafka.topic, kafka.config_topic and kafka.window_topic must differ (one schema per topic)".into());
        }
        if self.partitions < 1 || self.replication_factor < 1 {
            return Err("kafka.partitions and kafka.replication_factor must be ≥ 1".into());
        }
        if !["none", "gzip", "snappy", "lz4", "zstd"].contains(&self.compression.as_str()) {
            return Err(format!(
                "kafka.compression: {:?} is not none, gzip, snappy, lz4 or zstd",
                self.compression
            ));
        }
        if self.outbox_max_bytes < 4096 {
            return Err("kafka.outbox_max_bytes must be at least 4096".into());
        }
        if self.queue_capacity == 0 || self.batch_size == 0 {
            return Err("kafka.queue_capacity and kafka.batch_size must be ≥ 1".into());
        }
        if self.delivery_timeout < Duration::from_millis(100) {
            return Err("kafka.delivery_timeout must be at least 100ms".into());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn defaults_are_valid_and_disabled() {
        let s = KafkaSettings::default();
        assert!(!s.enabled());
        s.validate().unwrap();
        let s = KafkaSettings {
            brokers: "127.0.0.1:9092, kafka-2:9092".into(),
            ..Default::default()
        };
        s.validate().unwrap();
    }

    #[test]
    fn bad_values_are_named() {
        let bad = |f: fn(&mut KafkaSettings), want: &str| {
            let mut s = KafkaSettings {
                brokers: "h:1".into(),
                ..Default::default()
            };
            f(&mut s);
            let e = s.validate().unwrap_err();
            assert!(e.contains(want), "{e}");
        };
        bad(|s| s.brokers = "localhost".into(), "HOST:PORT");
        bad(|s| s.brokers = "h:99999".into(), "HOST:PORT");
        bad(|s| s.config_topic = s.topic.clone(), "must differ");
        bad(|s| s.window_topic = s.config_topic.clone(), "must differ");
        bad(|s| s.partitions = 0, "partitions");
        bad(|s| s.compression = "brotli".into(), "compression");
        bad(|s| s.outbox_max_bytes = 10, "outbox_max_bytes");
    }
}
