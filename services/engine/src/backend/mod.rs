//! The backend seam: what a device has to implement to serve quantmesh's precision plan.
//!
//! A backend owns the model's weights in its own forms (for every linear group an INT8
//! form, a float form, or both — its [`Residency`]) and runs one step's forward pass over
//! the flattened tokens of many sequences, reading and writing the paged KV cache. It
//! decides nothing about precision: before every linear group it asks the [`Router`] which
//! rows take the float path, and before writing a layer's K/V whether that layer stores
//! INT8. The policy (the fallback mask, per-token bounds, MLP coupling, shadow passes,
//! recomputation after NaN/Inf) lives in `precision/` and is the same for every backend.
//!
//! [`cpu`] is the first implementation (candle tensors, Q8_0 quantized matmuls). A CUDA or
//! Ascend backend implements [`Backend`] and [`GroupLoader`]; nothing else changes.

pub mod cpu;

use crate::error::Result;
use crate::kv::{KvCache, PageId, SeqId, Slot};
use candle_core::{DType, Tensor};
use quantmesh_model::{Checkpoint, ModelConfig};
use quantmesh_types::{GroupId, PrecisionClass, Residency};
use serde::{Deserialize, Serialize};
use std::any::Any;
use std::sync::Arc;

/// One sequence's part of a step.
#[derive(Debug, Clone)]
pub struct SeqChunk {
    pub seq: SeqId,
    pub tokens: Vec<u32>,
    /// Absolute position of `tokens[0]`.
    pub start_pos: usize,
    /// KV slots for `tokens`, one each.
    pub slots: Vec<Slot>,
    pub block_table: Vec<PageId>,
    /// Compute logits for the last token of the chunk.
    pub want_logits: bool,
}

/// One step of the batch: sequence chunks (prefill chunks and single decode tokens).
#[derive(Debug, Clone, Default)]
pub struct StepInput {
    pub chunks: Vec<SeqChunk>,
    /// Copy-on-write page copies to do before the step.
    pub copies: Vec<(PageId, PageId)>,
}

impl StepInput {
    pub fn num_tokens(&self) -> usize {
        self.chunks.iter().map(|c| c.tokens.len()).sum()
    }

    /// (sequence, absolute position) of every row, in row order.
    pub fn rows(&self) -> Vec<(SeqId, usize)> {
        self.chunks
            .iter()
            .flat_map(|c| (0..c.tokens.len()).map(move |i| (c.seq, c.start_pos + i)))
            .collect()
    }
}

/// Which rows of a step's activations take the float path through one group.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RowPath {
    AllInt8,
    AllFloat,
    /// Row indices (ascending, unique) computed in float; the rest in INT8.
    FloatRows(Vec<usize>),
    /// Every row in float from the checkpoint's own weights: the shadow pass's reference.
    /// The resident float copy where there is one, else the backend's reference weights
    /// (read from the checkpoint) where it keeps them, else INT8 (counted as unavailable).
    Reference,
}

/// What happened inside one group on one step: used for counting "wanted fallback,
/// unavailable" and for tests.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct GroupOutcome {
    pub float_rows: usize,
    pub int8_rows: usize,
    /// Rows that asked for float but the group holds no float copy, and got no higher
    /// precision than their neighbours (`off`, `all`).
    pub fallback_unavailable_rows: usize,
    /// Rows computed on the quantized weights with split activations: under
    /// [`SplitActivations::Copyless`] exactly the rows that wanted float in a group
    /// without a float copy (not counted as unavailable); under `all` every quantized row.
    pub split_rows: usize,
}

/// What a group's served quantization does to each input column (the monitor's harm
/// statistic); one implementation, shared with the pre-screen's calibrated harm bound.
pub use quantmesh_kernels::ColumnError;

pub use quantmesh_config::{EmbeddingDtype, FloatDtype, Forms, SplitActivations};

/// Bytes of a `rows × cols` vocabulary table in form `d` (Q8_0 by [`QuantFormat::bytes`],
/// `q4_s8` as [`quantmesh_kernels::PackedQ4`] holds it; `None` for `Auto`, which is not a
/// form).
pub fn table_bytes(d: EmbeddingDtype, rows: usize, cols: usize) -> Option<usize> {
    let values = rows * cols;
    match d {
        EmbeddingDtype::Q8_0 => Some(QuantFormat::Q8_0.bytes(1, values)),
        EmbeddingDtype::Q4S8 => Some(quantmesh_kernels::PackedQ4::bytes_for(rows, cols)),
        EmbeddingDtype::F16 => Some(2 * values),
        EmbeddingDtype::F32 => Some(4 * values),
        EmbeddingDtype::Auto => None,
    }
}

/// The candle dtype a float copy is stored in.
pub fn candle_dtype(f: FloatDtype) -> DType {
    match f {
        FloatDtype::F16 => DType::F16,
        FloatDtype::Bf16 => DType::BF16,
        FloatDtype::F32 => DType::F32,
    }
}

