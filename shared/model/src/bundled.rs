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
//! `planted.json` lists all of this for tests and benchmarks. Weights are random
//! (not trained): generated text is not meaningful, but every code path is real.

use crate::checkpoint::write_safetensors;
use crate::error::{ModelError, Result};
use crate::names;
use quantmesh_types::GroupKind;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use rand_distr::{Distribution, Normal, StudentT};
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

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum StoreDtype {
    #[default]
    Bf16,
    F16,
    F32,
}

impl std::str::FromStr for StoreDtype {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "bf16" => Ok(StoreDtype::Bf16),
            "f16" => Ok(StoreDtype::F16),
            "f32" => Ok(StoreDtype::F32),
            _ => Err(format!("unknown dtype {s:?}: bf16, f16 or f32")),
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

/// What was planted, machine-readable (`planted.json`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Planted {
    /// Residual-stream channels with massive activations on every token.
    pub massive_channels: Vec<usize>,
    /// Channel with a massive activation on the BOS token only, and that token's position.
    pub bos_massive_channel: usize,
    pub massive_positions: Vec<usize>,
    /// Groups (like `layers.2.gate_up`) with heavy-tailed weights.
    pub heavy_tailed_groups: Vec<String>,
    /// Groups made deliberately quantization-sensitive.
    pub sensitive_groups: Vec<String>,
    /// Token ids that make the sensitive group's input spike (input-dependent outliers).
    pub trigger_tokens: Vec<u32>,
    /// Intermediate channels of the sensitive group's input that spike on trigger tokens.
    pub spike_channels: Vec<usize>,
}

pub const SPECIAL_TOKENS: [&str; 6] = [
    "<s>",
    "</s>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|end|>",
];
const CHAT_TEMPLATE: &str = "{{ bos_token }}{% for m in messages %}<|{{ m.role }}|>\n{{ m.content }}<|end|>\n{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}";

