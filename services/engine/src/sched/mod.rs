//! Continuous batching: the pure scheduling logic ([`scheduler`]: admission, chunked
//! prefill, page reservation, completion), sampling ([`sampling`]) and the actor that
//! drives them ([`actor`]).

pub mod actor;
pub mod sampling;
pub mod scheduler;

pub use actor::{Cancel, Drain, SchedulerActor, SchedulerParts, Submit};
pub use scheduler::{Scheduler, SchedulerLimits, SeqEvent, Sequence, SubmitError};
