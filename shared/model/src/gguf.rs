//! GGUF files (llama.cpp's format): the header and metadata, read through candle's
//! `quantized::gguf_file`, presented in the engine's Hugging Face vocabulary.
//!
//! Three things come out of one file:
//! * the [`ModelConfig`] (from `<arch>.block_count`, `<arch>.embedding_length`, …);
//! * the tensor map: every GGUF tensor under its Hugging Face name (`blk.3.attn_q.weight` →
//!   `model.layers.3.self_attn.q_proj.weight`), with the row permutation llama.cpp's
//!   converter applied to Llama q/k weights undone (the engine's RoPE is Hugging Face's
//!   rotate-half);
//! * the tokenizer (`tokenizer.ggml.*`, see [`GgufFile::tokenizer_json`]) and the chat template.
//!
//! Supported architectures: `llama`, `mistral`, `qwen2`. Tensor data types are whatever
//! candle dequantizes (F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K…Q6_K).

use crate::config::{EosIds, ModelConfig};
use crate::error::{ModelError, Result};
use crate::names;
use candle_core::quantized::gguf_file::{Content, Value};
use candle_core::quantized::GgmlDType;
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// Architectures the engine runs, as GGUF names them.
pub const ARCHITECTURES: &[&str] = &["llama", "mistral", "qwen2"];

/// One tensor of a GGUF file under its Hugging Face name.
#[derive(Debug, Clone)]
pub struct GgufTensor {
    pub dtype: GgmlDType,
    /// `[rows, cols]` (PyTorch order).
    pub shape: Vec<usize>,
    /// Byte range in the file.
    pub start: usize,
    pub end: usize,
    /// Undo llama.cpp's q/k row interleave with this many heads.
    pub unpermute_heads: Option<usize>,
}

/// A parsed GGUF header.
pub struct GgufFile {
    pub path: PathBuf,
    pub arch: String,
    metadata: HashMap<String, Value>,
    /// Hugging Face name → tensor.
    pub tensors: HashMap<String, GgufTensor>,
    pub file_len: u64,
}

/// `path` itself when it is a `.gguf` file; the one `.gguf` file in it when it is a
/// directory without `config.json`; `None` for a Hugging Face directory.
pub fn find_gguf(path: &Path) -> Result<Option<PathBuf>> {
    if path.is_file() {
        if is_gguf_file(path) {
            return Ok(Some(path.to_path_buf()));
        }
        return Err(ModelError::checkpoint(
            path,
            None,
            "is a file but not a GGUF file: give a .gguf file, a directory holding one, or a \
             Hugging Face directory (config.json, *.safetensors, tokenizer.json)",
        ));
    }
    if !path.is_dir() || path.join("config.json").exists() {
        return Ok(None);
    }
    let mut found: Vec<PathBuf> = std::fs::read_dir(path)
        .map_err(|e| ModelError::io(format!("listing {}", path.display()), e))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "gguf"))
        .collect();
    found.sort();
    match found.len() {
        0 => Ok(None),
        1 => Ok(found.pop()),
        _ => Err(ModelError::checkpoint(
            path,
            None,
            format!(
                "holds {} .gguf files ({}); pass --model the one to serve",
                found.len(),
                found
                    .iter()
                    .filter_map(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        )),
    }
}

fn is_gguf_file(path: &Path) -> bool {
    if path.extension().is_some_and(|x| x == "gguf") {
        return true;
    }
    let mut magic = [0u8; 4];
    std::fs::File::open(path)
        .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut magic))
        .is_ok()
        && &magic == b"GGUF"
}

/// Whole-model tensors: (GGUF name, Hugging Face name).
const GLOBAL_NAMES: &[(&str, &str)] = &[
    ("token_embd.weight", names::EMBED),
    ("output_norm.weight", names::FINAL_NORM),
    ("output.weight", names::LM_HEAD),
];

/// Per-layer tensors: (GGUF part of `blk.N.<part>.<suffix>`, Hugging Face member of
/// `model.layers.N.<member>.<suffix>`).
const LAYER_NAMES: &[(&str, &str)] = &[
    ("attn_norm", names::INPUT_NORM),
    ("ffn_norm", names::POST_NORM),
    ("attn_q", "self_attn.q_proj"),
    ("attn_k", "self_attn.k_proj"),
    ("attn_v", "self_attn.v_proj"),
    ("attn_output", "self_attn.o_proj"),
    ("ffn_gate", "mlp.gate_proj"),
    ("ffn_up", "mlp.up_proj"),
    ("ffn_down", "mlp.down_proj"),
];