/// GPT-2's byte → printable character map, so token id = byte value.
fn byte_char(b: u8) -> char {
    let printable = |b: u8| {
        (b'!'..=b'~').contains(&b) || (0xA1..=0xAC).contains(&b) || (0xAE..=0xFF).contains(&b)
    };
    if printable(b) {
        b as char
    } else {
        let n = (0..b).filter(|&x| !printable(x)).count() as u32;
        char::from_u32(256 + n).unwrap_or('?')
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

pub const VOCAB_SIZE: usize = 320;

/// Ordinary English prompts (with the usual share of `,` `.` `!`) used by tests,
/// benchmarks and warm-ups to drive the bundled model like real traffic.
pub const SAMPLE_PROMPTS: &[&str] = &[
    "The weather today is mild, with a light breeze from the west.",
    "Please summarize the meeting notes. Keep it short, clear, and friendly!",
    "In 1969, astronauts landed on the moon. It was a historic moment.",
    "Write a haiku about autumn leaves, rain, and a quiet street.",
    "How do I bake bread at home? I have flour, water, yeast, and salt.",
    "Translate to French: good morning, how are you today?",
    "List three benefits of exercise. Be concise.",
    "Once upon a time, in a small village, there lived an old clockmaker.",
];

fn write_json(path: &Path, v: &impl Serialize) -> Result<()> {
    let text = serde_json::to_string_pretty(v).map_err(|e| ModelError::Config(e.to_string()))?;
    std::fs::write(path, text + "\n")
        .map_err(|e| ModelError::io(format!("writing {}", path.display()), e))
}

fn write_tokenizer(dir: &Path) -> Result<()> {
    use tokenizers::models::bpe::BPE;
    use tokenizers::pre_tokenizers::byte_level::ByteLevel;
    use tokenizers::{AddedToken, Tokenizer};
    let vocab: tokenizers::models::bpe::Vocab = (0..=255u8)
        .map(|b| (byte_char(b).to_string(), b as u32))
        .collect();
    let bpe = BPE::builder()
        .vocab_and_merges(vocab, Vec::new())
        .build()
        .map_err(|e| ModelError::Tokenizer(e.to_string()))?;
    let mut tok = Tokenizer::new(bpe);
    tok.with_pre_tokenizer(Some(ByteLevel::new(false, true, true)));
    tok.with_decoder(Some(ByteLevel::new(false, true, true)));
    let specials: Vec<AddedToken> = SPECIAL_TOKENS
        .iter()
        .map(|t| AddedToken::from(*t, true))
        .collect();
    let _added = tok.add_special_tokens(specials);
    let path = dir.join("tokenizer.json");
    tok.save(&path, true)
        .map_err(|e| ModelError::Tokenizer(format!("{}: {e}", path.display())))?;
    write_json(
        &dir.join("tokenizer_config.json"),
        &serde_json::json!({
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": "<s>",
            "eos_token": "</s>",
            "add_bos_token": true,
            "chat_template": CHAT_TEMPLATE,
            "model_max_length": 2048,
        }),
    )
}

/// Write the bundled model into `dir` (created if missing). Deterministic: the same options
/// give byte-identical files.
pub fn init_model(dir: &Path, opts: &InitOptions) -> Result<Planted> {
    std::fs::create_dir_all(dir)
        .map_err(|e| ModelError::io(format!("creating {}", dir.display()), e))?;
    let (h, inter, layers, nh, nkv) = dims(opts.size);
    let hd = h / nh;
    let v = VOCAB_SIZE;
    let mut rng = StdRng::seed_from_u64(opts.seed);
    let mid = layers / 2;
    let planted = Planted {
        massive_channels: vec![h / 8 + 1],
        bos_massive_channel: h * 5 / 8 + 3,
        massive_positions: vec![0],
        heavy_tailed_groups: vec![format!("layers.{mid}.gate_up")],
        sensitive_groups: vec!["layers.1.down".to_string()],
        trigger_tokens: b",.!".iter().map(|&b| b as u32).collect(),
        spike_channels: vec![7, inter / 3 + 1, inter / 2 + 5, inter - 9],
    };
    let bos = 256usize;

    let normal = |rng: &mut StdRng, n: usize, std: f32| -> Vec<f32> {
        let d = Normal::new(0.0f32, std).unwrap_or_else(|_| Normal::new(0.0, 1.0).expect("valid"));
        (0..n).map(|_| d.sample(rng)).collect()
    };
    let mut tensors: Vec<(String, Vec<usize>, Vec<f32>)> = Vec::new();

    let mut embed = normal(&mut rng, v * h, 1.0);
    for t in 0..v {
        for &c in &planted.massive_channels {
            embed[t * h + c] = 30.0;
        }
    }
    embed[bos * h + planted.bos_massive_channel] = 60.0;
    let embed_rows = embed.clone();
    tensors.push((names::EMBED.into(), vec![v, h], embed));

    for l in 0..layers {
        // Real models learn small norm gains on massive channels; keep them at 1 so the
        // monitor sees the massive values, but damp them a little in later layers.
        let mut norm_w = vec![1.0f32; h];
        norm_w
            .iter_mut()
            .enumerate()
            .for_each(|(i, w)| *w += 0.05 * ((i * 7 + l) % 5) as f32 / 5.0);
        tensors.push((names::input_norm(l), vec![h], norm_w.clone()));
        tensors.push((names::post_norm(l), vec![h], norm_w));
        let std_in = |fan_in: usize| 1.0 / (fan_in as f32).sqrt();
        let qkv = names::members(GroupKind::Qkv);
        for (name, out, inp) in [
            (qkv[0], nh * hd, h),
            (qkv[1], nkv * hd, h),
            (qkv[2], nkv * hd, h),
        ] {
            tensors.push((
                names::member_weight(l, name),
                vec![out, inp],
                normal(&mut rng, out * inp, std_in(inp)),
            ));
            if opts.qkv_bias {
                tensors.push((
                    names::member_bias(l, name),
                    vec![out],
                    normal(&mut rng, out, 0.02),
                ));
            }
        }
        tensors.push((
            names::member_weight(l, names::members(GroupKind::O)[0]),
            vec![h, nh * hd],
            normal(&mut rng, h * nh * hd, std_in(nh * hd) * 0.5),
        ));
        for name in names::members(GroupKind::GateUp) {
            let mut w: Vec<f32> = if l == mid {
                let t = StudentT::new(2.5f32).map_err(|e| ModelError::Config(e.to_string()))?;
                (0..inter * h)
                    .map(|_| t.sample(&mut rng) * std_in(h) * 0.5)
                    .collect()
            } else {
                normal(&mut rng, inter * h, std_in(h))
            };
            if l == 1 {
                // Input-dependent outliers feeding the sensitive down projection: a few
                // intermediate channels read the trigger tokens' embedding direction, so
                // SwiGLU spikes on those tokens and stays small elsewhere.
                let mut dir = vec![0f32; h];
                for &t in &planted.trigger_tokens {
                    let row = &embed_rows[t as usize * h..(t as usize + 1) * h];
                    let norm: f32 = row.iter().map(|x| x * x).sum::<f32>().sqrt().max(1e-6);
                    dir.iter_mut()
                        .zip(row)
                        .for_each(|(d, x)| *d += 2.0 * x / norm);
                }
                for &c in planted
                    .massive_channels
                    .iter()
                    .chain([&planted.bos_massive_channel])
                {
                    dir[c] = 0.0;
                }
                for &j in &planted.spike_channels {
                    w[j * h..(j + 1) * h].copy_from_slice(&dir);
                }
            }
            tensors.push((names::member_weight(l, name), vec![inter, h], w));
        }
        let mut down = normal(&mut rng, h * inter, std_in(inter) * 0.5);
        if l == 1 {
            let sigma = std_in(inter) * 0.5;
            for row in 0..h {
                for block in 0..inter / 32 {
                    let j = block * 32 + (row + block) % 32;
                    let sign = if rng.gen::<bool>() { 1.0 } else { -1.0 };
                    down[row * inter + j] = sign * 60.0 * sigma;
                }
            }
        }
        let down_name = names::member_weight(l, names::members(GroupKind::Down)[0]);
        tensors.push((down_name, vec![h, inter], down));
    }
    tensors.push((names::FINAL_NORM.into(), vec![h], vec![1.0; h]));
    // The every-token massive channel doubles as a bias (as in real models): it pushes
    // printable ASCII up and everything else down, so sampled text is readable noise
    // rather than control bytes.
    let mut lm_head = normal(&mut rng, v * h, 1.0 / (h as f32).sqrt());
    let mc = planted.massive_channels[0];
    for t in 0..v {
        let printable = (0x20..0x7f).contains(&t) || t == b'\n' as usize;
        lm_head[t * h + mc] = if printable { 0.05 } else { -0.5 };
    }
    tensors.push((names::LM_HEAD.into(), vec![v, h], lm_head));

    let (dtype, dtype_name) = match opts.dtype {
        StoreDtype::Bf16 => (safetensors::Dtype::BF16, "bfloat16"),
        StoreDtype::F16 => (safetensors::Dtype::F16, "float16"),
        StoreDtype::F32 => (safetensors::Dtype::F32, "float32"),
    };
    // Remove stale shards from an earlier init with another layout.
    if let Ok(rd) = std::fs::read_dir(dir) {
        for e in rd.flatten() {
            let n = e.file_name().to_string_lossy().to_string();
            if n.ends_with(".safetensors") || n == "model.safetensors.index.json" {
                let _ = std::fs::remove_file(e.path());
            }
        }
    }
    let shards = opts.shards.max(1);
    if shards == 1 {
        write_safetensors(&dir.join("model.safetensors"), &tensors, dtype)?;
    } else {
        let per = tensors.len().div_ceil(shards);
        let mut weight_map = serde_json::Map::new();
        let mut total = 0usize;
        for (i, chunk) in tensors.chunks(per).enumerate() {
            let name = format!("model-{:05}-of-{:05}.safetensors", i + 1, shards);
            for (t, _, d) in chunk {
                weight_map.insert(t.clone(), serde_json::Value::String(name.clone()));
                total += d.len()
                    * if dtype == safetensors::Dtype::F32 {
                        4
                    } else {
                        2
                    };
            }
            write_safetensors(&dir.join(&name), chunk, dtype)?;
        }
        write_json(
            &dir.join("model.safetensors.index.json"),
            &serde_json::json!({"metadata": {"total_size": total}, "weight_map": weight_map}),
        )?;
    }

    let model_type = if opts.qkv_bias { "qwen2" } else { "llama" };
    write_json(
        &dir.join("config.json"),
        &serde_json::json!({
            "architectures": [if opts.qkv_bias { "Qwen2ForCausalLM" } else { "LlamaForCausalLM" }],
            "model_type": model_type,
            "hidden_size": h,
            "intermediate_size": inter,
            "num_hidden_layers": layers,
            "num_attention_heads": nh,
            "num_key_value_heads": nkv,
            "vocab_size": v,
            "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0,
            "max_position_embeddings": 2048,
            "tie_word_embeddings": false,
            "bos_token_id": 256,
            "eos_token_id": [257, 261],
            "torch_dtype": dtype_name,
            "_name_or_path": format!("quantmesh-{}", format!("{:?}", opts.size).to_lowercase()),
        }),
    )?;
    write_tokenizer(dir)?;
    write_json(&dir.join("planted.json"), &planted)?;
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
    std::fs::write(dir.join("README.md"), card)
        .map_err(|e| ModelError::io("writing model card", e))?;
    Ok(planted)
}

/// Whether `dir` already holds a model (config and weights).
pub fn model_present(dir: &Path) -> bool {
    dir.join("config.json").exists()
        && (dir.join("model.safetensors").exists()
            || dir.join("model.safetensors.index.json").exists())
        && dir.join("tokenizer.json").exists()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_chars_are_distinct() {
        let set: std::collections::HashSet<char> = (0..=255u8).map(byte_char).collect();
        assert_eq!(set.len(), 256);
        assert_eq!(byte_char(b'a'), 'a');
        assert_eq!(byte_char(b' '), '\u{120}');
    }
}
