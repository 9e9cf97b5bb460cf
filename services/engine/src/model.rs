//! A Llama-family decoder (RMSNorm, RoPE, grouped-query attention, SwiGLU; Qwen2-style
//! q/k/v biases) over a flattened batch of tokens from many sequences, reading and
//! writing the paged KV cache.
//!
//! A step is a list of sequence chunks (prefill chunks and single decode tokens). Linear
//! groups run once over all rows of the step; attention runs per sequence over that
//! sequence's cached K/V.

use crate::block_manager::{PageId, SeqId, Slot};
use crate::checkpoint::Checkpoint;
use crate::config::ModelConfig;
use crate::error::{EngineError, Result};
use crate::kv_cache::KvCache;
use crate::linear::{DualLinear, GroupOutcome, RowPath};
use crate::mask::{GroupDetector, PathMask};
use candle_core::{DType, Device, Tensor, D};
use quantmesh_shared::{GroupId, GroupKind, Residency};
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

/// One sequence's part of a step.
#[derive(Debug, Clone)]
pub struct SeqChunk {
    pub seq: SeqId,
    pub tokens: Vec<u32>,
    /// Absolute position of `tokens[0]`.
    pub start_pos: usize,
    /// KV slots for `tokens`, one each.
    pub slots: Vec<Slot>,
    pub block_table: Vec<PageId>,
    /// Compute logits for the last token of the chunk.
    pub want_logits: bool,
}

#[derive(Debug, Clone, Default)]
pub struct StepInput {
    pub chunks: Vec<SeqChunk>,
    /// Copy-on-write page copies to do before the step.
    pub copies: Vec<(PageId, PageId)>,
}

impl StepInput {
    pub fn num_tokens(&self) -> usize {
        self.chunks.iter().map(|c| c.tokens.len()).sum()
    }
}

/// What a step produced.
#[derive(Debug, Clone, Default)]
pub struct StepOutput {
    /// Logits of the last token of each chunk that asked for them.
    pub logits: Vec<(SeqId, Vec<f32>)>,
    /// Row counts per group and path.
    pub outcomes: Vec<(GroupId, GroupOutcome)>,
    /// The mask version this step ran under.
    pub mask_version: u64,
    pub num_tokens: usize,
    /// (sequence, position, token id) of every row, in row order.
    pub rows: Vec<(SeqId, usize, u32)>,
    /// Activation statistics per monitored group (empty when monitoring is off).
    pub obs: Vec<GroupObs>,
    /// Sampled KL(P_float ‖ P_served) per sequence with logits (shadow steps only).
    pub shadow_kl: Vec<(SeqId, f64)>,
    /// NaN/Inf seen in activations or logits: the step was recomputed in float.
    pub non_finite: bool,
    /// Time spent choosing paths (mask checks and per-token routing).
    pub mask_check_ns: u64,
    /// Time spent computing activation statistics (monitoring).
    pub stats_ns: u64,
}

/// One group's statistics for one step.
#[derive(Debug, Clone, PartialEq)]
pub struct GroupObs {
    pub group: GroupId,
    /// Per row: abs-max of the input over non-excluded channels; NaN for skipped positions.
    pub stats: Vec<f32>,
    /// Rows routed to float in this group by the per-token bound.
    pub token_float_rows: Vec<usize>,
    /// Per row: abs-argmax channel (only while learning massive channels).
    pub argmax: Vec<u32>,
}

