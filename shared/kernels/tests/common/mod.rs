//! What the product tests share: random operands, the exact product of the dequantized
//! operands, and each weight form's two product calls checked against each other.
#![allow(clippy::unwrap_used, dead_code)]

use quantmesh_kernels::{Activations, Isa, PackedQ4, PackedQ8, Pool, Result};
use rand::{Rng, SeedableRng};

/// `n` values in `±scale`, with a few loud channels (×20), as real activations have.
pub fn rand_vec(n: usize, seed: u64, scale: f32) -> Vec<f32> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    (0..n)
        .map(|i| {
            let v: f32 = rng.gen_range(-1.0..1.0) * scale;
            if i % 97 == 3 {
                v * 20.0
            } else {
                v
            }
        })
        .collect()
}

/// A packed weight form's product and shape, as the tests call them.
pub trait Weights {
    fn rows(&self) -> usize;
    fn cols(&self) -> usize;
    fn dequantize(&self) -> Vec<f32>;
    fn matmul(&self, a: &Activations, out: &mut [f32], isa: Isa, pool: &Pool) -> Result<()>;
    fn matmul_vec(&self, a: &Activations, isa: Isa, pool: &Pool) -> Result<Vec<f32>>;
}

macro_rules! weights {
    ($t:ty) => {
        impl Weights for $t {
            fn rows(&self) -> usize {
                <$t>::rows(self)
            }
            fn cols(&self) -> usize {
                <$t>::cols(self)
            }
            fn dequantize(&self) -> Vec<f32> {
                <$t>::dequantize(self)
            }
            fn matmul(
                &self,
                a: &Activations,
                out: &mut [f32],
                isa: Isa,
                pool: &Pool,
            ) -> Result<()> {
                <$t>::matmul(self, a, out, isa, pool)
            }
            fn matmul_vec(&self, a: &Activations, isa: Isa, pool: &Pool) -> Result<Vec<f32>> {
                <$t>::matmul_vec(self, a, isa, pool)
            }
        }
    };
}
weights!(PackedQ8);
weights!(PackedQ4);

/// The product into a buffer of NaNs and into a new vector: the same bits (every output is
/// written either way).
pub fn product(w: &impl Weights, a: &Activations, isa: Isa, pool: &Pool) -> Vec<f32> {
    let mut out = vec![f32::NAN; a.rows() * w.rows()];
    w.matmul(a, &mut out, isa, pool).unwrap();
    let fresh = w.matmul_vec(a, isa, pool).unwrap();
    assert_eq!(fresh.len(), out.len());
    assert!(fresh
        .iter()
        .zip(&out)
        .all(|(x, y)| x.to_bits() == y.to_bits()));
    out
}

/// The f64 product of the dequantized operands (what every kernel approximates), and each
/// output's sum of |terms| (the scale the f32 rounding error is measured against).
pub fn exact(w: &impl Weights, a: &Activations) -> (Vec<f64>, Vec<f64>) {
    let (wd, ad) = (w.dequantize(), a.dequantize());
    let k = w.cols();
    let mut sum = vec![0f64; a.rows() * w.rows()];
    let mut magnitude = sum.clone();
    for m in 0..a.rows() {
        for r in 0..w.rows() {
            for i in 0..k {
                let t = ad[m * k + i] as f64 * wd[r * k + i] as f64;
                sum[m * w.rows() + r] += t;
                magnitude[m * w.rows() + r] += t.abs();
            }
        }
    }
    (sum, magnitude)
}
