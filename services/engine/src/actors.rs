//! The engine's actors: tokenizer (a small pool of sync workers), scheduler (async, owns
//! the queue and the block manager) and executor (one sync thread, owns the model and the
//! KV bytes). Tokenizer → scheduler → executor, typed messages, bounded mailboxes.

use crate::block_manager::SeqId;
use crate::error::EngineError;
use crate::kv_cache::KvCache;
use crate::mask::MaskHandle;
use crate::messages::{ApplyChatTemplate, Cancel, Drain, Encode, Execute, Submit};
use crate::model::{LlamaModel, StepOutput};
use crate::scheduler::{Scheduler, SeqEvent, SubmitError};
use crate::stats::{EngineStats, StatsCell};
use crate::tokenizer::TextTokenizer;
use actix::prelude::*;
use quantmesh_shared::FinishReason;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use tokio::sync::{mpsc, oneshot};

// ---------------------------------------------------------------- tokenizer

pub struct TokenizerActor {
    pub tokenizer: Arc<TextTokenizer>,
}

impl Actor for TokenizerActor {
    type Context = SyncContext<Self>;
}

impl Handler<Encode> for TokenizerActor {
    type Result = Result<Vec<u32>, EngineError>;
    fn handle(&mut self, msg: Encode, _: &mut Self::Context) -> Self::Result {
        self.tokenizer.encode(&msg.text, msg.add_bos)
    }
}

impl Handler<ApplyChatTemplate> for TokenizerActor {
    type Result = Result<String, EngineError>;
    fn handle(&mut self, msg: ApplyChatTemplate, _: &mut Self::Context) -> Self::Result {
        self.tokenizer.apply_chat_template(&msg.0)
    }
}

// ---------------------------------------------------------------- executor

/// The model and its KV bytes. Shared behind a mutex only so the sync arbiter's factory
/// can hand it to its single thread; nothing else touches it.
pub struct ExecutorState {
    pub model: LlamaModel,
    pub kv: KvCache,
    pub mask: MaskHandle,
    pub kv_int8: bool,
}

pub struct ExecutorActor {
    pub state: Arc<Mutex<ExecutorState>>,
}

impl Actor for ExecutorActor {
    type Context = SyncContext<Self>;
}

impl Handler<Execute> for ExecutorActor {
    type Result = Result<StepOutput, EngineError>;
    fn handle(&mut self, msg: Execute, _: &mut Self::Context) -> Self::Result {
        let mut guard = self.state.lock().map_err(|_| EngineError::Stopped)?;
        let st = &mut *guard;
        // The mask is read once per step: a decision takes effect at the next step.
        let mask = st.mask.load();
        st.model.forward(&msg.0, &mask, &mut st.kv, st.kv_int8)
    }
}

// ---------------------------------------------------------------- scheduler

pub struct SchedulerActor {
    pub core: Scheduler,
    pub executor: Addr<ExecutorActor>,
    pub streams: HashMap<SeqId, mpsc::UnboundedSender<SeqEvent>>,
    pub mask: MaskHandle,
    pub stats: StatsCell,
    pub mailbox_capacity: usize,
    busy: bool,
    draining: bool,
    drain_waiters: Vec<oneshot::Sender<()>>,
}

impl SchedulerActor {
    pub fn new(
        core: Scheduler,
        executor: Addr<ExecutorActor>,
        mask: MaskHandle,
        stats: StatsCell,
        mailbox_capacity: usize,
    ) -> Self {
        Self {
            core,
            executor,
            streams: HashMap::new(),
            mask,
            stats,
            mailbox_capacity,
            busy: false,
            draining: false,
            drain_waiters: Vec::new(),
        }
    }

