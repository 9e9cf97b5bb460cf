//! The float budget and 16-bit float copies, through the CPU backend and the step policy.

#![allow(clippy::unwrap_used)]

mod support;

use quantmesh_engine::backend::cpu::LlamaModel;
use quantmesh_engine::backend::{Backend, EmbeddingDtype, FloatDtype, Forms};
use quantmesh_engine::kv::KvFloatDtype;
use quantmesh_engine::plan::{group_params, resolve};
use quantmesh_engine::precision::PathMask;
use quantmesh_engine::EngineConfig;
use quantmesh_model::bundled::{init_model, InitOptions};
use quantmesh_model::ops::kl_logits;
use quantmesh_model::{Checkpoint, ModelConfig};
use quantmesh_types::{GroupKind, Residency};
use support::Rig;

/// The next-token logits after `text` (bytes as token ids), every group on its float path
/// where it has one, f32 KV.
fn last_logits(model: LlamaModel, cfg: &ModelConfig, text: &str) -> Vec<f32> {
    let tokens: Vec<u32> = text.bytes().map(u32::from).collect();
    let mask = PathMask::all_groups_float(cfg.num_hidden_layers);
    Rig::with_model(model, cfg, KvFloatDtype::F32).feed(1, &tokens, &mask, false)
}

/// Groups over budget are INT8-only; when the float path is wanted there (every group in
/// float), their rows are counted as "wanted fallback, unavailable" and the kept groups run
/// in float.
#[test]
fn over_budget_groups_are_int8_only_and_count_wanted_fallback() {
    let dir = tempfile::tempdir().unwrap();
    init_model(dir.path(), &InitOptions::default()).unwrap();
    let cfg = ModelConfig::load(dir.path()).unwrap();
    let o_bytes = group_params(&cfg, GroupKind::O) * 2;
    let base = EngineConfig {
        default_residency: Residency::Dual,
        // Room for three `o`-sized f16 copies.
        float_budget: quantmesh_engine::budget::FloatBudget::Bytes(3 * o_bytes as u64),
        ..Default::default()
    };
    let live = resolve(&base, &cfg, None);
    assert!(!live.budget.demoted.is_empty());
    assert!(live.budget.float_bytes <= 3 * o_bytes);
    let ck = Checkpoint::open(dir.path()).unwrap();
    let model =
        LlamaModel::load_from(&ck, &cfg, &|g| live.residency[&g], live.forms(&base)).unwrap();
    let w = model.weight_bytes();
    assert_eq!(
        w.float, live.budget.float_bytes,
        "resident float copies = the plan's"
    );
    for g in &live.budget.demoted {
        assert_eq!(model.residency(*g), Residency::Int8);
    }
    let mut rig = Rig::with_model(model, &cfg, KvFloatDtype::F16);
    let all_float = PathMask::all_groups_float(cfg.num_hidden_layers);
    let out = rig.step(1, &[72, 101, 108, 108, 111], &all_float, true);
    let mut kept_float = 0;
    for (g, o) in &out.outcomes {
        if live.budget.demoted.contains(g) {
            assert_eq!(o.fallback_unavailable_rows, 5, "{g}");
            assert_eq!(o.float_rows, 0, "{g}");
        } else {
            assert_eq!(o.fallback_unavailable_rows, 0, "{g}");
            kept_float += o.float_rows;
        }
    }
    assert!(kept_float > 0);
}

/// f16 float copies take half the bytes of f32 ones and give nearly the same next-token
/// distribution (KL far below what INT8 costs).
#[test]
fn f16_float_copies_halve_memory_and_keep_quality() {
    let dir = tempfile::tempdir().unwrap();
    init_model(dir.path(), &InitOptions::default()).unwrap();
    let cfg = ModelConfig::load(dir.path()).unwrap();
    let ck = Checkpoint::open(dir.path()).unwrap();
    let load = |r, float| {
        let forms = Forms {
            float,
            embeddings: EmbeddingDtype::F32,
            ..Forms::EXACT
        };
        LlamaModel::load_from(&ck, &cfg, &|_| r, forms).unwrap()
    };
    let f32m = load(Residency::Float, FloatDtype::F32);
    let f16m = load(Residency::Float, FloatDtype::F16);
    assert_eq!(f16m.weight_bytes().float * 2, f32m.weight_bytes().float);
    let int8 = load(Residency::Int8, FloatDtype::F32);
    let logits = |m| last_logits(m, &cfg, "The quick brown fox jumps over the lazy dog.");
    let (a, b, c) = (logits(f32m), logits(f16m), logits(int8));
    let kl16 = kl_logits(&a, &b);
    let kl8 = kl_logits(&a, &c);
    assert!(kl16 < kl8 / 10.0, "f16 {kl16} vs int8 {kl8}");
}

/// 8-bit vocabulary tables (embedding lookups decoded from the same Q8_0 blocks `lm_head`
/// multiplies with) cost little next-token KL compared with INT8 linear groups, and take
/// about half of f16's bytes.
#[test]
fn q8_0_vocabulary_tables_are_small_and_close() {
    let dir = tempfile::tempdir().unwrap();
    init_model(dir.path(), &InitOptions::default()).unwrap();
    let cfg = ModelConfig::load(dir.path()).unwrap();
    let ck = Checkpoint::open(dir.path()).unwrap();
    let load = |embeddings, r| {
        let forms = Forms {
            float: FloatDtype::F32,
            embeddings,
            ..Forms::EXACT
        };
        LlamaModel::load_from(&ck, &cfg, &|_| r, forms).unwrap()
    };
    let exact = load(EmbeddingDtype::F32, Residency::Float);
    let q8 = load(EmbeddingDtype::Q8_0, Residency::Float);
    let int8 = load(EmbeddingDtype::F32, Residency::Int8);
    let f16 = load(EmbeddingDtype::F16, Residency::Float);
    assert!(q8.weight_bytes().other * 10 < f16.weight_bytes().other * 6);
    let logits = |m| last_logits(m, &cfg, "Pack my box with five dozen liquor jugs.");
    let (a, b, c) = (logits(exact), logits(q8), logits(int8));
    assert!(
        kl_logits(&a, &b) < kl_logits(&a, &c),
        "{} vs {}",
        kl_logits(&a, &b),
        kl_logits(&a, &c)
    );
}
