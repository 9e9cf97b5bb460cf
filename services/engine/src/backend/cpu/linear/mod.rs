//! Dual-precision linear groups: an INT8 form and an exact float form, either or both
//! resident, chosen per step and per row.
//!
//! Quantized ("INT8") form: Q8_0 weights (blocks of 32 sharing one scale) on quantmesh's own
//! kernels (`quantmesh-kernels`: repacked row tiles read once per step for all rows; the
//! activations quantized once per call to 8 bits — W8A8 with per-block scales, finer than
//! per-channel — or to 16 bits under split activations, at the same cost); for `w4a16`
//! groups 4-bit weights (`q4_s8`: 16 levels `d · q + m` per block of 32) on the same kernels
//! and activations (W4A8, W4A16 split). llama.cpp's Q4_0 and Q4_K, kept for comparison,
//! run on candle's kernels. See docs/design/kernels.md, "CPU kernels and the thread
//! runtime".
//!
//! Float form: the checkpoint's values (never dequantized INT8), stored in the engine's
//! `float_dtype` (f16 by default: half the bytes of f32); f16 copies run on the kernels'
//! f16 product (widened in registers), f32 and bf16 on candle's matmul.

use crate::backend::{
    ColumnError, FloatDtype, GroupForm, GroupOutcome, QuantFormat, RowPath, SplitActivations,
};
use crate::error::Result;
use candle_core::quantized::{GgmlDType, QMatMul, QStorage, QTensor};
use candle_core::{DType, Device, Module, Tensor};
use quantmesh_kernels::{ActBits, Activations, Isa, PackedQ4, PackedQ8, Pool};
use quantmesh_types::Residency;
use std::sync::{Arc, OnceLock};

/// `x · wᵀ` in `w`'s dtype, f32 in and out. f16 weights run on quantmesh's own kernel
/// (widened in registers, read once for all rows); f32 and bf16 on candle's.
pub(crate) fn float_matmul(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    if w.dtype() == DType::F16 && w.is_contiguous() {
        return f16_product(x, w);
    }
    Ok(if w.dtype() == DType::F32 {
        x.matmul(&w.t()?)?
    } else {
        x.to_dtype(w.dtype())?
            .matmul(&w.t()?)?
            .to_dtype(DType::F32)?
    })
}

/// `x · wᵀ` for a contiguous f16 `w` `[out, in]` on [`quantmesh_kernels::f16_matmul`].
fn f16_product(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    let (rows, cols) = w.dims2()?;
    let m = x.dim(0)?;
    let mut out = vec![0f32; m * rows];
    with_cpu_slice::<half::f16, _>(w, |weights| {
        with_f32_rows(x, |x| {
            quantmesh_kernels::f16_matmul(
                weights,
                rows,
                cols,
                x,
                &mut out,
                Isa::current(),
                Pool::global(),
            )?;
            Ok(())
        })
    })?;
    Ok(Tensor::from_vec(out, (m, rows), &Device::Cpu)?)
}

