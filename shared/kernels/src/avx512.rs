//! The Q8_0 and 4-bit products with AVX-512 VNNI (x86-64). Each function is `#[target_feature]` and
//! `unsafe`: the caller checks [`crate::Isa::Avx512`] is available.
//!
//! Two kernels, one per weight order:
//!
//! [`q8_pair_tiles`] ([`crate::Q8Layout::WidePairColumns`], what [`crate::Isa::Avx512`]
//! packs): per column pair, one 32-byte load widened to 16 bits holds the pair for 16
//! weight rows; `vpdpwssd` against an activation row's pair broadcast to every lane (a
//! load, no shuffle) adds row `i`'s two products into lane `i`. 8- and 16-bit activations
//! cost the same (their 16-bit values; a block's sums stay below 2³¹), there is no
//! horizontal sum, and per block one conversion and one multiply-add per 16 rows and
//! activation row. A register tile is 16 weight rows × up to 8 activation rows.
//!
//! [`q8_tiles`] ([`crate::Q8Layout::RowTiles`], for weights packed in the scalar
//! reference's order; the activations hold their byte form): `vpdpbusd` multiplies 64 unsigned bytes by 64 signed bytes and adds each group of four
//! products into a 32-bit lane. One 512-bit register holds one block of two weight rows
//! (the packed tile keeps a block's rows adjacent), and an activation block (32 bytes) is
//! broadcast to both halves, so one instruction makes 64 products: lanes 0–7 are the first
//! row's partial sums, lanes 8–15 the second's.
//!
//! The activations go in as the unsigned operand, biased by 128; the bias comes back off
//! lane by lane, because each block's accumulators start at `-128 · Σ w` over the lane's
//! four weights (one more `vpdpbusd` per weight block, shared by all activation rows). So
//! every lane holds exactly its four products:
//!
//! - 8-bit activations (W8A8): one instruction per 64 products.
//! - 16-bit activations (W8A16): `a = 256 · hi + lo`, `hi` the signed high byte and `lo`
//!   the unsigned low one: `Σ w · hi`, shifted left by 8, is the start of `Σ lo · w`. Two
//!   instructions per 64 products; each lane's `Σ w · a` stays below 2²⁴ in magnitude.
//!
//! Each block's integer lanes become f32 once (exact: every lane is below 2²⁴) and are
//! added with the two scales' product (`vfmadd`); the lanes of a row are summed once per
//! tile, at the end. A register tile is one weight tile (4 rows: two registers) × `J`
//! activation rows.

#![allow(clippy::needless_range_loop)] // lane- and row-indexed loops mirror the register tiles

use crate::layout::{
    ActBits, Activations, PackedQ8, BLOCK, ROW_BLOCK, TILE_ROWS, WIDE_PAIR_TILE_ROWS,
};
use crate::q4::{
    PackedQ4, OFFSET_UNIT, Q4_TILE_BLOCK_BYTES, Q4_TILE_ROWS, STEP_UNIT, SUPER_BLOCKS,
};
use std::arch::x86_64::*;
use std::ops::Range;

/// As [`crate::scalar::q8_tiles`]. Only the activation rows `act_rows` are computed.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
pub(crate) unsafe fn q8_tiles(
    w: &PackedQ8,
    a: &Activations,
    tiles: Range<usize>,
    act_rows: Range<usize>,
    out: *mut f32,
) {
    let sixteen = a.bytes == Some(ActBits::Sixteen);
    let mut m0 = act_rows.start;
    while m0 < act_rows.end {
        let m1 = (m0 + ROW_BLOCK).min(act_rows.end);
        for t in tiles.clone() {
            match sixteen {
                true => rows::<true>(w, a, t, m0..m1, out),
                false => rows::<false>(w, a, t, m0..m1, out),
            }
        }
        m0 = m1;
    }
}

/// Tile `t` for activation rows `rows`, in register tiles of 4 rows and one of the rest.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
#[inline]
unsafe fn rows<const SIXTEEN: bool>(
    w: &PackedQ8,
    a: &Activations,
    t: usize,
    rows: Range<usize>,
    out: *mut f32,
) {
    let mut m = rows.start;
    while m + 4 <= rows.end {
        tile::<4, SIXTEEN>(w, a, t, m, out);
        m += 4;
    }
    match rows.end - m {
        3 => tile::<3, SIXTEEN>(w, a, t, m, out),
        2 => tile::<2, SIXTEEN>(w, a, t, m, out),
        1 => tile::<1, SIXTEEN>(w, a, t, m, out),
        _ => {}
    }
}

