//! The walk: calibration tokens go through the float model one layer at a time, and each
//! linear group is scored when its input is known. Weights are read from the memory-mapped
//! checkpoint one member tensor at a time (three short passes per tensor: range + output,
//! histograms, quantile refinement; a fourth, the whole tensor at once, when scale migration
//! is on: the served W8A8 error with and without the factors) and their pages released after
//! each pass, so peak memory is about one tensor in f32 plus the calibration activations —
//! never a layer, never the model.

use crate::metrics::{activation_stats, dispersion, kl_hist, Gram, Hist, Quantiles, Range};
use crate::quant::{fake_quant, Format};
use crate::rules::{Rules, Scores};
use crate::smoothing::{self, Candidate, ColumnMax, ServedError};
use crate::PrescreenError;
use candle_core::{Device, Tensor};
use quantmesh_kernels::{ColumnError, ColumnErrorSum, PackedQ8, Q8Layout};
use quantmesh_model::ops::{causal_attention, member_shapes, rms_norm, rope, rope_tables, swiglu};
use quantmesh_model::{names, Checkpoint, ModelConfig, ModelError};
use quantmesh_types::sensitive::{
    Act8Nsr, ActivationStats, GroupMetrics, HarmByBits, KlByFormat, ResidualByBits, Smoothing,
};
use quantmesh_types::{GroupEntry, GroupId, GroupKind, PrecisionClass};

/// Output rows computed per block when projecting pseudo-quantized weights (bounds the
/// dequantized copy to `ROW_BLOCK × in` floats).
const ROW_BLOCK: usize = 256;
/// R is capped here so it stays a finite JSON number (a zero IQR makes it infinite).
const R_CAP: f64 = 1e9;

/// The calibration batch: every prompt's tokens back to back.
pub struct Batch {
    pub tokens: Vec<u32>,
    /// (start, len) of each prompt in `tokens`.
    pub seqs: Vec<(usize, usize)>,
    /// Absolute position of each token.
    pub positions: Vec<u32>,
    /// Row indices that count in statistics (every position but 0, the attention sink).
    pub keep: Tensor,
    /// The rows the output KL is computed on: `keep`, or an evenly spaced subset of at most
    /// `kl_tokens` of them (the pseudo-quantized projections cost 3 matmuls per group, the
    /// float forward only 1, so this bounds the pre-screen's compute).
    pub kl_rows: Tensor,
}

impl Batch {
    pub fn new(prompts: &[Vec<u32>], kl_tokens: usize) -> Result<Self, PrescreenError> {
        let mut tokens = Vec::new();
        let mut seqs = Vec::new();
        let mut positions = Vec::new();
        let mut keep = Vec::new();
        for p in prompts {
            seqs.push((tokens.len(), p.len()));
            for (i, t) in p.iter().enumerate() {
                if i > 0 {
                    keep.push(tokens.len() as u32);
                }
                tokens.push(*t);
                positions.push(i as u32);
            }
        }
        if keep.is_empty() {
            return Err(PrescreenError::Calibration(
                "the calibration prompts hold no token beyond position 0".into(),
            ));
        }
        let n = keep.len();
        let want = kl_tokens.clamp(1, n);
        let kl: Vec<u32> = (0..want).map(|i| keep[i * n / want]).collect();
        Ok(Self {
            tokens,
            seqs,
            positions,
            kl_rows: Tensor::from_vec(kl, want, &Device::Cpu)?,
            keep: Tensor::from_vec(keep, n, &Device::Cpu)?,
        })
    }
}

/// Reports progress: one tick per member tensor scored.
pub trait Progress {
    fn tensor_done(&self, name: &str);
}

/// What every step of the walk reads.
pub struct Ctx<'a> {
    pub ck: &'a Checkpoint,
    pub cfg: &'a ModelConfig,
    pub batch: &'a Batch,
    /// RoPE (cos, sin) of every calibration token's position, one row per token.
    pub rope: &'a (Tensor, Tensor),
    pub rules: &'a Rules,
    pub progress: &'a dyn Progress,
}

/// The formats a weight budget chooses between (8 bits, 4 bits): the formats whose error is
/// followed into the residual stream.
const BITS_FORMATS: [Format; 2] = [Format::W8a8PerChannel, Format::W4a16];

