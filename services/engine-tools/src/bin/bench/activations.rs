//! The activation table: how close each activation width and rotation keeps the served
//! first-load plan to the checkpoint's exact function, on held-out texts, with the monitor
//! on and fed by other traffic.

use crate::args::{Args, MonitorChoice, SmoothingChoice};
use crate::formats::{teacher_forced_top1, KlSummary, Scored};
use crate::steps::watch_with;
use quantmesh_engine::backend::cpu::LlamaModel;
use quantmesh_engine::backend::{EmbeddingDtype, FloatDtype, Forms, SplitActivations};
use quantmesh_engine::monitor::GroupMode;
use quantmesh_engine::precision::mask::PathMask;
use quantmesh_model::ModelConfig;
use quantmesh_types::{GroupId, GroupKind, Residency};
use std::path::{Path, PathBuf};

/// One table row per (split, rotation, held-out text): mean, median and p99 next-token KL
/// to the f32 float model, top-1 agreement and perplexity. Every configuration serves the
/// plan at `plan_path` (float copies f16, the plan's tables); its monitor first watches
/// `traffic` (texts never scored), and its mask, per-token bound included, is in force
/// while the held-out texts are scored.
pub(crate) fn activation_table(
    dir: &Path,
    cfg: &ModelConfig,
    plan_path: &Path,
    held_out: &[PathBuf],
    traffic: &[PathBuf],
    args: &Args,
) -> Result<(), Box<dyn std::error::Error>> {
    if held_out.is_empty() || traffic.is_empty() {
        return Err("--activation-table needs --held-out FILE and --traffic FILE".into());
    }
    let tok = quantmesh_model::tokenizer::TextTokenizer::load(dir)?;
    let read = |p: &PathBuf| -> Result<Vec<u32>, Box<dyn std::error::Error>> {
        let text = std::fs::read_to_string(p).map_err(|e| format!("{}: {e}", p.display()))?;
        Ok(tok.encode(&text, true)?)
    };
    let mut texts = Vec::new();
    for p in held_out {
        let mut ids = read(p)?;
        ids.truncate(args.ppl_tokens);
        texts.push((p, ids));
    }
    // The monitor's traffic: 64-token requests cut from the traffic texts.
    let mut requests: Vec<Vec<u32>> = Vec::new();
    for p in traffic {
        let ids = read(p)?;
        requests.extend(
            ids.chunks(64)
                .filter(|c| c.len() == 64)
                .map(<[u32]>::to_vec),
        );
    }
    requests.truncate(args.traffic_requests);
    let ck = quantmesh_model::Checkpoint::open(dir)?;
    let (base, live, plan) = crate::steps::served_plan(&ck, cfg, plan_path, args.float_budget)?;
    let ratios = if args.wide_activations.is_empty() {
        vec![base.wide_activations]
    } else {
        args.wide_activations.clone()
    };
    let reference = LlamaModel::load(dir, cfg, &|_| Residency::Float)?;
    println!();
    println!(
        "Activation widths and rotations on {} (first-load plan {}, float budget {}, {} tables; KL to the f32 float model with float activations, teacher-forced; the monitor, as the engine configures it from the plan, watched {} requests of 64 tokens from {} first, as one window; {} tokens per held-out text):",
        dir.display(),
        plan_path.display(),
        args.float_budget,
        live.embeddings.as_str(),
        requests.len(),
        traffic
            .iter()
            .map(|p| p.display().to_string())
            .collect::<Vec<_>>()
            .join(", "),
        args.ppl_tokens
    );
    println!();
    println!(
        "Activation spikes count in the monitor {}.",
        if args.spikes_only_8bit {
            "only where activations are 8-bit (off, copyless): the engine's earlier rule"
        } else {
            "under every width (the engine's rule)"
        }
    );
    println!();
    let smoothed = live.smoothing.len();
    println!("Scale migration: `plan` = the plan's smoothing factors ({smoothed} of its groups carry them), `none` = the same plan without. Monitor `off`: no monitor, every row on the plan's paths. Groups on fallback: after the monitor's window, of the linear groups (float where a copy is resident, 16-bit activations where not under `copyless`). Wide groups: under `copyless`, the groups that carry 16-bit activations on every row because the plan measured their 8-bit activations costing at least the ratio times their 8-bit weights' error (`engine.wide_activations`). Mean KL ÷ `all`'s: against the `all` row of the same rotation, smoothing, monitor and text, over the same tokens, with a paired bootstrap's 95 % interval (1 000 resamplings of the tokens): the mean of a few hundred tokens is carried by a few of them. Rows `… + top-1 < τ`: the row before, scored again with the positions whose served top-1 probability fell below τ carried at 16 bits in every group.");
    println!();
    let mut configs = Vec::new();
    for &split in &args.splits {
        // Wide groups change only `copyless`: the other widths run once, without a ratio.
        let widths: Vec<Option<f64>> = match split {
            SplitActivations::Copyless => ratios.iter().copied().map(Some).collect(),
            _ => vec![None],
        };
        for &rotation in &args.rotations {
            for &smoothing in &args.smoothings {
                for &monitor in &args.monitors {
                    for &ratio in &widths {
                        configs.push((split, rotation, smoothing, monitor, ratio));
                    }
                }
            }
        }
    }
    let mut rows: Vec<Row> = Vec::new();
    for (split, rotation, smoothing, monitor, ratio) in configs {
        let wide = match (split, ratio) {
            // `copyless_q4`: every Q8_0 group wide, as the engine serves it.
            (SplitActivations::CopylessQ4, _) => quantmesh_engine::plan::served_wide(&live.quant),
            (_, Some(r)) => quantmesh_engine::plan::wide_groups(plan.groups.iter(), r),
            (_, None) => Default::default(),
        };
        let wide_label = ratio.map_or_else(
            || "-".to_string(),
            |r| format!("{} (ratio {r})", wide.len()),
        );
        let forms = Forms {
            float: FloatDtype::F16,
            embeddings: match live.embeddings {
                EmbeddingDtype::Auto => EmbeddingDtype::Q8_0,
                e => e,
            },
            split,
            rotation,
        };
        let form = |g| {
            let mut f = live.form(g, base.default_residency);
            if smoothing == SmoothingChoice::None {
                f.smoothing = None;
            }
            f.wide = wide.contains(&g);
            f
        };
        let model = LlamaModel::load_planned(&ck, cfg, &form, forms)?;
        // The monitor as the engine runs it: the plan's thresholds and overrides, each
        // group in the residency the model serves it in, split fallback under `copyless`;
        // its window is the traffic (one window closes, with the engine's trigger), and no
        // shadow passes (the scoring below is the reference).
        let mcfg = quantmesh_engine::monitor::MonitorConfig {
            window_requests: requests.len(),
            shadow_sample_rate: 0.0,
            ..live.monitor.clone()
        };
        let spikes = !args.spikes_only_8bit || split != SplitActivations::All;
        let (mask, on_fallback) = match monitor {
            MonitorChoice::On => {
                let (m, mask) = watch_with(&model, cfg, mcfg, &requests, 1, spikes, split)?;
                let report = m.report();
                let n = report
                    .groups
                    .iter()
                    .filter(|g| g.mode != GroupMode::Int8 && g.mode != GroupMode::ForcedInt8)
                    .count();
                (mask, format!("{n} / {}", report.groups.len()))
            }
            MonitorChoice::Off => (Default::default(), "-".to_string()),
        };
        let config = Config {
            split,
            rotation,
            smoothing,
            monitor,
        };
        for (t, (path, ids)) in texts.iter().enumerate() {
            let s = teacher_forced_top1(&model, &reference, cfg, ids, &mask, true)?;
            eprintln!(
                "[activation table] {} / {} (wide {wide_label}): {}",
                split.as_str(),
                rotation,
                path.display()
            );
            // The uncertain-token trial: the same text again with the positions named by the
            // served distribution carried at 16 bits in every group.
            let mut trials = Vec::new();
            if split == SplitActivations::Copyless {
                for &tau in &args.uncertain_top1 {
                    for shift in [0, 1] {
                        let (m2, n) = uncertain_rows(&mask, cfg, &s, tau, shift);
                        let s2 = teacher_forced_top1(&model, &reference, cfg, ids, &m2, true)?;
                        let when = if shift == 0 { "same" } else { "next" };
                        trials.push((
                            format!(
                                "{} + top-1 < {tau} ({when} token; {n} of {} tokens 16-bit)",
                                split.as_str(),
                                s.kls.len()
                            ),
                            s2,
                        ));
                    }
                }
            }
            rows.push(Row {
                config,
                label: split.as_str().to_string(),
                wide: wide_label.clone(),
                on_fallback: on_fallback.clone(),
                text: t,
                scored: s,
            });
            for (label, scored) in trials {
                rows.push(Row {
                    config,
                    label,
                    wide: wide_label.clone(),
                    on_fallback: on_fallback.clone(),
                    text: t,
                    scored,
                });
            }
        }
    }
    print_rows(&rows, &texts);
    Ok(())
}

