//! The decision core's unit tests: warm-up, outliers, windows, hysteresis, coupling.

use super::*;
use crate::precision::GroupObs;
use quantmesh_types::GroupKind;
use std::collections::BTreeSet;

fn groups() -> Vec<(GroupId, Residency)> {
    (0..2)
        .flat_map(|l| GroupKind::ALL.map(|k| (GroupId::new(l, k), Residency::Dual)))
        .collect()
}

fn cfg() -> MonitorConfig {
    MonitorConfig {
        window_requests: 1,
        warmup_tokens: 200,
        min_window_tokens: 50,
        recovery_windows: 2,
        ..Default::default()
    }
}

/// A step of `n` rows whose statistic in group `g`, row `i` is `stat(g, i)`, with the
/// channels in `massive` reported massive in every row.
fn step_of(n: usize, massive: &[u32], mut stat: impl FnMut(GroupId, usize) -> f32) -> StepOutput {
    let rows: Vec<(SeqId, usize, u32)> = (0..n).map(|i| (1, i + 1, 7)).collect();
    let obs = groups()
        .into_iter()
        .map(|(g, _)| GroupObs {
            group: g,
            stats: (0..n).map(|i| stat(g, i)).collect(),
            token_float_rows: Vec::new(),
            massive: vec![massive.to_vec(); n],
            harm: Vec::new(),
        })
        .collect();
    StepOutput {
        rows,
        obs,
        num_tokens: n,
        ..Default::default()
    }
}

/// A step of `n` rows where group `hot` has every `every`-th row at 50 (others ≈ 1),
/// and channel 3 is massive in every row (a massive fixed channel).
fn step(n: usize, hot: Option<GroupId>, every: usize, seed: usize) -> StepOutput {
    step_of(n, &[3], |g, i| {
        if Some(g) == hot && every > 0 && i % every == 0 {
            50.0
        } else {
            1.0 + 0.1 * (((i + seed) * 37 % 17) as f32 / 17.0)
        }
    })
}

/// A monitor over [`groups`] whose batch falls back once a tenth of its groups are in float.
fn batch_share_monitor() -> Monitor {
    Monitor::new(
        MonitorConfig {
            batch_group_share: 0.1,
            ..cfg()
        },
        "t",
        &groups(),
    )
}

fn warm(m: &mut Monitor) {
    m.observe(&step(200, None, 0, 0));
    m.end_window();
}

/// A step of `n` rows whose statistic is Gaussian(mean, sd) in every group, with group
/// `spiky`'s rows multiplied by `spike` on every `every`-th row.
fn gaussian_step(
    n: usize,
    mean: f32,
    sd: f32,
    spiky: Option<(GroupId, usize, f32)>,
    rng: &mut rand::rngs::StdRng,
) -> StepOutput {
    use rand::Rng;
    step_of(n, &[], |g, i| {
        // Box–Muller
        let (u1, u2): (f32, f32) = (rng.gen_range(1e-7..1.0), rng.gen());
        let z = (-2.0 * u1.ln()).sqrt() * (std::f32::consts::TAU * u2).cos();
        let x = mean + sd * z;
        match spiky {
            Some((h, every, f)) if h == g && i % every == 0 => x * f,
            _ => x,
        }
    })
}

