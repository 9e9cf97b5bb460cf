//! What a quantization does to each input column of a weight, and the output
//! noise-to-signal ratio that gives for one input row: the engine's monitor computes it on
//! served rows (its harm test), the pre-screen on calibration rows (the bound a 4-bit group
//! is served with).

/// Per input column `j` of a group's weight `W` `[out, in]`: the squared error its served
/// quantization leaves, `error_j = Σ_i (W_ij − deq(W)_ij)²`, and the weight's energy,
/// `energy_j = Σ_i W_ij²`. For an input row `x`, `Σ_j x_j²·error_j` is the expected
/// `‖(W − deq W)·x‖²` when different columns' errors are uncorrelated (as rounding errors
/// are), and `Σ_j x_j²·energy_j` the same estimate of `‖W·x‖²`: their ratio
/// ([`ColumnError::nsr`]) is the row's output noise-to-signal ratio on the quantized path —
/// what the weights' quantization does to *this* input. It is what the activation monitor's
/// harm statistic measures; the column sums are computed once, where the group is built.
#[derive(Debug, Clone, PartialEq)]
pub struct ColumnError {
    pub error: Vec<f32>,
    pub energy: Vec<f32>,
}

impl ColumnError {
    /// From the float weight and its dequantized quantization, both `[out, in]` row-major.
    pub fn from_weights(weight: &[f32], dequantized: &[f32], in_dim: usize) -> Self {
        let mut sum = ColumnErrorSum::new(in_dim);
        sum.add(weight, dequantized);
        sum.finish()
    }

    pub fn in_dim(&self) -> usize {
        self.error.len()
    }

    /// The output noise-to-signal ratio of input row `x` (`Σ x_j²·error_j / Σ x_j²·energy_j`;
    /// 0 for a zero row), on this thread's instruction set ([`crate::probe_row`]).
    pub fn nsr(&self, x: &[f32]) -> f32 {
        crate::probe_row(x, Some(self.columns()), crate::Isa::current()).nsr()
    }

    /// The per-column `(error, energy)`, as [`crate::probe_row`] takes them.
    pub fn columns(&self) -> (&[f32], &[f32]) {
        (&self.error, &self.energy)
    }

    /// The same ratio for a mean input power per channel (`E[x_j²]`): the group's harm on
    /// traffic with those powers.
    pub fn nsr_of_power(&self, power: &[f64]) -> f64 {
        let (mut a, mut b) = (0f64, 0f64);
        for ((p, e), w) in power.iter().zip(&self.error).zip(&self.energy) {
            a += p * *e as f64;
            b += p * *w as f64;
        }
        if b > 0.0 {
            a / b
        } else {
            0.0
        }
    }
}

/// [`ColumnError`] summed over a weight's rows a block at a time (in f64), for callers that
/// never hold the whole weight.
#[derive(Debug, Clone)]
pub struct ColumnErrorSum {
    error: Vec<f64>,
    energy: Vec<f64>,
}

impl ColumnErrorSum {
    pub fn new(in_dim: usize) -> Self {
        Self {
            error: vec![0.0; in_dim],
            energy: vec![0.0; in_dim],
        }
    }

    /// Add rows of the float weight and their dequantized quantization (`[n, in]` each).
    pub fn add(&mut self, weight: &[f32], dequantized: &[f32]) {
        let in_dim = self.error.len().max(1);
        for (w_row, q_row) in weight
            .chunks_exact(in_dim)
            .zip(dequantized.chunks_exact(in_dim))
        {
            for (j, (&w, &q)) in w_row.iter().zip(q_row).enumerate() {
                let (w, q) = (w as f64, q as f64);
                self.error[j] += (w - q) * (w - q);
                self.energy[j] += w * w;
            }
        }
    }

    pub fn finish(self) -> ColumnError {
        ColumnError {
            error: self.error.into_iter().map(|v| v as f32).collect(),
            energy: self.energy.into_iter().map(|v| v as f32).collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Summing a weight block by block gives what the whole weight gives, and the ratio is
    /// the exact output noise-to-signal ratio when one column carries the input.
    #[test]
    fn block_sums_match_the_whole_and_one_column_is_exact() {
        let (out, inp) = (6, 5);
        let w: Vec<f32> = (0..out * inp)
            .map(|i| ((i * 7 % 11) as f32 - 5.0) * 0.1)
            .collect();
        let q: Vec<f32> = w
            .iter()
            .enumerate()
            .map(|(i, v)| v + (i % 3) as f32 * 0.01)
            .collect();
        let whole = ColumnError::from_weights(&w, &q, inp);
        let mut sum = ColumnErrorSum::new(inp);
        sum.add(&w[..2 * inp], &q[..2 * inp]);
        sum.add(&w[2 * inp..], &q[2 * inp..]);
        assert_eq!(sum.finish(), whole);
        let mut x = vec![0f32; inp];
        x[2] = 3.0;
        let (mut noise, mut signal) = (0f64, 0f64);
        for r in 0..out {
            let (a, b) = (w[r * inp + 2] as f64 * 3.0, q[r * inp + 2] as f64 * 3.0);
            noise += (a - b) * (a - b);
            signal += a * a;
        }
        let nsr = whole.nsr(&x) as f64;
        assert!(
            (nsr - noise / signal).abs() < 1e-5 * (noise / signal),
            "{nsr}"
        );
    }
}