/// A row pair's accumulator (`[row0 lanes | row1 lanes]`) as the two rows' sums.
#[target_feature(enable = "avx512f,avx2,fma")]
#[inline]
unsafe fn pair_sums(v: __m512) -> (f32, f32) {
    let lo = _mm512_castps512_ps256(v);
    let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
    (crate::x86::hsum(lo), crate::x86::hsum(hi))
}

/// Tile `t`'s block `b`: the weight scales spread over the row pairs' lanes
/// (`[d0 ×8 | d1 ×8]`, `[d2 ×8 | d3 ×8]`).
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
#[inline]
unsafe fn weight_scales(wd: *const u8, b: usize) -> (__m512, __m512) {
    let d = _mm512_castps128_ps512(_mm_cvtph_ps(_mm_loadl_epi64(
        wd.add(b * TILE_ROWS * 2) as *const __m128i
    )));
    let i01 = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    let i23 = _mm512_setr_epi32(2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
    (_mm512_permutexvar_ps(i01, d), _mm512_permutexvar_ps(i23, d))
}

/// 32 bytes at `p`, in both halves of a register.
#[target_feature(enable = "avx512f,avx2")]
#[inline]
unsafe fn broadcast_block(p: *const u8) -> __m512i {
    _mm512_broadcast_i64x4(_mm256_loadu_si256(p as *const __m256i))
}

/// Write the 4 outputs of tile `t` for activation row `m` (padding rows are dropped).
#[inline]
unsafe fn store(w: &PackedQ8, t: usize, m: usize, v: [f32; 4], out: *mut f32) {
    let n = w.rows;
    for (r, &v) in v.iter().enumerate() {
        let col = t * TILE_ROWS + r;
        if col < n {
            *out.add(m * n + col) = v;
        }
    }
}

/// `-128 · Σ w` over each lane's four weights of a row pair's block: where the
/// accumulators start, so the activations' bias of 128 cancels lane by lane.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
#[inline]
unsafe fn unbias(w: __m512i) -> __m512i {
    let zero = _mm512_setzero_si512();
    _mm512_sub_epi32(zero, _mm512_dpbusd_epi32(zero, _mm512_set1_epi8(-128), w))
}

/// Tile `t` for activation rows `m .. m + J`: 8-bit activations, or 16-bit ones
/// (`SIXTEEN`: the high bytes' sums shifted left by 8 start the low bytes').
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
#[inline]
unsafe fn tile<const J: usize, const SIXTEEN: bool>(
    w: &PackedQ8,
    a: &Activations,
    t: usize,
    m: usize,
    out: *mut f32,
) {
    let wq = w.qs.as_ptr().add(t * w.blocks * TILE_ROWS * BLOCK);
    let wd = w.d.as_ptr().add(t * w.blocks * TILE_ROWS) as *const u8;
    let mut acc = [[_mm512_setzero_ps(); 2]; J];
    for b in 0..w.blocks {
        let (s01, s23) = weight_scales(wd, b);
        let wb = wq.add(b * TILE_ROWS * BLOCK);
        crate::x86::prefetch_ahead(wb as *const u8, TILE_ROWS * BLOCK);
        let w01 = _mm512_loadu_si512(wb as *const _);
        let w23 = _mm512_loadu_si512(wb.add(64) as *const _);
        let (z01, z23) = (unbias(w01), unbias(w23));
        for (j, acc) in acc.iter_mut().enumerate() {
            let (row, blk) = ((m + j) * a.cols + b * BLOCK, (m + j) * a.blocks + b);
            let ah = broadcast_block(a.hi.as_ptr().add(row));
            let da = _mm512_set1_ps(*a.d.get_unchecked(blk));
            let mut d01 = _mm512_dpbusd_epi32(z01, ah, w01);
            let mut d23 = _mm512_dpbusd_epi32(z23, ah, w23);
            if SIXTEEN {
                let al = broadcast_block(a.lo.as_ptr().add(row));
                d01 = _mm512_dpbusd_epi32(_mm512_slli_epi32::<8>(d01), al, w01);
                d23 = _mm512_dpbusd_epi32(_mm512_slli_epi32::<8>(d23), al, w23);
            }
            acc[0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d01), _mm512_mul_ps(s01, da), acc[0]);
            acc[1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d23), _mm512_mul_ps(s23, da), acc[1]);
        }
    }
    for (j, acc) in acc.iter().enumerate() {
        let (r0, r1) = pair_sums(acc[0]);
        let (r2, r3) = pair_sums(acc[1]);
        store(w, t, m + j, [r0, r1, r2, r3], out);
    }
}

