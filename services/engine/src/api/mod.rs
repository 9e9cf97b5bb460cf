//! The engine's API: the only surface the gateway (and a remote-engine client later)
//! uses. [`Engine`] is a cheap handle to the running actors; requests go in as
//! [`GenerateRequest`]s (validated here, in one place) and come back as [`Generation`]
//! streams.
//!
//! - `load.rs`: the model, tokenizer and plan read from disk ([`load_parts`]);
//! - `wiring.rs`: the actors started with the handles they share ([`Engine::start`]);
//! - `submit.rs`: a request checked, tokenized and queued ([`Engine::submit`]);
//! - `generation.rs`: the stream of one answer ([`Generation`]);
//! - `handle.rs`: the handle itself and its queries and admin operations;
//! - here: the names other crates use, re-exported.

mod generation;
mod handle;
mod load;
mod submit;
mod wiring;

pub use crate::backend::cpu::leave_the_cores_to_the_kernel_pool;
pub use crate::backend::{EmbeddingDtype, FloatDtype, Forms, SplitActivations, WeightBytes};
pub use crate::budget::FloatBudget;
pub use crate::config::EngineConfig;
pub use crate::error::{EngineError, ModelError};
pub use crate::events::EventSink;
pub use crate::kv::{KvFloatDtype, KvScale};
pub use crate::metrics::EngineMetrics as Metrics;
pub use crate::monitor::{
    Decision, DecisionCount, ForceMode, GroupMode, GroupReport, MonitorConfig, MonitorReport,
};
pub use crate::precision::PathMask;
pub use crate::reload::{ConfigStatus, ReloadOutcome};
pub use crate::request::{GenerateRequest, Prompt};
pub use crate::stats::EngineStats;
pub use crate::trace::{TraceHook, TARGET as TRACE_TARGET};
pub use generation::{Generation, GenerationEvent, LogprobsText};
pub use handle::{plan_source_is_empty, Engine, EngineStart, ModelInfo, MAX_N};
pub use load::{load_parts, LoadedParts};
pub use quantmesh_model::{ChatMessage, ModelConfig};
