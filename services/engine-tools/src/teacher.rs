//! Teacher-forced runs: a scratch KV cache, one step per token over a text, and the
//! next-token KL of a plan to the exact float reference.

use quantmesh_engine::backend::cpu::LlamaModel;
use quantmesh_engine::backend::{
    EmbeddingDtype, FloatDtype, Forms, GroupForm, QuantFormat, SeqChunk, SplitActivations,
    StepInput,
};
use quantmesh_engine::error::{EngineError, Result};
use quantmesh_engine::kv::{BlockManager, KvCache, KvFloatDtype, KvScale};
use quantmesh_engine::precision::{PathMask, StepRunner};
use quantmesh_model::bundled::ORDINARY_TEXT;
use quantmesh_model::{ModelConfig, TextTokenizer};
use quantmesh_types::{GroupId, PrecisionClass, Residency};
use std::path::Path;

/// An empty KV cache (f16 float pages, the default C8 scale) and its block manager: `pages`
/// pages of `page` tokens.
pub fn scratch_cache(cfg: &ModelConfig, pages: usize, page: usize) -> (KvCache, BlockManager) {
    scratch_cache_with(cfg, pages, page, KvScale::default())
}

/// [`scratch_cache`] with C8 scales as `scale` says.
pub fn scratch_cache_with(
    cfg: &ModelConfig,
    pages: usize,
    page: usize,
    scale: KvScale,
) -> (KvCache, BlockManager) {
    (
        KvCache::new(
            cfg.num_hidden_layers,
            pages,
            page,
            cfg.kv_dim(),
            KvFloatDtype::F16,
        )
        .with_scale(scale, cfg.head_dim()),
        BlockManager::new(pages, page, false),
    )
}

/// One step appending `toks` to each admitted sequence (logits for every chunk).
pub fn step_for(bm: &mut BlockManager, seqs: &[(u64, Vec<u32>)]) -> Result<StepInput> {
    let mut step = StepInput::default();
    for (id, toks) in seqs {
        let start = bm.num_tokens(*id).unwrap_or(0);
        let out = bm
            .append(*id, toks.len())
            .map_err(|e| EngineError::Config(format!("KV pages: {e}")))?;
        step.copies.extend(out.copies);
        step.chunks.push(SeqChunk {
            seq: *id,
            tokens: toks.clone(),
            start_pos: start,
            slots: out.slots,
            block_table: bm.block_table(*id).unwrap_or_default().to_vec(),
            want_logits: true,
        });
    }
    Ok(step)
}

/// Mean next-token KL(P_float ‖ P_mask) for each mask over [`ORDINARY_TEXT`], teacher-forced
/// (the model loaded by [`Reference::load_class`]).
pub fn teacher_forced_kl(
    dir: &Path,
    class: PrecisionClass,
    split: SplitActivations,
    masks: &[PathMask],
) -> Result<Vec<f64>> {
    let r = Reference::load_class(dir, class, split)?;
    r.mean_kl(&r.texts, masks)
}

/// A checkpoint loaded for KL measurements, and [`ORDINARY_TEXT`] tokenized.
pub struct Reference {
    pub cfg: ModelConfig,
    pub model: LlamaModel,
    pub texts: Vec<Vec<u32>>,
}

impl Reference {
    /// Every group dual with exact f32 float copies and its quantized form the one `class`
    /// is served with ([`QuantFormat::for_class`]), quantized-path rows split as `split`
    /// says, f32 vocabulary tables: the served linear groups against their own float weights.
    pub fn load_class(dir: &Path, class: PrecisionClass, split: SplitActivations) -> Result<Self> {
        let cfg = ModelConfig::load(dir)?;
        let ck = quantmesh_model::Checkpoint::open(dir)?;
        let form = |_: GroupId| GroupForm::new(Residency::Dual, QuantFormat::for_class(class));
        let forms = Forms {
            float: FloatDtype::F32,
            embeddings: EmbeddingDtype::F32,
            split,
            rotation: 0,
        };
        let model = LlamaModel::load_planned(&ck, &cfg, &form, forms)?;
        Self::with_model(dir, cfg, model)
    }

    fn with_model(dir: &Path, cfg: ModelConfig, model: LlamaModel) -> Result<Self> {
        let tok = TextTokenizer::load(dir)?;
        let texts = ORDINARY_TEXT
            .iter()
            .map(|t| tok.encode(t, true))
            .collect::<std::result::Result<Vec<_>, _>>()
            .map_err(|e| EngineError::Config(e.to_string()))?;
        Ok(Self { cfg, model, texts })
    }

    /// Mean next-token KL(P_float ‖ P_mask) per mask over `texts` (see
    /// [`teacher_forced_kl_on`]), and the number of positions.
    pub(super) fn mean_kl_n(
        &self,
        texts: &[Vec<u32>],
        masks: &[PathMask],
    ) -> Result<(Vec<f64>, usize)> {
        let (sums, n) = teacher_forced_kl_on(&self.model, &self.cfg, texts, masks)?;
        Ok((sums.into_iter().map(|s| s / n.max(1) as f64).collect(), n))
    }

    pub fn mean_kl(&self, texts: &[Vec<u32>], masks: &[PathMask]) -> Result<Vec<f64>> {
        Ok(self.mean_kl_n(texts, masks)?.0)
    }
}

