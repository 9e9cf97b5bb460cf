//! The common head widths (64, 128) with their loops in AVX2 registers: the same
//! operations in the same order as the portable loops, so the same bits, with each key and
//! value row loaded once for the item's heads, the output kept in registers across a run
//! of rows and the exponentials 8 at a time.

use super::{KvElem, KvRun};
use std::arch::x86_64::*;

/// The loops for head width `8 · C`. Only [`super::item_avx2`] uses it, after the
/// caller checked AVX2 and FMA are available.
pub(super) struct Avx2<const C: usize>;

impl<const C: usize> super::Loops for Avx2<C> {
    #[inline(always)]
    fn dots<const G: usize, E: KvElem>(q: &[&[f32]; G], b: &[E]) -> [f32; G] {
        // SAFETY: built only behind the AVX2 check (see the type).
        unsafe { dots::<C, G, E>(q, b) }
    }
    #[inline(always)]
    fn scores_run<const G: usize, E: KvElem>(
        q: &[&[f32]; G],
        run: &KvRun<'_, E>,
        scale: f32,
        scores: &mut [f32],
        ctx: usize,
    ) {
        // SAFETY: as above. Four rows at a time for one or two heads, two for more, so
        // the sums fit the 16 AVX2 registers beside a row's chunk and the queries'.
        unsafe {
            match G {
                1 | 2 => scores_run::<C, 4, G, E>(q, run, scale, scores, ctx),
                _ => scores_run::<C, 2, G, E>(q, run, scale, scores, ctx),
            }
        }
    }
    #[inline(always)]
    fn max(s: &[f32]) -> f32 {
        // SAFETY: as above.
        unsafe { max(s) }
    }
    #[inline(always)]
    fn exp_shifted(s: &mut [f32], max: f32) -> f32 {
        // SAFETY: as above.
        unsafe { exp_shifted(s, max) }
    }
    #[inline(always)]
    fn weighted_run<const G: usize, E: KvElem>(p: &[&[f32]; G], run: &KvRun<'_, E>, o: &mut [f32]) {
        // SAFETY: as above. Blocks of output registers that fit the 16 AVX2 registers
        // beside one value register and the heads' weights.
        unsafe {
            match G {
                1 => weighted_run::<C, 8, G, E>(p, run, o),
                2 => weighted_run::<C, 4, G, E>(p, run, o),
                _ => weighted_run::<C, 2, G, E>(p, run, o),
            }
        }
    }
}

/// As the portable max: `vmaxps(x, m)` returns `m` when `x` is NaN, so NaN is ignored
/// as `f32::max` ignores it; the order of exact maxima does not matter.
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn max(s: &[f32]) -> f32 {
    let mut m = _mm256_set1_ps(f32::NEG_INFINITY);
    let chunks = s.chunks_exact(8);
    let rest = chunks.remainder();
    for c in chunks {
        m = _mm256_max_ps(_mm256_loadu_ps(c.as_ptr()), m);
    }
    let h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    let h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    let h = _mm_max_ss(h, _mm_movehdup_ps(h));
    rest.iter().fold(_mm_cvtss_f32(h), |m, &x| m.max(x))
}

/// [`super::exp_nonpositive`] on 8 lanes: the same operations in the same order.
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn exp8(x: __m256) -> __m256 {
    let ps = _mm256_set1_ps;
    let finite = _mm256_cmp_ps(x, ps(-87.0), _CMP_GE_OQ);
    let xc = _mm256_blendv_ps(ps(-87.0), _mm256_min_ps(x, ps(0.0)), finite);
    let round = ps(12_582_912.0);
    let n = _mm256_sub_ps(
        _mm256_add_ps(_mm256_mul_ps(xc, ps(std::f32::consts::LOG2_E)), round),
        round,
    );
    let r = _mm256_sub_ps(
        _mm256_sub_ps(xc, _mm256_mul_ps(n, ps(0.693_359_4))),
        _mm256_mul_ps(n, ps(-2.121_944_4e-4)),
    );
    let mut p = ps(1.987_569_1e-4);
    for c in [
        1.398_2e-3,
        8.333_452e-3,
        4.166_579_6e-2,
        1.666_666_5e-1,
        0.5,
    ] {
        p = _mm256_add_ps(_mm256_mul_ps(p, r), ps(c));
    }
    let p = _mm256_add_ps(
        _mm256_add_ps(_mm256_mul_ps(_mm256_mul_ps(p, r), r), r),
        ps(1.0),
    );
    let two_n = _mm256_castsi256_ps(_mm256_slli_epi32::<23>(_mm256_add_epi32(
        _mm256_cvttps_epi32(n),
        _mm256_set1_epi32(127),
    )));
    _mm256_and_ps(_mm256_mul_ps(p, two_n), finite)
}

