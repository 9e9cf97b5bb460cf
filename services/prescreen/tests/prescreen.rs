//! The pre-screen on real (bundled) checkpoints: classification of the planted groups,
//! determinism, sharded and corrupt checkpoints, and the engine serving the result.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use quantmesh_model::bundled::{init_model, InitOptions, Planted, StoreDtype};
use quantmesh_prescreen::{run, scan::Progress, Options, PrescreenError};
use quantmesh_types::{EmbeddingDtype, GroupId, PrecisionClass, Residency, SensitiveLayers};
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};

struct Count(AtomicUsize);
impl Progress for Count {
    fn tensor_done(&self, _: &str) {
        self.0.fetch_add(1, Ordering::Relaxed);
    }
}

fn opts(model: &Path) -> Options {
    Options {
        model: model.to_path_buf(),
        calibration: None,
        rules: Default::default(),
        max_prompts: 96,
        max_tokens_per_prompt: 48,
        kl_tokens: 2048,
        timestamp: "2026-11-22T00:00:00Z".into(),
        weight_budget: None,
        hook_thresholds: true,
    }
}

fn model(shards: usize) -> (tempfile::TempDir, Planted) {
    let dir = tempfile::tempdir().unwrap();
    let planted = init_model(
        dir.path(),
        &InitOptions {
            shards,
            ..Default::default()
        },
    )
    .unwrap();
    (dir, planted)
}

#[test]
fn planted_groups_are_classified_and_output_is_reproducible() {
    let (dir, planted) = model(3);
    let count = Count(AtomicUsize::new(0));
    let out = run(&opts(dir.path()), &count).unwrap();
    let layers = out.file.model.as_ref().unwrap().num_layers;
    assert_eq!(
        count.0.load(Ordering::Relaxed),
        layers * 7,
        "one tick per member tensor"
    );
    let groups = &out.file.groups;
    assert_eq!(groups.len(), layers * 4);
    for (name, entry) in groups {
        let class = entry.class;
        if planted.sensitive_groups.contains(name) {
            assert_eq!(class, PrecisionClass::Fp16, "{name}: {:?}", entry.rule);
        } else if planted.heavy_tailed_groups.contains(name) {
            assert_ne!(
                class,
                PrecisionClass::W8a8,
                "{name}: heavy tails are not aggressive"
            );
        } else {
            assert_ne!(
                class,
                PrecisionClass::Fp16,
                "{name} is ordinary: {:?}",
                entry.rule
            );
        }
        assert!(entry.rule.as_ref().is_some_and(|r| !r.is_empty()));
        let g: GroupId = name.parse().unwrap();
        // The every-token massive channel is found where the residual stream enters.
        if matches!(
            g.kind,
            quantmesh_types::GroupKind::Qkv | quantmesh_types::GroupKind::GateUp
        ) {
            for c in &planted.massive_channels {
                assert!(
                    entry.massive_channels.contains(c),
                    "{name}: {:?}",
                    entry.massive_channels
                );
            }
            // The BOS-only channel lives at position 0, which is not measured.
            assert!(!entry
                .massive_channels
                .contains(&planted.bos_massive_channel));
        }
    }
    // Same inputs and timestamp → the same bytes.
    let again = run(&opts(dir.path()), &Count(AtomicUsize::new(0))).unwrap();
    assert_eq!(out.bytes, again.bytes);
    // Sharding does not change the content fingerprint of the same tensors.
    let (single, _) = model(1);
    let one = run(&opts(single.path()), &Count(AtomicUsize::new(0))).unwrap();
    assert_eq!(
        one.file.model.as_ref().unwrap().content_md5,
        out.file.model.as_ref().unwrap().content_md5
    );
    assert_eq!(one.file.groups, out.file.groups);
    // The output is schema v1 and validates against the model.
    SensitiveLayers::parse(&out.bytes).unwrap();
    assert!(out.bytes_formats < out.bytes_all_fp16);
}

