//! Every SIMD kernel against the scalar reference, over shapes that are not multiples of
//! the tile or the register tile, odd row counts, both activation widths, and one thread or
//! several.
#![allow(clippy::unwrap_used)]

use proptest::prelude::*;
use quantmesh_kernels::{ActBits, Activations, Isa, PackedQ8, Pool, Q8Layout, BLOCK};
use rand::{Rng, SeedableRng};

mod common;
use common::{exact, product, rand_vec};

const LAYOUTS: [Q8Layout; 4] = [
    Q8Layout::RowTiles,
    Q8Layout::PairColumns,
    Q8Layout::WidePairColumns,
    Q8Layout::WideQuadColumns,
];

/// Every instruction set on the weights in every layout: its own, and the others (a model
/// loaded outside a test's `Isa::scoped`), which a kernel for them or the scalar reference
/// reads.
fn runs() -> Vec<(Isa, Q8Layout)> {
    Isa::all_available()
        .into_iter()
        .flat_map(|isa| LAYOUTS.map(|layout| (isa, layout)))
        .collect()
}

fn check(rows: usize, cols: usize, m: usize, bits: ActBits, seed: u64, threads: usize) {
    let wf = rand_vec(rows * cols, seed, 0.1);
    let w = PackedQ8::quantize_in(&wf, rows, cols, Q8Layout::RowTiles).unwrap();
    let xf = rand_vec(m * cols, seed + 1, 1.0);
    let pool = Pool::new(threads);
    let (want, mag) = {
        let mut a = Activations::new();
        a.quantize_with(&xf, m, cols, bits, Isa::Scalar).unwrap();
        exact(&w, &a)
    };
    for (isa, layout) in runs() {
        let w = PackedQ8::quantize_in(&wf, rows, cols, layout).unwrap();
        let mut a = Activations::new();
        a.quantize_with(&xf, m, cols, bits, isa).unwrap();
        let got = product(&w, &a, isa, &pool);
        for (i, (&g, &e)) in got.iter().zip(&want).enumerate() {
            // f32 accumulation over `cols` terms: a few ulps of the terms' magnitude.
            let tol = 1e-6 * mag[i] + 1e-30;
            assert!(
                (g as f64 - e).abs() <= tol,
                "{isa:?} {layout:?} [{rows}x{cols}] m={m} {bits:?} threads={threads} out {i}: {g} vs {e} (tol {tol})"
            );
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]
    #[test]
    fn simd_equals_the_reference(
        rows in 1usize..40,
        blocks in 1usize..12,
        m in 1usize..11,
        sixteen in any::<bool>(),
        seed in 0u64..1000,
        threads in 1usize..4,
    ) {
        let bits = if sixteen { ActBits::Sixteen } else { ActBits::Eight };
        check(rows, blocks * BLOCK, m, bits, seed, threads);
    }

    /// Shapes with whole 16 × 16 tiles and leftovers on both sides (the AMX kernel's, where
    /// this CPU has it: it takes the whole tiles, the AVX-512 kernel the rest).
    #[test]
    fn simd_equals_the_reference_past_whole_tiles(
        rows in 16usize..90,
        blocks in 1usize..6,
        m in 16usize..52,
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
        (3072, 576, 67),
        (130, 64, 129),
    ] {
        for bits in [ActBits::Eight, ActBits::Sixteen] {
            check(rows, cols, m, bits, rows as u64, 2);
        }
    }
}

/// Integer-valued operands with unit scales make every partial sum exact in f32, so every
/// kernel must give the reference's integers bit for bit.
#[test]
fn integer_parts_are_exact() {
    for (rows, cols, m) in [(13, 7 * BLOCK, 5), (70, 3 * BLOCK, 37)] {
        integer_parts_are_exact_for(rows, cols, m);
    }
}

fn integer_parts_are_exact_for(rows: usize, cols: usize, m: usize) {
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    let mut int_vec = |n: usize| -> Vec<f32> {
        (0..n)
            .map(|i| {
                if i % BLOCK == 0 {
                    127.0 // every block's amax is 127: scale exactly 1
                } else {
                    rng.gen_range(-127i32..=127) as f32
                }
            })
            .collect()
    };
    let (wf, xf) = (int_vec(rows * cols), int_vec(m * cols));
    let w = PackedQ8::quantize_in(&wf, rows, cols, Q8Layout::RowTiles).unwrap();
    let mut a = Activations::new();
    a.quantize_with(&xf, m, cols, ActBits::Eight, Isa::Scalar)
        .unwrap();
    let pool = Pool::new(2);
    let reference = product(&w, &a, Isa::Scalar, &pool);
    let want: Vec<f32> = exact(&w, &a).0.iter().map(|&v| v as f32).collect();
    assert_eq!(reference, want);
    for (isa, layout) in runs() {
        let w = PackedQ8::quantize_in(&wf, rows, cols, layout).unwrap();
        a.quantize_with(&xf, m, cols, ActBits::Eight, isa).unwrap();
        assert_eq!(
            product(&w, &a, isa, &pool),
            want,
            "{isa:?} {layout:?} [{rows}x{cols}] m={m}"
        );
    }
}

/// Both layouts hold the same weights, and each instruction set packs in its kernel's.
#[test]
fn both_layouts_hold_the_same_weights() {
    let (rows, cols) = (21, 5 * BLOCK);
    let wf = rand_vec(rows * cols, 5, 0.1);
    let tiles = PackedQ8::quantize_in(&wf, rows, cols, Q8Layout::RowTiles).unwrap();
    assert_eq!(tiles.bytes(), 24 * 5 * 34, "tiles of 4 rows");
    for (layout, padded) in [
        (Q8Layout::PairColumns, 24),
        (Q8Layout::WidePairColumns, 32),
        (Q8Layout::WideQuadColumns, 32),
    ] {
        let pairs = PackedQ8::quantize_in(&wf, rows, cols, layout).unwrap();
        assert_eq!(pairs.layout(), layout);
        assert_eq!(tiles.dequantize(), pairs.dequantize(), "{layout:?}");
        assert_eq!(pairs.bytes(), padded * 5 * 34, "{layout:?}");
    }
    for isa in Isa::all_available() {
        let packed = isa.scoped(|| PackedQ8::quantize(&wf, rows, cols).unwrap());
        assert_eq!(packed.layout(), Q8Layout::for_isa(isa), "{isa:?}");
        // Packed for 8-bit activations: the order of that width's fastest kernel. (The
        // only test that sets the packing width, and it sets it back.)
        quantmesh_kernels::set_packing_width(ActBits::Eight);
        let packed = isa.scoped(|| PackedQ8::quantize(&wf, rows, cols).unwrap());
        quantmesh_kernels::set_packing_width(ActBits::Sixteen);
        assert_eq!(
            packed.layout(),
            Q8Layout::for_width(isa, ActBits::Eight),
            "{isa:?}"
        );
    }
    assert_eq!(quantmesh_kernels::packing_width(), ActBits::Sixteen);
    for isa in Isa::ALL {
        assert_eq!(
            Q8Layout::for_width(isa, ActBits::Sixteen),
            Q8Layout::for_isa(isa)
        );
        let eight = Q8Layout::for_width(isa, ActBits::Eight);
        match isa {
            Isa::Avx512 | Isa::Amx => assert_eq!(eight, Q8Layout::WideQuadColumns),
            _ => assert_eq!(eight, Q8Layout::for_isa(isa), "{isa:?}"),
        }
    }
    assert_eq!(Q8Layout::for_isa(Isa::Avx2), Q8Layout::PairColumns);
    assert_eq!(Q8Layout::for_isa(Isa::AvxVnni), Q8Layout::PairColumns);
    assert_eq!(Q8Layout::for_isa(Isa::Avx512), Q8Layout::WidePairColumns);
    assert_eq!(Q8Layout::for_isa(Isa::Amx), Q8Layout::WideQuadColumns);
    assert_eq!(Q8Layout::for_isa(Isa::Scalar), Q8Layout::RowTiles);
    assert_eq!(Q8Layout::for_isa(Isa::Neon), Q8Layout::PairColumns);
}

/// The NEON kernel scales each block's integer sums as the scalar reference does (separate
/// multiplies and adds, in its order): on aarch64 it equals the reference bit for bit, on
/// random operands of model and odd shapes, both widths, one thread and several. (The
/// test command runs the kernel tests for aarch64 under qemu-user; elsewhere NEON is not
/// available and this checks that no instruction set claims it.)
#[test]
fn neon_equals_the_reference_bit_for_bit() {
    if !common::neon_here() {
        return;
    }
    for (i, &(rows, cols, m)) in [
        (960, 576, 1),
        (37, 5 * BLOCK, 7),
        (576, 1536, 3),
        (9, 64, 70),
    ]
    .iter()
    .enumerate()
    {
        let wf = rand_vec(rows * cols, 40 + i as u64, 0.1);
        let w = PackedQ8::quantize_in(&wf, rows, cols, Q8Layout::PairColumns).unwrap();
        common::neon_equals_reference_bitwise(&w, &rand_vec(m * cols, 50 + i as u64, 1.0), m);
    }
}

/// 16-bit activations leave the weights' error alone: against the product with the f32
/// activations, W8A16 is ≥ 50× closer than W8A8.
#[test]
fn sixteen_bit_activations_remove_the_activation_error() {
    let (rows, cols, m) = (64, 576, 4);
    let x = rand_vec(m * cols, 3, 1.0);
    let w = PackedQ8::quantize(&rand_vec(rows * cols, 4, 0.1), rows, cols).unwrap();
    let wd = w.dequantize();
    let pool = Pool::new(2);
    let mut want = vec![0f64; m * rows];
    for i in 0..m {
        for r in 0..rows {
            want[i * rows + r] = (0..cols)
                .map(|k| x[i * cols + k] as f64 * wd[r * cols + k] as f64)
                .sum();
        }
    }
    let err = |bits| {
        let mut a = Activations::new();
        a.quantize(&x, m, cols, bits).unwrap();
        let y = product(&w, &a, Isa::detect(), &pool);
        let (mut e, mut s) = (0f64, 0f64);
        for (y, w) in y.iter().zip(&want) {
            e += (*y as f64 - w).powi(2);
            s += w * w;
        }
        (e / s).sqrt()
    };
    let (e8, e16) = (err(ActBits::Eight), err(ActBits::Sixteen));
    assert!(e8 > 1e-3, "W8A8 error {e8}");
    assert!(e16 * 50.0 < e8, "W8A16 {e16} vs W8A8 {e8}");
}

/// GGUF's Q8_0 blocks load to the same values `quantize` makes, and a weight already on
/// the Q8_0 grid quantizes to itself.
#[test]
fn q8_0_blocks_round_trip() {
    let (rows, cols) = (6, 96);
    let w = PackedQ8::quantize(&rand_vec(rows * cols, 9, 1.0), rows, cols).unwrap();
    let deq = w.dequantize();
    let again = PackedQ8::quantize(&deq, rows, cols).unwrap();
    assert_eq!(again.dequantize(), deq);
    let mut gguf = Vec::new();
    for r in 0..rows {
        for b in 0..cols / BLOCK {
            let block = &deq[r * cols + b * BLOCK..][..BLOCK];
            let amax = block.iter().fold(0f32, |m, v| m.max(v.abs()));
            let d = half::f16::from_f32(amax / 127.0);
            gguf.extend_from_slice(&d.to_le_bytes());
            for v in block {
                gguf.push(((v / d.to_f32()).round() as i8) as u8);
            }
        }
    }
    let loaded = PackedQ8::from_q8_0(&gguf, rows, cols).unwrap();
    assert_eq!(loaded.dequantize(), deq);
    let loaded = PackedQ8::from_q8_0_in(&gguf, rows, cols, Q8Layout::RowTiles).unwrap();
    assert_eq!(
        loaded.bytes(),
        8 * cols / BLOCK * 34,
        "two padding rows in the last tile"
    );
    for layout in LAYOUTS {
        let loaded = PackedQ8::from_q8_0_in(&gguf, rows, cols, layout).unwrap();
        assert_eq!(loaded.dequantize(), deq, "{layout:?}");
        assert_eq!(loaded.layout(), layout);
    }
    assert!(PackedQ8::from_q8_0(&gguf[1..], rows, cols).is_err());
    assert!(PackedQ8::quantize(&[0.0; 40], 1, 40).is_err());
}

/// Every instruction set quantizes activations to the same values (rounding ties to even),
/// at both widths.
#[test]
fn activation_quantization_is_the_same_everywhere() {
    let mut x = rand_vec(5 * 96, 11, 3.0);
    x[7] = 0.0; // a tie: 2.5 steps of a block whose amax is 127 steps
    x[0..32].fill(0.0); // an all-zero block
    x[40] = 127.0;
    x[41] = 2.5;
    for bits in [ActBits::Eight, ActBits::Sixteen] {
        let mut want = Activations::new();
        want.quantize_with(&x, 5, 96, bits, Isa::Scalar).unwrap();
        for isa in Isa::all_available() {
            let mut got = Activations::new();
            got.quantize_with(&x, 5, 96, bits, isa).unwrap();
            assert_eq!(got.dequantize(), want.dequantize(), "{isa:?} {bits:?}");
        }
    }
}

/// A batch large enough to be quantized on the pool's threads (several rows per thread, an
/// odd count) gives each row the values it gets quantized alone, on every instruction set.
#[test]
fn a_batch_quantized_on_the_pool_equals_its_rows_alone() {
    let (rows, cols) = (37, 576);
    let x = rand_vec(rows * cols, 5, 4.0);
    for bits in [ActBits::Eight, ActBits::Sixteen] {
        for isa in Isa::all_available() {
            let mut batch = Activations::new();
            batch.quantize_with(&x, rows, cols, bits, isa).unwrap();
            let got = batch.dequantize();
            for (r, row) in x.chunks_exact(cols).enumerate() {
                let mut one = Activations::new();
                one.quantize_with(row, 1, cols, bits, isa).unwrap();
                assert_eq!(
                    &got[r * cols..(r + 1) * cols],
                    &one.dequantize()[..],
                    "{isa:?} {bits:?} row {r}"
                );
            }
        }
    }
}

#[test]
fn bad_shapes_are_errors() {
    let w = PackedQ8::quantize(&[0.5; 64], 2, 32).unwrap();
    let mut a = Activations::new();
    a.quantize(&[1.0; 64], 1, 64, ActBits::Eight).unwrap();
    let mut out = vec![0.0; 2];
    assert!(w.matmul(&a, &mut out, Isa::Scalar, Pool::global()).is_err());
    a.quantize(&[1.0; 32], 1, 32, ActBits::Eight).unwrap();
    assert!(w
        .matmul(&a, &mut out[..1], Isa::Scalar, Pool::global())
        .is_err());
    w.matmul(&a, &mut out, Isa::Scalar, Pool::global()).unwrap();
    assert!((out[0] - 16.0).abs() < 0.1);
}
