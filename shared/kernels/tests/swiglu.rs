//! SwiGLU against the f64 formula, every instruction set giving the same bits, one thread
//! or several.
#![allow(clippy::unwrap_used)]

use quantmesh_kernels::{swiglu, Isa, Pool};
use rand::{Rng, SeedableRng};

#[test]
fn equals_the_formula_with_the_same_bits_everywhere() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(11);
    for &(rows, inter, threads) in &[(1, 1536, 1), (7, 96, 2), (33, 1536, 2), (3, 5, 3)] {
        let mut gu: Vec<f32> = (0..rows * 2 * inter)
            .map(|_| rng.gen_range(-12.0f32..12.0))
            .collect();
        gu[0] = 0.0;
        gu[1] = -90.0; // σ underflows: silu → −0
        let mut first: Option<Vec<f32>> = None;
        for isa in Isa::all_available() {
            let mut out = vec![f32::NAN; rows * inter];
            swiglu(&gu, rows, inter, &mut out, isa, &Pool::new(threads)).unwrap();
            for r in 0..rows {
                for i in 0..inter {
                    let (g, u) = (
                        gu[r * 2 * inter + i] as f64,
                        gu[r * 2 * inter + inter + i] as f64,
                    );
                    let want = g / (1.0 + (-g).exp()) * u;
                    let got = out[r * inter + i] as f64;
                    assert!(
                        (got - want).abs() <= 1e-6 * want.abs() + 1e-30,
                        "{isa:?} row {r} col {i}: silu({g})·{u} = {got}, want {want}"
                    );
                }
            }
            match &first {
                None => first = Some(out),
                Some(f) => assert_eq!(f, &out, "{isa:?} differs from the scalar build"),
            }
        }
    }
    let mut out = vec![0.0; 4];
    assert!(swiglu(&[0.0; 6], 1, 4, &mut out, Isa::Scalar, Pool::global()).is_err());
}
