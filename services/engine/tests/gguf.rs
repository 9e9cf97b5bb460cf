//! GGUF loading on files we write ourselves from the bundled safetensors checkpoints, the
//! way llama.cpp's converter writes them (q/k rows interleaved for Llama, not for Qwen2;
//! 1-D tensors in F32): the same model must come back — same config, same weights, same
//! logits — whatever the architecture (llama with GQA, qwen2 with q/k/v biases), storage
//! type (F32, F16, Q8_0, Q4_K) or source dtype.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use candle_core::quantized::gguf_file::{self, Value};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use quantmesh_engine::backend::cpu::LlamaModel;
use quantmesh_engine::backend::{SeqChunk, StepInput};
use quantmesh_engine::kv::BlockManager;
use quantmesh_engine::kv::KvCache;
use quantmesh_engine::kv::KvFloatDtype;
use quantmesh_engine::precision::{PathMask, StepRunner};
use quantmesh_model::bundled::{init_model, InitOptions, ModelSize, StoreDtype};
use quantmesh_model::checkpoint::Checkpoint;
use quantmesh_model::gguf::gguf_name;
use quantmesh_model::ModelConfig;
use quantmesh_types::Residency;
use std::path::Path;

/// llama.cpp's `permute` in convert_hf_to_gguf.py, as tensor ops:
/// `w.reshape(heads, 2, rows/heads/2, cols).swapaxes(1, 2).reshape(rows, cols)`; with
/// `inverse`, the reshape `(heads, rows/heads/2, 2, cols)` that undoes it.
fn interleave(w: &Tensor, heads: usize, inverse: bool) -> Tensor {
    let (rows, cols) = w.dims2().unwrap();
    let split = if inverse {
        (heads, rows / heads / 2, 2, cols)
    } else {
        (heads, 2, rows / heads / 2, cols)
    };
    w.reshape(split)
        .unwrap()
        .transpose(1, 2)
        .unwrap()
        .contiguous()
        .unwrap()
        .reshape((rows, cols))
        .unwrap()
}

fn llama_permute(w: &Tensor, heads: usize) -> Tensor {
    interleave(w, heads, false)
}

/// Write the checkpoint at `hf` as a GGUF file: 2-D weights in `dtype`, the rest F32.
fn write_gguf(hf: &Path, out: &Path, dtype: GgmlDType) {
    let cfg = ModelConfig::load(hf).unwrap();
    let ck = Checkpoint::open(hf).unwrap();
    let arch = cfg.model_type.clone();
    let mut tensors: Vec<(String, QTensor)> = Vec::new();
    let mut names: Vec<&str> = ck.names().collect();
    names.sort();
    for name in names {
        let Some(g) = gguf_name(name) else {
            continue;
        };
        let mut t = ck.load_f32(name).unwrap();
        if arch == "llama" && name.ends_with("q_proj.weight") {
            t = llama_permute(&t, cfg.num_attention_heads);
        } else if arch == "llama" && name.ends_with("k_proj.weight") {
            t = llama_permute(&t, cfg.num_kv_heads());
        }
        let ty = if t.rank() == 2 { dtype } else { GgmlDType::F32 };
        tensors.push((g, QTensor::quantize(&t, ty).unwrap()));
    }
    let a = |k: &str| format!("{arch}.{k}");
    let meta: Vec<(String, Value)> = vec![
        ("general.architecture".into(), Value::String(arch.clone())),
        (a("block_count"), Value::U32(cfg.num_hidden_layers as u32)),
        (a("embedding_length"), Value::U32(cfg.hidden_size as u32)),
        (
            a("feed_forward_length"),
            Value::U32(cfg.intermediate_size as u32),
        ),
        (
            a("attention.head_count"),
            Value::U32(cfg.num_attention_heads as u32),
        ),
        (
            a("attention.head_count_kv"),
            Value::U32(cfg.num_kv_heads() as u32),
        ),
        (
            a("attention.layer_norm_rms_epsilon"),
            Value::F32(cfg.rms_norm_eps as f32),
        ),
        (a("rope.freq_base"), Value::F32(cfg.rope_theta as f32)),
        (
            a("context_length"),
            Value::U32(cfg.max_position_embeddings as u32),
        ),
        (a("vocab_size"), Value::U32(cfg.vocab_size as u32)),
    ];
    let meta_refs: Vec<(&str, &Value)> = meta.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let tensor_refs: Vec<(&str, &QTensor)> = tensors.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let mut f = std::fs::File::create(out).unwrap();
    gguf_file::write(&mut f, &meta_refs, &tensor_refs).unwrap();
}

