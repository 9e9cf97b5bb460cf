//! The pre-screen's metrics, as pure functions over slices (known-answer unit tests below).
//!
//! * **R** = (max − min) / (Q3 − Q1). Quantiles use the lower nearest rank: Qp is the value
//!   of rank ⌊p·(N−1)⌋ in ascending order. Computed *exactly* without sorting or copying the
//!   weights: a 65 536-bin histogram over [min, max] finds the bin holding each rank, and a
//!   further pass collects just the values in that bin (a few thousand at most for real
//!   weight distributions) and selects the rank among them. See [`Quantiles`].
//! * **Energy ratio** = σ1² / Σσᵢ² = λmax(G) / trace(G) with G = WᵀW (or WWᵀ, whichever is
//!   smaller), λmax by power iteration. It is the share of the matrix's Frobenius energy in
//!   its top singular direction: 1 for a rank-1 matrix, ≈ 1/min(m, n) for a flat spectrum.
//!   Chosen over σ1 / Σσᵢ because it needs no full SVD (trace(G) = ‖W‖²_F is exact) and
//!   because it is the quantity a low-rank outlier direction inflates.
//! * **KL(P ‖ Q)** of a layer's outputs, float (P) vs pseudo-quantized weights (Q): both
//!   sets of output values histogrammed into [`KL_BINS`] (256) equal bins over the range
//!   [min, max] of the float outputs with linear (cloud-in-cell) assignment between the
//!   two nearest bin centres (Q values outside are counted in the edge bins); every
//!   bin of both gets [`KL_EPS`] added before normalising (so empty bins cost a bounded
//!   amount instead of ∞); KL = Σ P·ln(P/Q) in nats. Identical outputs give exactly 0.

use candle_core::{Device, Tensor};
use quantmesh_model::massive::{massive_channels, MassiveRule};

/// Rows per block when accumulating a Gram matrix.
const GRAM_BLOCK: usize = 256;

/// Histogram bins for the output KL. 256 rather than TensorRT's 2048: the histograms here
/// hold the outputs of one group on a few thousand to a few hundred thousand values, and
/// layer 0 sees one input row per token id, so its outputs are a comb of repeated values;
/// with 2048 bins a sub-bin shift of that comb by INT8 rounding reads as KL ≈ 0.1 on the
/// bundled model's ordinary `layers.0.qkv` (measured), with 256 bins ≈ 0.002.
pub const KL_BINS: usize = 256;
/// Additive smoothing per bin (in probability units, before renormalising).
pub const KL_EPS: f64 = 1e-6;
/// Bins of the first quantile pass.
const Q_BINS: usize = 1 << 16;

/// Running min / max / sum of squares over one or more slices.
#[derive(Debug, Clone, Copy)]
pub struct Range {
    pub min: f32,
    pub max: f32,
    pub count: u64,
    pub sum_sq: f64,
}

impl Default for Range {
    fn default() -> Self {
        Self {
            min: f32::INFINITY,
            max: f32::NEG_INFINITY,
            count: 0,
            sum_sq: 0.0,
        }
    }
}

impl Range {
    pub fn add(&mut self, xs: &[f32]) {
        for &x in xs {
            self.min = self.min.min(x);
            self.max = self.max.max(x);
            self.sum_sq += (x as f64) * (x as f64);
        }
        self.count += xs.len() as u64;
    }

    pub fn absmax(&self) -> f32 {
        self.min.abs().max(self.max.abs())
    }
}

/// Exact Q1 and Q3 over data seen in passes (see the module docs).
pub struct Quantiles {
    range: Range,
    counts: Vec<u64>,
    /// Ranks wanted (Q1, Q3) and, after `locate`, their bins and the rank inside the bin.
    targets: [(u64, usize, u64); 2],
    found: [Vec<f32>; 2],
}

impl Quantiles {
    /// Start from a completed [`Range`] (pass 1).
    pub fn new(range: Range) -> Self {
        let n = range.count.max(1);
        let rank = |p: f64| ((n - 1) as f64 * p).floor() as u64;
        Self {
            range,
            counts: vec![0; Q_BINS],
            targets: [(rank(0.25), 0, 0), (rank(0.75), 0, 0)],
            found: [Vec::new(), Vec::new()],
        }
    }