/// A group's outputs on the KL rows, kept so the layer can follow its quantization error
/// into the residual stream: per member, the float output, and per [`BITS_FORMATS`] entry
/// the pseudo-quantized output and the float weights applied to the incoming error
/// (`carry`). For `qkv`, the pseudo-quantized outputs on every row too (attention mixes
/// positions).
struct Probe {
    float: Vec<Tensor>,
    quant: [Vec<Tensor>; 2],
    carried: [Vec<Tensor>; 2],
    quant_all_rows: Option<[Vec<Tensor>; 2]>,
}

impl Probe {
    /// Per bits format: the quantized output minus the float one, members side by side.
    fn own_error(&self) -> Result<[Tensor; 2], PrescreenError> {
        let p = Tensor::cat(&self.float, 1)?;
        let e = |f: usize| -> Result<Tensor, PrescreenError> {
            Ok((Tensor::cat(&self.quant[f], 1)? - &p)?)
        };
        Ok([e(0)?, e(1)?])
    }

    /// Per bits format: the incoming error through this group's float weights.
    fn carried_error(&self) -> Result<[Tensor; 2], PrescreenError> {
        Ok([
            Tensor::cat(&self.carried[0], 1)?,
            Tensor::cat(&self.carried[1], 1)?,
        ])
    }
}

/// A scored group.
pub struct Scored {
    pub entry: GroupEntry,
    /// Parameters of the group (for the memory summary).
    pub params: usize,
    /// Output rows (all members) and input width.
    pub rows: usize,
    pub cols: usize,
    /// Bytes of its weights as stored in the checkpoint.
    pub stored_bytes: usize,
}

struct Member {
    weight: String,
    bias: Option<String>,
    shape: [usize; 2],
}

fn members(ck: &Checkpoint, cfg: &ModelConfig, g: GroupId) -> Vec<Member> {
    names::group_tensors(g)
        .into_iter()
        .zip(member_shapes(cfg, g.kind))
        .map(|((weight, b), shape)| Member {
            weight,
            bias: ck.contains(&b).then_some(b),
            shape,
        })
        .collect()
}

/// Rows `start..start + n` of a member's weight, decoded from the mapped checkpoint.
fn rows(ck: &Checkpoint, m: &Member, start: usize, n: usize) -> Result<Vec<f32>, PrescreenError> {
    Ok(ck.read_rows_f32(&m.weight, start, n)?)
}

/// Check a member's stored shape against the config before reading it; returns its
/// stored size in bytes.
fn check_shape(ck: &Checkpoint, m: &Member) -> Result<usize, PrescreenError> {
    let info = ck.info(&m.weight)?;
    if info.shape != m.shape {
        return Err(PrescreenError::Model(ModelError::checkpoint(
            &info.file,
            Some(&m.weight),
            format!(
                "shape {:?} does not match the config's {:?}",
                info.shape, m.shape
            ),
        )));
    }
    Ok(info.bytes)
}

/// The row blocks of a `[out, in]` matrix: (first row, rows).
fn blocks(out: usize) -> impl Iterator<Item = (usize, usize)> {
    (0..out)
        .step_by(ROW_BLOCK)
        .map(move |s| (s, ROW_BLOCK.min(out - s)))
}

/// `x · Wᵀ (+ b)` for one block of output rows. The float outputs and the pseudo-quantized
/// outputs go through this with the same blocks, so identical weights give bit-identical
/// outputs (KL exactly 0).
fn project_block(
    x: &Tensor,
    block: &[f32],
    (start, n): (usize, usize),
    bias: Option<&Tensor>,
) -> Result<Tensor, PrescreenError> {
    let inp = block.len() / n.max(1);
    let wb = Tensor::from_slice(block, (n, inp), &Device::Cpu)?;
    let mut y = x.matmul(&wb.t()?)?;
    if let Some(b) = bias {
        y = y.broadcast_add(&b.narrow(0, start, n)?)?;
    }
    Ok(y)
}

/// A scoped thread's result; its panic goes on in the caller, as if it had run there.
fn joined<T>(h: std::thread::ScopedJoinHandle<'_, T>) -> T {
    h.join().unwrap_or_else(|p| std::panic::resume_unwind(p))
}

