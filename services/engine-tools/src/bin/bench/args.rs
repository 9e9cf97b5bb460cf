//! The bench's command line.

use quantmesh_engine::backend::{EmbeddingDtype, FloatDtype, Forms, SplitActivations};
use quantmesh_engine::budget::FloatBudget;
use quantmesh_engine::kv::KvScale;
use quantmesh_model::bundled::ModelSize;
use quantmesh_types::Residency;
use std::path::PathBuf;

/// Engine throughput and memory benchmark: prints tables whose ratios are against the float
/// plan measured in the same run.
#[derive(clap::Parser)]
#[command(
    name = "quantmesh-engine-bench",
    about = "Engine throughput and memory benchmark: tables of ratios against the float plan measured in the same run"
)]
pub(crate) struct Args {
    /// The bundled synthetic model to run when no --model is given: tiny, small or medium.
    #[arg(long, default_value = "small")]
    pub(crate) size: ModelSize,
    /// A GGUF file or Hugging Face directory to run instead of the bundled model.
    #[arg(long)]
    pub(crate) model: Option<PathBuf>,
    /// Text whose perplexity is measured on the float, INT8-only and monitor-driven plans
    /// (needed by --quant-formats and --memory-table for their quality columns).
    #[arg(long)]
    pub(crate) ppl_text: Option<PathBuf>,
    /// Tokens of --ppl-text to score.
    #[arg(long, default_value_t = 1024)]
    pub(crate) ppl_tokens: usize,
    /// Write the dual plan's numbers (what `quantmesh serve` runs) to this JSON file.
    #[arg(long)]
    pub(crate) json: Option<PathBuf>,
    /// Plans of the throughput table (comma-separated residencies).
    #[arg(long, value_delimiter = ',', default_value = "float,int8,dual")]
    pub(crate) plans: Vec<Residency>,
    /// Prompt tokens per sequence.
    #[arg(long, default_value_t = 128)]
    pub(crate) prompt_len: usize,
    /// Decode steps per batch.
    #[arg(long, default_value_t = 32)]
    pub(crate) decode_steps: usize,
    /// Most prompt tokens in one prefill step of the throughput table, as the server's
    /// `max_num_batched_tokens` splits a batch's prompts (first come first served); 0: every
    /// prompt of the batch in one step [default: the engine's].
    #[arg(long, default_value_t = quantmesh_engine::EngineConfig::default().max_num_batched_tokens)]
    pub(crate) step_tokens: usize,
    /// Batch sizes of the decode table (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "1,8,32")]
    pub(crate) batches: Vec<usize>,
    /// Also time every linear group on its own.
    #[arg(long)]
    pub(crate) per_group: bool,
    /// How float copies are stored: f16, bf16 or f32.
    #[arg(long, default_value = "f16", value_parser = float_dtype)]
    pub(crate) float_dtype: FloatDtype,
    /// How the vocabulary tables are stored: q8_0, f16 or f32 (the bench loads tables
    /// directly, so `auto`, which needs a plan's budget, is refused) [default: the engine's].
    #[arg(long, value_parser = embeddings)]
    pub(crate) embeddings: Option<EmbeddingDtype>,
    /// Split activations: off, copyless or all [default: the engine's].
    #[arg(long = "split-activations")]
    pub(crate) split: Option<SplitActivations>,
    /// C8 KV cache scales: token or head [default: the engine's].
    #[arg(long, value_parser = kv_scale)]
    pub(crate) kv_scale: Option<KvScale>,
    /// The float-copy dtype section (f16 / bf16 / f32 copies compared).
    #[arg(long)]
    pub(crate) float_dtypes: bool,
    /// The quantized-format section (with --ppl-text: their perplexity).
    #[arg(long)]
    pub(crate) quant_formats: bool,
    /// The memory table of this plan (needs --ppl-text).
    #[arg(long, requires = "ppl_text")]
    pub(crate) memory_table: Option<PathBuf>,
    /// Rows of the memory table to run (1-based, comma-separated; all when absent).
    #[arg(long, value_delimiter = ',')]
    pub(crate) memory_rows: Vec<usize>,
    /// Another runtime's run on the memory table's text, scored as one more row against the
    /// same float model (a JSON file: name, bytes, ids, window, logits; see
    /// scripts/bench-q4km.sh). Repeatable.
    #[arg(long, requires = "memory_table")]
    pub(crate) peer: Vec<PathBuf>,
    /// The memory table's float budget (bytes, or a share of the INT8 weights like 10%).
    #[arg(long, default_value = "10%")]
    pub(crate) float_budget: FloatBudget,
    /// The shadow pass's cost section.
    #[arg(long)]
    pub(crate) shadow_cost: bool,
    /// The activation table of this plan: each of --splits × --rotations served with the
    /// monitor (fed by --traffic) and scored on every --held-out text.
    #[arg(long)]
    pub(crate) activation_table: Option<PathBuf>,
    /// A held-out text the activation table scores (repeatable; --ppl-tokens of each).
    #[arg(long)]
    pub(crate) held_out: Vec<PathBuf>,
    /// A text the activation table's monitor watches first, in 64-token requests
    /// (repeatable; never scored).
    #[arg(long)]
    pub(crate) traffic: Vec<PathBuf>,
    /// Most monitor requests cut from --traffic.
    #[arg(long, default_value_t = 48)]
    pub(crate) traffic_requests: usize,
    /// Activation widths of the activation table (comma-separated: off, copyless, all).
    #[arg(long, value_delimiter = ',', default_value = "off,copyless,all")]
    pub(crate) splits: Vec<SplitActivations>,
    /// `engine.wide_activations` ratios the activation table serves `copyless` with
    /// (comma-separated; 0 = no wide group) [default: the engine's].
    #[arg(long, value_delimiter = ',')]
    pub(crate) wide_activations: Vec<f64>,
    /// Let activation spikes count in the activation table's monitor only where
    /// activations are 8-bit (`off`, `copyless`): the engine's earlier rule, for comparison
    /// (the engine counts them under every width).
    #[arg(long)]
    pub(crate) spikes_only_8bit: bool,
    /// After each `copyless` row of the activation table, score the text again with every
    /// position whose served top-1 probability fell below each of these bounds carried at 16
    /// bits in every group (comma-separated): once the position itself (what computing that
    /// token again would give), once the position after it (decided from the step before).
    #[arg(long, value_delimiter = ',')]
    pub(crate) uncertain_top1: Vec<f64>,
    /// Rotation blocks of the activation table (comma-separated; 0 = none).
    #[arg(long, value_delimiter = ',', default_value = "0,32,64,128")]
    pub(crate) rotations: Vec<u32>,
    /// Scale migration in the activation table (comma-separated: `plan` = the plan's
    /// smoothing factors, `none` = the same plan without them).
    #[arg(long, value_delimiter = ',', default_value = "none,plan")]
    pub(crate) smoothings: Vec<SmoothingChoice>,
    /// The activation table's monitor (comma-separated: `on` = fed by --traffic, its mask in
    /// force while scoring; `off` = every row on the plan's paths, no monitor).
    #[arg(long, value_delimiter = ',', default_value = "on")]
    pub(crate) monitors: Vec<MonitorChoice>,
    /// The Hadamard rotation block of the other sections' quantized paths (0 = none)
    /// [default: the engine's].
    #[arg(long)]
    pub(crate) rotation_block: Option<u32>,
}

