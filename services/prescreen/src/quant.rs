//! Pseudo-quantization (quantize → dequantize) of weight rows for the candidate formats.
//! Weights only: the KL measures what the weight format loses; activation quantization is
//! judged separately from the activation statistics.
//!
//! * `w8a8`: symmetric INT8, one scale for the whole fused group: s = absmax / 127.
//! * `w8a8_per_channel`: symmetric INT8, one scale per output row: s = row absmax / 127.
//! * `w4a16`: exactly what the engine serves the class with, `quantmesh_kernels::PackedQ4`
//!   (16 levels `d·q + m` per block of 32 input weights, `d` and `m` as 8-bit fractions of
//!   f16 values shared by up to 8 blocks), quantized and dequantized by the kernels' own
//!   code. Rows whose width 32 does not divide (the engine cannot serve those in any
//!   quantized form) use asymmetric 4-bit in groups of 128 instead.
//!
//! `w8a8` and `w8a8_per_channel` are pessimistic proxies of the served form: the engine
//! stores both as Q8_0 (a scale per 32 weights), finer than either scale here, so their KL
//! bounds what serving loses from above.

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Format {
    W8a8,
    W8a8PerChannel,
    W4a16,
}

impl Format {
    pub const ALL: [Format; 3] = [Format::W8a8, Format::W8a8PerChannel, Format::W4a16];

    pub fn name(self) -> &'static str {
        match self {
            Format::W8a8 => "w8a8",
            Format::W8a8PerChannel => "w8a8_per_channel",
            Format::W4a16 => "w4a16",
        }
    }
}

/// Group size of the 4-bit format.
pub const W4_GROUP: usize = 128;

fn int8(w: f32, s: f32) -> f32 {
    if s == 0.0 {
        return w;
    }
    (w / s).round().clamp(-127.0, 127.0) * s
}

/// Quantize → dequantize `rows` (row-major, `cols` wide) in place. `tensor_absmax` is the
/// absmax of the whole fused group (for the per-tensor format).
pub fn fake_quant(rows: &mut [f32], cols: usize, format: Format, tensor_absmax: f32) {
    match format {
        Format::W8a8 => {
            let s = tensor_absmax / 127.0;
            rows.iter_mut().for_each(|w| *w = int8(*w, s));
        }
        Format::W8a8PerChannel => {
            for row in rows.chunks_exact_mut(cols) {
                let s = row.iter().fold(0f32, |m, w| m.max(w.abs())) / 127.0;
                row.iter_mut().for_each(|w| *w = int8(*w, s));
            }
        }
        Format::W4a16 => {
            if let Some(q) = four_bit_roundtrip(rows, cols) {
                rows.copy_from_slice(&q);
                return;
            }
            let g = W4_GROUP.min(cols).max(1);
            for row in rows.chunks_exact_mut(cols) {
                for grp in row.chunks_mut(g) {
                    let lo = grp.iter().cloned().fold(f32::INFINITY, f32::min);
                    let hi = grp.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
                    let s = (hi - lo) / 15.0;
                    if s == 0.0 {
                        continue;
                    }
                    let z = (-lo / s).round();
                    grp.iter_mut()
                        .for_each(|w| *w = (((*w / s).round() + z).clamp(0.0, 15.0) - z) * s);
                }
            }
        }
    }
}

/// `rows` through the engine's 4-bit form and back (`None` when 32 does not divide `cols`).
fn four_bit_roundtrip(rows: &[f32], cols: usize) -> Option<Vec<f32>> {
    if cols == 0 || !rows.len().is_multiple_of(cols) {
        return None;
    }
    quantmesh_kernels::PackedQ4::quantize(rows, rows.len() / cols, cols)
        .ok()
        .map(|p| p.dequantize())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn representable_weights_are_unchanged() {
        // Multiples of a power-of-two step with the extreme at ±127 steps: exact in INT8.
        let step = 1.0f32 / 64.0;
        let w: Vec<f32> = (0..256)
            .map(|i| ((i * 37 % 255) as f32 - 127.0) * step)
            .collect();
        let absmax = w.iter().fold(0f32, |m, x| m.max(x.abs()));
        assert_eq!(absmax, 127.0 * step);
        let mut q = w.clone();
        fake_quant(&mut q, 16, Format::W8a8, absmax);
        assert_eq!(q, w);
        // 16 levels per group: exact in 4 bits.
        let w4: Vec<f32> = (0..256).map(|i| (i % 16) as f32 * 0.25 - 2.0).collect();
        let mut q = w4.clone();
        fake_quant(&mut q, 128, Format::W4a16, 2.0);
        assert_eq!(q, w4);
    }

    #[test]
    fn per_channel_beats_per_tensor_with_an_outlier_row() {
        let mut w: Vec<f32> = (0..64).map(|i| (i as f32 * 0.1).sin() * 0.01).collect();
        w[0] = 5.0; // one huge weight in row 0
        let absmax = 5.0;
        let err = |f| {
            let mut q = w.clone();
            fake_quant(&mut q, 16, f, absmax);
            q.iter().zip(&w).map(|(a, b)| (a - b).abs()).sum::<f32>()
        };
        assert!(err(Format::W8a8PerChannel) < err(Format::W8a8));
    }

    /// w4a16 is the served 4-bit form, bit for bit: per block of 32 at most 16 levels, and
    /// the error at most about half a block's step (the range over 15).
    #[test]
    fn w4a16_is_the_served_four_bit_form() {
        let cols = 96;
        let w: Vec<f32> = (0..cols * 4)
            .map(|i| ((i as f32 * 1.37).sin() * 0.05) + if i % 41 == 0 { 0.3 } else { 0.0 })
            .collect();
        let mut q = w.clone();
        fake_quant(&mut q, cols, Format::W4a16, 0.0);
        let served = quantmesh_kernels::PackedQ4::quantize(&w, 4, cols)
            .unwrap()
            .dequantize();
        assert_eq!(q, served);
        for (blk, qb) in w.chunks(32).zip(q.chunks(32)) {
            let mut levels: Vec<u32> = qb.iter().map(|v| v.to_bits()).collect();
            levels.sort_unstable();
            levels.dedup();
            assert!(levels.len() <= 16, "{levels:?}");
            let lo = blk.iter().copied().fold(f32::INFINITY, f32::min);
            let hi = blk.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let worst = blk
                .iter()
                .zip(qb)
                .map(|(a, b)| (a - b).abs())
                .fold(0f32, f32::max);
            assert!(
                worst <= (hi - lo) / 15.0 * 0.75,
                "error {worst} in [{lo}, {hi}]"
            );
        }
        // Widths 32 does not divide keep the group-wise 4-bit form.
        let mut odd = vec![0.5f32, -0.25, 0.125, 1.0, -1.0, 0.0, 0.75];
        fake_quant(&mut odd, 7, Format::W4a16, 0.0);
        assert!(odd.iter().all(|v| v.is_finite()));
    }
}