/// Summed next-token KL(P_float-only ‖ P_mask) for each mask over `texts` (token ids), and
/// the number of positions summed (see [`teacher_forced_on`]).
pub fn teacher_forced_kl_on(
    model: &dyn quantmesh_engine::backend::Backend,
    cfg: &ModelConfig,
    texts: &[Vec<u32>],
    masks: &[PathMask],
) -> Result<(Vec<f64>, usize)> {
    let t = teacher_forced_on(model, cfg, texts, masks)?;
    Ok((t.kl_sums, t.positions))
}

/// What [`teacher_forced_on`] measured.
#[derive(Debug, Clone, Default)]
pub struct TeacherForced {
    /// Per mask: summed next-token KL(P_float-only ‖ P_mask).
    pub kl_sums: Vec<f64>,
    /// Positions summed (every text's positions after the first).
    pub positions: usize,
    /// Per mask, the float-only reference first: summed negative log-likelihood of the
    /// text's actual next token, over `nll_positions` (positions that have one).
    pub nll_sums: Vec<f64>,
    pub nll_positions: usize,
}

impl TeacherForced {
    /// Perplexity of the float-only reference (index 0) and of each mask (index `m + 1`).
    pub fn perplexity(&self, i: usize) -> f64 {
        (self.nll_sums[i] / self.nll_positions.max(1) as f64).exp()
    }
}

/// The texts run together, one token of each per step from an empty cache (a batch of
/// sequences, as the engine serves them), once all-float (the reference) and once per mask:
/// each position's KL to the reference and each mask's likelihood of the actual next token.
pub fn teacher_forced_on(
    model: &dyn quantmesh_engine::backend::Backend,
    cfg: &ModelConfig,
    texts: &[Vec<u32>],
    masks: &[PathMask],
) -> Result<TeacherForced> {
    let all_float = PathMask::all_groups_float(cfg.num_hidden_layers);
    let mut runner = StepRunner::default();
    let mut out = TeacherForced {
        kl_sums: vec![0f64; masks.len()],
        nll_sums: vec![0f64; masks.len() + 1],
        ..Default::default()
    };
    let mut reference: Vec<Vec<Vec<f32>>> = Vec::new();
    for (m, mask) in std::iter::once(&all_float).chain(masks).enumerate() {
        let logits = teacher_forced_logits(cfg, texts, |step, kv| {
            Ok(runner.run(model, step, mask, kv, true)?.logits)
        })?;
        // Long runs (the oracle's one mask per group) say how far they are.
        if masks.len() >= 16 && m % 10 == 0 {
            eprintln!("  teacher-forced KL: {m} of {} masks", masks.len());
        }
        for (ids, got) in texts.iter().zip(&logits) {
            for (pos, l) in got.iter().enumerate().skip(1) {
                if let Some(&next) = ids.get(pos + 1) {
                    out.nll_sums[m] += quantmesh_model::ops::nll_logits(l, next);
                    if m == 0 {
                        out.nll_positions += 1;
                    }
                }
            }
        }
        if m == 0 {
            reference = logits;
            continue;
        }
        for (want, got) in reference.iter().zip(&logits) {
            for (w, g) in want.iter().zip(got).skip(1) {
                out.kl_sums[m - 1] += quantmesh_model::ops::kl_logits(w, g);
                if m == 1 {
                    out.positions += 1;
                }
            }
        }
    }
    Ok(out)
}

/// Every position's next-token logits of each text, teacher-forced: the texts run as one
/// batch of sequences from an empty cache, one token of each per step, each step through
/// `pass`.
pub(super) fn teacher_forced_logits(
    cfg: &ModelConfig,
    texts: &[Vec<u32>],
    mut pass: impl FnMut(&StepInput, &mut KvCache) -> Result<Vec<(u64, Vec<f32>)>>,
) -> Result<Vec<Vec<Vec<f32>>>> {
    let page = 16;
    let pages: usize = texts.iter().map(|t| t.len().div_ceil(page) + 1).sum();
    let (mut kv, mut bm) = scratch_cache(cfg, pages, page);
    for (i, ids) in texts.iter().enumerate() {
        bm.admit(i as u64, &[], ids.len())
            .map_err(|e| EngineError::Config(format!("KV pages: {e}")))?;
    }
    let longest = texts.iter().map(Vec::len).max().unwrap_or(0);
    let mut logits: Vec<Vec<Vec<f32>>> = vec![Vec::new(); texts.len()];
    for t in 0..longest {
        let seqs: Vec<(u64, Vec<u32>)> = texts
            .iter()
            .enumerate()
            .filter(|(_, ids)| t < ids.len())
            .map(|(i, ids)| (i as u64, vec![ids[t]]))
            .collect();
        let step = step_for(&mut bm, &seqs)?;
        let out = pass(&step, &mut kv)?;
        if out.len() != seqs.len() {
            return Err(EngineError::Config(format!(
                "a step of {} sequences returned {} logits",
                seqs.len(),
                out.len()
            )));
        }
        for (seq, l) in out {
            logits
                .get_mut(seq as usize)
                .ok_or_else(|| EngineError::Config(format!("logits for unknown sequence {seq}")))?
                .push(l);
        }
    }
    Ok(logits)
}
