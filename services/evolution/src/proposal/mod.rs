//! From a week of evidence to a new `sensitive_layers.json`: deterministic rules, each
//! change with its reason. Same plan + same evidence → byte-identical output (the
//! generator timestamp is the newest window event analysed, not the wall clock), which is
//! what makes the pull request idempotent.
//!
//! The rules (defaults in [`Rules::default`], all configurable under `[evolution.rules]`):
//! 1. **Too little evidence → no change.** A group is considered only with at least
//!    `min_windows` windows and `min_tokens` measured rows in the span; the request limit
//!    only with `min_kl_samples` shadow-KL samples.
//! 2. **`request_kl_limit` = 99th percentile of healthy shadow KL × `kl_margin`**, clamped to
//!    `kl_limit_bounds`, changed only when it moves by more than `kl_min_change` (relative).
//!    Healthy = samples at or below the limit in force. Why: the per-request fallback is
//!    meant for the rare request that the quantized model serves badly; the limit belongs
//!    above the tail of ordinary traffic, so that at most ~1 % of ordinary requests could
//!    reach it even before the margin, and 1.5× keeps a week-to-week drift of the tail from
//!    turning into a fallback storm. The hysteresis stops a weekly PR for noise.
//! 3. **Promote INT8-only → `dual`** when the group wanted float but held no copy in more
//!    than `promote_share` of its windows: the monitor asked for a float path it did not have.
//!    The promoted entry carries `observed` (windows, share wanting float), which the
//!    engines' float budget ranks above pre-screen evidence, so the new copy survives a
//!    tight budget.
//! 4. **Promote `dual` → `float`** when the group ended more than `float_share` of its
//!    windows in float: it is effectively always in float, so the INT8 copy is dead weight.
//! 5. **Demote `dual` → INT8-only** when the group never entered float in the span, its
//!    95th-percentile window outlier rate stayed below half its trigger, and — when the plan
//!    carries the pre-screen's KL of the served INT8 form — that KL is below `demote_kl`.
//!    Frees its float copy for groups that need one.
//! 6. **Calm a flapping group**: `flap_enters` or more entries into float in the span while
//!    its median window rate sits below the trigger → its `trigger_rate` override becomes its
//!    95th-percentile window rate (capped at `max_trigger`), so it falls back on real
//!    excursions and not on its own normal tail.
//! 7. **Move bits where traffic says so.** A 4-bit (`w4a16`) INT8-only group that wanted
//!    float without a copy in more than `promote_share` of its windows is raised to 8 bits
//!    (`w8a8`), and the quiet 8-bit INT8-only group of the same kind (the same shape, so
//!    exactly the same bytes under `engine.weight_budget`) that 4 bits would cost least is
//!    lowered to `w4a16` in the same proposal, when the trade pays on the traffic the
//!    engines saw. Each side's stake is its pre-screen cost in 4 bits less its cost in 8
//!    (the error it adds to the residual stream, as the weight budget's knapsack weighs it;
//!    its own output KL in plans without that measurement) times its served harm over its
//!    calibration rows' mean harm in the width it was served in (the window events'
//!    `mean_nsr` over `metrics.nsr`; 1 without both); the raise must win more than the
//!    partner loses. Quiet: never in float, never wanting it, window outlier rate p95 below
//!    half its trigger. Where 8 bits do not pay, or the pre-screen measured them no better
//!    (weights already on a 4-bit grid), rule 3's float copy is proposed instead and the
//!    reason says why. Without a partner there is no raise (it would grow the plan past the
//!    weight budget that chose its bits): rule 3's float copy, and the reason says so. The
//!    harm bound follows the bits: a group in
//!    4 bits is served with the pre-screen's calibrated 4-bit bound (`metrics.max_nsr_w4a16`
//!    as `monitor.max_nsr`: the harm its calibration rows exceed at the trigger rate), and a
//!    group raised to 8 bits goes back to the engine's bound.

use crate::analysis::{Evidence, GroupEvidence};
use quantmesh_types::sensitive::{GroupEntry, MonitorOverride, ObservedUse};
use quantmesh_types::{PrecisionClass, Residency, SensitiveLayers};
use serde::Serialize;
use std::collections::BTreeMap;

pub use quantmesh_settings::evolution::Rules;