/// Measure one group's input rows: returns the observation and whether a non-finite value
/// was seen. A single pass over the data, no tensor ops.
fn observe_rows(
    g: GroupId,
    det: &GroupDetector,
    input: &Tensor,
    rows: &[(SeqId, usize)],
    skip: &[usize],
) -> Result<(GroupObs, bool)> {
    let (n, d) = input.dims2()?;
    // Read the activations in place when they are contiguous f32 on the CPU (the usual
    // case); copy otherwise.
    let (storage, layout) = input.storage_and_layout();
    let borrowed = match (&*storage, layout.contiguous_offsets()) {
        (candle_core::Storage::Cpu(cpu), Some((start, end))) => {
            cpu.as_slice::<f32>().ok().map(|s| &s[start..end])
        }
        _ => None,
    };
    let owned;
    let data: &[f32] = match borrowed {
        Some(d) => d,
        None => {
            owned = input.flatten_all()?.to_vec1::<f32>()?;
            &owned
        }
    };
    // Channel ranges that count (everything but the excluded channels).
    let mut ranges = Vec::with_capacity(det.excluded_channels.len() + 1);
    let mut from = 0;
    for &c in det.excluded_channels.iter().filter(|&&c| c < d) {
        if c > from {
            ranges.push(from..c);
        }
        from = c + 1;
    }
    if from < d {
        ranges.push(from..d);
    }
    let mut obs = GroupObs {
        group: g,
        stats: Vec::with_capacity(n),
        token_float_rows: Vec::new(),
        argmax: Vec::new(),
    };
    let mut non_finite = false;
    for r in 0..n {
        let row = &data[r * d..(r + 1) * d];
        if skip.contains(&rows[r].1) {
            obs.stats.push(f32::NAN);
            if det.learn_channels {
                obs.argmax.push(u32::MAX);
            }
            continue;
        }
        // A NaN or Inf anywhere makes the row sum non-finite: one cheap check per row.
        let finite = sum8(row).is_finite();
        non_finite |= !finite;
        let m = ranges
            .iter()
            .map(|rg| absmax8(&row[rg.clone()]))
            .fold(0f32, f32::max);
        if det.learn_channels {
            let mut best = (0u32, -1f32);
            for (c, v) in row.iter().enumerate() {
                if v.abs() > best.1 {
                    best = (c as u32, v.abs());
                }
            }
            obs.argmax.push(best.0);
        }
        if m > det.token_bound {
            obs.token_float_rows.push(r);
        }
        obs.stats.push(if finite { m } else { f32::INFINITY });
    }
    Ok((obs, non_finite))
}

/// Abs-max with 8 independent lanes (vectorizes to max instructions).
#[inline]
fn absmax8(x: &[f32]) -> f32 {
    let mut lanes = [0f32; 8];
    let chunks = x.chunks_exact(8);
    let tail = chunks
        .remainder()
        .iter()
        .fold(0f32, |m, v| if v.abs() > m { v.abs() } else { m });
    for c in chunks {
        for k in 0..8 {
            let a = c[k].abs();
            lanes[k] = if a > lanes[k] { a } else { lanes[k] };
        }
    }
    lanes.iter().fold(tail, |m, &v| if v > m { v } else { m })
}

/// Sum with 8 independent lanes.
#[inline]
fn sum8(x: &[f32]) -> f32 {
    let mut lanes = [0f32; 8];
    let chunks = x.chunks_exact(8);
    let tail: f32 = chunks.remainder().iter().sum();
    for c in chunks {
        for k in 0..8 {
            lanes[k] += c[k];
        }
    }
    lanes.iter().sum::<f32>() + tail
}

/// `base` with the rows listed in `rows` replaced by the rows of `with` (same order).
fn replace_rows(base: &Tensor, rows: &[usize], with: &Tensor) -> Result<Tensor> {
    let n = base.dim(0)?;
    let mut map: Vec<u32> = (0..n as u32).collect();
    for (i, &r) in rows.iter().enumerate() {
        map[r] = (n + i) as u32;
    }
    let stacked = Tensor::cat(&[base, with], 0)?;
    Ok(stacked.index_select(&Tensor::new(map.as_slice(), base.device())?, 0)?)
}

/// Add per-token float rows to a path.
fn with_token_rows(path: RowPath, extra: &[usize]) -> RowPath {
    if extra.is_empty() {
        return path;
    }
    match path {
        RowPath::AllFloat => RowPath::AllFloat,
        RowPath::AllInt8 => RowPath::FloatRows(extra.to_vec()),
        RowPath::FloatRows(mut v) => {
            v.extend_from_slice(extra);
            v.sort_unstable();
            v.dedup();
            RowPath::FloatRows(v)
        }
    }
}

