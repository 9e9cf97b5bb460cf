//! Dual-precision linear groups: an INT8 form and an exact float form, either or both
//! resident, chosen per step and per row.
//!
//! Quantized ("INT8") form: candle's Q8_0 quantized matmul (blocks of 32 weights sharing one
//! scale; the activations are quantized to Q8_0 blocks on the fly, so this is W8A8 with
//! per-block scales, finer than per-channel), or for `w4a16` groups 4-bit weights (Q4_K, or
//! Q4_0 where 256 does not divide the input width; candle still quantizes activations to 8
//! bits, so it computes W4A8). Chosen over a hand-written per-channel W8A8 kernel
//! because it is measured at 0.08–0.28× the time of the f32 matmul on this CPU
//! (AVX-512 VNNI) and is maintained upstream; see ARCHITECTURE.md.
//!
//! Float form: the checkpoint's values (never dequantized INT8), stored in the engine's
//! `float_dtype` (f16 by default: half the bytes of f32; as fast at batch 1, 2–4× slower at
//! batch 8–32 on the CPU backend, measured by `quantmesh-engine-bench --float-dtypes`); the
//! float path casts its input rows to that dtype, multiplies, and casts the output back.

use crate::backend::{FloatDtype, GroupForm, GroupOutcome, QuantFormat, RowPath};
use crate::error::Result;
use candle_core::quantized::{QMatMul, QTensor};
use candle_core::{DType, Module, Tensor};
use quantmesh_types::Residency;

/// `x · wᵀ` in `w`'s dtype, f32 in and out.
fn float_matmul(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    Ok(if w.dtype() == DType::F32 {
        x.matmul(&w.t()?)?
    } else {
        x.to_dtype(w.dtype())?
            .matmul(&w.t()?)?
            .to_dtype(DType::F32)?
    })
}

pub struct DualLinear {
    int8: Option<QMatMul>,
    /// How `int8` stores its weights.
    quant: QuantFormat,
    float: Option<Tensor>,
    bias: Option<Tensor>,
    out_dim: usize,
    in_dim: usize,
}

impl DualLinear {
    /// Build from the f32 weight `[out, in]` (and optional bias `[out]`) with the given
    /// residency (Q8_0 quantized form); the float copy (when the residency has one) is
    /// stored as `float_dtype`.
    pub fn new(
        weight: Tensor,
        bias: Option<Tensor>,
        residency: Residency,
        float_dtype: FloatDtype,
    ) -> Result<Self> {
        Self::with_form(weight, bias, GroupForm::q8(residency), float_dtype)
    }

    /// As [`DualLinear::new`], the quantized form stored as `form.quant` says.
    pub fn with_form(
        weight: Tensor,
        bias: Option<Tensor>,
        form: GroupForm,
        float_dtype: FloatDtype,
    ) -> Result<Self> {
        let residency = form.residency;
        let (out_dim, in_dim) = weight.dims2()?;
        let int8 = if residency.has_int8() {
            Some(QMatMul::from_qtensor(QTensor::quantize(
                &weight,
                form.quant.ggml(),
            )?)?)
        } else {
            None
        };
        let float = if residency.has_float() {
            Some(weight.to_dtype(float_dtype.dtype())?)
        } else {
            None
        };
        Ok(Self {
            int8,
            quant: form.quant,
            float,
            bias,
            out_dim,
            in_dim,
        })
    }

    pub fn residency(&self) -> Residency {
        match (self.int8.is_some(), self.float.is_some()) {
            (true, true) => Residency::Dual,
            (true, false) => Residency::Int8,
            _ => Residency::Float,
        }
    }

    pub fn quant_format(&self) -> QuantFormat {
        self.quant
    }

    pub fn out_dim(&self) -> usize {
        self.out_dim
    }

    pub fn in_dim(&self) -> usize {
        self.in_dim
    }

    /// Bytes of resident weights (quantized form at its format's bytes per 32 weights).
    pub fn resident_bytes(&self) -> usize {
        let (q, f, b) = self.bytes_by_form();
        q + f + b
    }

    /// (quantized form, float copy, bias) bytes.
    pub fn bytes_by_form(&self) -> (usize, usize, usize) {
        let n = self.out_dim * self.in_dim;
        let q = if self.int8.is_some() {
            self.quant.bytes(n)
        } else {
            0
        };
        let f = self
            .float
            .as_ref()
            .map_or(0, |w| n * w.dtype().size_in_bytes());
        let b = self.bias.as_ref().map_or(0, |b| b.elem_count() * 4);
        (q, f, b)
    }

    fn float_mm(&self, x: &Tensor) -> Result<Option<Tensor>> {
        self.float.as_ref().map(|w| float_matmul(x, w)).transpose()
    }

    fn int8_mm(&self, x: &Tensor) -> Result<Option<Tensor>> {
        match &self.int8 {
            Some(q) => Ok(Some(q.forward(x)?)),
            None => Ok(None),
        }
    }

