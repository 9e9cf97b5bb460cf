//! 4-bit weights ([`PackedQ4`]): the values of each block of 32 on a grid of 16 levels
//! `d · q + m` (`q` in 0..=15, an offset `m` as well as a step `d`, so a block whose values
//! are not centred on zero keeps all 16 levels), `d` and `m` stored as 8-bit fractions of
//! the largest step and offset among up to 8 blocks of a row (two f16 values) (a super-block: 256 values, the last of
//! a row shorter where 256 does not divide the width). The form of llama.cpp's Q4_K with
//! 8-bit instead of 6-bit block scales and super-blocks that end with the row, so every
//! width that is a multiple of 32 has it (SmolLM2's 576 does not fit Q4_K): 18 bytes per 32
//! weights plus 4 per super-block and row, 4.625 bits per weight at widths 256 divides.
//!
//! Layout, tiles of 8 output rows like [`crate::Q8Layout::PairColumns`], one 16-byte run
//! per two column pairs of a block (`[tile][block][quad][row in tile][2]`): byte `2i + c`
//! of quad `k` holds row `i`'s column `4k + c` in its low nibble and column `4k + 2 + c` in
//! its high one. One load, a mask and a shift give the two pairs for the tile's 8 rows as
//! bytes in the 8-bit kernel's order; widened to 16 bits they go through `vpmaddwd` against
//! the activation pair exactly as 8-bit weights do (the values are 0..=15, so 8- and 16-bit
//! activations cost the same). The block's offset adds `m · d_a · Σ a` per block and row,
//! the activations' block sums computed once when they are quantized.
//!
//! Quantization (at load) searches each block's `(d, m)`: several ranges around the
//! block's minimum and maximum, each refined by a least-squares fit of `d` and `m` to the
//! values' levels, the lowest squared error kept; then the 8-bit scales are chosen per
//! super-block and each block takes the neighbouring 8-bit values with the lowest error.

use crate::layout::BLOCK;
use crate::{KernelError, Result};
use half::f16;

/// Output rows per tile.
pub(crate) const Q4_TILE_ROWS: usize = 8;
/// Blocks per super-block (the last of a row may have fewer).
pub const SUPER_BLOCKS: usize = 8;
/// Bytes of one tile's block of 4-bit values.
pub(crate) const Q4_TILE_BLOCK_BYTES: usize = Q4_TILE_ROWS * BLOCK / 2;

/// 4-bit weights repacked for the kernels (see the module's notes).
#[derive(Clone)]
pub struct PackedQ4 {
    pub(crate) rows: usize,
    pub(crate) cols: usize,
    pub(crate) blocks: usize,
    /// Super-blocks per row.
    pub(crate) supers: usize,
    /// Tiles of [`Q4_TILE_ROWS`] rows.
    pub(crate) tiles: usize,
    /// `[tile][block][quad][row in tile][2]`, two values per byte.
    pub(crate) qs: Vec<u8>,
    /// `[tile][block][row in tile]`: the step in 255ths of its super-block's `ds` ([`step`]).
    pub(crate) sc: Vec<u8>,
    /// `[tile][block][row in tile]`: the offset in 127ths of its super-block's `ms`
    /// ([`offset`]).
    pub(crate) mn: Vec<i8>,
    /// `[tile][super-block][row in tile]`: the largest step among the super-block's blocks.
    pub(crate) ds: Vec<f16>,
    /// `[tile][super-block][row in tile]`: the largest |offset| among them.
    pub(crate) ms: Vec<f16>,
}

impl std::fmt::Debug for PackedQ4 {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "PackedQ4[{}, {}]", self.rows, self.cols)
    }
}

