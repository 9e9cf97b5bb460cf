//! Every message the engine's actors exchange, each with its result type.

use crate::block_manager::SeqId;
use crate::error::EngineError;
use crate::model::{StepInput, StepOutput};
use crate::scheduler::{SeqEvent, Sequence, SubmitError};
use crate::tokenizer::ChatMessage;
use actix::Message;
use tokio::sync::mpsc;

/// Scheduler → executor: run one step of the batch.
#[derive(Message)]
#[rtype(result = "Result<StepOutput, EngineError>")]
pub struct Execute(pub StepInput);

/// Engine handle → scheduler: queue a tokenized request. Its events flow back on
/// `events` (unbounded, but bounded in practice by `max_tokens` + 1 events).
#[derive(Message)]
#[rtype(result = "Result<(), SubmitError>")]
pub struct Submit {
    pub seq: Sequence,
    pub events: mpsc::UnboundedSender<SeqEvent>,
}

/// Engine handle → scheduler: stop a request and free its pages now.
#[derive(Message)]
#[rtype(result = "()")]
pub struct Cancel(pub SeqId);

/// Engine handle → scheduler: stop admitting, fail waiting requests, let running ones
/// finish. Replies when nothing is running any more.
#[derive(Message)]
#[rtype(result = "()")]
pub struct Drain;

/// Engine handle → tokenizer: text to token ids.
#[derive(Message)]
#[rtype(result = "Result<Vec<u32>, EngineError>")]
pub struct Encode {
    pub text: String,
    pub add_bos: bool,
}

/// Engine handle → tokenizer: chat messages to a prompt string via the chat template.
#[derive(Message)]
#[rtype(result = "Result<String, EngineError>")]
pub struct ApplyChatTemplate(pub Vec<ChatMessage>);

/// Scheduler → monitor: one step's observations (logits stripped) and the requests that
/// finished. Sent with `try_send`: the serving path never waits for the monitor.
#[derive(Message)]
#[rtype(result = "()")]
pub struct Observe {
    pub out: Option<crate::model::StepOutput>,
    pub finished: Vec<SeqId>,
}

/// Admin → monitor: pin a group to float or INT8, or hand it back to the detector.
#[derive(Message)]
#[rtype(result = "Result<(), String>")]
pub struct ForceGroup {
    pub group: quantmesh_shared::GroupId,
    pub mode: crate::monitor::ForceMode,
}

/// Config actor → executor: replace these linear groups (built in the background) between
/// two steps. Replies with the resident weight bytes after the swap (all, linear groups).
#[derive(Message)]
#[rtype(result = "Result<(usize, usize), EngineError>")]
pub struct SwapGroups(pub Vec<(quantmesh_shared::GroupId, crate::linear::DualLinear)>);

/// Config actor → monitor: new thresholds and residencies (hot reload).
#[derive(Message)]
#[rtype(result = "()")]
pub struct Reconfigure {
    pub config: crate::monitor::MonitorConfig,
    pub residencies: Vec<(quantmesh_shared::GroupId, quantmesh_shared::Residency)>,
    pub md5: Option<String>,
}
