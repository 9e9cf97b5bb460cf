//! The live precision plan: the engine's own configuration overlaid with the
//! `sensitive_layers.json` in force. One pure function, so start-up and hot reload compute
//! the plan the same way and a reload to the same file is a no-op (idempotent).

use crate::backend::{EmbeddingDtype, Forms, GroupForm, QuantFormat, SplitActivations};
use crate::budget::{self, BudgetOutcome};
use crate::config::EngineConfig;
use crate::monitor::{GroupOverride, MonitorConfig};
use quantmesh_model::ops::member_shapes;
use quantmesh_model::ModelConfig;
use quantmesh_types::{GroupId, GroupKind, Residency, ValidatedPlan};
use std::collections::BTreeMap;

/// What the engine runs with.
#[derive(Debug, Clone, PartialEq)]
pub struct LivePlan {
    /// md5 of the `sensitive_layers.json` in force (`None`: engine configuration only).
    pub md5: Option<String>,
    pub monitor: MonitorConfig,
    pub residency: BTreeMap<GroupId, Residency>,
    /// How each group's quantized form is stored: the class's format (`w4a16` → `q4_s8`),
    /// Q8_0 for every group the file does not class.
    pub quant: BTreeMap<GroupId, QuantFormat>,
    /// The groups whose quantized path smooths its input: the exponents of their factors
    /// (validated against the input width when the file was).
    pub smoothing: BTreeMap<GroupId, std::sync::Arc<[i8]>>,
    /// What `engine.float_budget` did to the residencies (and the tables).
    pub budget: BudgetOutcome,
    /// How the vocabulary tables are stored (`engine.embeddings` resolved; never `auto`).
    pub embeddings: EmbeddingDtype,
    /// The groups that carry 16-bit activations on every row (`engine.wide_activations`;
    /// [`wide_groups`]; under `copyless_q4` also every Q8_0 group, [`served_wide`]); empty
    /// unless the engine serves `copyless` or `copyless_q4`.
    pub wide: std::collections::BTreeSet<GroupId>,
}

impl LivePlan {
    /// What the backend loads with: `base`'s forms, the tables as this plan resolved them.
    pub fn forms(&self, base: &EngineConfig) -> Forms {
        base.forms_with(self.embeddings)
    }

    /// Group `g`'s residency and quantized format (Q8_0 + the engine's default residency
    /// for a group the plan does not list).
    pub fn form(&self, g: GroupId, default: Residency) -> GroupForm {
        GroupForm {
            residency: self.residency.get(&g).copied().unwrap_or(default),
            quant: self.quant.get(&g).copied().unwrap_or_default(),
            smoothing: self.smoothing.get(&g).cloned(),
            wide: self.wide.contains(&g),
        }
    }
}

/// Bytes the vocabulary tables stored as `dtype` take beyond Q8_0 (one table when tied;
/// widths 32 does not divide have no Q8_0 or `q4_s8` form and are f16 already); none for a
/// form smaller than Q8_0.
pub fn table_extra_bytes(cfg: &ModelConfig, dtype: EmbeddingDtype) -> usize {
    let tables = if cfg.tie_word_embeddings { 1 } else { 2 };
    let floor = if cfg.hidden_size.is_multiple_of(32) {
        EmbeddingDtype::Q8_0
    } else {
        EmbeddingDtype::F16
    };
    let bytes = |d: EmbeddingDtype| {
        tables * crate::backend::table_bytes(d, cfg.vocab_size, cfg.hidden_size).unwrap_or(0)
    };
    bytes(dtype).saturating_sub(bytes(floor))
}

/// Parameters of a group's weight (all members).
pub fn group_params(cfg: &ModelConfig, kind: GroupKind) -> usize {
    member_shapes(cfg, kind).iter().map(|s| s[0] * s[1]).sum()
}

