//! The executor actor: one sync thread that owns the backend (the model's weights) and the
//! KV bytes, runs every step under the mask snapshot of that step, and hands the step's
//! activation statistics straight to the monitor (never waiting for it).

use crate::backend::Backend;
use crate::backend::{PreparedGroup, PreparedTables, StepInput};
use crate::error::{EngineError, Result};
use crate::kv::KvCache;
use crate::metrics::{EngineMetrics, RowPathLabel, StepFailureCause};
use crate::monitor::Observe;
use crate::precision::{MaskHandle, StepOutput, StepRunner};
use crate::stats::StatsCell;
use actix::prelude::*;
use quantmesh_types::WeightBudget;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

/// Scheduler → executor: run one step of the batch.
#[derive(Message)]
#[rtype(result = "Result<StepOutput, EngineError>")]
pub struct Execute(pub StepInput);

/// Config actor → executor: replace these linear groups and, when their form changes, the
/// vocabulary tables (built in the background) between two steps, all or nothing. Replies
/// with the resident weight bytes after the swap (all, linear groups).
#[derive(Message)]
#[rtype(result = "Result<(usize, usize), EngineError>")]
pub struct SwapWeights {
    pub groups: Vec<PreparedGroup>,
    pub tables: Option<PreparedTables>,
    /// Refuse the swap (nothing replaced) when the weights would then take more than this
    /// share of the all-16-bit model (`engine.weight_budget`); `None` for no limit (and for
    /// a rollback to weights that were in force).
    pub within: Option<WeightBudget>,
}

/// Everything the executor owns. Behind a mutex only so the sync arbiter's factory can
/// hand it to its single thread; nothing else touches it.
///
/// Supervision: every message is handled under `catch_unwind`, so a panic fails only the
/// requests of that step (the scheduler frees their pages; pages enter the prefix cache only
/// after a step succeeds, so half-written KV is never shared) and the thread, the weights
/// and the other sequences' KV carry on. The state holds nothing a panic can leave half
/// updated besides the failed step's own KV slots: the weights change only by
/// [`SwapWeights`], which replaces them whole.
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
        let (mut float, mut int8, mut split, mut unavailable) = (0u64, 0u64, 0u64, 0u64);
        for (_, o) in &out.outcomes {
            float += o.float_rows as u64;
            int8 += o.int8_rows as u64;
            split += o.split_rows as u64;
            unavailable += o.fallback_unavailable_rows as u64;
        }
        m.rows(RowPathLabel::Float, float);
        m.rows(RowPathLabel::Int8, int8);
        m.rows(RowPathLabel::Split, split);
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
            s.split_rows += split;
            s.fallback_unavailable_rows += unavailable;
        });
    }

    /// Hand the step's statistics to the monitor without waiting (see [`hand_to_monitor`]).
    fn observe(&self, out: &mut StepOutput) {
        if let Some(monitor) = &self.monitor {
            hand_to_monitor(monitor, out, &self.metrics, &self.stats);
        }
    }
}

/// Hand a step's statistics to the monitor without waiting; a full (or closed) mailbox drops
/// them, counted in `quantmesh_monitor_observations_dropped_total` and the engine stats. They
/// are moved out of `out`: the scheduler only reads the logits. Returns whether they were
/// delivered (or there was nothing to deliver).
pub(crate) fn hand_to_monitor(
    monitor: &Recipient<Observe>,
    out: &mut StepOutput,
    metrics: &EngineMetrics,
    stats: &StatsCell,
) -> bool {
    if out.obs.is_empty() && out.shadow_kl.is_empty() && !out.non_finite {
        return true;
    }
    let obs = StepOutput {
        obs: std::mem::take(&mut out.obs),
        rows: std::mem::take(&mut out.rows),
        shadow_kl: std::mem::take(&mut out.shadow_kl),
        shadow_reference: out.shadow_reference,
        mask_version: out.mask_version,
        num_tokens: out.num_tokens,
        non_finite: out.non_finite,
        mask_check_ns: out.mask_check_ns,
        stats_ns: out.stats_ns,
        ..Default::default()
    };
    if monitor.try_send(Observe(obs)).is_err() {
        metrics.monitor_dropped.inc();
        stats.update(|s| s.monitor_observations_dropped += 1);
        false
    } else {
        true
    }
}

