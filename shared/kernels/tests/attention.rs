//! Attention against a plain f64 softmax, every instruction set giving the same bits.
#![allow(clippy::unwrap_used)]

use proptest::prelude::*;
use quantmesh_kernels::{attention, exp_nonpositive, AttentionShape, Isa, Pool};
use rand::{Rng, SeedableRng};

fn reference(q: &[f32], k: &[f32], v: &[f32], s: AttentionShape) -> Vec<f64> {
    let hd = s.head_dim;
    let keys = k.len() / (s.kv_heads * hd);
    let mut out = vec![0f64; q.len()];
    for i in 0..s.rows {
        for h in 0..s.heads {
            let g = h / (s.heads / s.kv_heads);
            let ctx = s.start + i + 1;
            let qh = &q[(i * s.heads + h) * hd..][..hd];
            let sc: Vec<f64> = (0..ctx)
                .map(|j| {
                    let kj = &k[(g * keys + j) * hd..][..hd];
                    qh.iter()
                        .zip(kj)
                        .map(|(a, b)| *a as f64 * *b as f64)
                        .sum::<f64>()
                        / (hd as f64).sqrt()
                })
                .collect();
            let mx = sc.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let e: Vec<f64> = sc.iter().map(|x| (x - mx).exp()).collect();
            let z: f64 = e.iter().sum();
            for d in 0..hd {
                out[(i * s.heads + h) * hd + d] = (0..ctx)
                    .map(|j| e[j] * v[(g * keys + j) * hd + d] as f64)
                    .sum::<f64>()
                    / z;
            }
        }
    }
    out
}

fn check(s: AttentionShape, extra_keys: usize, seed: u64, threads: usize) {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let keys = s.start + s.rows + extra_keys;
    let mut r = |n: usize, a: f32| (0..n).map(|_| rng.gen_range(-a..a)).collect::<Vec<f32>>();
    let q = r(s.rows * s.heads * s.head_dim, 3.0);
    let k = r(s.kv_heads * keys * s.head_dim, 3.0);
    let v = r(s.kv_heads * keys * s.head_dim, 1.0);
    let want = reference(&q, &k, &v, s);
    let pool = Pool::new(threads);
    let mut first: Option<Vec<f32>> = None;
    for isa in Isa::all_available() {
        let mut out = vec![f32::NAN; q.len()];
        attention(&q, &k, &v, s, &mut out, isa, &pool).unwrap();
        for (i, (g, w)) in out.iter().zip(&want).enumerate() {
            assert!(
                (*g as f64 - w).abs() < 1e-5,
                "{isa:?} {s:?} out {i}: {g} vs {w}"
            );
        }
        match &first {
            None => first = Some(out),
            Some(f) => assert_eq!(f, &out, "{isa:?} differs from the scalar build"),
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(40))]
    #[test]
    fn equals_the_reference(
        rows in 1usize..9, start in 0usize..40, kv_heads in 1usize..4, rep in 1usize..4,
        head_dim in 1usize..70, extra in 0usize..5, seed in 0u64..1000, threads in 1usize..4,
    ) {
        let s = AttentionShape { rows, start, heads: kv_heads * rep, kv_heads, head_dim };
        check(s, extra, seed, threads);
    }
}

#[test]
fn model_shapes() {
    // SmolLM2: 9 heads over 3, width 64; a prefill chunk and a decode step.
    let s = AttentionShape {
        rows: 40,
        start: 0,
        heads: 9,
        kv_heads: 3,
        head_dim: 64,
    };
    check(s, 0, 1, 2);
    let s = AttentionShape {
        rows: 1,
        start: 300,
        heads: 9,
        kv_heads: 3,
        head_dim: 64,
    };
    check(s, 7, 2, 2);
    // Width 128 (Llama-style heads; its own SIMD form), grouped 4 to 1.
    let s = AttentionShape {
        rows: 9,
        start: 20,
        heads: 8,
        kv_heads: 2,
        head_dim: 128,
    };
    check(s, 3, 3, 2);
}

#[test]
fn exp_is_accurate_and_safe() {
    let mut x = 0f32;
    while x >= -87.0 {
        let (got, want) = (exp_nonpositive(x) as f64, (x as f64).exp());
        assert!(
            ((got - want) / want).abs() < 3e-7,
            "exp({x}) = {got}, want {want}"
        );
        x -= 0.0137;
    }
    assert_eq!(exp_nonpositive(0.0), 1.0);
    assert_eq!(exp_nonpositive(-100.0), 0.0);
    assert_eq!(exp_nonpositive(f32::NEG_INFINITY), 0.0);
    assert_eq!(exp_nonpositive(f32::NAN), 0.0);
}

#[test]
fn bad_shapes_are_errors() {
    let s = AttentionShape {
        rows: 2,
        start: 1,
        heads: 2,
        kv_heads: 1,
        head_dim: 4,
    };
    let mut out = vec![0.0; 16];
    // two keys where row 1 needs three
    assert!(attention(
        &[0.0; 16],
        &[0.0; 8],
        &[0.0; 8],
        s,
        &mut out,
        Isa::Scalar,
        Pool::global()
    )
    .is_err());
    let s = AttentionShape {
        heads: 3,
        kv_heads: 2,
        ..s
    };
    assert!(attention(
        &[0.0; 24],
        &[0.0; 24],
        &[0.0; 24],
        s,
        &mut out,
        Isa::Scalar,
        Pool::global()
    )
    .is_err());
}
