//! The data the kernels read: Q8_0 weights in row tiles, activation rows quantized per
//! block, the f16 product's operands, and the output the threads share. The products
//! themselves (which kernel runs, on which threads) are in `q8.rs` and `f16.rs`.
//!
//! [`PackedQ8`] (`rows × cols` weights, `cols` a multiple of [`BLOCK`]) cuts the rows into
//! tiles and keeps each tile's weights in one contiguous run, so a call streams each weight
//! once from memory however many activation rows it has (the kernel keeps the tile in L1
//! while it walks the rows). Inside a tile the order is the one its kernel reads without
//! shuffling ([`Q8Layout`]):
//! - [`Q8Layout::RowTiles`] (the scalar reference): tiles of [`TILE_ROWS`] rows, the
//!   32-value blocks of the tile's rows interleaved (`[tile][block][row in tile][32]`); a
//!   row's block is one run of 32 bytes (AVX-512's `vpdpbusd` also reads this order, for
//!   weights packed so and run on a machine with it).
//! - [`Q8Layout::PairColumns`] (AVX2, NEON) and [`Q8Layout::WidePairColumns`] (AVX-512
//!   VNNI): tiles of 8 or 16 rows, each block stored by pairs of columns
//!   (`[tile][block][pair][row in tile][2]`): one 16- or 32-byte load widened to 16 bits is
//!   the pair for all the tile's rows, and `vpmaddwd` / `vpdpwssd` (NEON: `smlal` and one
//!   pairwise add per block) against an activation pair broadcast to every lane leaves each
//!   row's partial sum in its own lane, for 8- and 16-bit activations at one cost.
//! - [`Q8Layout::WideQuadColumns`] (AVX-512 VNNI serving 8-bit activations, and AMX at
//!   either width: a block of a tile is exactly an AMX weight tile): tiles of 16
//!   rows, each block stored by quads of columns (`[tile][block][quad][row in tile][4]`):
//!   one 64-byte load is the quad for all 16 rows, one 32-bit lane per row, and
//!   `vpdpbusd` against the activation row's quad as bytes, broadcast to every lane, adds
//!   four products into each row's lane: half the instructions of the pair order for 8-bit
//!   activations (16-bit ones take their high and low bytes in two passes).
//!
//! The f16 scales are kept in the tiles' order (`[tile][block][row in tile]`). The bytes are
//! Q8_0's own (34 per 32 weights); a row count the tile height does not divide is padded
//! with zero rows that are never written out.

use crate::{KernelError, Result};
use half::f16;

/// Values per quantization block (Q8_0's).
pub const BLOCK: usize = 32;
/// Output rows per tile of [`Q8Layout::RowTiles`].
pub const TILE_ROWS: usize = 4;
/// Output rows per tile of [`Q8Layout::PairColumns`].
pub(crate) const PAIR_TILE_ROWS: usize = 8;
/// Output rows per tile of [`Q8Layout::WidePairColumns`] and [`Q8Layout::WideQuadColumns`].
pub(crate) const WIDE_PAIR_TILE_ROWS: usize = 16;
/// Activation rows a thread walks per pass over its tiles (they stay in L2 meanwhile).
pub(crate) const ROW_BLOCK: usize = 64;

/// The order of a [`PackedQ8`]'s weights inside a tile: the one its kernel reads without
/// shuffling (see the module's notes).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Q8Layout {
    /// `[tile of 4 rows][block][row][32]`: the scalar reference's order.
    RowTiles,
    /// `[tile of 8 rows][block][column pair][row][2]`: the AVX2 kernel's order.
    PairColumns,
    /// `[tile of 16 rows][block][column pair][row][2]`: the AVX-512 kernel's order.
    WidePairColumns,
    /// `[tile of 16 rows][block][column quad][row][4]`: the AVX-512 kernel's order for
    /// 8-bit activations (`vpdpbusd`), and the AMX kernel's (its weight tiles' own order).
    WideQuadColumns,
}

impl Q8Layout {
    /// Output rows per tile.
    pub fn tile_rows(self) -> usize {
        match self {
            Q8Layout::RowTiles => TILE_ROWS,
            Q8Layout::PairColumns => PAIR_TILE_ROWS,
            Q8Layout::WidePairColumns | Q8Layout::WideQuadColumns => WIDE_PAIR_TILE_ROWS,
        }
    }

    /// Consecutive columns of one row stored side by side inside a block (RowTiles: the
    /// whole block of 32).
    fn group(self) -> usize {
        match self {
            Q8Layout::RowTiles => BLOCK,
            Q8Layout::PairColumns | Q8Layout::WidePairColumns => 2,
            Q8Layout::WideQuadColumns => 4,
        }
    }
}

