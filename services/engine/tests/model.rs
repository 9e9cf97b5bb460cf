//! Model-level correctness on the bundled checkpoint: INT8 vs float, paged decode vs
//! recompute, sharded loading, corrupt files, precision switches mid-sequence.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use candle_core::Tensor;
use quantmesh_engine::backend::cpu::LlamaModel;
use quantmesh_engine::backend::Backend;
use quantmesh_engine::kv::KvFloatDtype;
use quantmesh_engine::precision::PathMask;
use quantmesh_engine::EngineError;
use quantmesh_model::bundled::{init_model, InitOptions, StoreDtype};
use quantmesh_model::ModelConfig;
use quantmesh_model::ModelError;
use quantmesh_types::{GroupId, GroupKind, Residency};

mod support;
use support::Rig;

fn model_dir(opts: InitOptions) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    init_model(dir.path(), &opts).unwrap();
    dir
}

fn all_float(cfg_layers: usize) -> PathMask {
    PathMask::all_groups_float(cfg_layers)
}

fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

fn kl(p_logits: &[f32], q_logits: &[f32]) -> f64 {
    let sm = |l: &[f32]| {
        let m = l.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
        let e: Vec<f64> = l.iter().map(|x| ((x - m) as f64).exp()).collect();
        let s: f64 = e.iter().sum();
        e.into_iter().map(|x| x / s).collect::<Vec<_>>()
    };
    let (p, q) = (sm(p_logits), sm(q_logits));
    p.iter()
        .zip(&q)
        .map(|(p, q)| {
            if *p > 0.0 {
                p * (p / q.max(1e-30)).ln()
            } else {
                0.0
            }
        })
        .sum()
}

fn prompt() -> Vec<u32> {
    let mut t = vec![256u32];
    t.extend(
        "The quick brown fox jumps over the lazy dog, again and again."
            .bytes()
            .map(u32::from),
    );
    t
}

#[test]
fn int8_path_is_close_to_float_path() {
    let dir = model_dir(InitOptions::default());
    let mut rig = Rig::new(dir.path(), Residency::Dual, KvFloatDtype::F32);
    let layers = rig.model.config().num_hidden_layers;
    let p = prompt();
    let f = rig.feed(1, &p, &all_float(layers), false);
    let q = rig.feed(2, &p, &PathMask::default(), false);
    let scale = f.iter().map(|x| x.abs()).fold(0.0, f32::max);
    let d = max_abs_diff(&f, &q);
    let k = kl(&f, &q);
    eprintln!("max |logit diff| = {d} (max |logit| {scale}), KL(float||int8) = {k}");
    // Bound: Q8_0 weights and activations keep logits within 10 % of their range and the
    // next-token distributions within KL 0.05 nats.
    assert!(d <= 0.10 * scale, "diff {d} vs scale {scale}");
    assert!(k < 0.05, "KL {k}");
    assert!(d > 0.0, "the INT8 path must actually differ");
    // The sensitive group alone in float moves the INT8 result towards float.
    let mut m = PathMask::default();
    m.float_groups.insert(GroupId::new(1, GroupKind::Down));
    let s = rig.feed(3, &p, &m, false);
    assert!(
        kl(&f, &s) < k,
        "fixing the planted sensitive group must reduce KL"
    );
}