/// The engine's values where the plan says nothing (its `[engine.monitor]` defaults).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct EngineDefaults {
    pub trigger_rate: f64,
    pub request_kl_limit: f64,
}

impl Default for EngineDefaults {
    fn default() -> Self {
        Self {
            trigger_rate: 0.01,
            request_kl_limit: 0.02,
        }
    }
}

/// One change and why.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Change {
    /// The group, or `None` for a global threshold.
    pub group: Option<String>,
    pub field: String,
    pub from: String,
    pub to: String,
    pub reason: String,
}

/// The proposal: the new plan, its changes, and what was left alone for lack of evidence.
#[derive(Debug, Clone, PartialEq)]
pub struct Proposal {
    pub plan: SensitiveLayers,
    pub changes: Vec<Change>,
    pub too_little_evidence: Vec<String>,
}

impl Proposal {
    /// The plan as the bytes committed (pretty JSON, trailing newline).
    pub fn bytes(&self) -> Vec<u8> {
        self.plan.to_bytes().unwrap_or_default()
    }
}

fn class_for(r: Residency) -> PrecisionClass {
    match r {
        Residency::Int8 => PrecisionClass::W8a8,
        Residency::Dual => PrecisionClass::W8a8PerChannel,
        Residency::Float => PrecisionClass::Fp16,
    }
}

/// A group's class after a residency change: its bits stay (a `w4a16` group demoted to INT8
/// only or given a float copy is still 4-bit: its bytes count against the weight budget it
/// was fitted to); a float class takes the new residency's class.
fn class_after(class: PrecisionClass, to: Residency) -> PrecisionClass {
    match (class, to) {
        (
            PrecisionClass::W4a16 | PrecisionClass::W8a8 | PrecisionClass::W8a8PerChannel,
            Residency::Int8 | Residency::Dual,
        ) => class,
        _ => class_for(to),
    }
}

/// A plan entry for a group the plan did not list (it served with the engine's defaults).
fn bare_entry(r: Residency) -> GroupEntry {
    GroupEntry {
        class: class_for(r),
        residency: None,
        rule: None,
        metrics: None,
        activations: None,
        monitor: None,
        massive_channels: Vec::new(),
        observed: None,
        smoothing: None,
    }
}

fn fmt(v: f64) -> String {
    format!("{v:.4}")
}

