//! The Q8_0 product: activations quantized once per call with this CPU's kernel, and the
//! weights' row tiles handed out to the pool's threads, each running the best kernel the
//! instruction set and the weights' layout allow (layouts in `layout.rs`).

use crate::layout::{check_product, quantize_act_block, Out};
use crate::pool::Pool;
use crate::{scalar, ActBits, Activations, Isa, KernelError, PackedQ8, Q8Layout, Result, BLOCK};
use std::ops::Range;
use std::sync::atomic::{AtomicBool, Ordering};

/// Products with fewer multiply-adds than this run on the caller alone (not worth waking a
/// second thread for).
pub(crate) const SERIAL_BELOW: usize = 64 * 1024;

/// Whether weights packed from now on are ordered for 8-bit activations
/// ([`set_packing_width`]).
static PACK_FOR_EIGHT_BITS: AtomicBool = AtomicBool::new(false);

/// The activation width most of this process's Q8_0 products will run at: weights packed
/// after this call ([`PackedQ8::quantize`], [`PackedQ8::from_q8_0`]) are in the order
/// [`Q8Layout::for_width`] gives for it. A speed hint only: every kernel reads every order,
/// so products of either width stay correct on weights packed for the other (16-bit
/// activations on weights ordered for 8-bit ones cost about the same from 4 rows up and
/// 1.03–1.15× at one row, as measured in `docs/design/kernels.md`). The default is 16 bits.
pub fn set_packing_width(bits: ActBits) {
    PACK_FOR_EIGHT_BITS.store(bits == ActBits::Eight, Ordering::Relaxed);
}

/// The width [`set_packing_width`] last set (16 bits before any call).
pub fn packing_width() -> ActBits {
    if PACK_FOR_EIGHT_BITS.load(Ordering::Relaxed) {
        ActBits::Eight
    } else {
        ActBits::Sixteen
    }
}

impl Q8Layout {
    /// The order `isa`'s Q8_0 kernel reads (the scalar reference reads every order).
    pub fn for_isa(isa: Isa) -> Self {
        match isa {
            Isa::Avx2 | Isa::AvxVnni | Isa::Neon => Q8Layout::PairColumns,
            Isa::Avx512 => Q8Layout::WidePairColumns,
            Isa::Amx => Q8Layout::WideQuadColumns,
            Isa::Scalar => Q8Layout::RowTiles,
        }
    }

    /// The order `isa`'s fastest kernel for activations of `bits` reads: under AVX-512 the
    /// quad order for 8-bit ones (`vpdpbusd`, 64 multiply-adds per instruction, where the
    /// pair order's `vpdpwssd` makes 32 whatever the width), else [`Q8Layout::for_isa`]
    /// (AMX reads the quad order at both widths: its tiles take it as it lies).
    pub fn for_width(isa: Isa, bits: ActBits) -> Self {
        match (isa, bits) {
            (Isa::Avx512, ActBits::Eight) => Q8Layout::WideQuadColumns,
            _ => Q8Layout::for_isa(isa),
        }
    }
}

impl PackedQ8 {
    /// Quantize the f32 weight `w` (`rows × cols`, row-major) to Q8_0, in the order this
    /// thread's kernel reads for the [`packing_width`] ([`Isa::current`]).
    pub fn quantize(w: &[f32], rows: usize, cols: usize) -> Result<Self> {
        let layout = Q8Layout::for_width(Isa::current(), packing_width());
        Self::quantize_in(w, rows, cols, layout)
    }

    /// From Q8_0 blocks as GGUF stores them (per block: f16 scale, 32 signed bytes; rows
    /// one after another), in the order this thread's kernel reads for the
    /// [`packing_width`] ([`Isa::current`]).
    pub fn from_q8_0(data: &[u8], rows: usize, cols: usize) -> Result<Self> {
        let layout = Q8Layout::for_width(Isa::current(), packing_width());
        Self::from_q8_0_in(data, rows, cols, layout)
    }

    /// `out = a · deq(self)ᵀ` (`a.rows() × self.rows()`, row-major), on `pool`'s threads,
    /// each taking contiguous chunks of tiles from one counter.
    pub fn matmul(&self, a: &Activations, out: &mut [f32], isa: Isa, pool: &Pool) -> Result<()> {
        check_product(a, self.rows, self.cols, Some(out.len()))?;
        // SAFETY: `out` holds exactly `a.rows × self.rows` values.
        unsafe { self.matmul_to(a, out.as_mut_ptr(), isa, pool) };
        Ok(())
    }

