//! Planted-truth checkpoints: a [`Recipe`] says what structure a synthetic Llama checkpoint
//! carries (dimensions, massive channels, heavy-tailed weights, input-dependent sensitive
//! MLPs) and [`write`] turns it into a Hugging Face directory (`config.json`,
//! safetensors single or sharded in f32/f16/bf16, byte-level tokenizer with a chat template,
//! `planted.json`, a model card). The bundled model is one recipe
//! ([`Recipe::bundled`]); the monitor's evaluation suite draws many others
//! ([`Recipe::family`]) so that no rule is tuned to one model.
//!
//! Weights are random (not trained). What is planted, and how:
//! * **massive channels** `(channel, magnitude)`: the embedding carries the magnitude on that
//!   residual channel for every token (input-invariant, as in Sun et al. 2024);
//! * **a BOS massive channel**: large on the BOS token only (position 0, the attention sink);
//! * **heavy-tailed weights**: Student-t (ν = 2.5) `gate_up` or `o` weights in chosen layers;
//! * **sensitive MLPs**: in a chosen layer, a few intermediate channels read the trigger
//!   tokens' embedding direction, so `down`'s input spikes on those tokens (`, . !`, and `e`
//!   in the evaluation family: ≈ 8 % of ordinary text) and
//!   stays small elsewhere; and `down` carries one weight of 60σ in every block of 32 along
//!   each row, so per-block INT8 scales crush the rest. INT8 hurts exactly there.

use crate::checkpoint::write_safetensors;
use crate::error::{ModelError, Result};
use crate::names;
use quantmesh_types::GroupKind;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use rand_distr::{Distribution, Normal, StudentT};
use serde::{Deserialize, Serialize};
use std::path::Path;

/// How the weights are stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
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

impl std::fmt::Display for StoreDtype {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            StoreDtype::Bf16 => "bf16",
            StoreDtype::F16 => "f16",
            StoreDtype::F32 => "f32",
        })
    }
}

/// What a synthetic checkpoint looks like.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Recipe {
    /// `_name_or_path` in `config.json` and the model card's title.
    pub name: String,
    pub seed: u64,
    pub hidden: usize,
    pub intermediate: usize,
    pub layers: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub dtype: StoreDtype,
    /// Split the weights over this many shards (with `model.safetensors.index.json`).
    pub shards: usize,
    /// Qwen2-style q/k/v biases.
    pub qkv_bias: bool,
    /// Residual channels with a massive value on every token: (channel, magnitude).
    pub massive: Vec<(usize, f32)>,
    /// Channel and magnitude of the BOS-only massive activation.
    pub bos_massive: Option<(usize, f32)>,
    /// Layers whose `gate_up` weights are heavy-tailed.
    pub heavy_gate_up: Vec<usize>,
    /// Layers whose `o` weights are heavy-tailed.
    pub heavy_o: Vec<usize>,
    /// Layers whose MLP is planted sensitive (input spikes at `down` + INT8-hostile `down`).
    pub sensitive: Vec<usize>,
    /// Layers whose `down` input spikes on the trigger tokens as in a sensitive MLP, while
    /// `down` reads the spike channels with zero weights (as trained models pair massive
    /// activations with negligible weights) and is otherwise ordinary: harm that only 8-bit
    /// activations feel, through the spikes' share of their quantization blocks.
    #[serde(default)]
    pub spiking: Vec<usize>,
    /// How strongly the spike channels read the trigger direction: the gain on the trigger
    /// embeddings' unit direction (bundled: 2.0), or with `isolate_spikes` the pre-activation
    /// reached on a trigger token's RMS-normalized embedding (family: 5, so SwiGLU gives
    /// ≈ 25 against ordinary abs-maxes of 3–6).
    pub spike_gain: f32,
    /// Scale of the `o` weights relative to 1/√fan-in (bundled: 0.5).
    pub o_scale: f32,
    /// Bytes whose tokens make the sensitive MLPs' input spike (bundled: `,.!`).
    pub trigger_bytes: String,
    /// Keep the INT8-hostile `down` weights off the spike channels' columns, so a spike
    /// leaves the layer as an ordinary dense vector instead of writing new input-dependent
    /// outliers into the residual stream for later layers (bundled: false).
    pub isolate_spikes: bool,
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
    /// Groups made deliberately quantization-sensitive (their input spikes on trigger tokens).
    pub sensitive_groups: Vec<String>,
    /// Token ids that make the sensitive groups' input spike (input-dependent outliers).
    pub trigger_tokens: Vec<u32>,
    /// Intermediate channels of the sensitive groups' input that spike on trigger tokens.
    pub spike_channels: Vec<usize>,
}

