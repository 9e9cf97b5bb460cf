//! AVX2 + FMA + F16C kernels (x86-64). Each public function is `#[target_feature]` and
//! `unsafe`: the caller checks [`crate::Isa::Avx2`] is available.
//!
//! The Q8_0 product widens each weight block to 16 bits once (`vpmovsxbw`) and multiplies
//! it by every activation row of the register tile with `vpmaddwd` (pairs of 16-bit
//! products summed into 32 bits: exact for 8- and 16-bit activations alike), converts the
//! block's integer sums to f32 and adds them with the two scales' product (`vfmadd`). A
//! register tile is 4 weight rows × 2 activation rows: 8 accumulators, 4 activation
//! vectors, 2 weight vectors.

use crate::q8::{Activations, PackedQ8, BLOCK, ROW_BLOCK, TILE_ROWS};
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
                q8_tile::<2>(w, a, t, m, out);
                m += 2;
            }
            if m < m1 {
                q8_tile::<1>(w, a, t, m, out);
            }
        }
        m0 = m1;
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn hsum(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    _mm_cvtss_f32(s)
}

/// Tile `t` (4 output columns) for activation rows `m .. m + M`.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn q8_tile<const M: usize>(
    w: &PackedQ8,
    a: &Activations,
    t: usize,
    m: usize,
    out: *mut f32,
) {
    let n = w.rows;
    let mut acc = [[_mm256_setzero_ps(); M]; TILE_ROWS];
    let wq = w.qs.as_ptr().add(t * w.blocks * TILE_ROWS * BLOCK);
    let wd = w.d.as_ptr().add(t * w.blocks * TILE_ROWS) as *const u8;
    let aq = a.q.as_ptr();
    let ad = a.d.as_ptr();
    let mut scales = [0f32; TILE_ROWS];
    for b in 0..w.blocks {
        // The tile's 4 f16 scales of this block, to f32.
        let sc = _mm_cvtph_ps(_mm_loadl_epi64(wd.add(b * TILE_ROWS * 2) as *const __m128i));
        _mm_storeu_ps(scales.as_mut_ptr(), sc);
        let mut av = [[_mm256_setzero_si256(); 2]; M];
        let mut da = [0f32; M];
        for j in 0..M {
            let p = aq.add((m + j) * a.cols + b * BLOCK);
            av[j][0] = _mm256_loadu_si256(p as *const __m256i);
            av[j][1] = _mm256_loadu_si256(p.add(16) as *const __m256i);
            da[j] = *ad.add((m + j) * a.blocks + b);
        }
        let wb = wq.add(b * TILE_ROWS * BLOCK);
        for r in 0..TILE_ROWS {
            let w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128(wb.add(r * BLOCK) as *const __m128i));
            let w1 =
                _mm256_cvtepi8_epi16(_mm_loadu_si128(wb.add(r * BLOCK + 16) as *const __m128i));
            for j in 0..M {
                let p = _mm256_add_epi32(
                    _mm256_madd_epi16(w0, av[j][0]),
                    _mm256_madd_epi16(w1, av[j][1]),
                );
                let s = _mm256_set1_ps(scales[r] * da[j]);
                acc[r][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), s, acc[r][j]);
            }
        }
    }
    for (r, acc) in acc.iter().enumerate() {
        let col = t * TILE_ROWS + r;
        if col < n {
            for (j, &v) in acc.iter().enumerate() {
                *out.add((m + j) * n + col) = hsum(v);
            }
        }
    }
}