#[test]
fn corrupt_and_truncated_shards_name_file_and_tensor() {
    let dir = tempfile::tempdir().unwrap();
    init_model(
        dir.path(),
        &InitOptions {
            shards: 2,
            dtype: StoreDtype::F32,
            ..Default::default()
        },
    )
    .unwrap();
    let shard = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .max()
        .unwrap();
    let bytes = std::fs::read(&shard).unwrap();
    // NaNs in the last tensor of the shard.
    let mut bad = bytes.clone();
    let n = bad.len();
    bad[n - 8..].copy_from_slice(&[0xff; 8]);
    std::fs::write(&shard, &bad).unwrap();
    let err = run(&opts(dir.path()), &Count(AtomicUsize::new(0)))
        .err()
        .unwrap();
    let msg = err.to_string();
    let file = shard.file_name().unwrap().to_str().unwrap();
    assert!(matches!(err, PrescreenError::Model(_)));
    assert!(
        msg.contains(file) && msg.contains("NaN") && msg.contains("model."),
        "{msg}"
    );
    // Truncated.
    std::fs::write(&shard, &bytes[..bytes.len() - 1000]).unwrap();
    let msg = run(&opts(dir.path()), &Count(AtomicUsize::new(0)))
        .err()
        .unwrap()
        .to_string();
    assert!(
        msg.contains(file) && msg.contains("truncated") && msg.contains("model."),
        "{msg}"
    );
}

/// The engine on the model in `dir`, serving the plan `bytes` (written beside it).
async fn serve(dir: &Path, bytes: &[u8]) -> quantmesh_engine::Engine {
    let file = dir.join("sensitive_layers.json");
    std::fs::write(&file, bytes).unwrap();
    let cfg = quantmesh_engine::EngineConfig {
        sensitive_layers: Some(file.display().to_string()),
        num_pages: 128,
        ..Default::default()
    };
    quantmesh_engine::Engine::start(dir, cfg, "t")
        .await
        .unwrap()
}

#[actix_rt::test]
async fn the_engine_serves_with_the_resulting_plan() {
    let (dir, planted) = model(1);
    let out = run(&opts(dir.path()), &Count(AtomicUsize::new(0))).unwrap();
    let engine = serve(dir.path(), &out.bytes).await;
    let status = engine.config_status();
    assert_eq!(
        status.md5.as_deref(),
        Some(format!("{:x}", md5::compute(&out.bytes)).as_str())
    );
    for (name, entry) in &out.file.groups {
        let want = entry.class.default_residency();
        assert_eq!(status.residency[name], want, "{name}");
    }
    let sensitive = &planted.sensitive_groups[0];
    assert_eq!(status.residency[sensitive], Residency::Float);
    // The plan holds less than the float weights alone (f32: 2× the FP16 bytes), and serves.
    let all_float_f32 = (out.bytes_all_fp16 * 2.0) as usize;
    assert!(engine.stats().linear_weight_bytes < all_float_f32);
    let ids = engine.encode("Hello, world.".into(), true).await.unwrap();
    // A random model may sample its end-of-sequence token at any step (which one depends on
    // the CPU's kernels), so the length is checked with EOS off.
    let params = quantmesh_types::SamplingParams {
        max_tokens: 8,
        stop_at_eos: false,
        ..Default::default()
    };
    let (_, finish, usage, _) = engine.generate(ids, params).await.unwrap().collect().await;
    assert_eq!(finish, quantmesh_types::FinishReason::Length);
    assert_eq!(usage.completion_tokens, 8);
}

/// The engine serving `plan` holds at most `budget` bytes and answers.
async fn serves_within(dir: &Path, plan: &[u8], budget: u64) -> quantmesh_engine::Engine {
    let engine = serve(dir, plan).await;
    let resident = engine.stats().resident_weight_bytes as u64;
    assert!(
        resident <= budget,
        "served {resident} bytes > budget {budget}"
    );
    let ids = engine.encode("Hello, world.".into(), true).await.unwrap();
    let params = quantmesh_types::SamplingParams {
        max_tokens: 4,
        stop_at_eos: false,
        ..Default::default()
    };
    let (_, _, usage, _) = engine.generate(ids, params).await.unwrap().collect().await;
    assert_eq!(usage.completion_tokens, 4);
    engine
}

