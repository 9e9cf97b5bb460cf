//! The engine's configuration as data: cache geometry, batching limits, the default
//! precision plan, the forms weights and the KV cache are stored in, and the activation
//! monitor's parameters. Defaults and range checks live here; what the values do lives in
//! the engine. Every role's settings (`quantmesh-settings`) embed it without depending on
//! the engine.

mod engine;
mod forms;
mod kv;
pub mod monitor;

pub use engine::{ConfigError, EngineConfig, DEFAULT_ROTATION_BLOCK};
pub use forms::{EmbeddingDtype, FloatDtype, Forms, SplitActivations};
pub use kv::{KvFloatDtype, KvScale};
pub use monitor::{GroupOverride, MonitorConfig, ShadowReference};
