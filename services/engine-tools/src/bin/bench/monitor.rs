//! The monitor's sections: perplexity under the plan it reaches, its overhead and quality.

use crate::args::*;
use crate::steps::*;
use quantmesh_engine::backend::cpu::LlamaModel;
use quantmesh_engine::precision::{PathMask, StepRunner};
use quantmesh_model::ModelConfig;
use quantmesh_types::Residency;
use std::time::Instant;

/// Perplexity of `text` (its first `max_tokens` tokens, windows of 256, teacher-forced one
/// token per step) on the float plan, INT8 only, and the plan the activation monitor
/// reaches after watching the first half of the text.
pub(crate) fn perplexity_section(
    dir: &std::path::Path,
    cfg: &ModelConfig,
    text: &std::path::Path,
    max_tokens: usize,
) -> Result<(), Box<dyn std::error::Error>> {
    use quantmesh_types::GroupKind;
    const WINDOW: usize = 256;
    let tok = quantmesh_model::tokenizer::TextTokenizer::load(dir)?;
    let text = std::fs::read_to_string(text)?;
    let mut ids = tok.encode(&text, true)?;
    ids.truncate(max_tokens);
    let model = LlamaModel::load(dir, cfg, &|_| Residency::Dual)?;
    let mut runner = StepRunner::default();
    let page = 16;
    let pages = WINDOW.div_ceil(page) + 2;
    let all_float = PathMask::all_groups_float(cfg.num_hidden_layers);
    // The monitor watches the text in requests of 64 tokens as served traffic, then its
    // mask is used.
    let mcfg = quantmesh_engine::monitor::MonitorConfig {
        window_requests: 4,
        shadow_sample_rate: 0.0,
        ..Default::default()
    };
    let requests: Vec<Vec<u32>> = ids.chunks(64).map(<[u32]>::to_vec).collect();
    let (_, monitored) = watch(&model, cfg, mcfg, &requests, 1)?;
    let chosen: Vec<String> = monitored
        .float_groups
        .iter()
        .map(|g| g.to_string())
        .collect();
    let plans: Vec<(String, PathMask, bool)> = vec![
        ("float (f16 KV)".into(), all_float, false),
        ("INT8 weights + C8 KV".into(), PathMask::default(), true),
        (
            format!(
                "INT8 + monitor's decisions ({} of {} groups in float{})",
                chosen.len(),
                cfg.num_hidden_layers * GroupKind::ALL.len(),
                if chosen.is_empty() {
                    String::new()
                } else {
                    let head: Vec<&str> = chosen.iter().take(6).map(String::as_str).collect();
                    let more = if chosen.len() > 6 { ", …" } else { "" };
                    format!(": {}{more}", head.join(", "))
                }
            ),
            monitored,
            true,
        ),
    ];
    println!();
    println!(
        "Perplexity over {} tokens (windows of {WINDOW}, teacher-forced):",
        ids.len()
    );
    println!();
    println!("| plan | perplexity | × float |");
    println!("|---|---|---|");
    let mut base = None;
    for (name, mask, kv_int8) in &plans {
        let (mut nll, mut n) = (0f64, 0usize);
        for (w, window) in ids.chunks(WINDOW).enumerate() {
            let (mut kv, mut bm) = cache(cfg, pages, page);
            let id = 1_000_000 + w as u64;
            bm.admit(id, &[], WINDOW).map_err(|e| e.to_string())?;
            for pair in window.windows(2) {
                let step = step_for(&mut bm, &[(id, vec![pair[0]])]);
                let mut out = runner.run(&model, &step, mask, &mut kv, *kv_int8)?;
                let logits = out.logits.remove(0).1;
                nll += quantmesh_model::ops::nll_logits(&logits, pair[1]);
                n += 1;
            }
        }
        let ppl = (nll / n as f64).exp();
        let b = *base.get_or_insert(ppl);
        println!("| {name} | {ppl:.3} | {:.4} |", ppl / b);
    }
    Ok(())
}

pub(crate) fn detector(
    model: &LlamaModel,
    cfg: &ModelConfig,
    planted_massive: &[usize],
    shadow: f64,
) -> std::sync::Arc<quantmesh_engine::precision::DetectorParams> {
    use quantmesh_types::{GroupId, GroupKind};
    let groups = (0..cfg.num_hidden_layers)
        .flat_map(|l| GroupKind::ALL.map(|k| GroupId::new(l, k)))
        .map(|g| {
            let excluded = if matches!(g.kind, GroupKind::Qkv | GroupKind::GateUp) {
                planted_massive.to_vec()
            } else {
                vec![]
            };
            (
                g,
                quantmesh_engine::precision::GroupDetector {
                    excluded_channels: excluded,
                    token_bound: f32::INFINITY,
                    learn_channels: false,
                    massive_ratio: 0.0,
                    column_error: quantmesh_engine::backend::Backend::column_error(model, g),
                },
            )
        })
        .collect();
    std::sync::Arc::new(quantmesh_engine::precision::DetectorParams {
        groups,
        skip_positions: vec![0],
        shadow_sample_rate: shadow,
    })
}

