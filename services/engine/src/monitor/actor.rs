//! The monitor actor: the only writer of the fallback mask. Turns step observations and
//! finished requests into decisions, publishes the mask, the fallback events and the
//! monitor's series.

use crate::backend::ColumnError;
use crate::events::EventSink;
use crate::kv::SeqId;
use crate::metrics::EngineMetrics;
use crate::monitor::core::{Monitor, MonitorReport};
use crate::monitor::{ForceMode, MonitorConfig};
use crate::precision::MaskHandle;
use crate::precision::StepOutput;
use crate::trace::{self, TraceHook};
use actix::prelude::*;
use quantmesh_types::FallbackEvent;
use quantmesh_types::{GroupId, Residency};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

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

/// Scheduler → monitor: these sequences (one request's answers) are traced under `span`;
/// decisions about them are noted in it and their events carry its `traceparent`. Sent
/// when the request is queued, before any step of it; forgotten at `RequestsFinished`.
#[derive(Message)]
#[rtype(result = "()")]
pub struct RequestsTraced {
    pub ids: Vec<SeqId>,
    pub span: tracing::Span,
}

/// Admin → monitor: pin a group to float or INT8, or hand it back to the detector. With
/// `span` (the admin call's, when traced) the decision is noted in it and its events carry
/// its `traceparent`. Answers the ids of the events the decision made (none when the group
/// was already so).
#[derive(Message)]
#[rtype(result = "Result<Vec<String>, String>")]
pub struct ForceGroup {
    pub group: GroupId,
    pub mode: ForceMode,
    pub span: Option<tracing::Span>,
}

/// Config actor → monitor: new thresholds and residencies (hot reload).
#[derive(Message)]
#[rtype(result = "()")]
pub struct Reconfigure {
    pub config: MonitorConfig,
    pub residencies: Vec<(GroupId, Residency)>,
    pub md5: Option<String>,
    /// The rebuilt groups' column errors (their quantized form changed or appeared).
    pub column_errors: Vec<(GroupId, Option<Arc<ColumnError>>)>,
}

pub struct MonitorActor {
    pub core: Monitor,
    pub mask: MaskHandle,
    pub sinks: Vec<Arc<dyn EventSink>>,
    /// The last report, for the admin API.
    pub report: Arc<Mutex<MonitorReport>>,
    pub metrics: EngineMetrics,
    /// Turns spans into `traceparent`s when traces are exported.
    pub trace_hook: Option<TraceHook>,
    /// Spans of traced requests still running, by sequence.
    pub traced: HashMap<SeqId, tracing::Span>,
    /// When `report` was last written.
    pub reported: Instant,
}

/// The longest a step's observations wait to reach the report (see
/// [`MonitorActor::publish_step`]).
pub const REPORT_EVERY: Duration = Duration::from_millis(100);

impl MonitorActor {
    /// Stamp each event with the `traceparent` of the call that asked for it (`asker`), else
    /// of the request it is about (noting the decision in that span), else of its own
    /// decision span.
    fn stamp(&self, events: &mut [FallbackEvent], asker: Option<&tracing::Span>) {
        let Some(hook) = &self.trace_hook else { return };
        for ev in events {
            let request = asker.or_else(|| ev.request_id.and_then(|id| self.traced.get(&id)));
            ev.traceparent = match request {
                Some(span) => {
                    trace::note_decision(span, ev);
                    hook.traceparent(span)
                }
                None => hook.traceparent(&trace::decision_span(ev)),
            };
        }
    }

    fn publish(&mut self, events: Vec<FallbackEvent>) {
        self.publish_under(events, None);
    }

    /// After a step's observations: the mask when it changed, the events, and the report
    /// only when something was decided or it is [`REPORT_EVERY`] old. A step changes the
    /// report's running figures only (means, window counts); what the metrics read from it
    /// changes with decisions and closed windows, which always publish it. The monitor runs
    /// between two steps, so building a report of every group each step would lengthen
    /// every step's gap.
    fn publish_step(&mut self, events: Vec<FallbackEvent>) {
        let changed = self.update_mask();
        if changed || !events.is_empty() || self.reported.elapsed() >= REPORT_EVERY {
            self.publish_under(events, None);
        }
    }

    /// Publish the core's decisions into the mask unless it already holds them; whether it
    /// changed.
    fn update_mask(&self) -> bool {
        if self.core.mask_is_current(&self.mask.load()) {
            return false;
        }
        let core = &self.core;
        self.mask.update(|m| core.apply_to(m));
        true
    }

    /// [`MonitorActor::publish`], the events stamped with `asker`'s trace when given.
    fn publish_under(&mut self, mut events: Vec<FallbackEvent>, asker: Option<&tracing::Span>) {
        self.stamp(&mut events, asker);
        self.update_mask();
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
            if let Some(nsr) = g.last_window_nsr {
                self.metrics.harm_nsr(&g.group, nsr);
            }
        }
        if let Ok(mut r) = self.report.lock() {
            *r = report;
        }
        self.reported = Instant::now();
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
        self.publish_step(events);
    }
}

impl Handler<RequestsFinished> for MonitorActor {
    type Result = ();
    fn handle(&mut self, msg: RequestsFinished, _: &mut Self::Context) {
        let events = self.core.requests_finished(&msg.0);
        self.publish(events);
        for window in self.core.take_windows() {
            for s in &self.sinks {
                s.publish_window(&window);
            }
        }
        for id in &msg.0 {
            self.traced.remove(id);
        }
    }
}

impl Handler<RequestsTraced> for MonitorActor {
    type Result = ();
    fn handle(&mut self, msg: RequestsTraced, _: &mut Self::Context) {
        for id in msg.ids {
            self.traced.insert(id, msg.span.clone());
        }
    }
}

impl Handler<Reconfigure> for MonitorActor {
    type Result = ();
    fn handle(&mut self, msg: Reconfigure, _: &mut Self::Context) {
        self.core.reconfigure(msg.config, &msg.residencies, msg.md5);
        self.core.set_column_errors(msg.column_errors);
        self.publish(Vec::new());
    }
}

impl Handler<ForceGroup> for MonitorActor {
    type Result = Result<Vec<String>, String>;
    fn handle(&mut self, msg: ForceGroup, _: &mut Self::Context) -> Self::Result {
        let events = self.core.force(msg.group, msg.mode)?;
        tracing::info!(group = %msg.group, mode = ?msg.mode, "group precision forced by admin");
        let ids = events.iter().map(|e| e.event_id.clone()).collect();
        self.publish_under(events, msg.span.as_ref());
        Ok(ids)
    }
}