/// Q8_0 weights repacked for the kernels.
#[derive(Clone)]
pub struct PackedQ8 {
    pub(crate) rows: usize,
    pub(crate) cols: usize,
    pub(crate) blocks: usize,
    pub(crate) layout: Q8Layout,
    /// Tiles of `layout.tile_rows()` rows.
    pub(crate) tiles: usize,
    /// `[tile][block][…]` in the layout's order.
    pub(crate) qs: Vec<i8>,
    /// `[tile][block][row in tile]`.
    pub(crate) d: Vec<f16>,
}

impl std::fmt::Debug for PackedQ8 {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "PackedQ8[{}, {}]", self.rows, self.cols)
    }
}

/// Q8_0's rounding of one block (llama.cpp's `quantize_row_q8_0_ref`): scale
/// `amax / 127` stored as f16, values `round(x / scale)` (ties away from zero).
fn quantize_block(x: &[f32], q: &mut [i8]) -> f16 {
    let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
    let d = amax / 127.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    for (q, &v) in q.iter_mut().zip(x) {
        *q = (v * id).round().clamp(-127.0, 127.0) as i8;
    }
    f16::from_f32(d)
}

impl PackedQ8 {
    pub(crate) fn empty(rows: usize, cols: usize, layout: Q8Layout) -> Result<Self> {
        if !cols.is_multiple_of(BLOCK) || cols == 0 {
            return Err(KernelError::Width {
                width: cols,
                block: BLOCK,
            });
        }
        let blocks = cols / BLOCK;
        let tile_rows = layout.tile_rows();
        let tiles = rows.div_ceil(tile_rows);
        Ok(Self {
            rows,
            cols,
            blocks,
            layout,
            tiles,
            qs: vec![0; tiles * tile_rows * cols],
            d: vec![f16::ZERO; tiles * tile_rows * blocks],
        })
    }

    /// Where row `r`'s block `b` lives: (offset of its first value in `qs`, the distance
    /// between its groups of [`Q8Layout::group`] values, offset of its scale in `d`). Value
    /// `j` of the block is at `first + (j / g) · stride + j % g`.
    #[inline]
    fn at(&self, r: usize, b: usize) -> (usize, usize, usize) {
        let th = self.layout.tile_rows();
        let g = self.layout.group();
        let (t, i) = (r / th, r % th);
        let first_row = (t * self.blocks + b) * th;
        (first_row * BLOCK + g * i, g * th, first_row + i)
    }

    /// Row `r`'s block `b`: its 32 values and its scale.
    pub(crate) fn block(&self, r: usize, b: usize) -> ([i8; BLOCK], f16) {
        let (first, stride, s) = self.at(r, b);
        let g = self.layout.group();
        let mut q = [0i8; BLOCK];
        for (p, group) in q.chunks_exact_mut(g).enumerate() {
            group.copy_from_slice(&self.qs[first + p * stride..][..g]);
        }
        (q, self.d[s])
    }

    fn set_block(&mut self, r: usize, b: usize, q: &[i8], d: f16) {
        let (first, stride, s) = self.at(r, b);
        let g = self.layout.group();
        for (p, group) in q.chunks_exact(g).enumerate() {
            self.qs[first + p * stride..][..g].copy_from_slice(group);
        }
        self.d[s] = d;
    }

    /// Quantize the f32 weight `w` (`rows × cols`, row-major) to Q8_0, in `layout`
    /// ([`PackedQ8::quantize`]: in the order this thread's kernel reads).
    pub fn quantize_in(w: &[f32], rows: usize, cols: usize, layout: Q8Layout) -> Result<Self> {
        let mut p = Self::empty(rows, cols, layout)?;
        if w.len() != rows * cols {
            return Err(KernelError::Shape(format!(
                "{} weights for [{rows}, {cols}]",
                w.len()
            )));
        }
        let mut q = [0i8; BLOCK];
        for (r, row) in w.chunks_exact(cols).enumerate() {
            for (b, x) in row.chunks_exact(BLOCK).enumerate() {
                let d = quantize_block(x, &mut q);
                p.set_block(r, b, &q, d);
            }
        }
        Ok(p)
    }

    /// From Q8_0 blocks as GGUF stores them (per block: f16 scale, 32 signed bytes; rows
    /// one after another), in `layout` ([`PackedQ8::from_q8_0`]: in the order this thread's
    /// kernel reads).
    pub fn from_q8_0_in(data: &[u8], rows: usize, cols: usize, layout: Q8Layout) -> Result<Self> {
        let mut p = Self::empty(rows, cols, layout)?;
        if data.len() != rows * p.blocks * (BLOCK + 2) {
            return Err(KernelError::Shape(format!(
                "{} bytes of Q8_0 for [{rows}, {cols}]",
                data.len()
            )));
        }
        let mut q = [0i8; BLOCK];
        for (i, block) in data.chunks_exact(BLOCK + 2).enumerate() {
            for (dst, &src) in q.iter_mut().zip(&block[2..]) {
                *dst = src as i8;
            }
            let d = f16::from_le_bytes([block[0], block[1]]);
            p.set_block(i / p.blocks, i % p.blocks, &q, d);
        }
        Ok(p)
    }