/// As [`crate::scalar::q8_tiles`], for weights in [`crate::Q8Layout::WidePairColumns`] and
/// activations of either width (their 16-bit values; no byte form needed): per column
/// pair, the 16 rows' pairs (one 32-byte load widened to 16 bits) times the activation
/// row's pair broadcast to every lane, `vpdpwssd`, leave row `i`'s sum in lane `i`.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
pub(crate) unsafe fn q8_pair_tiles(
    w: &PackedQ8,
    a: &Activations,
    tiles: Range<usize>,
    out: *mut f32,
) {
    let mut m0 = 0;
    while m0 < a.rows {
        let m1 = (m0 + ROW_BLOCK).min(a.rows);
        for t in tiles.clone() {
            let mut m = m0;
            while m + 8 <= m1 {
                pair_tile::<8>(w, a, t, m, out);
                m += 8;
            }
            match m1 - m {
                7 => pair_tile::<7>(w, a, t, m, out),
                6 => pair_tile::<6>(w, a, t, m, out),
                5 => pair_tile::<5>(w, a, t, m, out),
                4 => pair_tile::<4>(w, a, t, m, out),
                3 => pair_tile::<3>(w, a, t, m, out),
                2 => pair_tile::<2>(w, a, t, m, out),
                1 => pair_tile::<1>(w, a, t, m, out),
                _ => {}
            }
        }
        m0 = m1;
    }
}

/// Tile `t` (16 output columns) for activation rows `m .. m + M`.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
#[inline]
unsafe fn pair_tile<const M: usize>(
    w: &PackedQ8,
    a: &Activations,
    t: usize,
    m: usize,
    out: *mut f32,
) {
    const G: usize = WIDE_PAIR_TILE_ROWS;
    let n = w.rows;
    let wq = w.qs.as_ptr().add(t * w.blocks * G * BLOCK);
    // 16 f16 scales per block: one 32-byte load.
    let wd = w.d.as_ptr().add(t * w.blocks * G) as *const __m256i;
    let mut aq = [a.q.as_ptr(); M];
    let mut ad = [a.d.as_ptr(); M];
    for j in 0..M {
        aq[j] = a.q.as_ptr().add((m + j) * a.cols);
        ad[j] = a.d.as_ptr().add((m + j) * a.blocks);
    }
    let mut acc = [_mm512_setzero_ps(); M];
    for b in 0..w.blocks {
        let wb = wq.add(b * G * BLOCK);
        crate::x86::prefetch_ahead(wb as *const u8, G * BLOCK);
        let mut sum = [_mm512_setzero_si512(); M];
        for p in 0..BLOCK / 2 {
            let wv = _mm512_cvtepi8_epi16(_mm256_loadu_si256(wb.add(p * 2 * G) as *const __m256i));
            for j in 0..M {
                let pair = (aq[j].add(b * BLOCK + 2 * p) as *const i32).read_unaligned();
                sum[j] = _mm512_dpwssd_epi32(sum[j], wv, _mm512_set1_epi32(pair));
            }
        }
        scale_block(&mut acc, &sum, wd.add(b), &ad, b);
    }
    store_tile(&acc, out, n, t * G, m);
}

/// A block's integer sums (row `i` in lane `i` of each activation row's register) added in
/// f32 to `acc` with the scales' product: the 16 weight rows' f16 scales at `wd` times each
/// activation row's scale of block `b`.
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
#[inline]
unsafe fn scale_block<const M: usize>(
    acc: &mut [__m512; M],
    sum: &[__m512i; M],
    wd: *const __m256i,
    ad: &[*const f32; M],
    b: usize,
) {
    let dw = _mm512_cvtph_ps(_mm256_loadu_si256(wd));
    for j in 0..M {
        let s = _mm512_mul_ps(dw, _mm512_set1_ps(*ad[j].add(b)));
        acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[j]), s, acc[j]);
    }
}

/// Write a 16-row tile's outputs (columns `c0 ..` of `n`) for activation rows `m .. m + M`,
/// dropping the padding rows of a last partial tile.
#[target_feature(enable = "avx512f")]
#[inline]
pub(crate) unsafe fn store_tile<const M: usize>(
    acc: &[__m512; M],
    out: *mut f32,
    n: usize,
    c0: usize,
    m: usize,
) {
    const G: usize = WIDE_PAIR_TILE_ROWS;
    let keep: __mmask16 = if c0 + G <= n {
        0xffff
    } else {
        (1u16 << (n - c0)) - 1
    };
    for j in 0..M {
        _mm512_mask_storeu_ps(out.add((m + j) * n + c0), keep, acc[j]);
    }
}

