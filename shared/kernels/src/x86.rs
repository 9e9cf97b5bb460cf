//! AVX2 + FMA + F16C kernels (x86-64). Each public function is `#[target_feature]` and
//! `unsafe`: the caller checks [`crate::Isa::Avx2`] is available.
//!
//! The Q8_0 product reads [`crate::Q8Layout::PairColumns`]: for each pair of columns, one
//! 16-byte load holds the pair for the tile's 8 rows; widened to 16 bits (`vpmovsxbw`) it
//! is multiplied with `vpmaddwd` by the activation row's pair broadcast to every lane
//! (`vpbroadcastd`, a load, not a shuffle), which leaves row `i`'s partial sum in lane `i`:
//! no horizontal sums, so the loop is bound by the multiply port rather than the shuffle
//! port. Exact for 8- and 16-bit activations alike (a block's 16 pair sums stay below
//! 2³¹). Per block the 8 integer sums are converted to f32 and added with the scales'
//! products (`vfmadd`). A register tile is two weight tiles (16 output columns) × up to 4
//! activation rows: 8 integer accumulators, so each broadcast pair feeds two multiplies
//! (a thread's odd last tile runs alone). The 4-bit product has the same register tile; for
//! 8-bit activations it multiplies the nibbles as bytes instead (`q4_tiles_bytes`:
//! `vpmaddubsw`, 32 multiply-adds per instruction against `vpmaddwd`'s 16, same sums and
//! bits).
//!
//! The Q8_0 and 4-bit products are also made for AVX-VNNI (`q8_tiles_vnni`, `q4_tiles_vnni`;
//! the caller checks [`crate::Isa::AvxVnni`]): `vpdpwssd` does the multiply and the add in
//! one instruction, with the same sums.

#![allow(clippy::needless_range_loop)] // lane- and row-indexed loops mirror the register tiles

use crate::layout::{Activations, PackedQ8, BLOCK, PAIR_TILE_ROWS, ROW_BLOCK, TILE_ROWS};
use crate::q4::{
    PackedQ4, OFFSET_UNIT, Q4_TILE_BLOCK_BYTES, Q4_TILE_ROWS, STEP_UNIT, SUPER_BLOCKS,
};
use std::arch::x86_64::*;
use std::ops::Range;

/// How far ahead of the block it multiplies the Q8_0 and 4-bit kernels (AVX2, AVX-VNNI and
/// AVX-512) ask for weight bytes.
const PREFETCH_AHEAD: usize = 8192;

/// Ask for the `bytes` of weights [`PREFETCH_AHEAD`] bytes on from `block`, one `prefetcht1`
/// per cache line. A thread's tiles are one contiguous stream, so at batch 1 this keeps more
/// lines in flight than the hardware prefetcher alone. Into the second-level cache, not the
/// first: on AMD Zen 4 `prefetcht0` left a one-thread 4-bit stream at 11–14 GB/s and
/// `prefetcht1` took it to 23 (the first level's miss buffers fill; docs/design/kernels.md).
/// A prefetch never faults: past the end it fetches nothing of ours.
#[inline(always)]
pub(crate) fn prefetch_ahead(block: *const u8, bytes: usize) {
    for line in 0..bytes / 64 {
        let p = block.wrapping_add(PREFETCH_AHEAD + 64 * line) as *const i8;
        // SAFETY: a prefetch is a hint; it reads nothing into the program and cannot fault,
        // whatever the address. SSE is part of x86-64.
        unsafe { _mm_prefetch::<_MM_HINT_T1>(p) };
    }
}

/// `acc + a0·b0 + a1·b1` over 16-bit pairs into 32-bit lanes (AVX2): two `vpmaddwd`, two
/// `vpaddd`; only the last add depends on `acc`, so the loop carries a one-cycle chain.
macro_rules! madd2_avx2 {
    ($acc:expr, $a0:expr, $b0:expr, $a1:expr, $b1:expr) => {
        _mm256_add_epi32(
            $acc,
            _mm256_add_epi32(_mm256_madd_epi16($a0, $b0), _mm256_madd_epi16($a1, $b1)),
        )
    };
}