/// The whole model on every instruction set this CPU runs (the scalar reference included):
/// the same logits up to f32 summation order, on the INT8 path (8- and 16-bit activations)
/// and the float path, prefill and decode. With 8-bit activations a last-bit difference
/// upstream can move an activation across a rounding boundary (a step of 1/127 of its
/// block's largest value) and the next layers carry it: measured over model seeds, AVX2
/// and AVX-512 alike land anywhere from 10⁻⁶ to 0.4× of what 8-bit activations themselves
/// cost (the 8- vs 16-bit difference on the reference). There the bound is that cost; a
/// wrong kernel misses it by orders of magnitude.
#[test]
fn every_instruction_set_gives_the_same_logits() {
    use quantmesh_engine::backend::{FloatDtype, Forms, SplitActivations};
    use quantmesh_kernels::Isa;
    let dir = model_dir(InitOptions::default());
    let cfg = ModelConfig::load(dir.path()).unwrap();
    let ck = quantmesh_model::Checkpoint::open(dir.path()).unwrap();
    let layers = cfg.num_hidden_layers;
    let p = prompt();
    let run = |isa: Isa, split: SplitActivations, float: bool| {
        let mask = if float {
            all_float(layers)
        } else {
            PathMask::default()
        };
        // f16 float copies: the float path runs on the kernels' f16 product.
        let forms = Forms {
            split,
            float: FloatDtype::F16,
            ..Forms::EXACT
        };
        // Loaded inside the scope: the weights are packed in the order `isa`'s kernel reads.
        isa.scoped(|| {
            let model = LlamaModel::load_from(&ck, &cfg, &|_| Residency::Dual, forms).unwrap();
            let mut rig = Rig::with_model(model, &cfg, KvFloatDtype::F32);
            let mut out = rig.feed(1, &p[..p.len() - 2], &mask, true);
            for t in &p[p.len() - 2..] {
                out.extend(rig.feed(1, &[*t], &mask, true));
            }
            out
        })
    };
    // What 8-bit activations cost on the reference: the scale of a rounding flip's effect.
    let eight_bit_noise = max_abs_diff(
        &run(Isa::Scalar, SplitActivations::Off, false),
        &run(Isa::Scalar, SplitActivations::All, false),
    );
    for split in [SplitActivations::Off, SplitActivations::All] {
        for float in [false, true] {
            let want = run(Isa::Scalar, split, float);
            let scale = want.iter().fold(0f32, |m, x| m.max(x.abs()));
            let tol = match (split, float) {
                (SplitActivations::Off, false) => (1e-4 * scale).max(eight_bit_noise),
                _ => 1e-4 * scale,
            };
            for isa in Isa::all_available() {
                let got = run(isa, split, float);
                assert_eq!(got.len(), want.len());
                let d = max_abs_diff(&got, &want);
                eprintln!(
                    "{isa:?} split={split:?} float={float}: max |Δlogit| {d} (scale {scale}, 8-bit noise {eight_bit_noise}, tolerance {tol})"
                );
                assert!(d <= tol, "{isa:?} split={split:?} float={float}: {d}");
            }
        }
    }
}

/// The vocabulary projection (Q8_0 tables, never watched, never with a float copy) carries
/// 16-bit activations under every mode but `off`: with every group on its float path it is
/// the only quantized product, so `copyless` gives exactly `all`'s logits and `off` (8-bit
/// activations there too) others.
#[test]
fn the_vocabulary_projection_carries_16_bit_activations_unless_off() {
    use quantmesh_engine::backend::{EmbeddingDtype, Forms, SplitActivations};
    let dir = model_dir(InitOptions::default());
    let cfg = ModelConfig::load(dir.path()).unwrap();
    let ck = quantmesh_model::Checkpoint::open(dir.path()).unwrap();
    let mask = all_float(cfg.num_hidden_layers);
    let p = prompt();
    let run = |split: SplitActivations| {
        let forms = Forms {
            split,
            embeddings: EmbeddingDtype::Q8_0,
            ..Forms::EXACT
        };
        let model = LlamaModel::load_from(&ck, &cfg, &|_| Residency::Dual, forms).unwrap();
        let mut rig = Rig::with_model(model, &cfg, KvFloatDtype::F32);
        rig.feed(1, &p, &mask, true)
    };
    let all = run(SplitActivations::All);
    assert_eq!(run(SplitActivations::Copyless), all);
    let off = run(SplitActivations::Off);
    assert!(
        max_abs_diff(&off, &all) > 0.0,
        "8-bit activations must move the logits"
    );
}