/// A block's step and offset before they are stored: the pair with the lowest squared
/// error over a few ranges, each refined by least squares.
fn fit_block(x: &[f32]) -> (f32, f32) {
    let lo = x.iter().copied().fold(f32::INFINITY, f32::min);
    let hi = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    if hi <= lo {
        return (0.0, lo);
    }
    let mut best = ((hi - lo) / 15.0, lo);
    let mut best_err = block_error(x, best.0, best.1);
    for step in 0..9 {
        // levels 13.0 ..= 17.0: a range a little narrower than the block's clips its
        // extremes to place the other levels better, a wider one rounds them better.
        let levels = 13.0 + 0.5 * step as f32;
        let (mut d, mut m) = ((hi - lo) / levels, lo);
        for _ in 0..2 {
            let Some(fit) = least_squares(x, d, m) else {
                break;
            };
            (d, m) = fit;
            let err = block_error(x, d, m);
            if err < best_err {
                (best, best_err) = ((d, m), err);
            }
        }
    }
    best
}

/// The level of `v` on the grid `d · q + m` (the nearest, ties to even) as an f32, for
/// `id = 1 / d` (0 for a zero step: every value at level 0). Float operations only, rounded
/// by adding and subtracting 2²³, so the loops over a block vectorize (`round` is a library
/// call on baseline x86-64, and the search below takes about 1 500 levels per block).
#[inline(always)]
fn level(v: f32, m: f32, id: f32) -> f32 {
    const ROUND: f32 = 8_388_608.0;
    (((v - m) * id).clamp(0.0, 15.0) + ROUND) - ROUND
}

/// `1 / d`, or 0 for a step that is not positive.
#[inline(always)]
fn inverse(d: f32) -> f32 {
    if d > 0.0 {
        1.0 / d
    } else {
        0.0
    }
}

/// The squared error of `x` (a block of 32) on the grid `(d, m)`. Summed in 8 lanes, then
/// the lanes, so the loop vectorizes.
fn block_error(x: &[f32], d: f32, m: f32) -> f32 {
    let id = inverse(d);
    let mut lanes = [0f32; 8];
    for c in x.chunks_exact(8) {
        for (l, &v) in lanes.iter_mut().zip(c) {
            let e = v - (d * level(v, m, id) + m);
            *l += e * e;
        }
    }
    lanes.iter().sum()
}

/// `(d, m)` minimising `Σ (x − d·q − m)²` for the levels `q` of `x` (a block of 32) on the
/// grid `(d, m)`; `None` where the levels do not determine a positive step. Sums in 8 lanes.
fn least_squares(x: &[f32], d: f32, m: f32) -> Option<(f32, f32)> {
    let id = inverse(d);
    let (mut sq, mut sqq, mut sx, mut sxq) = ([0f32; 8], [0f32; 8], [0f32; 8], [0f32; 8]);
    for c in x.chunks_exact(8) {
        for (l, &v) in c.iter().enumerate() {
            let q = level(v, m, id);
            sq[l] += q;
            sqq[l] += q * q;
            sx[l] += v;
            sxq[l] += v * q;
        }
    }
    let sum = |a: [f32; 8]| a.iter().sum::<f32>();
    let (sq, sqq, sx, sxq) = (sum(sq), sum(sqq), sum(sx), sum(sxq));
    let n = x.len() as f32;
    let det = n * sqq - sq * sq;
    if det <= 0.0 {
        return None;
    }
    let d = (n * sxq - sq * sx) / det;
    let m = (sx - d * sq) / n;
    (d > 0.0).then_some((d, m))
}

impl PackedQ4 {
    fn empty(rows: usize, cols: usize) -> Result<Self> {
        if !cols.is_multiple_of(BLOCK) || cols == 0 {
            return Err(KernelError::Width {
                width: cols,
                block: BLOCK,
            });
        }
        let blocks = cols / BLOCK;
        let supers = blocks.div_ceil(SUPER_BLOCKS);
        let tiles = rows.div_ceil(Q4_TILE_ROWS);
        let padded = tiles * Q4_TILE_ROWS;
        Ok(Self {
            rows,
            cols,
            blocks,
            supers,
            tiles,
            qs: vec![0; padded * cols / 2],
            sc: vec![0; padded * blocks],
            mn: vec![0; padded * blocks],
            ds: vec![f16::ZERO; padded * supers],
            ms: vec![f16::ZERO; padded * supers],
        })
    }

