//! Layered configuration: built-in defaults → TOML file → `QUANTMESH_*` environment →
//! command-line flags (applied by the binary). Validated once at start-up.

pub mod evolution;
mod flags;
pub mod mesh;
mod sections;

pub use flags::{GatewayFlags, ListenFlags, ServeFlags};
pub use sections::*;