/// As [`crate::scalar::q8_tiles`] for the activation rows `rows`, for weights in
/// [`crate::Q8Layout::WideQuadColumns`] and activations as bytes (`hi`, `lo`:
/// [`Activations::byte_form`]): per column quad, the 16 rows' quads (one 64-byte load, a row per 32-bit lane) times the activation row's quad
/// broadcast to every lane, `vpdpbusd`, add four products into row `i`'s lane: 64
/// multiply-adds per instruction for 8-bit activations, twice the pair order's. The
/// activations' bias of 128 comes off once the rows' multiply-adds are done: `-128 · Σ w`,
/// made once per block and register tile in chains of its own. 16-bit activations take the high
/// bytes' pass, shifted left by 8, then the low bytes' (as [`q8_tiles`] does).
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
pub(crate) unsafe fn q8_quad_tiles(
    w: &PackedQ8,
    a: &Activations,
    (hi, lo, sixteen): (&[u8], &[u8], bool),
    tiles: Range<usize>,
    rows: Range<usize>,
    out: *mut f32,
) {
    let (hi, lo) = (hi.as_ptr(), lo.as_ptr());
    let mut m0 = rows.start;
    while m0 < rows.end {
        let m1 = (m0 + ROW_BLOCK).min(rows.end);
        for t in tiles.clone() {
            match sixteen {
                true => quad_rows::<true>(w, a, (hi, lo), t, m0..m1, out),
                false => quad_rows::<false>(w, a, (hi, lo), t, m0..m1, out),
            }
        }
        m0 = m1;
    }
}

/// Tile `t` for activation rows `rows`, in register tiles of 8 rows and one of the rest.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
#[inline]
unsafe fn quad_rows<const SIXTEEN: bool>(
    w: &PackedQ8,
    a: &Activations,
    bytes: (*const u8, *const u8),
    t: usize,
    rows: Range<usize>,
    out: *mut f32,
) {
    let mut m = rows.start;
    while m + 8 <= rows.end {
        quad_tile::<8, SIXTEEN>(w, a, bytes, t, m, out);
        m += 8;
    }
    match rows.end - m {
        7 => quad_tile::<7, SIXTEEN>(w, a, bytes, t, m, out),
        6 => quad_tile::<6, SIXTEEN>(w, a, bytes, t, m, out),
        5 => quad_tile::<5, SIXTEEN>(w, a, bytes, t, m, out),
        4 => quad_tile::<4, SIXTEEN>(w, a, bytes, t, m, out),
        3 => quad_tile::<3, SIXTEEN>(w, a, bytes, t, m, out),
        2 => quad_tile::<2, SIXTEEN>(w, a, bytes, t, m, out),
        1 => quad_tile::<1, SIXTEEN>(w, a, bytes, t, m, out),
        _ => {}
    }
}

