//! The executor actor: one sync thread that owns the backend (the model's weights) and the
//! KV bytes, runs every step under the mask snapshot of that step, and hands the step's
//! activation statistics straight to the monitor (never waiting for it).

use crate::backend::Backend;
use crate::backend::{PreparedGroup, StepInput};
use crate::error::{EngineError, Result};
use crate::kv::KvCache;
use crate::metrics::{EngineMetrics, RowPathLabel};
use crate::monitor::Observe;
use crate::precision::{MaskHandle, StepOutput, StepRunner};
use crate::stats::StatsCell;
use actix::prelude::*;
use std::sync::{Arc, Mutex};

/// Scheduler → executor: run one step of the batch.
#[derive(Message)]
#[rtype(result = "Result<StepOutput, EngineError>")]
pub struct Execute(pub StepInput);

/// Config actor → executor: replace these linear groups (built in the background) between
/// two steps, all or nothing. Replies with the resident weight bytes after the swap (all,
/// linear groups).
#[derive(Message)]
#[rtype(result = "Result<(usize, usize), EngineError>")]
pub struct SwapGroups(pub Vec<PreparedGroup>);

/// Everything the executor owns. Behind a mutex only so the sync arbiter's factory can
/// hand it to its single thread; nothing else touches it.
pub struct ExecutorState {
    pub backend: Box<dyn Backend>,
    pub kv: KvCache,
    pub runner: StepRunner,
    pub mask: MaskHandle,
    pub kv_int8: bool,
    /// Where step observations go (`None`: monitoring off).
    pub monitor: Option<Recipient<Observe>>,
    pub metrics: EngineMetrics,
    pub stats: StatsCell,
}

pub struct ExecutorActor {
    pub state: Arc<Mutex<ExecutorState>>,
}

impl Actor for ExecutorActor {
    type Context = SyncContext<Self>;
}

impl ExecutorState {
    fn record(&self, out: &StepOutput) {
        let m = &self.metrics;
        m.steps.inc();
        m.mask_check_seconds.inc_by(out.mask_check_ns as f64 * 1e-9);
        m.batch_recomputes.inc_by(u64::from(out.non_finite));
        let (mut float, mut int8, mut unavailable) = (0u64, 0u64, 0u64);
        for (_, o) in &out.outcomes {
            float += o.float_rows as u64;
            int8 += o.int8_rows as u64;
            unavailable += o.fallback_unavailable_rows as u64;
        }
        m.rows(RowPathLabel::Float, float);
        m.rows(RowPathLabel::Int8, int8);
        m.fallback_unavailable.inc_by(unavailable);
        self.stats.update(|s| {
            s.steps += 1;
            s.tokens_processed += out.num_tokens as u64;
            s.mask_version = out.mask_version;
            s.mask_check_ns += out.mask_check_ns;
            s.shadow_steps += u64::from(!out.shadow_kl.is_empty());
            s.batch_recomputes += u64::from(out.non_finite);
            s.float_rows += float;
            s.int8_rows += int8;
            s.fallback_unavailable_rows += unavailable;
        });
    }

    /// Hand the step's statistics to the monitor without waiting; a full mailbox drops
    /// them (counted). They are moved out of `out`: the scheduler only reads the logits.
    fn observe(&self, out: &mut StepOutput) {
        let Some(monitor) = &self.monitor else { return };
        if out.obs.is_empty() && out.shadow_kl.is_empty() && !out.non_finite {
            return;
        }
        let obs = StepOutput {
            obs: std::mem::take(&mut out.obs),
            rows: std::mem::take(&mut out.rows),
            shadow_kl: std::mem::take(&mut out.shadow_kl),
            mask_version: out.mask_version,
            num_tokens: out.num_tokens,
            non_finite: out.non_finite,
            mask_check_ns: out.mask_check_ns,
            stats_ns: out.stats_ns,
            ..Default::default()
        };
        if monitor.try_send(Observe(obs)).is_err() {
            self.metrics.monitor_dropped.inc();
            self.stats.update(|s| s.monitor_observations_dropped += 1);
        }
    }
}

impl Handler<Execute> for ExecutorActor {
    type Result = Result<StepOutput>;
    fn handle(&mut self, msg: Execute, _: &mut Self::Context) -> Self::Result {
        let mut guard = self.state.lock().map_err(|_| EngineError::Stopped)?;
        let st = &mut *guard;
        // The mask is read once per step: a decision takes effect at the next step.
        let mask = st.mask.load();
        let mut out = st
            .runner
            .run(st.backend.as_ref(), &msg.0, &mask, &mut st.kv, st.kv_int8)?;
        st.record(&out);
        st.observe(&mut out);
        Ok(out)
    }
}

impl Handler<SwapGroups> for ExecutorActor {
    type Result = Result<(usize, usize)>;
    fn handle(&mut self, msg: SwapGroups, _: &mut Self::Context) -> Self::Result {
        let mut guard = self.state.lock().map_err(|_| EngineError::Stopped)?;
        let st = &mut *guard;
        st.backend.replace_groups(msg.0)?;
        let (resident, linear) = (st.backend.resident_bytes(), st.backend.linear_bytes());
        let weights = st.backend.weight_bytes();
        st.metrics.set_weights(&weights);
        st.stats.update(|s| {
            s.resident_weight_bytes = resident;
            s.linear_weight_bytes = linear;
            s.weights = weights;
        });
        Ok((resident, linear))
    }
}
