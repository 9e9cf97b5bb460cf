//! Another runtime's logits on the memory table's text, scored against the same f32 float
//! model as quantmesh's rows (llama.cpp on its own quantized file: `scripts/llama_ref.py`'s
//! `logits` op writes them, `scripts/bench-q4km.sh` runs the whole comparison).

use crate::formats::{walk_windows, KlSummary, KL_WINDOW};
use quantmesh_engine::backend::cpu::LlamaModel;
use quantmesh_engine::precision::PathMask;
use quantmesh_model::ModelConfig;
use std::path::{Path, PathBuf};

/// What `--peer FILE` names: a JSON description of the peer's run and its logits.
#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct Peer {
    /// The row's name in the table.
    pub(crate) name: String,
    /// Bytes of the peer's weights as it holds them (its file's size, say).
    pub(crate) bytes: u64,
    /// The token ids it was run on: must be the table's own.
    pub(crate) ids: Vec<u32>,
    /// Tokens per window, each from an empty context: must be the table's.
    pub(crate) window: usize,
    /// Little-endian f32 `[positions, vocab]`: each window's next-token logits at every
    /// position that has a next token, windows in order (relative to this file's folder
    /// when not absolute).
    pub(crate) logits: PathBuf,
    /// Batch-1 speeds the peer measured itself, when it did.
    #[serde(default)]
    pub(crate) prefill_tok_s: Option<f64>,
    #[serde(default)]
    pub(crate) decode_tok_s: Option<f64>,
}

impl Peer {
    pub(crate) fn load(path: &Path) -> Result<Self, Box<dyn std::error::Error>> {
        let mut p: Peer = serde_json::from_slice(&std::fs::read(path)?)
            .map_err(|e| format!("{}: {e}", path.display()))?;
        if p.logits.is_relative() {
            if let Some(dir) = path.parent() {
                p.logits = dir.join(&p.logits);
            }
        }
        Ok(p)
    }

    /// The peer's logits file, checked against the table's token ids and windows:
    /// `positions × vocab` little-endian f32.
    fn logits_for(
        &self,
        cfg: &ModelConfig,
        ids: &[u32],
    ) -> Result<Vec<u8>, Box<dyn std::error::Error>> {
        if self.ids != ids {
            return Err(format!(
                "peer {:?}: its {} token ids are not the table's {} (same text, tokenizer and --ppl-tokens?)",
                self.name,
                self.ids.len(),
                ids.len()
            )
            .into());
        }
        if self.window != KL_WINDOW {
            return Err(format!(
                "peer {:?}: windows of {} tokens, the table's are {KL_WINDOW}",
                self.name, self.window
            )
            .into());
        }
        let vocab = cfg.vocab_size;
        let bytes = std::fs::read(&self.logits)
            .map_err(|e| format!("peer {:?}: {}: {e}", self.name, self.logits.display()))?;
        let positions: usize = ids
            .chunks(KL_WINDOW)
            .map(|w| w.len().saturating_sub(1))
            .sum();
        if bytes.len() != positions * vocab * 4 {
            return Err(format!(
                "peer {:?}: {} holds {} bytes, not {positions} positions × {vocab} logits × 4",
                self.name,
                self.logits.display(),
                bytes.len()
            )
            .into());
        }
        Ok(bytes)
    }

    /// The peer's row of the memory table (`all_f16`: the model's all-16-bit bytes).
    pub(crate) fn row(&self, ppl: f64, kls: &[f64], all_f16: u64) -> String {
        let KlSummary {
            mean,
            median,
            p99,
            worst_share,
        } = KlSummary::of(kls);
        let speed =
            |v: Option<f64>, digits: usize| v.map_or("—".into(), |v| format!("{v:.digits$}"));
        format!(
            "| {} | — (its file) | {:.1} | {:.2} | — | {} | {} | {ppl:.3} | {mean:.5} | {median:.5} | {p99:.4} | {:.0} % |",
            self.name,
            self.bytes as f64 / (1 << 20) as f64,
            self.bytes as f64 / all_f16.max(1) as f64,
            speed(self.prefill_tok_s, 0),
            speed(self.decode_tok_s, 1),
            100.0 * worst_share
        )
    }
}

/// A peer's perplexity and its per-position KLs.
pub(crate) type Scored = (f64, Vec<f64>);

/// Each peer's perplexity on `ids` and each position's KL from `reference`'s (all-float)
/// distribution to the peer's, in the table's windows: one walk of the reference for all.
pub(crate) fn score(
    peers: &[Peer],
    reference: &LlamaModel,
    cfg: &ModelConfig,
    ids: &[u32],
) -> Result<Vec<Scored>, Box<dyn std::error::Error>> {
    if peers.is_empty() {
        return Ok(Vec::new());
    }
    let logits: Vec<Vec<u8>> = peers
        .iter()
        .map(|p| p.logits_for(cfg, ids))
        .collect::<Result<_, _>>()?;
    let row_bytes = cfg.vocab_size * 4;
    let mut scores: Vec<Scored> = peers.iter().map(|_| (0.0, Vec::new())).collect();
    let all_float = PathMask::all_groups_float(cfg.num_hidden_layers);
    let mut position = 0;
    walk_windows(
        cfg,
        ids,
        &[(reference, &all_float, false)],
        |_, next, want| {
            for ((nll, kls), bytes) in scores.iter_mut().zip(&logits) {
                let got: Vec<f32> = bytes[position * row_bytes..(position + 1) * row_bytes]
                    .chunks_exact(4)
                    .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                    .collect();
                *nll += quantmesh_model::ops::nll_logits(&got, next);
                kls.push(quantmesh_model::ops::kl_logits(&want[0], &got));
            }
            position += 1;
            Ok(())
        },
    )?;
    Ok(scores
        .into_iter()
        .map(|(nll, kls)| ((nll / kls.len().max(1) as f64).exp(), kls))
        .collect())
}