/// Which grid candle's kernel quantizes the activations of `q` (`[out, in]`, quantized as
/// `qt`) to. It depends on the weight format, the shape and the CPU (on x86 with VNNI,
/// Q8_0 weights whose input width 256 divides run a repacked kernel on Q8_K activations;
/// elsewhere Q8_0 blocks of 32), so it is measured rather than assumed: two probe rows are
/// put on each candidate grid and multiplied by the kernel; on the kernel's own grid the
/// product equals the dequantized weights' exactly (up to float summation), off it the
/// kernel's re-quantization shows (≈ 1e-3). Checked on the first 16 output rows.
fn activation_grid(
    q: &QMatMul,
    qt: &QTensor,
    out_dim: usize,
    in_dim: usize,
) -> Result<Option<GgmlDType>> {
    let dev = Device::Cpu;
    let rows = out_dim.min(16);
    let dt = qt.dtype();
    let row_bytes = in_dim / dt.block_size() * dt.type_size();
    let data = qt.data()?;
    let head = QTensor::new(
        QStorage::from_data(
            std::borrow::Cow::Borrowed(&data[..rows * row_bytes]),
            &dev,
            dt,
        )?,
        (rows, in_dim),
    )?
    .dequantize(&dev)?;
    // Deterministic probe rows with a spread of magnitudes (a few large channels).
    let probe: Vec<f32> = (0..2 * in_dim)
        .map(|i| {
            let t = i as f32;
            (t * 0.618_034).fract() * 2.0 - 1.0 + if i % 97 == 5 { 6.0 } else { 0.0 }
        })
        .collect();
    let probe = Tensor::from_vec(probe, (2, in_dim), &dev)?;
    let mut best: Option<(GgmlDType, f32)> = None;
    for grid in [GgmlDType::Q8_0, GgmlDType::Q8K] {
        if !in_dim.is_multiple_of(grid.block_size()) {
            continue;
        }
        let on_grid = QTensor::quantize(&probe, grid)?.dequantize(&dev)?;
        let got = q.forward(&on_grid)?.narrow(1, 0, rows)?;
        let want = on_grid.matmul(&head.t()?)?;
        let err = ((&got - &want)?.sqr()?.sum_all()?.to_scalar::<f32>()?
            / want
                .sqr()?
                .sum_all()?
                .to_scalar::<f32>()?
                .max(f32::MIN_POSITIVE))
        .sqrt();
        if err < 1e-4 && best.is_none_or(|(_, e)| err < e) {
            best = Some((grid, err));
        }
    }
    Ok(best.map(|(g, _)| g))
}

/// The values of the contiguous CPU tensor `t` (of dtype `D`) as one row-major slice,
/// handed to `f` without a copy.
fn with_cpu_slice<D: candle_core::WithDType, T>(
    t: &Tensor,
    f: impl FnOnce(&[D]) -> Result<T>,
) -> Result<T> {
    if !t.is_contiguous() {
        return Err(candle_core::Error::Msg("a kernel was given a strided tensor".into()).into());
    }
    let (storage, layout) = t.storage_and_layout();
    let candle_core::Storage::Cpu(cpu) = &*storage else {
        return Err(
            candle_core::Error::Msg("the CPU backend was given a device tensor".into()).into(),
        );
    };
    let start = layout.start_offset();
    f(&cpu.as_slice::<D>()?[start..start + t.elem_count()])
}

/// The f32 values of `x` (any dtype, any layout) as one row-major slice, handed to `f`
/// without a copy when `x` is already contiguous f32.
pub(crate) fn with_f32_rows<T>(x: &Tensor, f: impl FnOnce(&[f32]) -> Result<T>) -> Result<T> {
    with_cpu_slice(&x.to_dtype(DType::F32)?.contiguous()?, f)
}

thread_local! {
    /// The activations of the current product, quantized once per call into a buffer that
    /// is reused (it grows to the step's largest input and stays).
    static ACTIVATIONS: std::cell::RefCell<Activations> = std::cell::RefCell::new(Activations::new());
}

/// Smoothing factors per input channel: `.0` = `2^e` (the weights' columns), `.1` = `2^-e`
/// (the input's channels).
type Factors = (Arc<[f32]>, Arc<[f32]>);

/// How the quantized path sees its input: every channel multiplied by the inverse of its
/// smoothing factor (scale migration, a power of two), then every row rotated in Hadamard
/// blocks of `rotation`; the quantized weights hold the opposite change (columns multiplied
/// by the factors, rows rotated alike), so the product is the same function in float. The
/// identity (no factors, block 1) leaves the input as it is.
#[derive(Debug, Clone)]
pub struct InputTransform {
    /// Per input channel `2^e` and `2^-e`; `None`: no smoothing.
    factors: Option<Factors>,
    /// Hadamard block (1: none).
    rotation: usize,
}

impl InputTransform {
    /// Smoothing by the factors `2^e` of `exponents` (one per input channel), then rotation.
    pub fn new(exponents: Option<&[i8]>, rotation: usize) -> Self {
        let factors = exponents.map(|e| {
            let f: Arc<[f32]> = e.iter().map(|&e| (e as f32).exp2()).collect();
            let inv: Arc<[f32]> = e.iter().map(|&e| (-(e as f32)).exp2()).collect();
            (f, inv)
        });
        Self {
            factors,
            rotation: rotation.max(1),
        }
    }

