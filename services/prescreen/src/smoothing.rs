//! Scale migration (SmoothQuant) for a group's quantized path: per input channel a
//! power-of-two factor `2^e_j`, `e_j = round(α·log2 max|x_j| − (1−α)·log2 max|W_:,j|)` over
//! the calibration rows, moved from the activations into the quantized weights' columns so an
//! outlier channel no longer sets its activation block's step alone. The pre-screen keeps it
//! for a group only where it lowers the served 8-bit-activation product's output error on the
//! calibration rows: Q8_0 weights and activations quantized per block of 32, both rotated in
//! the engine's Hadamard blocks, exactly as the engine serves them.

use crate::PrescreenError;
use candle_core::{Device, Tensor};
use quantmesh_kernels::{ActBits, Activations, PackedQ8, Q8Layout};
use quantmesh_types::sensitive::MAX_SMOOTHING_EXPONENT;

/// Per-column largest |value| of row-major rows.
#[derive(Debug, Clone)]
pub struct ColumnMax(Vec<f32>);

impl ColumnMax {
    pub fn new(cols: usize) -> Self {
        Self(vec![0.0; cols])
    }

    /// Fold in rows of this width (a trailing partial row is ignored).
    pub fn add(&mut self, rows: &[f32]) {
        let cols = self.0.len();
        if cols == 0 {
            return;
        }
        for row in rows.chunks_exact(cols) {
            for (m, v) in self.0.iter_mut().zip(row) {
                *m = m.max(v.abs());
            }
        }
    }

    pub fn values(&self) -> &[f32] {
        &self.0
    }
}

/// The factors' exponents for activations whose channels peak at `act` and weights whose
/// columns peak at `weight`, strength `alpha`, centred on 0 (a common power of two changes no
/// block's quantization) and clamped to ±[`MAX_SMOOTHING_EXPONENT`]. A channel that is zero
/// on either side keeps factor 1.
pub fn exponents(act: &[f32], weight: &[f32], alpha: f64) -> Vec<i8> {
    let raw: Vec<Option<f64>> = act
        .iter()
        .zip(weight)
        .map(|(&a, &w)| {
            (a > 0.0 && w > 0.0 && a.is_finite() && w.is_finite())
                .then(|| alpha * f64::from(a).log2() - (1.0 - alpha) * f64::from(w).log2())
        })
        .collect();
    let known: Vec<f64> = raw.iter().flatten().copied().collect();
    let centre = if known.is_empty() {
        0.0
    } else {
        known.iter().sum::<f64>() / known.len() as f64
    };
    let lim = f64::from(MAX_SMOOTHING_EXPONENT);
    raw.into_iter()
        .map(|e| e.map_or(0, |e| (e - centre).round().clamp(-lim, lim) as i8))
        .collect()
}

/// Multiply column `j` of each row by `2^(sign·e_j)`, then rotate the rows in Hadamard
/// blocks of `block`.
fn change(v: &mut [f32], cols: usize, exps: Option<&[i8]>, sign: f32, block: usize) {
    if let Some(e) = exps {
        let f: Vec<f32> = e.iter().map(|&e| (sign * f32::from(e)).exp2()).collect();
        for row in v.chunks_exact_mut(cols) {
            for (x, f) in row.iter_mut().zip(&f) {
                *x *= f;
            }
        }
    }
    // `block` divides `cols` (quantmesh_kernels::rotation_block): this cannot fail.
    let _ = quantmesh_kernels::hadamard_blocks(v, block);
}

/// One candidate set of factors: the strength it came from and its exponents.
#[derive(Debug, Clone, PartialEq)]
pub struct Candidate {
    pub alpha: f64,
    pub exps: Vec<i8>,
}

/// The factors each measured form applies, in the order of [`ServedError`]'s forms: none,
/// then each candidate's.
fn factors(candidates: &[Candidate]) -> impl Iterator<Item = Option<&[i8]>> {
    std::iter::once(None).chain(candidates.iter().map(|c| Some(&c.exps[..])))
}

/// The served product's output error, summed over a group's members: always unsmoothed
/// (what W8A8 costs the group as it stands), and with each candidate's factors.
pub struct ServedError {
    cols: usize,
    block: usize,
    candidates: Vec<Candidate>,
    /// The KL rows as the engine quantizes them, dequantized: unsmoothed, then smoothed by
    /// each candidate in turn, each with its summed squared output error.
    forms: Vec<(Tensor, f64)>,
    signal: f64,
}

/// What [`ServedError::finish`] measured.
#[derive(Debug, Clone, PartialEq)]
pub struct Served {
    /// Output noise-to-signal ratio without factors.
    pub plain: f64,
    /// The candidate with the lowest error, and that error (`None`: no candidates).
    pub smoothed: Option<(f64, Candidate)>,
}

impl ServedError {
    /// `x` the group's input on the KL rows (`[rows, cols]`), `candidates` the factors to
    /// measure beside none (empty: the unsmoothed form only), `block` the engine's rotation
    /// block for this width. `None` where the served form does not exist for this width
    /// (activations are quantized in blocks of 32).
    pub fn new(
        x: &Tensor,
        candidates: Vec<Candidate>,
        block: usize,
    ) -> Result<Option<Self>, PrescreenError> {
        let (rows, cols) = x.dims2()?;
        if cols == 0 || !cols.is_multiple_of(quantmesh_kernels::BLOCK) || rows == 0 {
            return Ok(None);
        }
        let xs = x.flatten_all()?.to_vec1::<f32>()?;
        let mut forms = Vec::with_capacity(1 + candidates.len());
        for e in factors(&candidates) {
            let mut v = xs.clone();
            change(&mut v, cols, e, -1.0, block);
            let mut a = Activations::new();
            a.quantize(&v, rows, cols, ActBits::Eight)?;
            let t = Tensor::from_vec(a.dequantize(), (rows, cols), &Device::Cpu)?;
            forms.push((t, 0.0));
        }
        Ok(Some(Self {
            cols,
            block,
            candidates,
            forms,
            signal: 0.0,
        }))
    }