    fn bin(&self, x: f32) -> usize {
        let (lo, hi) = (self.range.min as f64, self.range.max as f64);
        if hi <= lo {
            return 0;
        }
        (((x as f64 - lo) / (hi - lo) * Q_BINS as f64) as usize).min(Q_BINS - 1)
    }

    /// Pass 2: count.
    pub fn count(&mut self, xs: &[f32]) {
        for &x in xs {
            let b = self.bin(x);
            self.counts[b] += 1;
        }
    }

    /// After pass 2: find the bin of each target rank.
    pub fn locate(&mut self) {
        for t in &mut self.targets {
            let mut below = 0u64;
            for (b, &c) in self.counts.iter().enumerate() {
                if below + c > t.0 {
                    t.1 = b;
                    t.2 = t.0 - below;
                    break;
                }
                below += c;
            }
        }
    }

    /// Pass 3: collect the values in the target bins.
    pub fn collect(&mut self, xs: &[f32]) {
        for &x in xs {
            let b = self.bin(x);
            for (i, t) in self.targets.iter().enumerate() {
                if b == t.1 {
                    self.found[i].push(x);
                }
            }
        }
    }

    /// (Q1, Q3) after pass 3.
    pub fn finish(mut self) -> (f32, f32) {
        let mut out = [0f32; 2];
        for (i, o) in out.iter_mut().enumerate() {
            let v = &mut self.found[i];
            let k = (self.targets[i].2 as usize).min(v.len().saturating_sub(1));
            *o = if v.is_empty() {
                self.range.min
            } else {
                *v.select_nth_unstable_by(k, f32::total_cmp).1
            };
        }
        (out[0], out[1])
    }
}

/// R from a range and its quartiles; a zero IQR gives +∞ unless the data are constant (0).
pub fn dispersion(range: &Range, q1: f32, q3: f32) -> f64 {
    let spread = (range.max - range.min) as f64;
    let iqr = (q3 - q1) as f64;
    if spread == 0.0 {
        0.0
    } else if iqr <= 0.0 {
        f64::INFINITY
    } else {
        spread / iqr
    }
}

/// R of one slice in memory (tests and small inputs): the same three passes.
pub fn dispersion_of(xs: &[f32]) -> f64 {
    let mut r = Range::default();
    r.add(xs);
    let mut q = Quantiles::new(r);
    q.count(xs);
    q.locate();
    q.collect(xs);
    let (q1, q3) = q.finish();
    dispersion(&r, q1, q3)
}

/// A Gram matrix G accumulated from row blocks (candle GEMM, f32), for the energy ratio.
pub struct Gram {
    pub dim: usize,
    g: Option<Tensor>,
}

impl Gram {
    pub fn new(dim: usize) -> Self {
        Self { dim, g: None }
    }

    /// G += `part` (a `[dim, dim]` tensor).
    pub fn add(&mut self, part: Tensor) -> candle_core::Result<()> {
        self.g = Some(match self.g.take() {
            Some(g) => (g + part)?,
            None => part,
        });
        Ok(())
    }

    /// G += AᵀA for a row-major `a` of shape `[rows, dim]`, in blocks of `GRAM_BLOCK` rows
    /// (never a full copy of `a`).
    pub fn add_rows(&mut self, a: &[f32]) -> candle_core::Result<()> {
        let d = self.dim;
        for block in a.chunks(GRAM_BLOCK * d) {
            let t = Tensor::from_slice(block, (block.len() / d, d), &Device::Cpu)?;
            self.add(t.t()?.matmul(&t)?)?;
        }
        Ok(())
    }

    /// G += A·Aᵀ for a row-major `a` of shape `[dim, cols]` (when a group has fewer rows
    /// than columns).
    pub fn add_outer(&mut self, a: &[f32], cols: usize) -> candle_core::Result<()> {
        self.add_outer_with(cols, |s, n| {
            Ok::<_, candle_core::Error>(a[s * cols..(s + n) * cols].to_vec())
        })
    }