/// The attention-output case from the field: statistic mean 0.68, σ 0.005. `mean + 4σ`
/// is 3 % above the mean; with Gaussian tails plus the EMA's drift ordinary rows cross it
/// now and then. The material floor (`min_excess`) keeps them from counting; a real spike
/// (7× on every 12th row) still triggers.
#[test]
fn low_variance_statistic_has_no_outliers_a_real_spike_has() {
    use rand::SeedableRng;
    let o = GroupId::new(1, GroupKind::O);
    let run = |min_excess: f64, spiky: Option<(GroupId, usize, f32)>| {
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        let mut m = Monitor::new(
            MonitorConfig {
                min_excess,
                ..cfg()
            },
            "t",
            &groups(),
        );
        m.observe(&gaussian_step(200, 0.68, 0.005, None, &mut rng));
        m.end_window();
        let mut events = Vec::new();
        let mut outliers = 0;
        for _ in 0..20 {
            // heavier-than-Gaussian tails: every 25th row 6σ out
            let mut st = gaussian_step(200, 0.68, 0.005, spiky, &mut rng);
            for ob in &mut st.obs {
                for (i, x) in ob.stats.iter_mut().enumerate() {
                    if i % 25 == 12 {
                        *x += 0.03;
                    }
                }
            }
            m.observe(&st);
            outliers += m.groups[&o].window_outliers;
            events.extend(m.end_window());
        }
        (events, outliers)
    };
    let (events, outliers) = run(1.0, None);
    assert!(events.is_empty(), "{events:?}");
    assert_eq!(outliers, 0);
    // Without the floor the same ordinary traffic makes the group fall back.
    let (events, outliers) = run(0.0, None);
    assert!(outliers > 0);
    assert!(
        events
            .iter()
            .any(|e| e.group.as_deref() == Some("layers.1.o")),
        "{events:?}"
    );
    // A real input-dependent spike still triggers with the floor, in that group only.
    let (events, _) = run(1.0, Some((o, 12, 7.0)));
    let groups: std::collections::BTreeSet<_> =
        events.iter().filter_map(|e| e.group.clone()).collect();
    assert_eq!(
        groups,
        std::collections::BTreeSet::from(["layers.1.o".to_string()])
    );
}

/// The harm test: rows whose output noise-to-signal ratio on the quantized path exceeds
/// `max_nsr` count as outliers with no activation spike, so a group its quantized
/// weights hurt on a share of rows above the trigger enters fallback (`down` takes its
/// `gate_up` along); below the bound, or with the bound off, nothing happens. The
/// window's mean harm is reported and published.
#[test]
fn harmful_rows_count_as_outliers_without_a_spike() {
    let down = GroupId::new(0, GroupKind::Down);
    let run = |max_nsr: f64, every: usize| {
        let mut m = Monitor::new(MonitorConfig { max_nsr, ..cfg() }, "t", &groups());
        warm(&mut m);
        let mut events = Vec::new();
        for w in 0..3 {
            // A steady activation statistic everywhere; the harm varies by group.
            let mut st = step(200, None, 0, w);
            for ob in &mut st.obs {
                ob.harm = (0..200)
                    .map(|i| {
                        if ob.group == down && i % every == 0 {
                            0.05
                        } else {
                            0.001
                        }
                    })
                    .collect();
            }
            m.observe(&st);
            events.extend(m.end_window());
        }
        let groups: BTreeSet<String> = events
            .iter()
            .filter(|e| e.action == FallbackAction::Enter)
            .filter_map(|e| e.group.clone())
            .collect();
        (groups, m.report(), m.take_windows())
    };
    let (entered, report, windows) = run(0.01, 1);
    assert_eq!(
        entered,
        BTreeSet::from(["layers.0.down".to_string(), "layers.0.gate_up".to_string()])
    );
    let nsr = |r: &MonitorReport, g: &str| {
        r.groups
            .iter()
            .find(|x| x.group == g)
            .and_then(|x| x.last_window_nsr)
    };
    assert!((nsr(&report, "layers.0.down").unwrap() - 0.05).abs() < 1e-6);
    assert!((nsr(&report, "layers.0.o").unwrap() - 0.001).abs() < 1e-6);
    // ... and every window's event carries it per group, for the evolution job.
    // (the first window is the warm-up's, with no harm measured)
    assert_eq!(windows.len(), 4);
    assert!(windows[0].groups.iter().all(|g| g.mean_nsr.is_none()));
    for w in &windows[1..] {
        let mean = |g: &str| {
            w.groups
                .iter()
                .find(|x| x.group == g)
                .and_then(|x| x.mean_nsr)
        };
        assert!(
            (mean("layers.0.down").unwrap() - 0.05).abs() < 1e-6,
            "{w:?}"
        );
        assert!((mean("layers.0.o").unwrap() - 0.001).abs() < 1e-6, "{w:?}");
    }
    // Harmful on every 10th row: 10 % is above the 1 % trigger with confidence.
    assert!(run(0.01, 10).0.contains("layers.0.down"));
    // Every 100th row: 1 %, not above the trigger with confidence.
    assert!(run(0.01, 100).0.is_empty());
    // The bound above the harm, or off.
    assert!(run(0.1, 1).0.is_empty());
    assert!(run(0.0, 1).0.is_empty());
}

