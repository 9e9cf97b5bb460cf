//! RMSNorm, RoPE, INT8 dequantization and sampling's softmax weights against their
//! formulas, and every instruction set against the scalar reference (bit for bit).
#![allow(clippy::unwrap_used)]

use proptest::prelude::*;
use quantmesh_kernels::{dequantize_i8, rms_norm, rope, softmax_weights, Isa};

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]
    /// Within a few ulps of the f64 formula, for widths that are and are not multiples of 8.
    #[test]
    fn rms_norm_is_the_formula(
        rows in 1usize..5,
        cols in 1usize..70,
        seed in any::<u32>(),
    ) {
        let v = |i: usize| ((i as f32 + seed as f32 * 0.37) * 0.731).sin() * 3.0;
        let x: Vec<f32> = (0..rows * cols).map(v).collect();
        let w: Vec<f32> = (0..cols).map(|i| 0.5 + v(i + 1000)).collect();
        let eps = 1e-5f32;
        let got = rms_norm(&x, &w, eps).unwrap();
        prop_assert_eq!(got.len(), x.len());
        for (r, row) in x.chunks(cols).enumerate() {
            let ms = row.iter().map(|&a| a as f64 * a as f64).sum::<f64>() / cols as f64;
            let d = (ms + eps as f64).sqrt();
            for (c, &a) in row.iter().enumerate() {
                let want = a as f64 / d * w[c] as f64;
                let g = got[r * cols + c] as f64;
                prop_assert!((g - want).abs() <= 1e-5 * want.abs() + 1e-6, "{} vs {}", g, want);
            }
        }
    }
}

/// A batch large enough to be normalized on the pool's threads (an odd number of rows)
/// gives each row the bits it gets alone.
#[test]
fn rms_norm_of_a_batch_is_each_row_alone() {
    let (rows, cols) = (41, 576);
    let x: Vec<f32> = (0..rows * cols)
        .map(|i| ((i as f32) * 0.377).sin() * 4.0)
        .collect();
    let w: Vec<f32> = (0..cols).map(|i| 0.5 + (i as f32 * 0.1).cos()).collect();
    let batch = rms_norm(&x, &w, 1e-5).unwrap();
    for (r, row) in x.chunks_exact(cols).enumerate() {
        let one = rms_norm(row, &w, 1e-5).unwrap();
        let got = &batch[r * cols..(r + 1) * cols];
        assert!(
            got.iter()
                .zip(&one)
                .all(|(a, b)| a.to_bits() == b.to_bits()),
            "row {r}"
        );
    }
}