    pub fn block(&self) -> usize {
        self.rotation
    }

    pub fn smooths(&self) -> bool {
        self.factors.is_some()
    }

    /// Neither smoothing nor rotation: the input goes to the quantizer as it is.
    fn is_identity(&self) -> bool {
        !self.smooths() && self.rotation <= 1
    }

    /// Rows of `cols` values with channel `j` multiplied by `by[j]` (when given).
    fn scale_columns(v: &mut [f32], cols: usize, by: Option<&[f32]>) {
        if let Some(by) = by.filter(|b| b.len() == cols) {
            for row in v.chunks_exact_mut(cols) {
                for (x, f) in row.iter_mut().zip(by) {
                    *x *= f;
                }
            }
        }
    }

    /// The weight `[out, in]` as the quantized form stores it: columns multiplied by the
    /// factors, rows rotated.
    fn weight_in(&self, w: &Tensor) -> Result<Tensor> {
        self.map_rows(w, |v, cols| {
            Self::scale_columns(v, cols, self.factors.as_ref().map(|f| &f.0[..]));
            Ok(quantmesh_kernels::hadamard_blocks(v, self.rotation)?)
        })
    }

    /// The inverse of [`InputTransform::weight_in`] (the rotation is its own inverse): the
    /// stored weights seen from the untransformed input.
    fn weight_out(&self, w: &Tensor) -> Result<Tensor> {
        self.map_rows(w, |v, cols| {
            quantmesh_kernels::hadamard_blocks(v, self.rotation)?;
            Self::scale_columns(v, cols, self.factors.as_ref().map(|f| &f.1[..]));
            Ok(())
        })
    }

    /// The input `[rows, in]` as the quantized path multiplies it (a tensor: candle's
    /// kernels; quantmesh's transform in [`kernel_product`]'s buffer).
    fn input(&self, x: &Tensor) -> Result<Tensor> {
        self.map_rows(x, |v, cols| self.input_rows(v, cols))
    }

    /// [`InputTransform::input`] in place on row-major values, a prefill's rows rotated on
    /// the kernels' pool.
    fn input_rows(&self, v: &mut [f32], cols: usize) -> Result<()> {
        Self::scale_columns(v, cols, self.factors.as_ref().map(|f| &f.1[..]));
        rotate_on_pool(v, cols, self.rotation)
    }

    fn map_rows(
        &self,
        x: &Tensor,
        f: impl FnOnce(&mut [f32], usize) -> Result<()>,
    ) -> Result<Tensor> {
        if self.is_identity() {
            return Ok(x.clone());
        }
        let dims = x.dims2()?;
        let mut v = x.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
        f(&mut v, dims.1)?;
        Ok(Tensor::from_vec(v, dims, x.device())?)
    }
}

/// A linear group's quantized weight and the kernel that multiplies by it.
///
/// Q8_0 and `q4_s8` weights run on quantmesh's own kernels (`quantmesh-kernels`: tiles
/// packed in the order this CPU's kernel reads, streamed once per call for all rows, the
/// activations quantized once to 8 or 16 bits, the instruction set picked at run time, one
/// persistent thread pool). llama.cpp's Q4_0 and Q4_K (comparison forms) run on candle's.
pub enum QuantKernel {
    Q8(PackedQ8),
    Q4(PackedQ4),
    Candle {
        mm: QMatMul,
        q: Arc<QTensor>,
        /// The grid the kernel quantizes activations to, found by [`activation_grid`] on
        /// the first split call (`None`: not reproducible, so splitting would gain nothing
        /// and the rows take the plain product).
        split_grid: OnceLock<Option<GgmlDType>>,
    },
}

