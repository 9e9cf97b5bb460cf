//! quantmesh's model: everything about a Llama-family checkpoint that does not depend on
//! how it is served. Both the engine (serving) and the pre-screen (offline scoring) build
//! on it; neither reaches into the other.
//!
//! * [`checkpoint`] — memory-mapped safetensors (single or sharded) and GGUF files behind
//!   one reader, every tensor under its Hugging Face name ([`names`]); exact float forms;
//!   errors that name the file and the tensor.
//! * [`gguf`] — GGUF headers, metadata → [`ModelConfig`], vocabulary → tokenizer.
//! * [`config`] — [`ModelConfig`] (`config.json` or GGUF metadata).
//! * [`files`] — [`ModelFiles`]: a model on disk recognised once (a GGUF header is parsed
//!   once per load and shared by the configuration, tokenizer and checkpoint).
//! * [`tokenizer`] — [`TextTokenizer`]: encode, decode, chat templates.
//! * [`ops`] — the layer's operations (RMSNorm, RoPE, SwiGLU, reference attention, KL) and
//!   [`ops::GroupWeights`], a fused linear group's exact float weights.
//! * [`massive`] — the massive-activation rule (channels far above the row's median), shared
//!   by the monitor's warm-up and the pre-screen.
//! * [`bundled`] — the deterministic synthetic checkpoint generator (`quantmesh model init`)
//!   and the planted-truth recipes of the monitor's evaluation suite.

pub mod bundled;
pub mod checkpoint;
pub mod config;
pub mod error;
pub mod files;
pub mod gguf;
pub mod massive;
pub mod names;
pub mod ops;
pub mod recipe;
pub mod tokenizer;

pub use checkpoint::Checkpoint;
pub use config::{EosIds, ModelConfig};
pub use error::ModelError;
pub use files::ModelFiles;
pub use tokenizer::{ChatMessage, IncrementalDecoder, TextTokenizer};

use quantmesh_types::ModelShape;

/// The facts `sensitive_layers.json` is validated against.
pub fn model_shape(ck: &Checkpoint, cfg: &ModelConfig) -> error::Result<ModelShape> {
    Ok(ModelShape {
        num_layers: cfg.num_hidden_layers,
        hidden_size: cfg.hidden_size,
        intermediate_size: cfg.intermediate_size,
        attn_dim: cfg.num_attention_heads * cfg.head_dim(),
        layout_md5: ck.layout_md5()?,
    })
}