/// The width a test's `split` flag stands for: `copyless` (rows that want float served
/// split) or `all`.
fn width(split: bool) -> SplitActivations {
    if split {
        SplitActivations::Copyless
    } else {
        SplitActivations::All
    }
}

/// Harm drives an INT8-only group's fallback under `all` (reported `unavailable`) and
/// `copyless` (a `split` layer decision), but not under `copyless_q4`: there the group's
/// split fallback would carry 16-bit activations, which leave the weights' error (what
/// harm measures) as it was. The harm is still reported under every width.
#[test]
fn harm_splits_a_group_under_copyless_but_not_under_copyless_q4() {
    let mut gs = groups();
    for (_, r) in gs.iter_mut() {
        *r = Residency::Int8;
    }
    let down = GroupId::new(0, GroupKind::Down);
    for (mode, want) in [
        (SplitActivations::All, Some(FallbackAction::Unavailable)),
        (SplitActivations::Copyless, Some(FallbackAction::Split)),
        (SplitActivations::CopylessQ4, None),
    ] {
        let mut m = Monitor::new(
            MonitorConfig {
                max_nsr: 0.01,
                ..cfg()
            },
            "t",
            &gs,
        );
        m.set_width(mode);
        warm(&mut m);
        let mut st = step(200, None, 0, 1);
        for ob in &mut st.obs {
            ob.harm = (0..200)
                .map(|_| if ob.group == down { 0.05 } else { 0.001 })
                .collect();
        }
        m.observe(&st);
        let ev = m.end_window();
        let got = ev
            .iter()
            .find(|e| {
                e.granularity == Granularity::Layer && e.group.as_deref() == Some("layers.0.down")
            })
            .map(|e| e.action);
        assert_eq!(got, want, "{}", mode.as_str());
        let nsr = m
            .report()
            .groups
            .iter()
            .find(|x| x.group == "layers.0.down")
            .and_then(|x| x.last_window_nsr);
        assert!(
            nsr.is_some_and(|n| (n - 0.05).abs() < 1e-6),
            "{}: {nsr:?}",
            mode.as_str()
        );
    }
}

/// Two equal massive channels reported in every warm-up row are both learned (in the
/// residual-stream readers).
#[test]
fn every_massive_channel_is_learned() {
    let mut m = Monitor::new(cfg(), "t", &groups());
    let mut st = step(200, None, 0, 0);
    for ob in &mut st.obs {
        ob.massive = vec![vec![17, 101]; 200];
    }
    m.observe(&st);
    let mut mask = PathMask::default();
    m.apply_to(&mut mask);
    let d = mask.detector.unwrap();
    assert_eq!(
        d.groups[&GroupId::new(1, GroupKind::GateUp)].excluded_channels,
        vec![17, 101]
    );
    assert!(d.groups[&GroupId::new(1, GroupKind::Down)]
        .excluded_channels
        .is_empty());
}

