//! The portable reference kernels: plain loops, integer dot products per block, one f32
//! multiply-add per block and row. Every SIMD kernel is tested against these.

use crate::layout::{Activations, PackedQ8, BLOCK, TILE_ROWS};
use std::ops::Range;

/// Output columns of `tiles` for every activation row, written through `out`
/// (`a.rows × w.rows`, row-major).
pub(crate) fn q8_tiles(w: &PackedQ8, a: &Activations, tiles: Range<usize>, out: *mut f32) {
    let n = w.rows;
    for t in tiles {
        for m in 0..a.rows {
            let mut acc = [0f32; TILE_ROWS];
            for b in 0..w.blocks {
                let s = (t * w.blocks + b) * TILE_ROWS;
                let aq = &a.q[m * a.cols + b * BLOCK..][..BLOCK];
                let da = a.d[m * a.blocks + b];
                for (r, acc) in acc.iter_mut().enumerate() {
                    let wq = &w.qs[(s + r) * BLOCK..][..BLOCK];
                    let dot: i32 = wq.iter().zip(aq).map(|(&x, &y)| x as i32 * y as i32).sum();
                    *acc += dot as f32 * (w.d[s + r].to_f32() * da);
                }
            }
            for (r, &v) in acc.iter().enumerate() {
                let col = t * TILE_ROWS + r;
                if col < n {
                    // SAFETY: `col < n` and `m < a.rows`: inside the output the caller
                    // checked; this thread owns the columns of its tiles.
                    unsafe { *out.add(m * n + col) = v };
                }
            }
        }
    }
}
