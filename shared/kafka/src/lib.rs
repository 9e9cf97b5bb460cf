//! quantmesh's Kafka event path.
//!
//! ```text
//!  engine (monitor / config actors)
//!     │ EventSink::publish — serialise + try_send, never blocks
//!     ▼
//!  KafkaSink ──bounded queue──▶ outbox writer thread ──append + fsync per batch──▶ sled outbox
//!                                                                                   │ peek
//!                                     Kafka ◀── idempotent producer (acks=all) ◀── relay thread
//!                                               delivery report ok ──▶ ack (remove) ┘
//! ```
//!
//! At-least-once: a record leaves the outbox only after the broker acknowledged it; after a
//! crash or an outage everything not acknowledged is sent again, so consumers deduplicate on
//! `event_id`. Bounded: `outbox_max_bytes` with `full_policy`, and a bounded queue before the
//! writer; every drop is counted in `quantmesh_events_dropped_total{reason}`.

pub mod client;
mod error;
pub mod metrics;
mod pipeline;
mod relay;
pub mod settings;
pub mod sink;
pub mod tail;

pub use error::KafkaError;
pub use metrics::{DropReason, KafkaMetrics};
pub use pipeline::EventPipeline;
pub use settings::{KafkaSettings, DEFAULT_CONFIG_TOPIC, DEFAULT_TOPIC};
pub use sink::{EventType, KafkaSink};
