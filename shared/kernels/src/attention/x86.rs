//! The common head widths (64, 128) with their loops in AVX2 registers: the same
//! operations in the same order as the portable loops, so the same bits, with each key and
//! value row loaded once for the item's heads, the output kept in registers across a run
//! of rows and the exponentials 8 at a time.

use super::{Call, Item, KvElem, KvRun, KvSource, Portable};
use std::arch::x86_64::*;

impl<S: KvSource> Call<'_, S> {
    /// One item with the AVX2 loops for the common head widths (64, 128), the portable loops
    /// compiled for AVX2 and FMA for any other.
    ///
    /// # Safety
    /// AVX2 and FMA are available.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn item_avx2(&self, item: Item, scores: &mut [f32], out: *mut f32) {
        self.item_simd::<false>(item, scores, out)
    }

    /// As [`Call::item_avx2`], the weighted sums of the values in AVX-512 registers
    /// ([`Simd`] with `WIDE`).
    ///
    /// # Safety
    /// AVX-512F, AVX2 and FMA are available.
    #[target_feature(enable = "avx512f,avx2,fma")]
    pub(super) unsafe fn item_avx512(&self, item: Item, scores: &mut [f32], out: *mut f32) {
        self.item_simd::<true>(item, scores, out)
    }

    /// The head-width dispatch both share, inlined into each so its loops are compiled for
    /// that one's instruction sets.
    #[inline(always)]
    fn item_simd<const WIDE: bool>(&self, item: Item, scores: &mut [f32], out: *mut f32) {
        match self.shape.head_dim {
            64 => self.item::<Simd<8, WIDE>>(item, scores, out),
            128 => self.item::<Simd<16, WIDE>>(item, scores, out),
            _ => self.item::<Portable>(item, scores, out),
        }
    }
}

/// The loops for head width `8 · C`: scores, max and exponentials in AVX2 registers;
/// the values' weighted sums in AVX2 registers, or with `WIDE` in AVX-512 ones (16
/// lanes: a head's 64 outputs in 4 registers, so a group of up to 4 heads keeps all its
/// sums across a run's rows in one pass). Each value gets the same fused multiply-adds
/// in the same order either way, so the same bits. Only [`Call::item_avx2`] (not
/// `WIDE`, after the caller checked AVX2 and FMA) and [`Call::item_avx512`] (`WIDE`,
/// after it checked AVX-512F as well) use it.
pub(super) struct Simd<const C: usize, const WIDE: bool>;

impl<const C: usize, const WIDE: bool> super::Loops for Simd<C, WIDE> {
    #[inline(always)]
    fn scores_run<const G: usize, E: KvElem>(
        q: &[&[f32]; G],
        run: &KvRun<'_, E>,
        scale: f32,
        scores: &mut [f32],
        at: (usize, usize),
    ) {
        // SAFETY: built only behind the instruction-set check (see the type).
        unsafe { scores_run::<C, G, E>(q, run, scale, scores, at) }
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
        // SAFETY: as above. AVX2: blocks of output registers that fit the 16 registers
        // beside one value register and the heads' weights. AVX-512: four registers of
        // each head's sums at a time, at most 16 of the 32.
        unsafe {
            match (WIDE, G) {
                (true, _) => weighted_run_512::<C, G, E>(p, run, o),
                (false, 1) => weighted_run::<C, 8, G, E>(p, run, o),
                (false, 2) => weighted_run::<C, 4, G, E>(p, run, o),
                (false, _) => weighted_run::<C, 2, G, E>(p, run, o),
            }
        }
    }
}

/// Rows taken together by [`scores_run`]: their lanes are added in one `hadd` tree.
const ROWS: usize = 4;