/// A weight budget between every-group-in-4-bits and every-group-in-8 mixes both, and the
/// engine serving the plan holds no more than the budget; one below the smallest plan is
/// refused, naming the setting and the smallest size.
#[actix_rt::test]
async fn a_weight_budget_plan_mixes_bits_and_fits_when_served() {
    let (dir, planted) = model(1);
    let with = |b: &str| Options {
        weight_budget: Some(b.parse().unwrap()),
        ..opts(dir.path())
    };
    let count = Count(AtomicUsize::new(0));
    let roomy_out = run(&with("2x"), &count).unwrap();
    let roomy = roomy_out.bits.unwrap();
    assert_eq!(roomy.four, 0, "{roomy:?}");
    // Room for everything: the tables stay 8-bit and the plan leaves them to the engine.
    assert_eq!(roomy.tables, Some(EmbeddingDtype::Q8_0));
    assert_eq!(roomy_out.file.tables, None);
    let (min, max) = (roomy.minimum_bytes, roomy.planned_bytes);
    assert!(min < max, "{roomy:?}");
    let budget = (min + max) / 2;
    let out = run(&with(&budget.to_string()), &count).unwrap();
    let bits = out.bits.clone().unwrap();
    assert!(bits.four > 0 && bits.eight > 0, "{bits:?}");
    assert!(bits.planned_bytes <= budget, "{bits:?}");
    assert!(
        bits.predicted_loss >= roomy.predicted_loss,
        "{bits:?} vs {roomy:?}"
    );
    let four = out
        .file
        .groups
        .values()
        .filter(|e| e.class == PrecisionClass::W4a16)
        .count();
    assert_eq!(four, bits.four);
    assert!(out.file.float_budget.is_some());
    // A group in 4 bits is served with its calibrated 4-bit harm bound, every other group
    // with the engine's; each group's 4-bit bound is measured either way.
    for (name, e) in &out.file.groups {
        let bound = e.metrics.as_ref().and_then(|m| m.max_nsr_w4a16);
        assert!(bound.is_some_and(|b| b > 0.0), "{name}: {bound:?}");
        let served = e.monitor.as_ref().and_then(|m| m.max_nsr);
        let want = (e.class == PrecisionClass::W4a16)
            .then_some(bound)
            .flatten();
        assert_eq!(served, want, "{name}");
    }
    // The cost is the error where it lands: the planted sensitive `down` amplifies its
    // `gate_up`'s error, which its own output KL cannot show (it is among the lowest), so
    // that `gate_up` costs the most in 4 bits and is the raise the knapsack makes first.
    let residual = |name: &str| {
        let m = out.file.groups[name].metrics.as_ref().unwrap();
        m.residual
            .as_ref()
            .expect("every scored group has one")
            .w4a16
    };
    assert!(!planted.sensitive_groups.is_empty());
    for down in &planted.sensitive_groups {
        let feeder = down.replace(".down", ".gate_up");
        for (name, e) in &out.file.groups {
            if name != &feeder && e.class != PrecisionClass::Fp16 {
                assert!(
                    residual(&feeder) > 10.0 * residual(name),
                    "{feeder} {} vs {name} {}",
                    residual(&feeder),
                    residual(name)
                );
            }
        }
        assert_ne!(out.file.groups[&feeder].class, PrecisionClass::W4a16);
    }

    serves_within(dir.path(), &out.bytes, budget).await;

    // The smallest plan: every group and the vocabulary tables in 4 bits, served as such.
    let smallest = run(&with(&min.to_string()), &count).unwrap();
    let bits = smallest.bits.clone().unwrap();
    assert_eq!((bits.eight, bits.tables), (0, Some(EmbeddingDtype::Q4S8)));
    assert_eq!(smallest.file.tables, Some(EmbeddingDtype::Q4S8));
    let engine = serves_within(dir.path(), &smallest.bytes, min).await;
    assert_eq!(engine.config_status().tables, Some(EmbeddingDtype::Q4S8));

    match run(&with(&(min - 1).to_string()), &count) {
        Err(PrescreenError::Budget(m)) => {
            assert!(
                m.contains("weight_budget") && m.contains(&min.to_string()),
                "{m}"
            )
        }
        other => panic!("{:?}", other.map(|o| o.bits)),
    }
}

