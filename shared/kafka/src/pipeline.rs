//! The running event path: outbox, writer thread, relay thread.

use crate::{client, relay, sink, KafkaError, KafkaMetrics, KafkaSettings, KafkaSink};
use quantmesh_outbox::Outbox;
use quantmesh_types::EventSink;
use std::sync::Arc;
use std::thread::JoinHandle;
use tokio::sync::{watch, Notify};

/// The running event path: outbox, writer thread, relay thread.
pub struct EventPipeline {
    sink: Arc<KafkaSink>,
    tx: std::sync::mpsc::SyncSender<sink::WriterMsg>,
    outbox: Arc<Outbox>,
    metrics: KafkaMetrics,
    stop: watch::Sender<bool>,
    writer: Option<JoinHandle<()>>,
    relay: Option<JoinHandle<()>>,
}

impl EventPipeline {
    /// Open the outbox, check the broker (creating missing topics), start the writer and the
    /// relay. With `required = true` an unreachable broker is an error; otherwise it is
    /// logged and events wait in the outbox.
    pub async fn start(settings: KafkaSettings, metrics: KafkaMetrics) -> Result<Self, KafkaError> {
        settings.validate().map_err(KafkaError::Settings)?;
        std::fs::create_dir_all(&settings.outbox_dir).map_err(|e| {
            KafkaError::Client(format!(
                "creating the outbox directory {}: {e}",
                settings.outbox_dir.display()
            ))
        })?;
        let outbox = Arc::new(
            Outbox::open(
                &settings.outbox_dir,
                settings.outbox_max_bytes,
                settings.full_policy,
            )?
            .with_min_free_bytes(settings.outbox_min_free_bytes),
        );
        metrics
            .outbox_max_bytes
            .set(settings.outbox_max_bytes as i64);
        metrics.outbox_depth.set(outbox.depth() as i64);
        metrics.outbox_bytes.set(outbox.bytes() as i64);
        if outbox.depth() > 0 {
            tracing::info!(target: "quantmesh::kafka", events = outbox.depth(), bytes = outbox.bytes(), dir = %settings.outbox_dir.display(), "events from an earlier run are waiting in the outbox: relaying them");
        }
        let admin = client::admin(&settings)?;
        match client::ensure_topics(&settings, &admin, Some(&metrics), settings.connect_timeout)
            .await
        {
            Ok(_) => {
                tracing::info!(target: "quantmesh::kafka", brokers = %settings.brokers, topic = %settings.topic, config_topic = %settings.config_topic, "Kafka event path ready")
            }
            Err(e) if settings.required => {
                return Err(KafkaError::Unreachable(format!(
                    "{} ({e}); kafka.required is true, so quantmesh does not start without it",
                    settings.brokers
                )))
            }
            Err(e) => {
                metrics.broker_up.set(0);
                tracing::warn!(target: "quantmesh::kafka", brokers = %settings.brokers, error = %e, "Kafka unreachable: serving anyway, events are kept in the outbox and relayed when it is back");
            }
        }
        let (tx, rx) = std::sync::mpsc::sync_channel(settings.queue_capacity);
        let wake = Arc::new(Notify::new());
        let (stop, stop_rx) = watch::channel(false);
        let writer = {
            let (o, m, w) = (outbox.clone(), metrics.clone(), wake.clone());
            std::thread::Builder::new()
                .name("qm-outbox-writer".into())
                .spawn(move || sink::run_writer(rx, o, m, w))?
        };
        let relay = relay::Relay {
            settings,
            outbox: outbox.clone(),
            metrics: metrics.clone(),
            admin,
            wake,
            stop: stop_rx,
        };
        let relay = std::thread::Builder::new()
            .name("qm-kafka-relay".into())
            .spawn(move || relay.run())?;
        Ok(Self {
            sink: Arc::new(KafkaSink::new(tx.clone(), metrics.clone())),
            tx,
            outbox,
            metrics,
            stop,
            writer: Some(writer),
            relay: Some(relay),
        })
    }

    /// The sink to hand to the engine.
    pub fn sink(&self) -> Arc<dyn EventSink> {
        self.sink.clone()
    }

    pub fn metrics(&self) -> &KafkaMetrics {
        &self.metrics
    }

    pub fn outbox_depth(&self) -> usize {
        self.outbox.depth()
    }

    /// Stop: the writer stores what is queued (fsync), the relay keeps delivering for at
    /// most `kafka.shutdown_timeout`, the rest stays in the outbox for the next start.
    pub async fn shutdown(mut self) {
        // The writer stores everything queued before the stop, then the relay gets its
        // deadline.
        let _ = self.tx.send(sink::WriterMsg::Stop);
        if let Some(w) = self.writer.take() {
            let _ = tokio::task::spawn_blocking(move || w.join()).await;
        }
        let _ = self.stop.send(true);
        if let Some(r) = self.relay.take() {
            let _ = tokio::task::spawn_blocking(move || r.join()).await;
        }
        if let Err(e) = self.outbox.flush() {
            tracing::error!(target: "quantmesh::kafka", error = %e, "final outbox flush");
        }
    }
}