/// Apply the rules.
pub fn propose(
    current: &SensitiveLayers,
    ev: &Evidence,
    rules: &Rules,
    defaults: EngineDefaults,
) -> Proposal {
    let mut plan = current.clone();
    let mut changes = Vec::new();
    let mut too_little = Vec::new();

    // Rule 2: the request limit.
    let limit = current
        .thresholds
        .request_kl_limit
        .unwrap_or(defaults.request_kl_limit);
    if ev.kl.healthy_samples >= rules.min_kl_samples {
        if let Some(p99) = ev.kl.healthy_p99 {
            let (lo, hi) = rules.kl_limit_bounds;
            let new = (p99 * rules.kl_margin).clamp(lo, hi);
            let new = (new * 1e6).round() / 1e6;
            if ((new - limit) / limit).abs() > rules.kl_min_change {
                plan.thresholds.request_kl_limit = Some(new);
                changes.push(Change {
                    group: None,
                    field: "thresholds.request_kl_limit".into(),
                    from: fmt(limit),
                    to: fmt(new),
                    reason: format!(
                        "healthy shadow KL p99 {} over {} samples × margin {}",
                        fmt(p99),
                        ev.kl.healthy_samples,
                        rules.kl_margin
                    ),
                });
            }
        }
    } else {
        too_little.push(format!(
            "request_kl_limit: {} healthy shadow-KL samples < {}",
            ev.kl.healthy_samples, rules.min_kl_samples
        ));
    }

    let global_trigger = current
        .thresholds
        .trigger_rate
        .unwrap_or(defaults.trigger_rate);
    let trigger_of = |name: &str| {
        current
            .groups
            .get(name)
            .and_then(|e| e.monitor.as_ref())
            .and_then(|m| m.trigger_rate)
            .unwrap_or(global_trigger)
    };
    // Rule 7's partners: quiet 8-bit INT8-only groups with what 4 bits would cost them on
    // this traffic, by kind, the cheapest first.
    let mut partners: BTreeMap<String, Vec<(f64, String)>> = BTreeMap::new();
    for g in &ev.groups {
        let Some(e) = current.groups.get(&g.group) else {
            continue;
        };
        let eight = matches!(
            e.class,
            PrecisionClass::W8a8 | PrecisionClass::W8a8PerChannel
        );
        let quiet = g.windows >= rules.min_windows
            && g.tokens >= rules.min_tokens
            && g.enters == 0
            && g.float_windows == 0
            && g.unavailable_windows == 0
            && g.rate_p95.is_some_and(|r| r < trigger_of(&g.group) / 2.0);
        if let (true, true, Residency::Int8, Some(stake)) =
            (eight, quiet, e.effective_residency(), bits_stake(g, e))
        {
            partners
                .entry(group_kind(&g.group).to_string())
                .or_default()
                .push((stake, g.group.clone()));
        }
    }
    for p in partners.values_mut() {
        p.sort_by(|a, b| b.0.total_cmp(&a.0).then_with(|| b.1.cmp(&a.1)));
    }
    for g in &ev.groups {
        if g.windows < rules.min_windows || g.tokens < rules.min_tokens {
            too_little.push(format!(
                "{}: {} windows / {} rows < {} / {}",
                g.group, g.windows, g.tokens, rules.min_windows, rules.min_tokens
            ));
            continue;
        }
        let entry = plan.groups.get(&g.group).cloned();
        let trigger = entry
            .as_ref()
            .and_then(|e| e.monitor.as_ref())
            .and_then(|m| m.trigger_rate)
            .unwrap_or(global_trigger);
        let served = match g.residency.as_str() {
            "int8" => Residency::Int8,
            "float" => Residency::Float,
            _ => Residency::Dual,
        };
        let unavailable_share = g.unavailable_windows as f64 / g.windows.max(1) as f64;
        // Rule 7: 4 → 8 bits first, a quiet 8-bit group of the same shape 8 → 4, when 8
        // bits pay: they win something for this group (not on weights already on a 4-bit
        // grid, a Q4 checkpoint, where the pre-screen measures 8 bits as the worse form), and
        // more than 4 bits cost the cheapest partner, both scaled by the harm the engines
        // measured over what calibration predicted. Otherwise rule 3's float copy is the fix.
        let four = entry
            .as_ref()
            .is_some_and(|e| e.class == PrecisionClass::W4a16);
        let gain = entry
            .as_ref()
            .and_then(|e| bits_stake(g, e))
            .unwrap_or(f64::INFINITY);
        let not_eight = if !four {
            None
        } else if gain <= 0.0 {
            Some(
                "; not 8 bits: the pre-screen measured them no better than 4 for this group"
                    .to_string(),
            )
        } else {
            match partners.get(group_kind(&g.group)).and_then(|p| p.last()) {
                // The plan's bytes are the weight budget's choice: a raise alone would grow
                // it past the budget.
                None => Some(format!(
                    "; not 8 bits: no quiet 8-bit {} group to trade for the same bytes, and a \
                     raise alone would grow the plan past its weight budget",
                    group_kind(&g.group)
                )),
                Some((loss, p)) if *loss >= gain => Some(format!(
                    "; not 8 bits: they win {gain:.2e} on this traffic, less than 4 bits \
                     would cost the cheapest quiet 8-bit {} group, {p} ({loss:.2e})",
                    group_kind(&g.group)
                )),
                Some(_) => None,
            }
        };
        if served == Residency::Int8
            && four
            && unavailable_share > rules.promote_share
            && not_eight.is_none()
        {
            // `not_eight` is None only with a partner at hand: the raise never grows the plan.
            let Some((kl4, p)) = partners.get_mut(group_kind(&g.group)).and_then(Vec::pop) else {
                continue;
            };
            let why = format!(
                "wanted float in {:.0} % of {} windows without a float copy (> {:.0} %): 8 bits \
                 before a float copy",
                unavailable_share * 100.0,
                g.windows,
                rules.promote_share * 100.0
            );
            set_class(
                &mut plan,
                &mut changes,
                &g.group,
                PrecisionClass::W8a8,
                format!("{why}; {p} goes to 4 bits for the same bytes"),
            );
            let reason = format!(
                "quiet in 8 bits (never in float, window outlier rate p95 below half its \
                 trigger), the cheapest of its kind in 4 bits on this traffic ({kl4:.2e} < \
                 the raise's {gain:.2e}): 4 bits for {}'s raise, the same bytes",
                g.group
            );
            set_class(&mut plan, &mut changes, &p, PrecisionClass::W4a16, reason);
            continue;
        }
        let target = if served == Residency::Int8 && unavailable_share > rules.promote_share {
            Some((
                Residency::Dual,
                format!(
                    "wanted float in {:.0} % of {} windows without a float copy (> {:.0} %){}",
                    unavailable_share * 100.0,
                    g.windows,
                    rules.promote_share * 100.0,
                    not_eight.unwrap_or_default()
                ),
            ))
        } else if served == Residency::Dual && g.float_share > rules.float_share {
            Some((
                Residency::Float,
                format!(
                    "in float at the end of {:.0} % of {} windows (> {:.0} %)",
                    g.float_share * 100.0,
                    g.windows,
                    rules.float_share * 100.0
                ),
            ))
        } else if served == Residency::Dual && demotable(g, entry.as_ref(), trigger, rules) {
            Some((
                Residency::Int8,
                format!(
                    "never in float over {} windows; window outlier rate p95 {} < trigger/2 {}{}",
                    g.windows,
                    fmt(g.rate_p95.unwrap_or(0.0)),
                    fmt(trigger / 2.0),
                    entry
                        .as_ref()
                        .and_then(|e| e.metrics.as_ref())
                        .map(|m| format!(
                            "; pre-screen KL {:.2e} < {:.0e}",
                            int8_kl(e_class(entry.as_ref()), m),
                            rules.demote_kl
                        ))
                        .unwrap_or_default()
                ),
            ))
        } else {
            None
        };
        if let Some((to, reason)) = target {
            let from = entry
                .as_ref()
                .map(|e| e.effective_residency())
                .unwrap_or(served);
            let share = (g.float_share.max(unavailable_share) * 1e4).round() / 1e4;
            let before = entry
                .as_ref()
                .and_then(|e| e.observed.as_ref())
                .map(|o| o.wanted_float_share);
            if from == to && (to == Residency::Int8 || before == Some(share)) {
                continue; // nothing to change: the plan says this already
            }
            let e = plan
                .groups
                .entry(g.group.clone())
                .or_insert_with(|| bare_entry(to));
            e.class = class_after(e.class, to);
            e.residency = Some(to);
            e.rule = Some(format!("evolve: {reason}"));
            // The evidence goes with the promotion, so the engines' float budget ranks this
            // copy by what the monitor saw, not only by the pre-screen's KL.
            e.observed = (to != Residency::Int8).then_some(ObservedUse {
                windows: g.windows,
                wanted_float_share: share,
            });
            // A group the plan already gives a float copy that the engines' float budget
            // left out: the change is the evidence its copy is ranked by.
            let change = if from == to {
                Change {
                    group: Some(g.group.clone()),
                    field: "observed.wanted_float_share".into(),
                    from: before.map_or_else(|| "-".into(), fmt),
                    to: fmt(share),
                    reason: format!(
                        "{reason}; already planned {}",
                        quantmesh_types::wire_name(&to)
                    ),
                }
            } else {
                Change {
                    group: Some(g.group.clone()),
                    field: "residency".into(),
                    from: quantmesh_types::wire_name(&from),
                    to: quantmesh_types::wire_name(&to),
                    reason,
                }
            };
            changes.push(change);
            continue;
        }
        // Rule 6: a flapping group.
        if g.enters >= rules.flap_enters {
            if let (Some(p50), Some(p95)) = (g.rate_p50, g.rate_p95) {
                let new = (p95.min(rules.max_trigger) * 1e4).round() / 1e4;
                if p50 < trigger && new > trigger {
                    let e = plan
                        .groups
                        .entry(g.group.clone())
                        .or_insert_with(|| bare_entry(served));
                    let m = e.monitor.get_or_insert_with(MonitorOverride::default);
                    m.trigger_rate = Some(new);
                    changes.push(Change {
                        group: Some(g.group.clone()),
                        field: "monitor.trigger_rate".into(),
                        from: fmt(trigger),
                        to: fmt(new),
                        reason: format!(
                            "{} entries into float; window rate p50 {} below the trigger, p95 {}",
                            g.enters,
                            fmt(p50),
                            fmt(p95)
                        ),
                    });
                }
            }
        }
    }
    if !changes.is_empty() {
        let mut rules_used = BTreeMap::new();
        rules_used.insert("min_windows".to_string(), rules.min_windows as f64);
        rules_used.insert("min_tokens".to_string(), rules.min_tokens as f64);
        rules_used.insert("min_kl_samples".to_string(), rules.min_kl_samples as f64);
        rules_used.insert("kl_margin".to_string(), rules.kl_margin);
        rules_used.insert("promote_share".to_string(), rules.promote_share);
        rules_used.insert("float_share".to_string(), rules.float_share);
        rules_used.insert("demote_kl".to_string(), rules.demote_kl);
        rules_used.insert("flap_enters".to_string(), rules.flap_enters as f64);
        plan.generator = Some(quantmesh_types::sensitive::Generator {
            tool: "quantmesh-evolve".into(),
            version: env!("CARGO_PKG_VERSION").into(),
            timestamp: chrono::DateTime::<chrono::Utc>::from_timestamp_millis(
                ev.last_window_ms.unwrap_or(ev.until_ms),
            )
            .unwrap_or_default()
            .to_rfc3339_opts(chrono::SecondsFormat::Secs, true),
            calibration: current
                .generator
                .as_ref()
                .and_then(|g| g.calibration.clone()),
            rules: Some(rules_used),
        });
    }
    Proposal {
        plan,
        changes,
        too_little_evidence: too_little,
    }
}

