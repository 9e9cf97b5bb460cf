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

mod formats;
mod memory;
mod monitor;

use formats::*;
use memory::*;
use monitor::*;

use quantmesh_engine::backend::cpu::LlamaModel;
use quantmesh_engine::backend::{
    Backend, EmbeddingDtype, FloatDtype, Forms, SplitActivations, StepInput,
};
use quantmesh_engine::budget::FloatBudget;
use quantmesh_engine::kv::{BlockManager, KvCache, KvScale};
use quantmesh_engine::precision::{PathMask, StepRunner};
use quantmesh_model::bundled::{init_model, InitOptions, ModelSize};
use quantmesh_model::ModelConfig;
use quantmesh_types::Residency;
use std::path::PathBuf;
use std::time::Instant;

/// Engine throughput and memory benchmark: prints tables whose ratios are against the float
/// plan measured in the same run.
#[derive(clap::Parser)]
#[command(
    name = "quantmesh-engine-bench",
    about = "Engine throughput and memory benchmark: tables of ratios against the float plan measured in the same run"
)]
struct Args {
    /// The bundled synthetic model to run when no --model is given: tiny, small or medium.
    #[arg(long, default_value = "small")]
    size: ModelSize,
    /// A GGUF file or Hugging Face directory to run instead of the bundled model.
    #[arg(long)]
    model: Option<PathBuf>,
    /// Text whose perplexity is measured on the float, INT8-only and monitor-driven plans
    /// (needed by --quant-formats and --memory-table for their quality columns).
    #[arg(long)]
    ppl_text: Option<PathBuf>,
    /// Tokens of --ppl-text to score.
    #[arg(long, default_value_t = 1024)]
    ppl_tokens: usize,
    /// Write the dual plan's numbers (what `quantmesh serve` runs) to this JSON file.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Plans of the throughput table (comma-separated residencies).
    #[arg(long, value_delimiter = ',', default_value = "float,int8,dual")]
    plans: Vec<Residency>,
    /// Prompt tokens per sequence.
    #[arg(long, default_value_t = 128)]
    prompt_len: usize,
    /// Decode steps per batch.
    #[arg(long, default_value_t = 32)]
    decode_steps: usize,
    /// Batch sizes of the decode table (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "1,8,32")]
    batches: Vec<usize>,
    /// Also time every linear group on its own.
    #[arg(long)]
    per_group: bool,
    /// How float copies are stored: f16, bf16 or f32.
    #[arg(long, default_value = "f16", value_parser = float_dtype)]
    float_dtype: FloatDtype,
    /// How the vocabulary tables are stored: q8_0, f16 or f32 (the bench loads tables
    /// directly, so `auto`, which needs a plan's budget, is refused) [default: the engine's].
    #[arg(long, value_parser = embeddings)]
    embeddings: Option<EmbeddingDtype>,
    /// Split activations: off, copyless or all [default: the engine's].
    #[arg(long = "split-activations")]
    split: Option<SplitActivations>,
    /// C8 KV cache scales: token or head [default: the engine's].
    #[arg(long, value_parser = kv_scale)]
    kv_scale: Option<KvScale>,
    /// The float-copy dtype section (f16 / bf16 / f32 copies compared).
    #[arg(long)]
    float_dtypes: bool,
    /// The quantized-format section (with --ppl-text: their perplexity).
    #[arg(long)]
    quant_formats: bool,
    /// The memory table of this plan (needs --ppl-text).
    #[arg(long, requires = "ppl_text")]
    memory_table: Option<PathBuf>,
    /// Rows of the memory table to run (1-based, comma-separated; all when absent).
    #[arg(long, value_delimiter = ',')]
    memory_rows: Vec<usize>,
    /// The memory table's float budget (bytes, or a share of the INT8 weights like 10%).
    #[arg(long, default_value = "10%")]
    float_budget: FloatBudget,
    /// The shadow pass's cost section.
    #[arg(long)]
    shadow_cost: bool,
}

impl Args {
    /// How float copies and vocabulary tables are stored (`--float-dtype`, `--embeddings`).
    fn forms(&self) -> Forms {
        Forms {
            float: self.float_dtype,
            embeddings: self.embeddings.unwrap_or_default(),
            split: self.split.unwrap_or_default(),
        }
    }
}

fn float_dtype(s: &str) -> Result<FloatDtype, String> {
    match s {
        "f16" => Ok(FloatDtype::F16),
        "bf16" => Ok(FloatDtype::Bf16),
        "f32" => Ok(FloatDtype::F32),
        other => Err(format!("{other:?}: f16, bf16 or f32")),
    }
}

fn embeddings(s: &str) -> Result<EmbeddingDtype, String> {
    match s.parse()? {
        EmbeddingDtype::Auto => Err("auto needs a plan's budget: give q8_0, f16 or f32".into()),
        d => Ok(d),
    }
}

fn kv_scale(s: &str) -> Result<KvScale, String> {
    match s {
        "token" => Ok(KvScale::Token),
        "head" => Ok(KvScale::Head),
        other => Err(format!("{other:?}: token or head")),
    }
}

/// C8 scales of every cache the bench makes (`--kv-scale`; set once at start).
static KV_SCALE: std::sync::OnceLock<KvScale> = std::sync::OnceLock::new();

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
    let args = <Args as clap::Parser>::parse();
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
