//! `quantmesh events tail`: a consumer for people. Prints the event topic as JSON lines
//! (the payload exactly as published) or as a readable table.

use crate::client::{self, Context};
use crate::settings::KafkaSettings;
use crate::KafkaError;
use quantmesh_types::{wire_name, ConfigEvent, FallbackEvent};
use rdkafka::consumer::{Consumer, StreamConsumer};
use rdkafka::Message;
use std::io::Write;
use std::time::Duration;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum TailFormat {
    /// One JSON object per line, the payload as published.
    #[default]
    Json,
    /// Aligned columns for a terminal.
    Table,
}

#[derive(Debug, Clone)]
pub struct TailOptions {
    pub settings: KafkaSettings,
    /// Consumer group. With a group, offsets are committed (a second run continues where
    /// the first stopped). Without, an ephemeral group that commits nothing.
    pub group: Option<String>,
    /// Start at the oldest retained event instead of new ones only (for a group: only when
    /// it has no committed offset yet).
    pub from_beginning: bool,
    /// Tail the config-event topic instead of the fallback-event topic.
    pub config_events: bool,
    pub format: TailFormat,
    /// Stop after this many events.
    pub limit: Option<u64>,
    /// Stop when no event arrived for this long.
    pub idle_timeout: Option<Duration>,
}

fn ms_to_rfc3339(ms: u64) -> String {
    let t = std::time::UNIX_EPOCH + Duration::from_millis(ms);
    humantime::format_rfc3339_millis(t).to_string()
}

fn opt<T: std::fmt::Display>(v: &Option<T>) -> String {
    v.as_ref()
        .map(|x| x.to_string())
        .unwrap_or_else(|| "-".into())
}

fn opt_f(v: Option<f64>, digits: usize) -> String {
    v.map(|x| format!("{x:.digits$}"))
        .unwrap_or_else(|| "-".into())
}

pub fn table_header(config_events: bool) -> String {
    if config_events {
        format!(
            "{:<24} {:<16} {:<8} {:<32} {:<32} {}",
            "TIME", "MODEL", "ACTION", "MD5", "PREVIOUS", "SOURCE / ERROR"
        )
    } else {
        format!(
            "{:<24} {:<16} {:<18} {:<8} {:<11} {:<13} {:>7} {:>8} {:>6} {:>8} {}",
            "TIME",
            "MODEL",
            "GROUP",
            "GRAN",
            "ACTION",
            "REASON",
            "RATE",
            "KL",
            "K",
            "REQUEST",
            "TOKENS"
        )
    }
}

/// One table row for a payload; a payload that is not a valid event is shown as such.
pub fn table_row(payload: &str, config_events: bool) -> String {
    if config_events {
        match serde_json::from_str::<ConfigEvent>(payload) {
            Ok(e) => format!(
                "{:<24} {:<16} {:<8} {:<32} {:<32} {}",
                ms_to_rfc3339(e.timestamp_ms),
                e.model,
                wire_name(&e.action),
                e.md5,
                opt(&e.previous_md5),
                e.error.unwrap_or(e.source)
            ),
            Err(err) => format!("(not a config event v1: {err}) {payload}"),
        }
    } else {
        match serde_json::from_str::<FallbackEvent>(payload) {
            Ok(e) => format!(
                "{:<24} {:<16} {:<18} {:<8} {:<11} {:<13} {:>7} {:>8} {:>6} {:>8} {}",
                ms_to_rfc3339(e.timestamp_ms),
                e.model,
                e.group.as_deref().unwrap_or("-"),
                wire_name(&e.granularity),
                wire_name(&e.action),
                wire_name(&e.reason),
                opt_f(e.outlier_rate, 3),
                opt_f(e.kl, 4),
                opt_f(e.k, 2),
                opt(&e.request_id),
                if e.token_ids.is_empty() {
                    "-".to_string()
                } else {
                    format!("{:?}", e.token_ids)
                }
            ),
            Err(err) => format!("(not a fallback event v1: {err}) {payload}"),
        }
    }
}

/// Consume and print until `limit` events, `idle_timeout`, or an error. Returns the number
/// of events printed.
pub async fn tail(opts: &TailOptions, out: &mut dyn Write) -> Result<u64, KafkaError> {
    opts.settings.validate().map_err(KafkaError::Settings)?;
    let topic = if opts.config_events {
        &opts.settings.config_topic
    } else {
        &opts.settings.topic
    };
    let (group, commit) = match &opts.group {
        Some(g) => (g.clone(), true),
        None => (format!("quantmesh-tail-{}", uuid::Uuid::new_v4()), false),
    };
    let mut cfg = client::consumer_config(&opts.settings, &group, opts.from_beginning);
    cfg.set("enable.auto.commit", if commit { "true" } else { "false" });
    let consumer: StreamConsumer<Context> = cfg
        .create_with_context(Context::default())
        .map_err(|e| KafkaError::Client(format!("creating the Kafka consumer: {e}")))?;
    consumer
        .subscribe(&[topic.as_str()])
        .map_err(|e| KafkaError::Client(format!("subscribing to {topic}: {e}")))?;
    tracing::info!(target: "quantmesh::kafka", %topic, %group, from_beginning = opts.from_beginning, "tailing");
    if opts.format == TailFormat::Table {
        writeln!(out, "{}", table_header(opts.config_events))?;
    }
    let mut n = 0u64;
    while opts.limit.is_none_or(|l| n < l) {
        let msg = match opts.idle_timeout {
            Some(d) => match tokio::time::timeout(d, consumer.recv()).await {
                Ok(m) => m,
                Err(_) => break,
            },
            None => consumer.recv().await,
        };
        let msg = match msg {
            Ok(m) => m,
            Err(e) => {
                tracing::warn!(target: "quantmesh::kafka", error = %e, "consumer error");
                continue;
            }
        };
        let payload = match msg.payload_view::<str>() {
            Some(Ok(p)) => p,
            Some(Err(_)) => "(payload is not UTF-8)",
            None => "(empty payload)",
        };
        match opts.format {
            TailFormat::Json => writeln!(out, "{payload}")?,
            TailFormat::Table => writeln!(out, "{}", table_row(payload, opts.config_events))?,
        }
        out.flush()?;
        n += 1;
    }
    if commit {
        let _ = consumer.commit_consumer_state(rdkafka::consumer::CommitMode::Sync);
    }
    Ok(n)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn table_rows_show_the_fields_and_flag_foreign_payloads() {
        let ev = serde_json::json!({
            "schema_version": 1, "event_id": "x", "timestamp_ms": 0, "model": "tiny",
            "group": "layers.1.down", "granularity": "layer", "action": "enter",
            "reason": "outlier_rate", "outlier_rate": 0.25, "mean": 1.0, "sigma": 0.5,
            "k": 4.0, "kl": null, "token_ids": [], "positions": [], "request_id": null,
            "config_md5": null
        });
        let row = table_row(&ev.to_string(), false);
        assert!(row.starts_with("1970-01-01T00:00:00.000Z"), "{row}");
        for want in [
            "tiny",
            "layers.1.down",
            "layer",
            "enter",
            "outlier_rate",
            "0.250",
            "4.00",
        ] {
            assert!(row.contains(want), "{want} missing from {row}");
        }
        assert!(table_row("{\"a\":1}", false).starts_with("(not a fallback event v1"));
        assert!(table_header(false).contains("GROUP"));
    }
}