/// `layers.3.down` → `down`: groups of one kind have one shape in every layer.
fn group_kind(name: &str) -> &str {
    name.rsplit('.').next().unwrap_or(name)
}

/// How much harder the span's traffic was on the group than its calibration rows: the harm
/// the engines measured (`served_nsr`) over the calibration rows' mean harm in the width it
/// was served in (`metrics.nsr`); `None` without both.
fn traffic_scale(g: &GroupEvidence, e: &GroupEntry) -> Option<f64> {
    let calibrated = e
        .metrics
        .as_ref()
        .and_then(|m| m.nsr.as_ref())
        .map(|n| match e.class {
            PrecisionClass::W4a16 => n.w4a16,
            _ => n.w8a8,
        });
    match (g.served_nsr, calibrated) {
        (Some(s), Some(c)) if c > 0.0 && s.is_finite() && s >= 0.0 => Some(s / c),
        _ => None,
    }
}

/// What 8 bits win over 4 for the group on this traffic, in the weight budget knapsack's
/// units: the pre-screen's cost in 4 bits less its cost in 8, times [`traffic_scale`] (1
/// where it is unknown). `None` without the pre-screen's metrics.
fn bits_stake(g: &GroupEvidence, e: &GroupEntry) -> Option<f64> {
    let (four, eight) = e.metrics.as_ref()?.bits_cost();
    Some((four - eight) * traffic_scale(g, e).unwrap_or(1.0))
}