/// Tile `t` (16 output columns) for activation rows `m .. m + M`.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
#[inline]
unsafe fn quad_tile<const M: usize, const SIXTEEN: bool>(
    w: &PackedQ8,
    a: &Activations,
    (hi, lo): (*const u8, *const u8),
    t: usize,
    m: usize,
    out: *mut f32,
) {
    const G: usize = WIDE_PAIR_TILE_ROWS;
    const QUADS: usize = BLOCK / 4;
    let n = w.rows;
    let wq = w.qs.as_ptr().add(t * w.blocks * G * BLOCK);
    // 16 f16 scales per block: one 32-byte load.
    let wd = w.d.as_ptr().add(t * w.blocks * G) as *const __m256i;
    let mut ahi = [hi; M];
    let mut alo = [lo; M];
    let mut ad = [a.d.as_ptr(); M];
    for j in 0..M {
        ahi[j] = hi.add((m + j) * a.cols);
        if SIXTEEN {
            alo[j] = lo.add((m + j) * a.cols);
        }
        ad[j] = a.d.as_ptr().add((m + j) * a.blocks);
    }
    let bias = _mm512_set1_epi8(-128);
    let zero = _mm512_setzero_si512();
    let mut acc = [_mm512_setzero_ps(); M];
    for b in 0..w.blocks {
        let wb = wq.add(b * G * BLOCK);
        crate::x86::prefetch_ahead(wb as *const u8, G * BLOCK);
        let mut wv = [zero; QUADS];
        // The bias's sums in two chains of four, apart from the rows' chains: the rows'
        // multiply-adds start from zero and the bias comes off after them. Wrapping integer
        // sums, so the order changes no bit; the rows no longer wait on the bias's eight
        // dependent multiply-adds (16-bit rows 16-20 % faster at 32 rows on a 2-core Xeon
        // without AMX; 8-bit rows unchanged: docs/MEASUREMENTS.md).
        let mut biased = [zero; 2];
        for q in 0..QUADS {
            wv[q] = _mm512_loadu_si512(wb.add(q * 4 * G) as *const _);
            biased[q % 2] = _mm512_dpbusd_epi32(biased[q % 2], bias, wv[q]);
        }
        let mut sum = [zero; M];
        let quad = |p: *const u8, q: usize| {
            _mm512_set1_epi32((p.add(b * BLOCK + 4 * q) as *const i32).read_unaligned())
        };
        for q in 0..QUADS {
            for j in 0..M {
                sum[j] = _mm512_dpbusd_epi32(sum[j], quad(ahi[j], q), wv[q]);
            }
        }
        let biased = _mm512_add_epi32(biased[0], biased[1]);
        for s in sum.iter_mut() {
            *s = _mm512_sub_epi32(*s, biased);
        }
        if SIXTEEN {
            for j in 0..M {
                sum[j] = _mm512_slli_epi32::<8>(sum[j]);
            }
            for q in 0..QUADS {
                for j in 0..M {
                    sum[j] = _mm512_dpbusd_epi32(sum[j], quad(alo[j], q), wv[q]);
                }
            }
        }
        scale_block(&mut acc, &sum, wd.add(b), &ad, b);
    }
    store_tile(&acc, out, n, t * G, m);
}

/// As [`crate::scalar::q4_tiles`] for the activation rows `rows`, for [`PackedQ4`]: two of
/// its 8-row tiles side by side fill a register (16 output columns), a register tile is
/// those 16 rows × up to 8 activation rows. Per quad of columns, the two tiles' 16-byte runs make one 32-byte
/// register; a mask and a shift give the two column pairs for the 16 rows, widened to 16
/// bits (`vpmovzxbw`), and `vpdpwssd` against each activation row's pair broadcast to every
/// lane leaves row `i`'s sum in lane `i`, as the 8-bit kernel does. A lone row of 8-bit
/// activations (batch-1 decode) runs [`q4_byte_tile`] instead, the same bits on
/// `vpdpbusd`. A range with an odd number of tiles computes its last tile twice over in one
/// register and keeps one half.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
pub(crate) unsafe fn q4_tiles(
    w: &PackedQ4,
    a: &Activations,
    tiles: Range<usize>,
    rows: Range<usize>,
    out: *mut f32,
) {
    // A lone row of 8-bit activations (batch-1 decode) takes the byte kernel: there the
    // weights' unpacking, not the multiply-adds, sets the time (at two rows it was already
    // no faster on a 576 x 1536 product).
    let bytes = a.bits == Some(ActBits::Eight);
    let mut m0 = rows.start;
    while m0 < rows.end {
        let m1 = (m0 + ROW_BLOCK).min(rows.end);
        let mut t = tiles.start;
        while t < tiles.end {
            let pair = (t, (t + 1).min(tiles.end - 1));
            let mut m = m0;
            while m + 8 <= m1 {
                q4_tile::<8>(w, a, pair, m, out);
                m += 8;
            }
            match (m1 - m, bytes) {
                (7, _) => q4_tile::<7>(w, a, pair, m, out),
                (6, _) => q4_tile::<6>(w, a, pair, m, out),
                (5, _) => q4_tile::<5>(w, a, pair, m, out),
                (4, _) => q4_tile::<4>(w, a, pair, m, out),
                (3, _) => q4_tile::<3>(w, a, pair, m, out),
                (2, _) => q4_tile::<2>(w, a, pair, m, out),
                (1, true) => q4_byte_tile(w, a, pair, m, out),
                (1, false) => q4_tile::<1>(w, a, pair, m, out),
                _ => {}
            }
            t += 2;
        }
        m0 = m1;
    }
}