impl QuantKernel {
    /// Quantize the f32 weight `[out, in]` to `format`.
    pub fn quantize(weight: &Tensor, format: QuantFormat) -> Result<Self> {
        let (rows, cols) = weight.dims2()?;
        let dtype = match format.ggml() {
            Some(dtype) => dtype,
            None => {
                return with_f32_rows(weight, |w| {
                    Ok(match format {
                        QuantFormat::Q4S8 => QuantKernel::Q4(PackedQ4::quantize(w, rows, cols)?),
                        _ => QuantKernel::Q8(PackedQ8::quantize(w, rows, cols)?),
                    })
                })
            }
        };
        let q = Arc::new(QTensor::quantize(weight, dtype)?);
        Ok(QuantKernel::Candle {
            mm: QMatMul::from_arc(q.clone())?,
            q,
            split_grid: OnceLock::new(),
        })
    }

    /// The weights as the kernel multiplies them, f32 `[out, in]`.
    pub fn dequantize(&self) -> Result<Tensor> {
        Ok(match self {
            QuantKernel::Q8(p) => {
                Tensor::from_vec(p.dequantize(), (p.rows(), p.cols()), &Device::Cpu)?
            }
            QuantKernel::Q4(p) => {
                Tensor::from_vec(p.dequantize(), (p.rows(), p.cols()), &Device::Cpu)?
            }
            QuantKernel::Candle { q, .. } => q.dequantize(&Device::Cpu)?,
        })
    }

    /// What this quantization does to each input column of `weight` (the f32 `[out, in]` it
    /// was made from, before `t` changed it): the quantized weights are turned back first,
    /// so the error is seen from the untransformed input.
    pub fn column_error(&self, weight: &Tensor, t: &InputTransform) -> Result<ColumnError> {
        let in_dim = weight.dim(1)?;
        let w = weight.flatten_all()?.to_vec1::<f32>()?;
        let seen = t.weight_out(&self.dequantize()?)?;
        Ok(ColumnError::from_weights(
            &w,
            &seen.flatten_all()?.to_vec1::<f32>()?,
            in_dim,
        ))
    }

    /// [`QuantKernel::forward`] (`split`: [`QuantKernel::split_forward`]) of `x` changed by
    /// `t` (smoothed, rotated). quantmesh's kernels change the rows on the way into the
    /// quantizer, in one reused buffer; candle's get a changed tensor.
    pub fn transformed_forward(
        &self,
        x: &Tensor,
        t: &InputTransform,
        split: bool,
    ) -> Result<Tensor> {
        let bits = if split {
            ActBits::Sixteen
        } else {
            ActBits::Eight
        };
        match self {
            QuantKernel::Q8(p) => q8_transformed(p, x, bits, t),
            QuantKernel::Q4(p) => q4_transformed(p, x, bits, t),
            QuantKernel::Candle { .. } => {
                let x = t.input(x)?;
                match split {
                    true => self.split_forward(&x),
                    false => self.forward(&x),
                }
            }
        }
    }

    /// `x · deq(W)ᵀ` through the kernel, activations quantized to 8 bits on the fly (W8A8).
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        match self {
            QuantKernel::Q8(p) => q8_product(p, x, ActBits::Eight),
            QuantKernel::Q4(p) => q4_product(p, x, ActBits::Eight),
            QuantKernel::Candle { mm, .. } => Ok(mm.forward(x)?),
        }
    }

    /// The same product with the activations carried to ≈ 16 bits, so only the weights'
    /// quantization error is left (`engine.split_activations`). On quantmesh's kernels this
    /// is one pass with 16-bit activations, at the cost of the 8-bit one. On candle's kernels
    /// `x` is cut into the kernel's own quantization of it, `x̂ = deq(q(x))`, and the
    /// remainder `x − x̂`; both go through the kernel as one matmul of twice the rows and
    /// the halves are summed (`x̂` lies on the kernel's grid, so the kernel reproduces it
    /// exactly; only the remainder, ≈ 1/254 of a block's step, is quantized again). Where
    /// that grid cannot be reproduced this is the plain product.
    pub fn split_forward(&self, x: &Tensor) -> Result<Tensor> {
        let (mm, q, split_grid) = match self {
            QuantKernel::Q8(p) => return q8_product(p, x, ActBits::Sixteen),
            QuantKernel::Q4(p) => return q4_product(p, x, ActBits::Sixteen),
            QuantKernel::Candle { mm, q, split_grid } => (mm, q, split_grid),
        };
        let (out_dim, in_dim) = q.shape().dims2()?;
        let grid = match split_grid.get() {
            Some(g) => *g,
            None => {
                let g = activation_grid(mm, q, out_dim, in_dim)?;
                if g.is_none() {
                    tracing::warn!(
                        out = out_dim,
                        input = in_dim,
                        format = ?q.dtype(),
                        "the kernel's activation grid is neither Q8_0 nor Q8_K here: split activations fall back to the plain quantized product"
                    );
                }
                *split_grid.get_or_init(|| g)
            }
        };
        let Some(grid) = grid else {
            return self.forward(x);
        };
        let rows = x.dim(0)?;
        let x = x.contiguous()?;
        let on_grid = QTensor::quantize(&x, grid)?.dequantize(x.device())?;
        let rest = (&x - &on_grid)?;
        let y = mm.forward(&Tensor::cat(&[&on_grid, &rest], 0)?)?;
        Ok((y.narrow(0, 0, rows)? + y.narrow(0, rows, rows)?)?)
    }
}

