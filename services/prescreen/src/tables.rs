//! The vocabulary tables' two forms under a weight budget: what the token embedding and
//! `lm_head` cost in 8 bits (Q8_0) and in 4 bits (`q4_s8`), as the engine stores them, so the
//! knapsack weighs them like any group instead of charging them fixed 8-bit bytes.
//!
//! The loss of a form is the error it adds to the stream its output lands in, relative to
//! that stream's energy — the currency of the groups' residual costs:
//! - the lookup: `‖ê − e‖² / ‖e‖²` over the calibration tokens' rows (the residual stream
//!   where it starts);
//! - the projection: the logits' error over their energy on the KL rows, both centred per
//!   row (softmax ignores a shift), with the final norm applied to the last hidden state as
//!   the engine does.
//!
//! A tied model pays both with one table. The tables are read in blocks of rows from the
//! mapped checkpoint; each block is quantized to both forms with the engine's own kernels'
//! packers and decoded back, so the error measured is the error served.

use crate::scan::{format_bytes, Batch};
use crate::PrescreenError;
use candle_core::{Device, Tensor};
use quantmesh_kernels::{PackedQ4, PackedQ8};
use quantmesh_model::ops::rms_norm;
use quantmesh_model::{names, Checkpoint, ModelConfig};
use quantmesh_types::PrecisionClass;

/// Vocabulary rows per block (bounds the decoded copies to a few MiB at any width).
const ROWS: usize = 1024;

/// The tables in their two forms: bytes as served and predicted loss.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TableCost {
    pub bytes8: u64,
    pub bytes4: u64,
    pub loss8: f64,
    pub loss4: f64,
}

/// Squared errors per form (8, 4 bits) and the energy they are relative to.
#[derive(Debug, Default, Clone, Copy)]
struct Relative {
    err: [f64; 2],
    energy: f64,
}

impl Relative {
    fn get(&self, form: usize) -> f64 {
        self.err[form] / self.energy.max(f64::MIN_POSITIVE)
    }
}

/// Per row of logits: Σ z, Σ z² (for centring), and per form Σ δz, Σ δz².
struct Logits {
    sum: Vec<f64>,
    sq: Vec<f64>,
    err_sum: [Vec<f64>; 2],
    err_sq: [Vec<f64>; 2],
    cols: usize,
}

impl Logits {
    fn new(rows: usize) -> Self {
        let z = || vec![0f64; rows];
        Self {
            sum: z(),
            sq: z(),
            err_sum: [z(), z()],
            err_sq: [z(), z()],
            cols: 0,
        }
    }

    fn add(acc: (&mut [f64], &mut [f64]), t: &Tensor) -> Result<(), PrescreenError> {
        for (r, row) in t.to_vec2::<f32>()?.iter().enumerate() {
            for &v in row {
                acc.0[r] += v as f64;
                acc.1[r] += (v as f64) * (v as f64);
            }
        }
        Ok(())
    }

    /// Centred energy and squared errors, summed over rows.
    fn relative(&self) -> Relative {
        let n = self.cols.max(1) as f64;
        let centred = |s: &[f64], q: &[f64]| -> f64 {
            s.iter().zip(q).map(|(s, q)| (q - s * s / n).max(0.0)).sum()
        };
        Relative {
            err: [
                centred(&self.err_sum[0], &self.err_sq[0]),
                centred(&self.err_sum[1], &self.err_sq[1]),
            ],
            energy: centred(&self.sum, &self.sq),
        }
    }
}

/// One table's walk: the lookup error on `tokens` (when it is the embedding) and the
/// projection error on `x` (when it is the output layer).
fn walk(
    ck: &Checkpoint,
    name: &str,
    cfg: &ModelConfig,
    tokens: Option<&[u32]>,
    x: Option<&Tensor>,
) -> Result<(Relative, Relative), PrescreenError> {
    let (vocab, cols) = (cfg.vocab_size, cfg.hidden_size);
    let mut lookup = Relative::default();
    let mut logits = x.map(|x| Logits::new(x.dim(0).unwrap_or(0)));
    for start in (0..vocab).step_by(ROWS) {
        let n = ROWS.min(vocab - start);
        let w = ck.read_rows_f32(name, start, n)?;
        let forms = [
            PackedQ8::quantize(&w, n, cols)?.dequantize(),
            PackedQ4::quantize(&w, n, cols)?.dequantize(),
        ];
        if let Some(tokens) = tokens {
            for &t in tokens {
                let t = t as usize;
                if !(start..start + n).contains(&t) {
                    continue;
                }
                let r = (t - start) * cols..(t - start + 1) * cols;
                lookup.energy += w[r.clone()]
                    .iter()
                    .map(|v| (*v as f64).powi(2))
                    .sum::<f64>();
                for (f, q) in forms.iter().enumerate() {
                    lookup.err[f] += w[r.clone()]
                        .iter()
                        .zip(&q[r.clone()])
                        .map(|(a, b)| (*b as f64 - *a as f64).powi(2))
                        .sum::<f64>();
                }
            }
        }
        if let (Some(x), Some(acc)) = (x, logits.as_mut()) {
            let wt = Tensor::from_slice(&w, (n, cols), &Device::Cpu)?;
            Logits::add((&mut acc.sum, &mut acc.sq), &x.matmul(&wt.t()?)?)?;
            for (f, q) in forms.iter().enumerate() {
                let delta: Vec<f32> = q.iter().zip(&w).map(|(q, w)| q - w).collect();
                let dt = Tensor::from_vec(delta, (n, cols), &Device::Cpu)?;
                let [s, e] = &mut [&mut acc.err_sum[f], &mut acc.err_sq[f]];
                Logits::add((s, e), &x.matmul(&dt.t()?)?)?;
            }
            acc.cols += n;
        }
    }
    ck.release(name);
    Ok((lookup, logits.map(|l| l.relative()).unwrap_or_default()))
}

/// The tables' cost in each form, or `None` where the width has no 8- or 4-bit form (32 does
/// not divide it: the engine keeps such tables in f16). `h` is the residual stream after the
/// last layer, every calibration row.
pub fn costs(
    ck: &Checkpoint,
    cfg: &ModelConfig,
    batch: &Batch,
    h: &Tensor,
) -> Result<Option<TableCost>, PrescreenError> {
    let (vocab, cols) = (cfg.vocab_size, cfg.hidden_size);
    if !cols.is_multiple_of(32) {
        return Ok(None);
    }
    let norm = ck.load_f32_shaped(names::FINAL_NORM, &[cols])?;
    let x = rms_norm(&h.index_select(&batch.kl_rows, 0)?, &norm, cfg.rms_norm_eps)?;
    let untied = ck.contains(names::LM_HEAD) && !cfg.tie_word_embeddings;
    let (lookup, mut logits) = walk(
        ck,
        names::EMBED,
        cfg,
        Some(&batch.tokens),
        (!untied).then_some(&x),
    )?;
    let tables = if untied {
        logits = walk(ck, names::LM_HEAD, cfg, None, Some(&x))?.1;
        2
    } else {
        1
    };
    Ok(Some(TableCost {
        bytes8: tables * format_bytes(PrecisionClass::W8a8, vocab, cols),
        bytes4: tables * format_bytes(PrecisionClass::W4a16, vocab, cols),
        loss8: lookup.get(0) + logits.get(0),
        loss4: lookup.get(1) + logits.get(1),
    }))
}
