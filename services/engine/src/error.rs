//! The engine's error type.

pub use quantmesh_model::ModelError;

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// Reading the model: checkpoint (naming file and tensor), config, tokenizer, or input
    /// the model cannot take (e.g. chat without a chat template).
    #[error(transparent)]
    Model(#[from] ModelError),
    #[error("invalid configuration: {0}")]
    Config(String),
    /// A plan whose weights would not fit `engine.weight_budget` (refused; the plan in force
    /// stays).
    #[error("the plan does not fit engine.weight_budget: {0}")]
    OverBudget(String),
    #[error("tensor op failed: {0}")]
    Tensor(#[from] candle_core::Error),
    /// A kernel was handed a shape it cannot multiply (a bug or a malformed checkpoint).
    #[error("kernel: {0}")]
    Kernel(#[from] quantmesh_kernels::KernelError),
    /// The request cannot be served as given (the caller's mistake: HTTP 400).
    #[error("the request is invalid: {0}")]
    InvalidRequest(String),
    /// One field of the request holds a value the engine does not take (HTTP 400 naming
    /// the field).
    #[error("the request is invalid: {message}")]
    InvalidParam {
        param: &'static str,
        message: String,
    },
    #[error("engine overloaded: {0}")]
    Overloaded(String),
    #[error("the engine has stopped")]
    Stopped,
    /// A step panicked; the panic was contained to the requests of that step.
    #[error("internal error: the step serving this request panicked ({0})")]
    StepPanicked(String),
}

impl EngineError {
    /// Whether the caller caused it (a bad request rather than a broken engine).
    pub fn is_client_error(&self) -> bool {
        matches!(
            self,
            EngineError::InvalidRequest(_)
                | EngineError::InvalidParam { .. }
                | EngineError::Model(ModelError::Tokenizer(_) | ModelError::InvalidInput(_))
        )
    }
}

pub type Result<T, E = EngineError> = std::result::Result<T, E>;