fn softmax64(l: &[f32]) -> Vec<f64> {
    let m = l.iter().cloned().fold(f32::NEG_INFINITY, f32::max) as f64;
    let e: Vec<f64> = l.iter().map(|x| (*x as f64 - m).exp()).collect();
    let z: f64 = e.iter().sum();
    e.into_iter().map(|x| x / z).collect()
}

/// KL(P ‖ Q) in nats between the softmax distributions of two logit vectors.
pub fn kl_logits(p_logits: &[f32], q_logits: &[f32]) -> f64 {
    let (p, q) = (softmax64(p_logits), softmax64(q_logits));
    p.iter()
        .zip(&q)
        .map(|(p, q)| {
            if *p > 0.0 {
                p * (p / q.max(1e-300)).ln()
            } else {
                0.0
            }
        })
        .sum()
}

/// The checkpoint shapes `[out, in]` of a group's members, in `GroupKind::members` order.
pub fn member_shapes(cfg: &ModelConfig, kind: GroupKind) -> Vec<[usize; 2]> {
    let (h, i) = (cfg.hidden_size, cfg.intermediate_size);
    let (hd, nh, nkv) = (cfg.head_dim(), cfg.num_attention_heads, cfg.num_kv_heads());
    match kind {
        GroupKind::Qkv => vec![[nh * hd, h], [nkv * hd, h], [nkv * hd, h]],
        GroupKind::O => vec![[h, nh * hd]],
        GroupKind::GateUp => vec![[i, h], [i, h]],
        GroupKind::Down => vec![[h, i]],
    }
}

/// Load one fused linear group from the checkpoint with the given residency. Used at model
/// load and, in the background, when a hot reload changes a group's residency.
pub fn load_group(
    ck: &Checkpoint,
    cfg: &ModelConfig,
    g: GroupId,
    residency: Residency,
) -> Result<DualLinear> {
    let p = format!("model.layers.{}.", g.layer);
    let members = g.kind.members();
    let shapes = member_shapes(cfg, g.kind);
    let bias_name = |m: &str| format!("{p}{m}.bias");
    let with_bias = (g.kind == GroupKind::Qkv && cfg.has_qkv_bias())
        || members.iter().any(|m| ck.contains(&bias_name(m)));
    let mut ws = Vec::with_capacity(members.len());
    let mut bs = Vec::new();
    for (member, shape) in members.iter().zip(&shapes) {
        ws.push(ck.load_f32_shaped(&format!("{p}{member}.weight"), shape)?);
        if with_bias {
            // Engines cannot mix biased and unbiased members in a fused group: a missing
            // member bias is reported as a checkpoint error.
            bs.push(ck.load_f32_shaped(&bias_name(member), &[shape[0]])?);
        }
    }
    let w = Tensor::cat(&ws, 0)?;
    drop(ws);
    let b = if bs.is_empty() {
        None
    } else {
        Some(Tensor::cat(&bs, 0)?)
    };
    DualLinear::new(w, b, residency)
}

struct Layer {
    input_norm: Tensor,
    post_norm: Tensor,
    groups: [DualLinear; 4],
}

pub struct LlamaModel {
    cfg: ModelConfig,
    embed: Tensor,
    layers: Vec<Layer>,
    norm: Tensor,
    lm_head: Tensor,
    cos: Tensor,
    sin: Tensor,
    steps: AtomicU64,
}

pub fn rms_norm(x: &Tensor, w: &Tensor, eps: f64) -> Result<Tensor> {
    let ms = x.sqr()?.mean_keepdim(D::Minus1)?;
    Ok(x.broadcast_div(&(ms + eps)?.sqrt()?)?.broadcast_mul(w)?)
}

/// RoPE cos/sin tables `[max_pos, head_dim/2]`.
pub fn rope_tables(cfg: &ModelConfig, max_pos: usize) -> Result<(Tensor, Tensor)> {
    let hd = cfg.head_dim();
    let half = hd / 2;
    let inv: Vec<f32> = (0..half)
        .map(|j| 1.0 / (cfg.rope_theta as f32).powf(2.0 * j as f32 / hd as f32))
        .collect();
    let mut angles = Vec::with_capacity(max_pos * half);
    for pos in 0..max_pos {
        angles.extend(inv.iter().map(|f| pos as f32 * f));
    }
    let angles = Tensor::from_vec(angles, (max_pos, half), &Device::Cpu)?;
    Ok((angles.cos()?, angles.sin()?))
}

