//! AVX2 + FMA + F16C kernels (x86-64). Each public function is `#[target_feature]` and
//! `unsafe`: the caller checks [`crate::Isa::Avx2`] is available.
//!
//! The Q8_0 product widens each weight block to 16 bits once (`vpmovsxbw`) and multiplies
//! it by every activation row of the register tile with `vpmaddwd` (pairs of 16-bit
//! products summed into 32 bits: exact for 8- and 16-bit activations alike), converts the
//! block's integer sums to f32 and adds them with the two scales' product (`vfmadd`). A
//! register tile is 4 weight rows × 2 activation rows: 8 accumulators, 4 activation
//! vectors, 2 weight vectors.

#![allow(clippy::needless_range_loop)] // lane- and row-indexed loops mirror the register tiles

use crate::layout::{Activations, PackedQ8, BLOCK, ROW_BLOCK, TILE_ROWS};
use std::arch::x86_64::*;
use std::ops::Range;

/// As [`crate::scalar::q8_tiles`].
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn q8_tiles(w: &PackedQ8, a: &Activations, tiles: Range<usize>, out: *mut f32) {
    let mut m0 = 0;
    while m0 < a.rows {
        let m1 = (m0 + ROW_BLOCK).min(a.rows);
        for t in tiles.clone() {
            let mut m = m0;
            while m + 2 <= m1 {
                q8_tile2(w, a, t, m, out);
                m += 2;
            }
            if m < m1 {
                q8_tile1(w, a, t, m, out);
            }
        }
        m0 = m1;
    }
}

/// The sum of a vector's 8 lanes.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(crate) unsafe fn hsum(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    _mm_cvtss_f32(s)
}

/// One weight block (32 values at `w`) widened to 16 bits: two vectors of 16.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn widen(w: *const i8) -> (__m256i, __m256i) {
    (
        _mm256_cvtepi8_epi16(_mm_loadu_si128(w as *const __m128i)),
        _mm256_cvtepi8_epi16(_mm_loadu_si128(w.add(16) as *const __m128i)),
    )
}

/// The 8 lane sums of one row pair's block product (`vpmaddwd` of both halves).
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn dot(w: (__m256i, __m256i), a: (__m256i, __m256i)) -> __m256i {
    _mm256_add_epi32(_mm256_madd_epi16(w.0, a.0), _mm256_madd_epi16(w.1, a.1))
}

/// The 4 weight rows' lane sums `p[r]` reduced to one vector per half:
/// `[Σ p0, Σ p1, Σ p2, Σ p3]` in each 128-bit half (low half: lanes 0–3, high: 4–7).
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn reduce4(p: [__m256i; 4]) -> __m256i {
    _mm256_hadd_epi32(_mm256_hadd_epi32(p[0], p[1]), _mm256_hadd_epi32(p[2], p[3]))
}

/// Activation row `m`'s block `b` (32 values as two vectors of 16).
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn act(a: &Activations, m: usize, b: usize) -> (__m256i, __m256i) {
    let p = a.q.as_ptr().add(m * a.cols + b * BLOCK);
    (
        _mm256_loadu_si256(p as *const __m256i),
        _mm256_loadu_si256(p.add(16) as *const __m256i),
    )
}

/// Tile `t` (4 output columns) for activation rows `m`, `m + 1`. Per block: 8 integer
/// dot products reduced to one vector `[r0..r3 of row m | r0..r3 of row m+1]`, converted
/// once and added with the scales' products `[dw_r · da_m | dw_r · da_m+1]`: one
/// accumulator for the whole register tile.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn q8_tile2(w: &PackedQ8, a: &Activations, t: usize, m: usize, out: *mut f32) {
    let n = w.rows;
    let mut acc = _mm256_setzero_ps();
    let wq = w.qs.as_ptr().add(t * w.blocks * TILE_ROWS * BLOCK);
    let wd = w.d.as_ptr().add(t * w.blocks * TILE_ROWS) as *const u8;
    let (d0, d1) = (
        a.d.as_ptr().add(m * a.blocks),
        a.d.as_ptr().add((m + 1) * a.blocks),
    );
    for b in 0..w.blocks {
        let dw = _mm_cvtph_ps(_mm_loadl_epi64(wd.add(b * TILE_ROWS * 2) as *const __m128i));
        let da = _mm256_set_m128(_mm_set1_ps(*d1.add(b)), _mm_set1_ps(*d0.add(b)));
        let s = _mm256_mul_ps(_mm256_set_m128(dw, dw), da);
        let (a0, a1) = (act(a, m, b), act(a, m + 1, b));
        let wb = wq.add(b * TILE_ROWS * BLOCK);
        let mut p0 = [_mm256_setzero_si256(); 4];
        let mut p1 = [_mm256_setzero_si256(); 4];
        for r in 0..TILE_ROWS {
            let wr = widen(wb.add(r * BLOCK));
            p0[r] = dot(wr, a0);
            p1[r] = dot(wr, a1);
        }
        let (x0, x1) = (reduce4(p0), reduce4(p1));
        let sum = _mm256_add_epi32(
            _mm256_permute2x128_si256(x0, x1, 0x20),
            _mm256_permute2x128_si256(x0, x1, 0x31),
        );
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), s, acc);
    }
    let mut v = [0f32; 8];
    _mm256_storeu_ps(v.as_mut_ptr(), acc);
    for r in 0..TILE_ROWS {
        let col = t * TILE_ROWS + r;
        if col < n {
            *out.add(m * n + col) = v[r];
            *out.add((m + 1) * n + col) = v[4 + r];
        }
    }
}

