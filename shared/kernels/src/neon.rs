//! NEON kernels (aarch64: Advanced SIMD, part of every ARMv8-A core — Graviton, Ampere,
//! Apple). Each public function is `unsafe`: the caller checks [`crate::Isa::Neon`] is
//! available.
//!
//! The Q8_0 product reads [`crate::Q8Layout::PairColumns`], as the AVX2 kernel does: for
//! each pair of columns one 16-byte load holds the pair for the tile's 8 rows; widened to
//! 16 bits (`sxtl`) each half is multiplied and accumulated (`smlal`, `smlal2`) with the
//! activation row's pair repeated in every lane pair (one `dup` of a 32-bit load), so lane
//! `2i + c` sums row `i`'s column `c` of every pair; one pairwise add (`addp`) per block
//! gives the 8 rows' integer sums. The 4-bit product reads its tiles the same way, a nibble
//! per value. Exact for 8- and 16-bit activations alike (a lane sums 16 products of at most
//! 127 · 32767). Per block the sums are scaled with separate multiplies and adds, in the
//! scalar reference's order, so the results equal the reference's bit for bit. A register
//! tile is 8 weight rows × up to 4 activation rows (16 integer accumulators).

#![allow(clippy::needless_range_loop)] // lane- and row-indexed loops mirror the register tiles

use crate::layout::{Activations, PackedQ8, BLOCK, PAIR_TILE_ROWS, ROW_BLOCK};
use crate::q4::{
    PackedQ4, OFFSET_UNIT, Q4_TILE_BLOCK_BYTES, Q4_TILE_ROWS, STEP_UNIT, SUPER_BLOCKS,
};
use std::arch::aarch64::*;
use std::ops::Range;

/// Rows of a tile (both products use tiles of 8 output rows).
const G: usize = PAIR_TILE_ROWS;
const _: () = assert!(Q4_TILE_ROWS == G);

/// Walk `tiles` × every activation row in register tiles of up to 4 rows.
#[inline(always)]
unsafe fn each_register_tile(
    rows: usize,
    tiles: Range<usize>,
    mut tile: impl FnMut(usize, usize, usize),
) {
    let mut m0 = 0;
    while m0 < rows {
        let m1 = (m0 + ROW_BLOCK).min(rows);
        for t in tiles.clone() {
            let mut m = m0;
            while m < m1 {
                let k = (m1 - m).min(4);
                tile(t, m, k);
                m += k;
            }
        }
        m0 = m1;
    }
}

/// The activation pair at `p` (two `i16`) repeated over the 8 lanes.
#[inline(always)]
unsafe fn pair(p: *const i16) -> int16x8_t {
    vreinterpretq_s16_s32(vdupq_n_s32((p as *const i32).read_unaligned()))
}

/// Accumulate one column pair of the tile's 8 rows (`lo`: rows 0–3, `hi`: rows 4–7, lane
/// `2i + c` = row `i`, column `c`) times the activation pair.
#[inline(always)]
unsafe fn pair_mla(acc: &mut [int32x4_t; 4], lo: int16x8_t, hi: int16x8_t, a: int16x8_t) {
    let a4 = vget_low_s16(a);
    acc[0] = vmlal_s16(acc[0], vget_low_s16(lo), a4);
    acc[1] = vmlal_high_s16(acc[1], lo, a);
    acc[2] = vmlal_s16(acc[2], vget_low_s16(hi), a4);
    acc[3] = vmlal_high_s16(acc[3], hi, a);
}

/// The 8 rows' sums of a block's pair accumulators, as f32 (rows 0–3, rows 4–7).
#[inline(always)]
unsafe fn row_sums(acc: &[int32x4_t; 4]) -> [float32x4_t; 2] {
    [
        vcvtq_f32_s32(vpaddq_s32(acc[0], acc[1])),
        vcvtq_f32_s32(vpaddq_s32(acc[2], acc[3])),
    ]
}

