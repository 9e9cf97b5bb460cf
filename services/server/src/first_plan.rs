//! The precision plan on first load. Served without a `sensitive_layers.json`, the gateway
//! runs the pre-screen on the loaded model once (bundled calibration prompts, progress in
//! the log), writes the result beside the model keyed by the md5 of the model's weight
//! files, and serves with it; the next start with the same files finds it and starts at
//! once. Different bytes (a new download, a re-quantized file) get a new plan, and so does a
//! release whose pre-screen chooses differently (`quantmesh_prescreen::PLAN_REVISION`).
//! Replicas that mount one model volume and start together pre-screen once: the first takes
//! a lock beside the plan, the others wait on it and reuse what it wrote.

use anyhow::Context;
use quantmesh_model::files::cache_dir;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::time::Instant;

/// What [`ensure`] found or made.
#[derive(Debug, Clone)]
pub struct FirstPlan {
    /// The plan file (`<model dir>/.quantmesh/sensitive_layers.<md5>.r<revision>.json`).
    pub path: PathBuf,
    /// The md5 of the model's weight files the plan is keyed by.
    pub model_md5: String,
    /// `true`: the pre-screen ran now; `false`: a cached plan was reused.
    pub computed: bool,
}

/// The weight files of a model path: the `.gguf` file, or a Hugging Face directory's
/// `*.safetensors`, sorted.
fn weight_files(model: &Path) -> anyhow::Result<Vec<PathBuf>> {
    if let Some(g) = quantmesh_model::gguf::find_gguf(model)? {
        return Ok(vec![g]);
    }
    let mut files: Vec<PathBuf> = std::fs::read_dir(model)
        .with_context(|| format!("reading {}", model.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .collect();
    files.sort();
    anyhow::ensure!(
        !files.is_empty(),
        "{}: no .gguf or .safetensors files to plan for",
        model.display()
    );
    Ok(files)
}

/// md5 over the bytes of `files` in order.
pub fn model_md5(files: &[PathBuf]) -> anyhow::Result<String> {
    let mut ctx = md5::Context::new();
    let mut buf = vec![0u8; 1 << 22];
    for f in files {
        let mut file =
            std::fs::File::open(f).with_context(|| format!("opening {}", f.display()))?;
        loop {
            let n = file
                .read(&mut buf)
                .with_context(|| format!("reading {}", f.display()))?;
            if n == 0 {
                break;
            }
            ctx.consume(&buf[..n]);
        }
    }
    Ok(format!("{:x}", ctx.finalize()))
}

/// (path, length, modification time in ns) of each file: what must not change for a
/// remembered md5 to still be the files' md5.
fn stamps(files: &[PathBuf]) -> anyhow::Result<Vec<(String, u64, u128)>> {
    files
        .iter()
        .map(|f| {
            let m = std::fs::metadata(f).with_context(|| format!("reading {}", f.display()))?;
            let mtime = m
                .modified()
                .ok()
                .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
                .map_or(0, |d| d.as_nanos());
            Ok((f.display().to_string(), m.len(), mtime))
        })
        .collect()
}

/// [`model_md5`], remembered in `dir/weights.md5.json` against the files' stamps, so a
/// later start over unchanged files does not read gigabytes again.
fn stamped_md5(files: &[PathBuf], dir: &Path) -> anyhow::Result<String> {
    #[derive(serde::Serialize, serde::Deserialize)]
    struct Remembered {
        stamps: Vec<(String, u64, u128)>,
        md5: String,
    }
    let path = dir.join("weights.md5.json");
    let now = stamps(files)?;
    if let Some(r) = std::fs::read(&path)
        .ok()
        .and_then(|b| serde_json::from_slice::<Remembered>(&b).ok())
    {
        if r.stamps == now {
            return Ok(r.md5);
        }
    }
    let md5 = model_md5(files)?;
    let bytes = serde_json::to_vec(&Remembered {
        stamps: now,
        md5: md5.clone(),
    })?;
    // Best effort: a read-only model directory only costs the hash next time.
    let _ = std::fs::create_dir_all(dir).and_then(|()| std::fs::write(&path, bytes));
    Ok(md5)
}

/// Logs the pre-screen's progress every tenth of the way.
struct LogProgress {
    total: usize,
    done: std::sync::atomic::AtomicUsize,
    started: Instant,
}

impl quantmesh_prescreen::scan::Progress for LogProgress {
    fn tensor_done(&self, name: &str) {
        let n = self.done.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1;
        let step = (self.total / 10).max(1);
        if n.is_multiple_of(step) || n == self.total {
            tracing::info!(
                tensors = n,
                of = self.total,
                last = name,
                seconds = self.started.elapsed().as_secs_f64(),
                "first-load plan: pre-screen progress"
            );
        }
    }
}

/// The cached plan at `path`, if it is there and parses.
fn cached(path: &Path, md5: &str) -> Option<FirstPlan> {
    if !path.is_file() {
        return None;
    }
    let read = std::fs::read(path)
        .map_err(|e| e.to_string())
        .and_then(|b| quantmesh_types::SensitiveLayers::parse(&b).map_err(|e| e.to_string()));
    match read {
        Ok(_) => {
            tracing::info!(plan = %path.display(), model_md5 = %md5, "first-load plan: reusing the cached plan");
            Some(FirstPlan {
                path: path.to_path_buf(),
                model_md5: md5.to_string(),
                computed: false,
            })
        }
        Err(e) => {
            tracing::warn!(plan = %path.display(), error = %e, "first-load plan: the cached plan is unreadable; computing it again");
            None
        }
    }
}

/// Where [`lock_plan`] locks for the plan at `path`: `.<plan file name>.lock` beside it
/// (hidden, like the temporary file a plan is written through, so a listing of the plans
/// shows only plans).
fn lock_path(path: &Path) -> Option<PathBuf> {
    let name = path.file_name()?.to_string_lossy();
    Some(path.with_file_name(format!(".{name}.lock")))
}

/// An exclusive lock beside the plan at `path` ([`lock_path`]), held while this process
/// pre-screens so that another process starting on the same model directory waits for its
/// plan instead of computing the same one beside it. `None` where there is no lock (a
/// read-only model directory, a file system without locks): then this process pre-screens
/// on its own.
fn lock_plan(path: &Path) -> Option<std::fs::File> {
    let lock_path = lock_path(path)?;
    quantmesh_model::files::lock_cache_file(&lock_path, || {
        tracing::info!(
            lock = %lock_path.display(),
            "first-load plan: another process is pre-screening this model; waiting for its plan"
        )
    })
    .map_err(|e| tracing::debug!(lock = %lock_path.display(), error = %e, "first-load plan: no lock; pre-screening unshared"))
    .ok()
}

/// The cached plan for `model`, computing it first when there is none for these bytes.
/// `prompts`: calibration prompts the pre-screen uses (0 = the whole bundled set, the
/// default; another count is a plan of its own, cached apart);
/// `weight_budget`: fit each group's bits to it (a plan per budget, cached apart);
/// `rotation_block`: the engine's (`engine.rotation_block`), under which the pre-screen
/// measures the served W8A8 error its scale migration is chosen by (a plan per block other
/// than the default, cached apart).
pub fn ensure(
    model: &Path,
    prompts: usize,
    weight_budget: Option<quantmesh_types::WeightBudget>,
    rotation_block: u32,
) -> anyhow::Result<FirstPlan> {
    let t0 = Instant::now();
    let files = weight_files(model)?;
    let dir = cache_dir(model);
    let md5 = stamped_md5(&files, &dir)?;
    let rotation = match rotation_block {
        quantmesh_types::DEFAULT_ROTATION_BLOCK => String::new(),
        b => format!(".rotation-{b}"),
    };
    let stem = format!(
        "sensitive_layers.{md5}.r{}{rotation}",
        quantmesh_prescreen::PLAN_REVISION
    );
    let stem = match prompts {
        0 => stem,
        n => format!("{stem}.prompts-{n}"),
    };
    let path = match weight_budget {
        None => dir.join(format!("{stem}.json")),
        Some(b) => dir.join(format!("{stem}.budget-{b}.json")),
    };
    if let Some(plan) = cached(&path, &md5) {
        return Ok(plan);
    }
    // Held until this function returns: the plan is written (renamed into place) first.
    let _lock = lock_plan(&path);
    if let Some(plan) = cached(&path, &md5) {
        return Ok(plan);
    }
    let mcfg = quantmesh_model::ModelConfig::load(model)?;
    tracing::info!(
        model = %model.display(),
        model_md5 = %md5,
        "first-load plan: no sensitive_layers.json given, running the pre-screen once (cached for later starts; `--plan none` skips it)"
    );
    let progress = LogProgress {
        total: mcfg.num_hidden_layers * 7,
        done: Default::default(),
        started: Instant::now(),
    };
    let opts = quantmesh_prescreen::Options {
        model: model.to_path_buf(),
        calibration: None,
        rules: quantmesh_prescreen::rules::Rules {
            rotation_block,
            ..Default::default()
        },
        max_prompts: prompts,
        max_tokens_per_prompt: quantmesh_prescreen::DEFAULT_TOKENS_PER_PROMPT,
        kl_tokens: quantmesh_prescreen::DEFAULT_KL_TOKENS,
        timestamp: humantime::format_rfc3339_seconds(std::time::SystemTime::now()).to_string(),
        weight_budget,
        // The server's `engine.monitor` settings stay in force: this plan chooses precisions,
        // not thresholds.
        hook_thresholds: false,
    };
    let outcome = quantmesh_prescreen::run(&opts, &progress)?;
    write_plan(&dir, &md5, &path, &outcome.bytes)?;
    tracing::info!(
        plan = %path.display(),
        seconds = t0.elapsed().as_secs_f64(),
        "first-load plan computed:\n{}{}",
        quantmesh_prescreen::summary_table(&outcome),
        outcome.bits.as_ref().map(quantmesh_prescreen::bits_line).unwrap_or_default()
    );
    Ok(FirstPlan {
        path,
        model_md5: md5,
        computed: true,
    })
}

/// Write a plan to `path` in `dir` whole or not at all (a temporary file, then a rename).
fn write_plan(dir: &Path, md5: &str, path: &Path, bytes: &[u8]) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let tmp = dir.join(format!(
        ".sensitive_layers.{md5}.{}.tmp",
        std::process::id()
    ));
    std::fs::write(&tmp, bytes).with_context(|| format!("writing {}", tmp.display()))?;
    std::fs::rename(&tmp, path).with_context(|| format!("writing {}", path.display()))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use quantmesh_model::bundled::{init_model, InitOptions};

    /// Computed once, reused while the weights are the same bytes, recomputed when they
    /// change.
    #[test]
    fn cached_plan_follows_the_model_bytes() {
        let dir = tempfile::tempdir().unwrap();
        init_model(dir.path(), &InitOptions::default()).unwrap();
        let first = ensure(dir.path(), 8, None, quantmesh_types::DEFAULT_ROTATION_BLOCK).unwrap();
        assert!(first.computed);
        assert!(first.path.starts_with(dir.path().join(".quantmesh")));
        let bytes = std::fs::read(&first.path).unwrap();
        let plan = quantmesh_types::SensitiveLayers::parse(&bytes).unwrap();
        assert_eq!(
            plan.thresholds,
            Default::default(),
            "the engine's configured monitor thresholds stay in force"
        );
        let files = weight_files(dir.path()).unwrap();
        assert_eq!(first.model_md5, model_md5(&files).unwrap());
        assert!(dir.path().join(".quantmesh/weights.md5.json").is_file());
        let again = ensure(dir.path(), 8, None, quantmesh_types::DEFAULT_ROTATION_BLOCK).unwrap();
        assert!(!again.computed, "same bytes: the cached plan is reused");
        assert_eq!(again.path, first.path);
        assert_eq!(std::fs::read(&again.path).unwrap(), bytes);
        // A plan an earlier revision of the pre-screen cached (its name has no revision, or
        // another one) is not served: this release pre-screens once more.
        std::fs::remove_file(&first.path).unwrap();
        let name = first
            .path
            .file_name()
            .unwrap()
            .to_string_lossy()
            .to_string();
        let revision = format!(".r{}", quantmesh_prescreen::PLAN_REVISION);
        assert!(name.contains(&revision), "{name}");
        let earlier = first.path.with_file_name(name.replace(&revision, ""));
        std::fs::write(&earlier, &bytes).unwrap();
        let again = ensure(dir.path(), 8, None, quantmesh_types::DEFAULT_ROTATION_BLOCK).unwrap();
        assert!(
            again.computed,
            "an earlier revision's plan must not be reused"
        );
        assert_eq!(again.path, first.path);
        // Other weights in the same place (another seed): a new md5, a new plan.
        init_model(
            dir.path(),
            &InitOptions {
                seed: 7,
                ..Default::default()
            },
        )
        .unwrap();
        let other = ensure(dir.path(), 8, None, quantmesh_types::DEFAULT_ROTATION_BLOCK).unwrap();
        assert!(other.computed);
        assert_ne!(other.model_md5, first.model_md5);
        assert_eq!(
            other.model_md5,
            model_md5(&files).unwrap(),
            "not the remembered md5"
        );
        assert_ne!(other.path, first.path);
        // Another prompt count is another plan, cached apart: the setting is not ignored.
        let fewer = ensure(dir.path(), 4, None, quantmesh_types::DEFAULT_ROTATION_BLOCK).unwrap();
        assert!(fewer.computed);
        assert_ne!(fewer.path, other.path);
        // A damaged cache file is recomputed, not trusted.
        std::fs::write(&other.path, b"{").unwrap();
        assert!(
            ensure(dir.path(), 8, None, quantmesh_types::DEFAULT_ROTATION_BLOCK)
                .unwrap()
                .computed
        );
    }

    /// Replicas starting together on one model directory pre-screen once: one computes the
    /// plan under the lock, the other waits for it and reuses it.
    #[test]
    fn concurrent_first_loads_pre_screen_once() {
        let dir = tempfile::tempdir().unwrap();
        init_model(dir.path(), &InitOptions::default()).unwrap();
        let model = dir.path().to_path_buf();
        let starts: Vec<_> = (0..2)
            .map(|_| {
                let model = model.clone();
                std::thread::spawn(move || {
                    ensure(&model, 8, None, quantmesh_types::DEFAULT_ROTATION_BLOCK).unwrap()
                })
            })
            .collect();
        let plans: Vec<FirstPlan> = starts.into_iter().map(|t| t.join().unwrap()).collect();
        assert_eq!(
            plans.iter().filter(|p| p.computed).count(),
            1,
            "one start computes, the other reuses: {plans:?}"
        );
        assert_eq!(plans[0].path, plans[1].path);
        assert!(lock_path(&plans[0].path).unwrap().is_file());
    }

    /// The default first-load plan calibrates on enough tokens for scale migration, so it
    /// carries factors where the pre-screen keeps them; a plan from a few prompts carries none.
    #[test]
    fn the_default_first_load_plan_carries_scale_migration() {
        let dir = tempfile::tempdir().unwrap();
        init_model(dir.path(), &InitOptions::default()).unwrap();
        let smoothed = |prompts: usize| {
            let plan = ensure(
                dir.path(),
                prompts,
                None,
                quantmesh_types::DEFAULT_ROTATION_BLOCK,
            )
            .unwrap();
            let bytes = std::fs::read(&plan.path).unwrap();
            let plan = quantmesh_types::SensitiveLayers::parse(&bytes).unwrap();
            plan.groups
                .values()
                .filter(|g| g.smoothing.is_some())
                .count()
        };
        let default = quantmesh_settings::ModelSettings::default().plan_prompts;
        assert!(
            smoothed(default) > 0,
            "the default plan ({default} prompts) has factors"
        );
        assert_eq!(smoothed(8), 0, "8 prompts are too few tokens for factors");
    }
}
