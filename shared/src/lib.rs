//! Types every quantmesh service agrees on.
//!
//! Keep this crate free of heavy dependencies: the gateway, the engine and (later) the
//! evolution service and data-platform tools all depend on it.

pub mod events;
pub mod generation;
pub mod precision;

pub use events::{
    FallbackAction, FallbackEvent, FallbackReason, Granularity, FALLBACK_EVENT_SCHEMA_VERSION,
};
pub use generation::{FinishReason, SamplingError, SamplingParams, Usage};
pub use precision::{GroupId, GroupKind, PrecisionClass, Residency};