/// The same with AVX-VNNI: `vpmaddwd`, then `vpdpwssd` adds the second pair product into it,
/// then one `vpaddd` (three instructions for four). The fused add stays off the loop's chain
/// (its latency is the multiply's). Equal sums: a block's pair sums never overflow.
macro_rules! madd2_vnni {
    ($acc:expr, $a0:expr, $b0:expr, $a1:expr, $b1:expr) => {
        _mm256_add_epi32($acc, dpwssd_vex(_mm256_madd_epi16($a0, $b0), $a1, $b1))
    };
}

/// `acc + a·b` over 16-bit pairs (AVX2): one `vpmaddwd`, one `vpaddd`.
macro_rules! madd1_avx2 {
    ($acc:expr, $a:expr, $b:expr) => {
        _mm256_add_epi32($acc, _mm256_madd_epi16($a, $b))
    };
}

/// The same with AVX-VNNI: one `vpdpwssd`.
macro_rules! madd1_vnni {
    ($acc:expr, $a:expr, $b:expr) => {
        dpwssd_vex($acc, $a, $b)
    };
}

/// `acc + a·b` over 16-bit pairs in one VEX-encoded `vpdpwssd`. Written as an instruction:
/// LLVM turns the intrinsic back into `vpmaddwd` + `vpaddd` when it tunes for a generic
/// x86-64 (seen in the built kernels), which would leave nothing for AVX-VNNI to do.
#[target_feature(enable = "avx2,avxvnni")]
#[inline]
unsafe fn dpwssd_vex(acc: __m256i, a: __m256i, b: __m256i) -> __m256i {
    let mut acc = acc;
    std::arch::asm!(
        "{{vex}} vpdpwssd {acc}, {a}, {b}",
        acc = inout(ymm_reg) acc,
        a = in(ymm_reg) a,
        b = in(ymm_reg) b,
        options(pure, nomem, nostack, preserves_flags)
    );
    acc
}

/// A 4-bit tile's super-block `i` (of `ds`, `ms`): the 8 rows' largest step and offset, in
/// the units of the 8-bit step and offset, as `q4::step` and `q4::offset`.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn q4_super_scales(ds: *const __m128i, ms: *const __m128i, i: usize) -> (__m256, __m256) {
    (
        _mm256_mul_ps(
            _mm256_cvtph_ps(_mm_loadu_si128(ds.add(i))),
            _mm256_set1_ps(STEP_UNIT),
        ),
        _mm256_mul_ps(
            _mm256_cvtph_ps(_mm_loadu_si128(ms.add(i))),
            _mm256_set1_ps(OFFSET_UNIT),
        ),
    )
}

/// A 4-bit tile's block: the 8 rows' step and offset from their 8-bit fractions (`sc`, `mn`)
/// of the super-block's largest (`dmax`, `mmax`).
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn q4_block_scales(
    dmax: __m256,
    mmax: __m256,
    sc: *const u8,
    mn: *const i8,
) -> (__m256, __m256) {
    let steps = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(sc as *const __m128i)));
    let offsets = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(mn as *const __m128i)));
    (_mm256_mul_ps(dmax, steps), _mm256_mul_ps(mmax, offsets))
}

// The 4-bit tiles have the 8-bit ones' width: one store serves both.
const _: () = assert!(Q4_TILE_ROWS == PAIR_TILE_ROWS);

/// Register tile `acc` (rows `m ..`, 8-column tiles `t ..`) into `out` (`n` columns per
/// row), the columns past `n` of a last partial tile left out.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn store_tiles<const T: usize, const M: usize>(
    acc: &[[__m256; T]; M],
    out: *mut f32,
    n: usize,
    t: usize,
    m: usize,
) {
    const G: usize = PAIR_TILE_ROWS;
    for h in 0..T {
        let c0 = (t + h) * G;
        for (j, acc) in acc.iter().enumerate() {
            let o = out.add((m + j) * n + c0);
            if c0 + G <= n {
                _mm256_storeu_ps(o, acc[h]);
            } else {
                let mut v = [0f32; G];
                _mm256_storeu_ps(v.as_mut_ptr(), acc[h]);
                for (r, &v) in v.iter().enumerate().take(n - c0) {
                    *o.add(r) = v;
                }
            }
        }
    }
}