/// Two 4-bit tiles side by side (16 weight rows; `t1 == t0` for a last lone tile): where
/// their blocks lie, and each block's 16 steps and offsets in f32, computed one way for the
/// AVX-512 kernel and for AMX's unpacked tiles, so the two add the same bits. Blocks are
/// taken in order (the super-block's largest step and offset are read at its first block).
pub(crate) struct Q4Pair {
    qs: [*const u8; 2],
    sc: [*const u8; 2],
    mn: [*const u8; 2],
    ds: [*const u8; 2],
    ms: [*const u8; 2],
    dmax: __m512,
    mmax: __m512,
}

impl Q4Pair {
    #[target_feature(enable = "avx512f")]
    #[inline]
    pub(crate) unsafe fn new(w: &PackedQ4, t0: usize, t1: usize) -> Self {
        const G: usize = Q4_TILE_ROWS;
        let per_tile = |p: *const u8, step: usize| [p.add(t0 * step), p.add(t1 * step)];
        Q4Pair {
            qs: per_tile(w.qs.as_ptr(), w.blocks * Q4_TILE_BLOCK_BYTES),
            sc: per_tile(w.sc.as_ptr(), w.blocks * G),
            mn: per_tile(w.mn.as_ptr() as *const u8, w.blocks * G),
            // 8 f16 values (16 bytes) per tile and super-block.
            ds: per_tile(w.ds.as_ptr() as *const u8, w.supers * G * 2),
            ms: per_tile(w.ms.as_ptr() as *const u8, w.supers * G * 2),
            dmax: _mm512_setzero_ps(),
            mmax: _mm512_setzero_ps(),
        }
    }

    /// Block `b`'s packed levels in each tile.
    #[inline(always)]
    pub(crate) unsafe fn block(&self, b: usize) -> (*const u8, *const u8) {
        (
            self.qs[0].add(b * Q4_TILE_BLOCK_BYTES),
            self.qs[1].add(b * Q4_TILE_BLOCK_BYTES),
        )
    }

    /// Block `b`'s 16 steps `d` and offsets `m` in f32, as `q4::step` and `q4::offset`
    /// compute them (the super-block's value in the units of the 8-bit one, times it).
    #[target_feature(enable = "avx512f,avx512bw,avx2,f16c")]
    #[inline]
    pub(crate) unsafe fn scales(&mut self, b: usize) -> (__m512, __m512) {
        const G: usize = Q4_TILE_ROWS;
        if b.is_multiple_of(SUPER_BLOCKS) {
            let s = b / SUPER_BLOCKS * G * 2;
            self.dmax = _mm512_mul_ps(
                _mm512_cvtph_ps(two_halves(self.ds[0].add(s), self.ds[1].add(s))),
                _mm512_set1_ps(STEP_UNIT),
            );
            self.mmax = _mm512_mul_ps(
                _mm512_cvtph_ps(two_halves(self.ms[0].add(s), self.ms[1].add(s))),
                _mm512_set1_ps(OFFSET_UNIT),
            );
        }
        let steps = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(two_eighths(
            self.sc[0].add(b * G),
            self.sc[1].add(b * G),
        )));
        let offsets = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(two_eighths(
            self.mn[0].add(b * G),
            self.mn[1].add(b * G),
        )));
        (
            _mm512_mul_ps(self.dmax, steps),
            _mm512_mul_ps(self.mmax, offsets),
        )
    }
}

/// 16 bytes at `p0` in the low half of a register, 16 at `p1` in the high one.
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn two_halves(p0: *const u8, p1: *const u8) -> __m256i {
    _mm256_set_m128i(
        _mm_loadu_si128(p1 as *const __m128i),
        _mm_loadu_si128(p0 as *const __m128i),
    )
}

/// 8 bytes at `p0`, then 8 at `p1`.
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn two_eighths(p0: *const u8, p1: *const u8) -> __m128i {
    _mm_unpacklo_epi64(
        _mm_loadl_epi64(p0 as *const __m128i),
        _mm_loadl_epi64(p1 as *const __m128i),
    )
}