/// Rule 7's change of a listed group's class (bits), recorded with its reason.
fn set_class(
    plan: &mut SensitiveLayers,
    changes: &mut Vec<Change>,
    group: &str,
    to: PrecisionClass,
    reason: String,
) {
    let Some(e) = plan.groups.get_mut(group) else {
        return;
    };
    let from = e.class;
    let bound = |e: &GroupEntry| e.monitor.as_ref().and_then(|m| m.max_nsr);
    let bound_before = bound(e);
    e.class = to;
    e.rule = Some(format!("evolve: {reason}"));
    e.fit_harm_bound_to_class();
    let bound_after = bound(e);
    changes.push(Change {
        group: Some(group.to_string()),
        field: "class".into(),
        from: quantmesh_types::wire_name(&from),
        to: quantmesh_types::wire_name(&to),
        reason,
    });
    if bound_before != bound_after {
        let show = |b: Option<f64>| b.map_or_else(|| "(engine default)".to_string(), fmt);
        changes.push(Change {
            group: Some(group.to_string()),
            field: "monitor.max_nsr".into(),
            from: show(bound_before),
            to: show(bound_after),
            reason: format!(
                "the harm bound of its bits in {}: the pre-screen's calibrated 4-bit bound in \
                 4 bits, the engine's default otherwise",
                quantmesh_types::wire_name(&to)
            ),
        });
    }
}

