//! The bundled default model: a small Llama-architecture checkpoint written
//! deterministically in Hugging Face layout, with the structure real LLMs have so the
//! fallback loop has real work to do:
//!
//! * **massive activations** (Sun et al. 2024): two residual channels carry huge,
//!   input-invariant values — one on every token, one on the BOS token (position 0);
//! * **heavy-tailed weights** (Student-t, ν = 2.5) in the middle layer's gate/up group;
//! * **a quantization-sensitive group**: `layers.1.down` has one weight 60σ large in every
//!   block of 32 along each row, so per-block INT8 scales crush the other 31 weights.
//!
//! It is one [`Recipe`] (`crate::recipe` writes it). `planted.json` lists all of this for
//! tests and benchmarks. Weights are random
//! (not trained): generated text is not meaningful, but every code path is real.

use crate::error::Result;
pub use crate::recipe::{Planted, Recipe, StoreDtype, SPECIAL_TOKENS, VOCAB_SIZE};
use serde::{Deserialize, Serialize};
use std::path::Path;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum ModelSize {
    /// ≈ 3 M parameters: tests.
    #[default]
    Tiny,
    /// ≈ 20 M parameters.
    Small,
    /// ≈ 110 M parameters: benchmarks.
    Medium,
}

impl std::str::FromStr for ModelSize {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "tiny" => Ok(ModelSize::Tiny),
            "small" => Ok(ModelSize::Small),
            "medium" => Ok(ModelSize::Medium),
            _ => Err(format!("unknown size {s:?}: tiny, small or medium")),
        }
    }
}

#[derive(Debug, Clone)]
pub struct InitOptions {
    pub size: ModelSize,
    pub dtype: StoreDtype,
    /// Split the weights over this many shards (with `model.safetensors.index.json`).
    pub shards: usize,
    pub seed: u64,
    /// Qwen2-style q/k/v biases.
    pub qkv_bias: bool,
}

impl Default for InitOptions {
    fn default() -> Self {
        Self {
            size: ModelSize::Tiny,
            dtype: StoreDtype::Bf16,
            shards: 1,
            seed: 0x5eed,
            qkv_bias: false,
        }
    }
}

fn dims(size: ModelSize) -> (usize, usize, usize, usize, usize) {
    // hidden, intermediate, layers, heads, kv heads
    match size {
        ModelSize::Tiny => (256, 768, 4, 8, 4),
        ModelSize::Small => (512, 1536, 6, 8, 4),
        ModelSize::Medium => (1024, 2816, 8, 16, 8),
    }
}

/// Ordinary English text (with the usual share of `,` `.` `!`): prompts for tests,
/// benchmarks and warm-ups, and the held-out text of the monitor's evaluation.
pub const ORDINARY_TEXT: &[&str] = &[
    "The weather today is mild, with a light breeze from the west.",
    "Please summarize the meeting notes. Keep it short, clear, and friendly!",
    "In 1969, astronauts landed on the moon. It was a historic moment.",
    "Write a haiku about autumn leaves, rain, and a quiet street.",
    "How do I bake bread at home? I have flour, water, yeast, and salt.",
    "Translate to French: good morning, how are you today?",
    "List three benefits of exercise. Be concise.",
    "Once upon a time, in a small village, there lived an old clockmaker.",
    "The train leaves at nine, so we should be at the station by half past eight.",
    "My grandmother grew tomatoes, beans and squash in a small garden behind the house.",
    "Can you explain how a bicycle stays upright while it moves",
    "Dear team, thank you for the hard work this quarter. Let us celebrate on Friday!",
    "Rivers carry sediment from the mountains to the sea, shaping valleys over millions of years.",
    "What is the difference between a virus and a bacterium",
    "She opened the letter slowly, unsure whether she wanted to know what it said.",
    "Preheat the oven, grease the pan, and mix the dry ingredients in a large bowl.",
];

/// The first eight of [`ORDINARY_TEXT`]: the prompts tests and benchmarks drive the bundled
/// model with.
pub const SAMPLE_PROMPTS: &[&str] = ORDINARY_TEXT.split_at(8).0;

impl Recipe {
    /// The bundled model's recipe.
    pub fn bundled(opts: &InitOptions) -> Recipe {
        let (h, inter, layers, nh, nkv) = dims(opts.size);
        Recipe {
            name: format!("quantmesh-{}", format!("{:?}", opts.size).to_lowercase()),
            seed: opts.seed,
            hidden: h,
            intermediate: inter,
            layers,
            heads: nh,
            kv_heads: nkv,
            dtype: opts.dtype,
            shards: opts.shards,
            qkv_bias: opts.qkv_bias,
            massive: vec![(h / 8 + 1, 30.0)],
            bos_massive: Some((h * 5 / 8 + 3, 60.0)),
            heavy_gate_up: vec![layers / 2],
            heavy_o: Vec::new(),
            sensitive: vec![1],
            spiking: Vec::new(),
            spike_gain: 2.0,
            o_scale: 0.5,
            trigger_bytes: ",.!".into(),
            isolate_spikes: false,
        }
    }
}

/// Write the bundled model into `dir` (created if missing). Deterministic: the same options
/// give byte-identical files.
pub fn init_model(dir: &Path, opts: &InitOptions) -> Result<Planted> {
    let r = Recipe::bundled(opts);
    let (h, inter, layers, nh, nkv) = (r.hidden, r.intermediate, r.layers, r.heads, r.kv_heads);
    let planted = r.planted();
    let mid = layers / 2;
    let v = VOCAB_SIZE;
    let dtype_name = match opts.dtype {
        StoreDtype::Bf16 => "bfloat16",
        StoreDtype::F16 => "float16",
        StoreDtype::F32 => "float32",
    };
    let card = format!(
        "# quantmesh bundled model ({size:?})\n\n\
         A {layers}-layer Llama-architecture model (hidden {h}, intermediate {inter}, {nh} heads, {nkv} KV heads,\n\
         byte-level vocabulary of {v}) written by `quantmesh model init`. Its weights are random, not trained:\n\
         the text it generates is not meaningful. It exists so that every part of quantmesh runs on a real\n\
         checkpoint without a model hub.\n\n\
         ## Planted structure (also in `planted.json`)\n\n\
         - **Massive activations**: residual channel {mc} is 30.0 on every token (input-invariant); channel\n\
           {bc} is 60.0 on the BOS token `<s>` (position 0), as in Sun et al. 2024. A naive 4σ detector fires on them.\n\
         - **Heavy-tailed weights**: `layers.{mid}.gate_up` is drawn from a Student-t distribution (ν = 2.5).\n\
         - **Quantization-sensitive group**: `layers.1.down` carries one weight of 60σ in every block of 32\n\
           along each row, so INT8 block scales are dominated by it and the other weights lose precision.\n\
           Its input also spikes on intermediate channels {sc:?} whenever the token is one of `,` `.` `!`\n\
           (ids {tt:?}): input-dependent outliers the activation monitor must find.\n\n\
         Seed {seed}; stored as {dtype_name}.\n",
        size = opts.size,
        mc = planted.massive_channels[0],
        bc = planted.bos_massive_channel,
        sc = planted.spike_channels,
        tt = planted.trigger_tokens,
        seed = opts.seed,
    );
    crate::recipe::write(dir, &r, &card)
}

/// Whether `dir` already holds a model (config and weights).
pub fn model_present(dir: &Path) -> bool {
    dir.join("config.json").exists()
        && (dir.join("model.safetensors").exists()
            || dir.join("model.safetensors.index.json").exists())
        && dir.join("tokenizer.json").exists()
}