/// `x` is `[rows, heads, head_dim]`; cos/sin are `[rows, head_dim/2]`. HF's rotate-half.
pub fn rope(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    let half = x.dim(D::Minus1)? / 2;
    let x1 = x.narrow(D::Minus1, 0, half)?;
    let x2 = x.narrow(D::Minus1, half, half)?;
    let c = cos.unsqueeze(1)?;
    let s = sin.unsqueeze(1)?;
    let a = (x1.broadcast_mul(&c)? - x2.broadcast_mul(&s)?)?;
    let b = (x2.broadcast_mul(&c)? + x1.broadcast_mul(&s)?)?;
    Ok(Tensor::cat(&[a, b], D::Minus1)?)
}

impl LlamaModel {
    /// Load from a Hugging Face directory; `residency` decides each group's resident forms.
    pub fn load(
        dir: &Path,
        cfg: &ModelConfig,
        residency: &dyn Fn(GroupId) -> Residency,
    ) -> Result<Self> {
        Self::load_from(&Checkpoint::open(dir)?, cfg, residency)
    }

    /// Load from an opened checkpoint.
    pub fn load_from(
        ck: &Checkpoint,
        cfg: &ModelConfig,
        residency: &dyn Fn(GroupId) -> Residency,
    ) -> Result<Self> {
        let (h, v) = (cfg.hidden_size, cfg.vocab_size);
        let embed = ck.load_f32_shaped("model.embed_tokens.weight", &[v, h])?;
        let norm = ck.load_f32_shaped("model.norm.weight", &[h])?;
        let lm_head = if ck.contains("lm_head.weight") && !cfg.tie_word_embeddings {
            ck.load_f32_shaped("lm_head.weight", &[v, h])?
        } else {
            embed.clone()
        };
        let mut layers = Vec::with_capacity(cfg.num_hidden_layers);
        for l in 0..cfg.num_hidden_layers {
            let p = format!("model.layers.{l}.");
            let group = |kind| {
                let g = GroupId::new(l, kind);
                load_group(ck, cfg, g, residency(g))
            };
            let qkv = group(GroupKind::Qkv)?;
            let o = group(GroupKind::O)?;
            let gate_up = group(GroupKind::GateUp)?;
            let down = group(GroupKind::Down)?;
            layers.push(Layer {
                input_norm: ck.load_f32_shaped(&format!("{p}input_layernorm.weight"), &[h])?,
                post_norm: ck
                    .load_f32_shaped(&format!("{p}post_attention_layernorm.weight"), &[h])?,
                groups: [qkv, o, gate_up, down],
            });
        }
        let (cos, sin) = rope_tables(cfg, cfg.max_position_embeddings)?;
        Ok(Self {
            cfg: cfg.clone(),
            embed,
            layers,
            norm,
            lm_head,
            cos,
            sin,
            steps: AtomicU64::new(0),
        })
    }

    pub fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    pub fn residency(&self, g: GroupId) -> Residency {
        self.layers[g.layer].groups[g.kind.index()].residency()
    }

    /// Whether `new` can replace group `g` (the group exists, same shape).
    pub fn check_replacement(&self, g: GroupId, new: &DualLinear) -> Result<()> {
        let slot = self
            .layers
            .get(g.layer)
            .map(|l| &l.groups[g.kind.index()])
            .ok_or_else(|| EngineError::Config(format!("no group {g} in this model")))?;
        if (slot.out_dim(), slot.in_dim()) != (new.out_dim(), new.in_dim()) {
            return Err(EngineError::Config(format!(
                "replacement for {g} has shape [{}, {}], expected [{}, {}]",
                new.out_dim(),
                new.in_dim(),
                slot.out_dim(),
                slot.in_dim()
            )));
        }
        Ok(())
    }

