//! A model on disk, recognised once: a GGUF file (its header parsed once, then shared by the
//! configuration, the tokenizer and the checkpoint) or a Hugging Face directory
//! (`config.json`, `*.safetensors`, `tokenizer.json`).

use crate::checkpoint::Checkpoint;
use crate::config::ModelConfig;
use crate::error::Result;
use crate::gguf::{find_gguf, GgufFile};
use crate::tokenizer::TextTokenizer;
use std::path::{Path, PathBuf};

/// Where a model's configuration, tokenizer and weights come from.
pub enum ModelFiles {
    /// A `.gguf` file (or a directory holding one), its header read.
    Gguf(Box<GgufFile>),
    /// A Hugging Face directory.
    HuggingFace(PathBuf),
}

impl ModelFiles {
    /// Recognise the model at `path`: a `.gguf` file, a directory holding one, or a Hugging
    /// Face directory. A GGUF header is read and checked here, once.
    pub fn open(path: &Path) -> Result<Self> {
        Ok(match find_gguf(path)? {
            Some(file) => Self::Gguf(Box::new(GgufFile::open(&file)?)),
            None => Self::HuggingFace(path.to_path_buf()),
        })
    }

    pub fn config(&self) -> Result<ModelConfig> {
        match self {
            Self::Gguf(g) => g.model_config(),
            Self::HuggingFace(dir) => ModelConfig::from_file(&dir.join("config.json")),
        }
    }

    pub fn tokenizer(&self) -> Result<TextTokenizer> {
        match self {
            Self::Gguf(g) => TextTokenizer::from_gguf(g),
            Self::HuggingFace(dir) => TextTokenizer::load_dir(dir),
        }
    }

    pub fn checkpoint(&self) -> Result<Checkpoint> {
        match self {
            Self::Gguf(g) => Checkpoint::from_gguf(g),
            Self::HuggingFace(dir) => Checkpoint::open(dir),
        }
    }
}

impl ModelConfig {
    /// The configuration of the model at `path` (see [`ModelFiles::open`]).
    pub fn load(path: &Path) -> Result<Self> {
        ModelFiles::open(path)?.config()
    }
}

impl TextTokenizer {
    /// The tokenizer of the model at `path` (see [`ModelFiles::open`]).
    pub fn load(path: &Path) -> Result<Self> {
        ModelFiles::open(path)?.tokenizer()
    }
}

/// Where what is derived from the model in `model` (a directory, or one file in it) is
/// kept between starts: `.quantmesh/` in the model's directory (its first-load plans, its
/// weights' digest, the activation width measured on each machine), shared by every
/// replica that mounts the same model volume.
pub fn cache_dir(model: &Path) -> PathBuf {
    let dir = if model.is_dir() {
        model
    } else {
        model.parent().unwrap_or(Path::new("."))
    };
    dir.join(".quantmesh")
}

/// An exclusive lock on the file at `path` in a [`cache_dir`] (made, with its folder, when
/// missing; one another user made is opened read-only, which locks as well), held until the
/// returned file is dropped: replicas that start together over one model volume do what is
/// kept there one at a time, and the later ones find the first one's result. `on_wait` runs
/// once when another process holds it, before this one blocks. An error: no lock here (a
/// read-only volume, a file system without locks); the caller goes on unshared.
pub fn lock_cache_file(path: &Path, on_wait: impl FnOnce()) -> std::io::Result<std::fs::File> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(path)
        .or_else(|_| std::fs::File::open(path))?;
    match file.try_lock() {
        Ok(()) => Ok(file),
        Err(std::fs::TryLockError::WouldBlock) => {
            on_wait();
            file.lock().map(|()| file)
        }
        Err(std::fs::TryLockError::Error(e)) => Err(e),
    }
}