/// The vocabulary tables' costs, measured as the engine stores them: both forms cost
/// something, 4 bits far more than Q8_0 (16 levels against 255), on the lookup and the
/// projection alike; the bytes are the served forms' (one table when tied).
#[test]
fn the_tables_cost_more_in_four_bits_than_in_eight() {
    use candle_core::{Device, Tensor};
    use quantmesh_model::{Checkpoint, ModelConfig};
    use quantmesh_prescreen::{scan::Batch, tables};
    for seed in [1u64, 7] {
        let dir = tempfile::tempdir().unwrap();
        init_model(
            dir.path(),
            &InitOptions {
                seed,
                ..Default::default()
            },
        )
        .unwrap();
        let cfg = ModelConfig::load(dir.path()).unwrap();
        let ck = Checkpoint::open(dir.path()).unwrap();
        let prompts: Vec<Vec<u32>> = (0..4)
            .map(|p| {
                (0..40)
                    .map(|i| ((p * 41 + i * 7) % cfg.vocab_size) as u32)
                    .collect()
            })
            .collect();
        let batch = Batch::new(&prompts, 64).unwrap();
        let h = Tensor::randn(0f32, 1.0, (160, cfg.hidden_size), &Device::Cpu).unwrap();
        let t = tables::costs(&ck, &cfg, &batch, &h).unwrap().unwrap();
        assert!(
            t.loss8 > 0.0 && t.loss4 > 20.0 * t.loss8,
            "seed {seed}: {t:?}"
        );
        let n = if cfg.tie_word_embeddings { 1 } else { 2 };
        let values = (n * cfg.vocab_size * cfg.hidden_size) as u64;
        assert_eq!(t.bytes8, values / 32 * 34);
        assert!(t.bytes4 * 10 < t.bytes8 * 6, "{t:?}");
    }
}