/// The precision policy as a backend sees it, asked in the order the layer runs.
pub trait Router {
    /// Which rows take the float path through group `g`, given its input `[rows, in]`
    /// (measured here when the group is monitored).
    fn route(&mut self, g: GroupId, input: &Tensor) -> Result<RowPath>;
    /// After `down` of `layer` was routed: the rows whose `gate_up` must be recomputed in
    /// float first (MLP coupling per token; the backend does it when `gate_up` holds a float
    /// copy). Empty when nothing is coupled.
    fn coupled_gate_up_rows(&mut self, layer: usize) -> Vec<usize>;
    /// Whether `layer` stores this step's new K/V entries in INT8 (C8).
    fn kv_int8(&self, layer: usize) -> bool;
    /// What group `g` did (rows per path).
    fn record(&mut self, g: GroupId, outcome: GroupOutcome);
}

/// What one pass produced: logits of the last token of each chunk that asked for them.
#[derive(Debug, Clone, Default)]
pub struct PassOutput {
    pub logits: Vec<(SeqId, Vec<f32>)>,
}

/// How a linear group's quantized form stores its weights — the form the plan and the
/// monitor call "INT8" (the path a group leaves when it falls back to float). The kernels
/// quantize the activations to 8-bit blocks on the fly (16-bit under split activations), so
/// `Q8_0` computes W8A8 and the 4-bit forms W4A8 (W4A16 under split activations).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
pub enum QuantFormat {
    /// 8-bit weights, an f16 scale per 32 (34 bytes per 32 weights): `w8a8`,
    /// `w8a8_per_channel`, and every group when no plan says otherwise.
    #[default]
    #[serde(rename = "q8_0")]
    Q8_0,
    /// 4-bit weights, 16 levels `d · q + m` per 32 with `d` and `m` as 8-bit fractions of
    /// two f16 values per super-block of up to 256 (`quantmesh_kernels::PackedQ4`: 18 bytes
    /// per 32 weights and 4 per super-block, 4.625 bits per weight), on quantmesh's own
    /// kernels: what `w4a16` groups are served with, at any width 32 divides.
    #[serde(rename = "q4_s8")]
    Q4S8,
    /// llama.cpp's Q4_0 (an f16 scale per 32, 18 bytes per 32 weights), on candle's
    /// kernels: a comparison form for the benchmarks.
    #[serde(rename = "q4_0")]
    Q4_0,
    /// llama.cpp's Q4_K (super-blocks of 256, 144 bytes per 256 weights; widths 256
    /// divides), on candle's kernels: a comparison form for the benchmarks.
    #[serde(rename = "q4_k")]
    Q4K,
}

impl QuantFormat {
    /// The form a pre-screen class is served with (the same at every input width: every
    /// form takes widths 32 divides, and the engine loads no others).
    pub fn for_class(class: PrecisionClass) -> Self {
        match class {
            PrecisionClass::W4a16 => QuantFormat::Q4S8,
            PrecisionClass::Fp16 | PrecisionClass::W8a8 | PrecisionClass::W8a8PerChannel => {
                QuantFormat::Q8_0
            }
        }
    }

    /// candle's type for the forms that run on candle's kernels.
    pub fn ggml(self) -> Option<candle_core::quantized::GgmlDType> {
        use candle_core::quantized::GgmlDType;
        match self {
            QuantFormat::Q8_0 | QuantFormat::Q4S8 => None,
            QuantFormat::Q4_0 => Some(GgmlDType::Q4_0),
            QuantFormat::Q4K => Some(GgmlDType::Q4K),
        }
    }

    pub fn is_four_bit(self) -> bool {
        !matches!(self, QuantFormat::Q8_0)
    }

    /// Bytes of a `rows × cols` weight in this form (whole blocks: every width we load is
    /// a multiple of the block).
    pub fn bytes(self, rows: usize, cols: usize) -> usize {
        let params = rows * cols;
        match self {
            QuantFormat::Q8_0 | QuantFormat::Q4_0 => params / 32 * (2 + 32 * self.bits() / 8),
            QuantFormat::Q4K => params / 256 * 144,
            QuantFormat::Q4S8 => quantmesh_kernels::PackedQ4::bytes_for(rows, cols),
        }
    }

    /// Bits per stored weight value (before scales).
    pub fn bits(self) -> usize {
        if self.is_four_bit() {
            4
        } else {
            8
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            QuantFormat::Q8_0 => "q8_0",
            QuantFormat::Q4S8 => "q4_s8",
            QuantFormat::Q4_0 => "q4_0",
            QuantFormat::Q4K => "q4_k",
        }
    }
}

/// What the plan decides for one linear group: which forms stay resident, how the
/// quantized one is stored, and the scale migration its quantized path applies.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GroupForm {
    pub residency: Residency,
    pub quant: QuantFormat,
    /// Smoothing factors' exponents, one per input channel (`None`: none); see
    /// `quantmesh_types::Smoothing`.
    pub smoothing: Option<std::sync::Arc<[i8]>>,
    /// Under `copyless`, every row of the group carries 16-bit activations, not only the
    /// rows the monitor wants at higher precision: the plan measured that 8-bit activations
    /// cost this group more than its weights' quantization does (`LivePlan::wide`).
    pub wide: bool,
}