    /// As [`PackedQ8::matmul`], into a new vector (never zeroed first: the kernels write
    /// every output).
    pub fn matmul_vec(&self, a: &Activations, isa: Isa, pool: &Pool) -> Result<Vec<f32>> {
        check_product(a, self.rows, self.cols, None)?;
        let len = a.rows * self.rows;
        let mut out = Vec::with_capacity(len);
        // SAFETY: the capacity holds `len` values; every kernel writes each output (row `m`
        // < `a.rows`, column < `self.rows`) exactly once before `matmul_to` returns, and a
        // panic in a kernel unwinds before the length is set.
        unsafe {
            self.matmul_to(a, out.as_mut_ptr(), isa, pool);
            out.set_len(len);
        }
        Ok(out)
    }

    /// The product into `out`, which has room for `a.rows × self.rows` values.
    unsafe fn matmul_to(&self, a: &Activations, out: *mut f32, isa: Isa, pool: &Pool) {
        if a.rows == 0 || self.rows == 0 {
            return;
        }
        let dst = Out(out);
        let isa = if isa.available() { isa } else { Isa::Scalar };
        // Each kernel reads one layout. Weights packed for another instruction set than the
        // caller's (a test's `Isa::scoped` around a model loaded outside it) run on the
        // kernel for their order where the caller's set includes it (the AVX2 one under
        // AVX-512 or AMX), else on the scalar reference, which reads every order.
        // The quad order's kernel takes the activations as bytes: made once, here, before
        // the threads start.
        #[cfg_attr(not(target_arch = "x86_64"), allow(unused_variables))]
        let quads = match (isa, self.layout) {
            (Isa::Avx512 | Isa::Amx, Q8Layout::WideQuadColumns) => a.byte_form(),
            _ => (&[][..], &[][..], false),
        };
        let one = |tiles: Range<usize>| {
            // SAFETY: every unit of tiles is claimed by exactly one thread, which writes
            // only the output columns of those tiles.
            let dst = &dst;
            match (isa, self.layout) {
                #[cfg(target_arch = "x86_64")]
                // SAFETY: `isa.available()` checked AVX-512 F/BW/VNNI and AVX2, FMA, F16C;
                // the activations hold their byte form.
                (Isa::Avx512 | Isa::Amx, Q8Layout::RowTiles) if a.bytes.is_some() => unsafe {
                    crate::avx512::q8_tiles(self, a, tiles, 0..a.rows, dst.0)
                },
                #[cfg(target_arch = "x86_64")]
                // SAFETY: `isa.available()` checked AVX-512 F/BW/VNNI and AVX2, FMA, F16C.
                (Isa::Avx512 | Isa::Amx, Q8Layout::WidePairColumns) => unsafe {
                    crate::avx512::q8_pair_tiles(self, a, tiles, dst.0)
                },
                #[cfg(target_arch = "x86_64")]
                // SAFETY: `isa.available()` checked AMX (granted), AVX-512 F/BW/VNNI and
                // AVX2, FMA, F16C; the activations hold their AMX byte form, and `quads` is
                // their byte form.
                (Isa::Amx, Q8Layout::WideQuadColumns)
                    if a.s8.len() == a.q.len() && a.bytes.is_some() =>
                unsafe { crate::amx::q8_quad_tiles(self, a, quads, tiles, dst.0) },
                #[cfg(target_arch = "x86_64")]
                // SAFETY: `isa.available()` checked AVX-512 F/BW/VNNI and AVX2, FMA, F16C;
                // `quads` is the activations' byte form.
                (Isa::Avx512 | Isa::Amx, Q8Layout::WideQuadColumns) => unsafe {
                    crate::avx512::q8_quad_tiles(self, a, quads, tiles, 0..a.rows, dst.0)
                },
                #[cfg(target_arch = "x86_64")]
                // SAFETY: `isa.available()` checked AVX-VNNI and AVX2, FMA, F16C.
                (Isa::AvxVnni, Q8Layout::PairColumns) => unsafe {
                    crate::x86::q8_tiles_vnni(self, a, tiles, dst.0)
                },
                #[cfg(target_arch = "x86_64")]
                // SAFETY: `isa.available()` checked AVX2, FMA and F16C (AVX-512 implies them).
                (isa, Q8Layout::PairColumns) if isa.x86_simd() => unsafe {
                    crate::x86::q8_tiles(self, a, tiles, dst.0)
                },
                #[cfg(target_arch = "aarch64")]
                // SAFETY: `isa.available()` checked NEON.
                (Isa::Neon, Q8Layout::PairColumns) => unsafe {
                    crate::neon::q8_tiles(self, a, tiles, dst.0)
                },
                _ => scalar::q8_tiles(self, a, tiles, dst.0),
            }
        };
        pool.chunks(
            self.tiles,
            self.rows * self.cols * a.rows < SERIAL_BELOW,
            &one,
        );
    }
}

