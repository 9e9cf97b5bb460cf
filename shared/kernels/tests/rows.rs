//! RMSNorm and RoPE against their formulas.
#![allow(clippy::unwrap_used)]

use proptest::prelude::*;
use quantmesh_kernels::{rms_norm, rope};

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

#[test]
fn bad_shapes_are_errors() {
    assert!(rms_norm(&[1.0; 5], &[1.0; 2], 1e-5).is_err());
    assert!(rms_norm(&[1.0; 4], &[], 1e-5).is_err());
    assert!(rope(&mut [1.0; 6], &[1.0; 2], &[0.0; 2]).is_err());
    assert!(rope(&mut [1.0; 8], &[1.0; 2], &[0.0; 3]).is_err());
}
