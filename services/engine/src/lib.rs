//! quantmesh inference engine.
//!
//! A real Llama-family forward pass on CPU (candle tensors) whose linear groups can hold
//! an INT8 and an exact float form at once and switch per layer, token, request or batch
//! at every step; a paged KV cache with per-layer INT8/float precision; and continuous
//! batching, all behind actix actors:
//!
//! ```text
//!  Engine handle ──Encode/ApplyChatTemplate──▶ TokenizerActor (2 sync threads)
//!       │
//!       └──Submit/Cancel/Drain──▶ SchedulerActor ──Execute(step)──▶ ExecutorActor (1 thread)
//!                                  (queue, BlockManager)              (LlamaModel, KvCache, mask)
//! ```
//!
//! The backend boundary is [`model::LlamaModel::forward`] over a [`model::StepInput`]: a
//! CUDA or Ascend backend implements the same step contract.

pub mod actors;
pub mod block_manager;
pub mod bundled;
pub mod checkpoint;
pub mod config;
pub mod engine;
pub mod error;
pub mod events;
pub mod gguf;
pub mod kv_cache;
pub mod linear;
pub mod mask;
pub mod messages;
pub mod model;
pub mod monitor;
pub mod plan;
pub mod reload;
pub mod sampling;
pub mod scheduler;
pub mod stats;
pub mod tokenizer;

pub use config::{EngineConfig, KvFloatDtype, ModelConfig};
pub use engine::{Engine, Generation, GenerationEvent, ModelInfo};
pub use error::EngineError;
pub use mask::{MaskHandle, PathMask};
pub use stats::EngineStats;
pub use tokenizer::ChatMessage;