impl GroupForm {
    /// `residency` with the default (Q8_0) quantized form, no smoothing.
    pub fn q8(residency: Residency) -> Self {
        Self::new(residency, QuantFormat::Q8_0)
    }

    /// `residency` and `quant`, no smoothing.
    pub fn new(residency: Residency, quant: QuantFormat) -> Self {
        Self {
            residency,
            quant,
            smoothing: None,
            wide: false,
        }
    }
}

/// Resident weight bytes by form.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct WeightBytes {
    /// 8-bit (Q8_0) quantized forms of linear groups.
    pub int8: usize,
    /// 4-bit (`q4_s8`; Q4_K or Q4_0 in the benchmarks) quantized forms of linear groups
    /// (`w4a16` groups).
    pub int4: usize,
    /// Float copies of linear groups.
    pub float: usize,
    /// Everything else: embeddings, norms, lm_head, biases.
    pub other: usize,
    /// The same model with every weight in 16 bits (the usual serving baseline).
    pub all_f16: usize,
}

impl WeightBytes {
    pub fn total(&self) -> usize {
        self.int8 + self.int4 + self.float + self.other
    }

    /// Resident bytes ÷ all-f16 bytes.
    pub fn ratio_to_f16(&self) -> f64 {
        self.total() as f64 / self.all_f16.max(1) as f64
    }
}

/// A linear group built off the serving thread, in its backend's own form, waiting to be
/// swapped in by [`Backend::replace_weights`].
pub struct PreparedGroup {
    pub group: GroupId,
    pub form: GroupForm,
    /// What the new quantized form does to each input column (for the monitor's harm
    /// statistic; `None` without a quantized form).
    pub column_error: Option<Arc<ColumnError>>,
    /// Resident bytes of the group in its new form (weights, copies, bias).
    pub bytes: usize,
    pub(crate) inner: Box<dyn Any + Send>,
}

/// Builds a group's resident forms from the checkpoint (runs on a background thread during
/// hot reload, so it takes no backend reference); `Forms` says how float copies are stored
/// and how the quantized path rotates activations.
pub type GroupLoader =
    fn(&Checkpoint, &ModelConfig, GroupId, GroupForm, Forms) -> Result<PreparedGroup>;

/// The vocabulary tables built off the serving thread in a new form, waiting to be swapped
/// in with the groups by [`Backend::replace_weights`].
pub struct PreparedTables {
    /// Resident bytes of the tables in their new form.
    pub bytes: usize,
    pub(crate) inner: Box<dyn Any + Send>,
}

/// Builds the vocabulary tables in a form from the checkpoint (background thread, like
/// [`GroupLoader`]).
pub type TableLoader = fn(&Checkpoint, &ModelConfig, EmbeddingDtype) -> Result<PreparedTables>;

/// A device that runs the Llama-family forward pass with per-group dual precision.
pub trait Backend: Send + 'static {
    fn config(&self) -> &ModelConfig;
    /// One forward pass over `step` (page copies already done), asking `router` for every
    /// linear group's rows and every layer's KV precision.
    fn pass(
        &self,
        step: &StepInput,
        router: &mut dyn Router,
        kv: &mut KvCache,
    ) -> Result<PassOutput>;
    fn residency(&self, g: GroupId) -> Residency;
    /// How group `g`'s quantized form is stored (meaningless when it is float-only).
    fn quant_format(&self, g: GroupId) -> QuantFormat;
    /// Group `g`'s [`ColumnError`] for the quantized form it holds (`None` without one).
    fn column_error(&self, g: GroupId) -> Option<Arc<ColumnError>> {
        let _ = g;
        None
    }
    /// Bytes of resident linear-group weights (the part the precision plan changes).
    fn linear_bytes(&self) -> usize;
    /// All resident weight bytes.
    fn resident_bytes(&self) -> usize;
    /// Resident weight bytes by form, and the all-f16 baseline.
    fn weight_bytes(&self) -> WeightBytes;
    /// All resident weight bytes once `groups` and `tables` replace what they replace: the
    /// figure [`Backend::replace_weights`] would leave, known before anything is built in.
    fn resident_bytes_after(
        &self,
        groups: &[PreparedGroup],
        tables: Option<&PreparedTables>,
    ) -> usize;
    /// How this backend stores float copies.
    fn float_dtype(&self) -> FloatDtype;
    /// Put prepared groups (and tables, when their form changes) in place, all or nothing
    /// (every replacement checked first). Called between two steps, so a step never sees a
    /// half-applied plan.
    fn replace_weights(
        &mut self,
        groups: Vec<PreparedGroup>,
        tables: Option<PreparedTables>,
    ) -> Result<()>;
    /// How this backend builds a group for [`Backend::replace_weights`].
    fn group_loader(&self) -> GroupLoader;
    /// How this backend builds the vocabulary tables for [`Backend::replace_weights`].
    fn table_loader(&self) -> TableLoader;
}
