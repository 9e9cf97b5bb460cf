//! Engine throughput and memory benchmark. Prints a table; ratios are against the float
//! plan measured in the same run.
//!
//! ```text
//! cargo run --release -p quantmesh-engine --bin quantmesh-engine-bench -- \
//!     [--size tiny|small|medium | --model PATH] [--prompt-len 128] [--decode-steps 32]
//!     [--batches 1,8,32] [--ppl-text FILE --ppl-tokens 1024] [--json FILE]
//! ```
//!
//! With `--model` (a GGUF file or Hugging Face directory) the throughput table runs on that
//! model, and with `--ppl-text` perplexity is measured on the float, INT8-only and
//! monitor-driven plans. `--json` writes the dual plan's numbers (what `quantmesh serve`
//! runs) for scripts/bench-llamacpp.sh.

use quantmesh_engine::backend::cpu::LlamaModel;
use quantmesh_engine::backend::{Backend, FloatDtype, StepInput};
use quantmesh_engine::kv::{BlockManager, KvCache};
use quantmesh_engine::precision::{PathMask, StepRunner};
use quantmesh_model::bundled::{init_model, InitOptions, ModelSize};
use quantmesh_model::ModelConfig;
use quantmesh_types::Residency;
use std::time::Instant;

struct Args {
    size: ModelSize,
    model: Option<std::path::PathBuf>,
    ppl_text: Option<std::path::PathBuf>,
    ppl_tokens: usize,
    json: Option<std::path::PathBuf>,
    plans: Vec<Residency>,
    prompt_len: usize,
    decode_steps: usize,
    batches: Vec<usize>,
    per_group: bool,
    float_dtype: FloatDtype,
    embeddings: quantmesh_engine::backend::EmbeddingDtype,
    float_dtypes: bool,
    quant_formats: bool,
    memory_table: Option<std::path::PathBuf>,
    shadow_cost: bool,
    /// Rows of the memory table to run (1-based; empty = all).
    memory_rows: Vec<usize>,
    float_budget: quantmesh_engine::budget::FloatBudget,
    split: quantmesh_engine::backend::SplitActivations,
}

impl Args {
    /// How float copies and vocabulary tables are stored (`--float-dtype`, `--embeddings`).
    fn forms(&self) -> quantmesh_engine::backend::Forms {
        quantmesh_engine::backend::Forms {
            float: self.float_dtype,
            embeddings: self.embeddings,
            split: self.split,
        }
    }
}