/// Last-token logits after each of `tokens`, one decode step at a time (float path).
fn logits(path: &Path, tokens: &[u32]) -> Vec<Vec<f32>> {
    let cfg = ModelConfig::load(path).unwrap();
    let model = LlamaModel::load(path, &cfg, &|_| Residency::Float).unwrap();
    let mut runner = StepRunner::default();
    let mut kv = KvCache::new(
        cfg.num_hidden_layers,
        8,
        16,
        cfg.kv_dim(),
        KvFloatDtype::F32,
    );
    let mut bm = BlockManager::new(8, 16, false);
    bm.admit(0, &[], 64).unwrap();
    let mut out = Vec::new();
    for (i, &t) in tokens.iter().enumerate() {
        let a = bm.append(0, 1).unwrap();
        let step = StepInput {
            chunks: vec![SeqChunk {
                seq: 0,
                tokens: vec![t],
                start_pos: i,
                slots: a.slots,
                block_table: bm.block_table(0).unwrap().to_vec(),
                want_logits: true,
            }],
            copies: a.copies,
        };
        let mut o = runner
            .run(&model, &step, &PathMask::default(), &mut kv, false)
            .unwrap();
        out.push(o.logits.remove(0).1);
    }
    out
}

fn max_diff(a: &[Vec<f32>], b: &[Vec<f32>]) -> f32 {
    a.iter()
        .flatten()
        .zip(b.iter().flatten())
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

const PROMPT: [u32; 12] = [256, 72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108];

fn bundled(opts: InitOptions) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    init_model(dir.path(), &opts).unwrap();
    dir
}

#[test]
fn f32_gguf_is_the_same_model_for_llama_and_qwen2() {
    for (qkv_bias, seed, dtype) in [(false, 11, StoreDtype::Bf16), (true, 12, StoreDtype::F16)] {
        let hf = bundled(InitOptions {
            qkv_bias,
            seed,
            dtype,
            ..Default::default()
        });
        let file = hf.path().join("model.gguf");
        write_gguf(hf.path(), &file, GgmlDType::F32);
        let (a, b) = (
            ModelConfig::load(hf.path()).unwrap(),
            ModelConfig::load(&file).unwrap(),
        );
        assert_eq!(b.model_type, if qkv_bias { "qwen2" } else { "llama" });
        assert_eq!(
            (
                a.hidden_size,
                a.intermediate_size,
                a.num_hidden_layers,
                a.num_kv_heads(),
                a.head_dim()
            ),
            (
                b.hidden_size,
                b.intermediate_size,
                b.num_hidden_layers,
                b.num_kv_heads(),
                b.head_dim()
            )
        );
        assert_eq!(b.has_qkv_bias(), qkv_bias);
        assert!(!b.tie_word_embeddings, "output.weight is present");
        // Weights come back exactly, q/k rows in Hugging Face order.
        let (ca, cb) = (
            Checkpoint::open(hf.path()).unwrap(),
            Checkpoint::open(&file).unwrap(),
        );
        for name in [
            "model.layers.1.self_attn.q_proj.weight",
            "model.layers.1.self_attn.k_proj.weight",
            "model.layers.2.mlp.down_proj.weight",
        ] {
            assert_eq!(
                ca.read_f32(name).unwrap(),
                cb.read_f32(name).unwrap(),
                "{name}"
            );
            let rows = ca.info(name).unwrap().shape[0];
            // Inside one head, across a head boundary, and the last rows.
            for (start, n) in [(3, 5), (30, 5), (rows - 7, 7)] {
                assert_eq!(
                    ca.read_rows_f32(name, start, n).unwrap(),
                    cb.read_rows_f32(name, start, n).unwrap(),
                    "{name} rows {start}..{} of {rows}",
                    start + n
                );
            }
        }
        let d = max_diff(&logits(hf.path(), &PROMPT), &logits(&file, &PROMPT));
        assert!(d < 1e-3, "qkv_bias={qkv_bias}: logits differ by {d}");
    }
}