    fn dispatch(&mut self, events: Vec<SeqEvent>) {
        let mut gone = Vec::new();
        for ev in events {
            match ev {
                SeqEvent::Token { seq, .. } => {
                    let delivered = self
                        .streams
                        .get(&seq)
                        .is_some_and(|tx| tx.send(ev.clone()).is_ok());
                    if !delivered {
                        gone.push(seq);
                    }
                }
                SeqEvent::Finished { seq, .. } => {
                    if let Some(tx) = self.streams.remove(&seq) {
                        let _ = tx.send(ev);
                    }
                    self.mask.forget_request(seq);
                }
            }
        }
        // The client went away: cancel and free pages now.
        for seq in gone {
            tracing::debug!(seq, "receiver dropped, cancelling");
            self.core.abort(seq, FinishReason::Cancelled);
            self.streams.remove(&seq);
            self.mask.forget_request(seq);
        }
    }

    fn publish_stats(&self, last: Option<&StepOutput>) {
        self.stats.update(|s: &mut EngineStats| {
            s.running = self.core.num_running();
            s.waiting = self.core.num_waiting();
            s.kv_pages_used = self.core.blocks.used_pages();
            s.kv_pages_free = self.core.blocks.free_pages();
            s.kv_fragmentation = self.core.blocks.fragmentation();
            s.prefix_cache_hit_pages = self.core.blocks.stats.prefix_hits;
            if let Some(out) = last {
                s.steps += 1;
                s.tokens_processed += out.num_tokens as u64;
                s.mask_version = out.mask_version;
                for (_, o) in &out.outcomes {
                    s.float_rows += o.float_rows as u64;
                    s.int8_rows += o.int8_rows as u64;
                    s.fallback_unavailable_rows += o.fallback_unavailable_rows as u64;
                }
            }
        });
    }

    fn kick(&mut self, ctx: &mut Context<Self>) {
        if self.busy {
            return;
        }
        let Some(step) = self.core.schedule() else {
            self.publish_stats(None);
            if self.draining && self.core.is_idle() {
                self.drain_waiters.drain(..).for_each(|w| {
                    let _ = w.send(());
                });
            }
            return;
        };
        self.busy = true;
        let fut = self.executor.send(Execute(step)).into_actor(self).map(|res, act, ctx| {
            act.busy = false;
            match res {
                Ok(Ok(out)) => {
                    let events = act.core.complete(&out);
                    act.dispatch(events);
                    act.publish_stats(Some(&out));
                }
                Ok(Err(e)) => {
                    tracing::error!(error = %e, "step failed; failing its requests");
                    let events = act.core.fail_in_flight();
                    act.dispatch(events);
                }
                Err(e) => {
                    tracing::error!(error = %e, "executor unreachable; failing the step's requests");
                    let events = act.core.fail_in_flight();
                    act.dispatch(events);
                }
            }
            act.kick(ctx);
        });
        ctx.spawn(fut);
    }
}

impl Actor for SchedulerActor {
    type Context = Context<Self>;
    fn started(&mut self, ctx: &mut Self::Context) {
        ctx.set_mailbox_capacity(self.mailbox_capacity);
        self.publish_stats(None);
    }
}

impl Handler<Submit> for SchedulerActor {
    type Result = Result<(), SubmitError>;
    fn handle(&mut self, msg: Submit, ctx: &mut Self::Context) -> Self::Result {
        if self.draining {
            return Err(SubmitError::ShuttingDown);
        }
        let id = msg.seq.id;
        self.core.submit(msg.seq)?;
        self.streams.insert(id, msg.events);
        self.kick(ctx);
        Ok(())
    }
}

impl Handler<Cancel> for SchedulerActor {
    type Result = ();
    fn handle(&mut self, msg: Cancel, ctx: &mut Self::Context) {
        if let Some(ev) = self.core.abort(msg.0, FinishReason::Cancelled) {
            self.dispatch(vec![ev]);
            self.publish_stats(None);
        }
        self.kick(ctx);
    }
}

impl Handler<Drain> for SchedulerActor {
    type Result = ResponseFuture<()>;
    fn handle(&mut self, _: Drain, ctx: &mut Self::Context) -> Self::Result {
        self.draining = true;
        let (tx, rx) = oneshot::channel();
        self.drain_waiters.push(tx);
        self.kick(ctx);
        Box::pin(async move {
            let _ = rx.await;
        })
    }
}