/// One thread's share of [`Activations::quantize_with`]: whole rows of the input, their
/// values and scales, and their byte forms (empty where not made).
struct Share<'a> {
    x: &'a [f32],
    q: &'a mut [i16],
    d: &'a mut [f32],
    hi: &'a mut [u8],
    lo: &'a mut [u8],
    s8: &'a mut [i8],
}

impl Activations {
    /// Quantize `x` (`rows × cols`, row-major) to `bits`, per block of 32: scale
    /// `amax / max` (`max` = 127 or 32767), values `round(x / scale)` (ties to even), with
    /// this thread's kernel ([`Isa::current`]).
    pub fn quantize(&mut self, x: &[f32], rows: usize, cols: usize, bits: ActBits) -> Result<()> {
        self.quantize_with(x, rows, cols, bits, Isa::current())
    }

    /// As [`Activations::quantize`], with `isa`'s kernel (every one gives the same values).
    pub fn quantize_with(
        &mut self,
        x: &[f32],
        rows: usize,
        cols: usize,
        bits: ActBits,
        isa: Isa,
    ) -> Result<()> {
        if !cols.is_multiple_of(BLOCK) || cols == 0 {
            return Err(KernelError::Width {
                width: cols,
                block: BLOCK,
            });
        }
        if x.len() != rows * cols {
            return Err(KernelError::Shape(format!(
                "{} activations for [{rows}, {cols}]",
                x.len()
            )));
        }
        self.rows = rows;
        self.cols = cols;
        self.blocks = cols / BLOCK;
        self.q.resize(rows * cols, 0);
        self.d.resize(rows * self.blocks, 0.0);
        let max = bits.max();
        let sixteen = bits == ActBits::Sixteen;
        // The byte forms the kernels read (filled with the values, share by share):
        // `vpdpbusd`'s unsigned bytes (`hi`, and `lo` for 16-bit values) where the kernels
        // take bytes, and AMX's signed high bytes (`s8`).
        let bytes = isa.byte_activations() && isa.available();
        let amx = bytes && isa == Isa::Amx;
        let n = rows * cols;
        self.hi.resize(if bytes { n } else { 0 }, 0);
        self.lo.resize(if bytes && sixteen { n } else { 0 }, 0);
        self.s8.resize(if amx { n } else { 0 }, 0);
        let quantize_share = |share: &mut Share<'_>| {
            let blocks = share
                .x
                .chunks_exact(BLOCK)
                .zip(share.q.chunks_exact_mut(BLOCK))
                .zip(share.d.iter_mut());
            match isa {
                #[cfg(target_arch = "x86_64")]
                isa if isa.x86_simd() && isa.available() => {
                    for ((x, q), d) in blocks {
                        // SAFETY: AVX2, FMA and F16C are available; blocks are 32 long.
                        *d = unsafe { crate::x86::quantize_act_block(x, q, max) };
                    }
                }
                _ => {
                    for ((x, q), d) in blocks {
                        *d = quantize_act_block(x, q, max);
                    }
                }
            }
            crate::layout::fill_byte_slices(share.q, sixteen, share.hi, share.lo, share.s8);
        };
        // A batch's rows are quantized on the pool, a share of whole rows per thread (each
        // block on its own, so the values do not depend on the split); a few rows are not
        // worth waking the workers for.
        let pool = crate::Pool::global();
        let per = pool.rows_per_share(rows, n);
        let mut shares = Vec::with_capacity(rows.div_ceil(per));
        let (mut x, mut q, mut d) = (x, &mut self.q[..], &mut self.d[..]);
        let (mut hi, mut lo, mut s8) = (&mut self.hi[..], &mut self.lo[..], &mut self.s8[..]);
        while !x.is_empty() {
            let r = per.min(x.len() / cols);
            // A byte form that is not made stays empty in every share.
            let take = |made: bool| if made { r * cols } else { 0 };
            let (x0, x1) = x.split_at(r * cols);
            let (q0, q1) = std::mem::take(&mut q).split_at_mut(r * cols);
            let (d0, d1) = std::mem::take(&mut d).split_at_mut(r * self.blocks);
            let (h0, h1) = std::mem::take(&mut hi).split_at_mut(take(bytes));
            let (l0, l1) = std::mem::take(&mut lo).split_at_mut(take(bytes && sixteen));
            let (s0, s1) = std::mem::take(&mut s8).split_at_mut(take(amx));
            shares.push(Share {
                x: x0,
                q: q0,
                d: d0,
                hi: h0,
                lo: l0,
                s8: s0,
            });
            (x, q, d, hi, lo, s8) = (x1, q1, d1, h1, l1, s1);
        }
        pool.for_each_mut(&mut shares, quantize_share);
        drop(shares);
        self.sums.take();
        self.lazy_bytes.take();
        self.q4_pairs.take();
        self.bits = Some(bits);
        self.bytes = bytes.then_some(bits);
        Ok(())
    }
}
