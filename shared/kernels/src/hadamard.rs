//! Block rotations of activation rows and weight rows: the normalized Walsh–Hadamard
//! transform `H_b / √b` applied to every consecutive block of `b` values (`b` a power of
//! two). `H_b / √b` is orthogonal and its own inverse, so `W·x = (W·H)·(H·x)`: rotating the
//! weights' rows once at load and each activation row before it is quantized keeps the
//! product exact in float, while an outlier channel is spread over its block and no longer
//! sets the block's quantization step alone.

use crate::{KernelError, Result};

/// The largest power of two `≤ block` that divides `width` (at least 1).
pub fn rotation_block(width: usize, block: usize) -> usize {
    let mut b = block.max(1).next_power_of_two();
    if b > block.max(1) {
        b /= 2;
    }
    while b > 1 && !width.is_multiple_of(b) {
        b /= 2;
    }
    b
}

/// Rotate every block of `block` values of `x` in place by `H_block / √block`.
/// `block` must be a power of two dividing `x.len()`; `block` 1 leaves `x` as it is.
pub fn hadamard_blocks(x: &mut [f32], block: usize) -> Result<()> {
    if block == 0 || !block.is_power_of_two() || !x.len().is_multiple_of(block) {
        return Err(KernelError::Shape(format!(
            "a Hadamard rotation of block {block} over {} values",
            x.len()
        )));
    }
    if block == 1 {
        return Ok(());
    }
    let scale = 1.0 / (block as f32).sqrt();
    for chunk in x.chunks_exact_mut(block) {
        // Sylvester's butterfly: log2(block) passes of sums and differences; the first
        // three (strides 1, 2, 4) on fixed groups of 8, which compile to straight-line code.
        let mut h = 1;
        if block >= 8 {
            for g in chunk.chunks_exact_mut(8) {
                let v: [f32; 8] = [g[0], g[1], g[2], g[3], g[4], g[5], g[6], g[7]];
                let a = [
                    v[0] + v[1],
                    v[0] - v[1],
                    v[2] + v[3],
                    v[2] - v[3],
                    v[4] + v[5],
                    v[4] - v[5],
                    v[6] + v[7],
                    v[6] - v[7],
                ];
                let b = [
                    a[0] + a[2],
                    a[1] + a[3],
                    a[0] - a[2],
                    a[1] - a[3],
                    a[4] + a[6],
                    a[5] + a[7],
                    a[4] - a[6],
                    a[5] - a[7],
                ];
                for i in 0..4 {
                    g[i] = b[i] + b[i + 4];
                    g[i + 4] = b[i] - b[i + 4];
                }
            }
            h = 8;
        }
        while h < block {
            for pair in chunk.chunks_exact_mut(2 * h) {
                let (a, b) = pair.split_at_mut(h);
                for (a, b) in a.iter_mut().zip(b.iter_mut()) {
                    let (s, d) = (*a + *b, *a - *b);
                    *a = s;
                    *b = d;
                }
            }
            h *= 2;
        }
        for v in chunk.iter_mut() {
            *v *= scale;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `H_b / √b` by its definition: entry (i, j) is (−1)^popcount(i & j) / √b.
    fn dense(b: usize) -> Vec<f32> {
        let s = 1.0 / (b as f32).sqrt();
        (0..b * b)
            .map(|k| {
                let (i, j) = (k / b, k % b);
                if (i & j).count_ones() % 2 == 0 {
                    s
                } else {
                    -s
                }
            })
            .collect()
    }

    #[test]
    fn the_butterfly_is_the_dense_matrix_and_its_own_inverse() {
        for b in [2usize, 4, 32, 64, 128] {
            let x: Vec<f32> = (0..3 * b)
                .map(|i| ((i as f32) * 0.37).sin() * 3.0 + if i == 5 { 40.0 } else { 0.0 })
                .collect();
            let mut y = x.clone();
            hadamard_blocks(&mut y, b).unwrap();
            let h = dense(b);
            for (blk, (xs, ys)) in x.chunks(b).zip(y.chunks(b)).enumerate() {
                for i in 0..b {
                    let want: f32 = (0..b).map(|j| h[i * b + j] * xs[j]).sum();
                    assert!(
                        (want - ys[i]).abs() < 1e-4,
                        "block {blk} row {i}: {want} vs {}",
                        ys[i]
                    );
                }
            }
            hadamard_blocks(&mut y, b).unwrap();
            for (a, b) in x.iter().zip(&y) {
                assert!((a - b).abs() < 1e-4);
            }
        }
    }

    #[test]
    fn an_outlier_is_spread_over_its_block_only() {
        let mut x = vec![0.5f32; 64];
        x[3] = 100.0;
        hadamard_blocks(&mut x, 32).unwrap();
        let first = x[..32].iter().fold(0f32, |m, v| m.max(v.abs()));
        assert!(first < 100.0 / 4.0, "the outlier still dominates: {first}");
        // The second block was constant: all its energy lands in its first value.
        assert!((x[32] - 0.5 * 32f32.sqrt()).abs() < 1e-4);
        assert!(x[33..].iter().all(|v| v.abs() < 1e-5));
    }

    #[test]
    fn bad_blocks_are_refused_and_block_sizes_fit_the_width() {
        assert!(hadamard_blocks(&mut [0.0; 48], 32).is_err());
        assert!(hadamard_blocks(&mut [0.0; 48], 12).is_err());
        assert_eq!(rotation_block(576, 128), 64);
        assert_eq!(rotation_block(1536, 128), 128);
        assert_eq!(rotation_block(1536, 100), 64);
        assert_eq!(rotation_block(576, 32), 32);
        assert_eq!(rotation_block(7, 32), 1);
    }
}
