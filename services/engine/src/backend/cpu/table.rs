//! The vocabulary tables: the token embedding (row lookups) and the output projection
//! (`lm_head`, a matmul), stored in f32, f16, 8 bits (Q8_0: blocks of 32 values with one
//! f16 scale, as llama.cpp stores them) or 4 bits (`q4_s8`, the form of 4-bit groups, which a
//! weight budget picks when the bytes serve the linear groups better). A tied model keeps
//! one copy for both uses; quantized, the lookup decodes the rows it needs straight from the
//! blocks the matmul reads, and the projection can split its activations like a linear
//! group (under every `engine.split_activations` but `off`), so the logits carry only the table's weight
//! error.

use crate::backend::cpu::linear::{float_matmul, q4_product, q8_product, with_f32_rows};
use crate::backend::EmbeddingDtype;
use crate::error::{EngineError, Result};
use candle_core::{DType, Device, Tensor};
use quantmesh_kernels::{ActBits, PackedQ4, PackedQ8};

pub enum Table {
    Float(Tensor),
    /// On the linear groups' Q8_0 kernel; lookups dequantize rows from the same tiles.
    Q8(PackedQ8),
    /// On the 4-bit groups' kernel, the same way.
    Q4(PackedQ4),
}

impl Table {
    /// `w` is the f32 table `[rows, cols]`. Q8_0 and `q4_s8` need `cols` to be a multiple of
    /// 32; other widths keep f16.
    pub fn new(w: &Tensor, dtype: EmbeddingDtype) -> Result<Self> {
        let (rows, cols) = w.dims2()?;
        Ok(match dtype {
            EmbeddingDtype::Q8_0 if cols % 32 == 0 => {
                with_f32_rows(w, |w| Ok(Table::Q8(PackedQ8::quantize(w, rows, cols)?)))?
            }
            EmbeddingDtype::Q4S8 if cols % 32 == 0 => {
                with_f32_rows(w, |w| Ok(Table::Q4(PackedQ4::quantize(w, rows, cols)?)))?
            }
            EmbeddingDtype::Q8_0 | EmbeddingDtype::Q4S8 | EmbeddingDtype::F16 => {
                Table::Float(w.to_dtype(DType::F16)?)
            }
            EmbeddingDtype::F32 => Table::Float(w.clone()),
            EmbeddingDtype::Auto => {
                return Err(EngineError::Config(
                    "vocabulary tables: `auto` is decided by the plan before loading".into(),
                ))
            }
        })
    }

    pub fn bytes(&self) -> usize {
        match self {
            Table::Float(t) => t.elem_count() * t.dtype().size_in_bytes(),
            Table::Q8(p) => p.bytes(),
            Table::Q4(p) => p.bytes(),
        }
    }

    /// `(rows, cols)`.
    pub fn shape(&self) -> (usize, usize) {
        match self {
            Table::Float(t) => t.dims2().unwrap_or((0, 0)),
            Table::Q8(p) => (p.rows(), p.cols()),
            Table::Q4(p) => (p.rows(), p.cols()),
        }
    }

    pub fn elem_count(&self) -> usize {
        let (rows, cols) = self.shape();
        rows * cols
    }

    /// Rows `ids` as f32 `[ids.len(), cols]`.
    pub fn rows(&self, ids: &[u32]) -> Result<Tensor> {
        match self {
            Table::Float(t) => Ok(t
                .index_select(&Tensor::new(ids, &Device::Cpu)?, 0)?
                .to_dtype(DType::F32)?),
            Table::Q8(p) => decode_rows(ids, p.rows(), p.cols(), |r, out| p.dequantize_row(r, out)),
            Table::Q4(p) => decode_rows(ids, p.rows(), p.cols(), |r, out| p.dequantize_row(r, out)),
        }
    }

    /// `x · tableᵀ`: `x` is `[n, cols]` f32, the result `[n, rows]` f32. `split`: a Q8_0
    /// table quantizes the activations to 16 bits instead of 8 (as split groups do).
    pub fn project(&self, x: &Tensor, split: bool) -> Result<Tensor> {
        match self {
            Table::Float(t) => float_matmul(x, t),
            Table::Q8(p) if split => q8_product(p, x, ActBits::Sixteen),
            Table::Q8(p) => q8_product(p, x, ActBits::Eight),
            Table::Q4(p) => q4_product(
                p,
                x,
                if split {
                    ActBits::Sixteen
                } else {
                    ActBits::Eight
                },
            ),
        }
    }

    /// The form this table is stored in.
    pub fn form(&self) -> EmbeddingDtype {
        match self {
            Table::Float(t) if t.dtype() == DType::F32 => EmbeddingDtype::F32,
            Table::Float(_) => EmbeddingDtype::F16,
            Table::Q8(_) => EmbeddingDtype::Q8_0,
            Table::Q4(_) => EmbeddingDtype::Q4S8,
        }
    }
}

