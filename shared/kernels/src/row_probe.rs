//! What the activation monitor reads off one input row of a group, in one pass over it:
//! the row's sum (finite or not: a NaN or Inf anywhere makes it non-finite), its largest
//! magnitude, and — when the group has a quantized form — the two sums of its harm ratio
//! (a `ColumnError`'s per-column error and energy, weighted by the row's squares). The monitor runs this on every row of every monitored
//! group between the products, on one thread, so it is written to vectorize: sixteen
//! independent lanes per sum, compiled for the best instruction set the CPU runs. The
//! lanes are combined in a fixed order and no multiply is fused into an add, so every
//! instruction set gives the same bits.

use crate::Isa;

/// Lanes per accumulator: one AVX-512 register, two AVX2 registers.
const LANES: usize = 16;

/// One row's statistics (see the module's documentation).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RowProbe {
    /// `Σ x_j`: non-finite when any value is.
    pub sum: f32,
    /// `max |x_j|`, NaN values skipped.
    pub abs_max: f32,
    /// `Σ x_j² · error_j` (0 without columns).
    pub noise: f32,
    /// `Σ x_j² · energy_j` (0 without columns).
    pub signal: f32,
}

impl RowProbe {
    /// The harm ratio `noise / signal`; 0 for a row with no signal.
    pub fn nsr(&self) -> f32 {
        if self.signal > 0.0 {
            self.noise / self.signal
        } else {
            0.0
        }
    }
}

/// Probe `row`, with the harm sums over a quantization's per-column `(error, energy)` when
/// given (a `ColumnError`'s `columns()`; channels past the shortest of the three count for
/// the sum and the maximum only).
pub fn probe_row(row: &[f32], columns: Option<(&[f32], &[f32])>, isa: Isa) -> RowProbe {
    let (error, energy) = match columns {
        Some((error, energy)) => {
            let n = row.len().min(error.len()).min(energy.len());
            (&error[..n], &energy[..n])
        }
        None => (&[][..], &[][..]),
    };
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `available()` checked AVX-512 F (and AVX2 below it).
        Isa::Avx512 | Isa::Amx if isa.available() => unsafe { probe_avx512(row, error, energy) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `available()` checked AVX2 and FMA.
        isa if isa.x86_simd() && isa.available() => unsafe { probe_avx2(row, error, energy) },
        _ => probe(row, error, energy),
    }
}