#[test]
fn planted_outliers_in_one_group_trigger_exactly_that_group() {
    let mut m = Monitor::new(cfg(), "t", &groups());
    warm(&mut m);
    let hot = GroupId::new(1, GroupKind::O);
    m.observe(&step(100, Some(hot), 20, 1)); // 5 % outliers
    let ev = m.requests_finished(&[1]);
    assert_eq!(ev.len(), 1, "{ev:?}");
    assert_eq!(ev[0].group.as_deref(), Some("layers.1.o"));
    assert_eq!(
        (ev[0].granularity, ev[0].action, ev[0].reason),
        (
            Granularity::Layer,
            FallbackAction::Enter,
            FallbackReason::OutlierRate
        )
    );
    assert!(ev[0].outlier_rate.unwrap() > 0.04);
    let mut mask = PathMask::default();
    m.apply_to(&mut mask);
    assert_eq!(
        mask.float_groups.iter().copied().collect::<Vec<_>>(),
        vec![hot]
    );
    assert_eq!(
        mask.kv_float_layers.iter().copied().collect::<Vec<_>>(),
        vec![1]
    );
    // channel 3 was learned as massive in every residual-input group, not elsewhere
    let d = mask.detector.unwrap();
    assert_eq!(
        d.groups[&GroupId::new(0, GroupKind::Qkv)].excluded_channels,
        vec![3]
    );
    assert!(d.groups[&GroupId::new(0, GroupKind::Down)]
        .excluded_channels
        .is_empty());
}

#[test]
fn down_fallback_takes_its_gate_up_along_and_back() {
    let mut m = Monitor::new(cfg(), "t", &groups());
    warm(&mut m);
    let down = GroupId::new(0, GroupKind::Down);
    let gu = GroupId::new(0, GroupKind::GateUp);
    m.observe(&step(100, Some(down), 10, 1));
    let ev = m.end_window();
    assert_eq!(
        ev.iter()
            .map(|e| e.group.clone().unwrap())
            .collect::<Vec<_>>(),
        vec!["layers.0.down", "layers.0.gate_up"]
    );
    assert_eq!(m.mode(gu), Some(GroupMode::Coupled));
    let mut mask = PathMask::default();
    m.apply_to(&mut mask);
    assert!(mask.float_groups.contains(&gu) && mask.float_groups.contains(&down));
    for i in 0..2 {
        m.observe(&step(100, None, 0, 10 + i));
        m.end_window();
    }
    assert_eq!(m.mode(down), Some(GroupMode::Int8));
    assert_eq!(m.mode(gu), Some(GroupMode::Int8));
}

#[test]
fn recovery_after_m_quiet_windows_and_not_before() {
    let mut m = Monitor::new(cfg(), "t", &groups());
    warm(&mut m);
    let hot = GroupId::new(0, GroupKind::O);
    m.observe(&step(100, Some(hot), 10, 2));
    m.end_window();
    assert_eq!(m.mode(hot), Some(GroupMode::Fallback));
    // one quiet window: still in fallback
    m.observe(&step(100, None, 0, 3));
    assert!(m.end_window().is_empty());
    assert_eq!(m.mode(hot), Some(GroupMode::Fallback));
    // a noisy window in between resets the count (rate ≥ trigger/2 but ≤ trigger)
    m.observe(&step(200, Some(hot), 200, 4)); // 0.5 %... exactly trigger/2
    m.end_window();
    m.observe(&step(100, None, 0, 5));
    assert!(m.end_window().is_empty(), "count restarted");
    assert_eq!(m.mode(hot), Some(GroupMode::Fallback));
    m.observe(&step(100, None, 0, 6));
    let ev = m.end_window();
    assert_eq!(ev.len(), 1);
    assert_eq!(
        (ev[0].action, ev[0].reason),
        (FallbackAction::Exit, FallbackReason::Recovered)
    );
    assert_eq!(m.mode(hot), Some(GroupMode::Int8));
}

#[test]
fn int8_only_group_reports_unavailable() {
    let mut gs = groups();
    gs[0].1 = Residency::Int8;
    let g0 = gs[0].0;
    let mut m = Monitor::new(cfg(), "t", &gs);
    warm(&mut m);
    m.observe(&step(100, Some(g0), 10, 1));
    let ev = m.end_window();
    assert_eq!(ev[0].action, FallbackAction::Unavailable);
    let mut mask = PathMask::default();
    m.apply_to(&mut mask);
    assert!(mask.float_groups.is_empty());
    assert!(m.report().groups[0].wanted_fallback_unavailable);
    assert!(m.force(g0, ForceMode::Float).is_err());
}

