//! The real trained model (SmolLM2-135M-Instruct, GGUF Q4_1) against llama.cpp on the same
//! file, through llama-cpp-python (`scripts/llama_ref.py`): tokenizer ids, greedy tokens
//! and next-token distributions on the float and INT8 paths; and loading errors named by
//! file and tensor.
//!
//! The model is fetched once into `QUANTMESH_TEST_MODELS` (scripts/test.sh sets it up);
//! llama-cpp-python is installed by scripts/test.sh. The Python interpreter is
//! `QUANTMESH_TEST_PYTHON` or `python3`.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use quantmesh_engine::backend::cpu::LlamaModel;
use quantmesh_engine::backend::Backend;
use quantmesh_engine::kv::KvFloatDtype;
use quantmesh_engine::precision::PathMask;
use quantmesh_engine::EngineError;
use quantmesh_model::checkpoint::Checkpoint;
use quantmesh_model::ops::kl_logits;
use quantmesh_model::tokenizer::{ChatMessage, TextTokenizer};
use quantmesh_model::ModelConfig;
use quantmesh_model::ModelError;
use quantmesh_types::Residency;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;

mod support;
use support::Rig;

fn gguf() -> &'static Path {
    static PATH: OnceLock<PathBuf> = OnceLock::new();
    PATH.get_or_init(|| {
        quantmesh_catalog::fetch_for_tests()
            .expect("fetching the real model (scripts/test.sh sets QUANTMESH_TEST_MODELS)")
    })
}