    /// Put a group built by [`load_group`] in place; returns the one it replaces (drop it
    /// to free its memory). Called by the executor between steps, so a step never sees a
    /// half-applied plan.
    pub fn replace_group(&mut self, g: GroupId, new: DualLinear) -> Result<DualLinear> {
        self.check_replacement(g, &new)?;
        let slot = &mut self.layers[g.layer].groups[g.kind.index()];
        Ok(std::mem::replace(slot, new))
    }

    /// Bytes of resident linear-group weights (the part the precision plan changes).
    pub fn linear_bytes(&self) -> usize {
        self.layers
            .iter()
            .flat_map(|l| l.groups.iter())
            .map(DualLinear::resident_bytes)
            .sum()
    }

    /// All resident weight bytes (linear groups + float embeddings, norms, lm_head).
    pub fn resident_bytes(&self) -> usize {
        let float = self.embed.elem_count()
            + self.norm.elem_count()
            + if self.cfg.tie_word_embeddings {
                0
            } else {
                self.lm_head.elem_count()
            }
            + self
                .layers
                .iter()
                .map(|l| l.input_norm.elem_count() + l.post_norm.elem_count())
                .sum::<usize>();
        self.linear_bytes() + float * 4
    }

    /// Which rows of the step take the float path through group `g`.
    fn row_path(g: GroupId, mask: &PathMask, rows: &[(SeqId, usize)]) -> RowPath {
        if mask.float_batch || mask.float_groups.contains(&g) {
            return RowPath::AllFloat;
        }
        let tokens = mask.float_tokens.get(&g);
        if mask.float_requests.is_empty() && tokens.is_none_or(|t| t.is_empty()) {
            return RowPath::AllInt8;
        }
        let float: Vec<usize> = rows
            .iter()
            .enumerate()
            .filter(|(_, (s, p))| {
                mask.float_requests.contains(s) || tokens.is_some_and(|t| t.contains(&(*s, *p)))
            })
            .map(|(i, _)| i)
            .collect();
        if float.is_empty() {
            RowPath::AllInt8
        } else {
            RowPath::FloatRows(float)
        }
    }

    /// Measure a group's input (when monitored) and choose its row path.
    fn route(
        g: GroupId,
        input: &Tensor,
        mask: &PathMask,
        rows: &[(SeqId, usize)],
        out: &mut StepOutput,
    ) -> Result<RowPath> {
        let det = mask
            .detector
            .as_ref()
            .and_then(|d| d.groups.get(&g).map(|gd| (d, gd)));
        let obs = match det {
            Some((d, gd)) => {
                let t = Instant::now();
                let (obs, bad) = observe_rows(g, gd, input, rows, &d.skip_positions)?;
                out.stats_ns += t.elapsed().as_nanos() as u64;
                out.non_finite |= bad;
                Some(obs)
            }
            None => None,
        };
        let t = Instant::now();
        let mut path = Self::row_path(g, mask, rows);
        if let Some(o) = &obs {
            path = with_token_rows(path, &o.token_float_rows);
        }
        out.mask_check_ns += t.elapsed().as_nanos() as u64;
        out.obs.extend(obs);
        Ok(path)
    }

    fn exec(
        layer: &Layer,
        g: GroupId,
        input: &Tensor,
        path: &RowPath,
        out: &mut StepOutput,
    ) -> Result<Tensor> {
        let (y, o) = layer.groups[g.kind.index()].forward(input, path)?;
        out.outcomes.push((g, o));
        Ok(y)
    }