/// One block of a member's weights pseudo-quantized in `format`, and its projections: on the
/// KL rows, and on every row when `every_row` and the format is one of [`BITS_FORMATS`].
/// Returns (the pseudo-quantized weights, the KL rows' outputs, every row's outputs).
#[allow(clippy::too_many_arguments)]
fn pseudo_quant_block(
    format: Format,
    w: &[f32],
    cols: usize,
    absmax: f32,
    blk: (usize, usize),
    x_kl: &Tensor,
    x: &Tensor,
    bias: Option<&Tensor>,
    every_row: bool,
) -> Result<(Vec<f32>, Tensor, Option<Tensor>), PrescreenError> {
    let mut q = w.to_vec();
    fake_quant(&mut q, cols, format, absmax);
    let kl_rows = project_block(x_kl, &q, blk, bias)?;
    let all = match every_row && BITS_FORMATS.contains(&format) {
        true => Some(project_block(x, &q, blk, bias)?),
        false => None,
    };
    Ok((q, kl_rows, all))
}

fn kept_values(t: &Tensor, keep: &Tensor) -> Result<Vec<f32>, PrescreenError> {
    Ok(t.index_select(keep, 0)?.flatten_all()?.to_vec1::<f32>()?)
}

/// Score one fused group on input `x` (`[tokens, in]`). Returns the group's outputs
/// (one tensor per member, float weights, bias added) and its entry.
fn score_group(
    ctx: &Ctx<'_>,
    g: GroupId,
    x: &Tensor,
    carry: Option<&[Tensor; 2]>,
) -> Result<(Vec<Tensor>, Scored, Probe), PrescreenError> {
    let (ck, cfg, batch, rules) = (ctx.ck, ctx.cfg, ctx.batch, ctx.rules);
    let ms = members(ck, cfg, g);
    let in_dim = ms[0].shape[1];
    let total_out: usize = ms.iter().map(|m| m.shape[0]).sum();
    let biases: Vec<Option<Tensor>> = ms
        .iter()
        .map(|m| m.bias.as_ref().map(|b| ck.load_f32(b)).transpose())
        .collect::<Result<_, _>>()?;

    // Pass 1: range of the weights, energy (Gram), float outputs (all rows, and the KL rows
    // through the same projection the pseudo-quantized weights will take).
    let x_kl = x.index_select(&batch.kl_rows, 0)?;
    let mut p_outputs = Vec::with_capacity(ms.len());
    let mut range = Range::default();
    let mut gram = Gram::new(if in_dim <= total_out {
        in_dim
    } else {
        total_out
    });
    let mut outputs = Vec::with_capacity(ms.len());
    let mut probe = Probe {
        float: Vec::with_capacity(ms.len()),
        quant: [Vec::new(), Vec::new()],
        carried: [Vec::new(), Vec::new()],
        quant_all_rows: (g.kind == GroupKind::Qkv).then(|| [Vec::new(), Vec::new()]),
    };
    let mut stored_bytes = 0;
    let mut weight_max = ColumnMax::new(in_dim);
    for (m, b) in ms.iter().zip(&biases) {
        stored_bytes += check_shape(ck, m)?;
        let (out, _) = (m.shape[0], m.shape[1]);
        let mut y_parts = Vec::new();
        let mut p_parts = Vec::new();
        let mut c_parts = [Vec::new(), Vec::new()];
        for blk in blocks(out) {
            let w = rows(ck, m, blk.0, blk.1)?;
            range.add(&w);
            weight_max.add(&w);
            if in_dim <= total_out {
                gram.add_rows(&w)?;
            }
            y_parts.push(project_block(x, &w, blk, b.as_ref())?);
            p_parts.push(project_block(&x_kl, &w, blk, b.as_ref())?);
            if let Some(carry) = carry {
                for (part, c) in c_parts.iter_mut().zip(carry) {
                    part.push(project_block(c, &w, blk, None)?);
                }
            }
        }
        outputs.push(Tensor::cat(&y_parts, 1)?);
        let p = Tensor::cat(&p_parts, 1)?;
        p_outputs.push(p.flatten_all()?.to_vec1::<f32>()?);
        probe.float.push(p);
        if carry.is_some() {
            for (to, part) in probe.carried.iter_mut().zip(&c_parts) {
                to.push(Tensor::cat(part, 1)?);
            }
        }
        if in_dim > total_out {
            // Only single-member groups are wider than tall (e.g. down): G = W·Wᵀ, tile by
            // tile, each tile decoded from the mapped bytes when needed.
            gram.add_outer_with(in_dim, |s, n| rows(ck, m, s, n))?;
        }
        ck.release(&m.weight);
    }
    let energy = gram.energy_ratio()?;
    drop(gram);

    // Output range of the float outputs on the KL rows, for the KL histograms.
    let mut out_range = Range::default();
    for y in &p_outputs {
        out_range.add(y);
    }
    let mut p_hist = Hist::new(out_range.min, out_range.max);
    for y in &p_outputs {
        p_hist.add(y);
    }
    drop(p_outputs);
    let mut q_hists: Vec<Hist> = Format::ALL
        .iter()
        .map(|_| Hist::new(out_range.min, out_range.max))
        .collect();

    // Pass 2: quantile histogram, pseudo-quantized outputs.
    let mut quant = Quantiles::new(range);
    let absmax = range.absmax();
    // What the served 4- and 8-bit forms (q4_s8, Q8_0) do to each input column, for their
    // calibrated harm.
    let mut four_bit_error = ColumnErrorSum::new(in_dim);
    let mut eight_bit_error = ColumnErrorSum::new(in_dim);
    for (m, b) in ms.iter().zip(&biases) {
        let mut parts: Vec<Vec<Tensor>> = vec![Vec::new(); Format::ALL.len()];
        let mut all_rows: [Vec<Tensor>; 2] = [Vec::new(), Vec::new()];
        let all_rows_too = probe.quant_all_rows.is_some();
        for blk in blocks(m.shape[0]) {
            let w = rows(ck, m, blk.0, blk.1)?;
            // Each format's pseudo-quantized block and its projections on a thread of its
            // own (independent work: the same bits as one after another), while this thread
            // counts the quantiles and the 8-bit error.
            let projected: Vec<_> = std::thread::scope(|sc| {
                let each: Vec<_> = Format::ALL
                    .iter()
                    .map(|f| {
                        let (w, x_kl, bias) = (&w, &x_kl, b.as_ref());
                        sc.spawn(move || {
                            pseudo_quant_block(
                                *f,
                                w,
                                m.shape[1],
                                absmax,
                                blk,
                                x_kl,
                                x,
                                bias,
                                all_rows_too,
                            )
                        })
                    })
                    .collect();
                quant.count(&w);
                if let Ok(q8) = PackedQ8::quantize_in(&w, blk.1, m.shape[1], Q8Layout::RowTiles) {
                    eight_bit_error.add(&w, &q8.dequantize());
                }
                each.into_iter().map(joined).collect()
            });
            for ((f, part), got) in Format::ALL.iter().zip(parts.iter_mut()).zip(projected) {
                let (q, kl_rows, every_row) = got?;
                if *f == Format::W4a16 {
                    four_bit_error.add(&w, &q);
                }
                part.push(kl_rows);
                if let (Some(k), Some(y)) = (BITS_FORMATS.iter().position(|b| b == f), every_row) {
                    all_rows[k].push(y);
                }
            }
        }
        // One histogram per format, each on a thread of its own.
        std::thread::scope(|sc| {
            let each: Vec<_> = parts
                .iter()
                .zip(q_hists.iter_mut())
                .map(|(part, h)| {
                    sc.spawn(move || -> Result<(), PrescreenError> {
                        h.add(&Tensor::cat(part, 1)?.flatten_all()?.to_vec1::<f32>()?);
                        Ok(())
                    })
                })
                .collect();
            each.into_iter().map(joined).collect::<Result<Vec<()>, _>>()
        })?;
        for (to, (_, part)) in probe.quant.iter_mut().zip(
            Format::ALL
                .iter()
                .zip(&parts)
                .filter(|(f, _)| BITS_FORMATS.contains(f)),
        ) {
            to.push(Tensor::cat(part, 1)?);
        }
        if let Some(to) = probe.quant_all_rows.as_mut() {
            for (to, part) in to.iter_mut().zip(&all_rows) {
                to.push(Tensor::cat(part, 1)?);
            }
        }
        ck.release(&m.weight);
    }
    quant.locate();

    // Pass 3: exact quartiles.
    for m in &ms {
        for (start, n) in blocks(m.shape[0]) {
            quant.collect(&rows(ck, m, start, n)?);
        }
        ck.release(&m.weight);
        ctx.progress.tensor_done(&m.weight);
    }
    let (q1, q3) = quant.finish();
    let r = dispersion(&range, q1, q3).min(R_CAP);
    let kl: Vec<f64> = q_hists.iter().map(|q| kl_hist(&p_hist, q)).collect();
    let scores = Scores {
        r,
        energy,
        kl_w8a8: kl[0],
        kl_w8a8_per_channel: kl[1],
        kl_w4a16: kl[2],
    };
    let (class, rule) = rules.classify(&scores);

    let xs = kept_values(x, &batch.keep)?;
    let (four_bit_error, eight_bit_error) = (four_bit_error.finish(), eight_bit_error.finish());
    // Four reads of the same rows, independent of each other: the activation statistics and
    // the column maxima here, each row's harm in 4 and in 8 bits on threads of their own.
    let (act, act_max, four_bit_harm, eight_bit_harm) = std::thread::scope(|sc| {
        let xs = &xs;
        let four = sc.spawn(|| row_harm(&four_bit_error, xs));
        let eight = sc.spawn(|| row_harm(&eight_bit_error, xs));
        let act = activation_stats(xs, in_dim, rules.massive_rule());
        let mut act_max = ColumnMax::new(in_dim);
        act_max.add(xs);
        (act, act_max, joined(four), joined(eight))
    });
    drop(xs);
    // Each row's harm in 4 bits once: its mean and the bound come from the same values.
    let four_bit_mean = mean(&four_bit_harm);
    let max_nsr_w4a16 = harm_bound(four_bit_harm, rules.hook.trigger_rate);
    let nsr = four_bit_mean
        .zip(mean(&eight_bit_harm))
        .map(|(four, eight)| HarmByBits {
            w8a8: round12(eight),
            w4a16: round12(four),
        });
    // Pass 4: the served W8A8 error (what 8-bit activations cost this group, the budget's
    // rank where the engine serves them), and with scale migration on and enough tokens for
    // factors, the error with each strength's candidate factors.
    let candidates = if batch.tokens.len() >= rules.smoothing_min_tokens {
        rules
            .smoothing_strengths()
            .into_iter()
            .map(|alpha| Candidate {
                alpha,
                exps: smoothing::exponents(act_max.values(), weight_max.values(), alpha),
            })
            .collect()
    } else {
        Vec::new()
    };
    let block = quantmesh_kernels::rotation_block(in_dim, rules.rotation_block.max(1) as usize);
    let (act8_nsr, smoothing) = match ServedError::new(&x_kl, candidates, block)? {
        Some(mut served) => {
            for ((m, b), float) in ms.iter().zip(&biases).zip(&probe.float) {
                let w = rows(ck, m, 0, m.shape[0])?;
                served.add(&w, m.shape[0], b.as_ref(), float)?;
                ck.release(&m.weight);
            }
            let served = served.finish();
            // No candidate factors: "smoothed" is the group as served, unsmoothed.
            let smoothed = served.smoothed.as_ref().map_or(served.plain, |(e, _)| *e);
            let act8 = Act8Nsr {
                plain: round12(served.plain),
                smoothed: round12(smoothed),
            };
            let keep = served
                .smoothed
                .filter(|(e, _)| *e <= rules.smoothing_gain * served.plain)
                .map(|(_, best)| Smoothing::new(best.alpha, &best.exps));
            (Some(act8), keep)
        }
        None => (None, None),
    };
    let residual_input = matches!(g.kind, GroupKind::Qkv | GroupKind::GateUp);
    let entry = GroupEntry {
        class,
        residency: None,
        rule: Some(rule),
        metrics: Some(GroupMetrics {
            r: round6(r),
            kl: KlByFormat {
                w8a8: round9(kl[0]),
                w8a8_per_channel: round9(kl[1]),
                w4a16: round9(kl[2]),
            },
            energy: round6(energy),
            // Filled in by `layer` once the error has reached the residual stream.
            residual: None,
            max_nsr_w4a16: max_nsr_w4a16.map(round9),
            nsr,
            act8_nsr,
        }),
        activations: Some(ActivationStats {
            absmax: round6(act.absmax),
            kurtosis: round6(act.kurtosis),
            quantile_score: round6(act.quantile_score),
            top_channels: act
                .top_channels
                .iter()
                .map(|(c, v)| (*c, round6(*v)))
                .collect(),
        }),
        monitor: None,
        massive_channels: if residual_input {
            act.massive_channels
        } else {
            Vec::new()
        },
        observed: None,
        smoothing,
    };
    Ok((
        outputs,
        Scored {
            entry,
            params: total_out * in_dim,
            rows: total_out,
            cols: in_dim,
            stored_bytes,
        },
        probe,
    ))
}