/// Rows `ids` of a quantized `[rows, cols]` table, each decoded by `decode`; an id outside
/// the table is the request's error.
fn decode_rows(
    ids: &[u32],
    rows: usize,
    cols: usize,
    decode: impl Fn(usize, &mut [f32]),
) -> Result<Tensor> {
    let mut out = vec![0f32; ids.len() * cols];
    for (&id, row) in ids.iter().zip(out.chunks_exact_mut(cols)) {
        if id as usize >= rows {
            return Err(EngineError::InvalidRequest(format!(
                "token id {id} is outside the vocabulary (size {rows})"
            )));
        }
        decode(id as usize, row);
    }
    Ok(Tensor::from_vec(out, (ids.len(), cols), &Device::Cpu)?)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn max_diff(a: Tensor, b: Tensor) -> f32 {
        (a - b)
            .unwrap()
            .abs()
            .unwrap()
            .max_all()
            .unwrap()
            .to_scalar::<f32>()
            .unwrap()
    }

    /// The Q8_0 lookup decodes the same values the Q8_0 matmul multiplies with.
    #[test]
    fn q8_rows_match_the_dequantized_table() {
        let w = Tensor::randn(0f32, 1.0, (10, 64), &Device::Cpu).unwrap();
        let t = Table::new(&w, EmbeddingDtype::Q8_0).unwrap();
        let Table::Q8(p) = &t else {
            panic!("64 columns fit Q8_0")
        };
        let deq = Tensor::from_vec(p.dequantize(), (p.rows(), p.cols()), &Device::Cpu).unwrap();
        let want = deq
            .index_select(&Tensor::new(&[3u32, 7, 3], &Device::Cpu).unwrap(), 0)
            .unwrap();
        assert_eq!(max_diff(t.rows(&[3, 7, 3]).unwrap(), want), 0.0);
        assert!(t.bytes() < 10 * 64 * 2, "8-bit is smaller than f16");
        assert!(
            t.rows(&[10]).is_err(),
            "out of range is an error, not a panic"
        );
    }

    /// The Q8_0 projection with split activations carries the table's weight error alone:
    /// against the dequantized table it is ≥ 20× closer than the plain 8-bit product. f16
    /// tables ignore the flag (their product is already float). `auto` is refused.
    #[test]
    fn q8_projection_splits_its_activations() {
        let w = Tensor::randn(0f32, 1.0, (300, 576), &Device::Cpu).unwrap();
        let t = Table::new(&w, EmbeddingDtype::Q8_0).unwrap();
        let Table::Q8(p) = &t else {
            panic!("576 columns fit Q8_0")
        };
        let deq = Tensor::from_vec(p.dequantize(), (p.rows(), p.cols()), &Device::Cpu).unwrap();
        let x = Tensor::randn(0f32, 1.0, (3, 576), &Device::Cpu).unwrap();
        let want = x.matmul(&deq.t().unwrap()).unwrap();
        let err = |y: Tensor| {
            let d = (y - &want).unwrap().sqr().unwrap().sum_all().unwrap();
            let n = want.sqr().unwrap().sum_all().unwrap();
            (d.to_scalar::<f32>().unwrap() / n.to_scalar::<f32>().unwrap()).sqrt()
        };
        let plain = err(t.project(&x, false).unwrap());
        let split = err(t.project(&x, true).unwrap());
        assert!(plain > 1e-3, "plain {plain}");
        assert!(split * 20.0 < plain, "split {split} vs plain {plain}");
        let f16 = Table::new(&w, EmbeddingDtype::F16).unwrap();
        let (a, b) = (
            f16.project(&x, false).unwrap(),
            f16.project(&x, true).unwrap(),
        );
        let same = (a - b).unwrap().abs().unwrap().max_all().unwrap();
        assert_eq!(same.to_scalar::<f32>().unwrap(), 0.0);
        assert!(Table::new(&w, EmbeddingDtype::Auto).is_err());
    }

    /// The 4-bit table: lookups decode the values the 4-bit product multiplies with, its
    /// split projection is the dequantized table's product up to the 16-bit activations,
    /// and it is the smallest form; widths 32 does not divide keep f16.
    #[test]
    fn q4_tables_look_up_and_project_what_they_store() {
        let w = Tensor::randn(0f32, 1.0, (40, 96), &Device::Cpu).unwrap();
        let t = Table::new(&w, EmbeddingDtype::Q4S8).unwrap();
        let Table::Q4(p) = &t else {
            panic!("96 columns fit q4_s8")
        };
        assert_eq!(t.form(), EmbeddingDtype::Q4S8);
        let deq = Tensor::from_vec(p.dequantize(), (40, 96), &Device::Cpu).unwrap();
        let ids = Tensor::new(&[5u32, 39, 0], &Device::Cpu).unwrap();
        let got = t.rows(&[5, 39, 0]).unwrap();
        assert_eq!(max_diff(got, deq.index_select(&ids, 0).unwrap()), 0.0);
        assert!(t.rows(&[40]).is_err());
        let x = Tensor::randn(0f32, 1.0, (3, 96), &Device::Cpu).unwrap();
        let want = x.matmul(&deq.t().unwrap()).unwrap();
        let scale = want
            .abs()
            .unwrap()
            .max_all()
            .unwrap()
            .to_scalar::<f32>()
            .unwrap();
        assert!(max_diff(t.project(&x, true).unwrap(), want.clone()) < 1e-3 * scale);
        let q8 = Table::new(&w, EmbeddingDtype::Q8_0).unwrap();
        assert!(
            t.bytes() * 10 < q8.bytes() * 6,
            "{} vs {}",
            t.bytes(),
            q8.bytes()
        );
        let odd = Tensor::randn(0f32, 1.0, (4, 40), &Device::Cpu).unwrap();
        let f = Table::new(&odd, EmbeddingDtype::Q4S8).unwrap();
        assert_eq!(f.form(), EmbeddingDtype::F16);
    }
}