/// As the portable `exp_shifted`: lane `l` sums the chunks' lane `l`, then the lanes
/// in the same fixed order, then the rest in order.
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn exp_shifted(s: &mut [f32], max: f32) -> f32 {
    let m = _mm256_set1_ps(max);
    let mut acc = _mm256_setzero_ps();
    let mut chunks = s.chunks_exact_mut(8);
    for c in &mut chunks {
        let e = exp8(_mm256_sub_ps(_mm256_loadu_ps(c.as_ptr()), m));
        _mm256_storeu_ps(c.as_mut_ptr(), e);
        acc = _mm256_add_ps(acc, e);
    }
    let h = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    let h = _mm_hadd_ps(h, h);
    let mut sum = _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
    for x in chunks.into_remainder() {
        *x = super::exp_nonpositive(*x - max);
        sum += *x;
    }
    sum
}

/// As [`super::dot`] for each of `G` heads over `8 · C` values, each chunk of the row
/// loaded once for all of them. The caller checks AVX2 and FMA are available.
#[target_feature(enable = "avx2,fma")]
#[inline]
pub(super) unsafe fn dots<const C: usize, const G: usize, E: KvElem>(
    q: &[&[f32]; G],
    b: &[E],
) -> [f32; G] {
    assert!(b.len() >= 8 * C && q.iter().all(|q| q.len() >= 8 * C));
    // SAFETY: every slice holds 8·C values (checked above); unaligned loads.
    unsafe {
        let mut acc = [_mm256_setzero_ps(); G];
        for c in 0..C {
            let y = E::load8(b.as_ptr().add(8 * c));
            for (acc, q) in acc.iter_mut().zip(q) {
                *acc = _mm256_fmadd_ps(_mm256_loadu_ps(q.as_ptr().add(8 * c)), y, *acc);
            }
        }
        // ((a0 + a4) + (a1 + a5)) + ((a2 + a6) + (a3 + a7)), as the portable code adds.
        acc.map(|acc| {
            let s = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
            let h = _mm_hadd_ps(s, s);
            _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)))
        })
    }
}

/// The four sums of `s`'s halves (`a0 + a4, a1 + a5, a2 + a6, a3 + a7`): the first
/// step of [`dots`]' reduction.
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn halves(a: __m256) -> __m128 {
    _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1))
}

