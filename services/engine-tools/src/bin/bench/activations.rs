//! The activation table: how close each activation width and rotation keeps the served
//! first-load plan to the checkpoint's exact function, on held-out texts, with the monitor
//! on and fed by other traffic.

use crate::args::{Args, MonitorChoice, SmoothingChoice};
use crate::formats::{teacher_forced_top1, KlSummary};
use crate::steps::watch_with;
use quantmesh_engine::backend::cpu::LlamaModel;
use quantmesh_engine::backend::{EmbeddingDtype, FloatDtype, Forms, SplitActivations};
use quantmesh_engine::monitor::GroupMode;
use quantmesh_model::ModelConfig;
use quantmesh_types::Residency;
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
    println!("Scale migration: `plan` = the plan's smoothing factors ({smoothed} of its groups carry them), `none` = the same plan without. Monitor `off`: no monitor, every row on the plan's paths. Groups on fallback: after the monitor's window, of the linear groups (float where a copy is resident, 16-bit activations where not under `copyless`). Wide groups: under `copyless`, the groups that carry 16-bit activations on every row because the plan measured their 8-bit activations costing at least the ratio times their 8-bit weights' error (`engine.wide_activations`).");
    println!();
    println!("| activations | wide groups | rotation block | smoothing | monitor | groups on fallback | held-out text | mean KL | median KL | p99 KL | top-1 agreement % | perplexity | served tok/s (b1, one token per step) |");
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|---|");
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
    for (split, rotation, smoothing, monitor, ratio) in configs {
        let wide = ratio.map_or_else(Default::default, |r| {
            quantmesh_engine::plan::wide_groups(plan.groups.iter(), r)
        });
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
        let split_fallback = split == SplitActivations::Copyless;
        let (mask, on_fallback) = match monitor {
            MonitorChoice::On => {
                let (m, mask) =
                    watch_with(&model, cfg, mcfg, &requests, 1, spikes, split_fallback)?;
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
        for (path, ids) in &texts {
            let s = teacher_forced_top1(&model, &reference, cfg, ids, &mask, true)?;
            let k = KlSummary::of(&s.kls);
            println!(
                "| {} | {} | {} | {} | {} | {} | {} | {:.5} | {:.5} | {:.4} | {:.1} | {:.3} | {:.1} |",
                split.as_str(),
                wide_label,
                if rotation == 0 {
                    "none".to_string()
                } else {
                    rotation.to_string()
                },
                match smoothing {
                    SmoothingChoice::None => "none",
                    SmoothingChoice::Plan => "plan",
                },
                match monitor {
                    MonitorChoice::On => "on",
                    MonitorChoice::Off => "off",
                },
                on_fallback,
                path.file_name().map_or_else(
                    || path.display().to_string(),
                    |n| n.to_string_lossy().into()
                ),
                k.mean,
                k.median,
                k.p99,
                100.0 * s.top1_agree as f64 / s.kls.len().max(1) as f64,
                s.perplexity,
                s.kls.len() as f64 / s.served_seconds.max(f64::MIN_POSITIVE)
            );
        }
    }
    Ok(())
}
