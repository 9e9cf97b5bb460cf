//! The Llama layer's operations, one implementation for every user: the engine's CPU
//! backend runs them over a step's rows (with paged attention of its own), the pre-screen
//! over the calibration batch (with [`causal_attention`]). Tensors are f32 on the CPU.

use crate::checkpoint::Checkpoint;
use crate::config::ModelConfig;
use crate::error::Result;
use crate::names;
use candle_core::{Device, Tensor, D};
use quantmesh_types::{GroupId, GroupKind};

/// RMSNorm over the last dimension: `x / sqrt(mean(x²) + eps) · w`.
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

/// SwiGLU: `silu(gate) · up` — the input of `down`.
pub fn swiglu(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    Ok((gate.silu()? * up)?)
}

/// SwiGLU over the fused `gate_up` output `[rows, 2·inter]` (gate first).
pub fn swiglu_fused(gate_up: &Tensor, inter: usize) -> Result<Tensor> {
    swiglu(
        &gate_up.narrow(1, 0, inter)?,
        &gate_up.narrow(1, inter, inter)?,
    )
}

/// Causal attention of one whole sequence: q `[n, nh, hd]`, k/v `[n, nkv, hd]` →
/// `[n, nh·hd]` (grouped-query heads shared in order). The reference the engine's paged
/// attention is tested against, and the pre-screen's attention.
pub fn causal_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    nh: usize,
    nkv: usize,
) -> Result<Tensor> {
    let (n, _, hd) = q.dims3()?;
    let rep = nh / nkv;
    let expand = |t: &Tensor| -> candle_core::Result<Tensor> {
        let t = t.transpose(0, 1)?.contiguous()?; // [nkv, n, hd]
        t.unsqueeze(1)?
            .expand((nkv, rep, n, hd))?
            .reshape((nh, n, hd))
    };
    let q = q.transpose(0, 1)?.contiguous()?;
    let (k, v) = (expand(k)?, expand(v)?);
    let scores = (q.matmul(&k.t()?)? / (hd as f64).sqrt())?;
    let mask: Vec<f32> = (0..n * n)
        .map(|i| {
            if i % n > i / n {
                f32::NEG_INFINITY
            } else {
                0.0
            }
        })
        .collect();
    let mask = Tensor::from_vec(mask, (n, n), q.device())?;
    let scores = scores.broadcast_add(&mask)?;
    let max = scores.max_keepdim(D::Minus1)?;
    let e = scores.broadcast_sub(&max)?.exp()?;
    let p = e.broadcast_div(&e.sum_keepdim(D::Minus1)?)?;
    Ok(p.matmul(&v)?.transpose(0, 1)?.reshape((n, nh * hd))?)
}

fn softmax64(l: &[f32]) -> Vec<f64> {
    let m = l.iter().cloned().fold(f32::NEG_INFINITY, f32::max) as f64;
    let e: Vec<f64> = l.iter().map(|x| (*x as f64 - m).exp()).collect();
    let z: f64 = e.iter().sum();
    e.into_iter().map(|x| x / z).collect()
}

/// −log softmax(logits)[token] in nats (+∞ for a token outside the logits).
pub fn nll_logits(logits: &[f32], token: u32) -> f64 {
    let m = logits.iter().cloned().fold(f32::NEG_INFINITY, f32::max) as f64;
    let z: f64 = logits.iter().map(|x| (*x as f64 - m).exp()).sum();
    match logits.get(token as usize) {
        Some(x) => -(*x as f64 - m - z.ln()),
        None => f64::INFINITY,
    }
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

/// The checkpoint shapes `[out, in]` of a group's members, in [`names::members`] order.
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

/// One fused group's exact float weights: members' rows concatenated `[Σ out, in]`, and
/// the concatenated bias when the group has one.
pub struct GroupWeights {
    pub weight: Tensor,
    pub bias: Option<Tensor>,
}

impl GroupWeights {
    /// Read group `g` from the checkpoint, every member checked against the config's shape.
    /// A fused group's members are all biased or none is: a missing member bias is a
    /// checkpoint error naming it.
    pub fn load(ck: &Checkpoint, cfg: &ModelConfig, g: GroupId) -> Result<Self> {
        let tensors = names::group_tensors(g);
        let shapes = member_shapes(cfg, g.kind);
        let with_bias = (g.kind == GroupKind::Qkv && cfg.has_qkv_bias())
            || tensors.iter().any(|(_, b)| ck.contains(b));
        let mut ws = Vec::with_capacity(tensors.len());
        let mut bs = Vec::new();
        for ((weight, bias), shape) in tensors.iter().zip(&shapes) {
            ws.push(ck.load_f32_shaped(weight, shape)?);
            if with_bias {
                bs.push(ck.load_f32_shaped(bias, &[shape[0]])?);
            }
        }
        let weight = Tensor::cat(&ws, 0)?;
        drop(ws);
        let bias = if bs.is_empty() {
            None
        } else {
            Some(Tensor::cat(&bs, 0)?)
        };
        Ok(Self { weight, bias })
    }
}