#[test]
fn nan_kl_and_batch_share_decisions() {
    let mut m = batch_share_monitor();
    warm(&mut m);
    let mut s = step(10, None, 0, 1);
    s.non_finite = true;
    s.shadow_kl = vec![(5, 0.5), (6, 0.001)];
    let ev = m.observe(&s);
    assert!(ev
        .iter()
        .any(|e| e.granularity == Granularity::Batch && e.reason == FallbackReason::NonFinite));
    let req: Vec<_> = ev
        .iter()
        .filter(|e| e.granularity == Granularity::Request)
        .collect();
    assert_eq!(req.len(), 1);
    assert_eq!(req[0].request_id, Some(5));
    let mut mask = PathMask::default();
    m.apply_to(&mut mask);
    assert!(mask.float_requests.contains(&5) && !mask.float_requests.contains(&6));
    m.requests_finished(&[5]);
    m.apply_to(&mut mask);
    assert!(mask.float_requests.is_empty());
    // two of 8 groups forced to float > 10 % share → whole batch float at window end
    m.force(GroupId::new(0, GroupKind::O), ForceMode::Float)
        .unwrap();
    m.force(GroupId::new(1, GroupKind::O), ForceMode::Float)
        .unwrap();
    let ev = m.end_window();
    assert!(ev
        .iter()
        .any(|e| e.granularity == Granularity::Batch && e.reason == FallbackReason::LayerShare));
    m.apply_to(&mut mask);
    assert!(mask.float_batch);
}

#[test]
fn a_batch_of_finished_requests_that_closes_two_windows_yields_both_events() {
    let mut m = Monitor::new(
        MonitorConfig {
            window_requests: 2,
            ..cfg()
        },
        "t",
        &groups(),
    );
    m.observe(&step(200, None, 0, 0));
    // Five requests finish in one message: two windows close, one request stays counted.
    m.requests_finished(&[1, 2, 3, 4, 5]);
    let windows = m.take_windows();
    assert_eq!(
        windows.iter().map(|w| w.window).collect::<Vec<_>>(),
        vec![1, 2],
        "one event per closed window, oldest first"
    );
    assert!(m.take_windows().is_empty(), "taken once");
    m.requests_finished(&[6]);
    assert_eq!(m.take_windows().len(), 1);
}

/// A per-token decision in an INT8-only group is `unavailable` unless the engine serves
/// such rows split (`copyless`): then it is a `split`; a group with a float copy enters.
#[test]
fn per_token_decisions_name_what_the_row_got() {
    let mut gs = groups();
    gs[0].1 = Residency::Int8;
    let (g0, g1) = (gs[0].0, gs[1].0);
    for (split, want) in [
        (false, FallbackAction::Unavailable),
        (true, FallbackAction::Split),
    ] {
        let mut m = Monitor::new(cfg(), "t", &gs);
        m.set_width(width(split));
        warm(&mut m);
        let mut out = step(100, None, 0, 1);
        for o in &mut out.obs {
            if o.group == g0 || o.group == g1 {
                o.token_float_rows = vec![3];
            }
        }
        let ev = m.observe(&out);
        let token: Vec<(Option<String>, FallbackAction)> = ev
            .iter()
            .filter(|e| e.granularity == Granularity::Token)
            .map(|e| (e.group.clone(), e.action))
            .collect();
        assert_eq!(
            token,
            vec![
                (Some(g0.to_string()), want),
                (Some(g1.to_string()), FallbackAction::Enter)
            ],
            "{split}"
        );
    }
}

