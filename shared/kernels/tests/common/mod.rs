//! What the product tests share: random operands, the exact product of the dequantized
//! operands, and each weight form's two product calls checked against each other.
#![allow(clippy::unwrap_used, dead_code)]

use quantmesh_kernels::{ActBits, Activations, Isa, PackedQ4, PackedQ8, Pool, Result};
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

/// Whether this machine runs the NEON kernels (aarch64; the test command runs the kernel
/// tests there under qemu-user). Elsewhere it checks that no instruction set claims NEON.
pub fn neon_here() -> bool {
    if !Isa::Neon.available() {
        assert_ne!(
            std::env::consts::ARCH,
            "aarch64",
            "every aarch64 core has NEON"
        );
        return false;
    }
    assert_eq!(Isa::detect(), Isa::Neon, "the best this CPU runs");
    true
}

/// The NEON product of `w` equals the scalar reference's bit for bit, on the activations
/// `xf` (`m` rows) quantized to both widths, on one thread and on three.
pub fn neon_equals_reference_bitwise(w: &impl Weights, xf: &[f32], m: usize) {
    for bits in [ActBits::Eight, ActBits::Sixteen] {
        let mut a = Activations::new();
        a.quantize_with(xf, m, w.cols(), bits, Isa::Scalar).unwrap();
        for threads in [1, 3] {
            let pool = Pool::new(threads);
            let reference = product(w, &a, Isa::Scalar, &pool);
            let neon = product(w, &a, Isa::Neon, &pool);
            assert!(
                reference
                    .iter()
                    .zip(&neon)
                    .all(|(r, n)| r.to_bits() == n.to_bits()),
                "[{}x{}] m={m} {bits:?} threads={threads}",
                w.rows(),
                w.cols()
            );
        }
    }
}