#[test]
fn paged_incremental_decode_equals_full_recompute() {
    let dir = model_dir(InitOptions::default());
    for (kv_int8, float) in [(false, true), (false, false), (true, false)] {
        let mut rig = Rig::new(dir.path(), Residency::Dual, KvFloatDtype::F32);
        let p = prompt();
        let mask = if float {
            all_float(rig.model.config().num_hidden_layers)
        } else {
            PathMask::default()
        };
        // incremental: prefill 5 tokens, then one at a time across page boundaries
        let mut inc = rig.feed(1, &p[..5], &mask, kv_int8);
        let mut last = Vec::new();
        for (i, t) in p[5..].iter().enumerate() {
            inc = rig.feed(1, &[*t], &mask, kv_int8);
            if i == p.len() - 6 {
                last = inc.clone();
            }
        }
        // full: the whole sequence in one prefill, fresh sequence
        let full = rig.feed(2, &p, &mask, kv_int8);
        let d = max_abs_diff(&last, &full);
        eprintln!(
            "kv_int8={kv_int8} float={float}: {d} (max logit {})",
            full.iter().fold(0f32, |m, x| m.max(x.abs()))
        );
        // Float path: only f32 summation order differs (candle's f32 GEMM). INT8 path: the
        // activations' rounding and the kernels' register tiles (1 or 2 rows) may differ in
        // the last bits; bound: 1 % of the logit range.
        let scale = full.iter().fold(0f32, |m, x| m.max(x.abs()));
        let bound = if float { 1e-4 } else { 0.01 * scale };
        assert!(
            d < bound,
            "kv_int8={kv_int8} float={float}: incremental vs recompute differ by {d}"
        );
        assert_eq!(inc.len(), full.len());
    }
}

#[test]
fn precision_switch_mid_sequence_continues() {
    let dir = model_dir(InitOptions::default());
    let mut rig = Rig::new(dir.path(), Residency::Dual, KvFloatDtype::F16);
    let p = prompt();
    let mut mask = PathMask::default();
    rig.feed(1, &p[..20], &mask, true);
    // layer 2 falls back: its groups to float, its KV cache to float for new tokens
    for k in GroupKind::ALL {
        mask.float_groups.insert(GroupId::new(2, k));
    }
    mask.kv_float_layers.insert(2);
    let mut logits = Vec::new();
    for t in &p[20..30] {
        logits = rig.feed(1, &[*t], &mask, true);
    }
    assert!(logits.iter().all(|x| x.is_finite()));
    let table = rig.bm.block_table(1).unwrap().to_vec();
    let precisions = rig.kv.slot_precisions(2, &table, 30);
    assert!(
        precisions[..20].iter().all(|p| *p == Some(true)),
        "old tokens stay INT8"
    );
    assert!(
        precisions[20..].iter().all(|p| *p == Some(false)),
        "new tokens in float"
    );
    assert!(
        rig.kv
            .slot_precisions(1, &table, 30)
            .iter()
            .all(|p| *p == Some(true)),
        "other layers untouched"
    );
    // and back to INT8
    let mask = PathMask::default();
    let l = rig.feed(1, &p[30..32], &mask, true);
    assert!(l.iter().all(|x| x.is_finite()));
}

#[test]
fn sharded_f32_checkpoint_matches_single_file() {
    let single = model_dir(InitOptions {
        dtype: StoreDtype::F32,
        ..Default::default()
    });
    let sharded = model_dir(InitOptions {
        dtype: StoreDtype::F32,
        shards: 3,
        ..Default::default()
    });
    assert!(sharded.path().join("model.safetensors.index.json").exists());
    assert!(sharded
        .path()
        .join("model-00003-of-00003.safetensors")
        .exists());
    let p = prompt();
    let mut a = Rig::new(single.path(), Residency::Float, KvFloatDtype::F32);
    let mut b = Rig::new(sharded.path(), Residency::Float, KvFloatDtype::F32);
    let m = PathMask::default();
    assert_eq!(a.feed(1, &p, &m, false), b.feed(1, &p, &m, false));
}

#[test]
fn f16_and_qwen2_bias_checkpoints_load_and_run() {
    let dir = model_dir(InitOptions {
        dtype: StoreDtype::F16,
        qkv_bias: true,
        ..Default::default()
    });
    let cfg = ModelConfig::from_file(&dir.path().join("config.json")).unwrap();
    assert!(cfg.has_qkv_bias());
    let mut rig = Rig::new(dir.path(), Residency::Dual, KvFloatDtype::F16);
    let l = rig.feed(1, &prompt(), &PathMask::default(), true);
    assert!(l.iter().all(|x| x.is_finite()));
}