/// Copyless: a group without a float copy whose outlier rate passes the trigger falls back
/// per layer onto 16-bit activations — a `split` layer decision that routes every row of
/// the group (the mask's float groups) but leaves its layer's KV cache alone — and returns
/// with `exit` after quiet windows. Without copyless the same evidence is `unavailable`.
/// A `down` in split fallback takes its INT8-only `gate_up` along, split too.
#[test]
fn a_copyless_group_over_its_trigger_falls_back_per_layer_split() {
    let mut gs = groups();
    for (g, r) in gs.iter_mut() {
        if g.layer == 1 {
            *r = Residency::Int8;
        }
    }
    let hot = GroupId::new(1, GroupKind::O);
    let down = GroupId::new(1, GroupKind::Down);
    let gu = GroupId::new(1, GroupKind::GateUp);
    for split in [false, true] {
        let mut m = Monitor::new(cfg(), "t", &gs);
        m.set_width(width(split));
        warm(&mut m);
        m.observe(&step(100, Some(hot), 10, 1));
        let ev = m.end_window();
        let layer: Vec<(Option<String>, FallbackAction)> = ev
            .iter()
            .filter(|e| e.granularity == Granularity::Layer)
            .map(|e| (e.group.clone(), e.action))
            .collect();
        let mut mask = PathMask::default();
        m.apply_to(&mut mask);
        if !split {
            assert_eq!(
                layer,
                vec![(Some(hot.to_string()), FallbackAction::Unavailable)]
            );
            assert!(mask.float_groups.is_empty());
            assert!(m
                .report()
                .groups
                .iter()
                .any(|g| g.wanted_fallback_unavailable));
            continue;
        }
        assert_eq!(layer, vec![(Some(hot.to_string()), FallbackAction::Split)]);
        assert_eq!(m.mode(hot), Some(GroupMode::Fallback));
        assert_eq!(
            mask.float_groups.iter().copied().collect::<Vec<_>>(),
            vec![hot]
        );
        assert!(
            mask.kv_float_layers.is_empty(),
            "split keeps the KV cache as it was"
        );
        assert!(!m
            .report()
            .groups
            .iter()
            .any(|g| g.wanted_fallback_unavailable));
        let windows = m.take_windows();
        let w = windows.last().unwrap();
        assert!(
            w.groups.iter().all(|g| !g.in_float),
            "no group ran a float copy"
        );
        assert!(
            w.groups
                .iter()
                .any(|g| g.group == hot.to_string() && g.wanted_unavailable),
            "the weekly analysis still sees a group that wanted float and had no copy"
        );
        // `down` over its trigger: split, and its gate_up coupled, split too.
        m.observe(&step(100, Some(down), 10, 2));
        let ev = m.end_window();
        let mut got: Vec<(Option<String>, FallbackAction)> = ev
            .iter()
            .filter(|e| e.granularity == Granularity::Layer)
            .map(|e| (e.group.clone(), e.action))
            .collect();
        got.sort();
        assert_eq!(
            got,
            vec![
                (Some(down.to_string()), FallbackAction::Split),
                (Some(gu.to_string()), FallbackAction::Split)
            ]
        );
        assert_eq!(m.mode(gu), Some(GroupMode::Coupled));
        // Quiet windows: every split group returns to 8-bit activations with `exit`.
        let mut exits = Vec::new();
        for i in 0..3 {
            m.observe(&step(100, None, 0, 10 + i));
            exits.extend(
                m.end_window()
                    .into_iter()
                    .filter(|e| e.action == FallbackAction::Exit)
                    .filter_map(|e| e.group),
            );
        }
        exits.sort();
        let mut want = vec![hot.to_string(), down.to_string(), gu.to_string()];
        want.sort();
        assert_eq!(exits, want);
        m.apply_to(&mut mask);
        assert!(mask.float_groups.is_empty());
        // Turning copyless off takes a split group out of fallback, marked wanted.
        m.observe(&step(100, Some(hot), 10, 20));
        m.end_window();
        assert_eq!(m.mode(hot), Some(GroupMode::Fallback));
        m.set_width(SplitActivations::All);
        assert_eq!(m.mode(hot), Some(GroupMode::Int8));
        assert!(m
            .report()
            .groups
            .iter()
            .any(|g| g.wanted_fallback_unavailable));
    }
}