/// Overlay `file` on `base`. Precedence, lowest first: `engine.default_residency`,
/// `engine.group_residency`, the file's groups (class → residency, or the explicit
/// `residency`); monitor thresholds: `engine.monitor`, the file's `thresholds`, the file's
/// per-group `monitor` overrides and `massive_channels`. Then `engine.float_budget` decides
/// which float copies stay (`budget.rs`).
pub fn resolve(
    base: &EngineConfig,
    cfg: &ModelConfig,
    file: Option<(&ValidatedPlan, &str)>,
) -> LivePlan {
    let num_layers = cfg.num_hidden_layers;
    let mut residency = BTreeMap::new();
    let mut quant = BTreeMap::new();
    let mut smoothing = BTreeMap::new();
    for l in 0..num_layers {
        for kind in GroupKind::ALL {
            let g = GroupId::new(l, kind);
            let r = base
                .group_residency
                .get(&g.to_string())
                .copied()
                .unwrap_or(base.default_residency);
            residency.insert(g, r);
            quant.insert(g, QuantFormat::Q8_0);
        }
    }
    let mut monitor = base.monitor.clone();
    if let Some((plan, _)) = file {
        let t = &plan.file.thresholds;
        let set = |dst: &mut f64, v: Option<f64>| {
            if let Some(v) = v {
                *dst = v;
            }
        };
        set(&mut monitor.k, t.k);
        set(&mut monitor.trigger_rate, t.trigger_rate);
        set(&mut monitor.min_excess, t.min_excess);
        set(&mut monitor.max_nsr, t.max_nsr);
        set(&mut monitor.token_k, t.token_k);
        set(&mut monitor.shadow_sample_rate, t.shadow_sample_rate);
        set(&mut monitor.request_kl_limit, t.request_kl_limit);
        if let Some(w) = t.window_requests {
            monitor.window_requests = w;
        }
        if let Some(w) = t.recovery_windows {
            monitor.recovery_windows = w;
        }
        for (g, entry) in &plan.groups {
            residency.insert(*g, entry.effective_residency());
            quant.insert(*g, QuantFormat::for_class(entry.class));
            let width = member_shapes(cfg, g.kind)[0][1];
            if let Some(e) = entry
                .smoothing
                .as_ref()
                .and_then(|s| s.exponents(width).ok())
            {
                smoothing.insert(*g, e.into());
            }
            let has_override = entry.monitor.is_some() || !entry.massive_channels.is_empty();
            if has_override {
                let o: &mut GroupOverride = monitor.overrides.entry(g.to_string()).or_default();
                if let Some(m) = &entry.monitor {
                    o.k = m.k.or(o.k);
                    o.trigger_rate = m.trigger_rate.or(o.trigger_rate);
                    o.min_excess = m.min_excess.or(o.min_excess);
                    o.max_nsr = m.max_nsr.or(o.max_nsr);
                }
                o.massive_channels.extend(&entry.massive_channels);
                o.massive_channels.sort_unstable();
                o.massive_channels.dedup();
            }
        }
    }
    let int8_bytes: usize = (0..num_layers)
        .flat_map(|_| GroupKind::ALL)
        .map(|k| QuantFormat::Q8_0.bytes(1, group_params(cfg, k)))
        .sum();
    let float_size = base.float_dtype.bytes();
    let wanted = residency.clone();
    // The plan's budget wins over the engine's, so a reload can change it.
    let setting = file
        .and_then(|(p, _)| p.file.float_budget)
        .unwrap_or(base.float_budget);
    let budget_bytes = setting.bytes(int8_bytes);
    // The plan's tables win over the engine's setting (a weight budget writes them).
    let tables = file
        .and_then(|(p, _)| p.file.tables)
        .unwrap_or(base.embeddings);
    // Where the quantized path runs 8-bit activations, the copies go where W8A8 hurts
    // (`copyless_q4` carries every Q8_0 group at 16 bits: ranked as `all`).
    let eight_bit = matches!(
        base.split_activations,
        SplitActivations::Off | SplitActivations::Copyless
    );
    let (embeddings, table_bytes) =
        budget::tables(tables, budget_bytes, &|d| table_extra_bytes(cfg, d));
    let mut budget = budget::apply(
        &mut residency,
        budget_bytes.map(|b| b.saturating_sub(table_bytes)),
        &|g| group_params(cfg, g.kind) * float_size,
        &|g| {
            budget::rank(
                wanted[&g],
                file.and_then(|(p, _)| p.groups.get(&g)),
                eight_bit,
            )
        },
    );
    // Wide groups change only `copyless`'s and `copyless_q4`'s product: under any other
    // width none are marked, so a plan reload never rebuilds groups for a flag that does
    // nothing.
    let measured = |p: &ValidatedPlan| wide_groups(p.groups.iter(), base.wide_activations);
    let wide = match (file, base.split_activations) {
        (Some((p, _)), SplitActivations::Copyless) => measured(p),
        (file, SplitActivations::CopylessQ4) => {
            let mut wide = served_wide(&quant);
            wide.extend(file.map(|(p, _)| measured(p)).unwrap_or_default());
            wide
        }
        _ => Default::default(),
    };
    budget.setting = setting;
    budget.budget_bytes = budget_bytes;
    budget.table_bytes = table_bytes;
    LivePlan {
        md5: file.map(|(_, md5)| md5.to_string()),
        monitor,
        residency,
        quant,
        smoothing,
        budget,
        embeddings,
        wide,
    }
}

