//! What a kernel call was given that it cannot work with.

/// What a kernel call was given that it cannot work with.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum KernelError {
    /// An input width that is not a whole number of blocks.
    #[error("input width {width} is not a multiple of the block size {block}")]
    Width { width: usize, block: usize },
    #[error("shape mismatch: {0}")]
    Shape(String),
}

pub type Result<T> = std::result::Result<T, KernelError>;