/// Scale migration on the bundled checkpoint: the groups whose input carries the planted
/// every-token massive channel (qkv and gate_up, where the residual stream enters) are
/// smoothed, that channel gets the largest factor, every kept choice lowered the served W8A8
/// error by the rules' gain, and `smoothing_alpha = 0`, or fewer calibration tokens than
/// `smoothing_min_tokens`, writes no factors (the unsmoothed served error is measured still).
#[test]
fn groups_fed_by_a_massive_channel_are_smoothed_and_alpha_zero_or_too_few_tokens_smooth_none() {
    let (dir, planted) = model(1);
    let out = run(&opts(dir.path()), &Count(AtomicUsize::new(0))).unwrap();
    let rules = quantmesh_prescreen::rules::Rules::default();
    let massive = planted.massive_channels[0];
    for (name, entry) in &out.file.groups {
        let a = entry
            .metrics
            .as_ref()
            .and_then(|m| m.act8_nsr.as_ref())
            .unwrap_or_else(|| panic!("{name}: no served W8A8 error"));
        assert!(a.plain > 0.0 && a.smoothed > 0.0, "{name}: {a:?}");
        let g: GroupId = name.parse().unwrap();
        let width = if matches!(
            g.kind,
            quantmesh_types::GroupKind::Qkv | quantmesh_types::GroupKind::GateUp
        ) {
            let s = entry
                .smoothing
                .as_ref()
                .unwrap_or_else(|| panic!("{name} reads the massive channel: {a:?}"));
            let e = s.exponents(s.log2_factors.split(' ').count()).unwrap();
            let top = *e.iter().max().unwrap();
            assert_eq!(e[massive], top, "{name}: {e:?}");
            e.len()
        } else {
            0
        };
        if let Some(s) = &entry.smoothing {
            assert!(
                a.smoothed <= rules.smoothing_gain * a.plain,
                "{name}: kept without gain {a:?}"
            );
            assert_eq!(s.alpha, rules.smoothing_alpha);
            assert!(width == 0 || s.exponents(width).is_ok());
        } else {
            assert!(a.smoothed > rules.smoothing_gain * a.plain, "{name}: {a:?}");
        }
    }
    let mut off = opts(dir.path());
    off.rules.smoothing_alpha = 0.0;
    let plain = run(&off, &Count(AtomicUsize::new(0))).unwrap();
    // No factors, but the served W8A8 error is measured all the same (the budget's rank
    // under 8-bit activations): the same unsmoothed figure as with factors on.
    for (name, e) in &plain.file.groups {
        let a = e
            .metrics
            .as_ref()
            .and_then(|m| m.act8_nsr.as_ref())
            .unwrap();
        assert!(e.smoothing.is_none(), "{name}");
        assert_eq!(a.smoothed, a.plain, "{name}");
        let with = out.file.groups[name].metrics.as_ref().unwrap();
        assert_eq!(
            Some(a.plain),
            with.act8_nsr.as_ref().map(|w| w.plain),
            "{name}"
        );
    }
    // Smoothing changes no class: the classes come from the weights' own metrics.
    for (name, e) in &plain.file.groups {
        assert_eq!(e.class, out.file.groups[name].class, "{name}");
    }
    assert!(quantmesh_prescreen::smoothing_line(&out.file).contains("groups smoothed"));
    assert_eq!(
        quantmesh_prescreen::smoothing_line(&plain.file),
        "scale migration: off\n"
    );
    // From fewer calibration tokens than the rule asks for: no factors, and the line says why.
    let tokens = out
        .file
        .generator
        .as_ref()
        .unwrap()
        .calibration
        .as_ref()
        .unwrap()
        .tokens;
    let mut few = opts(dir.path());
    few.rules.smoothing_min_tokens = tokens + 1;
    let few = run(&few, &Count(AtomicUsize::new(0))).unwrap();
    assert!(few.file.groups.values().all(|e| e.smoothing.is_none()
        && e.metrics
            .as_ref()
            .and_then(|m| m.act8_nsr.as_ref())
            .is_some_and(|a| a.smoothed == a.plain)));
    let line = quantmesh_prescreen::smoothing_line(&few.file);
    assert!(
        line.contains(&format!(
            "{tokens} calibration tokens, fewer than the {}",
            tokens + 1
        )),
        "{line}"
    );
    // Exactly enough tokens: the factors are computed.
    let mut enough = opts(dir.path());
    enough.rules.smoothing_min_tokens = tokens;
    let enough = run(&enough, &Count(AtomicUsize::new(0))).unwrap();
    assert_eq!(enough.file.groups, out.file.groups);
    // Per-group strengths: each group keeps whichever of 0.75 (the rules' own), 0.5 and 0.9
    // serves it best, so no group's best candidate is worse than with 0.75 alone, and a
    // group keeps factors whenever it did with one strength.
    let mut per_group = opts(dir.path());
    per_group.rules.smoothing_alphas = vec![0.5, 0.9];
    let per_group = run(&per_group, &Count(AtomicUsize::new(0))).unwrap();
    for (name, e) in &per_group.file.groups {
        let one = &out.file.groups[name];
        let (a, a1) = (
            e.metrics
                .as_ref()
                .and_then(|m| m.act8_nsr.as_ref())
                .unwrap(),
            one.metrics
                .as_ref()
                .and_then(|m| m.act8_nsr.as_ref())
                .unwrap(),
        );
        assert_eq!(a.plain, a1.plain, "{name}");
        assert!(a.smoothed <= a1.smoothed, "{name}: {a:?} vs {a1:?}");
        if one.smoothing.is_some() {
            let s = e.smoothing.as_ref().unwrap_or_else(|| panic!("{name}"));
            assert!([0.75, 0.5, 0.9].contains(&s.alpha), "{name}: {}", s.alpha);
        }
    }
    let line = quantmesh_prescreen::smoothing_line(&per_group.file);
    assert!(line.contains("strengths kept: "), "{line}");
}

