//! Engine throughput and memory benchmark. Prints a table; ratios are against the float
//! plan measured in the same run.
//!
//! ```text
//! cargo run --release -p quantmesh-engine-tools --bin quantmesh-engine-bench -- \
//!     [--size tiny|small|medium | --model PATH] [--prompt-len 128] [--decode-steps 32]
//!     [--batches 1,8,32] [--ppl-text FILE --ppl-tokens 1024] [--json FILE]
//! ```
//!
//! With `--model` (a GGUF file or Hugging Face directory) the throughput table runs on that
//! model, and with `--ppl-text` perplexity is measured on the float, INT8-only and
//! monitor-driven plans. `--json` writes the dual plan's numbers (what `quantmesh serve`
//! runs) for scripts/bench-llamacpp.sh.

mod activations;
mod args;
mod formats;
mod memory;
mod monitor;
mod peer;
mod steps;

use args::*;
use formats::*;
use memory::*;
use monitor::*;
use steps::*;

use quantmesh_engine::backend::cpu::LlamaModel;
use quantmesh_engine::backend::Backend;
use quantmesh_engine::precision::{PathMask, StepRunner};
use quantmesh_model::bundled::{init_model, InitOptions};
use quantmesh_model::ModelConfig;
use quantmesh_types::Residency;
use std::time::Instant;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    quantmesh_engine::api::leave_the_cores_to_the_kernel_pool();
    let mut args = <Args as clap::Parser>::parse();
    if let Some(scale) = args.kv_scale {
        let _ = KV_SCALE.set(scale);
    }
    let bundled = args.model.is_none();
    let dir = args.model.clone().unwrap_or_else(|| {
        std::env::temp_dir().join(format!("quantmesh-bench-{:?}", args.size).to_lowercase())
    });
    let planted_ok = std::fs::read_to_string(dir.join("planted.json"))
        .ok()
        .and_then(|t| serde_json::from_str::<quantmesh_model::bundled::Planted>(&t).ok())
        .is_some();
    if bundled && (!quantmesh_model::bundled::model_present(&dir) || !planted_ok) {
        eprintln!("writing bundled {:?} model to {}", args.size, dir.display());
        init_model(
            &dir,
            &InitOptions {
                size: args.size,
                ..Default::default()
            },
        )?;
    }
    let cfg = ModelConfig::load(&dir)?;
    // `auto` resolved as the engine resolves it, on this model's widest product (timed
    // afresh: a benchmark does not trust an earlier start's timing). The throughput plans
    // store every group in Q8_0 (the activation table names its widths in --splits).
    let width = quantmesh_engine::backend::cpu::width::choose_for(
        args.split.unwrap_or_default(),
        &cfg,
        None,
        false,
    )?;
    args.split = Some(width.mode);
    println!(
        "activation width {} ({}), rotation block {}",
        width.mode.as_str(),
        width.ratio.map_or("as given".to_string(), |r| format!(
            "auto: 16-bit activations cost {r:.2}x the 8-bit product here"
        )),
        args.forms().rotation
    );
    println!(
        "model {}: hidden {}, layers {}, intermediate {}; prompt {} tokens, {} decode steps",
        if bundled {
            format!("{:?}", args.size)
        } else {
            dir.display().to_string()
        },
        cfg.hidden_size,
        cfg.num_hidden_layers,
        cfg.intermediate_size,
        args.prompt_len,
        args.decode_steps
    );
    if let Some(plan) = &args.activation_table {
        return activations::activation_table(
            &dir,
            &cfg,
            plan,
            &args.held_out,
            &args.traffic,
            &args,
        );
    }
    if let Some(plan) = &args.memory_table {
        // The memory table alone: its rows carry their own speed columns.
        let text = args
            .ppl_text
            .as_deref()
            .ok_or("--memory-table needs --ppl-text FILE")?;
        return memory_table(&dir, &cfg, plan, text, &args);
    }
    let page = 16;
    let max_b = args.batches.iter().copied().max().unwrap_or(1);
    let pages = max_b * (args.prompt_len + args.decode_steps).div_ceil(page) + 8;
    println!();
    match args.step_tokens {
        0 => println!("prefill: every prompt of a batch in one step"),
        n => println!("prefill: in steps of at most {n} prompt tokens, first come first served, as the server's max_num_batched_tokens splits them"),
    }
    println!("| plan | weights MiB | batch | prefill tok/s | × float | decode tok/s | × float |");
    println!("|---|---|---|---|---|---|---|");
    let mut float_ref: Vec<(f64, f64)> = Vec::new();
    let mut dual_numbers = serde_json::Map::new();
    for (pi, plan) in args.plans.iter().copied().enumerate() {
        let ck = quantmesh_model::Checkpoint::open(&dir)?;
        let model = LlamaModel::load_from(&ck, &cfg, &|_| plan, args.forms())?;
        let mut runner = StepRunner::default();
        let mib = model.resident_bytes() as f64 / (1 << 20) as f64;
        // Warm-up (thread pools, page faults of the freshly loaded weights), untimed.
        {
            let (mut kv, mut bm) = cache(&cfg, 8, page);
            bm.admit(u64::MAX, &[], 64).map_err(|e| e.to_string())?;
            let step = step_for(&mut bm, &[(u64::MAX, (0..32).collect())]);
            runner.run(&model, &step, &PathMask::default(), &mut kv, true)?;
        }
        for (bi, &b) in args.batches.iter().enumerate() {
            let (mut kv, mut bm) = cache(&cfg, pages, page);
            let mask = PathMask::default();
            let prompts = admit_batch(&mut bm, b, args.prompt_len, args.decode_steps)?;
            let t0 = Instant::now();
            let mut served = Served {
                runner: &mut runner,
                model: &model,
                mask: &mask,
                kv: &mut kv,
            };
            served.prefill(&mut bm, &prompts, args.step_tokens)?;
            let prefill = (b * args.prompt_len) as f64 / t0.elapsed().as_secs_f64();
            let t1 = Instant::now();
            for s in 0..args.decode_steps {
                let toks: Vec<(u64, Vec<u32>)> = (0..b as u64)
                    .map(|i| (i, vec![(s as u32 + i as u32) % 256]))
                    .collect();
                let step = step_for(&mut bm, &toks);
                runner.run(&model, &step, &mask, &mut kv, true)?;
            }
            let decode = (b * args.decode_steps) as f64 / t1.elapsed().as_secs_f64();
            if pi == 0 {
                float_ref.push((prefill, decode));
            }
            if plan == Residency::Dual {
                dual_numbers.insert(
                    format!("batch_{b}"),
                    serde_json::json!({"prefill_tok_s": prefill, "decode_tok_s": decode, "weights_mib": mib}),
                );
            }
            let (fp, fd) = float_ref[bi]; // the first plan listed (float by default)
            println!(
                "| {plan} | {mib:.1} | {b} | {prefill:.0} | {:.2} | {decode:.0} | {:.2} |",
                prefill / fp,
                decode / fd
            );
        }
    }
    let (kv, _) = cache(&cfg, 1, page);
    let (q, f) = (
        kv.bytes_per_token_layer(true) * cfg.num_hidden_layers,
        kv.bytes_per_token_layer(false) * cfg.num_hidden_layers,
    );
    println!();
    println!(
        "KV bytes per token (all layers): INT8 (C8) {q}, FP16 {f}, ratio {:.2}",
        q as f64 / f as f64
    );
    if let Some(path) = &args.json {
        let v = serde_json::json!({"prompt_len": args.prompt_len, "decode_steps": args.decode_steps, "dual": dual_numbers});
        std::fs::write(path, serde_json::to_string_pretty(&v)?)?;
    }
    if let Some(text) = &args.ppl_text {
        perplexity_section(&dir, &cfg, text, args.ppl_tokens)?;
    }
    if bundled {
        monitor_section(&dir, &cfg, &args)?;
    }
    if args.float_dtypes {
        float_dtype_section(&cfg)?;
    }
    if args.quant_formats {
        quant_format_section(&dir, &cfg, args.ppl_text.as_deref(), args.ppl_tokens)?;
    }
    if args.shadow_cost {
        shadow_cost_section(&dir, &cfg, &args)?;
    }
    println!();
    println!(
        "float copies stored as {}; peak RSS of this process {:.1} MiB",
        args.float_dtype.as_str(),
        peak_rss_mib().unwrap_or(f64::NAN)
    );
    Ok(())
}