#[test]
fn quantized_gguf_float_form_is_the_exact_dequantization() {
    let hf = bundled(InitOptions {
        size: ModelSize::Tiny,
        seed: 21,
        ..Default::default()
    });
    let ck = Checkpoint::open(hf.path()).unwrap();
    let cfg = ModelConfig::load(hf.path()).unwrap();
    for dtype in [GgmlDType::F16, GgmlDType::Q8_0, GgmlDType::Q4K] {
        let file = hf.path().join(format!("model-{dtype:?}.gguf"));
        write_gguf(hf.path(), &file, dtype);
        let q = Checkpoint::open(&file).unwrap();
        for name in [
            "model.layers.0.self_attn.q_proj.weight",
            "model.layers.3.self_attn.k_proj.weight",
            "model.layers.1.mlp.gate_proj.weight",
        ] {
            // What the file holds, dequantized, in Hugging Face row order.
            let t = ck.load_f32(name).unwrap();
            let heads = if name.contains("q_proj") {
                Some(cfg.num_attention_heads)
            } else if name.contains("k_proj") {
                Some(cfg.num_kv_heads())
            } else {
                None
            };
            let stored = match heads {
                Some(h) => llama_permute(&t, h),
                None => t,
            };
            let deq = QTensor::quantize(&stored, dtype)
                .unwrap()
                .dequantize(&Device::Cpu)
                .unwrap();
            let expected = match heads {
                Some(h) => interleave(&deq, h, true),
                None => deq,
            };
            let expected: Vec<f32> = expected.flatten_all().unwrap().to_vec1().unwrap();
            assert_eq!(q.read_f32(name).unwrap().0, expected, "{dtype:?} {name}");
            let cols = q.info(name).unwrap().shape[1];
            assert_eq!(
                q.read_rows_f32(name, 30, 5).unwrap(),
                expected[30 * cols..35 * cols].to_vec(),
                "{dtype:?} {name} rows 30..35"
            );
            assert_eq!(q.info(name).unwrap().dtype, format!("{dtype:?}"));
        }
        q.verify("model.layers.0.mlp.down_proj.weight").unwrap();
        // The model built from it runs and stays close to the source model.
        let d = max_diff(
            &logits(hf.path(), &PROMPT[..6]),
            &logits(&file, &PROMPT[..6]),
        );
        assert!(d.is_finite(), "{dtype:?}");
    }
}

#[test]
fn a_directory_holding_one_gguf_is_a_model_and_two_are_ambiguous() {
    let hf = bundled(InitOptions::default());
    let dir = tempfile::tempdir().unwrap();
    write_gguf(hf.path(), &dir.path().join("a.gguf"), GgmlDType::F32);
    assert!(ModelConfig::load(dir.path()).is_ok());
    assert!(Checkpoint::open(dir.path()).is_ok());
    std::fs::copy(dir.path().join("a.gguf"), dir.path().join("b.gguf")).unwrap();
    let err = ModelConfig::load(dir.path()).unwrap_err().to_string();
    assert!(err.contains("a.gguf") && err.contains("b.gguf"), "{err}");
    // Another kind of file is named as such.
    let err = ModelConfig::load(&hf.path().join("config.json"))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("config.json") && err.contains("not a GGUF file"),
        "{err}"
    );
    // A GGUF without tokenizer metadata serves no text: the error says why.
    let err = match quantmesh_model::tokenizer::TextTokenizer::load(&dir.path().join("a.gguf")) {
        Ok(_) => panic!("a GGUF without a tokenizer"),
        Err(e) => e.to_string(),
    };
    assert!(
        err.contains("a.gguf") && err.contains("tokenizer.ggml.model"),
        "{err}"
    );
}

mod corrupt_inputs {
    //! Property test: a GGUF file with bytes flipped in its header (metadata, tensor infos)
    //! or cut anywhere is refused with an error — never a panic, never a giant allocation.

    use super::*;
    use proptest::prelude::*;

    fn original() -> &'static Vec<u8> {
        static F: std::sync::OnceLock<Vec<u8>> = std::sync::OnceLock::new();
        F.get_or_init(|| {
            let hf = bundled(InitOptions::default());
            let dir = tempfile::tempdir().unwrap();
            let path = dir.path().join("m.gguf");
            write_gguf(hf.path(), &path, GgmlDType::F32);
            std::fs::read(path).unwrap()
        })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(96))]

        #[test]
        fn a_corrupted_gguf_is_an_error_not_a_panic(
            flips in prop::collection::vec((0usize..16384, any::<u8>()), 0..6),
            cut in prop::option::of(any::<usize>()),
        ) {
            let mut b = original().clone();
            for (at, v) in flips {
                let at = at % b.len();
                b[at] = v;
            }
            if let Some(c) = cut {
                b.truncate(c % (b.len() + 1));
            }
            let dir = tempfile::tempdir().unwrap();
            std::fs::write(dir.path().join("m.gguf"), &b).unwrap();
            if ModelConfig::load(dir.path()).is_ok() {
                if let Ok(ck) = Checkpoint::open(dir.path()) {
                    let names: Vec<String> = ck.names().map(String::from).collect();
                    for n in names {
                        let _ = ck.read_f32(&n);
                    }
                }
                let _ = quantmesh_model::tokenizer::TextTokenizer::load(&dir.path().join("m.gguf"));
            }
        }
    }
}