    /// Run one step. `kv_int8`: whether new KV entries are stored in INT8 (layers listed in
    /// `mask.kv_float_layers` store float regardless).
    ///
    /// With monitoring on, a deterministic `shadow_sample_rate` share of steps first runs a
    /// float-only pass to get `KL(P_float ‖ P_served)` for each sequence's next token (the
    /// served pass then rewrites the step's KV slots, so the cache holds served values). A
    /// NaN/Inf in activations or logits makes the whole step recompute in float.
    pub fn forward(
        &self,
        step: &StepInput,
        mask: &PathMask,
        kv: &mut KvCache,
        kv_int8: bool,
    ) -> Result<StepOutput> {
        for &(src, dst) in &step.copies {
            kv.copy_page(src, dst);
        }
        let n = self.steps.fetch_add(1, Ordering::Relaxed);
        let float_mask = || PathMask {
            float_batch: true,
            detector: None,
            ..mask.clone()
        };
        let shadow = match &mask.detector {
            // Weyl sequence: evenly spread, deterministic sampling of steps.
            Some(d) if d.shadow_sample_rate > 0.0 && !mask.float_batch => {
                ((n as f64 * 0.618_033_988_749_895) % 1.0) < d.shadow_sample_rate
            }
            _ => false,
        };
        let shadow_logits = if shadow {
            Some(self.pass(step, &float_mask(), kv, kv_int8)?.logits)
        } else {
            None
        };
        let mut out = self.pass(step, mask, kv, kv_int8)?;
        let bad_logits = out
            .logits
            .iter()
            .any(|(_, l)| l.iter().any(|x| !x.is_finite()));
        if out.non_finite || bad_logits {
            tracing::warn!(
                tokens = out.num_tokens,
                "non-finite activations or logits: recomputing the step in float"
            );
            let again = self.pass(step, &float_mask(), kv, kv_int8)?;
            out.logits = again.logits;
            out.outcomes.extend(again.outcomes);
            out.non_finite = true;
        }
        if let Some(fl) = shadow_logits {
            out.shadow_kl = fl
                .iter()
                .zip(&out.logits)
                .filter(|((a, _), (b, _))| a == b)
                .map(|((s, f), (_, q))| (*s, kl_logits(f, q)))
                .collect();
        }
        Ok(out)
    }

