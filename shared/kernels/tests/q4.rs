//! The 4-bit product against the scalar reference and the exact product of the dequantized
//! operands, over shapes that are not multiples of the tile, the super-block or the
//! register tile; and the quantization's error against simpler 4-bit grids.
#![allow(clippy::unwrap_used)]

use proptest::prelude::*;
use quantmesh_kernels::{ActBits, Activations, Isa, PackedQ4, Pool, BLOCK, SUPER_BLOCKS};
use rand::{Rng, SeedableRng};

mod common;
use common::{exact, product, rand_vec};

fn check(rows: usize, cols: usize, m: usize, bits: ActBits, seed: u64, threads: usize) {
    // Offsets away from zero in some rows: the blocks' `m` takes both signs.
    let mut wf = rand_vec(rows * cols, seed, 0.1);
    for (r, row) in wf.chunks_exact_mut(cols).enumerate() {
        let shift = (r % 3) as f32 * 0.05 - 0.05;
        row.iter_mut().for_each(|v| *v += shift);
    }
    let w = PackedQ4::quantize(&wf, rows, cols).unwrap();
    let xf = rand_vec(m * cols, seed + 1, 1.0);
    let pool = Pool::new(threads);
    for isa in Isa::all_available() {
        let mut a = Activations::new();
        a.quantize_with(&xf, m, cols, bits, isa).unwrap();
        let (want, mag) = exact(&w, &a);
        let got = product(&w, &a, isa, &pool);
        for (i, (&g, &e)) in got.iter().zip(&want).enumerate() {
            // f32 accumulation of `d · Σ q·a` and `m · Σ a`, each up to ≈ 8× the terms'
            // magnitude when a block's offset cancels most of its levels.
            let tol = 1e-5 * mag[i] + 1e-30;
            assert!(
                (g as f64 - e).abs() <= tol,
                "{isa:?} [{rows}x{cols}] m={m} {bits:?} threads={threads} out {i}: {g} vs {e} (tol {tol})"
            );
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]
    #[test]
    fn simd_equals_the_reference(
        rows in 1usize..40,
        blocks in 1usize..20,
        m in 1usize..40,
        sixteen in any::<bool>(),
        seed in 0u64..1000,
        threads in 1usize..4,
    ) {
        let bits = if sixteen { ActBits::Sixteen } else { ActBits::Eight };
        check(rows, blocks * BLOCK, m, bits, seed, threads);
    }
}

#[test]
fn model_shapes_and_more_rows_than_a_row_block() {
    for &(rows, cols, m) in &[
        (960, 576, 1),
        (576, 1536, 3),
        (200, 576, 67),
        (130, 64, 129),
    ] {
        for bits in [ActBits::Eight, ActBits::Sixteen] {
            check(rows, cols, m, bits, rows as u64, 2);
        }
    }
}

/// Integer levels, activations and unit scales: every kernel gives the reference's
/// integers bit for bit (weights with steps 1 and offsets −8 or 0 per block, so each
/// super-block's largest step and offset store them exactly).
#[test]
fn integer_parts_are_exact() {
    // More than one whole tile of activation rows, and a partial one (AMX's rows and the
    // AVX-512 kernel's).
    let (rows, cols, m) = (13, 11 * BLOCK, 35);
    let mut rng = rand::rngs::StdRng::seed_from_u64(3);
    let wf: Vec<f32> = (0..rows * cols)
        .map(|i| {
            let offset = if (i / BLOCK).is_multiple_of(2) {
                -8.0
            } else {
                0.0
            };
            match i % BLOCK {
                0 => offset,
                1 => offset + 15.0,
                _ => offset + rng.gen_range(0..16) as f32,
            }
        })
        .collect();
    let w = PackedQ4::quantize(&wf, rows, cols).unwrap();
    assert_eq!(w.dequantize(), wf, "integer levels are stored exactly");
    let xf: Vec<f32> = (0..m * cols)
        .map(|i| {
            if i % BLOCK == 0 {
                127.0
            } else {
                rng.gen_range(-127i32..=127) as f32
            }
        })
        .collect();
    let pool = Pool::new(2);
    let mut a = Activations::new();
    a.quantize_with(&xf, m, cols, ActBits::Eight, Isa::Scalar)
        .unwrap();
    let want: Vec<f32> = exact(&w, &a).0.iter().map(|&v| v as f32).collect();
    for isa in Isa::all_available() {
        a.quantize_with(&xf, m, cols, ActBits::Eight, isa).unwrap();
        assert_eq!(product(&w, &a, isa, &pool), want, "{isa:?}");
    }
}

/// AMX computes whole 16-row tiles of activations with tile products and the rest with the
/// AVX-512 kernel; both add each block's integer sum in f32 with the same operations in the
/// same order, so their outputs agree bit for bit (odd tile counts, partial row tiles, both
/// widths, rows past a last whole tile and a lone last tile).
#[test]
fn amx_equals_avx512_bit_for_bit() {
    if !Isa::Amx.available() {
        eprintln!("skipped: this CPU or kernel grants no AMX");
        return;
    }
    let pool = Pool::new(2);
    for &(rows, cols, m) in &[
        (40, 576, 16),
        (24, 9 * BLOCK, 37),
        (130, 256, 48),
        (8, 64, 17),
    ] {
        let w = PackedQ4::quantize(&rand_vec(rows * cols, rows as u64, 0.1), rows, cols).unwrap();
        let xf = rand_vec(m * cols, 7, 1.0);
        for bits in [ActBits::Eight, ActBits::Sixteen] {
            let mut a = Activations::new();
            a.quantize_with(&xf, m, cols, bits, Isa::Amx).unwrap();
            let amx = product(&w, &a, Isa::Amx, &pool);
            let avx512 = product(&w, &a, Isa::Avx512, &pool);
            assert!(
                amx.iter()
                    .zip(&avx512)
                    .all(|(x, y)| x.to_bits() == y.to_bits()),
                "[{rows}x{cols}] m={m} {bits:?}"
            );
        }
    }
}

/// A lone row of 8-bit activations takes the AVX-512 byte kernel (`vpdpbusd` on the levels
/// as bytes); more rows the 16-bit one. Each row's block sums are the same integers either
/// way, added with the same operations, so a row's output is the same bits whether it came
/// alone or inside a larger product (odd tile counts, a lone last tile, a row block's last
/// row).
#[test]
fn the_byte_kernel_equals_the_wide_one_bit_for_bit() {
    if !Isa::Avx512.available() {
        eprintln!("skipped: this CPU has no AVX-512 VNNI");
        return;
    }
    let pool = Pool::new(2);
    for &(rows, cols) in &[(40, 576), (24, 9 * BLOCK), (130, 256), (8, 64), (9, 1536)] {
        let w = PackedQ4::quantize(&rand_vec(rows * cols, rows as u64, 0.1), rows, cols).unwrap();
        let m = 11;
        let xf = rand_vec(m * cols, 9, 1.0);
        let run = |first: usize, count: usize| {
            let mut a = Activations::new();
            let x = &xf[first * cols..(first + count) * cols];
            a.quantize_with(x, count, cols, ActBits::Eight, Isa::Avx512)
                .unwrap();
            product(&w, &a, Isa::Avx512, &pool)
        };
        // 11 rows: a register tile of 8 and one of 3, both on the 16-bit kernel; 9 rows end
        // on a lone row, the byte kernel's.
        let all = run(0, m);
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        for (first, count) in [(0, 1), (5, 1), (10, 1), (3, 2), (2, 9)] {
            assert_eq!(
                bits(&run(first, count)),
                bits(&all[first * rows..(first + count) * rows]),
                "[{rows}x{cols}] rows {first}..{}",
                first + count
            );
        }
    }
}

/// Relative RMS error of `deq` against `w`.
fn rel_err(w: &[f32], deq: &[f32]) -> f64 {
    let (mut e, mut s) = (0f64, 0f64);
    for (&a, &b) in w.iter().zip(deq) {
        e += (a as f64 - b as f64).powi(2);
        s += (a as f64).powi(2);
    }
    (e / s).sqrt()
}

/// Q4_0's grid (llama.cpp's `quantize_row_q4_0_ref`: `d = max / −8`, the value of largest
/// magnitude, levels `q − 8`), dequantized.
fn q4_0(w: &[f32]) -> Vec<f32> {
    w.chunks_exact(BLOCK)
        .flat_map(|x| {
            let max = x
                .iter()
                .fold(0f32, |m, &v| if v.abs() > m.abs() { v } else { m });
            let d = half::f16::from_f32(max / -8.0).to_f32();
            let id = if d != 0.0 { 1.0 / d } else { 0.0 };
            x.iter()
                .map(move |&v| ((v * id + 8.5).floor().clamp(0.0, 15.0) - 8.0) * d)
                .collect::<Vec<_>>()
        })
        .collect()
}

/// The per-block min/max grid with exact f32 scales (Q4_1's, before its f16 rounding).
fn min_max(w: &[f32]) -> Vec<f32> {
    w.chunks_exact(BLOCK)
        .flat_map(|x| {
            let lo = x.iter().copied().fold(f32::INFINITY, f32::min);
            let hi = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let d = (hi - lo) / 15.0;
            x.iter()
                .map(move |&v| {
                    if d > 0.0 {
                        ((v - lo) / d).round() * d + lo
                    } else {
                        lo
                    }
                })
                .collect::<Vec<_>>()
        })
        .collect()
}

/// On weights of several distributions, scales and seeds (Gaussian, heavy-tailed, shifted
/// per row, rows of very different magnitudes inside one super-block's reach), the error is
/// below Q4_0's and at most that of the exact-scale min/max grid.
#[test]
fn quantization_error_is_below_simpler_grids() {
    let (rows, cols) = (24, 9 * BLOCK);
    for seed in 0..6u64 {
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let w: Vec<f32> = (0..rows * cols)
            .map(|i| {
                // Box–Muller: a Gaussian of deviation 0.02.
                let (u, t): (f32, f32) = (rng.gen_range(1e-7..1.0), rng.gen_range(0.0..1.0));
                let v = 0.02 * (-2.0 * u.ln()).sqrt() * (std::f32::consts::TAU * t).cos();
                let block_scale = if (i / BLOCK).is_multiple_of(5) {
                    0.05
                } else {
                    1.0
                };
                match seed % 3 {
                    0 => v,
                    1 => v * v.abs() * 50.0, // heavy tails
                    _ => v * block_scale + (i / cols) as f32 * 0.004, // quiet blocks, shifted rows
                }
            })
            .collect();
        let ours = rel_err(
            &w,
            &PackedQ4::quantize(&w, rows, cols).unwrap().dequantize(),
        );
        let (zero, mm) = (rel_err(&w, &q4_0(&w)), rel_err(&w, &min_max(&w)));
        assert!(ours < zero, "seed {seed}: {ours} vs Q4_0 {zero}");
        assert!(ours <= mm * 1.02, "seed {seed}: {ours} vs min/max {mm}");
    }
}

#[test]
fn bytes_and_bad_shapes() {
    let (rows, cols) = (16, 9 * BLOCK);
    let w = PackedQ4::quantize(&rand_vec(rows * cols, 1, 0.1), rows, cols).unwrap();
    let supers = 9usize.div_ceil(SUPER_BLOCKS);
    assert_eq!(w.bytes(), rows * (9 * 18 + 4 * supers));
    assert_eq!(PackedQ4::bytes_for(rows, cols), w.bytes());
    assert_eq!(
        PackedQ4::bytes_for(1, 256),
        8 * 18 + 4,
        "4.625 bits per weight"
    );
    let padded = PackedQ4::quantize(&rand_vec(3 * cols, 1, 0.1), 3, cols).unwrap();
    assert_eq!(
        padded.bytes(),
        PackedQ4::bytes_for(8, cols),
        "one tile of 8 rows"
    );
    assert!(PackedQ4::quantize(&[0.0; 40], 1, 40).is_err());
    assert!(PackedQ4::quantize(&[0.0; 64], 3, 32).is_err());
    let mut a = Activations::new();
    a.quantize(&[1.0; 64], 1, 64, ActBits::Eight).unwrap();
    let mut out = vec![0.0; rows];
    assert!(w.matmul(&a, &mut out, Isa::Scalar, Pool::global()).is_err());
    // A constant block is its offset.
    let c = PackedQ4::quantize(&[0.25; 64], 2, 32).unwrap();
    assert_eq!(c.dequantize(), vec![0.25; 64]);
}

/// The NEON kernel equals the scalar reference bit for bit on aarch64 (it scales each
/// block's sums in the reference's order), including rows with offsets of both signs and
/// widths that end in a short super-block. Run for aarch64 under qemu-user by the test
/// command; elsewhere it checks that no instruction set claims NEON.
#[test]
fn neon_equals_the_reference_bit_for_bit() {
    if !common::neon_here() {
        return;
    }
    for (i, &(rows, cols, m)) in [
        (960, 576, 1),
        (37, 11 * BLOCK, 7),
        (576, 1536, 3),
        (9, 64, 70),
    ]
    .iter()
    .enumerate()
    {
        let mut wf = rand_vec(rows * cols, 60 + i as u64, 0.1);
        for (r, row) in wf.chunks_exact_mut(cols).enumerate() {
            let shift = (r % 3) as f32 * 0.05 - 0.05;
            row.iter_mut().for_each(|v| *v += shift);
        }
        let w = PackedQ4::quantize(&wf, rows, cols).unwrap();
        common::neon_equals_reference_bitwise(&w, &rand_vec(m * cols, 70 + i as u64, 1.0), m);
    }
}