/// The groups `copyless_q4` serves wide whatever their measurements: every group stored
/// in Q8_0 (its 8-bit activations buy no speed where that mode is chosen; only the 4-bit
/// groups run them).
pub fn served_wide(quant: &BTreeMap<GroupId, QuantFormat>) -> std::collections::BTreeSet<GroupId> {
    quant
        .iter()
        .filter(|(_, q)| !q.is_four_bit())
        .map(|(g, _)| *g)
        .collect()
}

/// The groups whose 8-bit activations cost them at least `ratio` times what their 8-bit
/// weights do (`engine.wide_activations`): the served W8A8 output error on the
/// calibration rows (`act8_nsr`, in the form served: smoothed where the entry keeps its
/// factors) against the weights' own (`nsr.w8a8`). Groups without both measurements, and
/// every group when `ratio` is 0, are not.
pub fn wide_groups<'a>(
    entries: impl Iterator<Item = (&'a GroupId, &'a quantmesh_types::GroupEntry)>,
    ratio: f64,
) -> std::collections::BTreeSet<GroupId> {
    if ratio <= 0.0 {
        return Default::default();
    }
    entries
        .filter(|(_, e)| {
            let weights = e
                .metrics
                .as_ref()
                .and_then(|m| m.nsr.as_ref())
                .map(|n| n.w8a8);
            match (e.served_act8_nsr(), weights) {
                (Some(act8), Some(w)) => w > 0.0 && act8 >= ratio * w,
                _ => false,
            }
        })
        .map(|(g, _)| *g)
        .collect()
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::backend::SplitActivations;
    use quantmesh_types::{ModelShape, SensitiveLayers};

    fn model() -> ModelConfig {
        serde_json::from_value(serde_json::json!({
            "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 4, "vocab_size": 100
        }))
        .unwrap()
    }

    fn shape() -> ModelShape {
        ModelShape {
            num_layers: 2,
            hidden_size: 64,
            intermediate_size: 128,
            attn_dim: 64,
            layout_md5: "x".into(),
        }
    }

    #[test]
    fn file_overlays_engine_config() {
        let mut base = EngineConfig::default();
        base.group_residency
            .insert("layers.0.o".into(), Residency::Int8);
        let text = r#"{"schema_version": 1, "thresholds": {"k": 6, "window_requests": 10},
            "groups": {"layers.1.down": {"class": "fp16", "monitor": {"k": 9}},
                       "layers.0.qkv": {"class": "w8a8", "massive_channels": [3, 1]}}}"#;
        let plan = SensitiveLayers::parse_for(text.as_bytes(), &shape()).unwrap();
        let live = resolve(&base, &model(), Some((&plan, "m")));
        assert_eq!(live.md5.as_deref(), Some("m"));
        assert_eq!(live.monitor.k, 6.0);
        assert_eq!(live.monitor.window_requests, 10);
        assert_eq!(live.monitor.trigger_rate, base.monitor.trigger_rate);
        assert_eq!(
            live.residency[&"layers.1.down".parse().unwrap()],
            Residency::Float
        );
        assert_eq!(
            live.residency[&"layers.0.qkv".parse().unwrap()],
            Residency::Int8
        );
        assert_eq!(
            live.residency[&"layers.0.o".parse().unwrap()],
            Residency::Int8
        );
        assert_eq!(
            live.residency[&"layers.1.o".parse().unwrap()],
            Residency::Dual
        );
        assert_eq!(live.monitor.overrides["layers.1.down"].k, Some(9.0));
        assert_eq!(
            live.monitor.overrides["layers.0.qkv"].massive_channels,
            vec![1, 3]
        );
        // Without a file: the engine's configuration alone.
        let none = resolve(&base, &model(), None);
        assert_eq!(none.monitor, base.monitor);
        assert_eq!(none.residency.len(), 8);
        assert!(none.budget.demoted.is_empty(), "unlimited by default");
    }

    /// A budget keeps the float copies with the strongest pre-screen evidence: here room
    /// for one `o`-sized copy (64×64 f16 = 8 KiB) and two dual groups competing for it.
    #[test]
    fn budget_demotes_the_weaker_dual_group() {
        let base = EngineConfig {
            default_residency: Residency::Int8,
            float_budget: "8KiB".parse().unwrap(),
            // Q8_0 tables take nothing from the budget: it is the groups' alone.
            embeddings: EmbeddingDtype::Q8_0,
            ..Default::default()
        };
        let m = |kl: f64| {
            format!(
                r#"{{"class": "w8a8_per_channel", "metrics": {{"r": 5, "energy": 0.1,
                   "kl": {{"w8a8": {kl}, "w8a8_per_channel": {kl}, "w4a16": {kl}}}}}}}"#
            )
        };
        let text = format!(
            r#"{{"schema_version": 1, "groups": {{"layers.0.o": {}, "layers.1.o": {}}}}}"#,
            m(0.001),
            m(0.2)
        );
        let plan = SensitiveLayers::parse_for(text.as_bytes(), &shape()).unwrap();
        let live = resolve(&base, &model(), Some((&plan, "m")));
        let g = |s: &str| s.parse::<GroupId>().unwrap();
        assert_eq!(live.residency[&g("layers.1.o")], Residency::Dual);
        assert_eq!(live.residency[&g("layers.0.o")], Residency::Int8);
        assert_eq!(live.budget.demoted, vec![g("layers.0.o")]);
        assert_eq!(live.budget.float_bytes, 64 * 64 * 2);

        // The plan's own budget wins over the engine's: room for both, then for none.
        for (budget, demoted) in [("16KiB", 0), ("0B", 2)] {
            let with = text.replacen('{', &format!(r#"{{"float_budget": "{budget}", "#), 1);
            let plan = SensitiveLayers::parse_for(with.as_bytes(), &shape()).unwrap();
            let live = resolve(&base, &model(), Some((&plan, "m")));
            assert_eq!(live.budget.demoted.len(), demoted, "{budget}");
            assert_eq!(live.budget.setting, budget.parse().unwrap());
        }
    }

    /// The vocabulary tables are served first: `auto` stores them in f16 exactly when their
    /// bytes beyond Q8_0 fit (then the groups share the rest), a fixed 16-bit form is
    /// charged whether it fits or not, and tables plus copies never exceed the budget
    /// unless a fixed form alone does. Tables here: 2 × 100 × 64 values, f16 = 12 000 bytes
    /// beyond Q8_0 (f32: 37 600); an `o` copy 8 KiB.
    #[test]
    fn tables_are_served_first_from_the_budget() {
        let m = model();
        assert_eq!(table_extra_bytes(&m, EmbeddingDtype::F16), 12_000);
        assert_eq!(table_extra_bytes(&m, EmbeddingDtype::F32), 37_600);
        assert_eq!(table_extra_bytes(&m, EmbeddingDtype::Q8_0), 0);
        let tied = ModelConfig {
            tie_word_embeddings: true,
            ..m.clone()
        };
        assert_eq!(table_extra_bytes(&tied, EmbeddingDtype::F16), 6_000);
        for (setting, budget, tables, copies) in [
            (EmbeddingDtype::Auto, "unlimited", EmbeddingDtype::F16, 8),
            (EmbeddingDtype::Auto, "11KiB", EmbeddingDtype::Q8_0, 1),
            (EmbeddingDtype::Auto, "12000", EmbeddingDtype::F16, 0),
            (EmbeddingDtype::Auto, "21000", EmbeddingDtype::F16, 1),
            (EmbeddingDtype::Q8_0, "21000", EmbeddingDtype::Q8_0, 2),
            (EmbeddingDtype::F16, "11KiB", EmbeddingDtype::F16, 0),
            (EmbeddingDtype::F32, "80000", EmbeddingDtype::F32, 3),
        ] {
            let base = EngineConfig {
                default_residency: Residency::Int8,
                group_residency: ["layers.0.o", "layers.1.o", "layers.0.qkv"]
                    .map(|g| (g.to_string(), Residency::Dual))
                    .into_iter()
                    .collect(),
                embeddings: setting,
                float_budget: budget.parse().unwrap(),
                ..Default::default()
            };
            let base = if budget == "unlimited" {
                EngineConfig {
                    default_residency: Residency::Dual,
                    ..base
                }
            } else {
                base
            };
            let live = resolve(&base, &m, None);
            let case = format!("{setting:?} under {budget}");
            assert_eq!(live.embeddings, tables, "{case}");
            assert_eq!(live.forms(&base).embeddings, tables, "{case}");
            assert_eq!(
                live.budget.table_bytes,
                table_extra_bytes(&m, tables),
                "{case}"
            );
            let kept = live.residency.values().filter(|r| r.has_float()).count();
            assert_eq!(kept, copies, "{case}");
            if let Some(b) = live.budget.budget_bytes {
                let fixed_over = setting != EmbeddingDtype::Auto && live.budget.table_bytes > b;
                assert!(
                    fixed_over || live.budget.table_bytes + live.budget.float_bytes <= b,
                    "{case}: {} + {} > {b}",
                    live.budget.table_bytes,
                    live.budget.float_bytes
                );
            }
        }
    }

    /// Classes choose the quantized form: `w4a16` → `q4_s8`, the rest (and unlisted groups)
    /// Q8_0; an explicit residency keeps the class's form.
    #[test]
    fn w4a16_groups_are_planned_in_four_bits() {
        let text = r#"{"schema_version": 1, "groups": {
            "layers.0.down": {"class": "w4a16"},
            "layers.1.down": {"class": "w4a16", "residency": "dual"},
            "layers.0.o": {"class": "w8a8"}}}"#;
        let plan = SensitiveLayers::parse_for(text.as_bytes(), &shape()).unwrap();
        let live = resolve(&EngineConfig::default(), &model(), Some((&plan, "m")));
        let g = |s: &str| s.parse::<GroupId>().unwrap();
        let form = |s: &str| live.form(g(s), Residency::Dual);
        assert_eq!(form("layers.0.down").quant, QuantFormat::Q4S8);
        assert_eq!(form("layers.0.down").residency, Residency::Int8);
        assert_eq!(
            form("layers.1.down"),
            GroupForm::new(Residency::Dual, QuantFormat::Q4S8)
        );
        assert_eq!(form("layers.0.o").quant, QuantFormat::Q8_0);
        assert_eq!(form("layers.1.qkv").quant, QuantFormat::Q8_0);
    }

    /// A group's smoothing factors reach its form; a group without keeps none.
    #[test]
    fn smoothing_factors_reach_the_group_form() {
        let exps: Vec<i8> = (0..64).map(|i| (i % 5) as i8 - 2).collect();
        let sm = quantmesh_types::Smoothing::new(0.5, &exps);
        let text = format!(
            r#"{{"schema_version": 1, "groups": {{
            "layers.0.o": {{"class": "w8a8", "smoothing": {{"alpha": 0.5, "log2_factors": "{}"}}}}}}}}"#,
            sm.log2_factors
        );
        let plan = SensitiveLayers::parse_for(text.as_bytes(), &shape()).unwrap();
        let live = resolve(&EngineConfig::default(), &model(), Some((&plan, "m")));
        let g = |s: &str| s.parse::<GroupId>().unwrap();
        assert_eq!(
            live.form(g("layers.0.o"), Residency::Int8)
                .smoothing
                .as_deref(),
            Some(&exps[..])
        );
        assert_eq!(live.form(g("layers.1.o"), Residency::Int8).smoothing, None);
    }

    /// Where the engine serves 8-bit activations the copy goes where W8A8 hurts: two dual
    /// groups compete for one copy, one with the larger weight KL, the other with the larger
    /// served W8A8 error (activations included). `all` (16-bit activations) keeps the first,
    /// `copyless` and `off` the second; with factors kept, the smoothed error is the one
    /// served and ranked.
    #[test]
    fn eight_bit_activations_rank_copies_by_the_served_w8a8_error() {
        let m = |kl: f64, plain: f64, smoothed: f64, factors: &str| {
            format!(
                r#"{{"class": "w8a8_per_channel", "metrics": {{"r": 5, "energy": 0.1,
                   "kl": {{"w8a8": {kl}, "w8a8_per_channel": {kl}, "w4a16": {kl}}},
                   "act8_nsr": {{"plain": {plain}, "smoothed": {smoothed}}}}}{factors}}}"#
            )
        };
        let factors = format!(
            r#", "smoothing": {{"alpha": 0.5, "log2_factors": "{}"}}"#,
            quantmesh_types::Smoothing::new(0.5, &[0i8; 64]).log2_factors
        );
        let g = |s: &str| s.parse::<GroupId>().unwrap();
        for (second, kept_under_8_bit) in [
            // The second group's plain error is larger: it keeps the copy in 8-bit modes.
            (m(0.001, 0.3, 0.3, ""), "layers.1.o"),
            // Its factors bring its served error under the first group's.
            (m(0.001, 0.3, 0.01, &factors), "layers.0.o"),
        ] {
            let text = format!(
                r#"{{"schema_version": 1, "groups": {{"layers.0.o": {}, "layers.1.o": {}}}}}"#,
                m(0.2, 0.05, 0.05, ""),
                second
            );
            let plan = SensitiveLayers::parse_for(text.as_bytes(), &shape()).unwrap();
            for (mode, kept) in [
                (SplitActivations::All, "layers.0.o"),
                (SplitActivations::Copyless, kept_under_8_bit),
                (SplitActivations::Off, kept_under_8_bit),
            ] {
                let base = EngineConfig {
                    default_residency: Residency::Int8,
                    float_budget: "8KiB".parse().unwrap(),
                    embeddings: EmbeddingDtype::Q8_0,
                    split_activations: mode,
                    ..Default::default()
                };
                let live = resolve(&base, &model(), Some((&plan, "m")));
                assert_eq!(
                    live.residency[&g(kept)],
                    Residency::Dual,
                    "{mode:?}: {second}"
                );
                assert_eq!(live.budget.demoted.len(), 1, "{mode:?}");
            }
        }
    }

    /// Wide groups are those whose measured W8A8 error (in the form served: smoothed where
    /// the entry keeps factors) is at least `wide_activations` times their 8-bit weights'
    /// own; a group without both measurements never is, and 0 chooses none. They reach the
    /// group forms, under `copyless` only.
    #[test]
    fn wide_groups_are_where_8_bit_activations_cost_more_than_the_weights() {
        let m = |w8: f64, plain: f64, smoothed: f64, factors: &str| {
            format!(
                r#"{{"class": "w8a8", "metrics": {{"r": 5, "energy": 0.1,
                   "kl": {{"w8a8": 0.1, "w8a8_per_channel": 0.1, "w4a16": 0.1}},
                   "nsr": {{"w8a8": {w8}, "w4a16": 0.1}},
                   "act8_nsr": {{"plain": {plain}, "smoothed": {smoothed}}}}}{factors}}}"#
            )
        };
        let factors = format!(
            r#", "smoothing": {{"alpha": 0.5, "log2_factors": "{}"}}"#,
            quantmesh_types::Smoothing::new(0.5, &[0i8; 64]).log2_factors
        );
        let text = format!(
            r#"{{"schema_version": 1, "groups": {{
                "layers.0.o": {}, "layers.0.down": {}, "layers.1.o": {},
                "layers.1.down": {}, "layers.1.qkv": {{"class": "w8a8"}}}}}}"#,
            // 3x: wide at 2.
            m(1e-5, 3e-5, 3e-5, ""),
            // 1.6x: wide at 1.5 only.
            m(2e-5, 3.2e-5, 3.2e-5, ""),
            // 4x unsmoothed, but its kept factors bring it to 1.2x: not wide.
            m(1e-5, 4e-5, 1.2e-5, &factors),
            // 2x exactly: wide at 2 (the bound is inclusive).
            m(1e-5, 2e-5, 2e-5, "")
        );
        let plan = SensitiveLayers::parse_for(text.as_bytes(), &shape()).unwrap();
        let g = |s: &str| s.parse::<GroupId>().unwrap();
        let wide = |ratio: f64| {
            let base = EngineConfig {
                wide_activations: ratio,
                split_activations: SplitActivations::Copyless,
                ..Default::default()
            };
            let live = resolve(&base, &model(), Some((&plan, "m")));
            for (id, _) in plan.groups.iter() {
                assert_eq!(live.form(*id, Residency::Int8).wide, live.wide.contains(id));
            }
            live.wide.iter().map(|g| g.to_string()).collect::<Vec<_>>()
        };
        assert_eq!(wide(2.0), ["layers.0.o", "layers.1.down"]);
        assert_eq!(wide(1.5), ["layers.0.o", "layers.0.down", "layers.1.down"]);
        assert!(wide(0.0).is_empty());
        assert!(wide(10.0).is_empty());
        // No plan, no measurements: no wide group; under any width but `copyless`, none.
        let copyless = EngineConfig {
            split_activations: SplitActivations::Copyless,
            ..Default::default()
        };
        let live = resolve(&copyless, &model(), None);
        assert!(!live.form(g("layers.0.o"), Residency::Int8).wide);
        for mode in [SplitActivations::All, SplitActivations::Off] {
            let base = EngineConfig {
                split_activations: mode,
                ..Default::default()
            };
            assert!(resolve(&base, &model(), Some((&plan, "m"))).wide.is_empty());
        }
    }

    /// Served-traffic evidence outranks the pre-screen's: a group the evolution service
    /// promoted because the monitor kept wanting it in float keeps its copy under a tight
    /// budget even though its offline KL is the smaller one.
    #[test]
    fn observed_evidence_keeps_a_promoted_copy_under_the_budget() {
        let base = EngineConfig {
            default_residency: Residency::Int8,
            float_budget: "8KiB".parse().unwrap(),
            // Q8_0 tables take nothing from the budget: it is the groups' alone.
            embeddings: EmbeddingDtype::Q8_0,
            ..Default::default()
        };
        let m = |kl: f64, observed: &str| {
            format!(
                r#"{{"class": "w8a8_per_channel", "metrics": {{"r": 5, "energy": 0.1,
                   "kl": {{"w8a8": {kl}, "w8a8_per_channel": {kl}, "w4a16": {kl}}}}}{observed}}}"#
            )
        };
        let text = format!(
            r#"{{"schema_version": 1, "groups": {{"layers.0.o": {}, "layers.1.o": {}}}}}"#,
            m(
                0.001,
                r#", "observed": {"windows": 120, "wanted_float_share": 0.35}"#
            ),
            m(0.2, "")
        );
        let plan = SensitiveLayers::parse_for(text.as_bytes(), &shape()).unwrap();
        let live = resolve(&base, &model(), Some((&plan, "m")));
        let g = |s: &str| s.parse::<GroupId>().unwrap();
        assert_eq!(live.residency[&g("layers.0.o")], Residency::Dual);
        assert_eq!(live.residency[&g("layers.1.o")], Residency::Int8);
        assert_eq!(live.budget.demoted, vec![g("layers.1.o")]);
        // A share outside [0, 1] is refused by name.
        let bad = text.replace("0.35", "1.5");
        let err = SensitiveLayers::parse_for(bad.as_bytes(), &shape()).unwrap_err();
        assert!(
            err.to_string().contains("observed.wanted_float_share"),
            "{err}"
        );
    }
}
