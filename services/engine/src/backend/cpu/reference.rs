//! The shadow pass's exact reference for groups that hold no float copy: their weights read
//! from the memory-mapped checkpoint, as the float copies are (`GroupWeights::load`, stored in
//! the engine's float dtype), a bounded number of them kept.
//!
//! Cache policy: the first groups that fit stay, the rest are read again on every shadow
//! pass. A shadow pass visits every group once, in layer order, so a least-recently-used
//! cache smaller than the set would evict each group just before its next use and never hit;
//! keeping a fixed subset hits on `capacity / total` of the bytes.

use crate::backend::FloatDtype;
use crate::error::Result;
use candle_core::Tensor;
use quantmesh_model::ops::GroupWeights;
use quantmesh_model::{Checkpoint, ModelConfig};
use quantmesh_types::GroupId;
use std::collections::HashMap;
use std::sync::{Mutex, PoisonError};

/// Reads (and partly keeps) the checkpoint's weights of groups without a float copy.
pub struct ReferenceWeights {
    ck: Checkpoint,
    cfg: ModelConfig,
    dtype: FloatDtype,
    capacity: usize,
    state: Mutex<Held>,
}

#[derive(Default)]
struct Held {
    groups: HashMap<GroupId, Tensor>,
    bytes: usize,
    /// Weights served from memory / read from the checkpoint.
    hits: u64,
    reads: u64,
}

/// Counters of [`ReferenceWeights`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ReferenceStats {
    pub held_bytes: usize,
    pub hits: u64,
    pub reads: u64,
}

impl ReferenceWeights {
    /// `capacity`: bytes of weights kept in memory (in `dtype`).
    pub fn new(ck: Checkpoint, cfg: ModelConfig, dtype: FloatDtype, capacity: usize) -> Self {
        Self {
            ck,
            cfg,
            dtype,
            capacity,
            state: Mutex::new(Held::default()),
        }
    }

    /// Group `g`'s float weight `[out, in]` (bias not included: the group holds it). A
    /// `Tensor` clone shares its storage.
    pub fn weight(&self, g: GroupId) -> Result<Tensor> {
        // The executor is the only caller (one pass at a time); a poisoned lock only means
        // an earlier read failed part way, and the map is still consistent.
        let mut held = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(w) = held.groups.get(&g).cloned() {
            held.hits += 1;
            return Ok(w);
        }
        let w = GroupWeights::load(&self.ck, &self.cfg, g)?
            .weight
            .to_dtype(crate::backend::candle_dtype(self.dtype))?;
        held.reads += 1;
        let bytes = w.elem_count() * w.dtype().size_in_bytes();
        if held.bytes + bytes <= self.capacity {
            held.bytes += bytes;
            held.groups.insert(g, w.clone());
        }
        Ok(w)
    }

    /// Drop group `g`'s kept weight (it gained a float copy of its own).
    pub fn forget(&self, g: GroupId) {
        let mut held = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(w) = held.groups.remove(&g) {
            held.bytes -= w.elem_count() * w.dtype().size_in_bytes();
        }
    }

    pub fn stats(&self) -> ReferenceStats {
        let held = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        ReferenceStats {
            held_bytes: held.bytes,
            hits: held.hits,
            reads: held.reads,
        }
    }
}
