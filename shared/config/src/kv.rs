//! How the KV cache stores what it keeps.

use serde::{Deserialize, Serialize};

/// Precision of the float KV path. The seed's "FP16"; f32 exists for exactness tests.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum KvFloatDtype {
    F16,
    F32,
}

/// Channels of a token's K (or V) vector that share one C8 scale (`engine.kv_scale`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum KvScale {
    /// One scale for the whole `kv_dim` vector (every KV head): the seed's per-token scale.
    #[default]
    Token,
    /// One scale per KV head (`head_dim` channels): a head whose keys carry large RoPE
    /// channels no longer coarsens the other heads' grid. 4 more bytes per extra head.
    Head,
}

impl KvScale {
    /// Scales per token vector of `kv_dim` channels in heads of `head_dim`.
    pub fn count(self, kv_dim: usize, head_dim: usize) -> usize {
        match self {
            KvScale::Token => 1,
            KvScale::Head => kv_dim / head_dim.max(1),
        }
    }
}