/// `x · deq(p)ᵀ` on quantmesh's kernels, `x` `[rows, in]`, activations quantized to `bits`.
pub(crate) fn q8_product(p: &PackedQ8, x: &Tensor, bits: ActBits) -> Result<Tensor> {
    q8_transformed(p, x, bits, &InputTransform::new(None, 1))
}

/// As [`q8_product`], the rows changed by `t` (smoothed, rotated) first.
fn q8_transformed(p: &PackedQ8, x: &Tensor, bits: ActBits, t: &InputTransform) -> Result<Tensor> {
    kernel_product(x, bits, t, p.rows(), |a| {
        p.matmul_vec(a, Isa::current(), Pool::global())
    })
}

/// As [`q8_product`], for 4-bit weights.
pub(crate) fn q4_product(p: &PackedQ4, x: &Tensor, bits: ActBits) -> Result<Tensor> {
    q4_transformed(p, x, bits, &InputTransform::new(None, 1))
}

/// As [`q8_transformed`], for 4-bit weights.
fn q4_transformed(p: &PackedQ4, x: &Tensor, bits: ActBits, t: &InputTransform) -> Result<Tensor> {
    kernel_product(x, bits, t, p.rows(), |a| {
        p.matmul_vec(a, Isa::current(), Pool::global())
    })
}

/// Rotate the rows of `r` (`cols` wide) in Hadamard blocks of `rotation`, a prefill's
/// rows shared out over the kernels' pool.
fn rotate_on_pool(r: &mut [f32], cols: usize, rotation: usize) -> Result<()> {
    if rotation <= 1 {
        return Ok(());
    }
    let pool = Pool::global();
    let rows = r.len() / cols.max(1);
    if rows < 2 * pool.threads() || cols == 0 || !cols.is_multiple_of(rotation) {
        return Ok(quantmesh_kernels::hadamard_blocks(r, rotation)?);
    }
    let per = rows.div_ceil(pool.threads()) * cols;
    let mut parts: Vec<&mut [f32]> = r.chunks_mut(per).collect();
    // Every part is whole rows of a width `rotation` divides: the call cannot fail.
    pool.for_each_mut(&mut parts, |p| {
        let _ = quantmesh_kernels::hadamard_blocks(p, rotation);
    });
    Ok(())
}