/// The walk both products share: the activation rows in blocks of [`ROW_BLOCK`], and in each
/// the weight tiles two at a time (a thread's odd last tile alone), four activation rows per
/// register tile and one register tile of the rest.
macro_rules! walk_tiles {
    ($features:literal, $tile:ident, $weights:ty, $w:expr, $a:expr, $tiles:expr, $out:expr) => {{
        /// Tiles `t .. t + T` for the activation rows `rows`.
        #[target_feature(enable = $features)]
        #[inline]
        unsafe fn rows_of<const T: usize>(
            w: &$weights,
            a: &Activations,
            t: usize,
            rows: Range<usize>,
            out: *mut f32,
        ) {
            let mut m = rows.start;
            while m + 4 <= rows.end {
                $tile::<T, 4>(w, a, t, m, out);
                m += 4;
            }
            match rows.end - m {
                3 => $tile::<T, 3>(w, a, t, m, out),
                2 => $tile::<T, 2>(w, a, t, m, out),
                1 => $tile::<T, 1>(w, a, t, m, out),
                _ => {}
            }
        }

        let (w, a, tiles, out) = ($w, $a, $tiles, $out);
        let mut m0 = 0;
        while m0 < a.rows {
            let m1 = (m0 + ROW_BLOCK).min(a.rows);
            let mut t = tiles.start;
            while t + 2 <= tiles.end {
                rows_of::<2>(w, a, t, m0..m1, out);
                t += 2;
            }
            if t < tiles.end {
                rows_of::<1>(w, a, t, m0..m1, out);
            }
            m0 = m1;
        }
    }};
}

