//! The proposal rules, one case each.

#![allow(clippy::unwrap_used)]
use super::*;
use crate::analysis::KlEvidence;

fn plan() -> SensitiveLayers {
    SensitiveLayers::parse(br#"{"schema_version": 1}"#).unwrap()
}

/// A schema-v1 plan with these `groups`.
fn plan_with(groups: serde_json::Value) -> SensitiveLayers {
    let file = serde_json::json!({"schema_version": 1, "groups": groups});
    SensitiveLayers::parse(file.to_string().as_bytes()).unwrap()
}

fn group(name: &str, residency: &str) -> GroupEvidence {
    GroupEvidence {
        group: name.into(),
        windows: 100,
        tokens: 100_000,
        outliers: 100,
        rate_p50: Some(0.001),
        rate_p95: Some(0.002),
        rate_max: Some(0.004),
        residency: residency.into(),
        ..Default::default()
    }
}

fn evidence(groups: Vec<GroupEvidence>) -> Evidence {
    Evidence {
        model: "m".into(),
        since_ms: 0,
        until_ms: 604_800_000,
        groups,
        ..Default::default()
    }
}

#[test]
fn an_int8_group_that_wanted_float_is_promoted_to_dual() {
    let mut g = group("layers.3.down", "int8");
    g.unavailable_windows = 40;
    let p = propose(
        &plan(),
        &evidence(vec![g]),
        &Rules::default(),
        EngineDefaults::default(),
    );
    assert_eq!(p.changes.len(), 1, "{:?}", p.changes);
    let e = &p.plan.groups["layers.3.down"];
    assert_eq!(e.residency, Some(Residency::Dual));
    assert_eq!(e.class, PrecisionClass::W8a8PerChannel);
    // The evidence travels with the promotion, for the engines' float budget.
    let o = e.observed.as_ref().expect("observed evidence");
    assert_eq!((o.windows, o.wanted_float_share), (100, 0.4));
    assert!(
        p.changes[0].reason.contains("40 %"),
        "{}",
        p.changes[0].reason
    );
    assert!(p.plan.generator.is_some());
}

/// A plan entry in `class`, INT8-only, with the pre-screen's 4-bit KL `kl4`.
fn entry(class: &str, kl4: f64) -> serde_json::Value {
    serde_json::json!({
        "class": class,
        "residency": "int8",
        "metrics": {"r": 5.0, "energy": 0.1,
                    "kl": {"w8a8": 0.001, "w8a8_per_channel": 0.0005, "w4a16": kl4}}
    })
}

#[test]
fn the_partner_is_the_cheapest_in_the_residual_stream_when_the_plan_measured_it() {
    // layers.1.down has the lower output KL, but its 4-bit error lands amplified in the
    // residual stream; layers.2.down costs less there, so it takes the 4 bits.
    let with_residual = |kl4: f64, res4: f64| {
        let mut e = entry("w8a8", kl4);
        e["metrics"]["residual"] = serde_json::json!({"w8a8_per_channel": 1e-6, "w4a16": res4});
        e
    };
    let plan = plan_with(serde_json::json!({
        "layers.0.down": entry("w4a16", 0.3),
        "layers.1.down": with_residual(0.001, 0.05),
        "layers.2.down": with_residual(0.01, 0.0001),
    }));
    let mut hurt = group("layers.0.down", "int8");
    hurt.unavailable_windows = 40;
    let ev = evidence(vec![
        hurt,
        group("layers.1.down", "int8"),
        group("layers.2.down", "int8"),
    ]);
    let p = propose(&plan, &ev, &Rules::default(), EngineDefaults::default());
    let class = |g: &str| p.plan.groups[g].class;
    assert_eq!(
        class("layers.2.down"),
        PrecisionClass::W4a16,
        "{:?}",
        p.changes
    );
    assert_eq!(
        class("layers.1.down"),
        PrecisionClass::W8a8,
        "{:?}",
        p.changes
    );
}

#[test]
fn a_four_bit_group_that_wanted_float_trades_bits_with_the_quietest_of_its_kind() {
    let plan = plan_with(serde_json::json!({
        "layers.0.down": entry("w4a16", 0.3),
        "layers.1.down": entry("w8a8", 0.02),
        "layers.2.down": entry("w8a8", 0.01),
        "layers.3.down": entry("w8a8", 0.005),
        "layers.0.o": entry("w8a8", 0.0001),
    }));
    let mut hurt = group("layers.0.down", "int8");
    hurt.unavailable_windows = 40;
    // layers.3.down has the lowest 4-bit KL but is not quiet (it wanted float once);
    // layers.0.o is quiet with a lower KL but another kind (another shape).
    let mut busy = group("layers.3.down", "int8");
    busy.unavailable_windows = 1;
    let ev = evidence(vec![
        hurt,
        group("layers.1.down", "int8"),
        group("layers.2.down", "int8"),
        busy,
        group("layers.0.o", "int8"),
    ]);
    let p = propose(&plan, &ev, &Rules::default(), EngineDefaults::default());
    let class = |g: &str| p.plan.groups[g].class;
    assert_eq!(
        class("layers.0.down"),
        PrecisionClass::W8a8,
        "{:?}",
        p.changes
    );
    assert_eq!(
        class("layers.2.down"),
        PrecisionClass::W4a16,
        "{:?}",
        p.changes
    );
    assert_eq!(class("layers.1.down"), PrecisionClass::W8a8);
    assert_eq!(class("layers.3.down"), PrecisionClass::W8a8);
    assert_eq!(class("layers.0.o"), PrecisionClass::W8a8);
    // Still INT8-only: 8 bits before a float copy.
    assert_eq!(
        p.plan.groups["layers.0.down"].residency,
        Some(Residency::Int8)
    );
    let fours = |pl: &SensitiveLayers| {
        pl.groups
            .values()
            .filter(|e| e.class == PrecisionClass::W4a16)
            .count()
    };
    assert_eq!(
        fours(&p.plan),
        fours(&plan),
        "the same bytes: one down in 4 bits"
    );
    assert_eq!(p.changes.len(), 2, "{:?}", p.changes);
    assert!(
        p.changes[0].reason.contains("layers.2.down goes to 4 bits"),
        "{:?}",
        p.changes[0]
    );
    assert!(
        p.changes[1].reason.contains("layers.0.down"),
        "{:?}",
        p.changes[1]
    );
    assert_eq!(
        (p.changes[0].field.as_str(), p.changes[0].to.as_str()),
        ("class", "w8a8")
    );

    // No quiet partner of its kind: no raise (it would grow the plan past the weight budget
    // that chose its bits) — a float copy instead, and the reason says why; the bits stay.
    let ev = evidence(vec![{
        let mut g = group("layers.0.down", "int8");
        g.unavailable_windows = 40;
        g
    }]);
    let p = propose(&plan, &ev, &Rules::default(), EngineDefaults::default());
    assert_eq!(p.plan.groups["layers.0.down"].class, PrecisionClass::W4a16);
    assert_eq!(fours(&p.plan), fours(&plan), "no group changed its bits");
    assert_eq!(
        p.plan.groups["layers.0.down"].residency,
        Some(Residency::Dual)
    );
    assert_eq!(p.changes.len(), 1);
    assert!(
        p.changes[0].reason.contains("past its weight budget"),
        "{:?}",
        p.changes[0]
    );
}

#[test]
fn a_dual_group_always_in_float_becomes_float() {
    let mut g = group("layers.1.down", "dual");
    g.float_windows = 95;
    g.float_share = 0.95;
    g.enters = 1;
    let p = propose(
        &plan(),
        &evidence(vec![g]),
        &Rules::default(),
        EngineDefaults::default(),
    );
    assert_eq!(
        p.plan.groups["layers.1.down"].residency,
        Some(Residency::Float)
    );
}

#[test]
fn a_quiet_dual_group_is_demoted_unless_its_kl_says_otherwise() {
    let g = group("layers.0.o", "dual");
    let p = propose(
        &plan(),
        &evidence(vec![g.clone()]),
        &Rules::default(),
        EngineDefaults::default(),
    );
    assert_eq!(p.plan.groups["layers.0.o"].residency, Some(Residency::Int8));
    // The pre-screen measured a large INT8 error: keep the float copy.
    let mut with_kl = plan();
    with_kl.groups.insert(
        "layers.0.o".into(),
        serde_json::from_value(serde_json::json!({
            "class": "w8a8_per_channel",
            "metrics": {"r": 1.0, "energy": 0.1,
                        "kl": {"w8a8": 0.01, "w8a8_per_channel": 0.01, "w4a16": 0.1}}
        }))
        .unwrap(),
    );
    let p = propose(
        &with_kl,
        &evidence(vec![g.clone()]),
        &Rules::default(),
        EngineDefaults::default(),
    );
    assert!(p.changes.is_empty(), "{:?}", p.changes);
    // A 4-bit group with a float copy is demoted to its 4-bit form, not to 8 bits: the
    // residency changes, the bits (and the weight budget's bytes) stay.
    let mut four = plan();
    four.groups.insert(
        "layers.0.o".into(),
        serde_json::from_value(serde_json::json!({
            "class": "w4a16", "residency": "dual",
            "metrics": {"r": 1.0, "energy": 0.1,
                        "kl": {"w8a8": 1e-5, "w8a8_per_channel": 1e-5, "w4a16": 2e-5}}
        }))
        .unwrap(),
    );
    let p = propose(
        &four,
        &evidence(vec![g.clone()]),
        &Rules::default(),
        EngineDefaults::default(),
    );
    let e = &p.plan.groups["layers.0.o"];
    assert_eq!(
        (e.residency, e.class),
        (Some(Residency::Int8), PrecisionClass::W4a16),
        "{:?}",
        p.changes
    );
    // A group that fell back once is not demoted.
    let mut busy = g;
    busy.enters = 1;
    let p = propose(
        &plan(),
        &evidence(vec![busy]),
        &Rules::default(),
        EngineDefaults::default(),
    );
    assert!(p.changes.is_empty());
}

#[test]
fn the_request_limit_follows_healthy_traffic_with_a_margin_and_hysteresis() {
    let mut ev = evidence(vec![]);
    ev.kl = KlEvidence {
        samples: 1000,
        healthy_samples: 990,
        healthy_p99: Some(0.004),
        ..Default::default()
    };
    let p = propose(&plan(), &ev, &Rules::default(), EngineDefaults::default());
    assert_eq!(p.plan.thresholds.request_kl_limit, Some(0.006));
    // Within 10 % of the limit in force: no change.
    ev.kl.healthy_p99 = Some(0.0135);
    let p = propose(&plan(), &ev, &Rules::default(), EngineDefaults::default());
    assert!(p.changes.is_empty(), "{:?}", p.changes);
    // Clamped to the bounds.
    ev.kl.healthy_p99 = Some(1.0);
    let p = propose(&plan(), &ev, &Rules::default(), EngineDefaults::default());
    assert_eq!(p.plan.thresholds.request_kl_limit, Some(0.2));
}

#[test]
fn too_little_evidence_changes_nothing() {
    let mut g = group("layers.3.down", "int8");
    g.unavailable_windows = 9;
    g.windows = 10;
    let mut ev = evidence(vec![g]);
    ev.kl = KlEvidence {
        samples: 50,
        healthy_samples: 50,
        healthy_p99: Some(0.5),
        ..Default::default()
    };
    let p = propose(&plan(), &ev, &Rules::default(), EngineDefaults::default());
    assert!(p.changes.is_empty());
    assert_eq!(p.plan, plan());
    assert_eq!(
        p.too_little_evidence.len(),
        2,
        "{:?}",
        p.too_little_evidence
    );
}

#[test]
fn a_flapping_group_gets_its_own_trigger() {
    let mut g = group("layers.2.down", "dual");
    g.enters = 6;
    g.exits = 6;
    g.float_windows = 30;
    g.float_share = 0.3;
    g.rate_p50 = Some(0.006);
    g.rate_p95 = Some(0.03);
    let p = propose(
        &plan(),
        &evidence(vec![g]),
        &Rules::default(),
        EngineDefaults::default(),
    );
    let m = p.plan.groups["layers.2.down"].monitor.clone().unwrap();
    assert_eq!(m.trigger_rate, Some(0.03));
}

#[test]
fn the_same_evidence_gives_the_same_bytes() {
    let mut g = group("layers.3.down", "int8");
    g.unavailable_windows = 40;
    let ev = evidence(vec![g]);
    let a = propose(&plan(), &ev, &Rules::default(), EngineDefaults::default());
    let b = propose(&plan(), &ev, &Rules::default(), EngineDefaults::default());
    assert_eq!(a.bytes(), b.bytes());
    let back = SensitiveLayers::parse(&a.bytes()).unwrap();
    assert_eq!(back, a.plan);
}

/// Bits and harm bound move together: the group raised to 8 bits drops its calibrated
/// 4-bit bound (an operator's trigger stays), the partner lowered to 4 bits takes its own,
/// and both show in the changes.
#[test]
fn the_harm_bound_follows_the_bits() {
    let with_bound = |class: &str, bound: f64, monitor: serde_json::Value| {
        let mut e = entry(class, if class == "w4a16" { 0.3 } else { 0.01 });
        e["metrics"]["max_nsr_w4a16"] = serde_json::json!(bound);
        e["monitor"] = monitor;
        e
    };
    let plan = plan_with(serde_json::json!({
        "layers.0.down": with_bound("w4a16", 0.004,
            serde_json::json!({"max_nsr": 0.004, "trigger_rate": 0.02})),
        "layers.1.down": with_bound("w8a8", 0.003, serde_json::json!({})),
    }));
    let mut hurt = group("layers.0.down", "int8");
    hurt.unavailable_windows = 40;
    let ev = evidence(vec![hurt, group("layers.1.down", "int8")]);
    let p = propose(&plan, &ev, &Rules::default(), EngineDefaults::default());
    let monitor = |g: &str| p.plan.groups[g].monitor.clone().unwrap_or_default();
    assert_eq!(p.plan.groups["layers.0.down"].class, PrecisionClass::W8a8);
    assert_eq!(
        (
            monitor("layers.0.down").max_nsr,
            monitor("layers.0.down").trigger_rate
        ),
        (None, Some(0.02))
    );
    assert_eq!(p.plan.groups["layers.1.down"].class, PrecisionClass::W4a16);
    assert_eq!(monitor("layers.1.down").max_nsr, Some(0.003));
    let bound_changes: Vec<_> = p
        .changes
        .iter()
        .filter(|c| c.field == "monitor.max_nsr")
        .map(|c| (c.group.clone().unwrap_or_default(), c.to.clone()))
        .collect();
    assert_eq!(
        bound_changes,
        vec![
            ("layers.0.down".to_string(), "(engine default)".to_string()),
            ("layers.1.down".to_string(), fmt(0.003)),
        ],
        "{:?}",
        p.changes
    );
}

/// Weights already on a 4-bit grid (a Q4 checkpoint) cost less in 4 bits than in 8: a 4-bit
/// group there that wanted float gets a float copy (rule 3), never 8 bits, and no partner
/// moves.
#[test]
fn a_four_bit_group_that_eight_bits_would_hurt_more_gets_a_float_copy() {
    let plan = plan_with(serde_json::json!({
        "layers.0.down": entry("w4a16", 0.0001),
        "layers.1.down": entry("w8a8", 0.01),
    }));
    let mut hurt = group("layers.0.down", "int8");
    hurt.unavailable_windows = 40;
    let ev = evidence(vec![hurt, group("layers.1.down", "int8")]);
    let p = propose(&plan, &ev, &Rules::default(), EngineDefaults::default());
    let e = &p.plan.groups["layers.0.down"];
    assert_eq!(
        (e.class, e.residency),
        (PrecisionClass::W4a16, Some(Residency::Dual)),
        "{:?}",
        p.changes
    );
    assert_eq!(p.plan.groups["layers.1.down"].class, PrecisionClass::W8a8);
    assert_eq!(p.changes.len(), 1, "{:?}", p.changes);
    assert!(
        p.changes[0].reason.contains("not 8 bits"),
        "{:?}",
        p.changes[0]
    );
}

/// The trade must pay on the traffic the engines saw: 8 bits win the hurt group less than 4
/// bits cost the only partner at calibration's harm, so it gets a float copy instead; when
/// the engines measured its harm at 50× calibration's (and the partner's at calibration's),
/// the raise wins more than the partner loses and the bits trade.
#[test]
fn bits_trade_only_when_the_raise_pays_for_the_partner_on_the_served_harm() {
    let with_harm = |class: &str, kl4: f64| {
        let mut e = entry(class, kl4);
        e["metrics"]["nsr"] = serde_json::json!({"w8a8": 1e-6, "w4a16": 0.004});
        e
    };
    let plan = plan_with(serde_json::json!({
        "layers.0.down": with_harm("w4a16", 0.001),
        "layers.1.down": with_harm("w8a8", 0.01),
    }));
    let run = |hurt_nsr: f64| {
        let mut hurt = group("layers.0.down", "int8");
        hurt.unavailable_windows = 40;
        hurt.served_nsr = Some(hurt_nsr);
        let mut quiet = group("layers.1.down", "int8");
        quiet.served_nsr = Some(1e-6);
        let ev = evidence(vec![hurt, quiet]);
        propose(&plan, &ev, &Rules::default(), EngineDefaults::default())
    };
    let as_calibrated = run(0.004);
    let e = &as_calibrated.plan.groups["layers.0.down"];
    assert_eq!(
        (e.class, e.residency),
        (PrecisionClass::W4a16, Some(Residency::Dual)),
        "{:?}",
        as_calibrated.changes
    );
    assert!(
        as_calibrated.changes[0].reason.contains("layers.1.down"),
        "{:?}",
        as_calibrated.changes
    );
    let hurt_more = run(0.2);
    let class = |g: &str| hurt_more.plan.groups[g].class;
    assert_eq!(
        (class("layers.0.down"), class("layers.1.down")),
        (PrecisionClass::W8a8, PrecisionClass::W4a16),
        "{:?}",
        hurt_more.changes
    );
}

/// A group the plan already gives a float copy, served without one (the engines' float
/// budget left it out), that wanted float: the change is the evidence its copy is ranked by,
/// not a residency change to what it already is; the same evidence again changes nothing.
#[test]
fn a_planned_copy_the_budget_left_out_gets_its_evidence_not_a_residency_change() {
    let mut e = entry("w8a8", 0.01);
    e["residency"] = serde_json::json!("dual");
    let plan = plan_with(serde_json::json!({"layers.3.down": e}));
    let mut g = group("layers.3.down", "int8");
    g.unavailable_windows = 40;
    let ev = evidence(vec![g]);
    let p = propose(&plan, &ev, &Rules::default(), EngineDefaults::default());
    assert_eq!(p.changes.len(), 1, "{:?}", p.changes);
    assert_eq!(
        (p.changes[0].field.as_str(), p.changes[0].to.as_str()),
        ("observed.wanted_float_share", "0.4000")
    );
    assert_eq!(
        p.plan.groups["layers.3.down"].residency,
        Some(Residency::Dual)
    );
    let again = propose(&p.plan, &ev, &Rules::default(), EngineDefaults::default());
    assert!(again.changes.is_empty(), "{:?}", again.changes);
}
