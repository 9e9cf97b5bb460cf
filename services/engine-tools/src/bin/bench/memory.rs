//! The memory table (resident bytes, RSS, speed and quality per configuration) and the
//! shadow pass's cost.

use crate::args::*;
use crate::formats::{teacher_forced, KlSummary};
use crate::steps::*;
use quantmesh_engine::backend::cpu::LlamaModel;
use quantmesh_engine::backend::{Backend, FloatDtype};
use quantmesh_engine::precision::{PathMask, StepRunner};
use quantmesh_model::ModelConfig;
use quantmesh_types::Residency;
use std::time::Instant;

pub(crate) fn rss_mib(key: &str) -> Option<f64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with(key))?;
    let kib: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib / 1024.0)
}

/// The memory configurations side by side on one text: resident bytes by form and against
/// all-f16, RSS growth at load, batch-1 prefill/decode speed, perplexity and mean next-token
/// KL to the exact f32 float model. Monitor-driven rows let the monitor watch the text as
/// served traffic first, then run under its mask (as `perplexity_section` does).
pub(crate) fn memory_table(
    dir: &std::path::Path,
    cfg: &ModelConfig,
    plan_path: &std::path::Path,
    text: &std::path::Path,
    args: &Args,
) -> Result<(), Box<dyn std::error::Error>> {
    use quantmesh_engine::backend::{EmbeddingDtype, Forms, SplitActivations};
    /// Which mask a row runs under: the monitor's after watching the text, every group
    /// wanting float, or none (every group on its resident quantized form).
    #[derive(PartialEq)]
    enum Watch {
        Monitor,
        AllFloat,
        Nothing,
    }
    use quantmesh_types::GroupId;
    let tok = quantmesh_model::tokenizer::TextTokenizer::load(dir)?;
    let mut ids = tok.encode(&std::fs::read_to_string(text)?, true)?;
    ids.truncate(args.ppl_tokens);
    let ck = quantmesh_model::Checkpoint::open(dir)?;
    let (base, live, _) = crate::steps::served_plan(&ck, cfg, plan_path, args.float_budget)?;
    let q = Forms {
        float: FloatDtype::F16,
        embeddings: EmbeddingDtype::Q8_0,
        split: SplitActivations::Off,
        rotation: 0,
    };
    let f16 = Forms {
        embeddings: EmbeddingDtype::F16,
        ..q
    };
    // The first-load plan's rows: the tables as the budget resolved them.
    let p = Forms {
        embeddings: live.embeddings,
        ..q
    };
    use quantmesh_engine::backend::GroupForm;
    // Each group's residency and quantized form: the plan's (its classes: 4- or 8-bit), or
    // one residency for every group in Q8_0.
    type Resid<'a> = Box<dyn Fn(GroupId) -> GroupForm + 'a>;
    let every = |r: Residency| -> Resid { Box::new(move |_| GroupForm::q8(r)) };
    let plan_resid = || -> Resid { Box::new(|g| live.form(g, base.default_residency)) };
    // (name, residency, forms, which mask, kv_int8)
    let configs: Vec<(String, Resid, Forms, Watch, bool)> = vec![
        (
            "all-f16 float".into(),
            every(Residency::Float),
            f16,
            Watch::AllFloat,
            false,
        ),
        (
            "all-dual f32 (previous default), monitor-driven".into(),
            every(Residency::Dual),
            Forms::EXACT,
            Watch::Monitor,
            true,
        ),
        (
            format!(
                "first-load plan, budget {} ({} over, {} tables), monitor-driven",
                args.float_budget,
                live.budget.demoted.len(),
                live.embeddings.as_str()
            ),
            plan_resid(),
            p,
            Watch::Monitor,
            true,
        ),
        (
            "INT8 only".into(),
            every(Residency::Int8),
            q,
            Watch::Nothing,
            true,
        ),
    ];
    // What each difference between the rows above costs, one change at a time: the float
    // copies' dtype and the vocabulary tables' form under the same plan, and the tables alone.
    let variants: Vec<(String, Resid, Forms, Watch, bool)> = vec![
        (
            "first-load plan, f32 float copies".into(),
            plan_resid(),
            Forms {
                float: FloatDtype::F32,
                ..p
            },
            Watch::Monitor,
            true,
        ),
        (
            "first-load plan, f16 vocabulary tables".into(),
            plan_resid(),
            f16,
            Watch::Monitor,
            true,
        ),
        (
            "first-load plan, no monitor".into(),
            plan_resid(),
            p,
            Watch::Nothing,
            true,
        ),
        (
            "first-load plan, monitor-driven, split activations for copyless rows".into(),
            plan_resid(),
            Forms {
                split: SplitActivations::Copyless,
                ..p
            },
            Watch::Monitor,
            true,
        ),
        (
            "first-load plan, monitor-driven, split activations everywhere".into(),
            plan_resid(),
            Forms {
                split: SplitActivations::All,
                ..p
            },
            Watch::Monitor,
            true,
        ),
        (
            "INT8 only, split activations everywhere".into(),
            every(Residency::Int8),
            Forms {
                split: SplitActivations::All,
                ..q
            },
            Watch::Nothing,
            true,
        ),
        (
            "INT8 only, f16 KV cache".into(),
            every(Residency::Int8),
            q,
            Watch::Nothing,
            false,
        ),
        (
            "all-f16 float, C8 KV cache".into(),
            every(Residency::Float),
            f16,
            Watch::AllFloat,
            true,
        ),
        (
            "first-load plan, monitor-driven, split everywhere, f16 KV cache".into(),
            plan_resid(),
            Forms {
                split: SplitActivations::All,
                ..p
            },
            Watch::Monitor,
            false,
        ),
        (
            "first-load plan, monitor-driven, split everywhere, f16 vocabulary tables".into(),
            plan_resid(),
            Forms {
                split: SplitActivations::All,
                ..f16
            },
            Watch::Monitor,
            true,
        ),
        (
            "INT8 only, f32 vocabulary tables".into(),
            every(Residency::Int8),
            Forms {
                embeddings: EmbeddingDtype::F32,
                ..q
            },
            Watch::Nothing,
            true,
        ),
    ];
    let configs: Vec<_> = configs
        .into_iter()
        .chain(variants)
        .enumerate()
        .filter(|(i, _)| args.memory_rows.is_empty() || args.memory_rows.contains(&(i + 1)))
        .map(|(_, c)| c)
        .collect();
    let reference = LlamaModel::load(dir, cfg, &|_| Residency::Float)?;
    let all_float = PathMask::all_groups_float(cfg.num_hidden_layers);
    let page = 16;
    println!();
    println!(
        "Memory configurations on {} ({} tokens of {}; KL to the f32 float model, teacher-forced):",
        dir.display(),
        ids.len(),
        text.display()
    );
    println!();
    println!("| configuration | int8 / int4 / float / other MiB | total MiB | × all-f16 | RSS at load MiB | prefill tok/s (b1, 128) | decode tok/s (b1) | perplexity | mean KL | median KL | p99 KL | worst 1 % share |");
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|");
    for (name, resid, forms, mask_from, kv_int8) in configs {
        let rss0 = rss_mib("VmRSS:").unwrap_or(f64::NAN);
        let model = LlamaModel::load_planned(&ck, cfg, &*resid, forms)?;
        let rss = rss_mib("VmRSS:").unwrap_or(f64::NAN) - rss0;
        let w = model.weight_bytes();
        let mask = if mask_from == Watch::Monitor {
            let mcfg = quantmesh_engine::monitor::MonitorConfig {
                window_requests: 4,
                shadow_sample_rate: 0.0,
                ..Default::default()
            };
            let requests: Vec<Vec<u32>> = ids.chunks(64).map(<[u32]>::to_vec).collect();
            watch(&model, cfg, mcfg, &requests, 1)?.1
        } else if mask_from == Watch::AllFloat {
            all_float.clone()
        } else {
            PathMask::default()
        };
        // Speed: a 128-token prefill, then 128 decode steps, batch 1 (fewer steps swing
        // by a third from run to run on a shared 2-core VM).
        let mut runner = StepRunner::default();
        let (prefill, decode) = {
            let (mut kv, mut bm) = cache(cfg, 18, page);
            bm.admit(7, &[], 260).map_err(|e| e.to_string())?;
            let prompt: Vec<u32> = ids.iter().copied().cycle().take(128).collect();
            let t = Instant::now();
            let step = step_for(&mut bm, &[(7, prompt)]);
            runner.run(&model, &step, &mask, &mut kv, kv_int8)?;
            let prefill = 128.0 / t.elapsed().as_secs_f64();
            let t = Instant::now();
            for i in 0..128u32 {
                let step = step_for(&mut bm, &[(7, vec![32 + i])]);
                runner.run(&model, &step, &mask, &mut kv, kv_int8)?;
            }
            (prefill, 128.0 / t.elapsed().as_secs_f64())
        };
        let (ppl, kls) = teacher_forced(&model, &reference, cfg, &ids, &mask, kv_int8)?;
        let KlSummary {
            mean: kl,
            median: p50,
            p99,
            worst_share: top,
        } = KlSummary::of(&kls);
        let mib = |b: usize| b as f64 / (1 << 20) as f64;
        println!(
            "| {name} | {:.1} / {:.1} / {:.1} / {:.1} | {:.1} | {:.2} | {rss:.0} | {prefill:.0} | {decode:.1} | {:.3} | {:.5} | {p50:.5} | {p99:.4} | {:.0} % |",
            mib(w.int8),
            mib(w.int4),
            mib(w.float),
            mib(w.other),
            mib(w.total()),
            w.ratio_to_f16(),
            ppl,
            kl,
            100.0 * top
        );
    }
    let all_f16 = reference.weight_bytes().all_f16 as u64;
    let peers: Vec<crate::peer::Peer> = args
        .peer
        .iter()
        .map(|p| crate::peer::Peer::load(p))
        .collect::<Result<_, _>>()?;
    let scores = crate::peer::score(&peers, &reference, cfg, &ids)?;
    for (peer, (ppl, kls)) in peers.iter().zip(&scores) {
        println!("{}", peer.row(*ppl, kls, all_f16));
    }
    Ok(())
}