/// The Hugging Face name of a GGUF tensor, or `None` for tensors the engine does not use
/// (e.g. `rope_freqs.weight`).
pub fn hf_name(gguf: &str) -> Option<String> {
    if let Some((_, hf)) = GLOBAL_NAMES.iter().find(|(g, _)| *g == gguf) {
        return Some(hf.to_string());
    }
    let rest = gguf.strip_prefix("blk.")?;
    let (layer, tail) = rest.split_once('.')?;
    let layer: usize = layer.parse().ok()?;
    let (part, suffix) = tail.rsplit_once('.')?;
    let (_, member) = LAYER_NAMES.iter().find(|(g, _)| *g == part)?;
    Some(format!("{}{member}.{suffix}", names::layer_prefix(layer)))
}

/// The GGUF name of a Hugging Face tensor (the inverse of [`hf_name`]), for writers.
pub fn gguf_name(hf: &str) -> Option<String> {
    if let Some((g, _)) = GLOBAL_NAMES.iter().find(|(_, h)| *h == hf) {
        return Some(g.to_string());
    }
    let rest = hf.strip_prefix("model.layers.")?;
    let (layer, tail) = rest.split_once('.')?;
    let layer: usize = layer.parse().ok()?;
    let (member, suffix) = tail.rsplit_once('.')?;
    let (part, _) = LAYER_NAMES.iter().find(|(_, h)| *h == member)?;
    Some(format!("blk.{layer}.{part}.{suffix}"))
}