/// Tiles `t0` and `t1` (output columns `8·t0 ..`, then `8·t1 ..`; `t1` is `t0 + 1`, or
/// `t0` itself for a last lone tile) for activation rows `m .. m + M`.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
#[inline]
unsafe fn q4_tile<const M: usize>(
    w: &PackedQ4,
    a: &Activations,
    (t0, t1): (usize, usize),
    m: usize,
    out: *mut f32,
) {
    const G: usize = Q4_TILE_ROWS;
    let n = w.rows;
    let mut pair = Q4Pair::new(w, t0, t1);
    let sums = a.block_sums().as_ptr();
    let mut aq = [a.q.as_ptr(); M];
    let mut ad = [a.d.as_ptr(); M];
    let mut asum = [sums; M];
    for j in 0..M {
        aq[j] = a.q.as_ptr().add((m + j) * a.cols);
        ad[j] = a.d.as_ptr().add((m + j) * a.blocks);
        asum[j] = sums.add((m + j) * a.blocks);
    }
    let nibble = _mm256_set1_epi8(0x0f);
    let mut acc = [_mm512_setzero_ps(); M];
    for b in 0..w.blocks {
        let (wb0, wb1) = pair.block(b);
        crate::x86::prefetch_ahead(wb0, Q4_TILE_BLOCK_BYTES);
        crate::x86::prefetch_ahead(wb1, Q4_TILE_BLOCK_BYTES);
        let mut sum = [_mm512_setzero_si512(); M];
        for k in 0..BLOCK / 4 {
            let x = two_halves(wb0.add(k * 2 * G), wb1.add(k * 2 * G));
            let w0 = _mm512_cvtepu8_epi16(_mm256_and_si256(x, nibble));
            let w1 = _mm512_cvtepu8_epi16(_mm256_and_si256(_mm256_srli_epi16::<4>(x), nibble));
            for j in 0..M {
                let p = aq[j].add(b * BLOCK + 4 * k) as *const i32;
                sum[j] = _mm512_dpwssd_epi32(sum[j], w0, _mm512_set1_epi32(p.read_unaligned()));
                sum[j] =
                    _mm512_dpwssd_epi32(sum[j], w1, _mm512_set1_epi32(p.add(1).read_unaligned()));
            }
        }
        let (dw, mw) = pair.scales(b);
        for j in 0..M {
            let s = _mm512_mul_ps(dw, _mm512_set1_ps(*ad[j].add(b)));
            acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[j]), s, acc[j]);
            acc[j] = _mm512_fmadd_ps(mw, _mm512_set1_ps(*asum[j].add(b)), acc[j]);
        }
    }
    let (c0, keep) = pair_columns(n, t0, t1);
    for j in 0..M {
        _mm512_mask_storeu_ps(out.add((m + j) * n + c0), keep, acc[j]);
    }
}

/// A pair of 4-bit tiles' first output column, and which of the 16 lanes from it are
/// output columns (the second tile's none when it is the first again; none past `n`).
#[inline(always)]
fn pair_columns(n: usize, t0: usize, t1: usize) -> (usize, __mmask16) {
    const G: usize = Q4_TILE_ROWS;
    let c0 = t0 * G;
    let width = if t1 == t0 { G } else { 2 * G };
    (c0, ((1u32 << width.min(n - c0)) - 1) as u16)
}