    /// G += A·Aᵀ tile by tile, G[i, j] = A_i · A_jᵀ, with row blocks of A from `fetch(first
    /// row, rows)`: A is never held whole (blocks are fetched again for every tile).
    pub fn add_outer_with<E: From<candle_core::Error>>(
        &mut self,
        cols: usize,
        mut fetch: impl FnMut(usize, usize) -> Result<Vec<f32>, E>,
    ) -> Result<(), E> {
        let d = self.dim;
        let blocks: Vec<(usize, usize)> = (0..d)
            .step_by(GRAM_BLOCK)
            .map(|s| (s, GRAM_BLOCK.min(d - s)))
            .collect();
        let mut tile = |(s, n): (usize, usize)| -> Result<Tensor, E> {
            Ok(Tensor::from_vec(fetch(s, n)?, (n, cols), &Device::Cpu)?)
        };
        let mut grid = Vec::with_capacity(blocks.len());
        for &bi in &blocks {
            let ti = tile(bi)?;
            let mut row = Vec::with_capacity(blocks.len());
            for &bj in &blocks {
                row.push(ti.matmul(&tile(bj)?.t()?)?);
            }
            grid.push(Tensor::cat(&row, 1)?);
        }
        Ok(self.add(Tensor::cat(&grid, 0)?)?)
    }

    /// σ1² / Σσᵢ² = λmax(G) / trace(G), λmax by power iteration (at most 300 iterations,
    /// relative change < 1e-7).
    pub fn energy_ratio(&self) -> candle_core::Result<f64> {
        let Some(g) = &self.g else { return Ok(0.0) };
        let d = self.dim;
        let diag: Vec<f32> = g
            .flatten_all()?
            .to_vec1::<f32>()?
            .into_iter()
            .step_by(d + 1)
            .collect();
        let trace: f64 = diag.iter().map(|&x| x as f64).sum();
        if trace <= 0.0 {
            return Ok(0.0);
        }
        // Deterministic start, not orthogonal to any coordinate axis.
        let start: Vec<f32> = (0..d).map(|i| 1.0 + (i % 7) as f32 * 0.1).collect();
        let mut v = Tensor::from_vec(start, (d, 1), g.device())?;
        let mut lambda = 0.0f64;
        for _ in 0..300 {
            let w = g.matmul(&v)?;
            let vv = v.sqr()?.sum_all()?.to_scalar::<f32>()? as f64;
            let next = (w.mul(&v)?.sum_all()?.to_scalar::<f32>()? as f64) / vv;
            let norm = w.sqr()?.sum_all()?.to_scalar::<f32>()?.sqrt();
            if norm == 0.0 {
                return Ok(0.0);
            }
            v = (w / norm as f64)?;
            let done = (next - lambda).abs() <= 1e-7 * next.abs();
            lambda = next;
            if done {
                break;
            }
        }
        Ok((lambda / trace).clamp(0.0, 1.0))
    }
}

/// Histogram of values over `[lo, hi]` with [`KL_BINS`] bins and *linear* (cloud-in-cell)
/// assignment: a value between two bin centres splits its unit weight between them in
/// proportion to its distance. Values outside the range go to the edge bins. Hard binning
/// makes the KL jump when a value crosses a bin edge, which dominates for discrete outputs
/// (layer 0 sees one input row per token id, so its outputs are a comb of repeated values);
/// with linear assignment the histogram — and so the KL — moves continuously with the data.
#[derive(Debug, Clone)]
pub struct Hist {
    lo: f64,
    hi: f64,
    pub weights: Vec<f64>,
}

impl Hist {
    pub fn new(lo: f32, hi: f32) -> Self {
        Self {
            lo: lo as f64,
            hi: hi as f64,
            weights: vec![0.0; KL_BINS],
        }
    }

    pub fn add(&mut self, xs: &[f32]) {
        let w = self.hi - self.lo;
        let last = (KL_BINS - 1) as f64;
        for &x in xs {
            if w <= 0.0 {
                self.weights[0] += 1.0;
                continue;
            }
            // Position in units of bins, relative to the first bin's centre.
            let pos = ((x as f64 - self.lo) / w * KL_BINS as f64 - 0.5).clamp(0.0, last);
            let i = pos.floor() as usize;
            let frac = pos - i as f64;
            self.weights[i] += 1.0 - frac;
            if frac > 0.0 {
                self.weights[i + 1] += frac;
            }
        }
    }
}

/// KL(P ‖ Q) in nats between two histograms, with [`KL_EPS`] smoothing.
pub fn kl_hist(p: &Hist, q: &Hist) -> f64 {
    let norm = |h: &Hist| -> Vec<f64> {
        let n: f64 = h.weights.iter().sum::<f64>().max(1e-300);
        let v: Vec<f64> = h.weights.iter().map(|&c| c / n + KL_EPS).collect();
        let z: f64 = v.iter().sum();
        v.into_iter().map(|x| x / z).collect()
    };
    let (p, q) = (norm(p), norm(q));
    p.iter()
        .zip(&q)
        .map(|(p, q)| p * (p / q).ln())
        .sum::<f64>()
        .max(0.0)
}

