//! Types every quantmesh service agrees on.
//!
//! Keep this crate free of heavy dependencies: the gateway, the engine and (later) the
//! evolution service and data-platform tools all depend on it.

pub mod generation;
pub mod precision;

pub use generation::{FinishReason, SamplingError, SamplingParams, Usage};
pub use precision::{GroupId, GroupKind, PrecisionClass, Residency};
