//! The precision policy, independent of any backend: the fallback mask (one snapshot per
//! step, one writer: the monitor actor), the routing of every group's rows, the activation
//! probes, the step policy (shadow passes, recompute after NaN/Inf) and the live plan
//! (`sensitive_layers.json` + engine config → residencies and thresholds).

pub mod mask;
pub mod probe;
pub mod router;
pub mod step;

pub use mask::{same_column_error, DetectorParams, GroupDetector, MaskHandle, PathMask};
pub use probe::GroupObs;
pub use router::MaskRouter;
pub use step::{StepOutput, StepRunner};
