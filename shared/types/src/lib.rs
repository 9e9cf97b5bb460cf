//! Types every quantmesh service agrees on.
//!
//! Keep this crate free of heavy dependencies: the gateway, the engine and (later) the
//! evolution service and data-platform tools all depend on it.

pub mod budget;
pub mod events;
pub mod forms;
pub mod generation;
pub mod precision;
pub mod sensitive;
pub mod trace;

pub use budget::{FloatBudget, WeightBudget};
pub use events::{now_ms, wire_name};
pub use events::{
    ConfigAction, ConfigEvent, EventSink, FallbackAction, FallbackEvent, FallbackReason,
    Granularity, KlReference, WindowEvent, WindowGroup, CONFIG_EVENT_SCHEMA_VERSION,
    FALLBACK_EVENT_SCHEMA_VERSION, MAX_WINDOW_KL_SAMPLES, WINDOW_EVENT_SCHEMA_VERSION,
};
pub use forms::{EmbeddingDtype, DEFAULT_ROTATION_BLOCK};
pub use generation::{
    FinishReason, SamplingError, SamplingParams, TokenLogprobs, Usage, MAX_TOP_LOGPROBS,
};
pub use precision::{GroupId, GroupKind, PrecisionClass, Residency};
pub use sensitive::{
    GroupEntry, ModelShape, SensitiveLayers, SensitiveLayersError, Smoothing, ValidatedPlan,
    SENSITIVE_LAYERS_SCHEMA_VERSION,
};
