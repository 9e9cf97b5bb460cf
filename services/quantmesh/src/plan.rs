//! `quantmesh plan`: work with `sensitive_layers.json` files outside a server — check one
//! against a model, publish a reviewed one (a merged evolution pull request) where the
//! engines poll.

use anyhow::Context as _;
use std::path::PathBuf;

#[derive(clap::Subcommand)]
pub enum PlanCommand {
    /// Validate a plan (schema, and with --model the model's layer names, shapes and channel
    /// ranges — exactly what a hot reload checks) and print its classes.
    Check(CheckArgs),
    /// Validate a plan, then publish it to a versioned store: versions/<md5>.json (never
    /// overwritten) and the `latest` pointer the engines follow (--sensitive-layers
    /// <store>/latest). Idempotent: publishing the same bytes again changes nothing.
    Publish(PublishArgs),
}

#[derive(clap::Args)]
pub struct CheckArgs {
    /// The sensitive_layers.json to check.
    file: PathBuf,
    /// The model directory it is for (its checkpoint and config.json).
    #[arg(long)]
    model: Option<PathBuf>,
}

#[derive(clap::Args)]
pub struct PublishArgs {
    /// The sensitive_layers.json to publish.
    file: PathBuf,
    /// Versioned store: file:///dir, or s3:// gs:// az:// in builds with `--features cloud`.
    #[arg(long)]
    to: String,
    /// Validate against this model directory first (recommended).
    #[arg(long)]
    model: Option<PathBuf>,
}

fn validate(file: &PathBuf, model: Option<&PathBuf>) -> anyhow::Result<(Vec<u8>, String)> {
    let bytes = std::fs::read(file).with_context(|| format!("reading {}", file.display()))?;
    let plan = match model {
        Some(dir) => {
            let ck = quantmesh_model::Checkpoint::open(dir)
                .with_context(|| format!("opening the checkpoint in {}", dir.display()))?;
            let cfg = quantmesh_model::ModelConfig::load(dir)
                .with_context(|| format!("reading config.json in {}", dir.display()))?;
            let shape = quantmesh_model::model_shape(&ck, &cfg)?;
            quantmesh_types::SensitiveLayers::parse_for(&bytes, &shape)
                .with_context(|| format!("{} does not fit {}", file.display(), dir.display()))?
                .file
        }
        None => quantmesh_types::SensitiveLayers::parse(&bytes)
            .with_context(|| format!("{} is not a valid sensitive_layers.json", file.display()))?,
    };
    let mut classes = std::collections::BTreeMap::<String, usize>::new();
    for g in plan.groups.values() {
        *classes
            .entry(quantmesh_types::wire_name(&g.class))
            .or_default() += 1;
    }
    let summary = format!(
        "{} groups ({}), md5 {:x}",
        plan.groups.len(),
        classes
            .iter()
            .map(|(c, n)| format!("{n} {c}"))
            .collect::<Vec<_>>()
            .join(", "),
        md5::compute(&bytes)
    );
    Ok((bytes, summary))
}

pub fn run(cmd: PlanCommand) -> anyhow::Result<()> {
    match cmd {
        PlanCommand::Check(a) => {
            let (_, summary) = validate(&a.file, a.model.as_ref())?;
            println!("{}: valid; {summary}", a.file.display());
            Ok(())
        }
        PlanCommand::Publish(a) => {
            let (bytes, summary) = validate(&a.file, a.model.as_ref())?;
            let store = quantmesh_store::VersionedStore::parse(&a.to)?;
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()?;
            let p = rt.block_on(store.publish(bytes.into()))?;
            println!("published {p}; {summary}");
            Ok(())
        }
    }
}