/// Each calibration row's harm (output noise-to-signal ratio, the monitor's statistic) with
/// these column errors; `xs` row-major, as wide as `errors`.
fn row_harm(errors: &ColumnError, xs: &[f32]) -> Vec<f32> {
    match errors.in_dim() {
        0 => Vec::new(),
        width => xs.chunks_exact(width).map(|x| errors.nsr(x)).collect(),
    }
}

/// The harm that a `share` of the calibration rows exceed (`harm`: one value per row): the
/// bound under which traffic like the calibration set stays at the trigger rate. `None`
/// without rows.
pub fn harm_bound(mut harm: Vec<f32>, share: f64) -> Option<f64> {
    if harm.is_empty() {
        return None;
    }
    harm.sort_by(f32::total_cmp);
    // The largest value with at most `share` of the rows strictly above it.
    let n = harm.len();
    let above = ((share.clamp(0.0, 1.0) * n as f64).floor() as usize).min(n - 1);
    Some(harm[n - 1 - above] as f64)
}

/// The mean of the rows' harm (`None` without rows).
fn mean(harm: &[f32]) -> Option<f64> {
    (!harm.is_empty()).then(|| harm.iter().map(|&h| h as f64).sum::<f64>() / harm.len() as f64)
}

/// Values are written rounded (6 significant decimals for R/energy/stats, 9 for KL) so the
/// file reads well; the classification used the unrounded values.
fn round6(v: f64) -> f64 {
    (v * 1e6).round() / 1e6
}
fn round9(v: f64) -> f64 {
    (v * 1e9).round() / 1e9
}
/// Harm in 8 bits is ~1e-7 on float weights: kept to 12 decimals.
fn round12(v: f64) -> f64 {
    (v * 1e12).round() / 1e12
}

