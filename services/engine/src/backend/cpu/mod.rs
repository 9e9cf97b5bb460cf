//! The CPU backend: a Llama-family decoder (RMSNorm, RoPE, grouped-query attention,
//! SwiGLU; Qwen2-style q/k/v biases) on candle tensors, over a flattened batch of tokens
//! from many sequences, reading and writing the paged KV cache.
//!
//! Linear groups run once over all rows of the step, each row on the path the [`Router`]
//! chose ([`linear::DualLinear`]: Q8_0 and exact f32 forms); attention runs per sequence
//! over that sequence's cached K/V (`KvCache::attend`). The layer's operations are
//! `quantmesh_model::ops`, shared with the pre-screen.

pub mod linear;
pub mod reference;
pub mod table;
pub mod width;

use crate::backend::{
    Backend, EmbeddingDtype, FloatDtype, Forms, GroupForm, GroupLoader, GroupOutcome, PassOutput,
    PreparedGroup, PreparedTables, QuantFormat, Router, RowPath, StepInput, TableLoader,
    WeightBytes,
};
use crate::error::{EngineError, Result};
use crate::kv::KvCache;
use candle_core::{DType, Device, Tensor};
use linear::{with_f32_rows, DualLinear};
use quantmesh_model::ops::{rope_tables, GroupWeights};
use quantmesh_model::{names, Checkpoint, ModelConfig};
use quantmesh_types::{GroupId, GroupKind, Residency};
use reference::ReferenceWeights;
use std::path::Path;
use std::sync::Arc;
use table::Table;

/// Leave the cores to the kernels' pool: candle (whose element-wise tensor ops remain
/// between the kernels: norms, RoPE, SwiGLU, residual adds) runs its ops on the calling
/// thread unless `CANDLE_NUM_THREADS` says otherwise. Its own pool's workers would
/// otherwise spin on the same cores as the kernels' workers between ops (measured: 10–15 %
/// of a 512-token prefill on 2 cores). Call first thing in `main`, before any other thread
/// exists (it sets an environment variable candle reads once).
pub fn leave_the_cores_to_the_kernel_pool() {
    if std::env::var_os("CANDLE_NUM_THREADS").is_none() {
        std::env::set_var("CANDLE_NUM_THREADS", "1");
    }
}

/// `silu(gate) · up` over the fused `gate_up` output `[rows, 2·inter]` (gate first), on the
/// kernels' pool (the same function as `quantmesh_model::ops::swiglu_fused`, to an ulp).
fn swiglu_rows(gu: &Tensor, inter: usize) -> Result<Tensor> {
    let (rows, _) = gu.dims2()?;
    let mut out = vec![0f32; rows * inter];
    linear::with_f32_rows(gu, |x| {
        quantmesh_kernels::swiglu(
            x,
            rows,
            inter,
            &mut out,
            quantmesh_kernels::Isa::current(),
            quantmesh_kernels::Pool::global(),
        )?;
        Ok(())
    })?;
    Ok(Tensor::from_vec(out, (rows, inter), &Device::Cpu)?)
}

/// RMSNorm of the rows of `x` (`[rows, cols]`) by the kernels' one-pass loop.
fn norm_rows(x: &Tensor, w: &Tensor, eps: f64) -> Result<Tensor> {
    let (rows, cols) = x.dims2()?;
    let y = with_f32_rows(x, |xs| {
        with_f32_rows(w, |ws| Ok(quantmesh_kernels::rms_norm(xs, ws, eps as f32)?))
    })?;
    Ok(Tensor::from_vec(y, (rows, cols), &Device::Cpu)?)
}