/// What a row served, less its wide groups: the key a row's `all` counterpart is found by.
#[derive(Clone, Copy, PartialEq, Eq)]
struct Config {
    split: SplitActivations,
    rotation: u32,
    smoothing: SmoothingChoice,
    monitor: MonitorChoice,
}

/// One scored (configuration, held-out text).
struct Row {
    config: Config,
    label: String,
    wide: String,
    on_fallback: String,
    text: usize,
    scored: Scored,
}

/// `mask` with every position whose served top-1 probability fell below `tau` carried at
/// 16 bits (float where a copy is resident) in every linear group: the position itself
/// (`shift` 0: as if the token were computed again) or the one after it in the same window
/// (`shift` 1: decided from the step before, no second pass). Returns the mask and how many
/// positions it names.
fn uncertain_rows(
    mask: &PathMask,
    cfg: &ModelConfig,
    scored: &Scored,
    tau: f64,
    shift: usize,
) -> (PathMask, usize) {
    let rows = &scored.rows;
    let named: Vec<(u64, usize)> = (0..rows.len())
        .filter(|&k| scored.top1_prob[k] < tau)
        .filter_map(|k| rows.get(k + shift).filter(|r| r.0 == rows[k].0).copied())
        .collect();
    let mut m = mask.clone();
    for l in 0..cfg.num_hidden_layers {
        for kind in GroupKind::ALL {
            m.float_tokens
                .entry(GroupId::new(l, kind))
                .or_default()
                .extend(named.iter().copied());
        }
    }
    (m, named.len())
}