#[test]
fn resident_bytes_follow_the_plan() {
    let dir = model_dir(InitOptions::default());
    let cfg = ModelConfig::from_file(&dir.path().join("config.json")).unwrap();
    let bytes = |r| {
        LlamaModel::load(dir.path(), &cfg, &|_| r)
            .unwrap()
            .linear_bytes()
    };
    let (i8b, dual, flt) = (
        bytes(Residency::Int8),
        bytes(Residency::Dual),
        bytes(Residency::Float),
    );
    assert_eq!(dual, i8b + flt);
    assert!(i8b * 3 < flt, "INT8 form is about a quarter of f32");
}

#[test]
fn truncated_checkpoint_names_file_and_tensor() {
    let dir = model_dir(InitOptions::default());
    let path = dir.path().join("model.safetensors");
    let bytes = std::fs::read(&path).unwrap();
    std::fs::write(&path, &bytes[..bytes.len() * 2 / 3]).unwrap();
    let cfg = ModelConfig::from_file(&dir.path().join("config.json")).unwrap();
    let err = LlamaModel::load(dir.path(), &cfg, &|_| Residency::Dual)
        .err()
        .expect("must fail");
    let msg = err.to_string();
    assert!(
        matches!(
            err,
            EngineError::Model(ModelError::Checkpoint {
                tensor: Some(_),
                ..
            })
        ),
        "{msg}"
    );
    assert!(
        msg.contains("model.safetensors") && msg.contains("tensor \"") && msg.contains("truncated"),
        "{msg}"
    );
}

#[test]
fn corrupt_tensor_data_names_the_tensor() {
    let dir = model_dir(InitOptions {
        dtype: StoreDtype::F32,
        ..Default::default()
    });
    let path = dir.path().join("model.safetensors");
    let mut bytes = std::fs::read(&path).unwrap();
    // Overwrite the last 8 bytes (inside the last tensor in file order) with NaNs.
    let n = bytes.len();
    bytes[n - 8..].copy_from_slice(&[0xff; 8]);
    std::fs::write(&path, &bytes).unwrap();
    let cfg = ModelConfig::from_file(&dir.path().join("config.json")).unwrap();
    let msg = LlamaModel::load(dir.path(), &cfg, &|_| Residency::Dual)
        .err()
        .expect("must fail")
        .to_string();
    assert!(
        msg.contains("model.safetensors") && msg.contains("NaN"),
        "{msg}"
    );
    // Garbage header
    std::fs::write(&path, b"not a safetensors file at all").unwrap();
    let msg = LlamaModel::load(dir.path(), &cfg, &|_| Residency::Dual)
        .err()
        .expect("must fail")
        .to_string();
    assert!(msg.contains("model.safetensors"), "{msg}");
}

#[test]
fn model_init_is_deterministic() {
    let a = model_dir(InitOptions::default());
    let b = model_dir(InitOptions::default());
    for f in [
        "model.safetensors",
        "config.json",
        "tokenizer.json",
        "planted.json",
        "README.md",
    ] {
        assert_eq!(
            std::fs::read(a.path().join(f)).unwrap(),
            std::fs::read(b.path().join(f)).unwrap(),
            "{f}"
        );
    }
}

#[test]
fn massive_channels_are_really_massive() {
    // The planted channels dominate the embedding rows, as the model card says.
    let dir = model_dir(InitOptions {
        dtype: StoreDtype::F32,
        ..Default::default()
    });
    let planted: quantmesh_model::bundled::Planted =
        serde_json::from_str(&std::fs::read_to_string(dir.path().join("planted.json")).unwrap())
            .unwrap();
    let ck = quantmesh_model::checkpoint::Checkpoint::open(dir.path()).unwrap();
    let emb: Tensor = ck.load_f32("model.embed_tokens.weight").unwrap();
    let row = emb.get(65).unwrap().to_vec1::<f32>().unwrap();
    let c = planted.massive_channels[0];
    let others = row
        .iter()
        .enumerate()
        .filter(|(i, _)| *i != c)
        .map(|(_, x)| x.abs())
        .fold(0.0, f32::max);
    assert!(row[c] > 4.0 * others);
    let bos = emb.get(256).unwrap().to_vec1::<f32>().unwrap();
    assert!(bos[planted.bos_massive_channel] > 50.0);
}

