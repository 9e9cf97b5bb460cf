//! The vocabulary tables: the token embedding (row lookups) and the output projection
//! (`lm_head`, a matmul), stored in f32, f16, or 8 bits (Q8_0: blocks of 32 values with one
//! f16 scale, as llama.cpp stores them). A tied model keeps one copy for both uses; in Q8_0
//! the lookup decodes the rows it needs straight from the blocks the matmul reads.

use crate::backend::EmbeddingDtype;
use crate::error::{EngineError, Result};
use candle_core::quantized::{GgmlDType, QMatMul, QTensor};
use candle_core::{DType, Device, Module, Tensor};
use half::f16;
use std::sync::Arc;

/// Q8_0: 2 bytes of f16 scale + 32 signed bytes per block.
const Q8_BLOCK: usize = 34;

pub enum Table {
    Float(Tensor),
    Q8 {
        q: Arc<QTensor>,
        mm: QMatMul,
        cols: usize,
    },
}

impl Table {
    /// `w` is the f32 table `[rows, cols]`. Q8_0 needs `cols` to be a multiple of 32; other
    /// widths keep f16.
    pub fn new(w: &Tensor, dtype: EmbeddingDtype) -> Result<Self> {
        let (_, cols) = w.dims2()?;
        Ok(match dtype {
            EmbeddingDtype::Q8_0 if cols % 32 == 0 => {
                let q = Arc::new(QTensor::quantize(w, GgmlDType::Q8_0)?);
                let mm = QMatMul::from_arc(q.clone())?;
                Table::Q8 { q, mm, cols }
            }
            EmbeddingDtype::Q8_0 | EmbeddingDtype::F16 => Table::Float(w.to_dtype(DType::F16)?),
            EmbeddingDtype::F32 => Table::Float(w.clone()),
        })
    }

    pub fn bytes(&self) -> usize {
        match self {
            Table::Float(t) => t.elem_count() * t.dtype().size_in_bytes(),
            Table::Q8 { q, .. } => q.storage_size_in_bytes(),
        }
    }

    pub fn elem_count(&self) -> usize {
        match self {
            Table::Float(t) => t.elem_count(),
            Table::Q8 { q, .. } => q.shape().elem_count(),
        }
    }

    /// Rows `ids` as f32 `[ids.len(), cols]`.
    pub fn rows(&self, ids: &[u32]) -> Result<Tensor> {
        match self {
            Table::Float(t) => Ok(t
                .index_select(&Tensor::new(ids, &Device::Cpu)?, 0)?
                .to_dtype(DType::F32)?),
            Table::Q8 { q, cols, .. } => {
                let data = q.data()?;
                let per_row = cols / 32 * Q8_BLOCK;
                let rows = q.shape().dims()[0];
                let mut out = Vec::with_capacity(ids.len() * cols);
                for &id in ids {
                    let id = id as usize;
                    if id >= rows {
                        return Err(EngineError::InvalidRequest(format!(
                            "token id {id} is outside the vocabulary (size {rows})"
                        )));
                    }
                    for block in data[id * per_row..(id + 1) * per_row].chunks_exact(Q8_BLOCK) {
                        let d = f16::from_le_bytes([block[0], block[1]]).to_f32();
                        out.extend(block[2..].iter().map(|&b| d * (b as i8) as f32));
                    }
                }
                Ok(Tensor::from_vec(out, (ids.len(), *cols), &Device::Cpu)?)
            }
        }
    }

    /// `x · tableᵀ`: `x` is `[n, cols]` f32, the result `[n, rows]` f32.
    pub fn project(&self, x: &Tensor) -> Result<Tensor> {
        match self {
            Table::Float(t) if t.dtype() == DType::F32 => Ok(x.matmul(&t.t()?)?),
            Table::Float(t) => Ok(x
                .to_dtype(t.dtype())?
                .matmul(&t.t()?)?
                .to_dtype(DType::F32)?),
            Table::Q8 { mm, .. } => Ok(mm.forward(x)?),
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
        let Table::Q8 { q, .. } = &t else {
            panic!("64 columns fit Q8_0")
        };
        let deq = q.dequantize(&Device::Cpu).unwrap();
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
}