fn parse() -> Result<Args, String> {
    let mut a = Args {
        size: ModelSize::Small,
        model: None,
        ppl_text: None,
        ppl_tokens: 1024,
        json: None,
        plans: vec![Residency::Float, Residency::Int8, Residency::Dual],
        prompt_len: 128,
        decode_steps: 32,
        batches: vec![1, 8, 32],
        per_group: false,
        float_dtype: FloatDtype::F16,
        embeddings: Default::default(),
        float_dtypes: false,
        quant_formats: false,
        memory_table: None,
        shadow_cost: false,
        memory_rows: Vec::new(),
        float_budget: quantmesh_engine::budget::FloatBudget::Percent(10.0),
        split: Default::default(),
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
            "--per-group" => a.per_group = true,
            "--float-dtypes" => a.float_dtypes = true,
            "--shadow-cost" => a.shadow_cost = true,
            "--memory-rows" => {
                a.memory_rows = v()?
                    .split(',')
                    .map(|s| s.parse().map_err(|e| format!("--memory-rows: {e}")))
                    .collect::<Result<_, _>>()?
            }
            "--quant-formats" => a.quant_formats = true,
            "--memory-table" => a.memory_table = Some(v()?.into()),
            "--float-budget" => a.float_budget = v()?.parse()?,
            "--kv-scale" => {
                use quantmesh_engine::kv::KvScale;
                let scale = match v()?.as_str() {
                    "token" => KvScale::Token,
                    "head" => KvScale::Head,
                    other => return Err(format!("--kv-scale {other:?}: token or head")),
                };
                KV_SCALE
                    .set(scale)
                    .map_err(|_| "--kv-scale given twice".to_string())?;
            }
            "--split-activations" => {
                a.split = v()?
                    .parse()
                    .map_err(|e| format!("--split-activations: {e}"))?
            }
            "--embeddings" => {
                use quantmesh_engine::backend::EmbeddingDtype;
                a.embeddings = match v()?.parse() {
                    // The bench loads tables directly; `auto` needs a plan's budget.
                    Ok(EmbeddingDtype::Auto) => {
                        return Err("--embeddings auto: give q8_0, f16 or f32".into())
                    }
                    Ok(d) => d,
                    Err(e) => return Err(format!("--embeddings: {e}")),
                }
            }
            "--float-dtype" => {
                a.float_dtype = match v()?.as_str() {
                    "f16" => FloatDtype::F16,
                    "bf16" => FloatDtype::Bf16,
                    "f32" => FloatDtype::F32,
                    other => return Err(format!("--float-dtype {other:?}: f16, bf16 or f32")),
                }
            }
            "--model" => a.model = Some(v()?.into()),
            "--ppl-text" => a.ppl_text = Some(v()?.into()),
            "--ppl-tokens" => {
                a.ppl_tokens = v()?.parse().map_err(|e| format!("--ppl-tokens: {e}"))?
            }
            "--json" => a.json = Some(v()?.into()),
            "--plans" => {
                a.plans = v()?
                    .split(',')
                    .map(|s| s.parse().map_err(|e| format!("--plans: {e}")))
                    .collect::<Result<_, _>>()?
            }
            "-h" | "--help" => {
                println!("quantmesh-engine-bench [--size tiny|small|medium | --model PATH] [--prompt-len N] [--decode-steps N] [--batches 1,8,32] [--per-group] [--ppl-text FILE] [--ppl-tokens N] [--json FILE] [--plans float,int8,dual] [--float-dtype f16|bf16|f32] [--embeddings q8_0|f16|f32] [--split-activations off|copyless|all] [--kv-scale token|head] [--float-dtypes] [--quant-formats [--ppl-text FILE]] [--memory-table PLAN.json --ppl-text FILE [--float-budget 10%] [--memory-rows 2,3,4]] [--shadow-cost]");
                std::process::exit(0);
            }
            other => return Err(format!("unknown argument {other}")),
        }
    }
    Ok(a)
}

/// C8 scales of every cache the bench makes (`--kv-scale`; set once at start).
static KV_SCALE: std::sync::OnceLock<quantmesh_engine::kv::KvScale> = std::sync::OnceLock::new();

fn cache(cfg: &ModelConfig, pages: usize, page: usize) -> (KvCache, BlockManager) {
    let scale = KV_SCALE.get().copied().unwrap_or_default();
    quantmesh_engine::evaluation::scratch_cache_with(cfg, pages, page, scale)
}

/// `b` synthetic prompts of printable tokens, admitted with room for `decode_steps` more.
fn admit_batch(
    bm: &mut BlockManager,
    b: usize,
    prompt_len: usize,
    decode_steps: usize,
) -> Result<Vec<(u64, Vec<u32>)>, String> {
    let prompts: Vec<(u64, Vec<u32>)> = (0..b as u64)
        .map(|i| {
            (
                i,
                (0..prompt_len as u32)
                    .map(|t| 32 + (t * 7 + i as u32) % 90)
                    .collect(),
            )
        })
        .collect();
    for (id, p) in &prompts {
        bm.admit(*id, p, decode_steps).map_err(|e| e.to_string())?;
    }
    Ok(prompts)
}