/// As the portable [`super::Loops::scores_run`]: [`ROWS`] rows at a time, each row's 8
/// lanes per head in registers (each chunk of a row loaded and converted once for the
/// heads), then the four rows' lanes added together by `hadd` (the portable order for
/// each row) and their scores scaled and stored as one vector; the rows left over one at
/// a time by [`dots`]. The caller checks AVX2 and FMA are available.
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn scores_run<const C: usize, const G: usize, E: KvElem>(
    q: &[&[f32]; G],
    run: &KvRun<'_, E>,
    scale: f32,
    scores: &mut [f32],
    (ctx, j): (usize, usize),
) {
    let hd = 8 * C;
    assert!(q.iter().all(|q| q.len() >= hd));
    assert!(G == 0 || scores.len() >= (G - 1) * ctx + j + run.rows);
    if let Some(last) = run.rows.checked_sub(1) {
        assert!(run.data.len() >= last * run.stride + hd);
        assert!(run.scales.len() > last * run.scale_stride);
    }
    let whole = run.rows - run.rows % ROWS;
    // SAFETY: every row read lies inside `run.data`, every scale inside `run.scales`,
    // every score written inside `scores` (checked above); unaligned loads and stores.
    unsafe {
        let scale4 = _mm_set1_ps(scale);
        for r in (0..whole).step_by(ROWS) {
            let mut acc = [[_mm256_setzero_ps(); ROWS]; G];
            for c in 0..C {
                for p in 0..ROWS {
                    let y = E::load8(run.data.as_ptr().add((r + p) * run.stride + 8 * c));
                    for (acc, q) in acc.iter_mut().zip(q) {
                        acc[p] = _mm256_fmadd_ps(_mm256_loadu_ps(q.as_ptr().add(8 * c)), y, acc[p]);
                    }
                }
            }
            let ks = _mm_setr_ps(
                *run.scales.get_unchecked(r * run.scale_stride),
                *run.scales.get_unchecked((r + 1) * run.scale_stride),
                *run.scales.get_unchecked((r + 2) * run.scale_stride),
                *run.scales.get_unchecked((r + 3) * run.scale_stride),
            );
            for (t, a) in acc.iter().enumerate() {
                // Lane p of the low half: row p's lanes 0..4 added as ((0+1)+(2+3)); of
                // the high half its lanes 4..8; then the halves.
                let h = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
                let d = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
                let s = _mm_mul_ps(_mm_mul_ps(d, ks), scale4);
                _mm_storeu_ps(scores.as_mut_ptr().add(t * ctx + j + r), s);
            }
        }
        for r in whole..run.rows {
            let d = dots::<C, G, E>(q, run.row(r, hd));
            let ks = run.scale(r);
            for (t, d) in d.into_iter().enumerate() {
                *scores.get_unchecked_mut(t * ctx + j + r) = d * ks * scale;
            }
        }
    }
}

/// As [`weighted_run`] in 16-lane registers: `C / 2` registers per head's output,
/// four at a time.
#[target_feature(enable = "avx512f,avx2,fma")]
#[inline]
unsafe fn weighted_run_512<const C: usize, const G: usize, E: KvElem>(
    p: &[&[f32]; G],
    run: &KvRun<'_, E>,
    o: &mut [f32],
) {
    const B: usize = 4;
    let hd = 8 * C;
    let n = p[0].len();
    assert!(C.is_multiple_of(2 * B) && o.len() == G * hd && p.iter().all(|p| p.len() == n));
    assert!(n <= run.rows);
    if let Some(last) = n.checked_sub(1) {
        assert!(run.data.len() >= last * run.stride + hd);
    }
    // SAFETY: every row read lies inside `run.data`, every weight inside its head's `p`
    // and `o` holds `G · hd` values (checked).
    unsafe {
        for block in (0..C / 2).step_by(B) {
            let mut acc = [[_mm512_setzero_ps(); B]; G];
            for (t, acc) in acc.iter_mut().enumerate() {
                for (b, acc) in acc.iter_mut().enumerate() {
                    *acc = _mm512_loadu_ps(o.as_ptr().add(t * hd + 16 * (block + b)));
                }
            }
            for r in 0..n {
                let w: [__m512; G] =
                    std::array::from_fn(|t| _mm512_set1_ps(*p[t].get_unchecked(r)));
                let row = run.data.as_ptr().add(r * run.stride + 16 * block);
                for b in 0..B {
                    let v = E::load16(row.add(16 * b));
                    for (acc, w) in acc.iter_mut().zip(&w) {
                        acc[b] = _mm512_fmadd_ps(*w, v, acc[b]);
                    }
                }
            }
            for (t, acc) in acc.iter().enumerate() {
                for (b, acc) in acc.iter().enumerate() {
                    _mm512_storeu_ps(o.as_mut_ptr().add(t * hd + 16 * (block + b)), *acc);
                }
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
unsafe fn dots<const C: usize, const G: usize, E: KvElem>(q: &[&[f32]; G], b: &[E]) -> [f32; G] {
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
        // ((a0 + a1) + (a2 + a3)) + ((a4 + a5) + (a6 + a7)), as the portable code adds.
        acc.map(|acc| {
            let h = _mm256_hadd_ps(acc, acc);
            let h = _mm256_hadd_ps(h, h);
            _mm_cvtss_f32(_mm_add_ss(
                _mm256_castps256_ps128(h),
                _mm256_extractf128_ps(h, 1),
            ))
        })
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