    /// Quantize the f32 weight `w` (`rows × cols`, row-major, `cols` a multiple of 32).
    pub fn quantize(w: &[f32], rows: usize, cols: usize) -> Result<Self> {
        let mut p = Self::empty(rows, cols)?;
        if w.len() != rows * cols {
            return Err(KernelError::Shape(format!(
                "{} weights for [{rows}, {cols}]",
                w.len()
            )));
        }
        let th = Q4_TILE_ROWS;
        let mut fits = vec![(0f32, 0f32); p.blocks];
        let mut q = [0u8; BLOCK];
        for (r, row) in w.chunks_exact(cols).enumerate() {
            let (t, i) = (r / th, r % th);
            for (fit, x) in fits.iter_mut().zip(row.chunks_exact(BLOCK)) {
                *fit = fit_block(x);
            }
            for (s, supers) in fits.chunks(SUPER_BLOCKS).enumerate() {
                let dmax = supers.iter().fold(0f32, |a, f| a.max(f.0));
                let mmax = supers.iter().fold(0f32, |a, f| a.max(f.1.abs()));
                let (ds, ms) = (f16::from_f32(dmax), f16::from_f32(mmax));
                p.ds[(t * p.supers + s) * th + i] = ds;
                p.ms[(t * p.supers + s) * th + i] = ms;

                for (k, &(d, m)) in supers.iter().enumerate() {
                    let b = s * SUPER_BLOCKS + k;
                    let x = &row[b * BLOCK..][..BLOCK];
                    let (sc, mn) = stored_scales(x, d, m, ds, ms);
                    let at = (t * p.blocks + b) * th + i;
                    p.sc[at] = sc;
                    p.mn[at] = mn;
                    let (d, m) = (step(ds, sc), offset(ms, mn));
                    let id = inverse(d);
                    for (q, &v) in q.iter_mut().zip(x) {
                        *q = level(v, m, id) as u8;
                    }
                    p.set_levels(r, b, &q);
                }
            }
        }
        Ok(p)
    }

    /// Where row `r`'s block `b`'s byte of columns `4k + c` and `4k + 2 + c` is: `base +
    /// 2 · Q4_TILE_ROWS · k + c`.
    #[inline]
    fn base(&self, r: usize, b: usize) -> usize {
        let (t, i) = (r / Q4_TILE_ROWS, r % Q4_TILE_ROWS);
        (t * self.blocks + b) * Q4_TILE_BLOCK_BYTES + 2 * i
    }

    fn set_levels(&mut self, r: usize, b: usize, q: &[u8; BLOCK]) {
        let base = self.base(r, b);
        for k in 0..BLOCK / 4 {
            for c in 0..2 {
                self.qs[base + 2 * Q4_TILE_ROWS * k + c] = q[4 * k + c] | (q[4 * k + 2 + c] << 4);
            }
        }
    }

