//! The activation monitor: the pure decision core ([`core`]: warm-up, robust statistics,
//! windows, hysteresis, MLP coupling, per-request and per-batch decisions), its parameters
//! ([`config`]) and the actor that drives it and writes the mask ([`actor`]).

pub mod actor;
pub mod config;
pub mod core;

pub use self::config::{GroupOverride, MonitorConfig, ShadowReference};
pub use self::core::{
    uuid_v4, Decision, DecisionCount, ForceMode, GroupMode, GroupReport, Monitor, MonitorReport,
};
pub use actor::{ForceGroup, MonitorActor, Observe, Reconfigure, RequestsFinished, RequestsTraced};