impl GgufFile {
    /// Read and check the header of `path`: architecture, metadata, and that every
    /// tensor's bytes are inside the file.
    pub fn open(path: &Path) -> Result<Self> {
        let bad = |tensor: Option<&str>, m: String| ModelError::checkpoint(path, tensor, m);
        let mut file = std::fs::File::open(path)
            .map_err(|e| ModelError::io(format!("opening {}", path.display()), e))?;
        let file_len = file
            .metadata()
            .map_err(|e| ModelError::io(format!("reading {}", path.display()), e))?
            .len();
        let mut reader = std::io::BufReader::new(&mut file);
        let content = Content::read(&mut reader)
            .map_err(|e| bad(None, format!("not a readable GGUF file: {e}")))?;
        let arch = match content.metadata.get("general.architecture") {
            Some(v) => v
                .to_string()
                .map_err(|e| bad(None, format!("general.architecture: {e}")))?
                .clone(),
            None => return Err(bad(None, "general.architecture is missing".into())),
        };
        if !ARCHITECTURES.contains(&arch.as_str()) {
            return Err(bad(
                None,
                format!(
                    "architecture {arch:?} is not supported (supported: {})",
                    ARCHITECTURES.join(", ")
                ),
            ));
        }
        let mut this = Self {
            path: path.to_path_buf(),
            arch,
            metadata: content.metadata,
            tensors: HashMap::new(),
            file_len,
        };
        let (heads, kv_heads) = (
            this.arch_u64("attention.head_count")? as usize,
            this.arch_u64_or("attention.head_count_kv", 0)? as usize,
        );
        let kv_heads = if kv_heads == 0 { heads } else { kv_heads };
        // llama.cpp's converter interleaves q/k rows for architectures it runs with
        // "normal" (GPT-J style) RoPE; Qwen2 uses NeoX RoPE and is stored as in HF.
        let permuted = this.arch != "qwen2";
        // GGUF places every tensor's data at a multiple of `general.alignment` (default 32);
        // the data is read in place from the memory map, so a misaligned offset is refused.
        let align = this
            .metadata
            .get("general.alignment")
            .and_then(|v| v.to_u32().ok())
            .map_or(32, u64::from)
            .max(1);
        // Tensors in file order, so a truncated file names the first tensor it cuts.
        let mut infos: Vec<_> = content.tensor_infos.into_iter().collect();
        infos.sort_by_key(|(_, t)| t.offset);
        for (gguf_name, info) in infos {
            let shape = info.shape.dims().to_vec();
            // A corrupt header can claim any sizes: all arithmetic on them is checked.
            let Some(elems) = shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d)) else {
                return Err(bad(
                    Some(&gguf_name),
                    format!("shape {shape:?} has more elements than this machine can address"),
                ));
            };
            if elems == 0 {
                return Err(bad(
                    Some(&gguf_name),
                    format!("shape {shape:?} holds no elements"),
                ));
            }
            let (block, size) = (info.ggml_dtype.block_size(), info.ggml_dtype.type_size());
            if !elems.is_multiple_of(block) {
                return Err(bad(
                    Some(&gguf_name),
                    format!("{elems} elements is not a whole number of {block}-element blocks"),
                ));
            }
            let end = content
                .tensor_data_offset
                .checked_add(info.offset)
                .and_then(|start| {
                    let bytes = u64::try_from((elems / block).checked_mul(size)?).ok()?;
                    Some((start, start.checked_add(bytes)?))
                });
            let Some((start, end)) = end else {
                return Err(bad(
                    Some(&gguf_name),
                    format!(
                        "offset {} and shape {shape:?} point past any file",
                        info.offset
                    ),
                ));
            };
            if start % align != 0 {
                return Err(bad(
                    Some(&gguf_name),
                    format!("data at byte {start} is not aligned to {align} bytes: the header is corrupt"),
                ));
            }
            if end > file_len {
                return Err(bad(
                    Some(&gguf_name),
                    format!("data ends at byte {end} but the file has only {file_len}: the file is truncated"),
                ));
            }
            let Some(name) = hf_name(&gguf_name) else {
                continue;
            };
            let unpermute_heads = match name.rsplit('.').nth(1) {
                Some("q_proj") if permuted => Some(heads),
                Some("k_proj") if permuted => Some(kv_heads),
                _ => None,
            };
            this.tensors.insert(
                name,
                GgufTensor {
                    dtype: info.ggml_dtype,
                    shape,
                    start: start as usize,
                    end: end as usize,
                    unpermute_heads,
                },
            );
        }
        Ok(this)
    }

    fn err(&self, m: impl Into<String>) -> ModelError {
        ModelError::checkpoint(&self.path, None, m)
    }

    fn u64_of(&self, key: &str, v: &Value) -> Result<u64> {
        let n = match v {
            Value::U8(x) => *x as u64,
            Value::U16(x) => *x as u64,
            Value::U32(x) => *x as u64,
            Value::U64(x) => *x,
            Value::I8(x) if *x >= 0 => *x as u64,
            Value::I16(x) if *x >= 0 => *x as u64,
            Value::I32(x) if *x >= 0 => *x as u64,
            Value::I64(x) if *x >= 0 => *x as u64,
            other => return Err(self.err(format!("{key}: expected a count, found {other:?}"))),
        };
        Ok(n)
    }

    fn f64_of(&self, key: &str, v: &Value) -> Result<f64> {
        match v {
            Value::F32(x) => Ok(*x as f64),
            Value::F64(x) => Ok(*x),
            other => self.u64_of(key, other).map(|n| n as f64),
        }
    }

    fn arch_u64(&self, key: &str) -> Result<u64> {
        let full = format!("{}.{key}", self.arch);
        match self.metadata.get(&full) {
            Some(v) => self.u64_of(&full, v),
            None => Err(self.err(format!("metadata {full} is missing"))),
        }
    }

    fn arch_u64_or(&self, key: &str, default: u64) -> Result<u64> {
        let full = format!("{}.{key}", self.arch);
        self.metadata
            .get(&full)
            .map_or(Ok(default), |v| self.u64_of(&full, v))
    }

    fn arch_f64_or(&self, key: &str, default: f64) -> Result<f64> {
        let full = format!("{}.{key}", self.arch);
        self.metadata
            .get(&full)
            .map_or(Ok(default), |v| self.f64_of(&full, v))
    }

    pub fn string(&self, key: &str) -> Option<&str> {
        match self.metadata.get(key) {
            Some(Value::String(s)) => Some(s),
            _ => None,
        }
    }

    fn u32_opt(&self, key: &str) -> Result<Option<u32>> {
        self.metadata
            .get(key)
            .map(|v| self.u64_of(key, v).map(|n| n as u32))
            .transpose()
    }

    pub fn bool(&self, key: &str) -> Option<bool> {
        match self.metadata.get(key) {
            Some(Value::Bool(b)) => Some(*b),
            _ => None,
        }
    }

    fn strings(&self, key: &str) -> Result<Vec<&str>> {
        let Some(v) = self.metadata.get(key) else {
            return Err(self.err(format!("metadata {key} is missing")));
        };
        let items = v.to_vec().map_err(|e| self.err(format!("{key}: {e}")))?;
        items
            .iter()
            .map(|x| match x {
                Value::String(s) => Ok(s.as_str()),
                other => Err(self.err(format!("{key}: expected strings, found {other:?}"))),
            })
            .collect()
    }

    /// The token strings of the vocabulary.
    pub fn tokens(&self) -> Result<Vec<&str>> {
        self.strings("tokenizer.ggml.tokens")
    }

    /// The model configuration the metadata describes.
    pub fn model_config(&self) -> Result<ModelConfig> {
        let heads = self.arch_u64("attention.head_count")? as usize;
        let hidden = self.arch_u64("embedding_length")? as usize;
        let kv = self.arch_u64_or("attention.head_count_kv", heads as u64)? as usize;
        let head_dim = self.arch_u64_or("attention.key_length", (hidden / heads.max(1)) as u64)?;
        let vocab = match self.arch_u64_or("vocab_size", 0)? {
            0 => self.tokens()?.len(),
            n => n as usize,
        };
        let has_bias = self
            .tensors
            .contains_key("model.layers.0.self_attn.q_proj.bias");
        let cfg = ModelConfig {
            model_type: self.arch.clone(),
            hidden_size: hidden,
            intermediate_size: self.arch_u64("feed_forward_length")? as usize,
            num_hidden_layers: self.arch_u64("block_count")? as usize,
            num_attention_heads: heads,
            num_key_value_heads: Some(kv),
            head_dim: Some(head_dim as usize),
            vocab_size: vocab,
            rms_norm_eps: self.arch_f64_or("attention.layer_norm_rms_epsilon", 1e-5)?,
            rope_theta: self.arch_f64_or("rope.freq_base", 10_000.0)?,
            max_position_embeddings: self.arch_u64_or("context_length", 4096)? as usize,
            tie_word_embeddings: !self.tensors.contains_key("lm_head.weight"),
            attention_bias: has_bias && self.arch != "qwen2",
            bos_token_id: self.u32_opt("tokenizer.ggml.bos_token_id")?,
            eos_token_id: Some(EosIds::Many(self.end_of_generation_ids()?)),
            torch_dtype: None,
            name_or_path: self.string("general.name").map(str::to_string),
        };
        cfg.validate().map_err(|m| self.err(m))?;
        Ok(cfg)
    }

    /// Tokens that end generation: EOS, EOT and the end-of-turn control tokens llama.cpp
    /// also treats as such (`<|im_end|>`, `<|endoftext|>`, `<|eot_id|>`, …).
    fn end_of_generation_ids(&self) -> Result<Vec<u32>> {
        let mut ids: Vec<u32> = ["tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id"]
            .iter()
            .filter_map(|k| self.u32_opt(k).transpose())
            .collect::<Result<_>>()?;
        const EOG: &[&str] = &[
            "<|im_end|>",
            "<|endoftext|>",
            "<|eot_id|>",
            "<|end|>",
            "<end_of_turn>",
            "<|end_of_text|>",
        ];
        if let Ok(tokens) = self.tokens() {
            let types = self.token_types().unwrap_or_default();
            for (id, t) in tokens.iter().enumerate() {
                let control = types.get(id).is_none_or(|&ty| ty == TOKEN_CONTROL);
                if control && EOG.contains(t) {
                    ids.push(id as u32);
                }
            }
        }
        ids.sort_unstable();
        ids.dedup();
        Ok(ids)
    }

    fn token_types(&self) -> Result<Vec<i64>> {
        let Some(v) = self.metadata.get("tokenizer.ggml.token_type") else {
            return Ok(Vec::new());
        };
        let items = v
            .to_vec()
            .map_err(|e| self.err(format!("tokenizer.ggml.token_type: {e}")))?;
        Ok(items
            .iter()
            .map(|x| match x {
                Value::I32(n) => *n as i64,
                Value::U32(n) => *n as i64,
                Value::I64(n) => *n,
                _ => 1,
            })
            .collect())
    }

    /// A `tokenizer.json` (Hugging Face `tokenizers` format) equivalent to the GGUF
    /// tokenizer: byte-level BPE over `tokenizer.ggml.tokens`/`merges`, the pre-tokenizer
    /// `tokenizer.ggml.pre` names, control and user-defined tokens as added tokens.
    pub fn tokenizer_json(&self) -> Result<serde_json::Value> {
        use serde_json::json;
        let model = self.string("tokenizer.ggml.model").unwrap_or("");
        if model != "gpt2" {
            return Err(self.err(format!(
                "tokenizer.ggml.model {model:?} is not supported (byte-level BPE, \"gpt2\", is)"
            )));
        }
        let pre = self.string("tokenizer.ggml.pre").unwrap_or("default");
        let pre_tokenizer = pre_tokenizer(pre).ok_or_else(|| {
            self.err(format!(
                "tokenizer.ggml.pre {pre:?} is not supported (supported: {})",
                PRE_TOKENIZERS.join(", ")
            ))
        })?;
        let tokens = self.tokens()?;
        let merges = self.strings("tokenizer.ggml.merges")?;
        let types = self.token_types()?;
        let vocab: serde_json::Map<String, serde_json::Value> = tokens
            .iter()
            .enumerate()
            .map(|(i, t)| (t.to_string(), json!(i)))
            .collect();
        let added: Vec<serde_json::Value> = tokens
            .iter()
            .enumerate()
            .filter(|(i, _)| matches!(types.get(*i), Some(&TOKEN_CONTROL | &TOKEN_USER)))
            .map(|(i, t)| {
                json!({"id": i, "content": t, "single_word": false, "lstrip": false,
                       "rstrip": false, "normalized": false,
                       "special": types.get(i) == Some(&TOKEN_CONTROL)})
            })
            .collect();
        Ok(json!({
            "version": "1.0",
            "truncation": null,
            "padding": null,
            "added_tokens": added,
            "normalizer": null,
            "pre_tokenizer": pre_tokenizer,
            "post_processor": null,
            "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
            "model": {
                "type": "BPE", "dropout": null, "unk_token": null,
                "continuing_subword_prefix": null, "end_of_word_suffix": null,
                "fuse_unk": false, "byte_fallback": false,
                "ignore_merges": pre == "llama-bpe",
                "vocab": vocab, "merges": merges,
            }
        }))
    }

    /// The token string of an id from the metadata's vocabulary.
    pub fn token(&self, key: &str) -> Result<Option<String>> {
        let Some(id) = self.u32_opt(key)? else {
            return Ok(None);
        };
        Ok(self.tokens()?.get(id as usize).map(|s| s.to_string()))
    }
}