    /// The order of the weights (which kernels read them without a repack).
    pub fn layout(&self) -> Q8Layout {
        self.layout
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    pub fn cols(&self) -> usize {
        self.cols
    }

    /// Resident bytes: Q8_0's 34 per 32 weights (padding rows of a last partial tile
    /// included).
    pub fn bytes(&self) -> usize {
        self.qs.len() + 2 * self.d.len()
    }

    /// Row `r` dequantized into `out` (`cols` values).
    pub fn dequantize_row(&self, r: usize, out: &mut [f32]) {
        for b in 0..self.blocks {
            let (q, d) = self.block(r, b);
            let d = d.to_f32();
            for (o, &v) in out[b * BLOCK..(b + 1) * BLOCK].iter_mut().zip(&q) {
                *o = d * v as f32;
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

/// Whether activations `a` fit weights of `rows × cols` and an output of `out` values
/// (`None`: not checked, the caller allocates it).
pub(crate) fn check_product(
    a: &Activations,
    rows: usize,
    cols: usize,
    out: Option<usize>,
) -> Result<()> {
    if a.cols != cols {
        return Err(KernelError::Shape(format!(
            "activations of width {} for weights [{rows}, {cols}]",
            a.cols
        )));
    }
    match out {
        Some(len) if len != a.rows * rows => Err(KernelError::Shape(format!(
            "output of {len} values for [{}, {rows}]",
            a.rows
        ))),
        _ => Ok(()),
    }
}

/// The output pointer the threads share (each writes disjoint elements).
pub(crate) struct Out(pub(crate) *mut f32);
// SAFETY: threads write disjoint elements, and `matmul` outlives them (`Pool::run` waits).
unsafe impl Sync for Out {}
unsafe impl Send for Out {}

/// How many bits the activations are quantized to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ActBits {
    /// Q8_0 activations (`amax / 127` per block): W8A8, llama.cpp's product.
    Eight,
    /// `amax / 32767` per block: W8A16, the activations' rounding ≈ 2⁻¹⁶ of the block's
    /// largest value, so the product carries the weights' quantization error alone.
    Sixteen,
}

impl ActBits {
    pub(crate) fn max(self) -> f32 {
        match self {
            ActBits::Eight => 127.0,
            ActBits::Sixteen => 32767.0,
        }
    }
}

/// Activation rows quantized per block of 32, values stored as `i16` whatever the bits (the
/// AVX2, AVX-512 and scalar kernels widen the weights to 16 bits and multiply pairs), one
/// f32 scale per block. Quantized for [`crate::Isa::Amx`], they also hold the values as
/// bytes for `vpdpbusd` (the `bytes`, `hi` and `lo` fields) and as the signed bytes of the
/// AMX tiles (`s8`). Reused across calls: quantizing into it allocates only when it grows.
#[derive(Debug, Clone, Default)]
pub struct Activations {
    pub(crate) rows: usize,
    pub(crate) cols: usize,
    pub(crate) blocks: usize,
    /// `[row][cols]`.
    pub(crate) q: Vec<i16>,
    /// `[row][block]`.
    pub(crate) d: Vec<f32>,
    /// `[row][block]`: the block's sum, `d · Σ q` (what a weight block's offset multiplies:
    /// the 4-bit weights' `m`), computed by the first 4-bit product that reads them
    /// ([`Activations::block_sums`]), once per quantization; 8-bit products never pay for it.
    pub(crate) sums: std::sync::OnceLock<Vec<f32>>,
    /// The byte form, when quantized for [`crate::Isa::Amx`]: `Some(bits)`.
    pub(crate) bytes: Option<ActBits>,
    /// `[row][cols]`: `h + 128` as an unsigned byte, `h` the value (8-bit) or its high
    /// byte `v >> 8` (16-bit). `vpdpbusd` multiplies unsigned by signed bytes; the kernel
    /// takes the bias back off with the weights' own sums.
    pub(crate) hi: Vec<u8>,
    /// `[row][cols]`: the low byte `v & 0xff` (16-bit only), unsigned.
    pub(crate) lo: Vec<u8>,
    /// `[row][cols]`, for [`crate::Isa::Amx`] only (else empty): `h` itself, signed (`hi` without
    /// its bias).
    pub(crate) s8: Vec<i8>,
    /// The width quantized to (`None` before the first quantization).
    pub(crate) bits: Option<ActBits>,
    /// The byte form made on demand, once per quantization, for a product whose weights are
    /// in [`Q8Layout::WideQuadColumns`] when the activations were not quantized with it.
    pub(crate) lazy_bytes: std::sync::OnceLock<ByteForm>,
    /// `[row][8 values][64]`: 8-bit values as the AVX2 4-bit byte kernel multiplies them
    /// (each row's byte pairs repeated across a register's lanes), made by the first such
    /// product after a quantization (`Activations::q4_pairs`, in `x86.rs`).
    pub(crate) q4_pairs: std::sync::OnceLock<Vec<u8>>,
}

/// Activation values as `vpdpbusd` takes them (the `hi` and `lo` fields of
/// [`Activations`]).
#[derive(Debug, Clone, Default)]
pub(crate) struct ByteForm {
    pub(crate) hi: Vec<u8>,
    pub(crate) lo: Vec<u8>,
}

impl ByteForm {
    fn of(q: &[i16], bits: ActBits) -> Self {
        let mut f = Self::default();
        Self::fill(q, bits, &mut f.hi, &mut f.lo);
        f
    }

    /// `hi` and `lo` for the values `q` (reusing their allocations).
    fn fill(q: &[i16], bits: ActBits, hi: &mut Vec<u8>, lo: &mut Vec<u8>) {
        let sixteen = bits == ActBits::Sixteen;
        hi.resize(q.len(), 0);
        lo.resize(if sixteen { q.len() } else { 0 }, 0);
        fill_byte_slices(q, sixteen, hi, lo, &mut []);
    }
}

/// The byte forms of the values `q`, each written where its slice is not empty (then as long
/// as `q`): `hi` the unsigned high bytes biased by 128 (the value itself for 8-bit values),
/// `lo` the low bytes (16-bit values), `s8` the signed high bytes (AMX's tiles).
pub(crate) fn fill_byte_slices(
    q: &[i16],
    sixteen: bool,
    hi: &mut [u8],
    lo: &mut [u8],
    s8: &mut [i8],
) {
    let high = |v: i16| if sixteen { v >> 8 } else { v };
    for (h, &v) in hi.iter_mut().zip(q) {
        *h = (high(v) + 128) as u8;
    }
    for (l, &v) in lo.iter_mut().zip(q) {
        *l = v as u8;
    }
    for (s, &v) in s8.iter_mut().zip(q) {
        *s = high(v) as i8;
    }
}

impl Activations {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    pub fn cols(&self) -> usize {
        self.cols
    }

    /// The byte form (`hi`, `lo`) and whether the values are 16-bit: the one filled at
    /// quantization where there is one, else made now (once per quantization).
    pub(crate) fn byte_form(&self) -> (&[u8], &[u8], bool) {
        let bits = self.bits.unwrap_or(ActBits::Eight);
        let sixteen = bits == ActBits::Sixteen;
        if self.bytes.is_some() {
            return (&self.hi, &self.lo, sixteen);
        }
        let f = self.lazy_bytes.get_or_init(|| ByteForm::of(&self.q, bits));
        (&f.hi, &f.lo, sixteen)
    }

    /// Every block's sum `d · Σ q` (`[row][block]`), computed on the first call after a
    /// quantization.
    pub(crate) fn block_sums(&self) -> &[f32] {
        self.sums.get_or_init(|| {
            self.q
                .chunks_exact(BLOCK)
                .zip(&self.d)
                .map(|(q, &d)| d * q.iter().map(|&v| i32::from(v)).sum::<i32>() as f32)
                .collect()
        })
    }

    /// The quantized rows as f32 (`rows × cols`).
    pub fn dequantize(&self) -> Vec<f32> {
        self.q
            .chunks_exact(BLOCK)
            .zip(&self.d)
            .flat_map(|(q, &d)| q.iter().map(move |&v| d * v as f32))
            .collect()
    }
}

/// One activation block quantized: scale `amax / max`, values `round(x / scale)` (ties to
/// even); the reference the SIMD quantizers match.
pub(crate) fn quantize_act_block(x: &[f32], q: &mut [i16], max: f32) -> f32 {
    let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
    let d = amax / max;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    for (q, &v) in q.iter_mut().zip(x) {
        *q = (v * id).round_ties_even().clamp(-max, max) as i16;
    }
    d
}

/// One call's operands, as the per-ISA loops see them.
pub(crate) struct F16Product<'a> {
    pub(crate) w: &'a [f16],
    pub(crate) rows: usize,
    pub(crate) cols: usize,
    pub(crate) x: &'a [f32],
    pub(crate) m: usize,
}
