//! The monitor on a real checkpoint: its report, the oracle at the same float bytes, and
//! each group's measured harm against the rankings that predict it.

use crate::serve::{observe, EvalOptions, Observed};
use crate::teacher::*;
use quantmesh_engine::backend::cpu::LlamaModel;
use quantmesh_engine::backend::{Backend, RowPath};
use quantmesh_engine::error::{EngineError, Result};
use quantmesh_engine::precision::PathMask;
use quantmesh_types::{GroupId, GroupKind};
use std::collections::BTreeSet;
use std::path::Path;

/// The monitor on a real checkpoint (no planted truth): serve `dir` with ordinary chat
/// traffic and report, as markdown, every group's statistic and outlier rate, the massive
/// channels learned, the groups that fell back, and the teacher-forced KL to the float model
/// of INT8-only and of the monitor's final float set; with `oracle`, also the oracle at the
/// same float parameters ([`oracle_at_same_bytes`]).
pub async fn real_model_report(dir: &Path, opts: &EvalOptions, oracle: bool) -> Result<String> {
    let observed = observe(dir, "real", opts, true).await?;
    let final_float = observed.final_float();
    let Observed { report, fell_back } = observed;
    // One load of the model serves the KL and, when asked, the oracle.
    let (kls, oracle_text) = {
        let dir = dir.to_path_buf();
        let chosen = final_float.clone();
        let (class, split) = (opts.class, opts.split);
        tokio::task::spawn_blocking(move || -> Result<(Vec<f64>, Option<String>)> {
            let r = Reference::load_class(&dir, class, split)?;
            let kls = r.mean_kl(
                &r.texts,
                &[
                    PathMask::default(),
                    PathMask::with_float_groups(chosen.iter().copied()),
                ],
            )?;
            let o = if oracle {
                Some(oracle_at_same_bytes(&r, &chosen)?)
            } else {
                None
            };
            Ok((kls, o))
        })
        .await
        .map_err(|e| EngineError::Config(format!("KL task: {e}")))??
    };
    let mut s = format!(
        "{} requests of ordinary chat traffic, window {} requests, {} windows.\n\n",
        opts.requests, opts.monitor.window_requests, report.windows_completed
    );
    let mut groups: Vec<_> = report.groups.iter().collect();
    groups.sort_by(|a, b| {
        b.last_window_rate
            .unwrap_or(0.0)
            .total_cmp(&a.last_window_rate.unwrap_or(0.0))
            .then(a.group.cmp(&b.group))
    });
    let rates: Vec<f64> = groups.iter().filter_map(|g| g.last_window_rate).collect();
    let nonzero = rates.iter().filter(|r| **r > 0.0).count();
    s += &format!(
        "Outlier rate in the last window: {} of {} groups above 0, max {:.4}; groups that fell back at any window: {}.\n\n",
        nonzero,
        groups.len(),
        rates.iter().cloned().fold(0.0, f64::max),
        if fell_back.is_empty() {
            "none".to_string()
        } else {
            fell_back.iter().cloned().collect::<Vec<_>>().join(", ")
        }
    );
    s += "| group | mode | mean | σ | σ/mean | bound | last rate | last NSR | learned massive channels |\n|---|---|---|---|---|---|---|---|---|\n";
    for g in groups.iter().take(16) {
        s += &format!(
            "| {} | {:?} | {:.3} | {:.4} | {:.3} | {} | {} | {} | {:?} |\n",
            g.group,
            g.mode,
            g.mean,
            g.sigma,
            g.sigma / g.mean.max(1e-9),
            g.outlier_bound.map_or("—".into(), |b| format!("{b:.3}")),
            g.last_window_rate.map_or("—".into(), |r| format!("{r:.4}")),
            g.last_window_nsr.map_or("—".into(), |r| format!("{r:.2e}")),
            g.excluded_channels
        );
    }
    // The harm statistic by kind: where the quantized weights hurt the traffic.
    let mut nsr_by_kind = std::collections::BTreeMap::<String, Vec<f64>>::new();
    for g in &report.groups {
        if let Some(n) = g.last_window_nsr {
            let kind = g.group.rsplit('.').next().unwrap_or("").to_string();
            nsr_by_kind.entry(kind).or_default().push(n);
        }
    }
    if !nsr_by_kind.is_empty() {
        s += &format!(
            "\nHarm (mean output noise-to-signal ratio in the last window, bound {:.2e}) by kind, min / median / max: {}.\n",
            opts.monitor.max_nsr,
            nsr_by_kind
                .iter_mut()
                .map(|(k, v)| {
                    v.sort_by(|a, b| a.total_cmp(b));
                    format!(
                        "{k} {:.1e} / {:.1e} / {:.1e}",
                        v[0],
                        v[v.len() / 2],
                        v[v.len() - 1]
                    )
                })
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
    let cv: Vec<f64> = report
        .groups
        .iter()
        .filter(|g| g.ready)
        .map(|g| g.sigma / g.mean.max(1e-9))
        .collect();
    let mut by_kind = std::collections::BTreeMap::<String, (f64, usize)>::new();
    for (g, c) in report.groups.iter().filter(|g| g.ready).zip(&cv) {
        let kind = g.group.rsplit('.').next().unwrap_or("").to_string();
        let e = by_kind.entry(kind).or_default();
        e.0 += c;
        e.1 += 1;
    }
    s += &format!(
        "\n(top 16 of {} groups by last rate). Mean σ/mean by kind: {}.\n\n",
        report.groups.len(),
        by_kind
            .iter()
            .map(|(k, (sum, n))| format!("{k} {:.3}", sum / *n as f64))
            .collect::<Vec<_>>()
            .join(", ")
    );
    s += &format!(
        "Teacher-forced mean KL to the float model over the held-out text: INT8 only {:.5}; with the monitor's final float set ({} groups) {:.5}.\n",
        kls[0],
        final_float.len(),
        kls[1]
    );
    if let Some(o) = oracle_text {
        s += &o;
    }
    Ok(s)
}

/// The oracle the monitor is measured against: every group's own KL contribution (KL of
/// the quantized model minus KL with that group alone in float, over the held-out texts),
/// then groups put in float in that order until they hold as many float parameters as the
/// monitor's `chosen` set; report both sets' KL and the share of the oracle's KL reduction
/// the monitor reached. Then the same comparison for rankings by the groups' measured harm
/// ([`harm_by_group`]) at a few float shares: how well a statistic the monitor can compute
/// online orders the groups.
pub fn oracle_at_same_bytes(r: &Reference, chosen: &BTreeSet<GroupId>) -> Result<String> {
    let cfg = &r.cfg;
    let texts = &r.texts;
    let groups: Vec<GroupId> = (0..cfg.num_hidden_layers)
        .flat_map(|l| GroupKind::ALL.map(|k| GroupId::new(l, k)))
        .collect();
    let mut masks = vec![PathMask::default()];
    masks.extend(groups.iter().map(|g| PathMask::with_float_groups([*g])));
    eprintln!(
        "oracle: every group's own KL gain ({} masks over {} texts)",
        masks.len(),
        texts.len()
    );
    let (kl, n) = r.mean_kl_n(texts, &masks)?;
    let kl_quantized = kl[0];
    let mut gain: Vec<(GroupId, f64)> = groups
        .iter()
        .zip(&kl[1..])
        .map(|(g, k)| (*g, kl_quantized - k))
        .collect();
    gain.sort_by(|a, b| b.1.total_cmp(&a.1));
    let params = |g: &GroupId| quantmesh_engine::plan::group_params(cfg, g.kind);
    let total: usize = groups.iter().map(params).sum();
    // Groups in `order` until `budget` parameters are used (a group that would overflow is
    // skipped, a smaller one after it may still fit).
    let take = |order: &[GroupId], budget: usize| {
        let mut set = BTreeSet::new();
        let mut used = 0;
        for g in order {
            if used + params(g) <= budget {
                used += params(g);
                set.insert(*g);
            }
        }
        (set, used)
    };
    let oracle_order: Vec<GroupId> = gain.iter().map(|(g, _)| *g).collect();
    let budget: usize = chosen.iter().map(params).sum();
    let (oracle, _) = take(&oracle_order, budget);
    let final_sets = teacher_forced_on(
        &r.model,
        cfg,
        texts,
        &[
            PathMask::default(),
            PathMask::with_float_groups(chosen.iter().copied()),
            PathMask::with_float_groups(oracle.iter().copied()),
        ],
    )?;
    let kl: Vec<f64> = final_sets.kl_sums[1..]
        .iter()
        .map(|s| s / final_sets.positions.max(1) as f64)
        .collect();
    let reach = |got: f64, best: f64| {
        if kl_quantized - best > 0.0 {
            (kl_quantized - got) / (kl_quantized - best)
        } else {
            f64::NAN
        }
    };
    let top: Vec<String> = gain
        .iter()
        .take(8)
        .map(|(g, d)| format!("{g} {d:.5}"))
        .collect();
    let mut out = format!(
        "\nOracle at the same float parameters ({:.1} % of the linear weights; {} texts, {n} positions): quantized only {:.5}, monitor's set ({} groups) {:.5}, oracle's set ({} groups) {:.5}: the monitor reaches {:.0} % of the oracle's KL reduction. Largest single-group KL reductions: {}.\n",
        100.0 * budget as f64 / total.max(1) as f64,
        texts.len(),
        kl_quantized,
        chosen.len(),
        kl[0],
        oracle.len(),
        kl[1],
        100.0 * reach(kl[0], kl[1]),
        top.join(", ")
    );
    out += &format!(
        "Perplexity of the actual next tokens ({} positions): float {:.3}, quantized only {:.3}, monitor's set {:.3}, oracle's set {:.3}.\n",
        final_sets.nll_positions,
        final_sets.perplexity(0),
        final_sets.perplexity(1),
        final_sets.perplexity(2),
        final_sets.perplexity(3)
    );
    // Rankings by harm statistics against the oracle at fixed float shares.
    eprintln!("oracle: harm rankings at {HARM_SHARES:?} of the linear parameters");
    let harm = harm_by_group(r, texts)?;
    let rank = |key: &dyn Fn(&GroupHarm) -> f64| {
        let mut v: Vec<(GroupId, f64)> = harm.iter().map(|(g, h)| (*g, key(h))).collect();
        v.sort_by(|a, b| b.1.total_cmp(&a.1));
        v.into_iter().map(|(g, _)| g).collect::<Vec<_>>()
    };
    let rankings: Vec<(&str, Vec<GroupId>)> = vec![
        ("traffic NSR", rank(&|h| h.nsr_of_power)),
        ("mean row NSR", rank(&|h| h.mean_row_nsr)),
        ("output error power", rank(&|h| h.error_power)),
        ("weight NSR", rank(&|h| h.weight_nsr)),
        (
            "traffic NSR without massive channels",
            rank(&|h| h.nsr_without_massive),
        ),
    ];
    if std::env::var_os("QUANTMESH_EVAL_VERBOSE").is_some() {
        out += "\n| group | single-group KL gain | traffic NSR | mean row NSR | without massive | weight NSR |\n|---|---|---|---|---|---|\n";
        for (g, d) in &gain {
            if let Some(h) = harm.get(g) {
                out += &format!(
                    "| {g} | {d:.5} | {:.2e} | {:.2e} | {:.2e} | {:.2e} |\n",
                    h.nsr_of_power, h.mean_row_nsr, h.nsr_without_massive, h.weight_nsr
                );
            }
        }
    }
    out += &format!(
        "\nRankings against the oracle (Spearman ρ with the single-group gains; reach = share of the oracle's KL reduction at the same float parameters):\n\n| ranking | ρ | {} |\n|---|---|{}\n",
        HARM_SHARES
            .iter()
            .map(|f| format!("reach at {:.0} %", 100.0 * f))
            .collect::<Vec<_>>()
            .join(" | "),
        "---|".repeat(HARM_SHARES.len())
    );
    for (name, order) in &rankings {
        let rho = spearman(&oracle_order, order);
        let mut cells = Vec::new();
        for f in HARM_SHARES {
            let (set, used) = take(order, (f * total as f64) as usize);
            let (best, _) = take(&oracle_order, used);
            let kl = r.mean_kl(
                texts,
                &[
                    PathMask::with_float_groups(set.iter().copied()),
                    PathMask::with_float_groups(best.iter().copied()),
                ],
            )?;
            cells.push(format!(
                "{:.0} % ({:.5} vs {:.5})",
                100.0 * reach(kl[0], kl[1]),
                kl[0],
                kl[1]
            ));
        }
        out += &format!("| {name} | {rho:.2} | {} |\n", cells.join(" | "));
    }
    Ok(out)
}

/// Float shares of the linear parameters the harm rankings are scored at.
const HARM_SHARES: [f64; 4] = [0.05, 0.1, 0.2, 0.4];

/// Spearman's rank correlation of two orderings of the same groups.
fn spearman(a: &[GroupId], b: &[GroupId]) -> f64 {
    let pos: std::collections::BTreeMap<GroupId, usize> =
        b.iter().enumerate().map(|(i, g)| (*g, i)).collect();
    let n = a.len() as f64;
    let d2: f64 = a
        .iter()
        .enumerate()
        .filter_map(|(i, g)| pos.get(g).map(|j| (i as f64 - *j as f64).powi(2)))
        .sum();
    1.0 - 6.0 * d2 / (n * (n * n - 1.0)).max(1.0)
}

/// One group's measured harm on traffic: what its quantized weights do to the inputs it
/// actually sees ([`quantmesh_engine::backend::ColumnError`]).
#[derive(Debug, Clone, Copy, Default)]
pub struct GroupHarm {
    /// Output noise-to-signal ratio for the traffic's mean input power per channel.
    pub nsr_of_power: f64,
    /// Mean over rows of each row's output noise-to-signal ratio.
    pub mean_row_nsr: f64,
    /// Expected squared output error per row, `Σ_j E[x_j²]·error_j`.
    pub error_power: f64,
    /// The weights alone: `Σ error_j / Σ energy_j` (every channel equally loud).
    pub weight_nsr: f64,
    /// [`GroupHarm::nsr_of_power`] without the channels whose mean power is over 36× the
    /// median channel's (6× in magnitude: the massive, input-invariant channels).
    pub nsr_without_massive: f64,
}

/// Every quantized group's [`GroupHarm`] on `texts` (teacher-forced, all groups on their
/// quantized path, position 0 left out as the monitor does).
pub fn harm_by_group(
    r: &Reference,
    texts: &[Vec<u32>],
) -> Result<std::collections::BTreeMap<GroupId, GroupHarm>> {
    #[derive(Default)]
    struct Acc {
        power: Vec<f64>,
        nsr_sum: f64,
        rows: usize,
    }
    struct PowerProbe<'a> {
        model: &'a LlamaModel,
        rows: Vec<(u64, usize)>,
        acc: std::collections::BTreeMap<GroupId, Acc>,
    }
    impl quantmesh_engine::backend::Router for PowerProbe<'_> {
        fn route(&mut self, g: GroupId, input: &candle_core::Tensor) -> Result<RowPath> {
            let Some(ce) = self.model.column_error(g) else {
                return Ok(RowPath::AllInt8);
            };
            let (n, d) = input.dims2()?;
            let data = input.flatten_all()?.to_vec1::<f32>()?;
            let acc = self.acc.entry(g).or_default();
            acc.power.resize(d, 0.0);
            for r in 0..n {
                if self.rows.get(r).is_none_or(|(_, p)| *p == 0) {
                    continue;
                }
                let row = &data[r * d..(r + 1) * d];
                for (p, x) in acc.power.iter_mut().zip(row) {
                    *p += (*x as f64) * (*x as f64);
                }
                acc.nsr_sum += ce.nsr(row) as f64;
                acc.rows += 1;
            }
            Ok(RowPath::AllInt8)
        }
        fn coupled_gate_up_rows(&mut self, _layer: usize) -> Vec<usize> {
            Vec::new()
        }
        fn kv_int8(&self, _layer: usize) -> bool {
            true
        }
        fn record(&mut self, _g: GroupId, _o: quantmesh_engine::backend::GroupOutcome) {}
    }
    let mut probe = PowerProbe {
        model: &r.model,
        rows: Vec::new(),
        acc: Default::default(),
    };
    teacher_forced_logits(&r.cfg, texts, |step, kv| {
        probe.rows = step.rows();
        Ok(r.model.pass(step, &mut probe, kv)?.logits)
    })?;
    let mut out = std::collections::BTreeMap::new();
    for (g, acc) in probe.acc {
        let Some(ce) = r.model.column_error(g) else {
            continue;
        };
        let rows = acc.rows.max(1) as f64;
        let power: Vec<f64> = acc.power.iter().map(|p| p / rows).collect();
        let error_power = power
            .iter()
            .zip(&ce.error)
            .map(|(p, e)| p * *e as f64)
            .sum();
        let weight_nsr = ce.error.iter().map(|e| *e as f64).sum::<f64>()
            / ce.energy
                .iter()
                .map(|e| *e as f64)
                .sum::<f64>()
                .max(f64::MIN_POSITIVE);
        let mut sorted = power.clone();
        sorted.sort_by(|a, b| a.total_cmp(b));
        let median = sorted.get(sorted.len() / 2).copied().unwrap_or(0.0);
        let ordinary: Vec<f64> = power
            .iter()
            .map(|p| if *p > 36.0 * median { 0.0 } else { *p })
            .collect();
        out.insert(
            g,
            GroupHarm {
                nsr_without_massive: ce.nsr_of_power(&ordinary),
                nsr_of_power: ce.nsr_of_power(&power),
                mean_row_nsr: acc.nsr_sum / rows,
                error_power,
                weight_nsr,
            },
        );
    }
    Ok(out)
}
