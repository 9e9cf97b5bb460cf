//! Pseudo-quantization (quantize → dequantize) of weight rows for the candidate formats.
//! Weights only: the KL measures what the weight format loses; activation quantization is
//! judged separately from the activation statistics.
//!
//! * `w8a8`: symmetric INT8, one scale for the whole fused group: s = absmax / 127.
//! * `w8a8_per_channel`: symmetric INT8, one scale per output row: s = row absmax / 127.
//! * `w4a16`: asymmetric 4-bit in groups of 128 input weights along each row (the whole
//!   row when it is shorter): s = (max − min) / 15, zero point z = round(−min / s),
//!   q = clamp(round(w / s) + z, 0, 15), w' = (q − z)·s.

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
}
