//! Forms weights are stored in that both the configuration and the precision plan name.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// The Hadamard block the quantized path rotates activations by unless `rotation_block`
/// says otherwise: on SmolLM2's first-load plan, three held-out texts, it halved plain
/// W8A8's mean KL to the float model, and cut `all`'s by 12–20 % and `copyless`'s by 7–13 %
/// (docs/MEASUREMENTS.md, "Activation width and rotation"); 32 did about as well.
pub const DEFAULT_ROTATION_BLOCK: u32 = 128;

/// How the vocabulary tables (token embedding, `lm_head`) are stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum EmbeddingDtype {
    /// 8 bits with a scale per 32 values (llama.cpp's usual output format).
    #[default]
    #[serde(rename = "q8_0")]
    Q8_0,
    /// 4 bits: 16 levels `d · q + m` per 32 values, the form `w4a16` groups are served in
    /// (about 4.6 bits per value). What a weight budget picks when the tables' bytes are
    /// worth more to the linear groups.
    #[serde(rename = "q4_s8")]
    Q4S8,
    F16,
    F32,
    /// A setting, not a form (`engine.embeddings`, the default): f16 when the tables' bytes
    /// beyond Q8_0 fit in the float budget (they are served first), else Q8_0. The plan
    /// resolves it (`plan::resolve`) before anything is loaded.
    Auto,
}

impl EmbeddingDtype {
    pub fn as_str(self) -> &'static str {
        match self {
            EmbeddingDtype::Q8_0 => "q8_0",
            EmbeddingDtype::Q4S8 => "q4_s8",
            EmbeddingDtype::F16 => "f16",
            EmbeddingDtype::F32 => "f32",
            EmbeddingDtype::Auto => "auto",
        }
    }
}

impl std::str::FromStr for EmbeddingDtype {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "q8_0" => Ok(EmbeddingDtype::Q8_0),
            "q4_s8" => Ok(EmbeddingDtype::Q4S8),
            "f16" => Ok(EmbeddingDtype::F16),
            "f32" => Ok(EmbeddingDtype::F32),
            "auto" => Ok(EmbeddingDtype::Auto),
            other => Err(format!("{other:?} is not auto, q8_0, q4_s8, f16 or f32")),
        }
    }
}
