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

/// A plan's `tables` decides how the vocabulary tables are stored, and a reload that changes
/// it rebuilds them off the serving thread and swaps them between two steps: in 4 bits they
/// take under 0.6× Q8_0's bytes, generation keeps answering through both reloads with no
/// failed request, and the status names the form in force. A reload that drops `tables`
/// returns to the engine's setting.
#[actix_rt::test]
async fn a_reload_changes_the_tables_form_and_keeps_serving() {
    use quantmesh_engine::Engine;
    let dir = tempfile::tempdir().unwrap();
    init_model(dir.path(), &InitOptions::default()).unwrap();
    let plan = dir.path().join("plan.json");
    let with_tables = |t: Option<&str>| match t {
        Some(t) => format!(r#"{{"schema_version": 1, "tables": "{t}"}}"#),
        None => r#"{"schema_version": 1}"#.to_string(),
    };
    std::fs::write(&plan, with_tables(Some("q8_0"))).unwrap();
    let e = Engine::start(
        dir.path(),
        EngineConfig {
            embeddings: EmbeddingDtype::F16,
            sensitive_layers: Some(plan.display().to_string()),
            reload_interval: std::time::Duration::from_secs(3600),
            ..Default::default()
        },
        "t",
    )
    .await
    .unwrap();
    let tables = |e: &Engine| {
        let st = e.config_status();
        (st.tables.unwrap(), st.weights.unwrap().other)
    };
    let (form, q8_bytes) = tables(&e);
    assert_eq!(
        form,
        EmbeddingDtype::Q8_0,
        "the plan wins over engine.embeddings"
    );
    let generate = |e: Engine| async move {
        let ids = e.encode("Hello, world.".into(), true).await.unwrap();
        let params = quantmesh_types::SamplingParams {
            max_tokens: 24,
            stop_at_eos: false,
            ..Default::default()
        };
        let (_, _, usage, _) = e.generate(ids, params).await.unwrap().collect().await;
        usage.completion_tokens
    };
    let mut running = Vec::new();
    for t in [Some("q4_s8"), None] {
        for _ in 0..3 {
            running.push(actix_rt::spawn(generate(e.clone())));
        }
        std::fs::write(&plan, with_tables(t)).unwrap();
        let outcome = e.reload_config().await.unwrap();
        assert!(
            matches!(
                outcome,
                quantmesh_engine::reload::ReloadOutcome::Applied { .. }
            ),
            "{outcome:?}"
        );
        let (form, bytes) = tables(&e);
        match t {
            Some(_) => {
                assert_eq!(form, EmbeddingDtype::Q4S8);
                assert!(bytes * 10 < q8_bytes * 6, "{bytes} vs Q8_0's {q8_bytes}");
            }
            None => {
                assert_eq!(form, EmbeddingDtype::F16, "back to engine.embeddings");
                assert!(bytes > q8_bytes);
            }
        }
        assert_eq!(generate(e.clone()).await, 24);
    }
    for r in running {
        assert_eq!(r.await.unwrap(), 24, "a request across the reload");
    }
}

/// `engine.weight_budget` is a promise on every plan the engine takes: a reload whose
/// weights would take more is refused before anything is swapped in (rejected, counted, the
/// error naming the budget; the same version is not built again on the next poll), the plan
/// and weights in force stay, and a plan within the budget is applied after it.
#[actix_rt::test]
async fn a_plan_over_the_weight_budget_is_refused_and_the_old_one_kept() {
    use quantmesh_engine::reload::ReloadOutcome;
    use quantmesh_engine::Engine;
    let dir = tempfile::tempdir().unwrap();
    init_model(dir.path(), &InitOptions::default()).unwrap();
    let cfg = ModelConfig::load(dir.path()).unwrap();
    // Every group 4-bit, no float copies: the plan the budget is measured on.
    let plan_with = |raised: Option<&str>, k: u32| {
        let groups: Vec<String> = (0..cfg.num_hidden_layers)
            .flat_map(|l| GroupKind::ALL.map(move |kind| format!("layers.{l}.{}", kind.name())))
            .map(|g| {
                let class = if Some(g.as_str()) == raised {
                    "w8a8"
                } else {
                    "w4a16"
                };
                format!(r#""{g}": {{"class": "{class}", "residency": "int8"}}"#)
            })
            .collect();
        format!(
            r#"{{"schema_version": 1, "thresholds": {{"k": {k}}}, "groups": {{{}}}}}"#,
            groups.join(", ")
        )
    };
    let plan = dir.path().join("plan.json");
    std::fs::write(&plan, plan_with(None, 6)).unwrap();
    let start = |budget| {
        Engine::start(
            dir.path(),
            EngineConfig {
                default_residency: Residency::Int8,
                sensitive_layers: Some(plan.display().to_string()),
                reload_interval: std::time::Duration::from_secs(3600),
                weight_budget: budget,
                ..Default::default()
            },
            "t",
        )
    };
    let resident = |e: &Engine| e.config_status().weights.unwrap().total();
    // The budget: exactly what the all-4-bit plan takes.
    let measured = resident(&start(None).await.unwrap());
    let e = start(Some(quantmesh_types::WeightBudget::Bytes(measured as u64)))
        .await
        .unwrap();
    assert_eq!(resident(&e), measured);
    let md5 = e.config_status().md5;

    // One group raised to 8 bits with nothing lowered: over by that group's extra bytes.
    std::fs::write(&plan, plan_with(Some("layers.0.down"), 6)).unwrap();
    for _ in 0..2 {
        let outcome = e.reload_config().await.unwrap();
        let ReloadOutcome::Rejected { error, .. } = &outcome else {
            panic!("an over-budget plan was not rejected: {outcome:?}");
        };
        assert!(
            error.contains("weight_budget") && error.contains(&measured.to_string()),
            "{error}"
        );
    }
    let st = e.config_status();
    assert_eq!(st.rejected_total, 1, "rejected once, then recognised");
    assert_eq!(st.md5, md5, "the plan in force stays");
    assert_eq!(resident(&e), measured, "the weights in force stay");
    assert_eq!(
        st.quant_format.get("layers.0.down"),
        Some(&quantmesh_engine::backend::QuantFormat::Q4S8),
        "{:?}",
        st.quant_format
    );

    // Within the budget (the same bytes, another threshold): applied.
    std::fs::write(&plan, plan_with(None, 7)).unwrap();
    let outcome = e.reload_config().await.unwrap();
    assert!(
        matches!(outcome, ReloadOutcome::Applied { .. }),
        "{outcome:?}"
    );
    assert_eq!(e.config_status().k, 7.0);
    assert_eq!(resident(&e), measured);
}