/// The monitor asks `mask_is_current` after every step instead of rebuilding the mask and
/// comparing: through warm-up, a layer fallback, a request fallback, a forced group, the
/// batch share and the recovery, the answer for the last published mask is always "would
/// rebuilding change it", and a freshly written mask is current.
#[test]
fn the_mask_check_agrees_with_rebuilding_the_mask() {
    fn agrees(m: &Monitor, published: &mut PathMask, state: &str) {
        let mut rebuilt = published.clone();
        m.apply_to(&mut rebuilt);
        assert_eq!(
            m.mask_is_current(published),
            rebuilt == *published,
            "{state}: the check disagrees with a rebuild"
        );
        *published = rebuilt;
        assert!(
            m.mask_is_current(published),
            "{state}: a fresh mask is stale"
        );
    }
    let mut m = batch_share_monitor();
    let mut published = PathMask::default();
    agrees(&m, &mut published, "new");
    agrees(&m, &mut published, "unchanged");
    m.observe(&step(60, None, 0, 0));
    agrees(&m, &mut published, "learning");
    warm(&mut m);
    agrees(&m, &mut published, "warm");
    let hot = GroupId::new(0, GroupKind::O);
    m.observe(&step(100, Some(hot), 10, 2));
    m.end_window();
    assert_eq!(m.mode(hot), Some(GroupMode::Fallback));
    agrees(&m, &mut published, "layer fallback");
    let mut s = step(10, None, 0, 1);
    s.shadow_kl = vec![(5, 0.5)];
    m.observe(&s);
    agrees(&m, &mut published, "request fallback");
    m.force(GroupId::new(1, GroupKind::Qkv), ForceMode::Int8)
        .unwrap();
    agrees(&m, &mut published, "forced to INT8");
    m.force(GroupId::new(1, GroupKind::O), ForceMode::Float)
        .unwrap();
    m.end_window();
    agrees(&m, &mut published, "batch share");
    m.requests_finished(&[5]);
    agrees(&m, &mut published, "request finished");
    for i in 0..3 {
        m.observe(&step(100, None, 0, 10 + i));
        m.end_window();
        agrees(&m, &mut published, "recovering");
    }
    // Each field the check reads, changed in the published mask alone.
    let mut changes: Vec<PathMask> = Vec::new();
    for edit in 0..5 {
        let mut p = published.clone();
        let mut d = DetectorParams::clone(p.detector.as_deref().unwrap());
        let first = d.groups.values_mut().next().unwrap();
        match edit {
            0 => first.excluded_channels.push(99),
            1 => first.token_bound += 1.0,
            2 => first.learn_channels = !first.learn_channels,
            3 => d.shadow_sample_rate += 0.5,
            _ => {
                d.groups.pop_last();
            }
        }
        p.detector = Some(Arc::new(d));
        changes.push(p);
    }
    let mut p = published.clone();
    p.float_batch = !p.float_batch;
    changes.push(p);
    let mut p = published.clone();
    p.float_requests.insert(77);
    changes.push(p);
    let mut p = published.clone();
    p.float_groups.insert(GroupId::new(1, GroupKind::Down));
    changes.push(p);
    let mut p = published.clone();
    p.kv_float_layers.insert(7);
    changes.push(p);
    let mut p = published.clone();
    p.detector = None;
    changes.push(p);
    for (i, p) in changes.iter().enumerate() {
        assert!(!m.mask_is_current(p), "change {i} went unnoticed");
    }
    // Monitoring off: current exactly when no detector is published.
    let off = Monitor::new(
        MonitorConfig {
            enabled: false,
            ..cfg()
        },
        "t",
        &groups(),
    );
    let mut p = PathMask::default();
    agrees(&off, &mut p, "off");
    assert!(!off.mask_is_current(&published));
}