pub const VOCAB_SIZE: usize = 320;
pub const BOS: usize = 256;

impl Recipe {
    /// The planted truth this recipe writes.
    pub fn planted(&self) -> Planted {
        let inter = self.intermediate;
        Planted {
            massive_channels: self.massive.iter().map(|m| m.0).collect(),
            bos_massive_channel: self.bos_massive.map_or(0, |b| b.0),
            massive_positions: vec![0],
            heavy_tailed_groups: self
                .heavy_gate_up
                .iter()
                .map(|l| format!("layers.{l}.gate_up"))
                .chain(self.heavy_o.iter().map(|l| format!("layers.{l}.o")))
                .collect(),
            sensitive_groups: self
                .sensitive
                .iter()
                .map(|l| format!("layers.{l}.down"))
                .collect(),
            trigger_tokens: self.trigger_bytes.bytes().map(u32::from).collect(),
            spike_channels: vec![7, inter / 3 + 1, inter / 2 + 5, inter - 9],
        }
    }

    /// A family of `n` varied recipes for the evaluation suite, drawn from `seed`: hidden
    /// 128–320, 3–6 layers, f32/f16/bf16, single or sharded, 1–4 massive channels (often
    /// equal in magnitude), 0, 1 or 2 sensitive MLPs, heavy-tailed `gate_up`/`o` weights, and
    /// attention-output scales that make the `o` statistic low-variance. Recipe `i` of a
    /// family has no sensitive MLP when `i % 3 == 0` (the clean models false fallbacks are
    /// counted on).
    pub fn family(seed: u64, n: usize) -> Vec<Recipe> {
        let mut rng = StdRng::seed_from_u64(seed);
        (0..n)
            .map(|i| {
                let heads = [4usize, 6, 8][rng.gen_range(0..3)];
                let head_dim = [16usize, 32][rng.gen_range(0..2)];
                let hidden = heads * head_dim * if heads * head_dim < 128 { 2 } else { 1 };
                let heads = hidden / head_dim;
                let kv_heads = if heads.is_multiple_of(2) {
                    heads / 2
                } else {
                    heads
                };
                let intermediate = (hidden * rng.gen_range(2..4)).div_ceil(32) * 32;
                let layers = rng.gen_range(3..7);
                let n_massive = rng.gen_range(1..5);
                let equal = rng.gen_bool(0.6);
                let mut chans: Vec<usize> = Vec::new();
                while chans.len() < n_massive {
                    let c = rng.gen_range(1..hidden);
                    if !chans.contains(&c) {
                        chans.push(c);
                    }
                }
                let base = rng.gen_range(25.0f32..60.0);
                let massive = chans
                    .iter()
                    .enumerate()
                    .map(|(j, &c)| {
                        (
                            c,
                            if equal {
                                base
                            } else {
                                base * (1.0 + j as f32 * 0.5)
                            },
                        )
                    })
                    .collect();
                let mut bos = rng.gen_range(1..hidden);
                while chans.contains(&bos) {
                    bos = (bos + 1) % hidden;
                }
                let n_sensitive = match i % 3 {
                    0 => 0,
                    1 => 1,
                    _ => 2,
                }
                .min(layers - 1);
                let mut sensitive: Vec<usize> = Vec::new();
                while sensitive.len() < n_sensitive {
                    let l = rng.gen_range(0..layers);
                    if !sensitive.contains(&l) {
                        sensitive.push(l);
                    }
                }
                sensitive.sort_unstable();
                let heavy_gate_up = vec![rng.gen_range(0..layers)];
                let heavy_o = vec![rng.gen_range(0..layers)];
                let dtype = [StoreDtype::F32, StoreDtype::F16, StoreDtype::Bf16][i % 3];
                let shards = if rng.gen_bool(0.4) { 2 } else { 1 };
                Recipe {
                    name: format!("planted-{seed}-{i}"),
                    seed: rng.gen(),
                    hidden,
                    intermediate,
                    layers,
                    heads,
                    kv_heads,
                    dtype,
                    shards,
                    qkv_bias: false,
                    massive,
                    bos_massive: Some((bos, rng.gen_range(40.0f32..80.0))),
                    heavy_gate_up,
                    heavy_o,
                    sensitive,
                    spiking: Vec::new(),
                    spike_gain: 5.0,
                    o_scale: [0.25f32, 0.5, 1.0][rng.gen_range(0..3)],
                    // `e` makes ~8 % of ordinary text's tokens spike (the field report's rate)
                    trigger_bytes: ",.!e".into(),
                    isolate_spikes: true,
                }
            })
            .collect()
    }
}

