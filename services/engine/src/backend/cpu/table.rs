//! The vocabulary tables: the token embedding (row lookups) and the output projection
//! (`lm_head`, a matmul), stored in f32, f16, or 8 bits (Q8_0: blocks of 32 values with one
//! f16 scale, as llama.cpp stores them). A tied model keeps one copy for both uses; in Q8_0
//! the lookup decodes the rows it needs straight from the blocks the matmul reads, and the
//! projection can split its activations like a linear group (`engine.split_activations =
//! all`), so the logits carry only the table's weight error.

use crate::backend::cpu::linear::{float_matmul, q8_product, with_f32_rows};
use crate::backend::EmbeddingDtype;
use crate::error::{EngineError, Result};
use candle_core::{DType, Device, Tensor};
use quantmesh_kernels::{ActBits, PackedQ8};

pub enum Table {
    Float(Tensor),
    /// On the linear groups' Q8_0 kernel; lookups dequantize rows from the same tiles.
    Q8(PackedQ8),
}

impl Table {
    /// `w` is the f32 table `[rows, cols]`. Q8_0 needs `cols` to be a multiple of 32; other
    /// widths keep f16.
    pub fn new(w: &Tensor, dtype: EmbeddingDtype) -> Result<Self> {
        let (rows, cols) = w.dims2()?;
        Ok(match dtype {
            EmbeddingDtype::Q8_0 if cols % 32 == 0 => {
                with_f32_rows(w, |w| Ok(Table::Q8(PackedQ8::quantize(w, rows, cols)?)))?
            }
            EmbeddingDtype::Q8_0 | EmbeddingDtype::F16 => Table::Float(w.to_dtype(DType::F16)?),
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
        }
    }

    pub fn elem_count(&self) -> usize {
        match self {
            Table::Float(t) => t.elem_count(),
            Table::Q8(p) => p.rows() * p.cols(),
        }
    }

    /// Rows `ids` as f32 `[ids.len(), cols]`.
    pub fn rows(&self, ids: &[u32]) -> Result<Tensor> {
        match self {
            Table::Float(t) => Ok(t
                .index_select(&Tensor::new(ids, &Device::Cpu)?, 0)?
                .to_dtype(DType::F32)?),
            Table::Q8(p) => {
                let (rows, cols) = (p.rows(), p.cols());
                let mut out = vec![0f32; ids.len() * cols];
                for (&id, row) in ids.iter().zip(out.chunks_exact_mut(cols)) {
                    if id as usize >= rows {
                        return Err(EngineError::InvalidRequest(format!(
                            "token id {id} is outside the vocabulary (size {rows})"
                        )));
                    }
                    p.dequantize_row(id as usize, row);
                }
                Ok(Tensor::from_vec(out, (ids.len(), cols), &Device::Cpu)?)
            }
        }
    }

    /// `x · tableᵀ`: `x` is `[n, cols]` f32, the result `[n, rows]` f32. `split`: a Q8_0
    /// table quantizes the activations to 16 bits instead of 8 (as split groups do).
    pub fn project(&self, x: &Tensor, split: bool) -> Result<Tensor> {
        match self {
            Table::Float(t) => float_matmul(x, t),
            Table::Q8(p) if split => q8_product(p, x, ActBits::Sixteen),
            Table::Q8(p) => q8_product(p, x, ActBits::Eight),
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

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
        let got = t.rows(&[3, 7, 3]).unwrap();
        let diff = (got - want)
            .unwrap()
            .abs()
            .unwrap()
            .max_all()
            .unwrap()
            .to_scalar::<f32>()
            .unwrap();
        assert_eq!(diff, 0.0);
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
}