    /// The preferred path, falling back to whichever form is resident.
    fn whole(&self, x: &Tensor, want_float: bool) -> Result<Tensor> {
        let first = if want_float {
            self.float_mm(x)?
        } else {
            self.int8_mm(x)?
        };
        match first {
            Some(y) => Ok(y),
            None => {
                let other = if want_float {
                    self.int8_mm(x)?
                } else {
                    self.float_mm(x)?
                };
                other.ok_or_else(|| {
                    candle_core::Error::Msg("linear group has no resident weights".into()).into()
                })
            }
        }
    }

    /// `x` is `[rows, in]`; returns `[rows, out]`.
    pub fn forward(&self, x: &Tensor, path: &RowPath) -> Result<(Tensor, GroupOutcome)> {
        let rows = x.dim(0)?;
        let has_float = self.float.is_some();
        let has_int8 = self.int8.is_some();
        let mut outcome = GroupOutcome::default();
        let y = match path {
            RowPath::AllInt8 => {
                if has_int8 {
                    outcome.int8_rows = rows
                } else {
                    outcome.float_rows = rows
                }
                self.whole(x, false)?
            }
            RowPath::AllFloat => {
                if has_float {
                    outcome.float_rows = rows;
                } else {
                    outcome.int8_rows = rows;
                    outcome.fallback_unavailable_rows = rows;
                }
                self.whole(x, true)?
            }
            RowPath::Reference => return self.forward(x, &RowPath::AllFloat),
            RowPath::FloatRows(float_rows) if float_rows.is_empty() => {
                return self.forward(x, &RowPath::AllInt8);
            }
            RowPath::FloatRows(float_rows) if float_rows.len() == rows => {
                return self.forward(x, &RowPath::AllFloat);
            }
            RowPath::FloatRows(float_rows) => {
                if !(has_float && has_int8) {
                    // Only one form resident: every row takes it.
                    let forced_float = has_float;
                    outcome.float_rows = if forced_float { rows } else { 0 };
                    outcome.int8_rows = rows - outcome.float_rows;
                    if !has_float {
                        outcome.fallback_unavailable_rows = float_rows.len();
                    }
                    self.whole(x, forced_float)?
                } else {
                    outcome.float_rows = float_rows.len();
                    outcome.int8_rows = rows - float_rows.len();
                    self.split_rows(x, float_rows)?
                }
            }
        };
        let y = match &self.bias {
            Some(b) => y.broadcast_add(b)?,
            None => y,
        };
        Ok((y, outcome))
    }

    /// Every row through `weight` (the group's exact float weight `[out, in]`, from the
    /// shadow reference; stored in any float dtype), plus the bias: the float path of a
    /// group that holds no float copy.
    pub fn forward_with(&self, x: &Tensor, weight: &Tensor) -> Result<(Tensor, GroupOutcome)> {
        let y = float_matmul(x, weight)?;
        let y = match &self.bias {
            Some(b) => y.broadcast_add(b)?,
            None => y,
        };
        let outcome = GroupOutcome {
            float_rows: x.dim(0)?,
            ..Default::default()
        };
        Ok((y, outcome))
    }

