//! The monitor's parameters: defined with the rest of the engine's configuration in
//! `quantmesh-config`, so the settings can name them without the engine.

pub use quantmesh_config::monitor::*;