/// Score every group of one layer and return the layer's output hidden states.
pub fn layer(
    ctx: &Ctx<'_>,
    l: usize,
    h: Tensor,
) -> Result<(Tensor, Vec<(GroupId, Scored)>), PrescreenError> {
    let (ck, cfg, batch) = (ctx.ck, ctx.cfg, ctx.batch);
    let hsz = cfg.hidden_size;
    let eps = cfg.rms_norm_eps;
    let mut scored = Vec::with_capacity(4);
    let norm_in = ck.load_f32_shaped(&names::input_norm(l), &[hsz])?;
    let x = rms_norm(&h, &norm_in, eps)?;
    let g = GroupId::new(l, GroupKind::Qkv);
    let (qkv, s, qkv_probe) = score_group(ctx, g, &x, None)?;
    scored.push((g, s));
    drop(x);
    let a = attend(ctx, &qkv)?;
    drop(qkv);
    // qkv's error through attention, on the KL rows, for `o` to carry on.
    let a_kl = a.index_select(&batch.kl_rows, 0)?;
    let mut qkv_out = Vec::with_capacity(2);
    for quant in qkv_probe.quant_all_rows.iter().flatten() {
        qkv_out.push((attend(ctx, quant)?.index_select(&batch.kl_rows, 0)? - &a_kl)?);
    }
    let qkv_err: [Tensor; 2] = qkv_out
        .try_into()
        .map_err(|_| PrescreenError::Calibration("qkv probe without its rows".into()))?;
    drop(qkv_probe);
    let g = GroupId::new(l, GroupKind::O);
    let (o, s, o_probe) = score_group(ctx, g, &a, Some(&qkv_err))?;
    scored.push((g, s));
    let h = (h + &o[0])?;
    let norm_post = ck.load_f32_shaped(&names::post_norm(l), &[hsz])?;
    let x = rms_norm(&h, &norm_post, eps)?;
    let g = GroupId::new(l, GroupKind::GateUp);
    let (gu, s, gu_probe) = score_group(ctx, g, &x, None)?;
    scored.push((g, s));
    let m = swiglu(&gu[0], &gu[1])?;
    drop(gu);
    // gate_up's error through SwiGLU, for `down` to carry on.
    let m_kl = swiglu(&gu_probe.float[0], &gu_probe.float[1])?;
    let gu_err = [
        (swiglu(&gu_probe.quant[0][0], &gu_probe.quant[0][1])? - &m_kl)?,
        (swiglu(&gu_probe.quant[1][0], &gu_probe.quant[1][1])? - &m_kl)?,
    ];
    let g = GroupId::new(l, GroupKind::Down);
    let (d, s, d_probe) = score_group(ctx, g, &m, Some(&gu_err))?;
    scored.push((g, s));
    let h = (h + &d[0])?;
    // Each group's error as it reaches the residual stream, against the stream's energy
    // after the layer.
    let energy = h
        .index_select(&batch.kl_rows, 0)?
        .sqr()?
        .sum_all()?
        .to_scalar::<f32>()? as f64;
    let errors = [
        o_probe.carried_error()?,
        o_probe.own_error()?,
        d_probe.carried_error()?,
        d_probe.own_error()?,
    ];
    for ((_, s), [e8, e4]) in scored.iter_mut().zip(errors) {
        let rel = |e: Tensor| -> Result<f64, PrescreenError> {
            Ok(e.sqr()?.sum_all()?.to_scalar::<f32>()? as f64 / energy.max(f64::MIN_POSITIVE))
        };
        if let Some(m) = s.entry.metrics.as_mut() {
            m.residual = Some(ResidualByBits {
                w8a8_per_channel: round9(rel(e8)?),
                w4a16: round9(rel(e4)?),
            });
        }
    }
    Ok((h, scored))
}