/// [`super::Loops::scores_run`] with `R` rows (2 or 4) at a time: every row's `C`
/// fused multiply-adds per head into a register of its own, in the order of [`dots`]
/// (so the sums are latency-free of each other), then the rows' lanes reduced together
/// by horizontal adds that add them in [`dots`]' order, `((a0 + a4) + (a1 + a5)) +
/// ((a2 + a6) + (a3 + a7))` per row, and scaled four at a time. The rows past the last
/// whole group go through [`dots`]. The caller checks AVX2 and FMA are available.
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn scores_run<const C: usize, const R: usize, const G: usize, E: KvElem>(
    q: &[&[f32]; G],
    run: &KvRun<'_, E>,
    scale: f32,
    scores: &mut [f32],
    ctx: usize,
) {
    let hd = 8 * C;
    let n = run.rows;
    assert!(R == 2 || R == 4);
    assert!(q.iter().all(|q| q.len() >= hd));
    if let Some(last) = n.checked_sub(1) {
        assert!(run.data.len() >= last * run.stride + hd);
        assert!(run.scales.len() > last * run.scale_stride);
        assert!(scores.len() >= (G - 1) * ctx + n);
    }
    let whole = n - n % R;
    // SAFETY: every row read lies inside `run.data`, every scale inside `run.scales`
    // and every score written inside `scores` (checked above).
    unsafe {
        let mut r = 0;
        while r < whole {
            let mut acc = [[_mm256_setzero_ps(); R]; G];
            for c in 0..C {
                for k in 0..R {
                    let y = E::load8(run.data.as_ptr().add((r + k) * run.stride + 8 * c));
                    for (acc, q) in acc.iter_mut().zip(q) {
                        acc[k] = _mm256_fmadd_ps(_mm256_loadu_ps(q.as_ptr().add(8 * c)), y, acc[k]);
                    }
                }
            }
            let sc = |k: usize| {
                *run.scales
                    .get_unchecked((r + k.min(R - 1)) * run.scale_stride)
            };
            let ks = _mm_setr_ps(sc(0), sc(1), sc(2), sc(3));
            let scale = _mm_set1_ps(scale);
            for (t, acc) in acc.iter().enumerate() {
                // hadd(hadd(s0, s1), hadd(s2, s3)) holds ((s_k0 + s_k1) + (s_k2 + s_k3))
                // for row k in lane k; with two rows hadd(hadd(s0, s1), ·) does.
                let h = _mm_hadd_ps(halves(acc[0]), halves(acc[1 % R]));
                let d = if R == 4 {
                    _mm_hadd_ps(h, _mm_hadd_ps(halves(acc[2 % R]), halves(acc[3 % R])))
                } else {
                    _mm_hadd_ps(h, h)
                };
                let v = _mm_mul_ps(_mm_mul_ps(d, ks), scale);
                let dst = scores.as_mut_ptr().add(t * ctx + r);
                if R == 4 {
                    _mm_storeu_ps(dst, v);
                } else {
                    let mut two = [0f32; 4];
                    _mm_storeu_ps(two.as_mut_ptr(), v);
                    std::ptr::copy_nonoverlapping(two.as_ptr(), dst, 2);
                }
            }
            r += R;
        }
        for r in whole..n {
            let d = dots::<C, G, E>(q, run.row(r, hd));
            let ks = run.scale(r);
            for (t, d) in d.into_iter().enumerate() {
                *scores.get_unchecked_mut(t * ctx + r) = d * ks * scale;
            }
        }
    }
}

/// As [`super::weighted_run`] for each of `G` heads' outputs of `8 · C` values (one
/// after another in `o`), `B` registers of each head's sums kept across the run's rows
/// at a time, each chunk of a row loaded once for the heads. The caller checks AVX2 and
/// FMA are available.
#[target_feature(enable = "avx2,fma")]
#[inline]
pub(super) unsafe fn weighted_run<const C: usize, const B: usize, const G: usize, E: KvElem>(
    p: &[&[f32]; G],
    run: &KvRun<'_, E>,
    o: &mut [f32],
) {
    let hd = 8 * C;
    let n = p[0].len();
    assert!(C.is_multiple_of(B) && o.len() == G * hd && p.iter().all(|p| p.len() == n));
    assert!(n <= run.rows);
    if let Some(last) = n.checked_sub(1) {
        assert!(run.data.len() >= last * run.stride + hd);
    }
    // SAFETY: every row read lies inside `run.data`, every weight inside its head's `p`
    // and `o` holds `G · hd` values (checked).
    unsafe {
        for block in (0..C).step_by(B) {
            let mut acc = [[_mm256_setzero_ps(); B]; G];
            for (t, acc) in acc.iter_mut().enumerate() {
                for (b, acc) in acc.iter_mut().enumerate() {
                    *acc = _mm256_loadu_ps(o.as_ptr().add(t * hd + 8 * (block + b)));
                }
            }
            for r in 0..n {
                let w: [__m256; G] =
                    std::array::from_fn(|t| _mm256_set1_ps(*p[t].get_unchecked(r)));
                let row = run.data.as_ptr().add(r * run.stride + 8 * block);
                for b in 0..B {
                    let v = E::load8(row.add(8 * b));
                    for (acc, w) in acc.iter_mut().zip(&w) {
                        acc[b] = _mm256_fmadd_ps(*w, v, acc[b]);
                    }
                }
            }
            for (t, acc) in acc.iter().enumerate() {
                for (b, acc) in acc.iter().enumerate() {
                    _mm256_storeu_ps(o.as_mut_ptr().add(t * hd + 8 * (block + b)), *acc);
                }
            }
        }
    }
}