pub(crate) fn write_json(path: &Path, v: &impl Serialize) -> Result<()> {
    let text = serde_json::to_string_pretty(v).map_err(|e| ModelError::Config(e.to_string()))?;
    std::fs::write(path, text + "\n")
        .map_err(|e| ModelError::io(format!("writing {}", path.display()), e))
}

fn normal(rng: &mut StdRng, n: usize, std: f32) -> Vec<f32> {
    let d = Normal::new(0.0f32, std).unwrap_or_else(|_| Normal::new(0.0, 1.0).expect("valid"));
    (0..n).map(|_| d.sample(rng)).collect()
}

fn student_t(rng: &mut StdRng, n: usize, scale: f32) -> Result<Vec<f32>> {
    let t = StudentT::new(2.5f32).map_err(|e| ModelError::Config(e.to_string()))?;
    Ok((0..n).map(|_| t.sample(rng) * scale).collect())
}

/// The tensors of `r`, in writing order (deterministic in `r`).
/// A named tensor: (name, shape, values).
type NamedTensor = (String, Vec<usize>, Vec<f32>);

fn tensors(r: &Recipe, planted: &Planted) -> Result<Vec<NamedTensor>> {
    let (h, inter, nh, nkv) = (r.hidden, r.intermediate, r.heads, r.kv_heads);
    let hd = h / nh;
    let v = VOCAB_SIZE;
    let mut rng = StdRng::seed_from_u64(r.seed);
    let mut tensors: Vec<NamedTensor> = Vec::new();

    let mut embed = normal(&mut rng, v * h, 1.0);
    for t in 0..v {
        for &(c, m) in &r.massive {
            embed[t * h + c] = m;
        }
    }
    if let Some((c, m)) = r.bos_massive {
        embed[BOS * h + c] = m;
    }
    let embed_rows = embed.clone();
    tensors.push((names::EMBED.into(), vec![v, h], embed));

    let std_in = |fan_in: usize| 1.0 / (fan_in as f32).sqrt();
    for l in 0..r.layers {
        // Real models learn small norm gains on massive channels; keep them at 1 so the
        // monitor sees the massive values, but vary them a little.
        let mut norm_w = vec![1.0f32; h];
        norm_w
            .iter_mut()
            .enumerate()
            .for_each(|(i, w)| *w += 0.05 * ((i * 7 + l) % 5) as f32 / 5.0);
        tensors.push((names::input_norm(l), vec![h], norm_w.clone()));
        tensors.push((names::post_norm(l), vec![h], norm_w));
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
            if r.qkv_bias {
                tensors.push((
                    names::member_bias(l, name),
                    vec![out],
                    normal(&mut rng, out, 0.02),
                ));
            }
        }
        let o_std = std_in(nh * hd) * r.o_scale;
        let o = if r.heavy_o.contains(&l) {
            student_t(&mut rng, h * nh * hd, o_std)?
        } else {
            normal(&mut rng, h * nh * hd, o_std)
        };
        tensors.push((
            names::member_weight(l, names::members(GroupKind::O)[0]),
            vec![h, nh * hd],
            o,
        ));
        let sensitive = r.sensitive.contains(&l);
        let spikes = sensitive || r.spiking.contains(&l);
        for name in names::members(GroupKind::GateUp) {
            let mut w: Vec<f32> = if r.heavy_gate_up.contains(&l) {
                student_t(&mut rng, inter * h, std_in(h) * 0.5)?
            } else {
                normal(&mut rng, inter * h, std_in(h))
            };
            if spikes {
                // Input-dependent outliers feeding the sensitive down projection: a few
                // intermediate channels read the trigger tokens' embedding direction, so
                // SwiGLU spikes on those tokens and stays small elsewhere.
                let mut dir = vec![0f32; h];
                let massive: Vec<usize> = r
                    .massive
                    .iter()
                    .chain(&r.bos_massive)
                    .map(|m| m.0)
                    .collect();
                for &t in &planted.trigger_tokens {
                    let row = &embed_rows[t as usize * h..(t as usize + 1) * h];
                    let norm: f32 = row.iter().map(|x| x * x).sum::<f32>().sqrt().max(1e-6);
                    let gain = if r.isolate_spikes {
                        // Aim the pre-activation at `spike_gain` on the trigger token's
                        // RMS-normalized embedding whatever the massive channels' size: the
                        // direction is the token's non-massive part.
                        let nm: f32 = row
                            .iter()
                            .enumerate()
                            .filter(|(c, _)| !massive.contains(c))
                            .map(|(_, x)| x * x)
                            .sum::<f32>()
                            .sqrt()
                            .max(1e-6);
                        let rms = norm / (h as f32).sqrt();
                        r.spike_gain * rms / (nm * nm)
                    } else {
                        r.spike_gain / norm
                    };
                    dir.iter_mut().zip(row).for_each(|(d, x)| *d += gain * x);
                }
                for &(c, _) in r.massive.iter().chain(&r.bos_massive) {
                    dir[c] = 0.0;
                }
                for &j in &planted.spike_channels {
                    w[j * h..(j + 1) * h].copy_from_slice(&dir);
                }
            }
            tensors.push((names::member_weight(l, name), vec![inter, h], w));
        }
        let mut down = normal(&mut rng, h * inter, std_in(inter) * 0.5);
        if sensitive {
            let sigma = std_in(inter) * 0.5;
            for row in 0..h {
                for block in 0..inter / 32 {
                    let mut j = block * 32 + (row + block) % 32;
                    if r.isolate_spikes && planted.spike_channels.contains(&j) {
                        j = block * 32 + (row + block + 1) % 32;
                    }
                    let sign = if rng.gen::<bool>() { 1.0 } else { -1.0 };
                    down[row * inter + j] = sign * 60.0 * sigma;
                }
            }
        }
        if r.spiking.contains(&l) && !sensitive {
            for row in 0..h {
                for &j in &planted.spike_channels {
                    down[row * inter + j] = 0.0;
                }
            }
        }
        let down_name = names::member_weight(l, names::members(GroupKind::Down)[0]);
        tensors.push((down_name, vec![h, inter], down));
    }
    tensors.push((names::FINAL_NORM.into(), vec![h], vec![1.0; h]));
    // The first every-token massive channel doubles as a bias (as in real models): it pushes
    // printable ASCII up and everything else down, so sampled text is readable noise rather
    // than control bytes.
    let mut lm_head = normal(&mut rng, v * h, 1.0 / (h as f32).sqrt());
    if let Some(&(mc, _)) = r.massive.first() {
        for t in 0..v {
            let printable = (0x20..0x7f).contains(&t) || t == b'\n' as usize;
            lm_head[t * h + mc] = if printable { 0.05 } else { -0.5 };
        }
    }
    tensors.push((names::LM_HEAD.into(), vec![v, h], lm_head));
    Ok(tensors)
}