/// `max |x_j|` over `x`, NaN values skipped (0 for an empty slice), vectorized as
/// [`probe_row`]; the same bits under every instruction set.
pub fn abs_max(x: &[f32], isa: Isa) -> f32 {
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as in `probe_row`.
        Isa::Avx512 | Isa::Amx if isa.available() => unsafe { abs_max_avx512(x) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as in `probe_row`.
        isa if isa.x86_simd() && isa.available() => unsafe { abs_max_avx2(x) },
        _ => abs_max_lanes(x),
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn probe_avx512(row: &[f32], error: &[f32], energy: &[f32]) -> RowProbe {
    probe(row, error, energy)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn probe_avx2(row: &[f32], error: &[f32], energy: &[f32]) -> RowProbe {
    probe(row, error, energy)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn abs_max_avx512(x: &[f32]) -> f32 {
    abs_max_lanes(x)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn abs_max_avx2(x: &[f32]) -> f32 {
    abs_max_lanes(x)
}

/// The larger of `m` and `|v|`, keeping `m` when `v` is NaN (a compare and a blend).
#[inline(always)]
fn max_abs(m: f32, v: f32) -> f32 {
    let a = v.abs();
    if a > m {
        a
    } else {
        m
    }
}

/// Lane `k` of each accumulator takes channels `k, k + 16, …`; the lanes are then
/// combined in order, and the channels past the last whole 16 added one by one.
#[inline(always)]
fn probe(row: &[f32], error: &[f32], energy: &[f32]) -> RowProbe {
    let mut sum = [0f32; LANES];
    let mut max = [0f32; LANES];
    let mut noise = [0f32; LANES];
    let mut signal = [0f32; LANES];
    // The harm's channels first (all of the row when the weight is as wide), then the rest.
    let h = error.len();
    let (head, rest) = row.split_at(h);
    let mut x = head.chunks_exact(LANES);
    let mut e = error.chunks_exact(LANES);
    let mut w = energy.chunks_exact(LANES);
    for ((x, e), w) in (&mut x).zip(&mut e).zip(&mut w) {
        for k in 0..LANES {
            let v = x[k];
            let s = v * v;
            sum[k] += v;
            max[k] = max_abs(max[k], v);
            noise[k] += s * e[k];
            signal[k] += s * w[k];
        }
    }
    let mut r = RowProbe {
        sum: sum.iter().sum(),
        abs_max: max.iter().fold(0f32, |m, &v| if v > m { v } else { m }),
        noise: noise.iter().sum(),
        signal: signal.iter().sum(),
    };
    for ((&v, &e), &w) in x.remainder().iter().zip(e.remainder()).zip(w.remainder()) {
        let s = v * v;
        r.sum += v;
        r.abs_max = max_abs(r.abs_max, v);
        r.noise += s * e;
        r.signal += s * w;
    }
    if !rest.is_empty() {
        r.sum += sum_lanes(rest);
        r.abs_max = max_abs(r.abs_max, abs_max_lanes(rest));
    }
    r
}

#[inline(always)]
fn sum_lanes(x: &[f32]) -> f32 {
    let mut lanes = [0f32; LANES];
    let mut c = x.chunks_exact(LANES);
    for c in &mut c {
        for k in 0..LANES {
            lanes[k] += c[k];
        }
    }
    lanes.iter().sum::<f32>() + c.remainder().iter().sum::<f32>()
}

#[inline(always)]
fn abs_max_lanes(x: &[f32]) -> f32 {
    let mut lanes = [0f32; LANES];
    let mut c = x.chunks_exact(LANES);
    for c in &mut c {
        for k in 0..LANES {
            lanes[k] = max_abs(lanes[k], c[k]);
        }
    }
    let m = lanes.iter().fold(0f32, |m, &v| if v > m { v } else { m });
    c.remainder().iter().fold(m, |m, &v| max_abs(m, v))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// A quantization's per-column (error, energy).
    fn columns(n: usize, seed: u32) -> (Vec<f32>, Vec<f32>) {
        let f = |i: usize, k: u32| ((i as u32).wrapping_mul(2_654_435_761) ^ k) % 1000;
        (
            (0..n).map(|i| f(i, seed) as f32 * 1e-5).collect(),
            (0..n).map(|i| 0.1 + f(i, seed + 7) as f32 * 1e-3).collect(),
        )
    }

    proptest! {
        /// Every instruction set gives the scalar reference's bits, for any width (whole
        /// lanes or not, weights as wide as the row, narrower or wider), and the sums are
        /// what a plain f64 loop gives.
        #[test]
        fn every_instruction_set_gives_the_reference_bits(
            row in proptest::collection::vec(-50f32..50.0, 0..300),
            extra in 0usize..40,
            narrower in any::<bool>(),
            seed in 0u32..1000,
        ) {
            let width = if narrower { row.len().saturating_sub(extra) } else { row.len() + extra };
            let (error, energy) = columns(width, seed);
            for cols in [None, Some((&error[..], &energy[..]))] {
                let reference = probe_row(&row, cols, Isa::Scalar);
                for isa in Isa::all_available() {
                    prop_assert_eq!(probe_row(&row, cols, isa), reference, "{:?}", isa);
                    prop_assert_eq!(abs_max(&row, isa).to_bits(), reference.abs_max.to_bits());
                }
                let n = cols.map_or(0, |(e, _)| e.len().min(row.len()));
                let (mut noise, mut signal) = (0f64, 0f64);
                for ((&x, &e), &w) in row.iter().zip(&error).zip(&energy).take(n) {
                    let s = (x as f64).powi(2);
                    noise += s * e as f64;
                    signal += s * w as f64;
                }
                let sum: f64 = row.iter().map(|&v| v as f64).sum();
                let max = row.iter().fold(0f32, |m, v| m.max(v.abs()));
                prop_assert!((reference.sum as f64 - sum).abs() <= 1e-4 * (1.0 + row.len() as f64 * 50.0));
                prop_assert_eq!(reference.abs_max, max);
                prop_assert!((reference.noise as f64 - noise).abs() <= 1e-5 * (1.0 + noise));
                prop_assert!((reference.signal as f64 - signal).abs() <= 1e-5 * (1.0 + signal));
            }
        }
    }

    /// A NaN or an infinity anywhere makes the sum non-finite (the monitor's check), and
    /// the maximum skips a NaN.
    #[test]
    fn a_non_finite_value_shows_in_the_sum_not_the_maximum() {
        for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
            for at in [0, 5, 16, 33] {
                let mut row: Vec<f32> = (0..37).map(|i| i as f32 * 0.5 - 9.0).collect();
                row[at] = bad;
                for isa in Isa::all_available() {
                    let p = probe_row(&row, None, isa);
                    assert!(!p.sum.is_finite(), "{isa:?} {bad} at {at}");
                    if bad.is_nan() {
                        let finite_max = row
                            .iter()
                            .filter(|v| v.is_finite())
                            .fold(0f32, |m, v| m.max(v.abs()));
                        assert_eq!(p.abs_max, finite_max, "{isa:?} at {at}");
                    }
                }
            }
        }
    }
}
