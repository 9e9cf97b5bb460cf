//! The model crate's error type: every problem names what it was reading.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: std::io::Error,
    },
    #[error("invalid configuration: {0}")]
    Config(String),
    /// A checkpoint problem, always naming the file and, where known, the tensor.
    #[error("checkpoint {file}: {tensor_part}{message}", tensor_part = tensor.as_ref().map(|t| format!("tensor {t:?}: ")).unwrap_or_default())]
    Checkpoint {
        file: PathBuf,
        tensor: Option<String>,
        message: String,
    },
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    /// Input the model cannot take (a chat request for a model without a chat template, a
    /// template that fails on the messages given).
    #[error("{0}")]
    InvalidInput(String),
    #[error("tensor op failed: {0}")]
    Tensor(#[from] candle_core::Error),
}

impl ModelError {
    pub fn io(context: impl Into<String>, source: std::io::Error) -> Self {
        ModelError::Io {
            context: context.into(),
            source,
        }
    }

    pub fn checkpoint(
        file: impl Into<PathBuf>,
        tensor: Option<&str>,
        message: impl Into<String>,
    ) -> Self {
        ModelError::Checkpoint {
            file: file.into(),
            tensor: tensor.map(str::to_string),
            message: message.into(),
        }
    }
}

pub type Result<T, E = ModelError> = std::result::Result<T, E>;