/// Tile `t` for activation row `m` alone (decode, and the odd row of a step).
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn q8_tile1(w: &PackedQ8, a: &Activations, t: usize, m: usize, out: *mut f32) {
    let n = w.rows;
    let mut acc = _mm_setzero_ps();
    let wq = w.qs.as_ptr().add(t * w.blocks * TILE_ROWS * BLOCK);
    let wd = w.d.as_ptr().add(t * w.blocks * TILE_ROWS) as *const u8;
    let d0 = a.d.as_ptr().add(m * a.blocks);
    for b in 0..w.blocks {
        let dw = _mm_cvtph_ps(_mm_loadl_epi64(wd.add(b * TILE_ROWS * 2) as *const __m128i));
        let s = _mm_mul_ps(dw, _mm_set1_ps(*d0.add(b)));
        let a0 = act(a, m, b);
        let wb = wq.add(b * TILE_ROWS * BLOCK);
        let mut p = [_mm256_setzero_si256(); 4];
        for (r, p) in p.iter_mut().enumerate() {
            *p = dot(widen(wb.add(r * BLOCK)), a0);
        }
        let x = reduce4(p);
        let sum = _mm_add_epi32(_mm256_castsi256_si128(x), _mm256_extracti128_si256(x, 1));
        acc = _mm_fmadd_ps(_mm_cvtepi32_ps(sum), s, acc);
    }
    let mut v = [0f32; 4];
    _mm_storeu_ps(v.as_mut_ptr(), acc);
    for (r, &v) in v.iter().enumerate() {
        let col = t * TILE_ROWS + r;
        if col < n {
            *out.add(m * n + col) = v;
        }
    }
}

/// One activation block quantized as [`crate::Activations::quantize`] does it: scale
/// `amax / max`, values rounded to nearest (ties to even, the default rounding mode).
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn quantize_act_block(x: &[f32], q: &mut [i16], max: f32) -> f32 {
    let p = x.as_ptr();
    let v = [
        _mm256_loadu_ps(p),
        _mm256_loadu_ps(p.add(8)),
        _mm256_loadu_ps(p.add(16)),
        _mm256_loadu_ps(p.add(24)),
    ];
    let abs = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fff_ffff));
    let m = _mm256_max_ps(
        _mm256_max_ps(_mm256_and_ps(v[0], abs), _mm256_and_ps(v[1], abs)),
        _mm256_max_ps(_mm256_and_ps(v[2], abs), _mm256_and_ps(v[3], abs)),
    );
    let m = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    let m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
    let amax = _mm_cvtss_f32(m);
    let d = amax / max;
    let id = _mm256_set1_ps(if d != 0.0 { 1.0 / d } else { 0.0 });
    let i = |v: __m256| _mm256_cvtps_epi32(_mm256_mul_ps(v, id));
    // packs interleaves the 128-bit halves; the permute puts the 16 values back in order.
    let lo = _mm256_permute4x64_epi64(_mm256_packs_epi32(i(v[0]), i(v[1])), 0xD8);
    let hi = _mm256_permute4x64_epi64(_mm256_packs_epi32(i(v[2]), i(v[3])), 0xD8);
    let o = q.as_mut_ptr();
    _mm256_storeu_si256(o as *mut __m256i, lo);
    _mm256_storeu_si256(o.add(16) as *mut __m256i, hi);
    d
}

/// As the scalar f16 product: output columns `rows` for every input row.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn f16_rows(
    p: &crate::layout::F16Product<'_>,
    rows: std::ops::Range<usize>,
    out: *mut f32,
) {
    let mut m0 = 0;
    while m0 < p.m {
        let m1 = (m0 + ROW_BLOCK).min(p.m);
        let mut r = rows.start;
        while r < rows.end {
            let nr = (rows.end - r).min(TILE_ROWS);
            let mut m = m0;
            while m + 2 <= m1 {
                f16_tile::<2>(p, r, nr, m, out);
                m += 2;
            }
            if m < m1 {
                f16_tile::<1>(p, r, nr, m, out);
            }
            r += nr;
        }
        m0 = m1;
    }
}

/// Output columns `r .. r + nr` (`nr ≤ 4`) for input rows `m .. m + M`.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn f16_tile<const M: usize>(
    p: &crate::layout::F16Product<'_>,
    r: usize,
    nr: usize,
    m: usize,
    out: *mut f32,
) {
    let k = p.cols;
    let mut acc = [[_mm256_setzero_ps(); M]; TILE_ROWS];
    let w = p.w.as_ptr() as *const u16;
    let x = p.x.as_ptr();
    let full = k / 8 * 8;
    let mut c = 0;
    while c < full {
        let mut xv = [_mm256_setzero_ps(); M];
        for (j, xv) in xv.iter_mut().enumerate() {
            *xv = _mm256_loadu_ps(x.add((m + j) * k + c));
        }
        for (i, acc) in acc.iter_mut().enumerate().take(nr) {
            let wv = _mm256_cvtph_ps(_mm_loadu_si128(w.add((r + i) * k + c) as *const __m128i));
            for j in 0..M {
                acc[j] = _mm256_fmadd_ps(wv, xv[j], acc[j]);
            }
        }
        c += 8;
    }
    for (i, acc) in acc.iter().enumerate().take(nr) {
        for (j, &v) in acc.iter().enumerate() {
            let mut s = hsum(v);
            for c in full..k {
                s += p.w[(r + i) * k + c].to_f32() * p.x[(m + j) * k + c];
            }
            *out.add((m + j) * p.rows + r + i) = s;
        }
    }
}
