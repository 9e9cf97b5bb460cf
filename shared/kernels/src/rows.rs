//! The step's small per-row operations around the products, on plain slices: RMSNorm,
//! rotary position embedding, the KV cache's INT8 rows back to f32, and sampling's softmax
//! weights. One pass over each row, no temporaries (the tensor library's form of RMSNorm or
//! RoPE is five to nine element-wise operations, each allocating its result), and the same
//! bits whatever the batch a row is in.

use crate::{Isa, KernelError, Result};
use std::mem::MaybeUninit;

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
    // Written in place of the allocation's spare capacity (no zeroing pass first).
    let norm = |x: &[f32], out: &mut [MaybeUninit<f32>]| {
        for (row, out) in x.chunks_exact(cols).zip(out.chunks_exact_mut(cols)) {
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
            for ((o, v), w) in out.iter_mut().zip(row).zip(w) {
                o.write(v / d * w);
            }
        }
    };
    let mut out = Vec::with_capacity(x.len());
    let spare = &mut out.spare_capacity_mut()[..x.len()];
    // A batch's rows on the pool, whole rows per thread (each row on its own, so the same
    // bits); a few rows are not worth waking the workers for.
    let pool = crate::Pool::global();
    let per = pool.rows_per_share(x.len() / cols, x.len()) * cols;
    let mut shares: Vec<_> = x.chunks(per).zip(spare.chunks_mut(per)).collect();
    pool.for_each_mut(&mut shares, |(x, out)| norm(x, out));
    // SAFETY: every one of the first `x.len()` values was written above (each row of `x`
    // by exactly one share; `x.len()` is a multiple of `cols`, checked).
    unsafe { out.set_len(x.len()) };
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

/// `dst[i] = src[i] · scale`: a row of 8-bit values back to f32 (the KV cache's INT8 pages).
/// The same bits under every instruction set (one multiply per value).
pub fn dequantize_i8(src: &[i8], scale: f32, dst: &mut [f32], isa: Isa) -> Result<()> {
    if src.len() != dst.len() {
        return Err(KernelError::Shape(format!(
            "dequantize {} values into {}",
            src.len(),
            dst.len()
        )));
    }
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `available()` checked AVX2 and FMA.
        isa if isa.x86_simd() && isa.available() => unsafe { dequantize_avx2(src, scale, dst) },
        _ => dequantize(src, scale, dst),
    }
    Ok(())
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn dequantize_avx2(src: &[i8], scale: f32, dst: &mut [f32]) {
    dequantize(src, scale, dst)
}

#[inline(always)]
fn dequantize(src: &[i8], scale: f32, dst: &mut [f32]) {
    for (o, &x) in dst.iter_mut().zip(src) {
        *o = x as f32 * scale;
    }
}

/// Sampling's unnormalized softmax: `w[i] = e^((logits[i] − max) · inv_t)` for every finite
/// logit (`max` the largest finite one) and 0 for the others (masked to −∞, NaN). Returns the
/// sum of the weights, or `None` when no logit is finite. The exponential is
/// [`crate::exp_nonpositive`] (about 2 ulp); maximum and sum run in 8 lanes, so the loops
/// vectorize and every instruction set gives the same bits.
pub fn softmax_weights(logits: &[f32], inv_t: f32, w: &mut [f32], isa: Isa) -> Result<Option<f32>> {
    if logits.len() != w.len() {
        return Err(KernelError::Shape(format!(
            "softmax weights of {} logits into {}",
            logits.len(),
            w.len()
        )));
    }
    Ok(match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `available()` checked AVX2 and FMA.
        isa if isa.x86_simd() && isa.available() => unsafe { weights_avx2(logits, inv_t, w) },
        _ => weights(logits, inv_t, w),
    })
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn weights_avx2(logits: &[f32], inv_t: f32, w: &mut [f32]) -> Option<f32> {
    weights(logits, inv_t, w)
}

#[inline(always)]
fn weights(logits: &[f32], inv_t: f32, w: &mut [f32]) -> Option<f32> {
    // Largest finite logit, in 8 lanes (a non-finite value counts as −∞).
    let mut lanes = [f32::NEG_INFINITY; 8];
    let mut chunks = logits.chunks_exact(8);
    for c in &mut chunks {
        for (m, &v) in lanes.iter_mut().zip(c) {
            let v = if v.is_finite() { v } else { f32::NEG_INFINITY };
            *m = if v > *m { v } else { *m };
        }
    }
    for (m, &v) in lanes.iter_mut().zip(chunks.remainder()) {
        if v.is_finite() && v > *m {
            *m = v;
        }
    }
    let max = lanes
        .iter()
        .fold(f32::NEG_INFINITY, |a, &b| if b > a { b } else { a });
    if max == f32::NEG_INFINITY {
        return None;
    }
    // The exponentials' arguments (≤ 0 for a finite logit, −∞ for the others), then the
    // exponentials in place (exp_nonpositive gives 0 for −∞), then their sum in 8 lanes:
    // three simple loops, each of which vectorizes.
    for (o, &v) in w.iter_mut().zip(logits) {
        *o = if v.is_finite() {
            (v - max) * inv_t
        } else {
            f32::NEG_INFINITY
        };
    }
    for o in w.iter_mut() {
        *o = crate::exp_nonpositive(*o);
    }
    let mut sums = [0f32; 8];
    let mut chunks = w.chunks_exact(8);
    for c in &mut chunks {
        for (s, &v) in sums.iter_mut().zip(c) {
            *s += v;
        }
    }
    for (s, &v) in sums.iter_mut().zip(chunks.remainder()) {
        *s += v;
    }
    Some(sums.iter().sum())
}