    /// Add one member: its f32 weight `[out, cols]`, bias, and its float output on the KL
    /// rows (`[rows, out]`, bias added).
    pub fn add(
        &mut self,
        w: &[f32],
        out: usize,
        bias: Option<&Tensor>,
        float: &Tensor,
    ) -> Result<(), PrescreenError> {
        self.signal += float.sqr()?.sum_all()?.to_scalar::<f32>()? as f64;
        for ((acts, err), e) in self.forms.iter_mut().zip(factors(&self.candidates)) {
            let mut v = w.to_vec();
            change(&mut v, self.cols, e, 1.0, self.block);
            let q = PackedQ8::quantize_in(&v, out, self.cols, Q8Layout::RowTiles)?;
            let wq = Tensor::from_vec(q.dequantize(), (out, self.cols), &Device::Cpu)?;
            let mut y = acts.matmul(&wq.t()?)?;
            if let Some(b) = bias {
                y = y.broadcast_add(b)?;
            }
            *err += (y - float)?.sqr()?.sum_all()?.to_scalar::<f32>()? as f64;
        }
        Ok(())
    }

    /// The output noise-to-signal ratios measured: the unsmoothed one and the best
    /// candidate's (the first listed among equals).
    pub fn finish(self) -> Served {
        let s = self.signal.max(f64::MIN_POSITIVE);
        let nsr: Vec<f64> = self.forms.iter().map(|(_, e)| e / s).collect();
        let best = nsr
            .iter()
            .skip(1)
            .copied()
            .zip(self.candidates)
            .reduce(|best, c| if c.0 < best.0 { c } else { best });
        Served {
            plain: nsr.first().copied().unwrap_or(0.0),
            smoothed: best,
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn exponents_balance_activation_and_weight_peaks() {
        // Channel 1's activations peak 64× the others', its weights as the others': α = 0.5
        // gives it 2^3 more than the rest; a dead channel keeps 0.
        let e = exponents(&[1.0, 64.0, 1.0, 0.0], &[1.0, 1.0, 1.0, 1.0], 0.5);
        assert_eq!(e[1] - e[0], 3);
        assert_eq!(e[0], e[2]);
        assert_eq!(e[3], 0);
        // Centred: a common scale moves nothing.
        assert_eq!(exponents(&[8.0, 8.0], &[1.0, 1.0], 0.5), vec![0, 0]);
    }

    #[test]
    fn smoothing_lowers_the_served_error_of_an_outlier_channel() {
        // 64 channels, channel 5 carries activations 200× the rest: without smoothing its
        // block's 8-bit step drowns the other 31 channels.
        let (rows, cols, out) = (16, 64, 8);
        let x: Vec<f32> = (0..rows * cols)
            .map(|i| {
                let v = ((i as f32) * 0.618_034).fract() - 0.5;
                if i % cols == 5 {
                    v.signum() * 100.0 + v
                } else {
                    v
                }
            })
            .collect();
        let w: Vec<f32> = (0..out * cols)
            .map(|i| ((i as f32) * 0.414_213).fract() - 0.5)
            .collect();
        let xt = Tensor::from_vec(x.clone(), (rows, cols), &Device::Cpu).unwrap();
        let wt = Tensor::from_vec(w.clone(), (out, cols), &Device::Cpu).unwrap();
        let float = xt.matmul(&wt.t().unwrap()).unwrap();
        let (mut am, mut wm) = (ColumnMax::new(cols), ColumnMax::new(cols));
        am.add(&x);
        wm.add(&w);
        let exps = exponents(am.values(), wm.values(), 0.5);
        assert!(exps[5] > exps[4] + 2, "{exps:?}");
        let candidate = |alpha| Candidate {
            alpha,
            exps: exponents(am.values(), wm.values(), alpha),
        };
        let served = |candidates| {
            let mut m = ServedError::new(&xt, candidates, 1).unwrap().unwrap();
            m.add(&w, out, None, &float).unwrap();
            m.finish()
        };
        let one = served(vec![candidate(0.5)]);
        let (plain, (smoothed, _)) = (one.plain, one.smoothed.clone().unwrap());
        assert!(smoothed < 0.5 * plain, "{smoothed} vs {plain}");
        // Without factors only the unsmoothed form is measured, to the same figure.
        assert_eq!(
            served(vec![]),
            Served {
                plain,
                smoothed: None
            }
        );
        // Several strengths: the lowest error is kept, with its strength; a useless one
        // (α = 0 moves the weights' peaks, not the outlier) loses.
        let many = served(vec![candidate(0.0), candidate(0.5), candidate(0.9)]);
        assert_eq!(many.plain, plain);
        let (best, kept) = many.smoothed.unwrap();
        assert!(best <= smoothed, "{best} vs {smoothed}");
        assert_ne!(kept.alpha, 0.0);
    }
}
