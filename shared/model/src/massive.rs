//! Massive activations (Sun et al. 2024): a few residual-stream channels carry values orders
//! of magnitude above the rest, on almost every token and whatever the input. An outlier
//! detector must leave them out (they are not outliers, they are the model), and there may be
//! any number of them, often of equal size.
//!
//! **Rule.** A channel is *massive in a row* when its magnitude exceeds `ratio` × the row's
//! median magnitude; it is a *massive channel* when that holds in at least `share` of the
//! rows. Defaults: ratio 6, share 0.5.
//!
//! Why these numbers: the share requirement is what protects ordinary channels. For a
//! Gaussian row the median magnitude is 0.674 σ, so a given ordinary channel exceeds 6× that
//! (4.0 σ) in 6·10⁻⁵ of rows, and even a channel with 5× the typical spread does so in only
//! 42 % of rows; Student-t (ν = 3) channels cross it in < 1 %. A channel must *typically* sit
//! ≥ 6× above the row's median to qualify. Real massive activations are hundreds to thousands
//! of times the median (Sun et al. 2024 use 100× plus an absolute floor of 100 on LLaMA2);
//! synthetic and small models are milder — the bundled model's channel (30 in the embedding)
//! falls to ≈ 10× the median two layers later, where a 20× ratio missed it. Comparing against
//! the row's median, not against the other channels' maximum, is what lets two, three or four
//! equal channels all qualify — an "abs-argmax in most rows" rule sees only one of two equal
//! channels.
//!
//! The engine's monitor (warm-up) and the offline pre-screen both use this module, so they
//! report the same set.

/// The rule's parameters.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MassiveRule {
    /// Magnitude ÷ the row's median magnitude above which a channel is massive in that row.
    pub ratio: f32,
    /// Share of rows in which a channel must be massive to be a massive channel.
    pub share: f64,
}

pub const DEFAULT_MASSIVE_RATIO: f32 = 6.0;
pub const DEFAULT_MASSIVE_SHARE: f64 = 0.5;

impl Default for MassiveRule {
    fn default() -> Self {
        Self {
            ratio: DEFAULT_MASSIVE_RATIO,
            share: DEFAULT_MASSIVE_SHARE,
        }
    }
}

/// Median of the magnitudes of `row` (upper median), using `scratch` as working space.
pub fn median_abs(row: &[f32], scratch: &mut Vec<f32>) -> f32 {
    if row.is_empty() {
        return 0.0;
    }
    scratch.clear();
    scratch.extend(row.iter().map(|v| v.abs()));
    let mid = scratch.len() / 2;
    *scratch.select_nth_unstable_by(mid, f32::total_cmp).1
}

/// Append to `out` the channels of `row` whose magnitude exceeds `ratio` × the row's median
/// magnitude. A row whose median is 0 (all-zero or mostly zero) marks nothing.
pub fn massive_in_row(row: &[f32], ratio: f32, scratch: &mut Vec<f32>, out: &mut Vec<u32>) {
    let med = median_abs(row, scratch);
    if med.is_nan() || med <= 0.0 {
        return;
    }
    let bound = ratio * med;
    out.extend(
        row.iter()
            .enumerate()
            .filter(|(_, v)| v.abs() > bound)
            .map(|(c, _)| c as u32),
    );
}

/// Counts, over rows, how often each channel was massive in its row.
#[derive(Debug, Clone, Default)]
pub struct MassiveCounter {
    /// By channel (grown to the highest channel seen): the monitor counts every row of
    /// every step it learns from, so a flat array rather than a map.
    counts: Vec<u64>,
    rows: u64,
}

impl MassiveCounter {
    /// Count one row given the channels massive in it (see [`massive_in_row`]).
    pub fn add(&mut self, channels: &[u32]) {
        self.rows += 1;
        for &c in channels {
            let c = c as usize;
            if c >= self.counts.len() {
                self.counts.resize(c + 1, 0);
            }
            self.counts[c] += 1;
        }
    }