/// A fused q/k/v product's rows (`[rows, (heads + 2·kv_heads)·head_dim]`) split into q, k
/// and v rows (`[rows][heads·head_dim]`, `[rows][kv_heads·head_dim]` twice), RoPE applied to
/// q and k with each row's tables (`cos`/`sin`: `[rows][head_dim / 2]`).
fn split_qkv_with_rope(
    qkv: &Tensor,
    (nh, nkv, hd): (usize, usize, usize),
    cos: &[f32],
    sin: &[f32],
) -> Result<(Vec<f32>, Vec<f32>, Vec<f32>)> {
    let (n, width) = qkv.dims2()?;
    let (qw, kw) = (nh * hd, nkv * hd);
    let half = hd / 2;
    if width != qw + 2 * kw || cos.len() != n * half || sin.len() != n * half {
        return Err(quantmesh_kernels::KernelError::Shape(format!(
            "q/k/v rows of {width} for {nh}+2x{nkv} heads of {hd}"
        ))
        .into());
    }
    with_f32_rows(qkv, |all| {
        let (mut q, mut k, mut v) = (
            Vec::with_capacity(n * qw),
            Vec::with_capacity(n * kw),
            Vec::with_capacity(n * kw),
        );
        for (r, row) in all.chunks_exact(width).enumerate() {
            let (c, s) = (
                &cos[r * half..(r + 1) * half],
                &sin[r * half..(r + 1) * half],
            );
            q.extend_from_slice(&row[..qw]);
            quantmesh_kernels::rope(&mut q[r * qw..], c, s)?;
            k.extend_from_slice(&row[qw..qw + kw]);
            quantmesh_kernels::rope(&mut k[r * kw..], c, s)?;
            v.extend_from_slice(&row[qw + kw..]);
        }
        Ok((q, k, v))
    })
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

/// Load one fused linear group from the checkpoint in the given form. Used at model load
/// and, in the background, when a hot reload changes a group's residency or format.
pub fn load_group(
    ck: &Checkpoint,
    cfg: &ModelConfig,
    g: GroupId,
    form: GroupForm,
    forms: Forms,
) -> Result<DualLinear> {
    let w = GroupWeights::load(ck, cfg, g)?;
    DualLinear::rotated(w.weight, w.bias, form, forms.float, forms.rotation)
}

fn prepare_group(
    ck: &Checkpoint,
    cfg: &ModelConfig,
    g: GroupId,
    form: GroupForm,
    forms: Forms,
) -> Result<PreparedGroup> {
    let lin = load_group(ck, cfg, g, form.clone(), forms)?;
    Ok(PreparedGroup {
        group: g,
        form,
        column_error: lin.column_error(),
        bytes: lin.resident_bytes(),
        inner: Box::new(lin),
    })
}

/// The token embedding and `lm_head` in `form` (one table, shared, when tied or when the
/// checkpoint has no `lm_head`).
fn load_tables(
    ck: &Checkpoint,
    cfg: &ModelConfig,
    form: EmbeddingDtype,
) -> Result<(Arc<Table>, Arc<Table>)> {
    let (h, v) = (cfg.hidden_size, cfg.vocab_size);
    let embed_w = ck.load_f32_shaped(names::EMBED, &[v, h])?;
    let embed = Arc::new(Table::new(&embed_w, form)?);
    drop(embed_w);
    let lm_head = if ck.contains(names::LM_HEAD) && !cfg.tie_word_embeddings {
        Arc::new(Table::new(
            &ck.load_f32_shaped(names::LM_HEAD, &[v, h])?,
            form,
        )?)
    } else {
        embed.clone()
    };
    Ok((embed, lm_head))
}

fn prepare_tables(
    ck: &Checkpoint,
    cfg: &ModelConfig,
    form: EmbeddingDtype,
) -> Result<PreparedTables> {
    let (embed, lm_head) = load_tables(ck, cfg, form)?;
    let bytes = table_pair_bytes(&embed, &lm_head);
    Ok(PreparedTables {
        bytes,
        inner: Box::new((embed, lm_head)),
    })
}

/// Resident bytes of the vocabulary tables (one, when shared).
fn table_pair_bytes(embed: &Arc<Table>, lm_head: &Arc<Table>) -> usize {
    if Arc::ptr_eq(embed, lm_head) {
        embed.bytes()
    } else {
        embed.bytes() + lm_head.bytes()
    }
}

struct Layer {
    input_norm: Tensor,
    post_norm: Tensor,
    groups: [DualLinear; 4],
}

pub struct LlamaModel {
    cfg: ModelConfig,
    embed: Arc<Table>,
    layers: Vec<Layer>,
    norm: Tensor,
    lm_head: Arc<Table>,
    cos: Tensor,
    sin: Tensor,
    forms: Forms,
    /// Exact float weights for the shadow reference of groups without a float copy.
    reference: Option<ReferenceWeights>,
}

impl LlamaModel {
    /// Load from a model path (Hugging Face directory or GGUF); `residency` decides each
    /// group's resident forms. Float copies in f32: the exact reference the tests and the
    /// benchmarks compare against.
    pub fn load(
        dir: &Path,
        cfg: &ModelConfig,
        residency: &dyn Fn(GroupId) -> Residency,
    ) -> Result<Self> {
        Self::load_from(&Checkpoint::open(dir)?, cfg, residency, Forms::EXACT)
    }

    /// Load from an opened checkpoint, float copies and vocabulary tables stored as `forms`
    /// says.
    pub fn load_from(
        ck: &Checkpoint,
        cfg: &ModelConfig,
        residency: &dyn Fn(GroupId) -> Residency,
        forms: Forms,
    ) -> Result<Self> {
        Self::load_planned(ck, cfg, &|g| GroupForm::q8(residency(g)), forms)
    }

    /// Load with each group's residency and quantized format from `form` (the plan).
    pub fn load_planned(
        ck: &Checkpoint,
        cfg: &ModelConfig,
        form: &dyn Fn(GroupId) -> GroupForm,
        forms: Forms,
    ) -> Result<Self> {
        let h = cfg.hidden_size;
        let (embed, lm_head) = load_tables(ck, cfg, forms.embeddings)?;
        let norm = ck.load_f32_shaped(names::FINAL_NORM, &[h])?;
        let mut layers = Vec::with_capacity(cfg.num_hidden_layers);
        for l in 0..cfg.num_hidden_layers {
            let group = |kind| {
                let g = GroupId::new(l, kind);
                load_group(ck, cfg, g, form(g), forms)
            };
            let qkv = group(GroupKind::Qkv)?;
            let o = group(GroupKind::O)?;
            let gate_up = group(GroupKind::GateUp)?;
            let down = group(GroupKind::Down)?;
            layers.push(Layer {
                input_norm: ck.load_f32_shaped(&names::input_norm(l), &[h])?,
                post_norm: ck.load_f32_shaped(&names::post_norm(l), &[h])?,
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
            forms,
            reference: None,
        })
    }

    /// Give the shadow pass ([`RowPath::Reference`]) the checkpoint's weights for groups that
    /// hold no float copy (otherwise they run INT8 in the reference too).
    pub fn with_reference(mut self, reference: ReferenceWeights) -> Self {
        self.reference = Some(reference);
        self
    }

    pub fn reference(&self) -> Option<&ReferenceWeights> {
        self.reference.as_ref()
    }

    fn slot(&self, g: GroupId) -> Result<&DualLinear> {
        self.layers
            .get(g.layer)
            .map(|l| &l.groups[g.kind.index()])
            .ok_or_else(|| EngineError::Config(format!("no group {g} in this model")))
    }

    /// Whether `new` can replace group `g` (the group exists, same shape).
    fn check_replacement(&self, g: GroupId, new: &DualLinear) -> Result<()> {
        let slot = self.slot(g)?;
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

    fn run_group(
        &self,
        layer: &Layer,
        g: GroupId,
        input: &Tensor,
        router: &mut dyn Router,
    ) -> Result<Tensor> {
        let path = router.route(g, input)?;
        let (y, o) = self.forward_group(layer, g, input, &path)?;
        router.record(g, o);
        Ok(y)
    }

    /// Group `g` on `path`; the reference path of a group without a float copy reads the
    /// checkpoint's weights when the model has them.
    fn forward_group(
        &self,
        layer: &Layer,
        g: GroupId,
        input: &Tensor,
        path: &RowPath,
    ) -> Result<(Tensor, GroupOutcome)> {
        let lin = &layer.groups[g.kind.index()];
        match (&self.reference, path) {
            (Some(r), RowPath::Reference) if !lin.residency().has_float() => {
                lin.forward_with(input, &r.weight(g)?)
            }
            _ => lin.forward(input, path, self.forms.split),
        }
    }
}

impl Backend for LlamaModel {
    fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    fn residency(&self, g: GroupId) -> Residency {
        self.layers[g.layer].groups[g.kind.index()].residency()
    }

    fn quant_format(&self, g: GroupId) -> QuantFormat {
        self.layers[g.layer].groups[g.kind.index()].quant_format()
    }

    fn column_error(&self, g: GroupId) -> Option<Arc<crate::backend::ColumnError>> {
        self.slot(g).ok().and_then(DualLinear::column_error)
    }

    fn linear_bytes(&self) -> usize {
        self.layers
            .iter()
            .flat_map(|l| l.groups.iter())
            .map(DualLinear::resident_bytes)
            .sum()
    }

    /// Linear groups + float embeddings, norms, lm_head.
    fn resident_bytes(&self) -> usize {
        self.weight_bytes().total()
    }

    fn resident_bytes_after(
        &self,
        groups: &[PreparedGroup],
        tables: Option<&PreparedTables>,
    ) -> usize {
        let mut bytes = self.resident_bytes();
        for p in groups {
            bytes -= self.layers[p.group.layer].groups[p.group.kind.index()].resident_bytes();
            bytes += p.bytes;
        }
        if let Some(t) = tables {
            bytes = bytes - table_pair_bytes(&self.embed, &self.lm_head) + t.bytes;
        }
        bytes
    }

    fn weight_bytes(&self) -> WeightBytes {
        let tied = Arc::ptr_eq(&self.lm_head, &self.embed);
        let norms = self.norm.elem_count()
            + self
                .layers
                .iter()
                .map(|l| l.input_norm.elem_count() + l.post_norm.elem_count())
                .sum::<usize>();
        let tables = table_pair_bytes(&self.embed, &self.lm_head);
        let table_params = if tied {
            self.embed.elem_count()
        } else {
            self.embed.elem_count() + self.lm_head.elem_count()
        };
        let other_params = norms + table_params;
        let mut wb = WeightBytes {
            other: norms * 4 + tables,
            ..Default::default()
        };
        let mut linear_params = 0;
        for g in self.layers.iter().flat_map(|l| l.groups.iter()) {
            let (q, f, b) = g.bytes_by_form();
            match g.quant_format().is_four_bit() {
                false => wb.int8 += q,
                true => wb.int4 += q,
            }
            wb.float += f;
            wb.other += b;
            linear_params += g.out_dim() * g.in_dim() + b / 4;
        }
        wb.all_f16 = (other_params + linear_params) * 2;
        wb
    }

    fn float_dtype(&self) -> FloatDtype {
        self.forms.float
    }

    fn replace_weights(
        &mut self,
        groups: Vec<PreparedGroup>,
        tables: Option<PreparedTables>,
    ) -> Result<()> {
        let mut ready = Vec::with_capacity(groups.len());
        for p in groups {
            let g = p.group;
            let new = p.inner.downcast::<DualLinear>().map_err(|_| {
                EngineError::Config(format!("replacement for {g} was built by another backend"))
            })?;
            self.check_replacement(g, &new)?;
            ready.push((g, *new));
        }
        let tables = match tables {
            Some(t) => {
                let new = t
                    .inner
                    .downcast::<(Arc<Table>, Arc<Table>)>()
                    .map_err(|_| {
                        EngineError::Config(
                            "replacement vocabulary tables were built by another backend".into(),
                        )
                    })?;
                let (embed, lm_head) = *new;
                for (old, new) in [(&self.embed, &embed), (&self.lm_head, &lm_head)] {
                    if old.shape() != new.shape() {
                        return Err(EngineError::Config(format!(
                            "replacement vocabulary table has shape {:?}, expected {:?}",
                            new.shape(),
                            old.shape()
                        )));
                    }
                }
                Some((embed, lm_head))
            }
            None => None,
        };
        for (g, new) in ready {
            if let Some(r) = &self.reference {
                if new.residency().has_float() {
                    r.forget(g);
                }
            }
            // The replaced forms (e.g. a float copy no longer wanted) are freed here.
            self.layers[g.layer].groups[g.kind.index()] = new;
        }
        if let Some((embed, lm_head)) = tables {
            // The form they hold (a width without a quantized form keeps f16).
            self.forms.embeddings = embed.form();
            self.embed = embed;
            self.lm_head = lm_head;
        }
        Ok(())
    }

    fn group_loader(&self) -> GroupLoader {
        prepare_group
    }

    fn table_loader(&self) -> TableLoader {
        prepare_tables
    }

    fn pass(
        &self,
        step: &StepInput,
        router: &mut dyn Router,
        kv: &mut KvCache,
    ) -> Result<PassOutput> {
        let dev = Device::Cpu;
        let cfg = &self.cfg;
        let (hd, nh, nkv) = (cfg.head_dim(), cfg.num_attention_heads, cfg.num_kv_heads());
        let kv_dim = nkv * hd;
        let ids: Vec<u32> = step
            .chunks
            .iter()
            .flat_map(|c| c.tokens.iter().copied())
            .collect();
        let n = ids.len();
        let mut out = PassOutput::default();
        if n == 0 {
            return Ok(out);
        }
        let rows = step.rows();
        if let Some(&(_, p)) = rows.iter().find(|(_, p)| *p >= cfg.max_position_embeddings) {
            return Err(EngineError::InvalidRequest(format!(
                "position {p} exceeds max_position_embeddings {}",
                cfg.max_position_embeddings
            )));
        }
        let pos: Vec<u32> = rows.iter().map(|(_, p)| *p as u32).collect();
        let pos = Tensor::new(pos.as_slice(), &dev)?;
        // The rows' RoPE tables, `[row][head_dim / 2]`.
        let cos = self
            .cos
            .index_select(&pos, 0)?
            .flatten_all()?
            .to_vec1::<f32>()?;
        let sin = self
            .sin
            .index_select(&pos, 0)?
            .flatten_all()?
            .to_vec1::<f32>()?;
        let mut x = self.embed.rows(&ids)?;

        for (l, layer) in self.layers.iter().enumerate() {
            let g = |kind| GroupId::new(l, kind);
            // --- attention ---
            let h = norm_rows(&x, &layer.input_norm, cfg.rms_norm_eps)?;
            let qkv = self.run_group(layer, g(GroupKind::Qkv), &h, router)?;
            let (q_rows, k_rows, v_rows) = split_qkv_with_rope(&qkv, (nh, nkv, hd), &cos, &sin)?;
            let layer_int8 = router.kv_int8(l);
            let mut attn = vec![0f32; n * nh * hd];
            // Every chunk's new keys and values first (each writes only its own new slots,
            // never a page another chunk reads: shared pages are copied before a write).
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
                row += c.tokens.len();
            }
            let width = nh * hd;
            if step.chunks.len() >= 2 && step.chunks.iter().all(|c| c.tokens.len() == 1) {
                // A decode step: one row per sequence, each sequence's gather and attention
                // a job of its own on the pool (one row's attention is too small to split).
                let kv = &*kv;
                let mut jobs: Vec<_> = step
                    .chunks
                    .iter()
                    .zip(q_rows.chunks_exact(width))
                    .zip(attn.chunks_exact_mut(width))
                    .map(|((c, q), out)| (c, q, out, Ok(())))
                    .collect();
                quantmesh_kernels::Pool::global().for_each_mut(&mut jobs, |(c, q, out, done)| {
                    *done = kv.attend(l, &c.block_table, c.start_pos, q, 1, nh, hd, out);
                });
                for (_, _, _, done) in jobs {
                    done?;
                }
            } else {
                let mut row = 0;
                for c in &step.chunks {
                    let m = c.tokens.len();
                    let span = row * width..(row + m) * width;
                    kv.attend(
                        l,
                        &c.block_table,
                        c.start_pos,
                        &q_rows[span.clone()],
                        m,
                        nh,
                        hd,
                        &mut attn[span],
                    )?;
                    row += m;
                }
            }
            let attn = Tensor::from_vec(attn, (n, nh * hd), &dev)?;
            x = (x + self.run_group(layer, g(GroupKind::O), &attn, router)?)?;
            // --- MLP ---
            let h = norm_rows(&x, &layer.post_norm, cfg.rms_norm_eps)?;
            let gu = self.run_group(layer, g(GroupKind::GateUp), &h, router)?;
            let inter = cfg.intermediate_size;
            let mut act = swiglu_rows(&gu, inter)?;
            let down = g(GroupKind::Down);
            let down_path = router.route(down, &act)?;
            let coupled = router.coupled_gate_up_rows(l);
            let gate_up = &layer.groups[GroupKind::GateUp.index()];
            if !coupled.is_empty() && gate_up.residency().has_float() {
                let idx: Vec<u32> = coupled.iter().map(|&r| r as u32).collect();
                let idx = Tensor::new(idx.as_slice(), &dev)?;
                let (gu_f, o) = gate_up.forward(
                    &h.index_select(&idx, 0)?,
                    &RowPath::AllFloat,
                    self.forms.split,
                )?;
                router.record(g(GroupKind::GateUp), o);
                act = replace_rows(&act, &coupled, &swiglu_rows(&gu_f, inter)?)?;
            }
            let (y, o) = self.forward_group(layer, down, &act, &down_path)?;
            router.record(down, o);
            x = (x + y)?;
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
            let last = norm_rows(&last, &self.norm, cfg.rms_norm_eps)?;
            // The Q8_0 output table has no float copy and the monitor does not watch it:
            // its activations carry 16 bits under every mode but `off`.
            let logits = self
                .lm_head
                .project(&last, self.forms.split.splits_table())?
                .to_dtype(DType::F32)?
                .to_vec2::<f32>()?;
            out.logits = want.into_iter().map(|(s, _)| s).zip(logits).collect();
        }
        Ok(out)
    }
}
