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
    Serve(quantmesh_gateway::ServeFlags),
    /// Manage model checkpoints.
    #[command(subcommand)]
    Model(ModelCommand),
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

fn main() -> anyhow::Result<()> {
    match Cli::parse().command {
        Command::Serve(flags) => quantmesh_gateway::serve_main(&flags),
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