/// The Q8_0 and 4-bit products for one set of target features and one pair multiply-add:
/// written once, made for AVX2 and for AVX-VNNI below.
macro_rules! products {
    ($features:literal, $madd2:ident, $madd1:ident, $q8_tiles:ident, $q8_tile:ident, $q4_tiles:ident, $q4_tile:ident) => {
        /// As [`crate::scalar::q8_tiles`], for weights in [`crate::Q8Layout::PairColumns`].
        #[target_feature(enable = $features)]
        pub(crate) unsafe fn $q8_tiles(
            w: &PackedQ8,
            a: &Activations,
            tiles: Range<usize>,
            out: *mut f32,
        ) {
            walk_tiles!($features, $q8_tile, PackedQ8, w, a, tiles, out);
        }

        /// Tiles `t .. t + T` (8·T output columns) for activation rows `m .. m + M`: each
        /// broadcast activation pair feeds all T tiles' products.
        #[target_feature(enable = $features)]
        #[inline]
        unsafe fn $q8_tile<const T: usize, const M: usize>(
            w: &PackedQ8,
            a: &Activations,
            t: usize,
            m: usize,
            out: *mut f32,
        ) {
            const G: usize = PAIR_TILE_ROWS;
            let n = w.rows;
            let stride = w.blocks * G * BLOCK;
            let wq = w.qs.as_ptr().add(t * stride);
            // 8 f16 scales per block of a tile: one 16-byte load.
            let wd = w.d.as_ptr().add(t * w.blocks * G) as *const __m128i;
            let mut aq = [a.q.as_ptr(); M];
            let mut ad = [a.d.as_ptr(); M];
            for j in 0..M {
                aq[j] = a.q.as_ptr().add((m + j) * a.cols);
                ad[j] = a.d.as_ptr().add((m + j) * a.blocks);
            }
            let mut acc = [[_mm256_setzero_ps(); T]; M];
            for b in 0..w.blocks {
                let wb = wq.add(b * G * BLOCK);
                for h in 0..T {
                    prefetch_ahead(wb.add(h * stride) as *const u8, G * BLOCK);
                }
                let mut s = [[_mm256_setzero_si256(); T]; M];
                for p in 0..BLOCK / 2 {
                    let mut wv = [_mm256_setzero_si256(); T];
                    for h in 0..T {
                        wv[h] = _mm256_cvtepi8_epi16(_mm_loadu_si128(
                            wb.add(h * stride + p * 2 * G) as *const __m128i,
                        ));
                    }
                    for j in 0..M {
                        let pair = aq[j].add(b * BLOCK + 2 * p) as *const i32;
                        let bj = _mm256_set1_epi32(pair.read_unaligned());
                        for h in 0..T {
                            s[j][h] = $madd1!(s[j][h], wv[h], bj);
                        }
                    }
                }
                for h in 0..T {
                    let dw = _mm256_cvtph_ps(_mm_loadu_si128(wd.add(h * w.blocks + b)));
                    for j in 0..M {
                        let da = _mm256_set1_ps(*ad[j].add(b));
                        acc[j][h] = _mm256_fmadd_ps(
                            _mm256_cvtepi32_ps(s[j][h]),
                            _mm256_mul_ps(dw, da),
                            acc[j][h],
                        );
                    }
                }
            }
            store_tiles(&acc, out, n, t, m);
        }

        /// As [`crate::scalar::q4_tiles`]: 4-bit weights in tiles of 8 rows, register tiles of two
        /// weight tiles × up to 4 activation rows.
        #[target_feature(enable = $features)]
        pub(crate) unsafe fn $q4_tiles(
            w: &PackedQ4,
            a: &Activations,
            tiles: Range<usize>,
            out: *mut f32,
        ) {
            walk_tiles!($features, $q4_tile, PackedQ4, w, a, tiles, out);
        }

        /// Tiles `t .. t + T` (8·T output columns) of 4-bit weights for activation rows
        /// `m .. m + M`. Per quad of columns, one 16-byte load per tile holds two column pairs
        /// for its 8 rows, a nibble each: the mask gives the first pair's bytes in the 8-bit
        /// kernel's order, the shift the second's. Each broadcast activation pair feeds all T
        /// tiles' products.
        #[target_feature(enable = $features)]
        #[inline]
        unsafe fn $q4_tile<const T: usize, const M: usize>(
            w: &PackedQ4,
            a: &Activations,
            t: usize,
            m: usize,
            out: *mut f32,
        ) {
            const G: usize = Q4_TILE_ROWS;
            let n = w.rows;
            let stride = w.blocks * Q4_TILE_BLOCK_BYTES;
            let wq = w.qs.as_ptr().add(t * stride);
            let sc = w.sc.as_ptr().add(t * w.blocks * G);
            let mn = w.mn.as_ptr().add(t * w.blocks * G);
            let ds = w.ds.as_ptr().add(t * w.supers * G) as *const __m128i;
            let ms = w.ms.as_ptr().add(t * w.supers * G) as *const __m128i;
            let mut aq = [a.q.as_ptr(); M];
            let mut ad = [a.d.as_ptr(); M];
            let sums = a.block_sums().as_ptr();
            let mut asum = [sums; M];
            for j in 0..M {
                aq[j] = a.q.as_ptr().add((m + j) * a.cols);
                ad[j] = a.d.as_ptr().add((m + j) * a.blocks);
                asum[j] = sums.add((m + j) * a.blocks);
            }
            let nibble = _mm256_set1_epi16(0x0f);
            let mut acc = [[_mm256_setzero_ps(); T]; M];
            let mut dmax = [_mm256_setzero_ps(); T];
            let mut mmax = [_mm256_setzero_ps(); T];
            for b in 0..w.blocks {
                if b % SUPER_BLOCKS == 0 {
                    let s = b / SUPER_BLOCKS;
                    for h in 0..T {
                        (dmax[h], mmax[h]) = q4_super_scales(ds, ms, h * w.supers + s);
                    }
                }
                let wb = wq.add(b * Q4_TILE_BLOCK_BYTES);
                for h in 0..T {
                    prefetch_ahead(wb.add(h * stride), Q4_TILE_BLOCK_BYTES);
                }
                let mut sum = [[_mm256_setzero_si256(); T]; M];
                for k in 0..BLOCK / 4 {
                    let mut w0 = [_mm256_setzero_si256(); T];
                    let mut w1 = [_mm256_setzero_si256(); T];
                    for h in 0..T {
                        // Widened first, so one `vpmovzxbw` serves both nibbles and the
                        // shift needs no mask: each lane's high byte is zero.
                        let x = _mm256_cvtepu8_epi16(_mm_loadu_si128(
                            wb.add(h * stride + k * 2 * G) as *const __m128i,
                        ));
                        w0[h] = _mm256_and_si256(x, nibble);
                        w1[h] = _mm256_srli_epi16(x, 4);
                    }
                    for j in 0..M {
                        let p = aq[j].add(b * BLOCK + 4 * k) as *const i32;
                        let p0 = _mm256_set1_epi32(p.read_unaligned());
                        let p1 = _mm256_set1_epi32(p.add(1).read_unaligned());
                        for h in 0..T {
                            sum[j][h] = $madd2!(sum[j][h], w0[h], p0, w1[h], p1);
                        }
                    }
                }
                for h in 0..T {
                    let at = h * w.blocks * G + b * G;
                    let (dw, mw) = q4_block_scales(dmax[h], mmax[h], sc.add(at), mn.add(at));
                    for j in 0..M {
                        let s = _mm256_mul_ps(dw, _mm256_set1_ps(*ad[j].add(b)));
                        acc[j][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum[j][h]), s, acc[j][h]);
                        acc[j][h] = _mm256_fmadd_ps(mw, _mm256_set1_ps(*asum[j].add(b)), acc[j][h]);
                    }
                }
            }
            store_tiles(&acc, out, n, t, m);
        }
    };
}

