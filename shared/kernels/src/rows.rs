//! The step's small per-row operations around the products, on plain slices: RMSNorm and
//! rotary position embedding. One pass over each row, no temporaries (the tensor library's
//! form of each is five to nine element-wise operations, each allocating its result), and the
//! same bits whatever the batch a row is in.

use crate::{KernelError, Result};

/// `out = x / sqrt(mean(x²) + eps) · w` for each row of `x` (`x.len() / w.len()` rows).
/// The squares are summed in 8 lanes (then the lanes in order), so the loop vectorizes and
/// every build gives the same bits.
pub fn rms_norm(x: &[f32], w: &[f32], eps: f32) -> Result<Vec<f32>> {
    let cols = w.len();
    if cols == 0 || !x.len().is_multiple_of(cols) {
        return Err(KernelError::Shape(format!(
            "RMSNorm of {} values with a weight of {cols}",
            x.len()
        )));
    }
    let mut out = Vec::with_capacity(x.len());
    for row in x.chunks_exact(cols) {
        let mut lanes = [0f32; 8];
        let mut chunks = row.chunks_exact(8);
        for c in &mut chunks {
            for (l, v) in lanes.iter_mut().zip(c) {
                *l += v * v;
            }
        }
        for (l, v) in lanes.iter_mut().zip(chunks.remainder()) {
            *l += v * v;
        }
        let sum = lanes.iter().sum::<f32>();
        let d = (sum / cols as f32 + eps).sqrt();
        out.extend(row.iter().zip(w).map(|(v, w)| v / d * w));
    }
    Ok(out)
}

/// Rotary position embedding in the rotate-half form, in place, on consecutive heads of
/// width `2 · cos.len()` in `x`: each head's first half `a` and second half `b` become
/// `a·cos − b·sin` and `b·cos + a·sin`.
pub fn rope(x: &mut [f32], cos: &[f32], sin: &[f32]) -> Result<()> {
    let half = cos.len();
    if half == 0 || sin.len() != half || !x.len().is_multiple_of(2 * half) {
        return Err(KernelError::Shape(format!(
            "RoPE of {} values with tables of {} and {}",
            x.len(),
            cos.len(),
            sin.len()
        )));
    }
    for head in x.chunks_exact_mut(2 * half) {
        let (a, b) = head.split_at_mut(half);
        for (((a, b), c), s) in a.iter_mut().zip(b.iter_mut()).zip(cos).zip(sin) {
            let (x1, x2) = (*a, *b);
            *a = x1 * c - x2 * s;
            *b = x2 * c + x1 * s;
        }
    }
    Ok(())
}
