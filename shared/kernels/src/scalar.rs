//! The portable reference kernels: plain loops, integer dot products per block, one f32
//! multiply-add per block and row. Every SIMD kernel is tested against these.

use crate::layout::{Activations, PackedQ8, BLOCK};
use crate::q4::{PackedQ4, Q4_TILE_ROWS};
use std::ops::Range;

/// Output columns of `tiles` for every activation row, written through `out`
/// (`a.rows × w.rows`, row-major). Reads either layout, block by block.
pub(crate) fn q8_tiles(w: &PackedQ8, a: &Activations, tiles: Range<usize>, out: *mut f32) {
    let n = w.rows;
    let th = w.layout.tile_rows();
    let mut acc = vec![0f32; a.rows * th];
    let mut blocks = vec![([0i8; BLOCK], 0f32); th];
    for t in tiles {
        acc.fill(0.0);
        for b in 0..w.blocks {
            for (r, block) in blocks.iter_mut().enumerate() {
                let (q, d) = w.block(t * th + r, b);
                *block = (q, d.to_f32());
            }
            for (m, acc) in acc.chunks_exact_mut(th).enumerate() {
                let aq = &a.q[m * a.cols + b * BLOCK..][..BLOCK];
                let da = a.d[m * a.blocks + b];
                for (acc, (wq, dw)) in acc.iter_mut().zip(&blocks) {
                    let dot: i32 = wq.iter().zip(aq).map(|(&x, &y)| x as i32 * y as i32).sum();
                    *acc += dot as f32 * (dw * da);
                }
            }
        }
        store(&acc, t, th, n, out);
    }
}

/// As [`q8_tiles`], for 4-bit weights: per block, `d · Σ q·a` plus the offset's `m · Σ a`.
pub(crate) fn q4_tiles(w: &PackedQ4, a: &Activations, tiles: Range<usize>, out: *mut f32) {
    let n = w.rows;
    let th = Q4_TILE_ROWS;
    let mut acc = vec![0f32; a.rows * th];
    let mut blocks = [([0u8; BLOCK], 0f32, 0f32); Q4_TILE_ROWS];
    let sums = a.block_sums();
    for t in tiles {
        acc.fill(0.0);
        for b in 0..w.blocks {
            for (r, block) in blocks.iter_mut().enumerate() {
                *block = w.block(t * th + r, b);
            }
            for (m, acc) in acc.chunks_exact_mut(th).enumerate() {
                let aq = &a.q[m * a.cols + b * BLOCK..][..BLOCK];
                let (da, sa) = (a.d[m * a.blocks + b], sums[m * a.blocks + b]);
                for (acc, (wq, dw, mw)) in acc.iter_mut().zip(&blocks) {
                    let dot: i32 = wq.iter().zip(aq).map(|(&x, &y)| x as i32 * y as i32).sum();
                    *acc += dot as f32 * (dw * da) + mw * sa;
                }
            }
        }
        store(&acc, t, th, n, out);
    }
}

/// Write tile `t`'s accumulators (`[activation row][row in tile]`, `th` rows per tile) to
/// the output columns it owns (`n` columns in all; padding rows dropped).
fn store(acc: &[f32], t: usize, th: usize, n: usize, out: *mut f32) {
    for (m, acc) in acc.chunks_exact(th).enumerate() {
        for (r, &v) in acc.iter().enumerate() {
            let col = t * th + r;
            if col < n {
                // SAFETY: `col < n` and `m` is below the activations' rows: inside the
                // output the caller checked; this thread owns the columns of its tiles.
                unsafe { *out.add(m * n + col) = v };
            }
        }
    }
}