/// Causal attention over the calibration sequences of a `qkv` group's outputs (q, k, v).
fn attend(ctx: &Ctx<'_>, qkv: &[Tensor]) -> Result<Tensor, PrescreenError> {
    let (cfg, batch, (cos, sin)) = (ctx.cfg, ctx.batch, ctx.rope);
    let (hd, nh, nkv) = (cfg.head_dim(), cfg.num_attention_heads, cfg.num_kv_heads());
    let n = batch.tokens.len();
    let q = rope(&qkv[0].reshape((n, nh, hd))?, cos, sin)?;
    let k = rope(&qkv[1].reshape((n, nkv, hd))?, cos, sin)?;
    let v = qkv[2].reshape((n, nkv, hd))?;
    let mut outs = Vec::with_capacity(batch.seqs.len());
    for &(start, len) in &batch.seqs {
        outs.push(causal_attention(
            &q.narrow(0, start, len)?,
            &k.narrow(0, start, len)?,
            &v.narrow(0, start, len)?,
            nh,
            nkv,
        )?);
    }
    Ok(Tensor::cat(&outs, 0)?)
}

/// Embed the calibration tokens (one read of the embedding table).
pub fn embed(ck: &Checkpoint, cfg: &ModelConfig, batch: &Batch) -> Result<Tensor, PrescreenError> {
    let name = names::EMBED;
    let e = ck.load_f32_shaped(name, &[cfg.vocab_size, cfg.hidden_size])?;
    let ids = Tensor::from_slice(&batch.tokens, batch.tokens.len(), &Device::Cpu)?;
    let h = e.index_select(&ids, 0)?;
    drop(e);
    ck.release(name);
    Ok(h)
}