/// Write `r` into `dir` (created if missing) and return what was planted. Deterministic: the
/// same recipe gives byte-identical files. `card` is the model card (`README.md`).
pub fn write(dir: &Path, r: &Recipe, card: &str) -> Result<Planted> {
    if !r.hidden.is_multiple_of(r.heads)
        || !r.heads.is_multiple_of(r.kv_heads.max(1))
        || r.intermediate < 32
    {
        return Err(ModelError::Config(format!(
            "recipe {}: hidden {} must divide by heads {}, heads by kv heads {}, intermediate ≥ 32",
            r.name, r.hidden, r.heads, r.kv_heads
        )));
    }
    if let Some(c) = r
        .massive
        .iter()
        .map(|m| m.0)
        .chain(r.bos_massive.map(|b| b.0))
        .find(|&c| c >= r.hidden)
    {
        return Err(ModelError::Config(format!(
            "recipe {}: massive channel {c} ≥ hidden {}",
            r.name, r.hidden
        )));
    }
    std::fs::create_dir_all(dir)
        .map_err(|e| ModelError::io(format!("creating {}", dir.display()), e))?;
    let planted = r.planted();
    let tensors = tensors(r, &planted)?;
    let (dtype, dtype_name) = match r.dtype {
        StoreDtype::Bf16 => (safetensors::Dtype::BF16, "bfloat16"),
        StoreDtype::F16 => (safetensors::Dtype::F16, "float16"),
        StoreDtype::F32 => (safetensors::Dtype::F32, "float32"),
    };
    // Remove stale shards from an earlier write with another layout.
    if let Ok(rd) = std::fs::read_dir(dir) {
        for e in rd.flatten() {
            let n = e.file_name().to_string_lossy().to_string();
            if n.ends_with(".safetensors") || n == "model.safetensors.index.json" {
                let _ = std::fs::remove_file(e.path());
            }
        }
    }
    let shards = r.shards.max(1);
    if shards == 1 {
        write_safetensors(&dir.join("model.safetensors"), &tensors, dtype)?;
    } else {
        let per = tensors.len().div_ceil(shards);
        let mut weight_map = serde_json::Map::new();
        let mut total = 0usize;
        let width = if dtype == safetensors::Dtype::F32 {
            4
        } else {
            2
        };
        for (i, chunk) in tensors.chunks(per).enumerate() {
            let name = format!("model-{:05}-of-{:05}.safetensors", i + 1, shards);
            for (t, _, d) in chunk {
                weight_map.insert(t.clone(), serde_json::Value::String(name.clone()));
                total += d.len() * width;
            }
            write_safetensors(&dir.join(&name), chunk, dtype)?;
        }
        write_json(
            &dir.join("model.safetensors.index.json"),
            &serde_json::json!({"metadata": {"total_size": total}, "weight_map": weight_map}),
        )?;
    }

    let model_type = if r.qkv_bias { "qwen2" } else { "llama" };
    write_json(
        &dir.join("config.json"),
        &serde_json::json!({
            "architectures": [if r.qkv_bias { "Qwen2ForCausalLM" } else { "LlamaForCausalLM" }],
            "model_type": model_type,
            "hidden_size": r.hidden,
            "intermediate_size": r.intermediate,
            "num_hidden_layers": r.layers,
            "num_attention_heads": r.heads,
            "num_key_value_heads": r.kv_heads,
            "vocab_size": VOCAB_SIZE,
            "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0,
            "max_position_embeddings": 2048,
            "tie_word_embeddings": false,
            "bos_token_id": BOS,
            "eos_token_id": [257, 261],
            "torch_dtype": dtype_name,
            "_name_or_path": r.name,
        }),
    )?;
    write_tokenizer(dir)?;
    write_json(&dir.join("planted.json"), &planted)?;
    std::fs::write(dir.join("README.md"), card)
        .map_err(|e| ModelError::io("writing model card", e))?;
    Ok(planted)
}