/// As [`q4_tile`] for one row of 8-bit activations (row `m`), on `vpdpbusd` (levels as
/// unsigned bytes × activations as signed bytes, 64 multiply-adds per instruction) in place
/// of widening the levels to 16 bits for `vpdpwssd`: half the unpacking per weight byte,
/// which is what a one-row product spends its time on. A 64-byte load holds 4 column quads
/// of a tile's 8 rows; the low and high nibbles, interleaved by 16-bit unit within each
/// 128-bit slice, put each row's 4 levels of one quad in one 32-bit lane, slice `k` holding
/// quad `k` (rows 0–3 in one register, 4–7 in the other). The block's activations, narrowed
/// to bytes, are spread to match (quad `k` over slice `k`'s four lanes). Folding the four
/// slices gives each row's block sum: exactly [`q4_tile`]'s integer sum, so the block is
/// added with its operations, in its order, and the two kernels agree bit for bit.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
#[inline]
unsafe fn q4_byte_tile(
    w: &PackedQ4,
    a: &Activations,
    (t0, t1): (usize, usize),
    m: usize,
    out: *mut f32,
) {
    let n = w.rows;
    let mut pair = Q4Pair::new(w, t0, t1);
    let aq = a.q.as_ptr().add(m * a.cols);
    let ad = a.d.as_ptr().add(m * a.blocks);
    let asum = a.block_sums().as_ptr().add(m * a.blocks);
    let nibble = _mm512_set1_epi8(0x0f);
    // Quad `k` (4 activation bytes, one 32-bit unit) over the four lanes of slice `k`.
    let quads_0_3 = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
    let quads_4_7 = _mm512_set_epi32(7, 7, 7, 7, 6, 6, 6, 6, 5, 5, 5, 5, 4, 4, 4, 4);
    let mut acc = _mm512_setzero_ps();
    for b in 0..w.blocks {
        let (wb0, wb1) = pair.block(b);
        crate::x86::prefetch_ahead(wb0, Q4_TILE_BLOCK_BYTES);
        crate::x86::prefetch_ahead(wb1, Q4_TILE_BLOCK_BYTES);
        // The block's 32 activations, each in [-127, 127], as signed bytes.
        let x = _mm512_castsi256_si512(_mm512_cvtepi16_epi8(_mm512_loadu_si512(
            aq.add(b * BLOCK) as *const _
        )));
        let (x0, x1) = (
            _mm512_permutexvar_epi32(quads_0_3, x),
            _mm512_permutexvar_epi32(quads_4_7, x),
        );
        let (a0, b0) = byte_levels(wb0, nibble);
        let (a1, b1) = byte_levels(wb0.add(64), nibble);
        let (a2, b2) = byte_levels(wb1, nibble);
        let (a3, b3) = byte_levels(wb1.add(64), nibble);
        // Rows 0–3 and 4–7 of tile `t0`, then of `t1`: slice `j` of the sum is register
        // `j`'s slices added.
        let sum = fold_four(
            quad_dot(a0, a1, x0, x1),
            quad_dot(b0, b1, x0, x1),
            quad_dot(a2, a3, x0, x1),
            quad_dot(b2, b3, x0, x1),
        );
        let (dw, mw) = pair.scales(b);
        let s = _mm512_mul_ps(dw, _mm512_set1_ps(*ad.add(b)));
        acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), s, acc);
        acc = _mm512_fmadd_ps(mw, _mm512_set1_ps(*asum.add(b)), acc);
    }
    let (c0, keep) = pair_columns(n, t0, t1);
    _mm512_mask_storeu_ps(out.add(m * n + c0), keep, acc);
}

/// 64 bytes of a 4-bit tile's block (4 column quads of its 8 rows) as levels in unsigned
/// bytes: each 32-bit lane one row's 4 levels of one quad, slice `k` quad `k`; rows 0–3 in
/// the first register, 4–7 in the second.
#[target_feature(enable = "avx512f,avx512bw")]
#[inline]
unsafe fn byte_levels(p: *const u8, nibble: __m512i) -> (__m512i, __m512i) {
    let v = _mm512_loadu_si512(p as *const _);
    // Byte `2r + i` holds columns `4k + i` (low nibble) and `4k + 2 + i` (high) of row `r`.
    let lo = _mm512_and_si512(v, nibble);
    let hi = _mm512_and_si512(_mm512_srli_epi16::<4>(v), nibble);
    (_mm512_unpacklo_epi16(lo, hi), _mm512_unpackhi_epi16(lo, hi))
}

/// Each row's partial sums over a block's two registers of levels (quads 0–3 and 4–7, from
/// [`byte_levels`]) times the activations spread to match: slice `k` holds quad `k`'s and
/// quad `k + 4`'s ([`fold_four`] adds the slices).
#[target_feature(enable = "avx512f,avx512vnni")]
#[inline]
unsafe fn quad_dot(lo: __m512i, hi: __m512i, x0: __m512i, x1: __m512i) -> __m512i {
    let s = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, x0);
    _mm512_dpbusd_epi32(s, hi, x1)
}

/// Slice `j` of the result is the sum of the four 128-bit slices of the `j`-th argument: a
/// 4 × 4 transpose of slices, added on the way (six slice shuffles and three adds, where
/// folding each register alone and blending takes eight, eight and three). Integer adds, so
/// the sums are the same whatever their order.
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn fold_four(a: __m512i, b: __m512i, c: __m512i, d: __m512i) -> __m512i {
    // [a0 + a2, a1 + a3, b0 + b2, b1 + b3] and the same for c, d.
    let ab = _mm512_add_epi32(
        _mm512_shuffle_i32x4::<0x44>(a, b),
        _mm512_shuffle_i32x4::<0xEE>(a, b),
    );
    let cd = _mm512_add_epi32(
        _mm512_shuffle_i32x4::<0x44>(c, d),
        _mm512_shuffle_i32x4::<0xEE>(c, d),
    );
    // [a, b, c, d] each summed: even slices plus odd slices.
    _mm512_add_epi32(
        _mm512_shuffle_i32x4::<0x88>(ab, cd),
        _mm512_shuffle_i32x4::<0xDD>(ab, cd),
    )
}
