//! Tokenization: the `tokenizers` crate, the model's chat template (Jinja, from
//! `tokenizer_config.json` or a GGUF file's `tokenizer.chat_template`, rendered with
//! minijinja) and incremental detokenization that never emits broken UTF-8 mid-stream.
//!
//! A GGUF model's tokenizer is built from its metadata (`tokenizer.ggml.*`, see
//! [`crate::gguf::GgufFile::tokenizer_json`]); its token ids equal llama.cpp's for the same
//! file (checked against llama-cpp-python in `services/engine/tests/real_model.rs`).

use crate::error::{ModelError, Result};
use serde::{Deserialize, Serialize};
use std::path::Path;

/// One chat message (OpenAI shape). Fields other than these two are refused, not ignored.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ChatMessage {
    /// `system`, `user` or `assistant`.
    #[schemars(extend("enum" = ["system", "user", "assistant"]))]
    pub role: String,
    pub content: String,
}

#[derive(Debug, Default, Deserialize)]
struct TokenizerConfig {
    #[serde(default)]
    chat_template: Option<String>,
    #[serde(default)]
    bos_token: Option<String>,
    #[serde(default)]
    eos_token: Option<String>,
    #[serde(default)]
    add_bos_token: Option<bool>,
}

pub struct TextTokenizer {
    inner: tokenizers::Tokenizer,
    config: TokenizerConfig,
    bos_id: Option<u32>,
}

impl TextTokenizer {
    /// Build the tokenizer a GGUF file describes.
    pub fn from_gguf(g: &crate::gguf::GgufFile) -> Result<Self> {
        let json = g.tokenizer_json()?;
        let bytes = serde_json::to_vec(&json)
            .map_err(|e| ModelError::Tokenizer(format!("{}: {e}", g.path.display())))?;
        let inner = tokenizers::Tokenizer::from_bytes(bytes).map_err(|e| {
            ModelError::Tokenizer(format!("{}: building the tokenizer: {e}", g.path.display()))
        })?;
        let config = TokenizerConfig {
            chat_template: g.string("tokenizer.chat_template").map(str::to_string),
            bos_token: g.token("tokenizer.ggml.bos_token_id")?,
            eos_token: g.token("tokenizer.ggml.eos_token_id")?,
            // llama.cpp's default: add BOS unless the file says not to.
            add_bos_token: Some(g.bool("tokenizer.ggml.add_bos_token").unwrap_or(true)),
        };
        Ok(Self::new(inner, config))
    }

    fn new(inner: tokenizers::Tokenizer, config: TokenizerConfig) -> Self {
        let bos_id = config
            .bos_token
            .as_deref()
            .and_then(|t| inner.token_to_id(t));
        Self {
            inner,
            config,
            bos_id,
        }
    }

    pub fn load_dir(dir: &Path) -> Result<Self> {
        let path = dir.join("tokenizer.json");
        let inner = tokenizers::Tokenizer::from_file(&path)
            .map_err(|e| ModelError::Tokenizer(format!("{}: {e}", path.display())))?;
        let cfg_path = dir.join("tokenizer_config.json");
        let config: TokenizerConfig = if cfg_path.exists() {
            let text = std::fs::read_to_string(&cfg_path)
                .map_err(|e| ModelError::io(format!("reading {}", cfg_path.display()), e))?;
            serde_json::from_str(&text)
                .map_err(|e| ModelError::Tokenizer(format!("{}: {e}", cfg_path.display())))?
        } else {
            TokenizerConfig::default()
        };
        Ok(Self::new(inner, config))
    }

    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    pub fn token_to_id(&self, t: &str) -> Option<u32> {
        self.inner.token_to_id(t)
    }

    /// Encode a prompt. With `add_bos`, the BOS token is prepended when the model's
    /// tokenizer config asks for it (`add_bos_token`, the Llama default).
    pub fn encode(&self, text: &str, add_bos: bool) -> Result<Vec<u32>> {
        let enc = self
            .inner
            .encode(text, false)
            .map_err(|e| ModelError::Tokenizer(e.to_string()))?;
        let mut ids = Vec::with_capacity(enc.len() + 1);
        if add_bos && self.config.add_bos_token.unwrap_or(false) {
            if let Some(b) = self.bos_id {
                ids.push(b);
            }
        }
        ids.extend_from_slice(enc.get_ids());
        Ok(ids)
    }

    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.inner
            .decode(ids, true)
            .map_err(|e| ModelError::Tokenizer(e.to_string()))
    }

    /// Render messages with the model's chat template, ending with the assistant prompt.
    pub fn apply_chat_template(&self, messages: &[ChatMessage]) -> Result<String> {
        let tpl = self.config.chat_template.as_deref().ok_or_else(|| {
            ModelError::InvalidInput("this model has no chat template; use /v1/completions".into())
        })?;
        let mut env = minijinja::Environment::new();
        env.add_template("chat", tpl)
            .map_err(|e| ModelError::Tokenizer(format!("chat template: {e}")))?;
        let t = env
            .get_template("chat")
            .map_err(|e| ModelError::Tokenizer(e.to_string()))?;
        t.render(minijinja::context! {
            messages => messages,
            add_generation_prompt => true,
            bos_token => self.config.bos_token.clone().unwrap_or_default(),
            eos_token => self.config.eos_token.clone().unwrap_or_default(),
        })
        .map_err(|e| ModelError::InvalidInput(format!("chat template: {e}")))
    }
}

/// Turns a growing list of token ids into text deltas. A delta is emitted only when the
/// decoded text no longer ends in an incomplete UTF-8 sequence (U+FFFD), so multi-byte
/// characters split over several byte tokens arrive whole.
#[derive(Debug, Default)]
pub struct IncrementalDecoder {
    ids: Vec<u32>,
    prefix_offset: usize,
    read_offset: usize,
}

impl IncrementalDecoder {
    pub fn push(&mut self, tok: &TextTokenizer, id: u32) -> Result<Option<String>> {
        self.ids.push(id);
        let prefix = tok.decode(&self.ids[self.prefix_offset..self.read_offset])?;
        let full = tok.decode(&self.ids[self.prefix_offset..])?;
        if full.len() > prefix.len() && !full.ends_with('\u{FFFD}') {
            let delta = full.get(prefix.len()..).unwrap_or_default().to_string();
            self.prefix_offset = self.read_offset;
            self.read_offset = self.ids.len();
            Ok(Some(delta))
        } else {
            Ok(None)
        }
    }

    /// Whatever is still held back at the end of the stream (possibly lossy).
    pub fn flush(&mut self, tok: &TextTokenizer) -> Result<String> {
        let prefix = tok.decode(&self.ids[self.prefix_offset..self.read_offset])?;
        let full = tok.decode(&self.ids[self.prefix_offset..])?;
        self.prefix_offset = self.ids.len();
        self.read_offset = self.ids.len();
        Ok(full.get(prefix.len()..).unwrap_or_default().to_string())
    }
}
