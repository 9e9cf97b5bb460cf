//! The monitor actor: the only writer of the fallback mask. Turns step observations and
//! finished requests into decisions, publishes the mask, the fallback events and the
//! monitor's series.

use crate::events::EventSink;
use crate::kv::SeqId;
use crate::metrics::EngineMetrics;
use crate::monitor::core::{Monitor, MonitorReport};
use crate::monitor::{ForceMode, MonitorConfig};
use crate::precision::StepOutput;
use crate::precision::{MaskHandle, PathMask};
use actix::prelude::*;
use quantmesh_types::FallbackEvent;
use quantmesh_types::{GroupId, Residency};
use std::sync::{Arc, Mutex};

/// Executor → monitor: one step's activation statistics, shadow KL and non-finite flag
/// (logits stripped). Sent with `try_send`: the serving path never waits for the
/// monitor; a full mailbox drops it (`quantmesh_monitor_observations_dropped_total`).
#[derive(Message)]
#[rtype(result = "()")]
pub struct Observe(pub StepOutput);

/// Scheduler → monitor: requests that finished (windows count requests). Always
/// delivered.
#[derive(Message)]
#[rtype(result = "()")]
pub struct RequestsFinished(pub Vec<SeqId>);

/// Admin → monitor: pin a group to float or INT8, or hand it back to the detector.
#[derive(Message)]
#[rtype(result = "Result<(), String>")]
pub struct ForceGroup {
    pub group: GroupId,
    pub mode: ForceMode,
}

/// Config actor → monitor: new thresholds and residencies (hot reload).
#[derive(Message)]
#[rtype(result = "()")]
pub struct Reconfigure {
    pub config: MonitorConfig,
    pub residencies: Vec<(GroupId, Residency)>,
    pub md5: Option<String>,
}

pub struct MonitorActor {
    pub core: Monitor,
    pub mask: MaskHandle,
    pub sinks: Vec<Arc<dyn EventSink>>,
    /// The last report, for the admin API.
    pub report: Arc<Mutex<MonitorReport>>,
    pub metrics: EngineMetrics,
}

impl MonitorActor {
    fn publish(&mut self, events: Vec<FallbackEvent>) {
        let current = self.mask.load();
        let mut next = PathMask::clone(&current);
        self.core.apply_to(&mut next);
        next.version = current.version;
        if next != *current {
            let core = &self.core;
            self.mask.update(|m| core.apply_to(m));
        }
        for ev in &events {
            self.metrics.decision(ev);
            for s in &self.sinks {
                s.publish(ev);
            }
        }
        let report = self.core.report();
        self.metrics
            .groups_in_fallback
            .set(report.groups_in_float as i64);
        for g in &report.groups {
            if let Some(rate) = g.last_window_rate {
                self.metrics.outlier_rate(&g.group, rate);
            }
        }
        if let Ok(mut r) = self.report.lock() {
            *r = report;
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
        let out = msg.0;
        let reference = out
            .shadow_reference
            .unwrap_or(quantmesh_types::KlReference::FloatWeights)
            .as_str();
        for (_, kl) in &out.shadow_kl {
            self.metrics
                .shadow_kl
                .with_label_values(&[reference])
                .observe(*kl);
        }
        let events = self.core.observe(&out);
        self.publish(events);
    }
}

impl Handler<RequestsFinished> for MonitorActor {
    type Result = ();
    fn handle(&mut self, msg: RequestsFinished, _: &mut Self::Context) {
        let events = self.core.requests_finished(&msg.0);
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
