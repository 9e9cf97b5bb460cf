//! The engine's measuring tools, apart from the engine's library: the binaries
//! `quantmesh-engine-bench` (speed, memory, quality tables) and `quantmesh-monitor-eval`, and
//! what they share — teacher-forced KL to the float model (`teacher.rs`), the report on a
//! real checkpoint with its oracle and per-group harm (`real_model.rs`), and here the
//! monitor's evaluation suite: serve planted-truth checkpoints
//! ([`quantmesh_model::recipe`]) through the real engine with ordinary traffic and score
//! what the monitor did against what was planted.
//!
//! Per model: the groups that fell back on their outlier rate (every `enter` decision over
//! the run, not only the final state) against the planted sensitive MLPs — a planted layer
//! `L` expects `layers.L.down` and, coupled to it, `layers.L.gate_up` — giving precision and
//! recall; false fallbacks (any other group) and how many windows they were counted over;
//! the massive channels the warm-up learned in every residual-stream group against the
//! planted ones; and the mean teacher-forced KL to the float model of INT8-only, of the
//! monitor's final float set, and of the planted (oracle) set in float.
//!
//! The suite's small configuration runs in the test suite; the full one is the
//! `quantmesh-monitor-eval` binary, whose results are in docs/MEASUREMENTS.md.

/// Ordinary English text: the traffic's prompts and the KL measurement's held-out text.
pub use quantmesh_model::bundled::ORDINARY_TEXT;

mod family;
mod real_model;
mod serve;
mod teacher;

pub use family::*;
pub use real_model::*;
pub use serve::*;
pub use teacher::*;