/// RoPE (cos, sin) for every calibration token, gathered once by its position.
pub fn rope_for(cfg: &ModelConfig, batch: &Batch) -> Result<(Tensor, Tensor), PrescreenError> {
    let longest = batch.seqs.iter().map(|s| s.1).max().unwrap_or(1);
    let (cos, sin) = rope_tables(cfg, longest.max(1))?;
    let pos = Tensor::from_slice(&batch.positions, batch.positions.len(), &Device::Cpu)?;
    Ok((cos.index_select(&pos, 0)?, sin.index_select(&pos, 0)?))
}

/// Bytes a class keeps per parameter when served (`fp16` → 2; 8-bit → Q8_0, 1.0625; 4-bit →
/// the engine's `q4_s8` at a width 256 divides, 0.578), for the summary.
/// Bytes of a `rows × cols` weight in `class`'s format, exactly as the engine holds it.
pub fn format_bytes(class: PrecisionClass, rows: usize, cols: usize) -> u64 {
    match class {
        PrecisionClass::Fp16 => 2 * (rows * cols) as u64,
        PrecisionClass::W8a8 | PrecisionClass::W8a8PerChannel => (rows * cols / 32 * 34) as u64,
        PrecisionClass::W4a16 => quantmesh_kernels::PackedQ4::bytes_for(rows, cols) as u64,
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    /// Float and pseudo-quantized outputs go through the same projection, so weights that
    /// INT8 represents exactly give KL = 0 exactly; weights it cannot, KL > 0.
    #[test]
    fn kl_is_zero_when_weights_are_exactly_representable() {
        let (out, inp, t) = (300, 64, 50);
        let step = 1.0f32 / 64.0;
        let w: Vec<f32> = (0..out * inp)
            .map(|i| ((i * 7919 % 255) as f32 - 127.0) * step)
            .collect();
        let absmax = w.iter().fold(0f32, |m, x| m.max(x.abs()));
        let xv: Vec<f32> = (0..t * inp).map(|i| ((i as f32) * 0.37).sin()).collect();
        let x = Tensor::from_vec(xv, (t, inp), &Device::Cpu).unwrap();
        let kl_for = |w: &[f32], absmax: f32| {
            // As score_group does: the same blocks through the same projection.
            let (mut ys, mut qs) = (Vec::new(), Vec::new());
            for blk in blocks(out) {
                let b = &w[blk.0 * inp..(blk.0 + blk.1) * inp];
                ys.push(project_block(&x, b, blk, None).unwrap());
                let mut q = b.to_vec();
                fake_quant(&mut q, inp, Format::W8a8, absmax);
                qs.push(project_block(&x, &q, blk, None).unwrap());
            }
            let y = Tensor::cat(&ys, 1).unwrap();
            let yq = Tensor::cat(&qs, 1).unwrap();
            let yv = y.flatten_all().unwrap().to_vec1::<f32>().unwrap();
            let qv = yq.flatten_all().unwrap().to_vec1::<f32>().unwrap();
            let mut r = Range::default();
            r.add(&yv);
            let (mut p, mut q) = (Hist::new(r.min, r.max), Hist::new(r.min, r.max));
            p.add(&yv);
            q.add(&qv);
            kl_hist(&p, &q)
        };
        assert_eq!(kl_for(&w, absmax), 0.0);
        // Off the grid (and one big weight stretching the scale): KL > 0.
        let mut off: Vec<f32> = w.iter().map(|v| v * 0.9731 + 0.0011).collect();
        off[0] = 40.0;
        assert!(kl_for(&off, 40.0) > 0.0);
    }

    /// Rows whose harm is i/100 (column 0 carries all the error): at a 1 % trigger rate
    /// one row of 100 lies above the bound, at 5 % five, at 0 none.
    #[test]
    fn the_harm_bound_is_exceeded_by_the_trigger_share_of_calibration_rows() {
        let errors = ColumnError {
            error: vec![1.0, 0.0],
            energy: vec![1.0, 1.0],
        };
        // a² / (a² + b²) = i/100 with a² = i, b² = 100 − i.
        let xs: Vec<f32> = (0..100)
            .rev()
            .flat_map(|i| [(i as f32).sqrt(), ((100 - i) as f32).sqrt()])
            .collect();
        let bound = |share| harm_bound(row_harm(&errors, &xs), share).unwrap();
        let above = |b: f64| {
            xs.chunks_exact(2)
                .filter(|x| errors.nsr(x) as f64 > b)
                .count()
        };
        assert_eq!(above(bound(0.01)), 1);
        assert_eq!(above(bound(0.05)), 5);
        assert_eq!(above(bound(0.0)), 0);
        assert!((bound(0.01) - 0.98).abs() < 1e-5, "{}", bound(0.01));
        assert_eq!(harm_bound(row_harm(&errors, &[]), 0.01), None);
    }
}