/// Monitoring overhead (prefill time and TPOT with monitoring off / on / on with a group in
/// fallback) and quality (mean KL to the float-only model, teacher-forced over a prompt set).
pub(crate) fn monitor_section(
    dir: &std::path::Path,
    cfg: &ModelConfig,
    args: &Args,
) -> Result<(), Box<dyn std::error::Error>> {
    use quantmesh_types::{GroupId, GroupKind};
    let planted: quantmesh_model::bundled::Planted =
        serde_json::from_str(&std::fs::read_to_string(dir.join("planted.json"))?)?;
    let sensitive: Vec<GroupId> = planted
        .sensitive_groups
        .iter()
        .filter_map(|g| g.parse().ok())
        .collect();
    // The overhead is timed on the forms `quantmesh serve` runs (f16 float copies, the
    // engine's tables and split activations, or what the flags say); the quality below is
    // scored against the exact f32 model.
    let served = LlamaModel::load_from(
        &quantmesh_model::Checkpoint::open(dir)?,
        cfg,
        &|_| Residency::Dual,
        args.forms(),
    )?;
    let model = LlamaModel::load(dir, cfg, &|_| Residency::Dual)?;
    let mut runner = StepRunner::default();
    let page = 16;
    let b = 8usize;
    let pages = b * (args.prompt_len + args.decode_steps).div_ceil(page) + 8;
    let fallback = PathMask {
        detector: Some(detector(&served, cfg, &planted.massive_channels, 0.0)),
        ..PathMask::with_float_groups(sensitive.iter().copied())
    };
    let variants: Vec<(&str, PathMask)> = vec![
        ("monitoring off", PathMask::default()),
        (
            "monitoring on (stats, per-token check)",
            PathMask {
                detector: Some(detector(&served, cfg, &planted.massive_channels, 0.0)),
                ..Default::default()
            },
        ),
        (
            "monitoring on, harm test off (max_nsr = 0)",
            PathMask {
                detector: Some(std::sync::Arc::new({
                    let mut d = (*detector(&served, cfg, &planted.massive_channels, 0.0)).clone();
                    for g in d.groups.values_mut() {
                        g.column_error = None;
                    }
                    d
                })),
                ..Default::default()
            },
        ),
        (
            "monitoring on + 1 % shadow KL",
            PathMask {
                detector: Some(detector(&served, cfg, &planted.massive_channels, 0.01)),
                ..Default::default()
            },
        ),
        (
            "monitoring on + sensitive group in fallback",
            fallback.clone(),
        ),
    ];
    println!();
    let forms = args.forms();
    println!("Monitoring overhead (dual plan as served: {:?} float copies, {:?} tables, split activations {:?}; batch {b}, prompt {} tokens, {} decode steps; 9 interleaved runs):", forms.float, forms.embeddings, forms.split, args.prompt_len, args.decode_steps);
    println!();
    println!("| variant | prefill ms median (min) | × off median (min) | TPOT ms median (min) | × off median (min) |");
    println!("|---|---|---|---|---|");
    // Interleaved repetitions (variant order rotates each round) so that drift and noise on
    // these VMs hit every variant alike; medians are reported.
    const REPS: usize = 9;
    let mut prefill_ms = vec![Vec::new(); variants.len()];
    // (statistics ns, mask-check ns, wall ns) summed over the monitoring-on runs
    let mut instrumented = [0u64; 3];
    let mut tpot_ms = vec![Vec::new(); variants.len()];
    for rep in 0..REPS {
        for k in 0..variants.len() {
            let vi = (k + rep) % variants.len();
            let mask = &variants[vi].1;
            let (mut kv, mut bm) = cache(cfg, pages, page);
            let prompts = admit_batch(&mut bm, b, args.prompt_len, args.decode_steps)?;
            let t0 = Instant::now();
            let step = step_for(&mut bm, &prompts);
            let o = runner.run(&served, &step, mask, &mut kv, true)?;
            prefill_ms[vi].push(t0.elapsed().as_secs_f64() * 1e3);
            if vi == 1 {
                instrumented[0] += o.stats_ns;
                instrumented[1] += o.mask_check_ns;
                instrumented[2] += t0.elapsed().as_nanos() as u64;
            }
            let t1 = Instant::now();
            for s in 0..args.decode_steps {
                let toks: Vec<(u64, Vec<u32>)> = (0..b as u64)
                    .map(|i| (i, vec![32 + (s as u32 + i as u32) % 90]))
                    .collect();
                let step = step_for(&mut bm, &toks);
                let ts = Instant::now();
                let o = runner.run(&served, &step, mask, &mut kv, true)?;
                if vi == 1 {
                    instrumented[0] += o.stats_ns;
                    instrumented[1] += o.mask_check_ns;
                    instrumented[2] += ts.elapsed().as_nanos() as u64;
                }
            }
            tpot_ms[vi].push(t1.elapsed().as_secs_f64() * 1e3 / args.decode_steps as f64);
        }
    }
    // (median, min): the minimum is the steadier estimate of cost on a noisy VM.
    let stats = |v: &mut Vec<f64>| {
        v.sort_by(|a, b| a.total_cmp(b));
        (v[v.len() / 2], v[0])
    };
    let mut base = ((0.0, 0.0), (0.0, 0.0));
    for (vi, (name, _)) in variants.iter().enumerate() {
        let (p, t) = (stats(&mut prefill_ms[vi]), stats(&mut tpot_ms[vi]));
        if vi == 0 {
            base = (p, t);
        }
        println!(
            "| {name} | {:.1} ({:.1}) | {:.3} ({:.3}) | {:.2} ({:.2}) | {:.3} ({:.3}) |",
            p.0,
            p.1,
            p.0 / base.0 .0,
            p.1 / base.0 .1,
            t.0,
            t.1,
            t.0 / base.1 .0,
            t.1 / base.1 .1
        );
    }
    println!();
    println!(
        "Instrumented (monitoring on): statistics {:.2} % and mask checks {:.3} % of forward time \
         (the wall-clock ratios above carry this VM's run-to-run noise)",
        100.0 * instrumented[0] as f64 / instrumented[2] as f64,
        100.0 * instrumented[1] as f64 / instrumented[2] as f64
    );

    // Quality: teacher-forced next-token KL to the float-only model.
    let tok = quantmesh_model::tokenizer::TextTokenizer::load(dir)?;
    // What the real monitor decides on this traffic: run it over the prompts (warm-up,
    // windows), then serve with the mask it publishes (per-layer fallback, MLP coupling and
    // per-token routing at the learned bounds).
    let mcfg = quantmesh_engine::monitor::MonitorConfig {
        window_requests: 4,
        warmup_tokens: 256,
        min_window_tokens: 32,
        shadow_sample_rate: 0.0,
        ..Default::default()
    };
    let prompts = quantmesh_model::bundled::SAMPLE_PROMPTS
        .iter()
        .map(|p| tok.encode(p, true))
        .collect::<Result<Vec<_>, _>>()?;
    let (monitor, monitored) = watch(&model, cfg, mcfg, &prompts, 4)?;
    let chosen: Vec<String> = monitored
        .float_groups
        .iter()
        .map(|g| g.to_string())
        .collect();
    if std::env::var_os("QUANTMESH_BENCH_DEBUG").is_some() {
        for g in monitor.report().groups {
            eprintln!(
                "{} {:?} mean={:.3} sigma={:.3} rate={:?} excluded={:?}",
                g.group, g.mode, g.mean, g.sigma, g.last_window_rate, g.excluded_channels
            );
        }
    }
    let int8 = PathMask::default();
    let mut quality: Vec<(String, PathMask)> = vec![
        ("INT8 only".into(), int8.clone()),
        (
            format!("INT8 + monitor's decisions (float: {})", chosen.join(", ")),
            monitored,
        ),
        (
            "INT8 + planted sensitive group in float".into(),
            fallback.clone(),
        ),
    ];
    let kv_float_all = PathMask {
        kv_float_layers: (0..cfg.num_hidden_layers).collect(),
        ..Default::default()
    };
    quality.push(("INT8 weights, KV cache in FP16".into(), kv_float_all));
    if args.per_group {
        for l in 0..cfg.num_hidden_layers {
            for k in GroupKind::ALL {
                let mut m = PathMask::default();
                m.float_groups.insert(GroupId::new(l, k));
                quality.push((format!("INT8 + {} in float", GroupId::new(l, k)), m));
            }
        }
    }
    let quality: Vec<(&str, &PathMask)> = quality.iter().map(|(n, m)| (n.as_str(), m)).collect();
    let texts = quantmesh_model::bundled::SAMPLE_PROMPTS
        .iter()
        .map(|p| tok.encode(p, true))
        .collect::<Result<Vec<_>, _>>()?;
    let masks: Vec<PathMask> = quality.iter().map(|(_, m)| (*m).clone()).collect();
    let (sums, n) = quantmesh_engine_tools::teacher_forced_kl_on(&model, cfg, &texts, &masks)?;
    println!();
    println!("Quality: mean next-token KL(P_float-only ‖ P) over {} prompts, {n} positions (teacher-forced):", quantmesh_model::bundled::SAMPLE_PROMPTS.len());
    println!();
    println!("| plan | mean KL (nats) | × INT8 only |");
    println!("|---|---|---|");
    for (qi, (name, _)) in quality.iter().enumerate() {
        let m = sums[qi] / n as f64;
        println!("| {name} | {m:.5} | {:.3} |", m / (sums[0] / n as f64));
    }
    Ok(())
}

/// Peak resident set size of this process (`VmHWM`), MiB.
pub(crate) fn peak_rss_mib() -> Option<f64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kib: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib / 1024.0)
}