impl ExecutorActor {
    /// The state, also after a panic that escaped `catch_unwind`'s protection elsewhere
    /// (nothing is left half-updated across messages: see [`ExecutorState`]).
    fn state(&self) -> MutexGuard<'_, ExecutorState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// The text of a caught panic.
fn panic_message(p: &(dyn std::any::Any + Send)) -> String {
    p.downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "non-string panic payload".into())
}

/// Run `f` with panics contained: a panic becomes [`EngineError::StepPanicked`]. On failure
/// also says whether it was a panic or a typed error.
fn contained<T>(f: impl FnOnce() -> Result<T>) -> Result<T, (EngineError, StepFailureCause)> {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err((e, StepFailureCause::Error)),
        Err(p) => Err((
            EngineError::StepPanicked(panic_message(p.as_ref())),
            StepFailureCause::Panic,
        )),
    }
}

impl Handler<Execute> for ExecutorActor {
    type Result = Result<StepOutput>;
    fn handle(&mut self, msg: Execute, _: &mut Self::Context) -> Self::Result {
        let mut guard = self.state();
        let st = &mut *guard;
        let (metrics, stats) = (st.metrics.clone(), st.stats.clone());
        contained(|| {
            crate::faults::before_step();
            // The mask is read once per step: a decision takes effect at the next step.
            let mask = st.mask.load();
            let mut out =
                st.runner
                    .run(st.backend.as_ref(), &msg.0, &mask, &mut st.kv, st.kv_int8)?;
            st.record(&out);
            st.observe(&mut out);
            Ok(out)
        })
        .map_err(|(e, cause)| {
            tracing::error!(error = %e, cause = cause.as_str(), "step failed");
            metrics.step_failed(cause);
            stats.update(|s| {
                s.step_failures += 1;
                s.step_panics += u64::from(cause == StepFailureCause::Panic);
            });
            e
        })
    }
}

impl Handler<SwapWeights> for ExecutorActor {
    type Result = Result<(usize, usize)>;
    fn handle(&mut self, msg: SwapWeights, _: &mut Self::Context) -> Self::Result {
        let mut guard = self.state();
        let st = &mut *guard;
        contained(|| {
            if let Some(budget) = msg.within {
                let limit = budget.bytes(st.backend.weight_bytes().all_f16 as u64);
                let after = st
                    .backend
                    .resident_bytes_after(&msg.groups, msg.tables.as_ref())
                    as u64;
                if after > limit {
                    return Err(EngineError::OverBudget(format!(
                        "its weights would take {after} bytes, over the {limit} of \
                         weight_budget {budget}"
                    )));
                }
            }
            st.backend.replace_weights(msg.groups, msg.tables)?;
            let (resident, linear) = (st.backend.resident_bytes(), st.backend.linear_bytes());
            let weights = st.backend.weight_bytes();
            st.metrics.set_weights(&weights);
            st.stats.update(|s| {
                s.resident_weight_bytes = resident;
                s.linear_weight_bytes = linear;
                s.weights = weights;
            });
            Ok((resident, linear))
        })
        .map_err(|(e, _)| e)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::monitor::MonitorActor;

    /// A monitor that never gets to run (its context is never started) with a one-message
    /// mailbox: the first observation queues, the rest are dropped and counted — the
    /// executor never waits.
    #[actix_rt::test]
    async fn a_full_monitor_mailbox_drops_and_counts_observations() {
        let mut ctx = Context::<MonitorActor>::new();
        ctx.set_mailbox_capacity(1);
        let monitor: Recipient<Observe> = ctx.address().recipient();
        let registry = prometheus::Registry::new();
        let metrics = EngineMetrics::register(&registry, "t").expect("metrics");
        let stats = StatsCell::new(Default::default());
        let step = || StepOutput {
            non_finite: true,
            num_tokens: 1,
            ..Default::default()
        };
        let delivered: Vec<bool> = (0..5)
            .map(|_| hand_to_monitor(&monitor, &mut step(), &metrics, &stats))
            .collect();
        let dropped = delivered.iter().filter(|d| !**d).count() as u64;
        assert!(delivered[0], "{delivered:?}");
        assert!(dropped >= 3, "{delivered:?}");
        assert_eq!(stats.get().monitor_observations_dropped, dropped);
        assert_eq!(metrics.monitor_dropped.get(), dropped);
        // Nothing to say: nothing sent, nothing dropped.
        assert!(hand_to_monitor(
            &monitor,
            &mut StepOutput::default(),
            &metrics,
            &stats
        ));
        assert_eq!(stats.get().monitor_observations_dropped, dropped);
        drop(ctx);
    }
}