/// Statistics of a layer's input activations (rows = tokens, position 0 already removed).
#[derive(Debug, Clone, PartialEq)]
pub struct ActStats {
    pub absmax: f64,
    pub kurtosis: f64,
    pub quantile_score: f64,
    /// (channel, abs-max), largest first, at most 8.
    pub top_channels: Vec<(usize, f64)>,
    /// Massive channels (`quantmesh_model::massive`: far above the row's median magnitude
    /// in most rows; the monitor's warm-up uses the same rule).
    pub massive_channels: Vec<usize>,
}

/// `x` is row-major `[rows, dim]`.
pub fn activation_stats(x: &[f32], dim: usize, massive: MassiveRule) -> ActStats {
    let rows = x.len() / dim.max(1);
    let n = x.len().max(1) as f64;
    let mean = x.iter().map(|&v| v as f64).sum::<f64>() / n;
    let (mut m2, mut m4) = (0.0, 0.0);
    for &v in x {
        let d = v as f64 - mean;
        m2 += d * d;
        m4 += d * d * d * d;
    }
    let (m2, m4) = (m2 / n, m4 / n);
    let kurtosis = if m2 > 0.0 { m4 / (m2 * m2) - 3.0 } else { 0.0 };
    let mut chan_max = vec![0f32; dim];
    for row in x.chunks_exact(dim) {
        for (c, v) in row.iter().enumerate() {
            chan_max[c] = chan_max[c].max(v.abs());
        }
    }
    let absmax = chan_max.iter().cloned().fold(0f32, f32::max) as f64;
    let mut abs: Vec<f32> = x.iter().map(|v| v.abs()).collect();
    let k = ((abs.len().saturating_sub(1)) as f64 * 0.999).floor() as usize;
    let p999 = if abs.is_empty() {
        0.0
    } else {
        *abs.select_nth_unstable_by(k, f32::total_cmp).1 as f64
    };
    let quantile_score = if p999 > 0.0 { absmax / p999 } else { 0.0 };
    let mut order: Vec<usize> = (0..dim).collect();
    order.sort_by(|a, b| chan_max[*b].total_cmp(&chan_max[*a]).then(a.cmp(b)));
    let top_channels = order
        .iter()
        .take(8)
        .map(|&c| (c, chan_max[c] as f64))
        .collect();
    let massive_channels = if rows > 0 {
        massive_channels(x, dim, massive)
    } else {
        Vec::new()
    };
    ActStats {
        absmax,
        kurtosis,
        quantile_score,
        top_channels,
        massive_channels,
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use rand::{Rng, SeedableRng};
    use rand_distr::{Distribution, Normal, StudentT};

    #[test]
    fn quartiles_are_exact() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(1);
        let xs: Vec<f32> = (0..100_001)
            .map(|_| rng.gen::<f32>() * 10.0 - 3.0)
            .collect();
        let mut sorted = xs.clone();
        sorted.sort_by(f32::total_cmp);
        let mut r = Range::default();
        r.add(&xs);
        let mut q = Quantiles::new(r);
        q.count(&xs[..50_000]);
        q.count(&xs[50_000..]);
        q.locate();
        q.collect(&xs);
        let (q1, q3) = q.finish();
        assert_eq!(q1, sorted[25_000]);
        assert_eq!(q3, sorted[75_000]);
    }

    #[test]
    fn uniform_vs_heavy_tailed_dispersion() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(2);
        // Uniform on [a, b]: IQR = (b − a)/2, so R → 2.
        let u: Vec<f32> = (0..200_000).map(|_| rng.gen::<f32>()).collect();
        let r = dispersion_of(&u);
        assert!((r - 2.0).abs() < 0.01, "uniform R = {r}");
        // Student-t ν = 2.5 has far heavier tails: R in the hundreds.
        let t = StudentT::new(2.5f32).unwrap();
        let h: Vec<f32> = (0..200_000).map(|_| t.sample(&mut rng)).collect();
        let r = dispersion_of(&h);
        assert!(r > 50.0, "heavy-tailed R = {r}");
        // Constant data: R = 0.
        assert_eq!(dispersion_of(&[3.0; 10]), 0.0);
    }

    #[test]
    fn rank_one_has_energy_one_and_noise_little() {
        // 600 rows: more than one Gram block.
        let (m, n) = (600, 24);
        let u: Vec<f32> = (0..m).map(|i| (i as f32 * 0.37).sin() + 0.1).collect();
        let v: Vec<f32> = (0..n).map(|j| (j as f32 * 0.11).cos()).collect();
        let a: Vec<f32> = (0..m * n).map(|k| u[k / n] * v[k % n]).collect();
        let mut g = Gram::new(n);
        g.add_rows(&a).unwrap();
        assert!((g.energy_ratio().unwrap() - 1.0).abs() < 1e-5);
        // The same through the outer-product form (rows < columns case), 600×600 in blocks.
        let mut g2 = Gram::new(m);
        g2.add_outer(&a, n).unwrap();
        assert!((g2.energy_ratio().unwrap() - 1.0).abs() < 1e-4);
        // Accumulating row blocks = the whole matrix.
        let mut g3 = Gram::new(n);
        g3.add_rows(&a[..10 * n]).unwrap();
        g3.add_rows(&a[10 * n..]).unwrap();
        assert!((g3.energy_ratio().unwrap() - 1.0).abs() < 1e-5);
        // Two orthogonal equal directions: 0.5.
        let mut b = vec![0f32; 16];
        b[0] = 1.0;
        b[5] = 1.0;
        let mut g4 = Gram::new(4);
        g4.add_rows(&b).unwrap();
        assert!((g4.energy_ratio().unwrap() - 0.5).abs() < 1e-5);
        // Gaussian noise: small.
        let mut rng = rand::rngs::StdRng::seed_from_u64(3);
        let d = Normal::new(0.0f32, 1.0).unwrap();
        let r: Vec<f32> = (0..256 * 64).map(|_| d.sample(&mut rng)).collect();
        let mut g5 = Gram::new(64);
        g5.add_rows(&r).unwrap();
        assert!(g5.energy_ratio().unwrap() < 0.1);
    }

    #[test]
    fn kl_is_zero_for_identical_outputs_and_grows_with_error() {
        let xs: Vec<f32> = (0..10_000).map(|i| ((i as f32) * 0.01).sin()).collect();
        let mut p = Hist::new(-1.0, 1.0);
        p.add(&xs);
        let q = p.clone();
        assert_eq!(kl_hist(&p, &q), 0.0);
        let shifted: Vec<f32> = xs.iter().map(|x| x * 0.5).collect();
        let mut q2 = Hist::new(-1.0, 1.0);
        q2.add(&shifted);
        assert!(kl_hist(&p, &q2) > 0.1);
        // Continuity: a comb of repeated values shifted by a hair costs a hair.
        let comb: Vec<f32> = (0..10_000).map(|i| (i % 17) as f32 * 0.05).collect();
        let nudged: Vec<f32> = comb.iter().map(|x| x + 1e-5).collect();
        let (mut a, mut b) = (Hist::new(0.0, 0.8), Hist::new(0.0, 0.8));
        a.add(&comb);
        b.add(&nudged);
        assert!(kl_hist(&a, &b) < 1e-4);
    }

    #[test]
    fn activation_stats_find_two_equal_massive_channels() {
        // The monitor's rule (quantmesh_model::massive): both equal channels, not one.
        let dim = 64;
        let mut x: Vec<f32> = (0..200 * dim)
            .map(|i| ((i * 37 % 23) as f32 - 11.0) / 10.0)
            .collect();
        for r in 0..200 {
            x[r * dim + 17] = 30.0;
            x[r * dim + 41] = -30.0;
        }
        let s = activation_stats(&x, dim, MassiveRule::default());
        assert_eq!(s.massive_channels, vec![17, 41]);
    }

    #[test]
    fn activation_stats_find_massive_channels() {
        let dim = 16;
        let mut x = vec![0.1f32; 100 * dim];
        for r in 0..100 {
            x[r * dim + 5] = 40.0; // every row: massive
            if r % 10 == 0 {
                x[r * dim + 9] = 80.0; // 10 % of rows: a spike, not fixed
            }
        }
        let s = activation_stats(&x, dim, MassiveRule::default());
        assert_eq!(s.massive_channels, vec![5]);
        assert_eq!(s.top_channels[0], (9, 80.0));
        assert_eq!(s.absmax, 80.0);
        assert!(s.kurtosis > 3.0);
    }
}