/// Run one `scripts/llama_ref.py` request.
fn llama_ref(req: serde_json::Value) -> serde_json::Value {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/../../scripts/llama_ref.py");
    let python = std::env::var("QUANTMESH_TEST_PYTHON").unwrap_or_else(|_| "python3".into());
    let mut child = Command::new(&python)
        .arg(script)
        .env("LLAMA_THREADS", "2")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("python3");
    child
        .stdin
        .take()
        .unwrap()
        .write_all(req.to_string().as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "llama_ref.py failed (is llama-cpp-python installed? scripts/test.sh installs it): {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

/// English text from the machine's license files, in paragraphs.
fn corpus() -> Vec<String> {
    let mut texts = Vec::new();
    for name in ["GPL-3", "Apache-2.0", "LGPL-2.1", "Artistic", "MPL-2.0"] {
        let path = Path::new("/usr/share/common-licenses").join(name);
        let Ok(text) = std::fs::read_to_string(&path) else {
            continue;
        };
        texts.extend(
            text.split("\n\n")
                .map(str::to_string)
                .filter(|p| !p.trim().is_empty()),
        );
    }
    assert!(
        texts.len() > 100,
        "expected the license texts in /usr/share/common-licenses"
    );
    texts
}

fn odd_inputs() -> Vec<String> {
    [
        "Hello world! 🌍🚀 Emoji: 👨‍👩‍👧‍👦 ✨",
        "中文测试：北京是中国的首都。日本語のテキスト、한국어 문장.",
        "tabs\tand\tcontrol\u{7}chars\u{1b}[0m and NUL-free \u{0c} form feed",
        "long        whitespace               runs\n\n\n\n   and trailing   ",
        "numbers 1234567890 3.14159 1,000,000 and 2026-11-23",
        "don't won't it's I'm we've they'll she'd DON'T",
        "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
        "café naïve coöperate Ærøskøbing ß ﬁ",
        "  leading spaces and \r\n windows line ends\r\n",
        "fn main() { println!(\"{}\", x.map(|v| v * 2)); } // code",
        "",
        " ",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect()
}

#[test]
fn tokenizer_ids_equal_llama_cpp() {
    let tok = TextTokenizer::load(gguf()).unwrap();
    let mut texts = corpus();
    texts.extend(odd_inputs());
    let reference = llama_ref(serde_json::json!({
        "op": "tokenize", "model": gguf(), "texts": texts,
    }));
    let expected: Vec<Vec<u32>> = serde_json::from_value(reference["ids"].clone()).unwrap();
    let mut tokens = 0;
    for (text, want) in texts.iter().zip(&expected) {
        let got = tok.encode(text, true).unwrap();
        assert_eq!(&got, want, "token ids differ for {text:?}");
        tokens += got.len();
        let back = tok.decode(&got).unwrap();
        if !text.contains("<|im_") {
            assert_eq!(&back, text, "decode(encode(x)) != x");
        }
    }
    eprintln!(
        "{} texts, {tokens} tokens: identical to llama.cpp",
        texts.len()
    );
}

fn argmax(l: &[f32]) -> u32 {
    let mut best = 0;
    for (i, v) in l.iter().enumerate() {
        if *v > l[best] {
            best = i;
        }
    }
    best as u32
}

const QUESTIONS: [&str; 10] = [
    "What is the capital of France? Answer in one sentence.",
    "Name three primary colors.",
    "Write a haiku about the sea.",
    "What is 12 times 12?",
    "Explain photosynthesis in one sentence.",
    "Who wrote Romeo and Juliet?",
    "Give me a synonym for happy.",
    "What is the boiling point of water in Celsius?",
    "Translate 'good morning' into Spanish.",
    "List two planets of the solar system.",
];

/// Float and INT8 paths against llama.cpp's greedy continuations of 10 chat prompts,
/// 32 tokens each: teacher-forced top-1 agreement, the share of answer tokens (up to
/// llama.cpp's end of turn) that free-running greedy decoding reproduces before the first
/// difference, and the KL of next-token distributions (llama.cpp's as P).
///
/// llama.cpp is not an exact float reference: its Q4_1 matmul quantizes activations to
/// 8 bits (Q8_1). Our float path uses the file's exact dequantized weights.
#[test]
fn greedy_tokens_agree_with_llama_cpp() {
    const N: usize = 32;
    let tok = TextTokenizer::load(gguf()).unwrap();
    let prompts: Vec<Vec<u32>> = QUESTIONS
        .iter()
        .map(|q| {
            let text = tok
                .apply_chat_template(&[ChatMessage {
                    role: "user".into(),
                    content: q.to_string(),
                }])
                .unwrap();
            tok.encode(&text, true).unwrap()
        })
        .collect();
    let tmp = tempfile::tempdir().unwrap();
    let logits_path = tmp.path().join("llama-logits.f32");
    let reference = llama_ref(serde_json::json!({
        "op": "greedy", "model": gguf(), "prompts": prompts, "n": N,
        "logits_out": logits_path,
    }));
    let want: Vec<Vec<u32>> = serde_json::from_value(reference["tokens"].clone()).unwrap();
    let vocab = reference["vocab"].as_u64().unwrap() as usize;
    let raw = std::fs::read(&logits_path).unwrap();
    let ref_logits: Vec<f32> = raw
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
    assert_eq!(ref_logits.len(), prompts.len() * N * vocab);

    let plain = Rig::new(gguf(), Residency::Dual, KvFloatDtype::F16);
    let cfg = plain.model.config().clone();
    // The same model with split activations on every INT8 row (`split_activations = all`).
    let split = {
        use quantmesh_engine::backend::{Forms, SplitActivations};
        let forms = Forms {
            split: SplitActivations::All,
            ..Forms::EXACT
        };
        let ck = Checkpoint::open(gguf()).unwrap();
        let model = LlamaModel::load_from(&ck, &cfg, &|_| Residency::Dual, forms).unwrap();
        Rig::with_model(model, &cfg, KvFloatDtype::F16)
    };
    let mut rigs = [plain, split];
    let eos = cfg.eos_ids();
    let float_mask = PathMask::all_groups_float(cfg.num_hidden_layers);
    let int8_mask = PathMask::default();
    let mut report = Vec::new();
    for (name, r, mask, kv_int8) in [
        ("float", 0, &float_mask, false),
        ("int8", 0, &int8_mask, true),
        ("split", 1, &int8_mask, true),
    ] {
        let rig = &mut rigs[r];
        let (mut forced, mut free, mut kl_sum) = (0usize, 0usize, 0f64);
        let mut answer_positions = 0usize;
        let mut first_answer = String::new();
        for (p, prompt) in prompts.iter().enumerate() {
            // Teacher forcing: feed llama.cpp's tokens, compare our top-1 and distribution.
            let seq = p as u64 * 2;
            let mut logits = rig.feed(seq, prompt, mask, kv_int8);
            for (i, &t) in want[p].iter().enumerate() {
                let r = &ref_logits[(p * N + i) * vocab..(p * N + i + 1) * vocab];
                kl_sum += kl_logits(r, &logits);
                forced += usize::from(argmax(&logits) == t);
                logits = rig.feed(seq, &[t], mask, kv_int8);
            }
            rig.free(seq);
            // Free running: our own greedy tokens.
            let seq = seq + 1;
            let mut logits = rig.feed(seq, prompt, mask, kv_int8);
            let mut ours = Vec::new();
            for _ in 0..N {
                let t = argmax(&logits);
                ours.push(t);
                logits = rig.feed(seq, &[t], mask, kv_int8);
            }
            rig.free(seq);
            // Up to and including llama.cpp's first end-of-generation token: what a served
            // answer is (after it, greedy decoding of a finished answer is noise).
            let end = want[p]
                .iter()
                .position(|t| eos.contains(t))
                .map_or(N, |i| i + 1);
            answer_positions += end;
            free += ours[..end]
                .iter()
                .zip(&want[p][..end])
                .take_while(|(a, b)| a == b)
                .count();
            if p == 0 {
                let cut = ours.iter().position(|t| eos.contains(t)).unwrap_or(N);
                first_answer = tok.decode(&ours[..cut]).unwrap();
            }
        }
        let total = (prompts.len() * N) as f64;
        let row = (
            name,
            forced as f64 / total,
            free as f64 / answer_positions as f64,
            kl_sum / total,
            first_answer,
        );
        eprintln!(
            "{name:>5}: teacher-forced top-1 agreement {:.3}, free-running identical answer prefix {:.3}, mean KL {:.5} nats; \"{}\"",
            row.1, row.2, row.3, row.4
        );
        report.push(row);
    }
    let float = &report[0];
    assert!(
        float.1 >= 0.95,
        "float path agrees with llama.cpp on {:.3} of positions (< 0.95)",
        float.1
    );
    assert!(float.4.contains("Paris"), "float answer: {:?}", float.4);
    let int8 = &report[1];
    assert!(
        int8.4.contains("Paris"),
        "INT8 answer to the capital question: {:?}",
        int8.4
    );
    // Split activations serve the same INT8 weights with ≈ 16-bit activations: the answer
    // stays right and the distribution is closer to llama.cpp's float model than plain INT8's.
    let split = &report[2];
    assert!(split.4.contains("Paris"), "split answer: {:?}", split.4);
    assert!(
        split.3 < int8.3,
        "split KL to llama.cpp {:.5} not below plain INT8's {:.5}",
        split.3,
        int8.3
    );
}

/// A file cut short names the file and the first tensor whose data is missing.
#[test]
fn truncated_gguf_names_file_and_tensor() {
    let bytes = std::fs::read(gguf()).unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let cut = tmp.path().join("cut.gguf");
    std::fs::write(&cut, &bytes[..bytes.len() / 2]).unwrap();
    let err = match Checkpoint::open(&cut) {
        Err(e) => e,
        Ok(_) => panic!("a truncated file opened"),
    };
    let msg = err.to_string();
    assert!(
        matches!(&err, ModelError::Checkpoint { tensor: Some(t), .. } if t.starts_with("blk.")),
        "{msg}"
    );
    assert!(
        msg.contains("cut.gguf") && msg.contains("truncated"),
        "{msg}"
    );
    let err = match ModelConfig::load(&cut)
        .map_err(EngineError::from)
        .and_then(|c| LlamaModel::load(&cut, &c, &|_| Residency::Int8))
    {
        Err(e) => e.to_string(),
        Ok(_) => panic!("a truncated file loaded"),
    };
    assert!(err.contains("cut.gguf") && err.contains("tensor"), "{err}");
}

/// An architecture the engine does not run is refused by name, before any tensor is read.
#[test]
fn unknown_architecture_is_refused() {
    let mut bytes = std::fs::read(gguf()).unwrap();
    let key = b"general.architecture";
    let at = bytes
        .windows(key.len())
        .position(|w| w == key)
        .expect("architecture key");
    // key, then u32 value type (8 = string), u64 length, the string.
    let value = at + key.len() + 4 + 8;
    assert_eq!(&bytes[value..value + 5], b"llama");
    bytes[value..value + 5].copy_from_slice(b"gptj0");
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("other-arch.gguf");
    std::fs::write(&path, &bytes).unwrap();
    for err in [
        ModelConfig::load(&path).map(|_| ()).unwrap_err(),
        Checkpoint::open(&path).map(|_| ()).unwrap_err(),
        TextTokenizer::load(&path).map(|_| ()).unwrap_err(),
    ] {
        let msg = err.to_string();
        assert!(
            msg.contains("other-arch.gguf") && msg.contains("\"gptj0\"") && msg.contains("llama"),
            "{msg}"
        );
    }
}

/// The metadata drives the config: the numbers llama.cpp reports for this file.
#[test]
fn config_comes_from_the_metadata() {
    let cfg = ModelConfig::load(gguf()).unwrap();
    assert_eq!(cfg.model_type, "llama");
    assert_eq!(
        (
            cfg.num_hidden_layers,
            cfg.hidden_size,
            cfg.intermediate_size
        ),
        (30, 576, 1536)
    );
    assert_eq!(
        (cfg.num_attention_heads, cfg.num_kv_heads(), cfg.head_dim()),
        (9, 3, 64)
    );
    assert_eq!(cfg.vocab_size, 49152);
    assert!(cfg.tie_word_embeddings);
    assert_eq!(cfg.rope_theta, 100_000.0);
    assert!(cfg.eos_ids().contains(&2), "{:?}", cfg.eos_ids());
    let ck = Checkpoint::open(gguf()).unwrap();
    let info = ck.info("model.layers.0.self_attn.q_proj.weight").unwrap();
    assert_eq!(info.shape, vec![576, 576]);
    assert_eq!(info.dtype, "Q4_1");
    assert!(!ck.contains("lm_head.weight"));
}
