//! Engine configuration: defined in `quantmesh-config`, so the settings of every role can
//! name it without depending on the engine.

pub use quantmesh_config::{ConfigError, EngineConfig};

impl From<ConfigError> for crate::error::EngineError {
    fn from(e: ConfigError) -> Self {
        crate::error::EngineError::Config(e.0)
    }
}