#[test]
fn rope_rotates_each_head_by_the_tables() {
    let half = 4;
    let cos: Vec<f32> = (0..half).map(|i| (i as f32 * 0.3).cos()).collect();
    let sin: Vec<f32> = (0..half).map(|i| (i as f32 * 0.3).sin()).collect();
    let x: Vec<f32> = (0..3 * 2 * half).map(|i| i as f32 * 0.25 - 2.0).collect();
    let mut y = x.clone();
    rope(&mut y, &cos, &sin).unwrap();
    for (h, (xh, yh)) in x.chunks(2 * half).zip(y.chunks(2 * half)).enumerate() {
        for j in 0..half {
            let (a, b) = (xh[j], xh[half + j]);
            assert_eq!(yh[j], a * cos[j] - b * sin[j], "head {h} {j}");
            assert_eq!(yh[half + j], b * cos[j] + a * sin[j], "head {h} {j}");
        }
    }
    // A rotation keeps each pair's length.
    for (xh, yh) in x.chunks(2 * half).zip(y.chunks(2 * half)) {
        for j in 0..half {
            let n0 = xh[j].hypot(xh[half + j]);
            let n1 = yh[j].hypot(yh[half + j]);
            assert!((n0 - n1).abs() <= 1e-5 * n0.max(1.0));
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]
    /// Every instruction set gives the formula's value exactly, on lengths that are and are
    /// not multiples of the vector width.
    #[test]
    fn dequantize_i8_is_the_product_on_every_isa(len in 0usize..150, seed in any::<u8>(), scale in 1e-4f32..0.2) {
        let src: Vec<i8> = (0..len).map(|i| (i as u8).wrapping_mul(37).wrapping_add(seed) as i8).collect();
        for isa in Isa::all_available() {
            let mut dst = vec![f32::NAN; len];
            dequantize_i8(&src, scale, &mut dst, isa).unwrap();
            for (d, &x) in dst.iter().zip(&src) {
                prop_assert_eq!(d.to_bits(), (x as f32 * scale).to_bits(), "{:?}", isa);
            }
        }
    }

    /// The weights are e^((l − max)/T) within a few ulp of the f64 formula, 0 for masked
    /// logits, summed correctly; every instruction set gives the scalar reference's bits.
    #[test]
    fn softmax_weights_are_the_formula_on_every_isa(
        len in 1usize..300,
        seed in any::<u32>(),
        temperature in 0.05f32..3.0,
        masked in 0usize..5,
    ) {
        let mut logits: Vec<f32> = (0..len)
            .map(|i| (i as f32 * 0.917 + seed as f32 * 0.013).sin() * 12.0)
            .collect();
        for m in 0..masked.min(len - 1) {
            logits[(m * 7919) % len] = if m % 2 == 0 { f32::NEG_INFINITY } else { f32::NAN };
        }
        let inv_t = 1.0 / temperature;
        let mut reference = vec![0f32; len];
        let total = softmax_weights(&logits, inv_t, &mut reference, Isa::Scalar).unwrap().unwrap();
        let max = logits.iter().copied().filter(|l| l.is_finite()).fold(f32::NEG_INFINITY, f32::max);
        let mut sum = 0f64;
        for (&w, &l) in reference.iter().zip(&logits) {
            if !l.is_finite() {
                prop_assert_eq!(w, 0.0);
                continue;
            }
            let x = (l as f64 - max as f64) * inv_t as f64;
            let want = x.exp();
            // The exponential's own error, plus the f32 rounding of its argument.
            let tol = want * (4e-7 + 2.4e-7 * x.abs()) + 2e-38; // 0 below e^-87
            prop_assert!((w as f64 - want).abs() <= tol, "{} vs {}", w, want);
            sum += w as f64;
        }
        prop_assert!((total as f64 - sum).abs() <= 1e-5 * sum);
        for isa in Isa::all_available() {
            let mut w = vec![f32::NAN; len];
            let t = softmax_weights(&logits, inv_t, &mut w, isa).unwrap().unwrap();
            prop_assert_eq!(t.to_bits(), total.to_bits(), "{:?}", isa);
            for (a, b) in w.iter().zip(&reference) {
                prop_assert_eq!(a.to_bits(), b.to_bits(), "{:?}", isa);
            }
        }
    }
}

#[test]
fn softmax_weights_of_no_finite_logit_are_none() {
    let logits = [f32::NEG_INFINITY, f32::NAN, f32::INFINITY];
    for isa in Isa::all_available() {
        let mut w = [1.0f32; 3];
        assert_eq!(softmax_weights(&logits, 1.0, &mut w, isa).unwrap(), None);
    }
}

#[test]
fn bad_shapes_are_errors() {
    assert!(dequantize_i8(&[1, 2], 1.0, &mut [0.0; 3], Isa::Scalar).is_err());
    assert!(softmax_weights(&[1.0; 2], 1.0, &mut [0.0; 3], Isa::Scalar).is_err());
    assert!(rms_norm(&[1.0; 5], &[1.0; 2], 1e-5).is_err());
    assert!(rms_norm(&[1.0; 4], &[], 1e-5).is_err());
    assert!(rope(&mut [1.0; 6], &[1.0; 2], &[0.0; 2]).is_err());
    assert!(rope(&mut [1.0; 8], &[1.0; 2], &[0.0; 3]).is_err());
}