/// The ratio of `a`'s mean to `b`'s over the same tokens, and its 95 % interval from a
/// paired bootstrap (tokens resampled with replacement, 1 000 draws, a fixed seed).
fn paired_ratio(a: &[f64], b: &[f64]) -> (f64, f64, f64) {
    use rand::{Rng, SeedableRng};
    let n = a.len().min(b.len());
    let ratio = |idx: &mut dyn Iterator<Item = usize>| {
        let (mut sa, mut sb) = (0.0, 0.0);
        for i in idx {
            sa += a[i];
            sb += b[i];
        }
        sa / sb.max(f64::MIN_POSITIVE)
    };
    let point = ratio(&mut (0..n));
    if n == 0 {
        return (point, point, point);
    }
    let mut rng = rand::rngs::StdRng::seed_from_u64(0x5eed);
    let mut draws: Vec<f64> = (0..1000)
        .map(|_| {
            let picks: Vec<usize> = (0..n).map(|_| rng.gen_range(0..n)).collect();
            ratio(&mut picks.into_iter())
        })
        .collect();
    draws.sort_by(f64::total_cmp);
    (point, draws[25], draws[974])
}

/// The table: one line per row, with its mean KL's ratio to the `all` row of the same
/// rotation, smoothing, monitor and text (paired over the text's tokens), where one ran.
fn print_rows(rows: &[Row], texts: &[(&PathBuf, Vec<u32>)]) {
    println!("| activations | wide groups | rotation block | smoothing | monitor | groups on fallback | held-out text | mean KL | median KL | p99 KL | top-1 agreement % | perplexity | mean KL ÷ `all`'s (95 % interval) | served tok/s (b1, one token per step) |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|---|");
    for r in rows {
        let c = r.config;
        let all = rows.iter().find(|o| {
            o.text == r.text
                && o.config
                    == Config {
                        split: SplitActivations::All,
                        ..c
                    }
                && o.label == SplitActivations::All.as_str()
        });
        let ratio = all.map_or_else(
            || "-".to_string(),
            |o| {
                let (p, lo, hi) = paired_ratio(&r.scored.kls, &o.scored.kls);
                format!("{p:.2} ({lo:.2}–{hi:.2})")
            },
        );
        let s = &r.scored;
        let k = KlSummary::of(&s.kls);
        let path = texts[r.text].0;
        println!(
            "| {} | {} | {} | {} | {} | {} | {} | {:.5} | {:.5} | {:.4} | {:.1} | {:.3} | {} | {:.1} |",
            r.label,
            r.wide,
            if c.rotation == 0 {
                "none".to_string()
            } else {
                c.rotation.to_string()
            },
            match c.smoothing {
                SmoothingChoice::None => "none",
                SmoothingChoice::Plan => "plan",
            },
            match c.monitor {
                MonitorChoice::On => "on",
                MonitorChoice::Off => "off",
            },
            r.on_fallback,
            path.file_name().map_or_else(
                || path.display().to_string(),
                |n| n.to_string_lossy().into()
            ),
            k.mean,
            k.median,
            k.p99,
            100.0 * s.top1_agree as f64 / s.kls.len().max(1) as f64,
            s.perplexity,
            ratio,
            s.kls.len() as f64 / s.served_seconds.max(f64::MIN_POSITIVE)
        );
    }
}

#[cfg(test)]
mod tests {
    use super::paired_ratio;

    /// The paired ratio is the ratio of the sums, and its interval holds it; a constant
    /// ratio has no spread, and the interval follows the draws' spread otherwise.
    #[test]
    fn the_paired_ratio_is_the_ratio_of_means_with_its_interval() {
        let b: Vec<f64> = (1..=200).map(|i| f64::from(i % 17) + 0.5).collect();
        let a: Vec<f64> = b.iter().map(|x| 2.0 * x).collect();
        let (p, lo, hi) = paired_ratio(&a, &b);
        assert!((p - 2.0).abs() < 1e-12 && (lo - 2.0).abs() < 1e-12 && (hi - 2.0).abs() < 1e-12);
        let noisy: Vec<f64> = b
            .iter()
            .enumerate()
            .map(|(i, x)| x * if i % 3 == 0 { 3.0 } else { 0.5 })
            .collect();
        let (p, lo, hi) = paired_ratio(&noisy, &b);
        let want = noisy.iter().sum::<f64>() / b.iter().sum::<f64>();
        assert!((p - want).abs() < 1e-12);
        assert!(lo < p && p < hi, "{lo} < {p} < {hi}");
        assert!(hi - lo > 0.05, "a mixed ratio has spread: {lo}..{hi}");
    }
}
