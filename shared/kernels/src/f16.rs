//! The float path's product over f16 weights, `out = x · Wᵀ` with `W` `[rows, cols]`
//! row-major f16 and `x` `[m, cols]` f32: the weights are widened in registers (F16C), so
//! no f32 copy of the weights is ever made, and each weight is read once per call for all
//! rows (register tiles of 4 weight rows × 2 activation rows; rows split across the pool's
//! threads in contiguous ranges).

use crate::layout::{F16Product, Out, ROW_BLOCK, TILE_ROWS};
use crate::pool::Pool;
use crate::{Isa, KernelError, Result};
use half::f16;

/// `out = x · wᵀ` (`m × rows`).
pub fn f16_matmul(
    w: &[f16],
    rows: usize,
    cols: usize,
    x: &[f32],
    out: &mut [f32],
    isa: Isa,
    pool: &Pool,
) -> Result<()> {
    if w.len() != rows * cols || cols == 0 || !x.len().is_multiple_of(cols) {
        return Err(KernelError::Shape(format!(
            "{} f16 weights for [{rows}, {cols}] and {} inputs",
            w.len(),
            x.len()
        )));
    }
    let m = x.len() / cols;
    if out.len() != m * rows {
        return Err(KernelError::Shape(format!(
            "output of {} values for [{m}, {rows}]",
            out.len()
        )));
    }
    if m == 0 || rows == 0 {
        return Ok(());
    }
    let tiles = rows.div_ceil(TILE_ROWS);
    let dst = Out(out.as_mut_ptr());
    let isa = if isa.available() { isa } else { Isa::Scalar };
    let work = |range: std::ops::Range<usize>| {
        let rows_range = range.start * TILE_ROWS..(range.end * TILE_ROWS).min(rows);
        if rows_range.is_empty() {
            return;
        }
        let dst = &dst;
        let p = F16Product {
            w,
            rows,
            cols,
            x,
            m,
        };
        match isa {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `isa.available()` checked AVX2, FMA and F16C.
            isa if isa.x86_simd() => unsafe { crate::x86::f16_rows(&p, rows_range, dst.0) },
            _ => p.scalar(rows_range, dst.0),
        }
    };
    pool.chunks(tiles, rows * cols * m < 64 * 1024, &work);
    Ok(())
}

impl F16Product<'_> {
    /// The reference: output columns `rows` for every input row, summed in f32 in order.
    fn scalar(&self, rows: std::ops::Range<usize>, out: *mut f32) {
        let k = self.cols;
        for m0 in (0..self.m).step_by(ROW_BLOCK) {
            for r in rows.clone() {
                let wr = &self.w[r * k..(r + 1) * k];
                for i in m0..(m0 + ROW_BLOCK).min(self.m) {
                    let xr = &self.x[i * k..(i + 1) * k];
                    let v: f32 = wr.iter().zip(xr).map(|(w, x)| w.to_f32() * x).sum();
                    // SAFETY: inside the output the caller checked; this thread owns
                    // columns `rows`.
                    unsafe { *out.add(i * self.rows + r) = v };
                }
            }
        }
    }
}