    /// Row `r`'s block `b`: its 32 levels, its step `d` and its offset `m` (value
    /// `d · q + m`), as the kernels compute them.
    pub(crate) fn block(&self, r: usize, b: usize) -> ([u8; BLOCK], f32, f32) {
        let base = self.base(r, b);
        let mut q = [0u8; BLOCK];
        for k in 0..BLOCK / 4 {
            for c in 0..2 {
                let byte = self.qs[base + 2 * Q4_TILE_ROWS * k + c];
                q[4 * k + c] = byte & 0x0f;
                q[4 * k + 2 + c] = byte >> 4;
            }
        }
        let (t, i) = (r / Q4_TILE_ROWS, r % Q4_TILE_ROWS);
        let at = (t * self.blocks + b) * Q4_TILE_ROWS + i;
        let sup = (t * self.supers + b / SUPER_BLOCKS) * Q4_TILE_ROWS + i;
        let d = step(self.ds[sup], self.sc[at]);
        let m = offset(self.ms[sup], self.mn[at]);
        (q, d, m)
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    pub fn cols(&self) -> usize {
        self.cols
    }

    /// Resident bytes (padding rows of a last partial tile included).
    pub fn bytes(&self) -> usize {
        self.qs.len() + self.sc.len() + self.mn.len() + 2 * (self.ds.len() + self.ms.len())
    }

    /// Bytes of a `rows × cols` weight in this form, without padding rows: 18 per block of
    /// 32, 4 per super-block.
    pub fn bytes_for(rows: usize, cols: usize) -> usize {
        let blocks = cols / BLOCK;
        rows * (blocks * (BLOCK / 2 + 2) + 4 * blocks.div_ceil(SUPER_BLOCKS))
    }

    /// Row `r` dequantized into `out` (`cols` values).
    pub fn dequantize_row(&self, r: usize, out: &mut [f32]) {
        for (b, out) in out.chunks_exact_mut(BLOCK).enumerate() {
            let (q, d, m) = self.block(r, b);
            for (o, &q) in out.iter_mut().zip(&q) {
                *o = d * q as f32 + m;
            }
        }
    }

    /// The whole weight dequantized (`rows × cols`, row-major).
    pub fn dequantize(&self) -> Vec<f32> {
        let mut out = vec![0f32; self.rows * self.cols];
        for (r, row) in out.chunks_exact_mut(self.cols).enumerate() {
            self.dequantize_row(r, row);
        }
        out
    }
}

/// A block's step: its 8-bit `sc` as a fraction of the super-block's largest step `ds`
/// (stored whole, so that it stays a normal f16 however small the weights), `(ds · ¹⁄₂₅₅) · sc`
/// in f32, in that order: the kernels scale `ds` once per super-block and multiply per
/// block (no division on the hot path), and every kernel rounds exactly as this does.
#[inline]
pub(crate) fn step(ds: f16, sc: u8) -> f32 {
    ds.to_f32() * STEP_UNIT * sc as f32
}

/// `1 / 255` and `1 / 127` as f32: the units of the stored 8-bit step and offset.
pub(crate) const STEP_UNIT: f32 = 1.0 / 255.0;
pub(crate) const OFFSET_UNIT: f32 = 1.0 / 127.0;

/// A block's offset: its 8-bit `mn` as a fraction of the super-block's largest |offset|,
/// `(ms · ¹⁄₁₂₇) · mn`, rounded as [`step`] is.
#[inline]
pub(crate) fn offset(ms: f16, mn: i8) -> f32 {
    ms.to_f32() * OFFSET_UNIT * mn as f32
}

/// The 8-bit multiples `(sc, mn)` of the super-block's `ds` and `ms` for a block fitted as
/// `(d, m)`: the nearest ones and their neighbours, the pair with the lowest squared error
/// on the block's values kept.
fn stored_scales(x: &[f32], d: f32, m: f32, ds: f16, ms: f16) -> (u8, i8) {
    let near = |v: f32, s: f16, max: f32| {
        let s = s.to_f32();
        if s > 0.0 {
            (v / s * max).round().clamp(-max, max)
        } else {
            0.0
        }
    };
    let (sc0, mn0) = (near(d, ds, 255.0).max(0.0), near(m, ms, 127.0));
    let mut best = (sc0 as u8, mn0 as i8);
    let mut best_err = f32::INFINITY;
    for dsc in [-1.0f32, 0.0, 1.0] {
        for dmn in [-1.0f32, 0.0, 1.0] {
            let sc = (sc0 + dsc).clamp(0.0, 255.0);
            let mn = (mn0 + dmn).clamp(-127.0, 127.0);
            let (sc, mn) = (sc as u8, mn as i8);
            let err = block_error(x, step(ds, sc), offset(ms, mn));
            if err < best_err {
                (best, best_err) = ((sc, mn), err);
            }
        }
    }
    best
}