    fn pass(
        &self,
        step: &StepInput,
        mask: &PathMask,
        kv: &mut KvCache,
        kv_int8: bool,
    ) -> Result<StepOutput> {
        let dev = Device::Cpu;
        let cfg = &self.cfg;
        let (hd, nh, nkv) = (cfg.head_dim(), cfg.num_attention_heads, cfg.num_kv_heads());
        let kv_dim = nkv * hd;
        let ids: Vec<u32> = step
            .chunks
            .iter()
            .flat_map(|c| c.tokens.iter().copied())
            .collect();
        let rows: Vec<(SeqId, usize)> = step
            .chunks
            .iter()
            .flat_map(|c| (0..c.tokens.len()).map(move |i| (c.seq, c.start_pos + i)))
            .collect();
        let n = ids.len();
        let mut out = StepOutput {
            mask_version: mask.version,
            num_tokens: n,
            rows: step
                .chunks
                .iter()
                .flat_map(|c| {
                    c.tokens
                        .iter()
                        .enumerate()
                        .map(move |(i, t)| (c.seq, c.start_pos + i, *t))
                })
                .collect(),
            ..Default::default()
        };
        if n == 0 {
            return Ok(out);
        }
        if let Some(&(_, p)) = rows.iter().find(|(_, p)| *p >= cfg.max_position_embeddings) {
            return Err(EngineError::InvalidRequest(format!(
                "position {p} exceeds max_position_embeddings {}",
                cfg.max_position_embeddings
            )));
        }
        let pos: Vec<u32> = rows.iter().map(|(_, p)| *p as u32).collect();
        let pos = Tensor::new(pos.as_slice(), &dev)?;
        let cos = self.cos.index_select(&pos, 0)?;
        let sin = self.sin.index_select(&pos, 0)?;
        let mut x = self
            .embed
            .index_select(&Tensor::new(ids.as_slice(), &dev)?, 0)?;

        for (l, layer) in self.layers.iter().enumerate() {
            let run = |kind: GroupKind, input: &Tensor, out: &mut StepOutput| -> Result<Tensor> {
                let g = GroupId::new(l, kind);
                let path = Self::route(g, input, mask, &rows, out)?;
                Self::exec(layer, g, input, &path, out)
            };
            // --- attention ---
            let h = rms_norm(&x, &layer.input_norm, cfg.rms_norm_eps)?;
            let qkv = run(GroupKind::Qkv, &h, &mut out)?;
            let q = qkv.narrow(1, 0, nh * hd)?.reshape((n, nh, hd))?;
            let k = qkv.narrow(1, nh * hd, kv_dim)?.reshape((n, nkv, hd))?;
            let v = qkv.narrow(1, nh * hd + kv_dim, kv_dim)?;
            let q = rope(&q, &cos, &sin)?;
            let k = rope(&k, &cos, &sin)?.reshape((n, kv_dim))?;
            let k_rows = k.flatten_all()?.to_vec1::<f32>()?;
            let v_rows = v.contiguous()?.flatten_all()?.to_vec1::<f32>()?;
            let layer_int8 = kv_int8 && !mask.kv_float_layers.contains(&l);
            let q_rows = q.flatten_all()?.to_vec1::<f32>()?;
            let mut attn = vec![0f32; n * nh * hd];
            let mut row = 0;
            for c in &step.chunks {
                for (i, slot) in c.slots.iter().enumerate() {
                    let r = (row + i) * kv_dim;
                    kv.write(
                        l,
                        *slot,
                        &k_rows[r..r + kv_dim],
                        &v_rows[r..r + kv_dim],
                        layer_int8,
                    );
                }
                let m = c.tokens.len();
                let span = row * nh * hd..(row + m) * nh * hd;
                kv.attend(
                    l,
                    &c.block_table,
                    c.start_pos,
                    &q_rows[span.clone()],
                    m,
                    nh,
                    hd,
                    &mut attn[span],
                );
                row += m;
            }
            let attn = Tensor::from_vec(attn, (n, nh * hd), &dev)?;
            x = (x + run(GroupKind::O, &attn, &mut out)?)?;
            // --- MLP ---
            let h = rms_norm(&x, &layer.post_norm, cfg.rms_norm_eps)?;
            let gu = run(GroupKind::GateUp, &h, &mut out)?;
            let inter = cfg.intermediate_size;
            let swiglu = |gu: &Tensor| -> Result<Tensor> {
                Ok((gu.narrow(1, 0, inter)?.silu()? * gu.narrow(1, inter, inter)?)?)
            };
            let mut act = swiglu(&gu)?;
            let down = GroupId::new(l, GroupKind::Down);
            let down_path = Self::route(down, &act, mask, &rows, &mut out)?;
            // MLP coupling per token: rows routed to float at `down` by the per-token bound
            // get their `gate_up` recomputed in float first (the spike is a product of it).
            let token_rows = out
                .obs
                .last()
                .filter(|o| o.group == down)
                .map(|o| o.token_float_rows.clone())
                .unwrap_or_default();
            let gate_up = &layer.groups[GroupKind::GateUp.index()];
            if !token_rows.is_empty()
                && gate_up.residency().has_float()
                && !mask.float_batch
                && !mask
                    .float_groups
                    .contains(&GroupId::new(l, GroupKind::GateUp))
            {
                let idx = Tensor::new(
                    token_rows
                        .iter()
                        .map(|&r| r as u32)
                        .collect::<Vec<_>>()
                        .as_slice(),
                    &dev,
                )?;
                let (gu_f, o) = gate_up.forward(&h.index_select(&idx, 0)?, &RowPath::AllFloat)?;
                out.outcomes.push((GroupId::new(l, GroupKind::GateUp), o));
                act = replace_rows(&act, &token_rows, &swiglu(&gu_f)?)?;
            }
            x = (x + Self::exec(layer, down, &act, &down_path, &mut out)?)?;
        }

        let mut want = Vec::new();
        let mut row = 0;
        for c in &step.chunks {
            row += c.tokens.len();
            if c.want_logits {
                want.push((c.seq, (row - 1) as u32));
            }
        }
        if !want.is_empty() {
            let idx: Vec<u32> = want.iter().map(|(_, r)| *r).collect();
            let last = x.index_select(&Tensor::new(idx.as_slice(), &dev)?, 0)?;
            let last = rms_norm(&last, &self.norm, cfg.rms_norm_eps)?;
            let logits = last
                .matmul(&self.lm_head.t()?)?
                .to_dtype(DType::F32)?
                .to_vec2::<f32>()?;
            out.logits = want.into_iter().map(|(s, _)| s).zip(logits).collect();
        }
        Ok(out)
    }
}
