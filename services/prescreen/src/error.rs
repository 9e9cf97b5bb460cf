//! Why a pre-screen run failed.

use quantmesh_model::ModelError;

/// Why a pre-screen run failed.
#[derive(Debug, thiserror::Error)]
pub enum PrescreenError {
    /// Checkpoint problems: the message names the file and the tensor.
    #[error(transparent)]
    Model(#[from] ModelError),
    /// The weight budget holds no plan.
    #[error("{0}")]
    Budget(String),
    #[error("calibration: {0}")]
    Calibration(String),
    #[error("tensor computation: {0}")]
    Compute(#[from] candle_core::Error),
    #[error("quantizing: {0}")]
    Kernel(#[from] quantmesh_kernels::KernelError),
}
