//! A model driven one sequence step at a time, straight through the CPU backend and the
//! step policy (`StepRunner`; no actors): the rig the model-level tests share.

#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use quantmesh_engine::backend::cpu::LlamaModel;
use quantmesh_engine::backend::{SeqChunk, StepInput};
use quantmesh_engine::kv::BlockManager;
use quantmesh_engine::kv::KvCache;
use quantmesh_engine::kv::KvFloatDtype;
use quantmesh_engine::precision::StepOutput;
use quantmesh_engine::precision::{PathMask, StepRunner};
use quantmesh_model::ModelConfig;
use quantmesh_types::Residency;
use std::path::Path;

pub struct Rig {
    pub model: LlamaModel,
    pub kv: KvCache,
    pub bm: BlockManager,
    pub runner: StepRunner,
}

impl Rig {
    /// The model at `path` (any format) with every group in `residency`, a 256-page cache.
    pub fn new(path: &Path, residency: Residency, kv_dtype: KvFloatDtype) -> Rig {
        let cfg = ModelConfig::load(path).unwrap();
        let model = LlamaModel::load(path, &cfg, &|_| residency).unwrap();
        Self::with_model(model, &cfg, kv_dtype)
    }

    /// A rig around a model loaded elsewhere.
    pub fn with_model(model: LlamaModel, cfg: &ModelConfig, kv_dtype: KvFloatDtype) -> Rig {
        let kv = KvCache::new(cfg.num_hidden_layers, 256, 16, cfg.kv_dim(), kv_dtype);
        Rig {
            model,
            kv,
            bm: BlockManager::new(256, 16, false),
            runner: StepRunner::default(),
        }
    }

    /// Run `tokens` of `seq` (appending to whatever it has) as one step.
    pub fn step(&mut self, seq: u64, tokens: &[u32], mask: &PathMask, kv_int8: bool) -> StepOutput {
        let step = self.prepare(seq, tokens);
        self.runner
            .run(&self.model, &step, mask, &mut self.kv, kv_int8)
            .unwrap()
    }

    /// The step that appends `tokens` to `seq` (its cache slots allocated).
    pub fn prepare(&mut self, seq: u64, tokens: &[u32]) -> StepInput {
        if !self.bm.contains(seq) {
            self.bm.admit(seq, &[], 512).unwrap();
        }
        let start = self.bm.num_tokens(seq).unwrap();
        let out = self.bm.append(seq, tokens.len()).unwrap();
        StepInput {
            chunks: vec![SeqChunk {
                seq,
                tokens: tokens.to_vec(),
                start_pos: start,
                slots: out.slots,
                block_table: self.bm.block_table(seq).unwrap().to_vec(),
                want_logits: true,
            }],
            copies: out.copies,
        }
    }

    /// Feed `tokens` of `seq` and return the last logits.
    pub fn feed(&mut self, seq: u64, tokens: &[u32], mask: &PathMask, kv_int8: bool) -> Vec<f32> {
        self.step(seq, tokens, mask, kv_int8).logits.remove(0).1
    }

    /// Forget `seq` and free its pages.
    pub fn free(&mut self, seq: u64) {
        self.bm.free(seq);
    }
}