fn detector_for(
    g: GroupId,
    bound: f32,
) -> std::sync::Arc<quantmesh_engine::precision::DetectorParams> {
    let mut groups = std::collections::BTreeMap::new();
    groups.insert(
        g,
        quantmesh_engine::precision::GroupDetector {
            excluded_channels: vec![],
            token_bound: bound,
            learn_channels: false,
            massive_ratio: 0.0,
            column_error: None,
        },
    );
    std::sync::Arc::new(quantmesh_engine::precision::DetectorParams {
        groups,
        skip_positions: vec![],
        shadow_sample_rate: 0.0,
    })
}

#[test]
fn per_token_bound_routes_rows_to_the_float_path_in_the_same_step() {
    let dir = model_dir(InitOptions::default());
    let g = GroupId::new(1, GroupKind::Down);
    let p = prompt();
    let run = |mask: PathMask| {
        let mut rig = Rig::new(dir.path(), Residency::Dual, KvFloatDtype::F32);
        rig.feed(1, &p, &mask, false)
    };
    let int8 = run(PathMask::default());
    let mut layer_float = PathMask::default();
    layer_float.float_groups.insert(g);
    // MLP coupling: rows routed at `down` get `gate_up` in float too
    layer_float
        .float_groups
        .insert(GroupId::new(1, GroupKind::GateUp));
    let float = run(layer_float);
    // bound 0: every row of the group is routed to float by the per-token rule
    let all_rows = run(PathMask {
        detector: Some(detector_for(g, 0.0)),
        ..Default::default()
    });
    assert_eq!(all_rows, float);
    // bound ∞: nothing routed, exactly the INT8 result
    let none = run(PathMask {
        detector: Some(detector_for(g, f32::INFINITY)),
        ..Default::default()
    });
    assert_eq!(none, int8);
    assert_ne!(int8, float);
}

#[test]
fn per_token_rows_are_reported_with_their_tokens() {
    let dir = model_dir(InitOptions::default());
    let mut rig = Rig::new(dir.path(), Residency::Dual, KvFloatDtype::F32);
    let toks = vec![256u32, b'a' as u32, b',' as u32, b'b' as u32];
    let g = GroupId::new(1, GroupKind::Down);
    // A bound between the ordinary rows and the planted spike on ',' routes only that row.
    let probe = rig.step(
        1,
        &toks,
        &PathMask {
            detector: Some(detector_for(g, f32::INFINITY)),
            ..Default::default()
        },
        false,
    );
    let stats = &probe.obs.iter().find(|o| o.group == g).unwrap().stats;
    let comma = stats[2];
    let others = stats
        .iter()
        .enumerate()
        .filter(|(i, _)| *i != 2)
        .map(|(_, s)| *s)
        .fold(0.0, f32::max);
    assert!(comma > 3.0 * others, "planted spike on ',': {stats:?}");
    // the same tokens again, as a fresh sequence, with the bound in between
    let out = rig.step(
        2,
        &toks,
        &PathMask {
            detector: Some(detector_for(g, (comma + others) / 2.0)),
            ..Default::default()
        },
        false,
    );
    let o = out.obs.iter().find(|o| o.group == g).unwrap();
    assert_eq!(o.token_float_rows, vec![2]);
    assert_eq!(out.rows[2], (2, 2, b',' as u32));
    let (_, outcome) = out.outcomes.iter().find(|(x, _)| *x == g).unwrap();
    assert_eq!((outcome.float_rows, outcome.int8_rows), (1, 3));
}