impl Args {
    /// How float copies and vocabulary tables are stored (`--float-dtype`, `--embeddings`).
    pub(crate) fn forms(&self) -> Forms {
        Forms {
            float: self.float_dtype,
            embeddings: self.embeddings.unwrap_or_default(),
            split: self.split.unwrap_or_default(),
            rotation: self
                .rotation_block
                .unwrap_or(quantmesh_engine::EngineConfig::default().rotation_block),
        }
    }
}

pub(crate) fn float_dtype(s: &str) -> Result<FloatDtype, String> {
    match s {
        "f16" => Ok(FloatDtype::F16),
        "bf16" => Ok(FloatDtype::Bf16),
        "f32" => Ok(FloatDtype::F32),
        other => Err(format!("{other:?}: f16, bf16 or f32")),
    }
}

pub(crate) fn embeddings(s: &str) -> Result<EmbeddingDtype, String> {
    match s.parse()? {
        EmbeddingDtype::Auto => Err("auto needs a plan's budget: give q8_0, f16 or f32".into()),
        d => Ok(d),
    }
}

pub(crate) fn kv_scale(s: &str) -> Result<KvScale, String> {
    match s {
        "token" => Ok(KvScale::Token),
        "head" => Ok(KvScale::Head),
        other => Err(format!("{other:?}: token or head")),
    }
}

/// [`Args::smoothings`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum SmoothingChoice {
    None,
    Plan,
}

/// [`Args::monitors`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum MonitorChoice {
    On,
    Off,
}
