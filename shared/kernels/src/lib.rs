//! quantmesh's CPU kernels.
//!
//! One job: multiply activation rows by quantized weights as fast as this CPU allows,
//! reading the weights once per call for all rows.
//!
//! - [`PackedQ8`]: Q8_0 weights (8-bit values, one scale per 32) repacked at load into tiles
//!   of output rows, each tile one contiguous run with its scales, in the order the
//!   instruction set's kernel reads ([`Q8Layout`]: column quads across 16 rows for AMX,
//!   whose tiles take them as they lie, column pairs across 16 rows for AVX-512 VNNI, or
//!   quads when most activations are 8-bit ([`set_packing_width`]), pairs across 8 rows for
//!   AVX2 and NEON), so one pass streams
//!   every weight once whatever the number of rows.
//! - [`PackedQ4`]: 4-bit weights (16 levels `d · q + m` per block of 32, `d` and `m` as
//!   8-bit fractions of f16 values shared by up to 8 blocks), in the AVX2 kernel's
//!   column-pair order, multiplied with the same 8- or 16-bit activations.
//! - [`Activations`]: the rows quantized once per call, per block of 32, to 8 bits (W8A8,
//!   llama.cpp's Q8_0 activations) or to 16 bits (W8A16: the weights' error alone). Both
//!   are stored as `i16`, so one AVX2 kernel serves both at one cost; for AVX-512 VNNI's
//!   quad order they are also split into bytes for `vpdpbusd` (one pass for 8 bits, two for
//!   16), and with AMX into the signed bytes of its tiles.
//! - [`f16_matmul`]: the float path's product over f16 weights, widened in registers.
//! - [`hadamard_blocks`]: block rotations of activation and weight rows (`H_b / √b`), which
//!   keep a product exact and spread an outlier channel over its block before quantization.
//! - [`swiglu`]: `silu(gate) · up` over the rows of a fused gate/up product.
//! - [`rms_norm`], [`rope`]: the step's per-row operations, one pass each on plain slices.
//! - [`attention`]: causal attention of a chunk's query rows over a sequence's keys and
//!   values, every (row, head) pair a work item on the pool.
//! - [`Isa`]: the instruction set the kernels run with, detected at run time
//!   (`QUANTMESH_KERNEL=scalar|avx2|avxvnni|avx512|amx|neon` forces one; the scalar path is the reference every
//!   SIMD kernel is tested against).
//! - [`ColumnError`]: what a quantization does to each input column, and the output
//!   noise-to-signal ratio that gives one input row (the monitor's harm statistic).
//! - [`probe_row`]: the monitor's one pass over an input row (sum, largest magnitude, the
//!   harm ratio's sums), vectorized; the same bits under every instruction set.
//! - [`Pool`]: one persistent pool of workers for the forward pass: a job's work in
//!   contiguous chunks the threads claim in order, the caller never waiting for a worker
//!   that has not started.

#![allow(unsafe_code)] // SIMD intrinsics and the pool's scoped jobs; each `unsafe` says why.

#[cfg(target_arch = "x86_64")]
mod amx;
mod attention;
#[cfg(target_arch = "x86_64")]
mod avx512;
mod column_error;
mod error;
mod f16;
mod hadamard;
mod isa;
mod layout;
#[cfg(target_arch = "aarch64")]
mod neon;
mod pool;
mod q4;
mod q4_product;
mod q8;
mod row_probe;
mod rows;
mod scalar;
mod swiglu;
#[cfg(target_arch = "x86_64")]
mod x86;

pub use attention::{
    attention, attention_over, exp_nonpositive, AttentionShape, Contiguous, KvElem, KvRun, KvSource,
};
pub use column_error::{ColumnError, ColumnErrorSum};
pub use error::{KernelError, Result};
pub use f16::f16_matmul;
pub use hadamard::{hadamard_blocks, rotation_block};
pub use isa::Isa;
pub use layout::{ActBits, Activations, PackedQ8, Q8Layout, BLOCK, TILE_ROWS};
pub use pool::Pool;
pub use q4::{PackedQ4, SUPER_BLOCKS};
pub use q8::{packing_width, set_packing_width};
pub use row_probe::{abs_max, probe_row, RowProbe};
pub use rows::{dequantize_i8, rms_norm, rope, softmax_weights};
pub use swiglu::swiglu;