thread_local! {
    /// The rows of the current product transformed, when the group smooths or rotates
    /// (reused like [`ACTIVATIONS`]).
    static TRANSFORMED: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// `x` (changed by `t`: smoothed, rotated) quantized to `bits` into this thread's
/// activations buffer, multiplied by `product` (`[rows, out]`).
fn kernel_product(
    x: &Tensor,
    bits: ActBits,
    t: &InputTransform,
    out: usize,
    product: impl FnOnce(&Activations) -> quantmesh_kernels::Result<Vec<f32>>,
) -> Result<Tensor> {
    let (rows, cols) = x.dims2()?;
    let y = with_f32_rows(x, |x| {
        ACTIVATIONS.with_borrow_mut(|a| -> Result<Vec<f32>> {
            if !t.is_identity() {
                TRANSFORMED.with_borrow_mut(|r| -> Result<()> {
                    r.clear();
                    r.extend_from_slice(x);
                    t.input_rows(r, cols)?;
                    Ok(a.quantize(r, rows, cols, bits)?)
                })?;
            } else {
                a.quantize(x, rows, cols, bits)?;
            }
            Ok(product(a)?)
        })
    })?;
    Ok(Tensor::from_vec(y, (rows, out), &Device::Cpu)?)
}

pub struct DualLinear {
    int8: Option<QuantKernel>,
    /// What `int8`'s quantization does to each input column (with `int8`).
    column_error: Option<Arc<ColumnError>>,
    /// How `int8` stores its weights.
    quant: QuantFormat,
    float: Option<Tensor>,
    bias: Option<Tensor>,
    out_dim: usize,
    in_dim: usize,
    /// How the quantized path changes its input (smoothing, rotation; `int8` holds the
    /// weights changed to match).
    transform: InputTransform,
    /// Every quantized-path row carries 16-bit activations under `copyless` ([`GroupForm::wide`]).
    wide: bool,
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
        Self::rotated(weight, bias, form, float_dtype, 0)
    }

    /// As [`DualLinear::with_form`], the quantized path rotating activations in Hadamard
    /// blocks of up to `rotation` channels (the widest power of two up to it that divides
    /// the input width; 0: none) and, when `form.smoothing` holds factors, dividing each
    /// channel by its factor first; its weights changed to match, so its product is the
    /// same function in float. The float copy is the checkpoint's weight, unchanged.
    pub fn rotated(
        weight: Tensor,
        bias: Option<Tensor>,
        form: GroupForm,
        float_dtype: FloatDtype,
        rotation: u32,
    ) -> Result<Self> {
        let residency = form.residency;
        let (out_dim, in_dim) = weight.dims2()?;
        let block = match rotation {
            0 => 1,
            b => quantmesh_kernels::rotation_block(in_dim, b as usize),
        };
        let exponents = form.smoothing.as_deref();
        if let Some(e) = exponents.filter(|e| e.len() != in_dim) {
            return Err(candle_core::Error::Msg(format!(
                "{} smoothing factors for an input width of {in_dim}",
                e.len()
            ))
            .into());
        }
        let transform = InputTransform::new(exponents, block);
        let (int8, column_error) = if residency.has_int8() {
            let k = QuantKernel::quantize(&transform.weight_in(&weight)?, form.quant)?;
            let e = k.column_error(&weight, &transform)?;
            (Some(k), Some(Arc::new(e)))
        } else {
            (None, None)
        };
        let float = if residency.has_float() {
            Some(weight.to_dtype(crate::backend::candle_dtype(float_dtype))?)
        } else {
            None
        };
        Ok(Self {
            int8,
            column_error,
            quant: form.quant,
            float,
            bias,
            out_dim,
            in_dim,
            transform,
            wide: form.wide,
        })
    }

    /// Whether quantized rows take 16-bit activations: as `split` says, all of a wide group's.
    fn splits(&self, split: SplitActivations, wanted_float: bool) -> bool {
        split.splits(wanted_float || (self.wide && split.copyless()))
    }

    /// The Hadamard block the quantized path rotates activations by (1: none).
    pub fn rotation(&self) -> usize {
        self.transform.block()
    }

    /// Whether the quantized path smooths its input (scale migration).
    pub fn smooths(&self) -> bool {
        self.transform.smooths()
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

    /// What the quantized form does to each input column (`None` for a float-only group).
    pub fn column_error(&self) -> Option<Arc<ColumnError>> {
        self.column_error.clone()
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
            self.quant.bytes(self.out_dim, self.in_dim)
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
        let Some(k) = &self.int8 else {
            return Ok(None);
        };
        Ok(Some(k.transformed_forward(x, &self.transform, false)?))
    }

    /// The quantized weights with split activations ([`QuantKernel::split_forward`]).
    fn split_mm(&self, x: &Tensor) -> Result<Option<Tensor>> {
        let Some(k) = &self.int8 else {
            return Ok(None);
        };
        Ok(Some(k.transformed_forward(x, &self.transform, true)?))
    }

    /// Every row through one path: float when `want_float` and a copy is resident; else the
    /// quantized weights, with split activations where `split` says so; a float-only group
    /// serves everything in float.
    fn whole(&self, x: &Tensor, want_float: bool, split: SplitActivations) -> Result<Tensor> {
        let y = match (want_float, &self.float) {
            (true, Some(w)) => Some(float_matmul(x, w)?),
            _ if self.splits(split, want_float) => self.split_mm(x)?,
            _ => self.int8_mm(x)?,
        };
        match y {
            Some(y) => Ok(y),
            None => self.float_mm(x)?.ok_or_else(|| {
                candle_core::Error::Msg("linear group has no resident weights".into()).into()
            }),
        }
    }

    /// `x` is `[rows, in]`; returns `[rows, out]`. Rows that want float in a group without a
    /// float copy are counted as unavailable and take the quantized path; `split` says which
    /// quantized-path rows carry split activations.
    pub fn forward(
        &self,
        x: &Tensor,
        path: &RowPath,
        split: SplitActivations,
    ) -> Result<(Tensor, GroupOutcome)> {
        let rows = x.dim(0)?;
        let has_float = self.float.is_some();
        let has_int8 = self.int8.is_some();
        let mut outcome = GroupOutcome::default();
        // Counts `n` quantized-path rows; `wanted_float`: they asked for a float copy the
        // group lacks (unavailable, unless `copyless` serves them split: 16-bit activations).
        let quantized = |o: &mut GroupOutcome, n: usize, wanted_float: bool| {
            if wanted_float && !split.copyless() {
                o.fallback_unavailable_rows += n;
            }
            if self.splits(split, wanted_float) {
                o.split_rows += n;
            } else {
                o.int8_rows += n;
            }
        };
        let y = match path {
            RowPath::AllInt8 => {
                if has_int8 {
                    quantized(&mut outcome, rows, false);
                } else {
                    outcome.float_rows = rows
                }
                self.whole(x, false, split)?
            }
            RowPath::AllFloat => {
                if has_float {
                    outcome.float_rows = rows;
                } else {
                    quantized(&mut outcome, rows, true);
                }
                self.whole(x, true, split)?
            }
            RowPath::Reference => return self.forward(x, &RowPath::AllFloat, split),
            RowPath::FloatRows(float_rows) if float_rows.is_empty() => {
                return self.forward(x, &RowPath::AllInt8, split);
            }
            RowPath::FloatRows(float_rows) if float_rows.len() == rows => {
                return self.forward(x, &RowPath::AllFloat, split);
            }
            RowPath::FloatRows(float_rows) => {
                let (f, i) = (float_rows.len(), rows - float_rows.len());
                if !has_int8 {
                    // Float only: every row takes it.
                    outcome.float_rows = rows;
                    self.whole(x, true, split)?
                } else if !has_float && (!split.copyless() || self.wide) {
                    // Every row on the same quantized path: no need to split the batch.
                    quantized(&mut outcome, i, false);
                    quantized(&mut outcome, f, true);
                    self.whole(x, false, split)?
                } else {
                    if has_float {
                        outcome.float_rows = f;
                    } else {
                        quantized(&mut outcome, f, true);
                    }
                    quantized(&mut outcome, i, false);
                    self.split_rows(x, float_rows, split)?
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

    /// Rows in `float_rows` through the float form (or the quantized one, split as `split`
    /// says, when there is no float copy), the rest through INT8, merged back
    /// into the original row order.
    fn split_rows(
        &self,
        x: &Tensor,
        float_rows: &[usize],
        split: SplitActivations,
    ) -> Result<Tensor> {
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
        let yi = self.whole(&xi, false, split)?;
        let yf = self.whole(&xf, true, split)?;
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
mod tests;