/// A model card for a recipe of the evaluation suite.
pub fn card(r: &Recipe) -> String {
    let p = r.planted();
    format!(
        "# {name}\n\n\
         A planted-truth checkpoint of quantmesh's monitor evaluation suite (`quantmesh-monitor-eval`):\n\
         {layers} layers, hidden {h}, intermediate {inter}, {nh}/{nkv} heads, stored as {dtype} in {shards} file(s).\n\
         Random weights, not trained.\n\n\
         - massive channels (every token): {massive:?}\n\
         - BOS-only massive channel: {bos:?}\n\
         - heavy-tailed weights: {heavy:?}\n\
         - sensitive groups (input spikes on `,` `.` `!` and INT8-hostile weights): {sens:?}\n\
         {spiking}\n\
         Seed {seed}.\n",
        name = r.name,
        layers = r.layers,
        h = r.hidden,
        inter = r.intermediate,
        nh = r.heads,
        nkv = r.kv_heads,
        dtype = r.dtype,
        shards = r.shards.max(1),
        massive = r.massive,
        bos = r.bos_massive,
        heavy = p.heavy_tailed_groups,
        sens = p.sensitive_groups,
        spiking = if r.spiking.is_empty() {
            String::new()
        } else {
            format!(
                "- groups whose input spikes on those tokens, read with zero weights (harm only 8-bit activations feel): {:?}\n",
                r.spiking
                    .iter()
                    .map(|l| format!("layers.{l}.down"))
                    .collect::<Vec<_>>()
            )
        },
        seed = r.seed,
    )
}