    /// Measure and count one row.
    pub fn add_row(&mut self, row: &[f32], ratio: f32, scratch: &mut Vec<f32>) {
        let mut found = Vec::new();
        massive_in_row(row, ratio, scratch, &mut found);
        self.add(&found);
    }

    pub fn rows(&self) -> u64 {
        self.rows
    }

    /// The channels massive in at least `share` of the rows counted, ascending.
    pub fn massive(&self, share: f64) -> Vec<usize> {
        if self.rows == 0 {
            return Vec::new();
        }
        let need = ((share * self.rows as f64).ceil() as u64).max(1);
        self.counts
            .iter()
            .enumerate()
            .filter(|(_, &n)| n >= need)
            .map(|(c, _)| c)
            .collect()
    }
}

/// The massive channels of row-major `x` (`[rows, dim]`) under `rule`.
pub fn massive_channels(x: &[f32], dim: usize, rule: MassiveRule) -> Vec<usize> {
    let mut counter = MassiveCounter::default();
    let mut scratch = Vec::with_capacity(dim);
    for row in x.chunks_exact(dim.max(1)) {
        counter.add_row(row, rule.ratio, &mut scratch);
    }
    counter.massive(rule.share)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use rand::SeedableRng;
    use rand_distr::{Distribution, Normal, StudentT};

    /// `rows` Gaussian rows of width `dim` with `planted` channels set to ± their magnitude
    /// (sign alternating by row, as real massive activations keep their sign but our rule
    /// must not care).
    fn rows(dim: usize, n: usize, planted: &[(usize, f32)], seed: u64) -> Vec<f32> {
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let d = Normal::new(0.0f32, 1.0).unwrap();
        let mut x: Vec<f32> = (0..dim * n).map(|_| d.sample(&mut rng)).collect();
        for r in 0..n {
            for &(c, m) in planted {
                x[r * dim + c] = if r % 2 == 0 { m } else { -m };
            }
        }
        x
    }

    #[test]
    fn one_massive_channel() {
        let x = rows(256, 200, &[(17, 40.0)], 1);
        assert_eq!(massive_channels(&x, 256, MassiveRule::default()), vec![17]);
    }

    #[test]
    fn two_equal_massive_channels_are_both_found() {
        let x = rows(192, 200, &[(17, 30.0), (101, 30.0)], 2);
        assert_eq!(
            massive_channels(&x, 192, MassiveRule::default()),
            vec![17, 101]
        );
    }

    #[test]
    fn four_channels_of_mixed_and_equal_size() {
        let planted = [(3, 25.0), (64, 80.0), (65, 80.0), (500, 200.0)];
        let x = rows(576, 300, &planted, 3);
        assert_eq!(
            massive_channels(&x, 576, MassiveRule::default()),
            vec![3, 64, 65, 500]
        );
    }

    #[test]
    fn ordinary_and_heavy_tailed_rows_have_none() {
        let x = rows(4096, 200, &[], 4);
        assert!(massive_channels(&x, 4096, MassiveRule::default()).is_empty());
        let mut rng = rand::rngs::StdRng::seed_from_u64(5);
        let t = StudentT::new(3.0f32).unwrap();
        let x: Vec<f32> = (0..4096 * 200).map(|_| t.sample(&mut rng)).collect();
        assert!(massive_channels(&x, 4096, MassiveRule::default()).is_empty());
    }

    #[test]
    fn a_channel_massive_in_few_rows_is_not_fixed() {
        // Massive on 10 % of rows only (input-dependent): not a massive channel.
        let mut x = rows(256, 200, &[], 6);
        for r in (0..200).step_by(10) {
            x[r * 256 + 9] = 50.0;
        }
        assert!(massive_channels(&x, 256, MassiveRule::default()).is_empty());
    }
}