/// Write a register tile's row of 8 outputs (columns `c0 ..`, clipped to `n`).
#[inline(always)]
unsafe fn store(acc: &[float32x4_t; 2], o: *mut f32, c0: usize, n: usize) {
    if c0 + G <= n {
        vst1q_f32(o, acc[0]);
        vst1q_f32(o.add(4), acc[1]);
    } else {
        let mut v = [0f32; G];
        vst1q_f32(v.as_mut_ptr(), acc[0]);
        vst1q_f32(v.as_mut_ptr().add(4), acc[1]);
        for (r, &v) in v.iter().enumerate().take(n - c0) {
            *o.add(r) = v;
        }
    }
}

/// As [`crate::scalar::q8_tiles`], for weights in [`crate::Q8Layout::PairColumns`].
pub(crate) unsafe fn q8_tiles(w: &PackedQ8, a: &Activations, tiles: Range<usize>, out: *mut f32) {
    each_register_tile(a.rows, tiles, |t, m, k| match k {
        4 => q8_tile::<4>(w, a, t, m, out),
        3 => q8_tile::<3>(w, a, t, m, out),
        2 => q8_tile::<2>(w, a, t, m, out),
        _ => q8_tile::<1>(w, a, t, m, out),
    });
}

/// Tile `t` (8 output columns) for activation rows `m .. m + M`.
#[inline(always)]
unsafe fn q8_tile<const M: usize>(
    w: &PackedQ8,
    a: &Activations,
    t: usize,
    m: usize,
    out: *mut f32,
) {
    let n = w.rows;
    let wq = w.qs.as_ptr().add(t * w.blocks * G * BLOCK);
    let wd = w.d.as_ptr().add(t * w.blocks * G);
    let aq: [*const i16; M] = std::array::from_fn(|j| a.q.as_ptr().add((m + j) * a.cols));
    let ad: [*const f32; M] = std::array::from_fn(|j| a.d.as_ptr().add((m + j) * a.blocks));
    let mut acc = [[vdupq_n_f32(0.0); 2]; M];
    for b in 0..w.blocks {
        let wb = wq.add(b * G * BLOCK);
        let mut sum = [[vdupq_n_s32(0); 4]; M];
        for p in 0..BLOCK / 2 {
            let v = vld1q_s8(wb.add(p * 2 * G));
            let (lo, hi) = (vmovl_s8(vget_low_s8(v)), vmovl_high_s8(v));
            for j in 0..M {
                pair_mla(&mut sum[j], lo, hi, pair(aq[j].add(b * BLOCK + 2 * p)));
            }
        }
        let d: [f32; G] = std::array::from_fn(|r| (*wd.add(b * G + r)).to_f32());
        let dw = [vld1q_f32(d.as_ptr()), vld1q_f32(d.as_ptr().add(4))];
        for j in 0..M {
            let da = vdupq_n_f32(*ad[j].add(b));
            let s = row_sums(&sum[j]);
            for h in 0..2 {
                // acc + dot · (dw · da), rounded step by step as the reference does
                acc[j][h] = vaddq_f32(acc[j][h], vmulq_f32(s[h], vmulq_f32(dw[h], da)));
            }
        }
    }
    for j in 0..M {
        store(&acc[j], out.add((m + j) * n + t * G), t * G, n);
    }
}

/// As [`crate::scalar::q4_tiles`]: 4-bit weights in tiles of 8 rows.
pub(crate) unsafe fn q4_tiles(w: &PackedQ4, a: &Activations, tiles: Range<usize>, out: *mut f32) {
    each_register_tile(a.rows, tiles, |t, m, k| match k {
        4 => q4_tile::<4>(w, a, t, m, out),
        3 => q4_tile::<3>(w, a, t, m, out),
        2 => q4_tile::<2>(w, a, t, m, out),
        _ => q4_tile::<1>(w, a, t, m, out),
    });
}

