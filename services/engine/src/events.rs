//! Where fallback events go. [`EventSink`] (defined in `quantmesh-types` so transports need
//! not depend on the engine) is the seam: the engine always publishes to the structured log
//! and an in-process broadcast; callers add more sinks at start (the gateway adds the Kafka
//! outbox sink of `quantmesh-kafka` when brokers are configured).

pub use quantmesh_types::EventSink;
use quantmesh_types::{ConfigAction, ConfigEvent, FallbackEvent, Granularity, WindowEvent};
use tokio::sync::broadcast;

/// Every event as one structured log line (target `quantmesh::fallback`).
pub struct LogSink;

impl EventSink for LogSink {
    fn publish_config(&self, ev: &ConfigEvent) {
        let json = serde_json::to_string(ev).unwrap_or_default();
        match ev.action {
            ConfigAction::Applied => {
                tracing::info!(target: "quantmesh::config", md5 = %ev.md5, source = %ev.source, event = %json, "config event")
            }
            ConfigAction::Rejected | ConfigAction::Failed => {
                tracing::error!(target: "quantmesh::config", md5 = %ev.md5, source = %ev.source, error = ?ev.error, event = %json, "config event")
            }
        }
    }

    fn publish(&self, ev: &FallbackEvent) {
        let json = serde_json::to_string(ev).unwrap_or_default();
        // Per-token decisions can be many per second: debug level; the rest at info.
        if ev.granularity == Granularity::Token {
            tracing::debug!(target: "quantmesh::fallback", group = ?ev.group, granularity = ?ev.granularity, action = ?ev.action, reason = ?ev.reason, event = %json, "fallback event");
        } else {
            tracing::info!(target: "quantmesh::fallback", group = ?ev.group, granularity = ?ev.granularity, action = ?ev.action, reason = ?ev.reason, event = %json, "fallback event");
        }
    }

    fn publish_window(&self, ev: &WindowEvent) {
        let in_float = ev.groups.iter().filter(|g| g.in_float).count();
        tracing::debug!(target: "quantmesh::fallback", window = ev.window, groups_in_float = in_float, shadow_kl_samples = ev.shadow_kl_seen, "monitor window closed");
    }
}

/// In-process fan-out to subscribers. Bounded: a subscriber that falls more than the
/// capacity behind loses the oldest events (and is told so by `RecvError::Lagged`).
#[derive(Clone)]
pub struct ChannelSink {
    tx: broadcast::Sender<FallbackEvent>,
    config_tx: broadcast::Sender<ConfigEvent>,
    window_tx: broadcast::Sender<WindowEvent>,
}

impl ChannelSink {
    pub fn new(capacity: usize) -> Self {
        Self {
            tx: broadcast::channel(capacity.max(1)).0,
            config_tx: broadcast::channel(64).0,
            window_tx: broadcast::channel(64).0,
        }
    }

    pub fn subscribe_windows(&self) -> broadcast::Receiver<WindowEvent> {
        self.window_tx.subscribe()
    }

    pub fn subscribe(&self) -> broadcast::Receiver<FallbackEvent> {
        self.tx.subscribe()
    }

    pub fn subscribe_config(&self) -> broadcast::Receiver<ConfigEvent> {
        self.config_tx.subscribe()
    }
}

impl EventSink for ChannelSink {
    fn publish(&self, ev: &FallbackEvent) {
        // No subscriber is not an error.
        let _ = self.tx.send(ev.clone());
    }

    fn publish_config(&self, ev: &ConfigEvent) {
        let _ = self.config_tx.send(ev.clone());
    }

    fn publish_window(&self, ev: &WindowEvent) {
        let _ = self.window_tx.send(ev.clone());
    }
}
