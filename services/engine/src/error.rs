//! The engine's error type.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
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
    #[error("tensor op failed: {0}")]
    Tensor(#[from] candle_core::Error),
    #[error("the request is invalid: {0}")]
    InvalidRequest(String),
    #[error("engine overloaded: {0}")]
    Overloaded(String),
    #[error("the engine has stopped")]
    Stopped,
}

impl EngineError {
    pub fn io(context: impl Into<String>, source: std::io::Error) -> Self {
        EngineError::Io {
            context: context.into(),
            source,
        }
    }

    pub fn checkpoint(
        file: impl Into<PathBuf>,
        tensor: Option<&str>,
        message: impl Into<String>,
    ) -> Self {
        EngineError::Checkpoint {
            file: file.into(),
            tensor: tensor.map(str::to_string),
            message: message.into(),
        }
    }
}

pub type Result<T, E = EngineError> = std::result::Result<T, E>;