products!(
    "avx2,fma,f16c",
    madd2_avx2,
    madd1_avx2,
    q8_tiles,
    q8_tile,
    q4_tiles,
    q4_tile
);
products!(
    "avx2,fma,f16c,avxvnni",
    madd2_vnni,
    madd1_vnni,
    q8_tiles_vnni,
    q8_tile_vnni,
    q4_tiles_vnni,
    q4_tile_vnni
);

/// As [`crate::scalar::q4_tiles`], for 8-bit activations (AVX2): `vpmaddubsw` multiplies the
/// weights' nibbles (unsigned, 0..=15) by the activations' bytes (signed) and adds each pair
/// into a 16-bit lane, 32 multiply-adds per instruction where the widened form's `vpmaddwd`
/// makes 16. The same register tiles as [`q4_tiles`].
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn q4_tiles_bytes(
    w: &PackedQ4,
    a: &Activations,
    tiles: Range<usize>,
    out: *mut f32,
) {
    walk_tiles!("avx2,fma,f16c", q4_tile_bytes, PackedQ4, w, a, tiles, out);
}

/// Tiles `t .. t + T` of 4-bit weights for 8-bit activation rows `m .. m + M`. One 32-byte
/// load holds quads `2p` and `2p + 1` of a block for the tile's 8 rows (one per 128-bit
/// half); the mask gives the nibbles of columns `8p + {0, 1}` and `8p + {4, 5}`, the shift
/// those of `8p + {2, 3}` and `8p + {6, 7}`, each byte pair one row's. The activations'
/// matching byte pairs, repeated across each half (made once per quantization:
/// [`Activations::q4_pairs`]), make `vpmaddubsw` leave row `i`'s sums of quad `2p` in 16-bit lane `i` and of
/// quad `2p + 1` in lane `8 + i`. A lane collects 16 products of at most 15 · 127 in a
/// block (≤ 30 480: no overflow); at the block's end the halves are widened and added, which
/// gives the same 32-bit sums as the widened kernel, then the same f32 operations: the same
/// bits as [`q4_tiles`] on the same activations.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn q4_tile_bytes<const T: usize, const M: usize>(
    w: &PackedQ4,
    a: &Activations,
    t: usize,
    m: usize,
    out: *mut f32,
) {
    const G: usize = Q4_TILE_ROWS;
    let n = w.rows;
    let stride = w.blocks * Q4_TILE_BLOCK_BYTES;
    let wq = w.qs.as_ptr().add(t * stride);
    let sc = w.sc.as_ptr().add(t * w.blocks * G);
    let mn = w.mn.as_ptr().add(t * w.blocks * G);
    let ds = w.ds.as_ptr().add(t * w.supers * G) as *const __m128i;
    let ms = w.ms.as_ptr().add(t * w.supers * G) as *const __m128i;
    let pairs = a.q4_pairs().as_ptr();
    let mut ap = [pairs; M];
    let mut ad = [a.d.as_ptr(); M];
    let sums = a.block_sums().as_ptr();
    let mut asum = [sums; M];
    for j in 0..M {
        ap[j] = pairs.add((m + j) * a.cols * PAIR_BYTES_PER_VALUE);
        ad[j] = a.d.as_ptr().add((m + j) * a.blocks);
        asum[j] = sums.add((m + j) * a.blocks);
    }
    let nibble = _mm256_set1_epi8(0x0f);
    let mut acc = [[_mm256_setzero_ps(); T]; M];
    let mut dmax = [_mm256_setzero_ps(); T];
    let mut mmax = [_mm256_setzero_ps(); T];
    for b in 0..w.blocks {
        if b % SUPER_BLOCKS == 0 {
            let s = b / SUPER_BLOCKS;
            for h in 0..T {
                (dmax[h], mmax[h]) = q4_super_scales(ds, ms, h * w.supers + s);
            }
        }
        let wb = wq.add(b * Q4_TILE_BLOCK_BYTES);
        for h in 0..T {
            prefetch_ahead(wb.add(h * stride), Q4_TILE_BLOCK_BYTES);
        }
        let mut sum = [[_mm256_setzero_si256(); T]; M];
        for p in 0..BLOCK / 8 {
            let mut w0 = [_mm256_setzero_si256(); T];
            let mut w1 = [_mm256_setzero_si256(); T];
            for h in 0..T {
                let x = _mm256_loadu_si256(wb.add(h * stride + p * 4 * G) as *const __m256i);
                w0[h] = _mm256_and_si256(x, nibble);
                w1[h] = _mm256_and_si256(_mm256_srli_epi16(x, 4), nibble);
            }
            for j in 0..M {
                let at = ap[j].add((b * BLOCK + 8 * p) * PAIR_BYTES_PER_VALUE);
                let a0 = _mm256_loadu_si256(at as *const __m256i);
                let a1 = _mm256_loadu_si256(at.add(32) as *const __m256i);
                for h in 0..T {
                    sum[j][h] = _mm256_add_epi16(
                        sum[j][h],
                        _mm256_add_epi16(
                            _mm256_maddubs_epi16(w0[h], a0),
                            _mm256_maddubs_epi16(w1[h], a1),
                        ),
                    );
                }
            }
        }
        for h in 0..T {
            let at = h * w.blocks * G + b * G;
            let (dw, mw) = q4_block_scales(dmax[h], mmax[h], sc.add(at), mn.add(at));
            for j in 0..M {
                let s16 = sum[j][h];
                let s32 = _mm256_add_epi32(
                    _mm256_cvtepi16_epi32(_mm256_castsi256_si128(s16)),
                    _mm256_cvtepi16_epi32(_mm256_extracti128_si256(s16, 1)),
                );
                let s = _mm256_mul_ps(dw, _mm256_set1_ps(*ad[j].add(b)));
                acc[j][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s32), s, acc[j][h]);
                acc[j][h] = _mm256_fmadd_ps(mw, _mm256_set1_ps(*asum[j].add(b)), acc[j][h]);
            }
        }
    }
    store_tiles(&acc, out, n, t, m);
}