/// What the shadow pass's exact reference costs on an INT8-only model: a batch-1 decode step
/// served, against the same step's reference pass (every group's weights from the checkpoint,
/// the first `cache` MiB of them kept), for a few cache sizes.
pub(crate) fn shadow_cost_section(
    dir: &std::path::Path,
    cfg: &ModelConfig,
    args: &Args,
) -> Result<(), Box<dyn std::error::Error>> {
    use quantmesh_engine::backend::cpu::reference::ReferenceWeights;
    use quantmesh_engine::precision::MaskRouter;
    let page = 16;
    let steps = args.decode_steps.max(4);
    println!();
    println!(
        "Shadow reference cost (INT8-only model, batch 1, {} prompt + {steps} decode steps; ms per step):",
        args.prompt_len
    );
    println!();
    println!("| reference cache MiB | held MiB | served step | reference pass | × served | checkpoint reads / pass |");
    println!("|---|---|---|---|---|---|");
    for cache_mib in [0usize, 128, 1 << 20] {
        let ck = quantmesh_model::Checkpoint::open(dir)?;
        let model =
            LlamaModel::load_from(&ck, cfg, &|_| Residency::Int8, args.forms())?.with_reference(
                ReferenceWeights::new(ck, cfg.clone(), args.float_dtype, cache_mib << 20),
            );
        let (mut kv, mut bm) = cache(cfg, (args.prompt_len + steps).div_ceil(page) + 4, page);
        bm.admit(1, &[], args.prompt_len + steps)
            .map_err(|e| e.to_string())?;
        let prompt: Vec<u32> = (0..args.prompt_len as u32).map(|t| 32 + t % 90).collect();
        let mut runner = StepRunner::default();
        runner.run(
            &model,
            &step_for(&mut bm, &[(1, prompt)]),
            &PathMask::default(),
            &mut kv,
            true,
        )?;
        let mask = PathMask::default();
        let (mut served, mut reference) = (0.0, 0.0);
        let mut reads0 = 0;
        for i in 0..steps as u32 {
            let step = step_for(&mut bm, &[(1, vec![40 + i % 50])]);
            let t = Instant::now();
            let mut router = MaskRouter::new(&mask, step.rows(), false).reference();
            model.pass(&step, &mut router, &mut kv)?;
            // the first reference pass fills the cache: not counted
            if i > 0 {
                reference += t.elapsed().as_secs_f64();
            } else {
                reads0 = model.reference().map_or(0, |r| r.stats().reads);
            }
            let t = Instant::now();
            let mut router = MaskRouter::new(&mask, step.rows(), true);
            model.pass(&step, &mut router, &mut kv)?;
            if i > 0 {
                served += t.elapsed().as_secs_f64();
            }
        }
        let n = (steps - 1) as f64;
        let s = model.reference().map(|r| r.stats()).unwrap_or_default();
        println!(
            "| {} | {:.0} | {:.1} | {:.1} | {:.1} | {:.0} |",
            if cache_mib >= 1 << 20 {
                "unlimited".to_string()
            } else {
                cache_mib.to_string()
            },
            s.held_bytes as f64 / (1 << 20) as f64,
            served / n * 1e3,
            reference / n * 1e3,
            reference / served,
            (s.reads - reads0) as f64 / n,
        );
    }
    Ok(())
}