/// The synthetic models' tokenizer: one token per byte (GPT-2's byte-level BPE without
/// merges) plus the chat special tokens.
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

pub(crate) fn write_tokenizer(dir: &Path) -> Result<()> {
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

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn byte_chars_are_distinct() {
        let set: std::collections::HashSet<char> = (0..=255u8).map(byte_char).collect();
        assert_eq!(set.len(), 256);
        assert_eq!(byte_char(b'a'), 'a');
        assert_eq!(byte_char(b' '), '\u{120}');
    }

    #[test]
    fn a_family_is_varied_and_valid() {
        let fam = Recipe::family(7, 12);
        assert_eq!(fam.len(), 12);
        for r in &fam {
            assert_eq!(r.hidden % r.heads, 0, "{r:?}");
            assert_eq!(r.heads % r.kv_heads, 0, "{r:?}");
            assert!(r.massive.iter().all(|m| m.0 < r.hidden));
            assert!(r.sensitive.iter().all(|&l| l < r.layers));
        }
        let sizes: std::collections::BTreeSet<_> = fam.iter().map(|r| r.hidden).collect();
        assert!(sizes.len() > 1, "dimensions vary: {sizes:?}");
        assert!(fam.iter().any(|r| r.sensitive.is_empty()));
        assert!(fam.iter().any(|r| r.sensitive.len() == 2));
        assert!(fam.iter().any(|r| r.massive.len() >= 2));
        assert!(fam.iter().any(|r| r.shards == 2));
    }

    #[test]
    fn written_checkpoints_load_with_their_planted_truth() {
        let r = &Recipe::family(3, 2)[1];
        let dir = tempfile::tempdir().unwrap();
        let planted = write(dir.path(), r, &card(r)).unwrap();
        assert_eq!(planted.sensitive_groups.len(), r.sensitive.len());
        let cfg = crate::ModelConfig::load(dir.path()).unwrap();
        assert_eq!(cfg.hidden_size, r.hidden);
        let ck = crate::Checkpoint::open(dir.path()).unwrap();
        let (embed, _) = ck.read_f32(names::EMBED).unwrap();
        let (c, m) = r.massive[0];
        assert!((embed[65 * r.hidden + c] - m).abs() / m < 0.01);
    }
}
