//! `quantmesh-monitor-eval`: the monitor's evaluation suite (see
//! `quantmesh_engine_tools`). Writes a family of planted-truth checkpoints, serves each
//! through the real engine with ordinary traffic, and prints what the monitor did against
//! what was planted.

use quantmesh_engine::backend::SplitActivations;
use quantmesh_engine_tools::{run_case, table, EvalOptions};
use quantmesh_model::recipe::Recipe;
use quantmesh_types::PrecisionClass;
use std::path::PathBuf;

/// Score the activation monitor on planted-truth checkpoints, or report it on a real one.
#[derive(clap::Parser)]
#[command(
    name = "quantmesh-monitor-eval",
    about = "Score the activation monitor on planted-truth checkpoints (or, with --model, report it on a real checkpoint)",
    after_help = "Set QUANTMESH_EVAL_VERBOSE=1 to print every group's final statistics."
)]
struct Args {
    /// Models in the family (every third has nothing planted).
    #[arg(long = "models", default_value_t = 12)]
    n: usize,
    /// Family seed.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Ordinary requests per model [default: 200].
    #[arg(long)]
    requests: Option<usize>,
    /// Requests per monitor window [default: 20].
    #[arg(long)]
    window: Option<usize>,
    /// The outlier rule's relative floor [default: the monitor's, 1.0].
    #[arg(long)]
    min_excess: Option<f64>,
    /// The outlier rule's k [default: 4].
    #[arg(long)]
    k: Option<f64>,
    /// Where to write the checkpoints [default: a temporary directory, removed after].
    #[arg(long)]
    dir: Option<PathBuf>,
    /// Run only model I of the family (0-based).
    #[arg(long)]
    only: Option<usize>,
    /// Instead: serve a real checkpoint (Hugging Face directory or GGUF) with ordinary chat
    /// traffic and report per-group statistics, fallbacks and KL.
    #[arg(long)]
    model: Option<PathBuf>,
    /// With --model: also rank every group by its own KL contribution, compare the
    /// monitor's float set with the oracle's at the same float parameters, and rank the
    /// groups by their measured harm against the oracle at 5–40 % float.
    #[arg(long, requires = "model")]
    oracle: bool,
    /// Which quantized rows carry split activations: off, copyless or all [default: off for
    /// the planted family, whose truth is 8-bit activation harm; the engine's default, all,
    /// for --model].
    #[arg(long = "split-activations")]
    split: Option<SplitActivations>,
    /// Serve every group as this class, each with an exact float copy: w8a8 (the default),
    /// w4a16 (4-bit weights), w8a8_per_channel or fp16.
    #[arg(long, value_parser = class)]
    class: Option<PrecisionClass>,
}

fn class(s: &str) -> Result<PrecisionClass, String> {
    serde_json::from_value(serde_json::Value::String(s.to_string()))
        .map_err(|_| format!("{s:?} is not w4a16, w8a8, w8a8_per_channel or fp16"))
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = <Args as clap::Parser>::parse();
    let mut opts = EvalOptions::default();
    if let Some(r) = args.requests {
        opts.requests = r;
    }
    if let Some(w) = args.window {
        opts.monitor.window_requests = w;
    }
    if let Some(e) = args.min_excess {
        opts.monitor.min_excess = e;
    }
    if let Some(k) = args.k {
        opts.monitor.k = k;
    }
    if let Some(c) = args.class {
        opts.class = c;
    }
    let (n, seed, dir, only, model, oracle) = (
        args.n,
        args.seed,
        args.dir,
        args.only,
        args.model,
        args.oracle,
    );
    let split_given = args.split.is_some();
    if let Some(s) = args.split {
        opts.split = s;
    }
    if let Some(m) = model {
        if !split_given {
            opts.split = SplitActivations::default();
        }
        let sys = actix::System::new();
        let text = sys.block_on(quantmesh_engine_tools::real_model_report(&m, &opts, oracle))?;
        println!("Monitor on {} (no planted truth):\n\n{text}", m.display());
        return Ok(());
    }
    let scratch = dir.is_none();
    let root = dir.unwrap_or_else(|| {
        std::env::temp_dir().join(format!("quantmesh-monitor-eval-{}", std::process::id()))
    });
    let mut recipes = Recipe::family(seed, n);
    if let Some(i) = only {
        recipes = recipes.into_iter().skip(i).take(1).collect();
    }
    let sys = actix::System::new();
    let cases = sys.block_on(async {
        let mut cases = Vec::new();
        for (i, r) in recipes.iter().enumerate() {
            let t = std::time::Instant::now();
            let case = run_case(&root.join(&r.name), r, &opts).await?;
            eprintln!(
                "[{}/{}] {} ({:.1} s): fell back {:?}, planted {:?}",
                i + 1,
                recipes.len(),
                r.name,
                t.elapsed().as_secs_f64(),
                case.fell_back,
                case.planted_sensitive
            );
            cases.push(case);
        }
        Ok::<_, quantmesh_engine::error::EngineError>(cases)
    });
    if scratch {
        let _ = std::fs::remove_dir_all(&root);
    }
    let cases = cases?;
    println!(
        "Monitor evaluation: {} models (family seed {seed}), {} requests each, window {} requests, k {}, min_excess {}:\n",
        cases.len(),
        opts.requests,
        opts.monitor.window_requests,
        opts.monitor.k,
        opts.monitor.min_excess
    );
    print!("{}", table(&cases));
    Ok(())
}
