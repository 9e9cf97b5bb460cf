//! Engine throughput and memory benchmark. Prints a table; ratios are against the float
//! plan measured in the same run.
//!
//! ```text
//! cargo run --release -p quantmesh-engine --bin quantmesh-engine-bench -- \
//!     [--size tiny|small|medium] [--prompt-len 128] [--decode-steps 32] [--batches 1,8,32]
//! ```

use quantmesh_engine::block_manager::BlockManager;
use quantmesh_engine::bundled::{init_model, InitOptions, ModelSize};
use quantmesh_engine::config::{KvFloatDtype, ModelConfig};
use quantmesh_engine::kv_cache::KvCache;
use quantmesh_engine::model::{LlamaModel, SeqChunk, StepInput};
use quantmesh_engine::PathMask;
use quantmesh_shared::Residency;
use std::time::Instant;

struct Args {
    size: ModelSize,
    prompt_len: usize,
    decode_steps: usize,
    batches: Vec<usize>,
}

fn parse() -> Result<Args, String> {
    let mut a = Args {
        size: ModelSize::Small,
        prompt_len: 128,
        decode_steps: 32,
        batches: vec![1, 8, 32],
    };
    let mut it = std::env::args().skip(1);
    while let Some(k) = it.next() {
        let mut v = || it.next().ok_or(format!("{k} needs a value"));
        match k.as_str() {
            "--size" => a.size = v()?.parse()?,
            "--prompt-len" => {
                a.prompt_len = v()?.parse().map_err(|e| format!("--prompt-len: {e}"))?
            }
            "--decode-steps" => {
                a.decode_steps = v()?.parse().map_err(|e| format!("--decode-steps: {e}"))?
            }
            "--batches" => {
                a.batches = v()?
                    .split(',')
                    .map(|s| s.parse().map_err(|e| format!("--batches: {e}")))
                    .collect::<Result<_, _>>()?
            }
            "-h" | "--help" => {
                println!("quantmesh-engine-bench [--size tiny|small|medium] [--prompt-len N] [--decode-steps N] [--batches 1,8,32]");
                std::process::exit(0);
            }
            other => return Err(format!("unknown argument {other}")),
        }
    }
    Ok(a)
}

fn step_for(bm: &mut BlockManager, seqs: &[(u64, Vec<u32>)]) -> StepInput {
    let mut step = StepInput::default();
    for (id, toks) in seqs {
        let start = bm.num_tokens(*id).unwrap_or(0);
        let out = bm.append(*id, toks.len()).expect("reserved");
        step.copies.extend(out.copies);
        step.chunks.push(SeqChunk {
            seq: *id,
            tokens: toks.clone(),
            start_pos: start,
            slots: out.slots,
            block_table: bm.block_table(*id).unwrap_or_default().to_vec(),
            want_logits: true,
        });
    }
    step
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = parse()?;
    let dir = std::env::temp_dir().join(format!("quantmesh-bench-{:?}", args.size).to_lowercase());
    if !quantmesh_engine::bundled::model_present(&dir) {
        eprintln!("writing bundled {:?} model to {}", args.size, dir.display());
        init_model(
            &dir,
            &InitOptions {
                size: args.size,
                ..Default::default()
            },
        )?;
    }
    let cfg = ModelConfig::from_file(&dir.join("config.json"))?;
    println!(
        "model {:?}: hidden {}, layers {}, intermediate {}; prompt {} tokens, {} decode steps",
        args.size,
        cfg.hidden_size,
        cfg.num_hidden_layers,
        cfg.intermediate_size,
        args.prompt_len,
        args.decode_steps
    );
    let page = 16;
    let max_b = args.batches.iter().copied().max().unwrap_or(1);
    let pages = max_b * (args.prompt_len + args.decode_steps).div_ceil(page) + 8;
    println!();
    println!("| plan | weights MiB | batch | prefill tok/s | × float | decode tok/s | × float |");
    println!("|---|---|---|---|---|---|---|");
    let mut float_ref: Vec<(f64, f64)> = Vec::new();
    for (pi, plan) in [Residency::Float, Residency::Int8, Residency::Dual]
        .into_iter()
        .enumerate()
    {
        let model = LlamaModel::load(&dir, &cfg, &|_| plan)?;
        let mib = model.resident_bytes() as f64 / (1 << 20) as f64;
        // Warm-up (thread pools, page faults of the freshly loaded weights), untimed.
        {
            let mut kv = KvCache::new(
                cfg.num_hidden_layers,
                8,
                page,
                cfg.kv_dim(),
                KvFloatDtype::F16,
            );
            let mut bm = BlockManager::new(8, page, false);
            bm.admit(u64::MAX, &[], 64).map_err(|e| e.to_string())?;
            let step = step_for(&mut bm, &[(u64::MAX, (0..32).collect())]);
            model.forward(&step, &PathMask::default(), &mut kv, true)?;
        }
        for (bi, &b) in args.batches.iter().enumerate() {
            let mut kv = KvCache::new(
                cfg.num_hidden_layers,
                pages,
                page,
                cfg.kv_dim(),
                KvFloatDtype::F16,
            );
            let mut bm = BlockManager::new(pages, page, false);
            let mask = PathMask::default();
            let prompts: Vec<(u64, Vec<u32>)> = (0..b as u64)
                .map(|i| {
                    (
                        i,
                        (0..args.prompt_len as u32)
                            .map(|t| (t * 7 + i as u32) % 256)
                            .collect(),
                    )
                })
                .collect();
            for (id, p) in &prompts {
                bm.admit(*id, p, args.decode_steps)
                    .map_err(|e| e.to_string())?;
            }
            let t0 = Instant::now();
            let step = step_for(&mut bm, &prompts);
            model.forward(&step, &mask, &mut kv, true)?;
            let prefill = (b * args.prompt_len) as f64 / t0.elapsed().as_secs_f64();
            let t1 = Instant::now();
            for s in 0..args.decode_steps {
                let toks: Vec<(u64, Vec<u32>)> = (0..b as u64)
                    .map(|i| (i, vec![(s as u32 + i as u32) % 256]))
                    .collect();
                let step = step_for(&mut bm, &toks);
                model.forward(&step, &mask, &mut kv, true)?;
            }
            let decode = (b * args.decode_steps) as f64 / t1.elapsed().as_secs_f64();
            if pi == 0 {
                float_ref.push((prefill, decode));
            }
            let (fp, fd) = float_ref[bi];
            println!(
                "| {plan} | {mib:.1} | {b} | {prefill:.0} | {:.2} | {decode:.0} | {:.2} |",
                prefill / fp,
                decode / fd
            );
        }
    }
    let kv = KvCache::new(
        cfg.num_hidden_layers,
        1,
        page,
        cfg.kv_dim(),
        KvFloatDtype::F16,
    );
    let (q, f) = (
        kv.bytes_per_token_layer(true) * cfg.num_hidden_layers,
        kv.bytes_per_token_layer(false) * cfg.num_hidden_layers,
    );
    println!();
    println!(
        "KV bytes per token (all layers): INT8 (C8) {q}, FP16 {f}, ratio {:.2}",
        q as f64 / f as f64
    );
    Ok(())
}