const TOKEN_CONTROL: i64 = 3;
const TOKEN_USER: i64 = 4;

/// Pre-tokenizers by `tokenizer.ggml.pre`, with the same splitting rules llama.cpp uses.
pub const PRE_TOKENIZERS: &[&str] = &["default", "gpt2", "smollm", "llama-bpe", "qwen2"];

fn pre_tokenizer(pre: &str) -> Option<serde_json::Value> {
    use serde_json::json;
    let byte_level = |use_regex: bool| json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": use_regex});
    let split = |pattern: &str| {
        json!({"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": false},
            byte_level(false),
        ]})
    };
    Some(match pre {
        // GPT-2's regex (what ByteLevel's own regex is).
        "default" | "gpt2" => byte_level(true),
        // Every digit alone, then GPT-2's regex.
        "smollm" => json!({"type": "Sequence", "pretokenizers": [
            {"type": "Digits", "individual_digits": true},
            byte_level(true),
        ]}),
        "llama-bpe" => split(
            r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
        ),
        "qwen2" => split(
            r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
        ),
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_map_to_hugging_face() {
        assert_eq!(
            hf_name("blk.12.attn_q.weight").as_deref(),
            Some("model.layers.12.self_attn.q_proj.weight")
        );
        assert_eq!(
            hf_name("blk.0.ffn_down.weight").as_deref(),
            Some("model.layers.0.mlp.down_proj.weight")
        );
        assert_eq!(
            hf_name("blk.3.attn_k.bias").as_deref(),
            Some("model.layers.3.self_attn.k_proj.bias")
        );
        assert_eq!(
            hf_name("token_embd.weight").as_deref(),
            Some("model.embed_tokens.weight")
        );
        assert_eq!(hf_name("rope_freqs.weight"), None);
        for g in [
            "blk.7.ffn_gate.weight",
            "output.weight",
            "blk.0.attn_v.bias",
        ] {
            assert_eq!(gguf_name(&hf_name(g).unwrap()).as_deref(), Some(g));
        }
        assert_eq!(hf_name("blk.x.attn_q.weight"), None);
    }
}
