//! The activation monitor on the bundled model, through the engine's actors.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use quantmesh_engine::backend::SplitActivations;
use quantmesh_engine::monitor::{GroupMode, MonitorConfig, MonitorReport, ShadowReference};
use quantmesh_engine::{Engine, EngineConfig};
use quantmesh_model::bundled::{init_model, InitOptions, Planted};
use quantmesh_types::{
    FallbackEvent, FallbackReason, Granularity, KlReference, Residency, SamplingParams,
};

fn monitor_cfg() -> MonitorConfig {
    MonitorConfig {
        window_requests: 8,
        warmup_tokens: 256,
        min_window_tokens: 32,
        shadow_sample_rate: 0.0,
        ..Default::default()
    }
}

async fn run(cfg: MonitorConfig, rounds: usize, prefix_caching: bool) -> (MonitorReport, Planted) {
    let dir = tempfile::tempdir().unwrap();
    let planted = init_model(dir.path(), &InitOptions::default()).unwrap();
    let e = Engine::start(
        dir.path(),
        EngineConfig {
            monitor: cfg,
            prefix_caching,
            // The planted truth is activation harm (spikes against INT8-hostile weights),
            // which exists where activations are quantized to 8 bits; with split activations
            // (the default) spikes do not count and the planted group is not harmed.
            split_activations: SplitActivations::Off,
            ..Default::default()
        },
        "t",
    )
    .await
    .unwrap();
    (drive(&e, 0, rounds).await, planted)
}