/// Tile `t` (8 output columns) of 4-bit weights for activation rows `m .. m + M`. Per quad
/// of columns, one 16-byte load holds two column pairs for the 8 rows, a nibble each: the
/// mask gives the first pair, the shift the second, in the 8-bit kernel's lane order.
#[inline(always)]
unsafe fn q4_tile<const M: usize>(
    w: &PackedQ4,
    a: &Activations,
    t: usize,
    m: usize,
    out: *mut f32,
) {
    let n = w.rows;
    let wq = w.qs.as_ptr().add(t * w.blocks * Q4_TILE_BLOCK_BYTES);
    let sc = w.sc.as_ptr().add(t * w.blocks * G);
    let mn = w.mn.as_ptr().add(t * w.blocks * G);
    let ds = w.ds.as_ptr().add(t * w.supers * G);
    let ms = w.ms.as_ptr().add(t * w.supers * G);
    let sums = a.block_sums().as_ptr();
    let aq: [*const i16; M] = std::array::from_fn(|j| a.q.as_ptr().add((m + j) * a.cols));
    let ad: [*const f32; M] = std::array::from_fn(|j| a.d.as_ptr().add((m + j) * a.blocks));
    let asum: [*const f32; M] = std::array::from_fn(|j| sums.add((m + j) * a.blocks));
    let nibble = vdupq_n_u8(0x0f);
    let widen = |v: uint8x16_t| {
        (
            vreinterpretq_s16_u16(vmovl_u8(vget_low_u8(v))),
            vreinterpretq_s16_u16(vmovl_high_u8(v)),
        )
    };
    let mut acc = [[vdupq_n_f32(0.0); 2]; M];
    let (mut dmax, mut mmax) = ([0f32; G], [0f32; G]);
    for b in 0..w.blocks {
        if b % SUPER_BLOCKS == 0 {
            // In the units of the 8-bit step and offset, as `q4::step` and `q4::offset`.
            let s = b / SUPER_BLOCKS;
            for r in 0..G {
                dmax[r] = (*ds.add(s * G + r)).to_f32() * STEP_UNIT;
                mmax[r] = (*ms.add(s * G + r)).to_f32() * OFFSET_UNIT;
            }
        }
        let wb = wq.add(b * Q4_TILE_BLOCK_BYTES);
        let mut sum = [[vdupq_n_s32(0); 4]; M];
        for k in 0..BLOCK / 4 {
            let x = vld1q_u8(wb.add(k * 2 * G));
            let (lo0, hi0) = widen(vandq_u8(x, nibble));
            let (lo1, hi1) = widen(vshrq_n_u8::<4>(x));
            for j in 0..M {
                let p = aq[j].add(b * BLOCK + 4 * k);
                pair_mla(&mut sum[j], lo0, hi0, pair(p));
                pair_mla(&mut sum[j], lo1, hi1, pair(p.add(2)));
            }
        }
        let dw: [f32; G] = std::array::from_fn(|r| dmax[r] * *sc.add(b * G + r) as f32);
        let mw: [f32; G] = std::array::from_fn(|r| mmax[r] * *mn.add(b * G + r) as f32);
        let dw = [vld1q_f32(dw.as_ptr()), vld1q_f32(dw.as_ptr().add(4))];
        let mw = [vld1q_f32(mw.as_ptr()), vld1q_f32(mw.as_ptr().add(4))];
        for j in 0..M {
            let (da, sa) = (vdupq_n_f32(*ad[j].add(b)), vdupq_n_f32(*asum[j].add(b)));
            let s = row_sums(&sum[j]);
            for h in 0..2 {
                // acc + (dot · (dw · da) + mw · sa), in the reference's order
                let term = vaddq_f32(vmulq_f32(s[h], vmulq_f32(dw[h], da)), vmulq_f32(mw[h], sa));
                acc[j][h] = vaddq_f32(acc[j][h], term);
            }
        }
    }
    for j in 0..M {
        store(&acc[j], out.add((m + j) * n + t * G), t * G, n);
    }
}
