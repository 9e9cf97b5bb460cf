//! The 4-bit product: [`PackedQ4`]'s tiles handed out to the pool's threads, each running
//! the AMX kernel for whole 16-row tiles of activations (tiles two at a time), the AVX-512
//! kernel (tiles two at a time), the AVX-VNNI or the AVX2 one where the
//! instruction set includes it (AVX2 with 8-bit activations: its byte kernel), the NEON one on aarch64, else the scalar reference (the
//! weights and their quantization are in `q4.rs`).

use crate::layout::{check_product, Activations, Out};
use crate::pool::Pool;
use crate::q8::SERIAL_BELOW;
#[cfg(target_arch = "x86_64")]
use crate::ActBits;
use crate::{scalar, Isa, PackedQ4, Result};
use std::ops::Range;

impl PackedQ4 {
    /// `out = a · deq(self)ᵀ` (`a.rows() × self.rows()`, row-major), on `pool`'s threads.
    /// AMX runs its own kernel on whole 16-row tiles of activations and the AVX-512 one on
    /// the rest, AVX-512 the AVX-512 kernel, AVX-VNNI, AVX2 and NEON their own; scalar the
    /// reference.
    pub fn matmul(&self, a: &Activations, out: &mut [f32], isa: Isa, pool: &Pool) -> Result<()> {
        check_product(a, self.rows, self.cols, Some(out.len()))?;
        if a.rows == 0 || self.rows == 0 {
            return Ok(());
        }
        let dst = Out(out.as_mut_ptr());
        let isa = if isa.available() { isa } else { Isa::Scalar };
        // Once per quantization, before the threads read them.
        a.block_sums();
        #[cfg(target_arch = "x86_64")]
        if isa == Isa::Avx2 && a.bits == Some(ActBits::Eight) {
            // SAFETY: `isa.available()` checked AVX2; the values are 8-bit.
            unsafe { a.q4_pairs() };
        }
        // The AVX-512 kernel takes tiles two at a time (16 output rows).
        let unit = if matches!(isa, Isa::Avx512 | Isa::Amx) {
            2
        } else {
            1
        };
        let one = |units: Range<usize>| {
            let dst = &dst;
            let tiles = units.start * unit..(units.end * unit).min(self.tiles);
            match isa {
                #[cfg(target_arch = "x86_64")]
                // SAFETY: `isa.available()` checked AMX (granted), AVX-512 F/BW/VNNI and AVX2,
                // FMA, F16C; the activations hold their AMX byte form; each range of tiles
                // (from an even tile) is claimed by one thread, which writes only those
                // tiles' output columns.
                Isa::Amx if a.s8.len() == a.q.len() && a.bytes.is_some() => unsafe {
                    crate::amx::q4_pair_tiles(self, a, tiles, dst.0)
                },
                #[cfg(target_arch = "x86_64")]
                // SAFETY: `isa.available()` checked AVX-512 F/BW/VNNI and AVX2, FMA, F16C;
                // each range of tiles is claimed by one thread, which writes only those
                // tiles' output columns.
                Isa::Avx512 | Isa::Amx => unsafe {
                    crate::avx512::q4_tiles(self, a, tiles, 0..a.rows, dst.0)
                },
                #[cfg(target_arch = "x86_64")]
                // SAFETY: `isa.available()` checked AVX-VNNI and AVX2, FMA, F16C; each range
                // of tiles is claimed by one thread, which writes only those tiles' output
                // columns.
                Isa::AvxVnni => unsafe { crate::x86::q4_tiles_vnni(self, a, tiles, dst.0) },
                #[cfg(target_arch = "x86_64")]
                // SAFETY: `isa.available()` checked AVX2, FMA and F16C; each range of tiles
                // is claimed by one thread, which writes only those tiles' output columns.
                isa if isa.x86_simd() && a.bits == Some(ActBits::Eight) => unsafe {
                    crate::x86::q4_tiles_bytes(self, a, tiles, dst.0)
                },
                #[cfg(target_arch = "x86_64")]
                // SAFETY: as above.
                isa if isa.x86_simd() => unsafe { crate::x86::q4_tiles(self, a, tiles, dst.0) },
                #[cfg(target_arch = "aarch64")]
                // SAFETY: `isa.available()` checked NEON; each range of tiles is claimed by
                // one thread, which writes only those tiles' output columns.
                Isa::Neon => unsafe { crate::neon::q4_tiles(self, a, tiles, dst.0) },
                _ => scalar::q4_tiles(self, a, tiles, dst.0),
            }
        };
        pool.chunks(
            self.tiles.div_ceil(unit),
            self.rows * self.cols * a.rows < SERIAL_BELOW,
            &one,
        );
        Ok(())
    }

    /// As [`PackedQ4::matmul`], into a new vector.
    pub fn matmul_vec(&self, a: &Activations, isa: Isa, pool: &Pool) -> Result<Vec<f32>> {
        let mut out = vec![0f32; a.rows * self.rows];
        self.matmul(a, &mut out, isa, pool)?;
        Ok(out)
    }
}