#[test]
fn non_finite_activations_recompute_the_step_in_float() {
    let dir = model_dir(InitOptions {
        dtype: StoreDtype::F32,
        ..Default::default()
    });
    // Corrupt (finite but absurd) norm gains overflow to Inf inside the forward pass.
    let ck = quantmesh_model::checkpoint::Checkpoint::open(dir.path()).unwrap();
    let mut names: Vec<String> = ck.names().map(String::from).collect();
    names.sort();
    let tensors: Vec<(String, Vec<usize>, Vec<f32>)> = names
        .iter()
        .map(|n| {
            let t = ck.load_f32(n).unwrap();
            let mut v = t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
            if n == "model.layers.2.input_layernorm.weight" {
                v.iter_mut().for_each(|x| *x = 3e38);
            }
            (n.clone(), t.dims().to_vec(), v)
        })
        .collect();
    drop(ck);
    quantmesh_model::checkpoint::write_safetensors(
        &dir.path().join("model.safetensors"),
        &tensors,
        safetensors::Dtype::F32,
    )
    .unwrap();
    let mut rig = Rig::new(dir.path(), Residency::Dual, KvFloatDtype::F32);
    let layers = rig.model.config().num_hidden_layers;
    let det = detector_for(GroupId::new(2, GroupKind::Qkv), f32::INFINITY);
    let out = rig.step(
        1,
        &[1, 2, 3],
        &PathMask {
            detector: Some(det),
            ..Default::default()
        },
        false,
    );
    assert!(out.non_finite, "NaN/Inf must be detected");
    // the recompute ran every group of the step on the float path
    assert!(
        out.outcomes
            .iter()
            .filter(|(_, o)| o.float_rows == 3)
            .count()
            >= layers * 4
    );
}

mod corrupt_inputs {
    //! Property tests for the parsers that take outside bytes: a safetensors checkpoint and
    //! a `sensitive_layers.json` with bytes flipped or cut anywhere in their headers give an
    //! error (or, where the flip is harmless, a result) — never a panic.

    use super::*;
    use proptest::prelude::*;
    use quantmesh_model::checkpoint::Checkpoint;
    use quantmesh_model::model_shape;
    use quantmesh_types::SensitiveLayers;

    struct Fixture {
        /// A small bundled checkpoint's bytes, its header length, its config.json.
        bytes: Vec<u8>,
        header: usize,
        config: Vec<u8>,
        /// A valid plan for it, and its shape.
        plan: Vec<u8>,
        shape: quantmesh_types::ModelShape,
    }

    fn fixture() -> &'static Fixture {
        static F: std::sync::OnceLock<Fixture> = std::sync::OnceLock::new();
        F.get_or_init(|| {
            let dir = model_dir(InitOptions::default());
            let bytes = std::fs::read(dir.path().join("model.safetensors")).unwrap();
            let header = 8 + u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
            let cfg = ModelConfig::from_file(&dir.path().join("config.json")).unwrap();
            let shape = model_shape(&Checkpoint::open(dir.path()).unwrap(), &cfg).unwrap();
            let plan = serde_json::to_vec_pretty(&serde_json::json!({
                "schema_version": 1,
                "model": {"num_layers": cfg.num_hidden_layers, "hidden_size": cfg.hidden_size,
                          "intermediate_size": cfg.intermediate_size, "layout_md5": shape.layout_md5},
                "thresholds": {"k": 4.0, "trigger_rate": 0.01, "min_excess": 1.0},
                "groups": {"layers.1.down": {"class": "fp16", "monitor": {"k": 5.0}},
                           "layers.0.qkv": {"class": "w8a8", "massive_channels": [3]}}
            }))
            .unwrap();
            let config = std::fs::read(dir.path().join("config.json")).unwrap();
            Fixture { bytes, header, config, plan, shape }
        })
    }

    fn mutate(bytes: &[u8], region: usize, flips: &[(usize, u8)], cut: Option<usize>) -> Vec<u8> {
        let mut b = bytes.to_vec();
        for &(at, v) in flips {
            let at = at % region.min(b.len());
            b[at] = v;
        }
        if let Some(c) = cut {
            b.truncate(c % (b.len() + 1));
        }
        b
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(96))]

        #[test]
        fn a_corrupted_safetensors_header_is_an_error_not_a_panic(
            flips in prop::collection::vec((any::<usize>(), any::<u8>()), 0..6),
            cut in prop::option::of(any::<usize>()),
        ) {
            let f = fixture();
            let dir = tempfile::tempdir().unwrap();
            std::fs::write(dir.path().join("config.json"), &f.config).unwrap();
            std::fs::write(dir.path().join("model.safetensors"), mutate(&f.bytes, f.header, &flips, cut)).unwrap();
            if let Ok(ck) = Checkpoint::open(dir.path()) {
                // A header that still parses: reading every tensor errors or succeeds.
                let names: Vec<String> = ck.names().map(String::from).collect();
                for n in names {
                    let _ = ck.read_f32(&n);
                }
            }
        }

        #[test]
        fn a_corrupted_plan_is_rejected_with_a_reason_not_a_panic(
            flips in prop::collection::vec((any::<usize>(), any::<u8>()), 0..6),
            cut in prop::option::of(any::<usize>()),
        ) {
            let f = fixture();
            let b = mutate(&f.plan, f.plan.len(), &flips, cut);
            match SensitiveLayers::parse(&b) {
                Ok(p) => {
                    if let Err(e) = p.validate(&f.shape) {
                        prop_assert!(!e.to_string().is_empty());
                    }
                }
                Err(e) => prop_assert!(!e.to_string().is_empty()),
            }
        }
    }
}