fn step_for(bm: &mut BlockManager, seqs: &[(u64, Vec<u32>)]) -> StepInput {
    quantmesh_engine::evaluation::step_for(bm, seqs).expect("reserved")
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    quantmesh_engine::api::leave_the_cores_to_the_kernel_pool();
    let args = parse()?;
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
            let step = step_for(&mut bm, &prompts);
            runner.run(&model, &step, &mask, &mut kv, true)?;
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

/// Run the activation monitor over `requests` (each its own sequence, `rounds` times, every
/// group dual-resident) as served traffic; returns it and the mask it publishes.
fn watch(
    model: &LlamaModel,
    cfg: &ModelConfig,
    mcfg: quantmesh_engine::monitor::MonitorConfig,
    requests: &[Vec<u32>],
    rounds: u64,
) -> Result<(quantmesh_engine::monitor::Monitor, PathMask), Box<dyn std::error::Error>> {
    use quantmesh_types::{GroupId, GroupKind};
    let residencies: Vec<(GroupId, Residency)> = (0..cfg.num_hidden_layers)
        .flat_map(|l| GroupKind::ALL.map(|k| (GroupId::new(l, k), Residency::Dual)))
        .collect();
    let mut monitor = quantmesh_engine::monitor::Monitor::new(mcfg, "bench", &residencies);
    // The harm test's column errors, as the engine gives them (the model here runs plain
    // W8A8 rows, so activation spikes count too: the monitor's default).
    monitor.set_column_errors(residencies.iter().map(|(g, _)| {
        (
            *g,
            quantmesh_engine::backend::Backend::column_error(model, *g),
        )
    }));
    let mut runner = StepRunner::default();
    let page = 16;
    for round in 0..rounds {
        for (i, ids) in requests.iter().enumerate() {
            let mut mask = PathMask::default();
            monitor.apply_to(&mut mask);
            let pages = ids.len().div_ceil(page) + 1;
            let (mut kv, mut bm) = cache(cfg, pages, page);
            let id = round * 1_000_000 + i as u64;
            bm.admit(id, &[], ids.len()).map_err(|e| e.to_string())?;
            let step = step_for(&mut bm, &[(id, ids.clone())]);
            let out = runner.run(model, &step, &mask, &mut kv, true)?;
            monitor.observe(&out);
            monitor.requests_finished(&[id]);
        }
    }
    let mut mask = PathMask::default();
    monitor.apply_to(&mut mask);
    Ok((monitor, mask))
}

/// Perplexity of `text` (its first `max_tokens` tokens, windows of 256, teacher-forced one
/// token per step) on the float plan, INT8 only, and the plan the activation monitor
/// reaches after watching the first half of the text.
fn perplexity_section(
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

fn detector(
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
fn monitor_section(
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
    let model = LlamaModel::load(dir, cfg, &|_| Residency::Dual)?;
    let mut runner = StepRunner::default();
    let page = 16;
    let b = 8usize;
    let pages = b * (args.prompt_len + args.decode_steps).div_ceil(page) + 8;
    let fallback = PathMask {
        detector: Some(detector(&model, cfg, &planted.massive_channels, 0.0)),
        ..PathMask::with_float_groups(sensitive.iter().copied())
    };
    let variants: Vec<(&str, PathMask)> = vec![
        ("monitoring off", PathMask::default()),
        (
            "monitoring on (stats, per-token check)",
            PathMask {
                detector: Some(detector(&model, cfg, &planted.massive_channels, 0.0)),
                ..Default::default()
            },
        ),
        (
            "monitoring on, harm test off (max_nsr = 0)",
            PathMask {
                detector: Some(std::sync::Arc::new({
                    let mut d = (*detector(&model, cfg, &planted.massive_channels, 0.0)).clone();
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
                detector: Some(detector(&model, cfg, &planted.massive_channels, 0.01)),
                ..Default::default()
            },
        ),
        (
            "monitoring on + sensitive group in fallback",
            fallback.clone(),
        ),
    ];
    println!();
    println!("Monitoring overhead (dual plan, batch {b}, prompt {} tokens, {} decode steps; 9 interleaved runs):", args.prompt_len, args.decode_steps);
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
            let o = runner.run(&model, &step, mask, &mut kv, true)?;
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
                let o = runner.run(&model, &step, mask, &mut kv, true)?;
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
    let (sums, n) =
        quantmesh_engine::evaluation::teacher_forced_kl_on(&model, cfg, &texts, &masks)?;
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
fn peak_rss_mib() -> Option<f64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kib: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib / 1024.0)
}

/// How fast and how exact a float copy is in each storage dtype, on this model's group
/// shapes: the float path casts its input to the weight's dtype, multiplies with candle's
/// CPU gemm, casts back. Errors are against the f32 product, relative to its abs-max.
fn float_dtype_section(cfg: &ModelConfig) -> Result<(), Box<dyn std::error::Error>> {
    use candle_core::quantized::{GgmlDType, QMatMul, QTensor};
    use candle_core::{DType, Device, Module, Tensor};
    use quantmesh_types::GroupKind;
    println!();
    println!("Float copy storage: matmul time per call (median of 15) and error vs f32:");
    println!();
    println!("| group | batch | f32 µs | f16 µs | × f32 | bf16 µs | × f32 | Q8_0 µs | × f32 | f16 rel. err | bf16 rel. err |");
    println!("|---|---|---|---|---|---|---|---|---|---|---|");
    let time =
        |f: &dyn Fn() -> candle_core::Result<Tensor>| -> Result<(f64, Tensor), candle_core::Error> {
            let mut v = Vec::new();
            let mut last = f()?;
            for _ in 0..15 {
                let t = Instant::now();
                last = f()?;
                v.push(t.elapsed().as_secs_f64() * 1e6);
            }
            v.sort_by(|a, b| a.total_cmp(b));
            Ok((v[v.len() / 2], last))
        };
    for kind in GroupKind::ALL {
        let out: usize = quantmesh_model::ops::member_shapes(cfg, kind)
            .iter()
            .map(|s| s[0])
            .sum();
        let inp = quantmesh_model::ops::member_shapes(cfg, kind)[0][1];
        let w = Tensor::randn(0f32, 0.02, (out, inp), &Device::Cpu)?;
        let (w16, wb16) = (w.to_dtype(DType::F16)?, w.to_dtype(DType::BF16)?);
        let q = QMatMul::from_qtensor(QTensor::quantize(&w, GgmlDType::Q8_0)?)?;
        for b in [1usize, 8, 32] {
            let x = Tensor::randn(0f32, 1.0, (b, inp), &Device::Cpu)?;
            let (t32, y32) = time(&|| x.matmul(&w.t()?))?;
            let (t16, y16) = time(&|| {
                x.to_dtype(DType::F16)?
                    .matmul(&w16.t()?)?
                    .to_dtype(DType::F32)
            })?;
            let (tb, yb) = time(&|| {
                x.to_dtype(DType::BF16)?
                    .matmul(&wb16.t()?)?
                    .to_dtype(DType::F32)
            })?;
            let (tq, _) = time(&|| q.forward(&x))?;
            let scale = y32.abs()?.max_all()?.to_scalar::<f32>()?.max(1e-12);
            let err = |y: &Tensor| -> candle_core::Result<f32> {
                Ok((y - &y32)?.abs()?.max_all()?.to_scalar::<f32>()? / scale)
            };
            println!(
                "| {} | {b} | {t32:.0} | {t16:.0} | {:.2} | {tb:.0} | {:.2} | {tq:.0} | {:.2} | {:.1e} | {:.1e} |",
                kind.name(),
                t16 / t32,
                tb / t32,
                tq / t32,
                err(&y16)?,
                err(&yb)?
            );
        }
    }
    Ok(())
}

/// The 4-bit candidates for `w4a16` against Q8_0, on the checkpoint's own weights: matmul
/// time per call (median of 15) at batch 1/8/32, output error against the f32 weights
/// (relative Frobenius norm, inputs N(0, 1)), bytes per weight; then, with a text, the whole
/// model with every group in each format (teacher-forced KL to the float model, perplexity).
fn quant_format_section(
    dir: &std::path::Path,
    cfg: &ModelConfig,
    text: Option<&std::path::Path>,
    max_tokens: usize,
) -> Result<(), Box<dyn std::error::Error>> {
    use candle_core::quantized::{GgmlDType, QMatMul, QTensor};
    use candle_core::{Device, Module, Tensor};
    use quantmesh_engine::backend::{GroupForm, QuantFormat};
    use quantmesh_types::{GroupId, GroupKind};
    let ck = quantmesh_model::Checkpoint::open(dir)?;
    println!();
    println!("Quantized forms on the checkpoint's weights (layer {}): matmul µs per call (median of 15), × Q8_0, relative output error:", cfg.num_hidden_layers / 2);
    println!();
    println!("| group [out × in] | batch | Q8_0 µs | Q4_0 µs | × Q8_0 | Q4_1 µs | × Q8_0 | Q4_K µs | × Q8_0 | err Q8_0 | err Q4_0 | err Q4_1 | err Q4_K |");
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|---|");
    let time = |q: &QMatMul, x: &Tensor| -> Result<(f64, Tensor), candle_core::Error> {
        let mut v = Vec::new();
        let mut last = q.forward(x)?;
        for _ in 0..15 {
            let t = Instant::now();
            last = q.forward(x)?;
            v.push(t.elapsed().as_secs_f64() * 1e6);
        }
        v.sort_by(|a, b| a.total_cmp(b));
        Ok((v[v.len() / 2], last))
    };
    for kind in GroupKind::ALL {
        let g = GroupId::new(cfg.num_hidden_layers / 2, kind);
        let w = quantmesh_model::ops::GroupWeights::load(&ck, cfg, g)?.weight;
        let (out, inp) = w.dims2()?;
        let mut forms = vec![
            ("Q8_0", Some(GgmlDType::Q8_0)),
            ("Q4_0", Some(GgmlDType::Q4_0)),
            ("Q4_1", Some(GgmlDType::Q4_1)),
        ];
        // Q4_K packs 256 weights per super-block: only rows that 256 divides.
        forms.push(("Q4_K", inp.is_multiple_of(256).then_some(GgmlDType::Q4K)));
        let qs: Vec<Option<QMatMul>> = forms
            .iter()
            .map(|(_, d)| {
                d.map(|d| QTensor::quantize(&w, d).and_then(QMatMul::from_qtensor))
                    .transpose()
            })
            .collect::<Result<_, _>>()?;
        for b in [1usize, 8, 32] {
            let x = Tensor::randn(0f32, 1.0, (b, inp), &Device::Cpu)?;
            let y32 = x.matmul(&w.t()?)?;
            let norm = y32.sqr()?.sum_all()?.to_scalar::<f32>()?.sqrt().max(1e-12);
            let mut times = Vec::new();
            let mut errs = Vec::new();
            for q in &qs {
                match q {
                    Some(q) => {
                        let (t, y) = time(q, &x)?;
                        times.push(Some(t));
                        errs.push(Some(
                            (y - &y32)?.sqr()?.sum_all()?.to_scalar::<f32>()?.sqrt() / norm,
                        ));
                    }
                    None => {
                        times.push(None);
                        errs.push(None);
                    }
                }
            }
            let t8 = times[0].unwrap_or(f64::NAN);
            let cell = |t: Option<f64>| match t {
                Some(t) => format!("{t:.0} | {:.2}", t / t8),
                None => "— | —".into(),
            };
            let e = |e: Option<f32>| e.map_or("—".into(), |e| format!("{e:.4}"));
            println!(
                "| {} [{out} × {inp}] | {b} | {t8:.0} | {} | {} | {} | {} | {} | {} | {} |",
                kind.name(),
                cell(times[1]),
                cell(times[2]),
                cell(times[3]),
                e(errs[0]),
                e(errs[1]),
                e(errs[2]),
                e(errs[3]),
            );
        }
    }
    println!();
    println!("Bytes per weight: Q8_0 1.0625, Q4_0 0.5625, Q4_1 0.625, Q4_K 0.5625; f16 2.");
    let Some(text) = text else {
        return Ok(());
    };
    let tok = quantmesh_model::tokenizer::TextTokenizer::load(dir)?;
    let mut ids = tok.encode(&std::fs::read_to_string(text)?, true)?;
    ids.truncate(max_tokens);
    let reference = LlamaModel::load(dir, cfg, &|_| Residency::Float)?;
    println!();
    println!("Every linear group in one quantized form ({} tokens, windows of {KL_WINDOW}, C8 KV; KL to the f32 float model, teacher-forced):", ids.len());
    println!();
    println!("| form | linear MiB | perplexity | mean KL | × Q8_0 KL |");
    println!("|---|---|---|---|---|");
    let mut kl8 = None;
    let served_w4 = |g: GroupId| {
        let in_dim = quantmesh_model::ops::member_shapes(cfg, g.kind)[0][1];
        QuantFormat::for_class(quantmesh_types::PrecisionClass::W4a16, in_dim)
    };
    let rows: [(&str, &dyn Fn(GroupId) -> QuantFormat); 3] = [
        ("q8_0 (w8a8)", &|_| QuantFormat::Q8_0),
        (
            "w4a16 as served (q4_k where 256 divides, else q4_0)",
            &served_w4,
        ),
        ("q4_0 everywhere", &|_| QuantFormat::Q4_0),
    ];
    for (label, quant) in rows {
        let form = |g: GroupId| GroupForm {
            residency: Residency::Int8,
            quant: quant(g),
        };
        let model = LlamaModel::load_planned(&ck, cfg, &form, Default::default())?;
        let w = model.weight_bytes();
        let (ppl, kls) = teacher_forced(&model, &reference, cfg, &ids, &PathMask::default(), true)?;
        let kl = KlSummary::of(&kls).mean;
        let base = *kl8.get_or_insert(kl);
        println!(
            "| {label} | {:.1} | {ppl:.3} | {kl:.5} | {:.2} |",
            (w.int8 + w.int4) as f64 / (1 << 20) as f64,
            kl / base
        );
    }
    Ok(())
}

/// Tokens per window of the teacher-forced KL/perplexity runs.
const KL_WINDOW: usize = 256;

/// Teacher-forced perplexity of `ids` on `model` under `mask`, and every token's next-token
/// KL to `reference` (run all-float, float KV), in windows of `KL_WINDOW` tokens, one token
/// per step. [`KlSummary`] reduces the KLs: the mean is carried by a few tokens, so
/// configurations are compared on the median and tail too.
fn teacher_forced(
    model: &LlamaModel,
    reference: &LlamaModel,
    cfg: &ModelConfig,
    ids: &[u32],
    mask: &PathMask,
    kv_int8: bool,
) -> Result<(f64, Vec<f64>), Box<dyn std::error::Error>> {
    let page = 16;
    let all_float = PathMask::all_groups_float(cfg.num_hidden_layers);
    let (mut runner, mut ref_runner) = (StepRunner::default(), StepRunner::default());
    let (mut nll, mut kls) = (0f64, Vec::with_capacity(ids.len()));
    for (wi, window) in ids.chunks(KL_WINDOW).enumerate() {
        let (mut kv, mut bm) = cache(cfg, KL_WINDOW.div_ceil(page) + 2, page);
        let (mut rkv, mut rbm) = cache(cfg, KL_WINDOW.div_ceil(page) + 2, page);
        let id = 1_000_000 + wi as u64;
        bm.admit(id, &[], KL_WINDOW).map_err(|e| e.to_string())?;
        rbm.admit(id, &[], KL_WINDOW).map_err(|e| e.to_string())?;
        for pair in window.windows(2) {
            let step = step_for(&mut bm, &[(id, vec![pair[0]])]);
            let logits = runner
                .run(model, &step, mask, &mut kv, kv_int8)?
                .logits
                .remove(0)
                .1;
            let rstep = step_for(&mut rbm, &[(id, vec![pair[0]])]);
            let want = ref_runner
                .run(reference, &rstep, &all_float, &mut rkv, false)?
                .logits
                .remove(0)
                .1;
            nll += quantmesh_model::ops::nll_logits(&logits, pair[1]);
            kls.push(quantmesh_model::ops::kl_logits(&want, &logits));
        }
    }
    let n = kls.len().max(1) as f64;
    Ok(((nll / n).exp(), kls))
}

/// A run's per-token KLs reduced: mean, median, p99 and the share of the total carried by
/// the worst 1 % of tokens.
struct KlSummary {
    mean: f64,
    median: f64,
    p99: f64,
    worst_share: f64,
}

impl KlSummary {
    fn of(kls: &[f64]) -> Self {
        let mut s = kls.to_vec();
        s.sort_by(f64::total_cmp);
        let total: f64 = s.iter().sum();
        // nearest rank; 0 for an empty run
        let at = |q: f64| {
            s.get(((s.len() as f64 - 1.0) * q).round().max(0.0) as usize)
                .copied()
                .unwrap_or(0.0)
        };
        let worst: f64 = s[s.len() - s.len().div_ceil(100)..].iter().sum();
        KlSummary {
            mean: total / s.len().max(1) as f64,
            median: at(0.5),
            p99: at(0.99),
            worst_share: worst / total.max(f64::MIN_POSITIVE),
        }
    }
}

fn rss_mib(key: &str) -> Option<f64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with(key))?;
    let kib: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib / 1024.0)
}

/// The memory configurations side by side on one text: resident bytes by form and against
/// all-f16, RSS growth at load, batch-1 prefill/decode speed, perplexity and mean next-token
/// KL to the exact f32 float model. Monitor-driven rows let the monitor watch the text as
/// served traffic first, then run under its mask (as `perplexity_section` does).
fn memory_table(
    dir: &std::path::Path,
    cfg: &ModelConfig,
    plan_path: &std::path::Path,
    text: &std::path::Path,
    args: &Args,
) -> Result<(), Box<dyn std::error::Error>> {
    use quantmesh_engine::backend::{EmbeddingDtype, Forms, SplitActivations};
    use quantmesh_engine::plan::resolve;
    /// Which mask a row runs under: the monitor's after watching the text, every group
    /// wanting float, or none (every group on its resident quantized form).
    #[derive(PartialEq)]
    enum Watch {
        Monitor,
        AllFloat,
        Nothing,
    }
    use quantmesh_types::{GroupId, SensitiveLayers};
    let tok = quantmesh_model::tokenizer::TextTokenizer::load(dir)?;
    let mut ids = tok.encode(&std::fs::read_to_string(text)?, true)?;
    ids.truncate(args.ppl_tokens);
    let ck = quantmesh_model::Checkpoint::open(dir)?;
    let shape = quantmesh_model::model_shape(&ck, cfg)?;
    let plan = SensitiveLayers::parse_for(&std::fs::read(plan_path)?, &shape)
        .map_err(|e| format!("{}: {e}", plan_path.display()))?;
    let base = quantmesh_engine::EngineConfig {
        float_budget: args.float_budget,
        ..Default::default()
    };
    let live = resolve(&base, cfg, Some((&plan, "plan")));
    let q = Forms {
        float: FloatDtype::F16,
        embeddings: EmbeddingDtype::Q8_0,
        split: SplitActivations::Off,
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
    type Resid = Box<dyn Fn(GroupId) -> Residency>;
    // (name, residency, forms, which mask, kv_int8)
    let configs: Vec<(String, Resid, Forms, Watch, bool)> = vec![
        (
            "all-f16 float".into(),
            Box::new(|_| Residency::Float),
            f16,
            Watch::AllFloat,
            false,
        ),
        (
            "all-dual f32 (previous default), monitor-driven".into(),
            Box::new(|_| Residency::Dual),
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
            Box::new({
                let r = live.residency.clone();
                move |g| r[&g]
            }),
            p,
            Watch::Monitor,
            true,
        ),
        (
            "INT8 only".into(),
            Box::new(|_| Residency::Int8),
            q,
            Watch::Nothing,
            true,
        ),
    ];
    // What each difference between the rows above costs, one change at a time: the float
    // copies' dtype and the vocabulary tables' form under the same plan, and the tables alone.
    let plan_resid = || -> Resid {
        let r = live.residency.clone();
        Box::new(move |g| r[&g])
    };
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
            Box::new(|_| Residency::Int8),
            Forms {
                split: SplitActivations::All,
                ..q
            },
            Watch::Nothing,
            true,
        ),
        (
            "INT8 only, f16 KV cache".into(),
            Box::new(|_| Residency::Int8),
            q,
            Watch::Nothing,
            false,
        ),
        (
            "all-f16 float, C8 KV cache".into(),
            Box::new(|_| Residency::Float),
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
            Box::new(|_| Residency::Int8),
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
    println!("| configuration | int8 / float / other MiB | total MiB | × all-f16 | RSS at load MiB | prefill tok/s (b1, 128) | decode tok/s (b1) | perplexity | mean KL | median KL | p99 KL | worst 1 % share |");
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|");
    for (name, resid, forms, mask_from, kv_int8) in configs {
        let rss0 = rss_mib("VmRSS:").unwrap_or(f64::NAN);
        let model = LlamaModel::load_from(&ck, cfg, &*resid, forms)?;
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
        // Speed: a 128-token prefill, then 32 decode steps, batch 1.
        let mut runner = StepRunner::default();
        let (prefill, decode) = {
            let (mut kv, mut bm) = cache(cfg, 16, page);
            bm.admit(7, &[], 200).map_err(|e| e.to_string())?;
            let prompt: Vec<u32> = ids.iter().copied().cycle().take(128).collect();
            let t = Instant::now();
            let step = step_for(&mut bm, &[(7, prompt)]);
            runner.run(&model, &step, &mask, &mut kv, kv_int8)?;
            let prefill = 128.0 / t.elapsed().as_secs_f64();
            let t = Instant::now();
            for i in 0..32u32 {
                let step = step_for(&mut bm, &[(7, vec![32 + i])]);
                runner.run(&model, &step, &mask, &mut kv, kv_int8)?;
            }
            (prefill, 32.0 / t.elapsed().as_secs_f64())
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
            "| {name} | {:.1} / {:.1} / {:.1} | {:.1} | {:.2} | {rss:.0} | {prefill:.0} | {decode:.1} | {:.3} | {:.5} | {p50:.5} | {p99:.4} | {:.0} % |",
            mib(w.int8),
            mib(w.float),
            mib(w.other),
            mib(w.total()),
            w.ratio_to_f16(),
            ppl,
            kl,
            100.0 * top
        );
    }
    Ok(())
}

/// What the shadow pass's exact reference costs on an INT8-only model: a batch-1 decode step
/// served, against the same step's reference pass (every group's weights from the checkpoint,
/// the first `cache` MiB of them kept), for a few cache sizes.
fn shadow_cost_section(
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
