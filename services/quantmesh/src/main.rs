//! `quantmesh`: the umbrella CLI.
//!
//! config → telemetry → build → serve → wait for a signal → drain with a timeout.

use anyhow::Context;
use clap::{Args, Parser, Subcommand};
use quantmesh_engine::bundled::{init_model, InitOptions, ModelSize, StoreDtype};
use quantmesh_gateway::settings::LogFormat;
use quantmesh_gateway::{run_embedded, shutdown_signal, telemetry, Settings};
use std::path::PathBuf;

#[derive(Parser)]
#[command(
    name = "quantmesh",
    version,
    about = "Serve quantized LLMs with online INT8→FP16 fallback.",
    long_about = "quantmesh serves Llama-family models with INT8 weights and an exact float copy of the layers that\n\
                  need one, switching precision per layer, token, request or batch while it runs.\n\n\
                  Quick start:\n  quantmesh serve            # writes the bundled model on first run, listens on 127.0.0.1:8080\n  \
                  curl -s localhost:8080/v1/completions -H 'content-type: application/json' \\\n       -d '{\"prompt\":\"Hello\",\"max_tokens\":16}'"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the embedded all-in-one stack: gateway and engine actors in one process.
    Serve(ServeArgs),
    /// Manage model checkpoints.
    #[command(subcommand)]
    Model(ModelCommand),
}

#[derive(Args)]
struct ServeArgs {
    /// TOML config file; keys as in infra/quantmesh.example.toml. Env `QUANTMESH_*` overrides
    /// the file, flags override both.
    #[arg(long, env = "QUANTMESH_CONFIG")]
    config: Option<PathBuf>,
    /// Address to listen on [default: 127.0.0.1].
    #[arg(long)]
    host: Option<String>,
    /// Port to listen on [default: 8080].
    #[arg(long)]
    port: Option<u16>,
    /// Model directory in Hugging Face layout [default: models/quantmesh-tiny]. The bundled
    /// model is written there on first run if it is empty.
    #[arg(long)]
    model: Option<PathBuf>,
    /// Name clients use in the `model` field [default: quantmesh-tiny].
    #[arg(long)]
    model_name: Option<String>,
    /// Residency of every linear group: int8 (smallest), dual (INT8 + exact float copy,
    /// switchable) or float [default: dual].
    #[arg(long)]
    residency: Option<quantmesh_shared::Residency>,
    /// Log format [default: text].
    #[arg(long, value_enum)]
    log_format: Option<LogFormat>,
}

#[derive(Subcommand)]
enum ModelCommand {
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

fn serve(a: ServeArgs) -> anyhow::Result<()> {
    let mut s = Settings::load(a.config.as_deref())?;
    if let Some(h) = a.host {
        s.server.host = h;
    }
    if let Some(p) = a.port {
        s.server.port = p;
    }
    if let Some(m) = a.model {
        s.model.dir = m;
    }
    if let Some(n) = a.model_name {
        s.model.name = n;
    }
    if let Some(r) = a.residency {
        s.engine.default_residency = r;
    }
    if let Some(f) = a.log_format {
        s.log.format = f;
    }
    telemetry::init(s.log.format, &s.log.level);
    s.validate()?;
    let listener = std::net::TcpListener::bind((s.server.host.as_str(), s.server.port))
        .with_context(|| format!("binding {}:{}", s.server.host, s.server.port))?;
    actix_rt::System::new().block_on(run_embedded(s, listener, shutdown_signal()))
}

fn main() -> anyhow::Result<()> {
    match Cli::parse().command {
        Command::Serve(a) => serve(a),
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
