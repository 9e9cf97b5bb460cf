//! The engine's actors: tokenizer (a small pool of sync workers), scheduler (async, owns
//! the queue and the block manager) and executor (one sync thread, owns the model and the
//! KV bytes). Tokenizer → scheduler → executor, typed messages, bounded mailboxes.

use crate::block_manager::SeqId;
use crate::error::EngineError;
use crate::events::EventSink;
use crate::kv_cache::KvCache;
use crate::mask::{MaskHandle, PathMask};
use crate::messages::{
    ApplyChatTemplate, Cancel, Drain, Encode, Execute, ForceGroup, Observe, Reconfigure, Submit,
    SwapGroups,
};
use crate::model::{LlamaModel, StepOutput};
use crate::monitor::{Monitor, MonitorReport};
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

impl Handler<SwapGroups> for ExecutorActor {
    type Result = Result<(usize, usize), EngineError>;
    fn handle(&mut self, msg: SwapGroups, _: &mut Self::Context) -> Self::Result {
        let mut guard = self.state.lock().map_err(|_| EngineError::Stopped)?;
        let st = &mut *guard;
        // Check every replacement before touching any: all or nothing.
        for (g, new) in &msg.0 {
            st.model.check_replacement(*g, new)?;
        }
        let mut old = Vec::with_capacity(msg.0.len());
        for (g, new) in msg.0 {
            old.push(st.model.replace_group(g, new)?);
        }
        // The replaced forms (e.g. a float copy no longer wanted) are freed here.
        drop(old);
        Ok((st.model.resident_bytes(), st.model.linear_bytes()))
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
    pub monitor: Option<Recipient<Observe>>,
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
            monitor: None,
            busy: false,
            draining: false,
            drain_waiters: Vec::new(),
        }
    }

    /// Hand a step's observations to the monitor without waiting; a full mailbox drops
    /// them (counted).
    fn observe(&self, out: Option<StepOutput>, finished: Vec<SeqId>) {
        if let Some(m) = &self.monitor {
            if out.is_none() && finished.is_empty() {
                return;
            }
            if m.try_send(Observe { out, finished }).is_err() {
                self.stats.update(|s| s.monitor_observations_dropped += 1);
            }
        }
    }

    /// Deliver events to their streams; returns the sequences that finished.
    fn dispatch(&mut self, events: Vec<SeqEvent>) -> Vec<SeqId> {
        let mut finished = Vec::new();
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
                    finished.push(seq);
                }
            }
        }
        // The client went away: cancel and free pages now.
        for seq in gone {
            tracing::debug!(seq, "receiver dropped, cancelling");
            self.core.abort(seq, FinishReason::Cancelled);
            self.streams.remove(&seq);
            self.mask.forget_request(seq);
            finished.push(seq);
        }
        finished
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
                s.mask_check_ns += out.mask_check_ns;
                s.shadow_steps += u64::from(!out.shadow_kl.is_empty());
                s.batch_recomputes += u64::from(out.non_finite);
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
                Ok(Ok(mut out)) => {
                    let events = act.core.complete(&out);
                    let finished = act.dispatch(events);
                    act.publish_stats(Some(&out));
                    out.logits = Vec::new();
                    act.observe(Some(out), finished);
                }
                Ok(Err(e)) => {
                    tracing::error!(error = %e, "step failed; failing its requests");
                    let events = act.core.fail_in_flight();
                    let finished = act.dispatch(events);
                    act.observe(None, finished);
                }
                Err(e) => {
                    tracing::error!(error = %e, "executor unreachable; failing the step's requests");
                    let events = act.core.fail_in_flight();
                    let finished = act.dispatch(events);
                    act.observe(None, finished);
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
            let finished = self.dispatch(vec![ev]);
            self.publish_stats(None);
            self.observe(None, finished);
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

// ---------------------------------------------------------------- monitor

/// Owns the monitor's state; turns observations into decisions, publishes the mask and
/// the fallback events.
pub struct MonitorActor {
    pub core: Monitor,
    pub mask: MaskHandle,
    pub sinks: Vec<Arc<dyn EventSink>>,
    pub report: Arc<Mutex<MonitorReport>>,
    /// Shadow-KL samples not yet exported (bounded).
    pub kl_samples: Arc<Mutex<Vec<f64>>>,
}

const KL_SAMPLES_MAX: usize = 10_000;

impl MonitorActor {
    fn publish(&mut self, events: Vec<quantmesh_shared::FallbackEvent>) {
        let current = self.mask.load();
        let mut next = PathMask::clone(&current);
        self.core.apply_to(&mut next);
        next.version = current.version;
        if next != *current {
            let core = &self.core;
            self.mask.update(|m| core.apply_to(m));
        }
        for ev in &events {
            for s in &self.sinks {
                s.publish(ev);
            }
        }
        if let Ok(mut r) = self.report.lock() {
            *r = self.core.report();
        }
    }
}

impl Actor for MonitorActor {
    type Context = Context<Self>;
    fn started(&mut self, ctx: &mut Self::Context) {
        ctx.set_mailbox_capacity(256);
        self.publish(Vec::new());
    }
}

impl Handler<Observe> for MonitorActor {
    type Result = ();
    fn handle(&mut self, msg: Observe, _: &mut Self::Context) {
        let mut events = Vec::new();
        if let Some(out) = &msg.out {
            events.extend(self.core.observe(out));
            if !out.shadow_kl.is_empty() {
                if let Ok(mut k) = self.kl_samples.lock() {
                    if k.len() < KL_SAMPLES_MAX {
                        k.extend(out.shadow_kl.iter().map(|(_, kl)| *kl));
                    }
                }
            }
        }
        events.extend(self.core.requests_finished(&msg.finished));
        self.publish(events);
    }
}

impl Handler<Reconfigure> for MonitorActor {
    type Result = ();
    fn handle(&mut self, msg: Reconfigure, _: &mut Self::Context) {
        self.core.reconfigure(msg.config, &msg.residencies, msg.md5);
        self.publish(Vec::new());
    }
}

impl Handler<ForceGroup> for MonitorActor {
    type Result = Result<(), String>;
    fn handle(&mut self, msg: ForceGroup, _: &mut Self::Context) -> Self::Result {
        let events = self.core.force(msg.group, msg.mode)?;
        tracing::info!(group = %msg.group, mode = ?msg.mode, "group precision forced by admin");
        self.publish(events);
        Ok(())
    }
}
