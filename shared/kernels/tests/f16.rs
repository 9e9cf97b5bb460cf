//! The f16 product against the reference and against f64, over odd shapes.
#![allow(clippy::unwrap_used)]

use half::f16;
use proptest::prelude::*;
use quantmesh_kernels::{f16_matmul, Isa, Pool};
use rand::{Rng, SeedableRng};

fn check(rows: usize, cols: usize, m: usize, seed: u64, threads: usize) {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let w: Vec<f16> = (0..rows * cols)
        .map(|_| f16::from_f32(rng.gen_range(-0.5..0.5)))
        .collect();
    let x: Vec<f32> = (0..m * cols).map(|_| rng.gen_range(-2.0..2.0)).collect();
    let pool = Pool::new(threads);
    for isa in Isa::all_available() {
        let mut out = vec![f32::NAN; m * rows];
        f16_matmul(&w, rows, cols, &x, &mut out, isa, &pool).unwrap();
        for i in 0..m {
            for r in 0..rows {
                let (mut e, mut mag) = (0f64, 0f64);
                for c in 0..cols {
                    let t = w[r * cols + c].to_f64() * x[i * cols + c] as f64;
                    e += t;
                    mag += t.abs();
                }
                let g = out[i * rows + r] as f64;
                assert!(
                    (g - e).abs() <= 1e-6 * mag + 1e-30,
                    "{isa:?} [{rows}x{cols}] m={m} ({i},{r}): {g} vs {e}"
                );
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]
    #[test]
    fn simd_equals_the_reference(
        rows in 1usize..30, cols in 1usize..90, m in 1usize..8,
        seed in 0u64..1000, threads in 1usize..4,
    ) {
        check(rows, cols, m, seed, threads);
    }
}

#[test]
fn model_shapes() {
    check(1000, 576, 1, 1, 2);
    check(96, 576, 67, 2, 2);
}

#[test]
fn bad_shapes_are_errors() {
    let w = vec![f16::ONE; 8];
    let mut out = vec![0.0; 2];
    assert!(f16_matmul(&w, 2, 4, &[1.0; 3], &mut out, Isa::Scalar, Pool::global()).is_err());
    assert!(f16_matmul(&w, 3, 4, &[1.0; 4], &mut out, Isa::Scalar, Pool::global()).is_err());
    f16_matmul(&w, 2, 4, &[1.0; 4], &mut out, Isa::Scalar, Pool::global()).unwrap();
    assert_eq!(out, vec![4.0, 4.0]);
}
