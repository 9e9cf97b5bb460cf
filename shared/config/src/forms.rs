//! The forms weights are stored and computed in, as the configuration names them.

pub use quantmesh_types::EmbeddingDtype;
use serde::{Deserialize, Serialize};

/// Which rows on the quantized path carry their activations to ≈ 16 bits (W8A16): the
/// weights' quantization error stays, the activations' goes, no extra memory
/// (`engine.split_activations`). On Q8_0 weights the kernel quantizes such rows to 16 bits
/// in the same single pass as 8-bit ones; on candle's 4-bit kernels a row is split into two
/// 8-bit parts (the kernel's own quantization and its remainder) run as twice the rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SplitActivations {
    /// None: the plain W8A8 kernel everywhere (on Q8_0 as fast as `all`; on 4-bit groups
    /// about twice as fast); rows that want float in a group without a float copy are only
    /// counted as "wanted fallback, unavailable".
    Off,
    /// Rows that want float in a group without a float copy (INT8-only, e.g. over the float
    /// budget): a fallback that costs no memory. The other rows take 8-bit activations; the
    /// Q8_0 `lm_head` takes 16-bit ones (it has no float copy and is not monitored).
    Copyless,
    /// `copyless` on the 4-bit groups and `all` on the Q8_0 ones (every Q8_0 group wide):
    /// for CPUs where the 8-bit product costs the same at either width but the 4-bit one
    /// is much cheaper with 8-bit activations (AVX2's byte kernel multiplies the nibbles as
    /// bytes), so a plan that stores groups in 4 bits (a weight budget) reads its bytes at
    /// the speed of the byte kernel while the Q8_0 groups keep `all`'s quality.
    CopylessQ4,
    /// Every row on the quantized path, the Q8_0 `lm_head` included: with it the first-load
    /// plan (0.56× all-f16's bytes) is closer to the float model than every group dual in
    /// f32 (2.4×), on SmolLM2 and on the bundled model (docs/design/precision.md, "Split
    /// activations").
    All,
    /// The default, measured at start-up on this machine: `copyless` where 16-bit
    /// activations cost meaningfully more than 8-bit ones (AMX, AVX-512 run as two halves);
    /// else, for a plan with 4-bit groups, `copyless_q4` where they cost meaningfully more
    /// on the 4-bit product; else `all`. The engine resolves it before loading; a backend never sees it (it would
    /// serve as `all`).
    #[default]
    Auto,
}

impl std::str::FromStr for SplitActivations {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "off" => Ok(SplitActivations::Off),
            "copyless" => Ok(SplitActivations::Copyless),
            "copyless_q4" => Ok(SplitActivations::CopylessQ4),
            "all" => Ok(SplitActivations::All),
            "auto" => Ok(SplitActivations::Auto),
            other => Err(format!(
                "{other:?} is not off, copyless, copyless_q4, all or auto"
            )),
        }
    }
}

impl SplitActivations {
    /// Whether a row on the quantized path is split: `wanted_float` when it asked for the
    /// float path in a group without a float copy.
    pub fn splits(self, wanted_float: bool) -> bool {
        match self {
            SplitActivations::Off => false,
            SplitActivations::Copyless | SplitActivations::CopylessQ4 => wanted_float,
            SplitActivations::All | SplitActivations::Auto => true,
        }
    }

    /// Whether rows that want float in a group without a float copy are served split,
    /// the others at 8 bits (`copyless` and `copyless_q4`; under `copyless_q4` the Q8_0
    /// groups are wide, so only its 4-bit groups' rows run at 8 bits).
    pub fn copyless(self) -> bool {
        matches!(
            self,
            SplitActivations::Copyless | SplitActivations::CopylessQ4
        )
    }

    /// Whether the vocabulary projection (`lm_head`, never watched by the monitor and never
    /// with a float copy) runs with split activations: under every mode but `off`. Under
    /// `copyless` its 8-bit activations were the whole measured distance to `all` on
    /// SmolLM2 with the monitor on (docs/MEASUREMENTS.md, "The vocabulary projection under
    /// `copyless`").
    pub fn splits_table(self) -> bool {
        self != SplitActivations::Off
    }

    pub fn as_str(self) -> &'static str {
        match self {
            SplitActivations::Off => "off",
            SplitActivations::Copyless => "copyless",
            SplitActivations::CopylessQ4 => "copyless_q4",
            SplitActivations::All => "all",
            SplitActivations::Auto => "auto",
        }
    }
}

/// How float copies are stored; the float path computes in this dtype (f32 in and out).
/// 16-bit halves the memory of a float copy. Measured on the CPU backend
/// (`quantmesh-engine-bench --float-dtypes`): f16 0.75–0.97× the f32 time at batch 1, 2–4× at
/// batch 8–32; bf16 slower still.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FloatDtype {
    #[default]
    F16,
    Bf16,
    F32,
}

impl FloatDtype {
    pub fn bytes(self) -> usize {
        match self {
            FloatDtype::F16 | FloatDtype::Bf16 => 2,
            FloatDtype::F32 => 4,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            FloatDtype::F16 => "f16",
            FloatDtype::Bf16 => "bf16",
            FloatDtype::F32 => "f32",
        }
    }
}

/// How a backend stores what the precision plan does not decide.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Forms {
    /// Float copies of linear groups.
    pub float: FloatDtype,
    /// Token embedding and `lm_head`.
    pub embeddings: EmbeddingDtype,
    /// Which quantized-path rows run with split activations.
    pub split: SplitActivations,
    /// Block of the Hadamard rotation the quantized path applies to activations (and, once
    /// at load, to the quantized weights' rows) before they are quantized; 0: none
    /// (`engine.rotation_block`).
    pub rotation: u32,
}

impl Forms {
    /// f32 everywhere: the exact reference the tests and benchmarks compare against.
    pub const EXACT: Forms = Forms {
        float: FloatDtype::F32,
        embeddings: EmbeddingDtype::F32,
        split: SplitActivations::Off,
        rotation: 0,
    };
}
