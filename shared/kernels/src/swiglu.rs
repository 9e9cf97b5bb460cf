//! SwiGLU, `silu(gate) · up`, over the rows of a fused `gate_up` product, on the pool.
//!
//! `silu(g) = g · σ(g)` with `σ` from one branch-free exponential of `-|g|` (never
//! positive, so [`crate::exp_nonpositive`] serves): `σ(g) = 1 / (1 + e)` for `g ≥ 0` and
//! `e / (1 + e)` below. The scalar and AVX2 builds run the same code (the AVX2 one compiled
//! with the features enabled), so they give the same bits.

use crate::layout::Out;
use crate::pool::Pool;
use crate::{exp_nonpositive, Isa, KernelError, Result};

/// `out[r][i] = silu(gu[r][i]) · gu[r][inter + i]` for `rows` rows of `gu` (`[rows][2·inter]`,
/// gate first), `out` `[rows][inter]`.
pub fn swiglu(
    gu: &[f32],
    rows: usize,
    inter: usize,
    out: &mut [f32],
    isa: Isa,
    pool: &Pool,
) -> Result<()> {
    if gu.len() != rows * 2 * inter || out.len() != rows * inter {
        return Err(KernelError::Shape(format!(
            "swiglu: {} inputs and {} outputs for {rows} rows of {inter}",
            gu.len(),
            out.len()
        )));
    }
    let isa = if isa.available() { isa } else { Isa::Scalar };
    let dst = Out(out.as_mut_ptr());
    let work = |range: std::ops::Range<usize>| {
        let dst = &dst;
        for r in range {
            let g = &gu[r * 2 * inter..][..inter];
            let u = &gu[r * 2 * inter + inter..][..inter];
            // SAFETY: each thread writes only the rows of its own chunks.
            let o = unsafe { std::slice::from_raw_parts_mut(dst.0.add(r * inter), inter) };
            match isa {
                #[cfg(target_arch = "x86_64")]
                // SAFETY: `isa.available()` checked AVX2 and FMA.
                isa if isa.x86_simd() => unsafe { row_avx2(g, u, o) },
                _ => row(g, u, o),
            }
        }
    };
    pool.chunks(rows, rows * inter < 16 * 1024, &work);
    Ok(())
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn row_avx2(g: &[f32], u: &[f32], o: &mut [f32]) {
    row(g, u, o)
}

#[inline(always)]
fn row(g: &[f32], u: &[f32], o: &mut [f32]) {
    for ((o, &g), &u) in o.iter_mut().zip(g).zip(u) {
        let e = exp_nonpositive(-g.abs());
        let sigmoid = if g >= 0.0 { 1.0 } else { e } / (1.0 + e);
        *o = g * sigmoid * u;
    }
}