/// The shadow pass's reference on an INT8-only model reads every group's weights from the
/// checkpoint: its logits are the float model's, not the INT8 model's; the kept weights stay
/// within the cache's bytes, and weights beyond it are read again on every pass.
#[test]
fn the_reference_pass_of_an_int8_only_model_is_the_float_model() {
    use quantmesh_engine::backend::cpu::reference::ReferenceWeights;
    use quantmesh_engine::backend::FloatDtype;
    use quantmesh_engine::precision::MaskRouter;
    let dir = model_dir(InitOptions::default());
    let cfg = ModelConfig::load(dir.path()).unwrap();
    let float = LlamaModel::load(dir.path(), &cfg, &|_| Residency::Float).unwrap();
    let one_group = {
        let w = quantmesh_model::ops::GroupWeights::load(
            &quantmesh_model::Checkpoint::open(dir.path()).unwrap(),
            &cfg,
            GroupId::new(0, GroupKind::Qkv),
        )
        .unwrap();
        w.weight.elem_count() * 4
    };
    let int8 = LlamaModel::load(dir.path(), &cfg, &|_| Residency::Int8)
        .unwrap()
        .with_reference(ReferenceWeights::new(
            quantmesh_model::Checkpoint::open(dir.path()).unwrap(),
            cfg.clone(),
            FloatDtype::F32,
            one_group,
        ));
    let p = prompt();
    let mut want = Rig::with_model(float, &cfg, KvFloatDtype::F32);
    let want = want.feed(1, &p, &all_float(cfg.num_hidden_layers), false);
    let mut rig = Rig::with_model(int8, &cfg, KvFloatDtype::F32);
    let served = rig.feed(1, &p, &PathMask::default(), false);
    let groups = cfg.num_hidden_layers * 4;
    for pass in 1..=2u64 {
        let step = rig.prepare(10 + pass, &p);
        let mask = PathMask::default();
        let mut router = MaskRouter::new(&mask, step.rows(), false).reference();
        let out = rig.model.pass(&step, &mut router, &mut rig.kv).unwrap();
        assert!(
            router
                .outcomes
                .iter()
                .all(|(_, o)| o.fallback_unavailable_rows == 0 && o.int8_rows == 0),
            "every group ran float: {:?}",
            router.outcomes
        );
        let got = &out.logits[0].1;
        let d = max_abs_diff(got, &want);
        assert!(
            d <= 1e-4,
            "pass {pass}: reference differs from the float model by {d}"
        );
        let s = rig.model.reference().unwrap().stats();
        // Only the first group fits: it is read once and then held; the others are read on
        // every pass.
        assert_eq!(s.held_bytes, one_group);
        assert_eq!(s.hits, pass - 1);
        assert_eq!(s.reads, groups as u64 * pass - (pass - 1));
    }
    assert!(
        max_abs_diff(&served, &want) > 1e-3,
        "INT8 must differ from float"
    );
}
