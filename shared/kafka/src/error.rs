//! Why the event path could not start or carry on.

/// Why the event path could not start or carry on.
#[derive(Debug, thiserror::Error)]
pub enum KafkaError {
    #[error("invalid kafka settings: {0}")]
    Settings(String),
    #[error("{0}")]
    Client(String),
    #[error("Kafka broker unreachable: {0}")]
    Unreachable(String),
    #[error("Kafka topic: {0}")]
    Topic(String),
    #[error(transparent)]
    Outbox(#[from] quantmesh_outbox::OutboxError),
    #[error("{0}")]
    Io(#[from] std::io::Error),
}
