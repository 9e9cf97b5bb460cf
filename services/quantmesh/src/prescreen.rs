//! `quantmesh prescreen`: the offline pre-screen with a progress bar, the summary table
//! and the optional upload.

use std::path::PathBuf;

pub const PRESCREEN_HELP: &str = r#"Offline pre-screen.

For every linear group (q/k/v and gate/up scored together, as engines fuse them) it computes
  R       = (max - min) / (Q3 - Q1) of the weights (exact quartiles),
  KL      = KL(P || Q) of the group's output histogram on the calibration prompts, float
            weights vs pseudo-quantized ones, for w8a8, w8a8_per_channel and w4a16,
  energy  = sigma1^2 / sum(sigma_i^2) of the weights,
and input activation statistics (abs-max, kurtosis, quantile score, massive channels), then
classifies it: energy > 0.42 -> fp16; R < 10 and KL < 0.015 -> w8a8 (or w4a16);
R < 50 and KL(per-channel) < 0.05 -> w8a8_per_channel; otherwise fp16 (thresholds in --rules).

With --weight-budget (bytes like 100MiB, or a share of the all-16-bit model like 0.38x) it
then chooses each non-fp16 group's bits, 4 (w4a16) or 8, so that the resident weights fit:
the mix with the least summed loss (each group's error where it reaches the residual stream),
found exactly by a knapsack over the measured costs. The vocabulary tables are one more
candidate, 8 or 4 bits (their error measured on the embedding lookup and on the logits; a
4-bit choice is written as the plan's tables). Norms and fp16 groups count against it as they
are; float copies get what the chosen bits leave, up to 10 % of the 8-bit linear weights
(written as the plan's float_budget). A budget below the smallest plan (every group and the
tables in 4 bits) is rejected with the smallest that fits.

The checkpoint is memory-mapped and read in blocks of rows, one tensor at a time. Same inputs
and --timestamp give a byte-identical file. With --upload the file is stored under
versions/<md5>.json at the URL (never overwritten) and the `latest` pointer is moved to it;
the engine's --sensitive-layers can name that pointer."#;

#[derive(clap::Args)]
pub struct PrescreenArgs {
    /// Checkpoint: a .gguf file (or a directory holding one) or a Hugging Face directory
    /// (sharded checkpoints included).
    #[arg(long)]
    model: PathBuf,
    /// Calibration prompts: JSON lines ({"prompt": ...}) or one prompt per line
    /// [default: the bundled set, services/prescreen/calibration/prompts.jsonl].
    #[arg(long)]
    calibration: Option<PathBuf>,
    /// TOML rules file (thresholds, aggressive format, hook thresholds); keys as in
    /// infra/prescreen-rules.example.toml [default: the spec's rules].
    #[arg(long)]
    rules: Option<PathBuf>,
    /// Where to write sensitive_layers.json.
    #[arg(long)]
    out: PathBuf,
    /// Versioned object storage to publish to: file:///dir, or s3:// gs:// az:// in builds
    /// with `--features cloud`. Checked for writability before any work.
    #[arg(long)]
    upload: Option<String>,
    /// Use at most this many calibration prompts (0 = all).
    #[arg(long, default_value_t = 0)]
    max_prompts: usize,
    /// Truncate each calibration prompt to this many tokens.
    #[arg(long, default_value_t = quantmesh_prescreen::DEFAULT_TOKENS_PER_PROMPT)]
    max_tokens_per_prompt: usize,
    /// Compute the output KL on at most this many calibration tokens (evenly spaced);
    /// activation statistics and the float forward use all of them.
    #[arg(long, default_value_t = quantmesh_prescreen::DEFAULT_KL_TOKENS)]
    kl_tokens: usize,
    /// RFC 3339 timestamp to record instead of now (for reproducible output).
    #[arg(long)]
    timestamp: Option<String>,
    /// Fit each group's bits (4 or 8) to this many bytes of resident weights: bytes
    /// ("100MiB") or a share of the all-16-bit model ("0.38x") [default: the rules'
    /// classes as they are].
    #[arg(long)]
    weight_budget: Option<quantmesh_types::WeightBudget>,
    /// No progress bar.
    #[arg(long)]
    quiet: bool,
}

struct Bar(indicatif::ProgressBar);

impl quantmesh_prescreen::scan::Progress for Bar {
    fn tensor_done(&self, name: &str) {
        self.0.set_message(name.to_string());
        self.0.inc(1);
    }
}

pub fn run(args: PrescreenArgs) -> anyhow::Result<()> {
    use anyhow::Context;
    quantmesh_telemetry::init(quantmesh_settings::LogFormat::Text, "info");
    let rules = match &args.rules {
        Some(p) => {
            let text = std::fs::read_to_string(p)
                .with_context(|| format!("reading rules file {}", p.display()))?;
            quantmesh_prescreen::rules::Rules::from_toml(&text)
                .map_err(|e| anyhow::anyhow!("rules file {}: {e}", p.display()))?
        }
        None => Default::default(),
    };
    if let Some(t) = &args.timestamp {
        humantime::parse_rfc3339(t)
            .with_context(|| format!("--timestamp {t:?} is not RFC 3339"))?;
    }
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    // Fail before the long part when the upload target is unusable.
    let store = match &args.upload {
        Some(url) => {
            let s = quantmesh_store::VersionedStore::parse(url)?;
            rt.block_on(s.check_writable())?;
            Some(s)
        }
        None => None,
    };
    let mcfg = quantmesh_model::ModelConfig::load(&args.model)?;
    let bar = indicatif::ProgressBar::new((mcfg.num_hidden_layers * 7) as u64);
    if args.quiet {
        bar.set_draw_target(indicatif::ProgressDrawTarget::hidden());
    }
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "{elapsed_precise} [{bar:30}] {pos}/{len} tensors  {msg}",
        )
        .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    let opts = quantmesh_prescreen::Options {
        model: args.model.clone(),
        calibration: args.calibration.clone(),
        rules,
        max_prompts: args.max_prompts,
        max_tokens_per_prompt: args.max_tokens_per_prompt,
        kl_tokens: args.kl_tokens,
        timestamp: args.timestamp.clone().unwrap_or_else(|| {
            humantime::format_rfc3339_seconds(std::time::SystemTime::now()).to_string()
        }),
        weight_budget: args.weight_budget,
        hook_thresholds: true,
    };
    let t0 = std::time::Instant::now();
    let outcome = quantmesh_prescreen::run(&opts, &Bar(bar.clone()))?;
    bar.finish_and_clear();
    let secs = t0.elapsed().as_secs_f64();
    std::fs::write(&args.out, &outcome.bytes)
        .with_context(|| format!("writing {}", args.out.display()))?;
    println!("{}", quantmesh_prescreen::summary_table(&outcome));
    if let Some(b) = &outcome.bits {
        println!("{}", quantmesh_prescreen::bits_line(b));
    }
    println!(
        "scanned {:.1} MiB in {secs:.2}s ({:.1} MiB/s) with {} calibration tokens; wrote {}",
        outcome.bytes_scanned as f64 / (1u64 << 20) as f64,
        outcome.bytes_scanned as f64 / (1u64 << 20) as f64 / secs.max(1e-9),
        outcome.calibration_tokens,
        args.out.display()
    );
    if let Some(store) = store {
        let p = rt.block_on(store.publish(outcome.bytes.clone().into()))?;
        println!("uploaded {p}");
    }
    Ok(())
}