/// `rounds` rounds of the sample prompts (one monitor window each with `window_requests`
/// 8), then wait until the monitor has seen every request (`seen` requests before).
async fn drive(e: &Engine, seen: usize, rounds: usize) -> MonitorReport {
    for r in 0..rounds {
        let gens = quantmesh_model::bundled::SAMPLE_PROMPTS
            .iter()
            .enumerate()
            .map(|(i, p)| {
                let e = e.clone();
                async move {
                    let ids = e.encode(p.to_string(), true).await.unwrap();
                    let params = SamplingParams {
                        temperature: 0.8,
                        seed: Some((r * 100 + i) as u64),
                        max_tokens: 24,
                        ..Default::default()
                    };
                    e.generate(ids, params).await.unwrap().collect().await
                }
            });
        futures::future::join_all(gens).await;
    }
    // the monitor handles observations asynchronously: wait until it saw every request
    let want = seen + rounds * quantmesh_model::bundled::SAMPLE_PROMPTS.len();
    for _ in 0..100 {
        let rep = e.monitor_report().unwrap();
        if rep.windows_completed as usize * 8 + rep.requests_in_window >= want {
            return rep;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    panic!(
        "monitor did not catch up: {:?} {:?}",
        e.monitor_report()
            .map(|r| (r.windows_completed, r.requests_in_window, r.groups_in_float)),
        e.stats()
    );
}

fn mode(r: &MonitorReport, g: &str) -> GroupMode {
    r.groups.iter().find(|x| x.group == g).unwrap().mode
}

#[actix_rt::test]
async fn sensitive_group_found_and_massive_channels_ignored() {
    let (rep, planted) = run(monitor_cfg(), 4, true).await;
    for g in &rep.groups {
        eprintln!(
            "{} {:?} ready={} mean={:.3} sigma={:.3} rate={:?} excluded={:?}",
            g.group, g.mode, g.ready, g.mean, g.sigma, g.last_window_rate, g.excluded_channels
        );
    }
    assert_eq!(mode(&rep, "layers.1.down"), GroupMode::Fallback);
    let massive = planted.massive_channels[0];
    for g in rep
        .groups
        .iter()
        .filter(|g| g.group.ends_with(".qkv") || g.group.ends_with(".gate_up"))
    {
        assert!(
            g.excluded_channels.contains(&massive),
            "{}: massive channel not learned",
            g.group
        );
        // (a gate_up may be `coupled`: in float because its layer's down fell back)
        assert!(
            matches!(g.mode, GroupMode::Int8 | GroupMode::Coupled),
            "{}: massive channels alone must not trigger fallback ({:?})",
            g.group,
            g.mode
        );
    }
}

#[actix_rt::test]
async fn without_exclusion_the_statistic_measures_the_massive_channel() {
    // Control: no channel learning, no skipped positions. After RMSNorm the massive
    // channel pins every row's abs-max near sqrt(hidden): the naive statistic measures the
    // massive channel, not the data, and is blind to everything under it.
    let naive = MonitorConfig {
        massive_channel_share: 2.0,
        skip_positions: vec![],
        ..monitor_cfg()
    };
    let (naive, _) = run(naive, 2, false).await;
    let (smart, _) = run(monitor_cfg(), 2, false).await;
    for g in ["layers.0.qkv", "layers.2.gate_up"] {
        let n = naive.groups.iter().find(|x| x.group == g).unwrap();
        let s = smart.groups.iter().find(|x| x.group == g).unwrap();
        assert!(n.excluded_channels.is_empty());
        assert!(
            n.mean > 2.0 * s.mean,
            "{g}: naive mean {} vs with exclusion {}",
            n.mean,
            s.mean
        );
    }
}

/// Shadow KL through the engine: every step also runs the float reference
/// (`shadow_sample_rate = 1`). Layer fallback is off (trigger rate 1) so the served path stays
/// INT8 and only the shadow KL can react.
async fn shadow_run(
    residency: Residency,
    kv_int8: bool,
    shadow_reference: ShadowReference,
) -> (Vec<FallbackEvent>, Vec<(String, f64, u64)>) {
    let dir = tempfile::tempdir().unwrap();
    init_model(dir.path(), &InitOptions::default()).unwrap();
    let e = Engine::start(
        dir.path(),
        EngineConfig {
            default_residency: residency,
            kv_int8,
            // The plain W8A8 path and Q8_0 tables: the INT8 error these tests look for at
            // its full size (split activations would leave the weights' error alone, a
            // rotation would spread the planted outlier).
            split_activations: quantmesh_engine::api::SplitActivations::Off,
            rotation_block: 0,
            embeddings: quantmesh_engine::api::EmbeddingDtype::Q8_0,
            monitor: MonitorConfig {
                trigger_rate: 1.0,
                token_k: 1e9,
                shadow_sample_rate: 1.0,
                request_kl_limit: 2e-5,
                shadow_reference,
                ..monitor_cfg()
            },
            ..Default::default()
        },
        "t",
    )
    .await
    .unwrap();
    let mut rx = e.subscribe_fallback_events();
    for (i, p) in quantmesh_model::bundled::SAMPLE_PROMPTS.iter().enumerate() {
        let ids = e.encode(p.to_string(), true).await.unwrap();
        let params = SamplingParams {
            temperature: 0.0,
            seed: Some(i as u64),
            max_tokens: 8,
            ..Default::default()
        };
        e.generate(ids, params).await.unwrap().collect().await;
    }
    // wait until the monitor has seen every request (and fail if it never does: the
    // histogram below would be checked against a partial window)
    let mut seen_all = false;
    for _ in 0..500 {
        let rep = e.monitor_report().unwrap();
        if rep.windows_completed as usize * 8 + rep.requests_in_window >= 8 {
            seen_all = true;
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    assert!(
        seen_all,
        "the monitor did not see all 8 requests: {:?}",
        e.monitor_report()
            .map(|r| (r.windows_completed, r.requests_in_window))
    );
    let mut events = Vec::new();
    while let Ok(ev) = rx.try_recv() {
        events.push(ev);
    }
    // (reference, sum, count) of the shadow-KL histogram
    let hist = e
        .registry()
        .gather()
        .into_iter()
        .filter(|f| f.name() == "quantmesh_shadow_kl")
        .flat_map(|f| f.get_metric().to_vec())
        .map(|m| {
            let reference = m
                .get_label()
                .iter()
                .find(|l| l.name() == "reference")
                .map(|l| l.value().to_string())
                .unwrap_or_default();
            let h = m.get_histogram();
            (reference, h.get_sample_sum(), h.get_sample_count())
        })
        .collect();
    (events, hist)
}

#[actix_rt::test]
async fn shadow_kl_sees_a_damaged_int8_group_and_is_zero_for_a_float_plan() {
    // Dual: served INT8 (with the planted INT8-hostile `layers.1.down`), reference float.
    let (events, hist) = shadow_run(Residency::Dual, true, ShadowReference::Checkpoint).await;
    let (reference, sum, count) = hist[0].clone();
    assert_eq!(hist.len(), 1, "{hist:?}");
    assert_eq!(reference, "float_weights");
    assert!(count > 0);
    let dual_mean = sum / count as f64;
    let requests: Vec<_> = events
        .iter()
        .filter(|e| e.granularity == Granularity::Request && e.reason == FallbackReason::ShadowKl)
        .collect();
    assert!(!requests.is_empty(), "no per-request fallback: {events:?}");
    for ev in &requests {
        assert!(ev.kl.unwrap() > 2e-5);
        assert_eq!(ev.kl_reference, Some(KlReference::FloatWeights));
    }
    // Float plan (float weights, float KV): served = reference, KL ≈ 0, no per-request
    // fallback.
    let (events, hist) = shadow_run(Residency::Float, false, ShadowReference::Checkpoint).await;
    let (reference, sum, count) = hist[0].clone();
    assert_eq!(reference, "float_weights");
    let float_mean = sum / count as f64;
    assert!(float_mean < 1e-6, "float plan shadow KL {float_mean}");
    assert!(!events.iter().any(|e| e.granularity == Granularity::Request));
    assert!(
        dual_mean > 1e3 * float_mean.max(1e-9),
        "{dual_mean} vs {float_mean}"
    );
    // INT8-only: the reference reads every group's weights from the checkpoint, so it is
    // the dual plan's exact reference — the same label, per-request fallbacks asked for, and
    // at least the dual plan's KL (dual requests that fell back were then served in float;
    // INT8-only ones cannot be).
    let (events, hist) = shadow_run(Residency::Int8, true, ShadowReference::Checkpoint).await;
    assert_eq!(hist.len(), 1, "{hist:?}");
    let (reference, sum, count) = hist[0].clone();
    assert_eq!(reference, "float_weights");
    let int8_mean = sum / count as f64;
    assert!(
        int8_mean >= 0.99 * dual_mean,
        "INT8-only {int8_mean} vs dual {dual_mean}"
    );
    assert!(events
        .iter()
        .any(|e| e.granularity == Granularity::Request && e.reason == FallbackReason::ShadowKl));
    // Without the checkpoint reference the INT8-only groups run INT8 in the reference too:
    // the KL misses them, and the label says so.
    let (_, hist) = shadow_run(Residency::Int8, true, ShadowReference::Resident).await;
    assert_eq!(hist[0].0, "partial_float_weights");
    let partial_mean = hist[0].1 / hist[0].2 as f64;
    assert!(
        partial_mean < 0.5 * int8_mean,
        "partial {partial_mean} vs exact {int8_mean}"
    );
}

/// One window event per closed window, carrying every group's counts.
#[actix_rt::test]
async fn every_closed_window_is_published_as_a_window_event() {
    let dir = tempfile::tempdir().unwrap();
    init_model(dir.path(), &InitOptions::default()).unwrap();
    let e = Engine::start(
        dir.path(),
        EngineConfig {
            monitor: MonitorConfig {
                shadow_sample_rate: 0.5,
                ..monitor_cfg()
            },
            ..Default::default()
        },
        "t",
    )
    .await
    .unwrap();
    let mut rx = e.subscribe_window_events();
    for r in 0..3u64 {
        for (i, p) in quantmesh_model::bundled::SAMPLE_PROMPTS.iter().enumerate() {
            let ids = e.encode(p.to_string(), true).await.unwrap();
            let params = SamplingParams {
                temperature: 0.8,
                seed: Some(r * 100 + i as u64),
                max_tokens: 12,
                ..Default::default()
            };
            e.generate(ids, params).await.unwrap().collect().await;
        }
    }
    let mut got = Vec::new();
    while got.len() < 3 {
        let w = tokio::time::timeout(std::time::Duration::from_secs(10), rx.recv())
            .await
            .expect("a window event per window")
            .unwrap();
        got.push(w);
    }
    let windows: Vec<u64> = got.iter().map(|w| w.window).collect();
    assert_eq!(windows, vec![1, 2, 3]);
    let ids: std::collections::HashSet<_> = got.iter().map(|w| w.event_id.clone()).collect();
    assert_eq!(ids.len(), 3);
    for w in &got {
        assert_eq!(w.groups.len(), e.monitor_report().unwrap().groups.len());
        assert!(w.groups.iter().all(|g| g.tokens > 0), "{w:?}");
        assert!(w.shadow_kl.len() as u64 <= w.shadow_kl_seen);
    }
    assert!(got.iter().any(|w| w.shadow_kl_seen > 0));
}

/// The harm test through the engine: the bundled model with one group served in 4 bits
/// (`w4a16`, dual) beside Q8_0 groups, with split activations and the spike test out of the
/// way (`min_excess` beyond any row), so only the harm test counts. The 4-bit group's rows carry far more output noise than any 8-bit
/// group's, a bound between the two puts exactly that group in float, and a reload back to
/// 8 bits hands the monitor the new form's column errors: its harm drops and it recovers.
#[actix_rt::test]
async fn the_harm_test_finds_a_four_bit_group_and_follows_a_reload() {
    let dir = tempfile::tempdir().unwrap();
    init_model(dir.path(), &InitOptions::default()).unwrap();
    let plan = dir.path().join("plan.json");
    let with_class = |class: &str| {
        format!(
            r#"{{"schema_version": 1, "groups": {{"layers.2.o": {{"class": "{class}", "residency": "dual"}}}}}}"#
        )
    };
    std::fs::write(&plan, with_class("w4a16")).unwrap();
    let e = Engine::start(
        dir.path(),
        EngineConfig {
            split_activations: quantmesh_engine::api::SplitActivations::All,
            monitor: MonitorConfig {
                max_nsr: 1e-3,
                min_excess: 1e9,
                ..monitor_cfg()
            },
            sensitive_layers: Some(plan.display().to_string()),
            reload_interval: std::time::Duration::from_secs(3600),
            ..Default::default()
        },
        "t",
    )
    .await
    .unwrap();
    let rep = drive(&e, 0, 4).await;
    let nsr = |r: &MonitorReport, g: &str| {
        r.groups
            .iter()
            .find(|x| x.group == g)
            .unwrap()
            .last_window_nsr
            .unwrap()
    };
    let four_bit = nsr(&rep, "layers.2.o");
    let eight_bit = rep
        .groups
        .iter()
        .filter(|g| g.group != "layers.2.o")
        .map(|g| g.last_window_nsr.unwrap())
        .fold(0f64, f64::max);
    eprintln!("harm: 4-bit layers.2.o {four_bit:.2e}, 8-bit groups at most {eight_bit:.2e}");
    // (the 8-bit maximum is the planted INT8-hostile `layers.1.down`: one 60σ weight per
    // block of 32 coarsens its Q8_0 step, ≈ 1.6·10⁻⁴)
    assert!(
        four_bit > 1e-3 && eight_bit < 1e-3 && four_bit > 10.0 * eight_bit,
        "4-bit {four_bit:.2e} vs 8-bit {eight_bit:.2e}"
    );
    let in_float: Vec<&str> = rep
        .groups
        .iter()
        .filter(|g| g.mode != GroupMode::Int8)
        .map(|g| g.group.as_str())
        .collect();
    assert_eq!(in_float, vec!["layers.2.o"]);
    assert_eq!(
        rep.groups
            .iter()
            .find(|g| g.group == "layers.2.o")
            .unwrap()
            .reason,
        Some(FallbackReason::OutlierRate)
    );

    // Back to 8 bits by reload: the group is rebuilt, the monitor takes its new column
    // errors, the harm falls under the bound, and after `recovery_windows` quiet windows the
    // group returns to the quantized path.
    std::fs::write(&plan, with_class("w8a8")).unwrap();
    e.reload_config().await.unwrap();
    let seen = 4 * quantmesh_model::bundled::SAMPLE_PROMPTS.len();
    let rep = drive(&e, seen, 4).await;
    let after = nsr(&rep, "layers.2.o");
    assert!(
        after < four_bit / 10.0 && after < 1e-3,
        "after the reload to 8 bits: {after:.2e} (4-bit: {four_bit:.2e})"
    );
    assert_eq!(mode(&rep, "layers.2.o"), GroupMode::Int8);
}
