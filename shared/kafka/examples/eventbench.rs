//! Event-path throughput against a real broker: publishes N fallback events through the
//! `KafkaSink` the engine uses (serialise → writer queue → sled outbox with group-committed
//! fsync → relay → idempotent producer → broker ack → outbox removal) and, as the baseline
//! in the same run, the same payloads through a bare rdkafka producer (no outbox).
//!
//! ```text
//! cargo run --release -p quantmesh-kafka --example eventbench -- 127.0.0.1:9092 200000 [batch_size]
//! ```

use quantmesh_kafka::{EventPipeline, KafkaMetrics, KafkaSettings};
use quantmesh_types::{FallbackAction, FallbackEvent, FallbackReason, Granularity};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::ClientConfig;
use std::time::{Duration, Instant};

fn event(i: u64) -> FallbackEvent {
    FallbackEvent {
        schema_version: 1,
        event_id: uuid::Uuid::new_v4().to_string(),
        timestamp_ms: quantmesh_types::now_ms(),
        model: "bench".into(),
        group: Some(format!("layers.{}.down", i % 32)),
        granularity: Granularity::Token,
        action: FallbackAction::Enter,
        reason: FallbackReason::ExtremeToken,
        outlier_rate: Some(0.02),
        mean: Some(1.5),
        sigma: Some(0.25),
        k: Some(16.0),
        kl: None,
        kl_reference: None,
        token_ids: vec![(i % 32000) as u32],
        positions: vec![(i % 2048) as usize],
        request_id: Some(i / 64),
        config_md5: None,
        traceparent: None,
    }
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> anyhow::Result<()> {
    let mut args = std::env::args().skip(1);
    let brokers = args.next().unwrap_or_else(|| "127.0.0.1:9092".into());
    let n: u64 = args
        .next()
        .map(|s| s.parse())
        .transpose()?
        .unwrap_or(100_000);
    let batch: usize = args
        .next()
        .map(|s| s.parse())
        .transpose()?
        .unwrap_or(KafkaSettings::default().batch_size);
    let dir = tempfile::tempdir()?;
    let settings = KafkaSettings {
        brokers: brokers.clone(),
        topic: format!("bench.fallback.{}", std::process::id()),
        config_topic: format!("bench.config.{}", std::process::id()),
        outbox_dir: dir.path().join("outbox"),
        outbox_max_bytes: 4 << 30,
        queue_capacity: n as usize + 1,
        batch_size: batch,
        ..Default::default()
    };
    let events: Vec<FallbackEvent> = (0..n).map(event).collect();
    let bytes: usize = events
        .iter()
        .map(|e| serde_json::to_string(e).map(|s| s.len()).unwrap_or(0))
        .sum();

    // Baseline: a bare idempotent producer, same payloads, same broker, no outbox.
    let raw: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", &brokers)
        .set("enable.idempotence", "true")
        .set("acks", "all")
        .set("compression.type", "lz4")
        .set("linger.ms", "5")
        .set("queue.buffering.max.messages", "1000000")
        .create()?;
    let topic = format!("bench.raw.{}", std::process::id());
    let t0 = Instant::now();
    let mut futs = Vec::with_capacity(events.len());
    for e in &events {
        let payload = serde_json::to_string(e)?;
        let key = format!("{}/{}", e.model, e.group.as_deref().unwrap_or("-"));
        let fut = raw
            .send_result(FutureRecord::to(&topic).key(&key).payload(&payload))
            .map_err(|(e, _)| e)?;
        futs.push(fut);
    }
    let ok = futures::future::join_all(futs)
        .await
        .into_iter()
        .filter(|r| matches!(r, Ok(Ok(_))))
        .count();
    let raw_s = t0.elapsed().as_secs_f64();

    // The engine's path.
    let metrics = KafkaMetrics::new();
    let pipeline = EventPipeline::start(settings, metrics.clone()).await?;
    let sink = pipeline.sink();
    let t0 = Instant::now();
    for e in &events {
        sink.publish(e);
    }
    let publish_s = t0.elapsed().as_secs_f64();
    let mut recorded_s = None;
    loop {
        let rec = metrics.recorded.with_label_values(&["fallback"]).get();
        if recorded_s.is_none() && rec >= n {
            recorded_s = Some(t0.elapsed().as_secs_f64());
        }
        if metrics.delivered.with_label_values(&["fallback"]).get() >= n {
            break;
        }
        let dropped: u64 = ["outbox_full", "queue_full", "storage_error"]
            .iter()
            .map(|r| metrics.dropped.with_label_values(&[r]).get())
            .sum();
        anyhow::ensure!(dropped == 0, "{dropped} events dropped");
        anyhow::ensure!(
            t0.elapsed() < Duration::from_secs(600),
            "not delivered in 10 min"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let total_s = t0.elapsed().as_secs_f64();
    let lat = metrics.latency.get_sample_sum() / metrics.latency.get_sample_count() as f64;
    pipeline.shutdown().await;

    println!(
        "{n} events, {:.0} B JSON each (mean), broker {brokers}",
        bytes as f64 / n as f64
    );
    println!("| path | events/s | seconds | note |");
    println!("|---|---|---|---|");
    println!(
        "| bare rdkafka producer (baseline, no outbox) | {:.0} | {raw_s:.2} | {ok}/{n} acked |",
        ok as f64 / raw_s
    );
    println!(
        "| KafkaSink::publish (engine-side cost) | {:.0} | {publish_s:.3} | {:.2} µs/event on the caller |",
        n as f64 / publish_s,
        publish_s * 1e6 / n as f64
    );
    println!(
        "| stored in the outbox (fsync'd) | {:.0} | {:.2} | |",
        n as f64 / recorded_s.unwrap_or(total_s),
        recorded_s.unwrap_or(total_s)
    );
    println!(
        "| delivered through the outbox (acked, removed) | {:.0} | {total_s:.2} | ratio to baseline {:.2}; mean delivery latency {:.0} ms |",
        n as f64 / total_s,
        raw_s / total_s,
        lat * 1000.0
    );
    Ok(())
}
