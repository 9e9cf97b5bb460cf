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

/// The served product's output error with and without the candidate factors, summed over a
/// group's members.
pub struct ServedError {
    cols: usize,
    block: usize,
    exps: Vec<i8>,
    /// The KL rows as the engine quantizes them, dequantized: unsmoothed and smoothed.
    acts: [Tensor; 2],
    err: [f64; 2],
    signal: f64,
}

impl ServedError {
    /// `x` the group's input on the KL rows (`[rows, cols]`), `block` the engine's rotation
    /// block for this width. `None` where the served form does not exist for this width
    /// (activations are quantized in blocks of 32).
    pub fn new(x: &Tensor, exps: Vec<i8>, block: usize) -> Result<Option<Self>, PrescreenError> {
        let (rows, cols) = x.dims2()?;
        if cols == 0 || !cols.is_multiple_of(quantmesh_kernels::BLOCK) || rows == 0 {
            return Ok(None);
        }
        let xs = x.flatten_all()?.to_vec1::<f32>()?;
        let mut acts = Vec::with_capacity(2);
        for smoothed in [false, true] {
            let mut v = xs.clone();
            change(&mut v, cols, smoothed.then_some(&exps[..]), -1.0, block);
            let mut a = Activations::new();
            a.quantize(&v, rows, cols, ActBits::Eight)?;
            acts.push(Tensor::from_vec(
                a.dequantize(),
                (rows, cols),
                &Device::Cpu,
            )?);
        }
        let [plain, smoothed]: [Tensor; 2] = acts
            .try_into()
            .map_err(|_| PrescreenError::Calibration("two activation forms".into()))?;
        Ok(Some(Self {
            cols,
            block,
            exps,
            acts: [plain, smoothed],
            err: [0.0; 2],
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
        for (k, smoothed) in [false, true].into_iter().enumerate() {
            let mut v = w.to_vec();
            let exps = smoothed.then_some(&self.exps[..]);
            change(&mut v, self.cols, exps, 1.0, self.block);
            let q = PackedQ8::quantize_in(&v, out, self.cols, Q8Layout::RowTiles)?;
            let wq = Tensor::from_vec(q.dequantize(), (out, self.cols), &Device::Cpu)?;
            let mut y = self.acts[k].matmul(&wq.t()?)?;
            if let Some(b) = bias {
                y = y.broadcast_add(b)?;
            }
            self.err[k] += (y - float)?.sqr()?.sum_all()?.to_scalar::<f32>()? as f64;
        }
        Ok(())
    }

    /// (unsmoothed, smoothed) output noise-to-signal ratios, and the exponents.
    pub fn finish(self) -> ((f64, f64), Vec<i8>) {
        let s = self.signal.max(f64::MIN_POSITIVE);
        ((self.err[0] / s, self.err[1] / s), self.exps)
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
        let mut m = ServedError::new(&xt, exps, 1).unwrap().unwrap();
        m.add(&w, out, None, &float).unwrap();
        let ((plain, smoothed), _) = m.finish();
        assert!(smoothed < 0.5 * plain, "{smoothed} vs {plain}");
    }
}