    /// Rows in `float_rows` through the float form, the rest through INT8, merged back
    /// into the original row order.
    fn split_rows(&self, x: &Tensor, float_rows: &[usize]) -> Result<Tensor> {
        let rows = x.dim(0)?;
        let mut is_float = vec![false; rows];
        for &r in float_rows {
            is_float[r] = true;
        }
        let int_rows: Vec<u32> = (0..rows as u32)
            .filter(|&r| !is_float[r as usize])
            .collect();
        let flt_rows: Vec<u32> = float_rows.iter().map(|&r| r as u32).collect();
        let dev = x.device();
        let xi = x.index_select(&Tensor::new(int_rows.as_slice(), dev)?, 0)?;
        let xf = x.index_select(&Tensor::new(flt_rows.as_slice(), dev)?, 0)?;
        let yi = self.whole(&xi, false)?;
        let yf = self.whole(&xf, true)?;
        let stacked = Tensor::cat(&[&yi, &yf], 0)?;
        // position of original row r inside `stacked`
        let mut inverse = vec![0u32; rows];
        for (i, &r) in int_rows.iter().enumerate() {
            inverse[r as usize] = i as u32;
        }
        for (i, &r) in flt_rows.iter().enumerate() {
            inverse[r as usize] = (int_rows.len() + i) as u32;
        }
        Ok(stacked.index_select(&Tensor::new(inverse.as_slice(), dev)?, 0)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device};

    fn rand(rows: usize, cols: usize, seed: u64) -> Tensor {
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let v: Vec<f32> = (0..rows * cols).map(|_| rng.gen_range(-1.0..1.0)).collect();
        Tensor::from_vec(v, (rows, cols), &Device::Cpu).unwrap()
    }

    #[test]
    fn row_mask_gives_exactly_float_or_int8_per_row() {
        let w = rand(64, 128, 1);
        let x = rand(9, 128, 2);
        let lin = DualLinear::new(
            w,
            Some(rand(1, 64, 3).squeeze(0).unwrap()),
            Residency::Dual,
            FloatDtype::F32,
        )
        .unwrap();
        let (all_f, _) = lin.forward(&x, &RowPath::AllFloat).unwrap();
        let (all_i, _) = lin.forward(&x, &RowPath::AllInt8).unwrap();
        let float_rows = vec![0, 3, 8];
        let (mixed, outcome) = lin
            .forward(&x, &RowPath::FloatRows(float_rows.clone()))
            .unwrap();
        assert_eq!(outcome.float_rows, 3);
        assert_eq!(outcome.int8_rows, 6);
        // Compare row by row against the row computed on its own path.
        for r in 0..9 {
            let want = if float_rows.contains(&r) {
                &all_f
            } else {
                &all_i
            };
            let a = mixed.get(r).unwrap().to_vec1::<f32>().unwrap();
            let b = want.get(r).unwrap().to_vec1::<f32>().unwrap();
            for (p, q) in a.iter().zip(&b) {
                assert!(
                    (p - q).abs() <= 1e-5 * (1.0 + q.abs()),
                    "row {r}: {p} vs {q}"
                );
            }
        }
        // and the two paths really differ (quantization error is not zero)
        let diff = (all_f - all_i)
            .unwrap()
            .abs()
            .unwrap()
            .max_all()
            .unwrap()
            .to_scalar::<f32>()
            .unwrap();
        assert!(diff > 0.0);
    }

    #[test]
    fn int8_only_group_reports_unavailable_fallback() {
        let lin = DualLinear::new(rand(32, 64, 4), None, Residency::Int8, FloatDtype::F32).unwrap();
        let x = rand(4, 64, 5);
        let (_, o) = lin.forward(&x, &RowPath::AllFloat).unwrap();
        assert_eq!(o.fallback_unavailable_rows, 4);
        let (_, o) = lin.forward(&x, &RowPath::FloatRows(vec![1])).unwrap();
        assert_eq!(o.fallback_unavailable_rows, 1);
        assert_eq!(lin.residency(), Residency::Int8);
    }

    #[test]
    fn float_only_group_is_exact() {
        let w = rand(32, 64, 6);
        let x = rand(3, 64, 7);
        let lin = DualLinear::new(w.clone(), None, Residency::Float, FloatDtype::F32).unwrap();
        let (y, _) = lin.forward(&x, &RowPath::AllInt8).unwrap();
        let want = x.matmul(&w.t().unwrap()).unwrap();
        let d = (y - want)
            .unwrap()
            .abs()
            .unwrap()
            .max_all()
            .unwrap()
            .to_dtype(DType::F32)
            .unwrap()
            .to_scalar::<f32>()
            .unwrap();
        assert_eq!(d, 0.0);
    }

    /// `w4a16` groups are served in 4 bits: Q4_0 bytes, an error above Q8_0's and still
    /// small, and the float copy (when dual) untouched.
    #[test]
    fn q4_0_form_is_four_bit_and_keeps_the_float_copy_exact() {
        let w = rand(64, 128, 8);
        let x = rand(5, 128, 9);
        let want = x.matmul(&w.t().unwrap()).unwrap();
        let err = |y: &Tensor| {
            let d = (y - &want).unwrap().sqr().unwrap().sum_all().unwrap();
            let n = want.sqr().unwrap().sum_all().unwrap();
            (d.to_scalar::<f32>().unwrap() / n.to_scalar::<f32>().unwrap()).sqrt()
        };
        let form = |quant| GroupForm {
            residency: Residency::Dual,
            quant,
        };
        let q8 = DualLinear::with_form(w.clone(), None, form(QuantFormat::Q8_0), FloatDtype::F32)
            .unwrap();
        let q4 = DualLinear::with_form(w.clone(), None, form(QuantFormat::Q4_0), FloatDtype::F32)
            .unwrap();
        assert_eq!(q4.quant_format(), QuantFormat::Q4_0);
        assert_eq!(q4.bytes_by_form().0, 64 * 128 / 32 * 18);
        assert_eq!(q8.bytes_by_form().0, 64 * 128 / 32 * 34);
        let (e8, e4) = (
            err(&q8.forward(&x, &RowPath::AllInt8).unwrap().0),
            err(&q4.forward(&x, &RowPath::AllInt8).unwrap().0),
        );
        assert!(e8 < e4 && e4 < 0.2, "Q8_0 {e8}, Q4_0 {e4}");
        assert!(err(&q4.forward(&x, &RowPath::AllFloat).unwrap().0) < 1e-6);
        // 256-wide inputs take Q4_K: the same bytes per weight, super-blocks of 256.
        let w = rand(64, 256, 10);
        assert_eq!(
            QuantFormat::for_class(quantmesh_types::PrecisionClass::W4a16, 256),
            QuantFormat::Q4K
        );
        let k = DualLinear::with_form(w, None, form(QuantFormat::Q4K), FloatDtype::F32).unwrap();
        assert_eq!(k.bytes_by_form().0, 64 * 256 / 256 * 144);
        assert_eq!(k.bytes_by_form().0, QuantFormat::Q4_0.bytes(64 * 256));
    }
}