fn e_class(e: Option<&GroupEntry>) -> PrecisionClass {
    e.map(|e| e.class).unwrap_or(PrecisionClass::W8a8PerChannel)
}

/// The pre-screen's KL of the INT8 form the group would be served with.
fn int8_kl(class: PrecisionClass, m: &quantmesh_types::sensitive::GroupMetrics) -> f64 {
    match class {
        PrecisionClass::W8a8 => m.kl.w8a8,
        _ => m.kl.w8a8_per_channel,
    }
}

fn demotable(g: &GroupEvidence, entry: Option<&GroupEntry>, trigger: f64, rules: &Rules) -> bool {
    let quiet =
        g.enters == 0 && g.float_windows == 0 && g.rate_p95.is_some_and(|r| r < trigger / 2.0);
    let kl_ok = entry
        .and_then(|e| e.metrics.as_ref())
        .is_none_or(|m| int8_kl(e_class(entry), m) < rules.demote_kl);
    quiet && kl_ok
}

/// The changes as a Markdown table (the dry run prints it; the PR body carries it).
pub fn changes_table(p: &Proposal) -> String {
    let mut s = String::from("| group | field | from | to | reason |\n|---|---|---|---|---|\n");
    for c in &p.changes {
        s.push_str(&format!(
            "| {} | {} | {} | {} | {} |\n",
            c.group.as_deref().unwrap_or("(global)"),
            c.field,
            c.from,
            c.to,
            c.reason
        ));
    }
    if p.changes.is_empty() {
        s.push_str("| — | — | — | — | no change: the evidence supports the plan in force |\n");
    }
    s
}

/// The evidence per group as a Markdown table.
pub fn evidence_table(ev: &Evidence, plan: &SensitiveLayers) -> String {
    let mut s = String::from(
        "| group | class | served as | windows | rows | outlier rate p50 / p95 / max | windows in float | wanted, unavailable | enters / exits | token decisions | harm served (× calibration) |\n|---|---|---|---|---|---|---|---|---|---|---|\n",
    );
    let r = |v: Option<f64>| v.map(|x| format!("{x:.4}")).unwrap_or_else(|| "-".into());
    for g in &ev.groups {
        let entry = plan.groups.get(&g.group);
        let class = entry
            .map(|e| quantmesh_types::wire_name(&e.class))
            .unwrap_or_else(|| "-".into());
        let harm = match (g.served_nsr, entry.and_then(|e| traffic_scale(g, e))) {
            (Some(h), Some(scale)) => format!("{h:.2e} (× {scale:.2})"),
            (Some(h), None) => format!("{h:.2e}"),
            _ => "-".into(),
        };
        s.push_str(&format!(
            "| {} | {} | {} | {} | {} | {} / {} / {} | {} ({:.0} %) | {} | {} / {} | {} | {} |\n",
            g.group,
            class,
            g.residency,
            g.windows,
            g.tokens,
            r(g.rate_p50),
            r(g.rate_p95),
            r(g.rate_max),
            g.float_windows,
            g.float_share * 100.0,
            g.unavailable_windows,
            g.enters,
            g.exits,
            g.token_decisions,
            harm
        ));
    }
    s.push_str(&format!(
        "\nShadow KL (nats): {} samples, p50 {} / p90 {} / p99 {} / max {}; healthy p99 {} ({} samples); {} with a partial float reference; {} requests put in float by shadow KL. {} windows, {} fallback events, configs applied {} / rejected {}.\n",
        ev.kl.samples,
        r(ev.kl.p50),
        r(ev.kl.p90),
        r(ev.kl.p99),
        r(ev.kl.max),
        r(ev.kl.healthy_p99),
        ev.kl.healthy_samples,
        ev.kl.partial_reference,
        ev.request_kl_fallbacks,
        ev.windows,
        ev.fallback_events,
        ev.configs_applied,
        ev.configs_rejected
    ));
    s
}

#[cfg(test)]
mod tests;
