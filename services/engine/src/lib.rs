//! quantmesh inference engine.
//!
//! A Llama-family forward pass whose linear groups can hold an INT8 and an exact float form
//! at once and switch per layer, token, request or batch at every step; a paged KV cache
//! with per-layer INT8/float precision; continuous batching; an activation monitor that
//! decides the fallbacks; hot reload of the precision plan — all behind actix actors.
//!
//! Folders by capability (see ARCHITECTURE.md for the map):
//!
//! * [`api`] — the [`Engine`] handle, requests, generations, status types: the only module
//!   the gateway imports.
//! * [`backend`] — the [`backend::Backend`] seam (one step's forward pass, asking a
//!   [`backend::Router`] for every group's rows) and its CPU implementation.
//! * [`precision`] — the fallback mask, routing, activation probes, the step policy.
//! * [`monitor`] — the decision core, its parameters, its actor (the mask's one writer).
//! * [`kv`] — page metadata and page bytes.
//! * [`sched`] — the scheduler, sampling, the scheduler actor.
//! * [`executor`], [`tokenize`] — the executor and tokenizer actors. Each actor's module
//!   defines the messages it handles. [`faults`] — the test-only panic hook.
//! * [`request`] — prompts and generation requests.
//! * [`reload`] — the config actor (hot reload); [`plan`] — the live plan; [`budget`] —
//!   the memory budget for float copies.
//! * [`metrics`] — the engine's Prometheus series, updated where things happen.
//! * [`trace`] — request traces with `tracing` alone (phase spans, event `traceparent`s);
//!   the caller owns the OpenTelemetry exporter.

pub mod api;
pub mod backend;
pub mod budget;
pub mod config;
pub mod error;
pub mod events;
pub mod executor;
pub mod faults;
pub mod kv;
pub mod metrics;
pub mod monitor;
pub mod plan;
pub mod precision;
pub mod reload;
pub mod request;
pub mod sched;
pub mod stats;
pub mod tokenize;
pub mod trace;

pub use api::{
    Engine, EngineStart, GenerateRequest, Generation, GenerationEvent, ModelInfo, Prompt,
};
pub use config::EngineConfig;
pub use error::EngineError;