/// Bytes of [`Activations::q4_pairs`] per activation value: two 32-byte registers per 8.
const PAIR_BYTES_PER_VALUE: usize = 8;

impl Activations {
    /// The 8-bit values as [`q4_tile_bytes`] multiplies them (`[row][8 values][64]`), made
    /// on the first call after a quantization (the 4-bit product calls it before its threads
    /// start, so they only read it).
    ///
    /// # Safety
    /// AVX2 must be available; the values must be 8-bit (within `i8`).
    pub(crate) unsafe fn q4_pairs(&self) -> &[u8] {
        self.q4_pairs.get_or_init(|| {
            let mut out = vec![0u8; self.q.len() * PAIR_BYTES_PER_VALUE];
            // SAFETY: the caller checked AVX2; `out` holds 64 bytes per 8 values.
            unsafe { q4_byte_pairs(&self.q, &mut out) };
            out
        })
    }
}

/// Each 8 values of `q` (8-bit, stored as `i16`) as two registers of byte pairs: values
/// {0, 1} repeated across the low half and {4, 5} across the high, then {2, 3} and {6, 7}
/// (`vpshufb` of the values packed to bytes): the operands [`q4_tile_bytes`] multiplies by
/// the weights' nibbles of the same columns.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q4_byte_pairs(q: &[i16], out: &mut [u8]) {
    debug_assert_eq!(out.len(), q.len() * PAIR_BYTES_PER_VALUE);
    let pick_lo = _mm256_setr_epi8(
        0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 4, 5, 4, 5, 4, 5, 4, 5, 4, 5, 4, 5, 4, 5,
        4, 5,
    );
    let pick_hi = _mm256_setr_epi8(
        2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 6, 7, 6, 7, 6, 7, 6, 7, 6, 7, 6, 7, 6, 7,
        6, 7,
    );
    for (v, o) in q.chunks_exact(8).zip(out.chunks_exact_mut(64)) {
        let v = _mm_loadu_si128(v.as_ptr() as *const __m128i);
        let v = _mm_packs_epi16(v, v);
        let v = _mm256_set_m128i(v, v);
        let o = o.as_mut_ptr() as *mut __m256i;
        _mm256_storeu_si256(o, _mm256_shuffle_epi8(v, pick_lo));
        _mm256_storeu_si256(o.add(1), _mm256_shuffle_epi8(v, pick_hi));
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{ActBits, Isa};

    /// `kernel` over every tile of `w` into a new output.
    fn run(
        w: &PackedQ4,
        a: &Activations,
        kernel: unsafe fn(&PackedQ4, &Activations, Range<usize>, *mut f32),
    ) -> Vec<u32> {
        let mut out = vec![f32::NAN; a.rows * w.rows];
        // SAFETY: the test runs only where AVX2, FMA and F16C are available; `out` holds
        // `a.rows × w.rows` values.
        unsafe { kernel(w, a, 0..w.tiles, out.as_mut_ptr()) };
        out.iter().map(|v| v.to_bits()).collect()
    }

    /// The byte kernel's 16-bit lanes hold the same integer sums as the widened kernel's
    /// 32-bit ones, then the same f32 operations: equal bits, over odd tile counts, lone
    /// tiles, register tiles of 1–4 rows, partial super-blocks, and blocks where every lane
    /// reaches its largest sum (levels 15 against activations ±127).
    #[test]
    fn the_byte_kernel_equals_the_widened_one_bit_for_bit() {
        if !Isa::Avx2.available() {
            eprintln!("skipped: this CPU has no AVX2");
            return;
        }
        let value =
            |i: usize, seed: usize| ((i * 7919 + seed * 104_729) % 2003) as f32 / 1001.0 - 1.0;
        for &(rows, cols, m) in &[
            (40, 576, 11),
            (24, 288, 1),
            (9, 1536, 5),
            (8, 64, 4),
            (130, 256, 3),
        ] {
            let wf: Vec<f32> = (0..rows * cols).map(|i| value(i, rows) * 0.1).collect();
            let w = PackedQ4::quantize(&wf, rows, cols).unwrap_or_else(|e| panic!("{e}"));
            let xf: Vec<f32> = (0..m * cols).map(|i| value(i, m + 1)).collect();
            let mut a = Activations::new();
            a.quantize_with(&xf, m, cols, ActBits::Eight, Isa::Avx2)
                .unwrap_or_else(|e| panic!("{e}"));
            assert_eq!(
                run(&w, &a, q4_tiles_bytes),
                run(&w, &a, q4_tiles),
                "[{rows}x{cols}] m={m}"
            );
        }
        // Every level 15 but one per block (0), every activation ±127.
        let (rows, cols, m) = (16, 256, 3);
        let wf: Vec<f32> = (0..rows * cols)
            .map(|i| if i % BLOCK == 5 { 0.0 } else { 1.0 })
            .collect();
        let w = PackedQ4::quantize(&wf, rows, cols).unwrap_or_else(|e| panic!("{e}"));
        let xf: Vec<f32> = (0..m * cols)
            .map(|i| if (i / cols) % 2 == 0 { 1.0 } else { -1.0 })
            .collect();
        let mut a = Activations::new();
        a.quantize_with(&xf, m, cols, ActBits::Eight, Isa::Avx2)
            .unwrap_or_else(|e| panic!("{e}"));
        assert!(a.q.iter().all(|v| v.abs() == 127));
        assert_eq!(run(&w, &a, q4_tiles_bytes), run(&w, &a, q4_tiles));
    }
}