/// The first-load plan knows the activation width it is served with: on a checkpoint where
/// one group's input spikes on common tokens while its weights read the spike channels with
/// zero weights (`layers.2.down`: INT8 weights represent it well, 8-bit activations do not),
/// and another group has heavy-tailed weights (`layers.1.o`: the larger weight error), the
/// pre-screen's served W8A8 harm picks the spiking group, without scale migration (as the
/// first-load plan runs), and the engine spends a one-copy float budget on it exactly when
/// it serves 8-bit activations (`copyless`, `off`); with 16-bit activations (`all`) the
/// weights' KL ranks first and the copy goes elsewhere.
#[actix_rt::test]
async fn the_w8a8_harm_measure_picks_the_group_whose_activations_hurt() {
    use quantmesh_engine::backend::SplitActivations;
    use quantmesh_model::recipe::{self, Recipe};
    let dir = tempfile::tempdir().unwrap();
    let r = Recipe {
        massive: Vec::new(),
        bos_massive: None,
        sensitive: Vec::new(),
        heavy_gate_up: Vec::new(),
        heavy_o: vec![1],
        spiking: vec![2],
        ..Recipe::bundled(&InitOptions::default())
    };
    recipe::write(dir.path(), &r, &recipe::card(&r)).unwrap();
    let mut o = opts(dir.path());
    o.rules.smoothing_alpha = 0.0;
    let out = run(&o, &Count(AtomicUsize::new(0))).unwrap();
    let groups = &out.file.groups;
    let harm = |name: &str| groups[name].served_act8_nsr().unwrap();
    let kl = |name: &str| groups[name].metrics.as_ref().unwrap().kl.w8a8_per_channel;
    let spiking = "layers.2.down";
    let (top_kl, _) = groups
        .keys()
        .map(|n| (n.as_str(), kl(n)))
        .max_by(|a, b| a.1.total_cmp(&b.1))
        .unwrap();
    assert_ne!(
        top_kl, spiking,
        "the spiking group's weights must not rank first by KL"
    );
    let next = groups
        .keys()
        .filter(|n| *n != spiking)
        .map(|n| harm(n))
        .fold(0.0, f64::max);
    assert!(
        harm(spiking) > 3.0 * next,
        "{spiking}: served W8A8 harm {} against at most {next} elsewhere",
        harm(spiking)
    );
    // Every group wants a copy; the budget has room for the spiking group's alone.
    let mut plan = out.file.clone();
    for e in plan.groups.values_mut() {
        e.residency = Some(Residency::Dual);
    }
    let bytes = serde_json::to_vec(&plan).unwrap();
    std::fs::write(dir.path().join("sensitive_layers.json"), &bytes).unwrap();
    let down_copy = r.hidden * r.intermediate * 2; // f16
    for mode in [
        SplitActivations::Copyless,
        SplitActivations::Off,
        SplitActivations::All,
    ] {
        let cfg = quantmesh_engine::EngineConfig {
            sensitive_layers: Some(
                dir.path()
                    .join("sensitive_layers.json")
                    .display()
                    .to_string(),
            ),
            num_pages: 64,
            float_budget: quantmesh_engine::budget::FloatBudget::Bytes(down_copy as u64),
            embeddings: quantmesh_engine::backend::EmbeddingDtype::Q8_0,
            split_activations: mode,
            ..Default::default()
        };
        let engine = quantmesh_engine::Engine::start(dir.path(), cfg, "t")
            .await
            .unwrap();
        let residency = engine.config_status().residency;
        let kept: Vec<&String> = residency
            .iter()
            .filter(|(_, r)| r.has_float())
            .map(|(n, _)| n)
            .collect();
        if mode == SplitActivations::All {
            assert_eq!(residency[spiking], Residency::Int8, "{mode:?}: {kept:?}");
            assert_eq!(residency[top_kl], Residency::Dual, "{mode:?}: {kept:?}");
        } else {
            assert_eq!(kept, vec![spiking], "{mode:?}");
        }
        drop(engine);
    }
}
