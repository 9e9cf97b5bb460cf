//! Config hot reload: the `ConfigActor` polls the `sensitive_layers.json` source, and on a
//! new version (md5 of its bytes) validates it against the loaded model and applies it with
//! no restart.
//!
//! ```text
//!  ConfigActor ──(timer: Poll, or ReloadNow from SIGHUP / POST /admin/config/reload)
//!     │  read source (object_store) → md5 → unchanged? done
//!     │  parse + validate (schema v1, against the model's layout) → invalid? keep old, count, event
//!     │  resolve plan → groups whose form changes (and the tables, when theirs does)
//!     ├─ background thread: load those groups from the memory-mapped checkpoint
//!     │  (float copy read / INT8 quantized) ── nothing is swapped until all are ready
//!     ├─ SwapWeights ─▶ ExecutorActor   (between two steps: a step sees the old plan or the new)
//!     ├─ Reconfigure ─▶ MonitorActor    (thresholds; k at once, rates at the next window)
//!     └─ status (md5 in force, counters) + ConfigEvent to the event sinks
//! ```
//!
//! Reloads are serialized. A poll that finds a reload in progress skips its turn. A poll
//! that sees new bytes re-reads them after a short settle time (a quarter of the interval,
//! at most 250 ms) and skips its turn if they changed meanwhile (a writer is still busy);
//! a half-written file that stays half-written fails validation and is rejected.

use crate::backend::{
    ColumnError, EmbeddingDtype, FloatDtype, GroupForm, GroupLoader, PreparedGroup, QuantFormat,
    SplitActivations, TableLoader, WeightBytes,
};
use crate::config::EngineConfig;
use crate::error::{EngineError, Result};
use crate::events::EventSink;
use crate::executor::ExecutorActor;
use crate::executor::SwapWeights;
use crate::metrics::{EngineMetrics, ReloadResult};
use crate::monitor::Reconfigure;
use crate::monitor::{uuid_v4, MonitorActor};
use crate::plan::{resolve, LivePlan};
use actix::prelude::*;
use quantmesh_model::{Checkpoint, ModelConfig};
use quantmesh_store::Location;
use quantmesh_types::{
    now_ms, ConfigAction, ConfigEvent, GroupId, ModelShape, Residency, SensitiveLayers,
    WeightBudget, CONFIG_EVENT_SCHEMA_VERSION,
};
use serde::Serialize;
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// How long one read of the plan source may take. A plan is a few KiB: a store that has not
/// answered by then is unreachable for this attempt (its client would otherwise retry a
/// refused connection with backoff for about a minute) and the next poll tries again.
const SOURCE_READ_TIMEOUT: Duration = Duration::from_secs(10);

/// What started a reload.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Trigger {
    Poll,
    /// SIGHUP or the admin API.
    Manual,
}

/// The result of one reload attempt.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "result", rename_all = "snake_case")]
pub enum ReloadOutcome {
    Applied {
        md5: String,
        changed_groups: Vec<String>,
        /// From reading the source to the new plan in force.
        seconds: f64,
    },
    Unchanged {
        md5: String,
    },
    Rejected {
        md5: String,
        error: String,
    },
    /// Valid, but applying it failed (checkpoint unreadable, engine stopping).
    Failed {
        md5: String,
        error: String,
    },
    /// The source could not be read; the plan in force stays.
    FetchFailed {
        error: String,
    },
    /// The bytes changed while being read (a writer is busy): try again next poll.
    Settling,
    /// Another reload is running (polls only).
    Busy,
}

/// What `/metrics` and `GET /admin/config` show.
#[derive(Debug, Clone, Default, Serialize)]
pub struct ConfigStatus {
    pub source: Option<String>,
    pub interval_ms: u64,
    /// md5 of the file in force (`None`: none loaded).
    pub md5: Option<String>,
    /// Unix ms when it was applied.
    pub applied_at_ms: Option<u64>,
    pub polls: u64,
    pub applied_total: u64,
    pub rejected_total: u64,
    pub failed_total: u64,
    pub fetch_errors_total: u64,
    pub last_error: Option<String>,
    /// Seconds from read to applied, for the last applied version.
    pub last_apply_seconds: Option<f64>,
    /// Live thresholds and residencies (the plan in force).
    pub k: f64,
    pub trigger_rate: f64,
    pub window_requests: usize,
    pub residency: BTreeMap<String, Residency>,
    /// Groups whose quantized form is not Q8_0 (`w4a16` → `q4_s8`).
    pub quant_format: BTreeMap<String, QuantFormat>,
    /// How float copies are stored and what the float budget allows.
    pub float_dtype: Option<FloatDtype>,
    pub float_budget: Option<String>,
    pub float_budget_bytes: Option<usize>,
    /// Bytes of the float copies the plan keeps.
    pub float_bytes: usize,
    /// How the vocabulary tables are stored (the plan's `tables`, else `engine.embeddings`),
    /// and the bytes beyond Q8_0 they take from the float budget.
    pub tables: Option<EmbeddingDtype>,
    pub table_bytes: usize,
    /// Which quantized-path rows carry split activations (`engine.split_activations`).
    pub split_activations: Option<SplitActivations>,
    /// Groups that wanted a float copy and are INT8-only because of the budget.
    pub over_budget: Vec<String>,
    /// Resident weights by form (filled in by `Engine::config_status`).
    pub weights: Option<WeightBytes>,
}

/// What a [`Reloader`] is built from.
pub struct ReloaderParts {
    pub source: Location,
    /// The engine's own configuration (the base the file is overlaid on).
    pub base: EngineConfig,
    pub model_dir: PathBuf,
    pub model_config: ModelConfig,
    pub shape: ModelShape,
    pub model_name: String,
    /// The plan the engine started with.
    pub live: LivePlan,
    pub executor: Addr<ExecutorActor>,
    pub monitor: Option<Addr<MonitorActor>>,
    /// How the backend builds a group whose residency changes.
    pub loader: GroupLoader,
    /// How it builds the vocabulary tables when their form changes.
    pub table_loader: TableLoader,
    pub sinks: Vec<Arc<dyn EventSink>>,
    pub status: Arc<Mutex<ConfigStatus>>,
    pub metrics: EngineMetrics,
    /// Turns the reload's span into the `traceparent` its config events carry.
    pub trace_hook: Option<crate::trace::TraceHook>,
}

/// Everything a reload needs; shared by the actor and its futures.
pub struct Reloader {
    parts: ReloaderParts,
    /// The plan in force and the last rejected md5. Held for the whole of a reload, which
    /// serializes them.
    state: tokio::sync::Mutex<ReloadState>,
}

struct ReloadState {
    live: LivePlan,
    rejected: Option<(String, String)>,
}

impl std::ops::Deref for Reloader {
    type Target = ReloaderParts;
    fn deref(&self) -> &ReloaderParts {
        &self.parts
    }
}

impl Reloader {
    pub fn new(parts: ReloaderParts) -> Self {
        let live = parts.live.clone();
        let r = Self {
            state: tokio::sync::Mutex::new(ReloadState {
                live: live.clone(),
                rejected: None,
            }),
            parts,
        };
        r.metrics.set_config_md5(live.md5.as_deref());
        if live.md5.is_some() {
            r.metrics.config_applied_at.set(now_ms() as f64 / 1000.0);
        }
        let interval = r.base.reload_interval;
        r.update_status(|s| {
            s.source = Some(r.source.to_string());
            s.interval_ms = interval.as_millis() as u64;
            s.applied_at_ms = live.md5.as_ref().map(|_| now_ms());
            describe(s, &live, &r.base);
        });
        r
    }

    fn update_status(&self, f: impl FnOnce(&mut ConfigStatus)) {
        if let Ok(mut s) = self.status.lock() {
            f(&mut s);
        }
    }

    fn event(
        &self,
        action: ConfigAction,
        md5: &str,
        previous: Option<String>,
        error: Option<String>,
        changed: Vec<String>,
    ) {
        let ev = ConfigEvent {
            schema_version: CONFIG_EVENT_SCHEMA_VERSION,
            event_id: uuid_v4(),
            timestamp_ms: now_ms(),
            model: self.model_name.clone(),
            action,
            source: self.source.to_string(),
            md5: md5.to_string(),
            previous_md5: previous,
            error,
            changed_groups: changed,
            traceparent: None,
        };
        // Its own span, a child of the admin request's when an operator asked for it.
        let ev = ConfigEvent {
            traceparent: self.trace_hook.as_ref().and_then(|h| {
                h.traceparent(&tracing::info_span!(
                    target: crate::trace::TARGET,
                    "quantmesh.config.change",
                    quantmesh.model = %ev.model,
                    quantmesh.action = ?ev.action,
                    quantmesh.md5 = %ev.md5,
                ))
            }),
            ..ev
        };
        for s in &self.sinks {
            s.publish_config(&ev);
        }
    }

    /// Read the plan source, giving up after [`SOURCE_READ_TIMEOUT`].
    async fn read_source(&self) -> std::result::Result<bytes::Bytes, String> {
        match tokio::time::timeout(SOURCE_READ_TIMEOUT, self.source.read()).await {
            Ok(read) => read.map_err(|e| e.to_string()),
            Err(_) => Err(format!(
                "{}: no answer within {} s",
                self.source,
                SOURCE_READ_TIMEOUT.as_secs()
            )),
        }
    }

    /// One reload attempt. Never panics, never leaves a half-applied plan.
    pub async fn reload(&self, trigger: Trigger) -> ReloadOutcome {
        let mut state = match trigger {
            Trigger::Poll => match self.state.try_lock() {
                Ok(s) => s,
                Err(_) => return ReloadOutcome::Busy,
            },
            Trigger::Manual => self.state.lock().await,
        };
        let t0 = Instant::now();
        let read = self.read_source().await;
        if trigger == Trigger::Poll {
            // Counted once the source has been read: a change written after a client saw
            // `polls == n` is seen by poll n + 1, never half-way through poll n.
            self.update_status(|s| s.polls += 1);
            self.metrics.config_polls.inc();
        }
        let bytes = match read {
            Ok(b) => b,
            Err(error) => {
                tracing::warn!(source = %self.source, %error, "config source unreadable; keeping the plan in force");
                self.metrics.reload(ReloadResult::FetchError);
                self.update_status(|s| {
                    s.fetch_errors_total += 1;
                    s.last_error = Some(error.clone());
                });
                return ReloadOutcome::FetchFailed { error };
            }
        };
        let md5 = format!("{:x}", md5::compute(&bytes));
        if state.live.md5.as_deref() == Some(md5.as_str()) {
            return ReloadOutcome::Unchanged { md5 };
        }
        if let Some((bad, error)) = &state.rejected {
            if *bad == md5 {
                // Already rejected (and counted, logged, evented) once.
                return ReloadOutcome::Rejected {
                    md5,
                    error: error.clone(),
                };
            }
        }
        if trigger == Trigger::Poll {
            let settle = (self.base.reload_interval / 4).min(Duration::from_millis(250));
            tokio::time::sleep(settle).await;
            match self.read_source().await {
                Ok(again) if again == bytes => {}
                _ => return ReloadOutcome::Settling,
            }
        }
        let previous = state.live.md5.clone();
        let plan = match SensitiveLayers::parse_for(&bytes, &self.shape) {
            Ok(p) => p,
            Err(e) => {
                let error = e.to_string();
                self.refuse(ConfigAction::Rejected, &md5, previous, &error);
                state.rejected = Some((md5.clone(), error.clone()));
                return ReloadOutcome::Rejected { md5, error };
            }
        };
        let live = resolve(&self.base, &self.model_config, Some((&plan, &md5)));
        match self.apply(&state.live, &live).await {
            Ok(changed) => {
                let seconds = t0.elapsed().as_secs_f64();
                let names: Vec<String> = changed.iter().map(|g| g.to_string()).collect();
                tracing::info!(source = %self.source, %md5, changed_groups = ?names, seconds, "sensitive_layers.json applied");
                self.metrics.reload(ReloadResult::Applied);
                self.metrics.set_config_md5(Some(&md5));
                self.metrics.config_apply_seconds.set(seconds);
                self.metrics.config_applied_at.set(now_ms() as f64 / 1000.0);
                self.update_status(|s| {
                    s.applied_total += 1;
                    s.applied_at_ms = Some(now_ms());
                    s.last_apply_seconds = Some(seconds);
                    s.last_error = None;
                    describe(s, &live, &self.base);
                });
                self.event(ConfigAction::Applied, &md5, previous, None, names.clone());
                state.live = live;
                state.rejected = None;
                ReloadOutcome::Applied {
                    md5,
                    changed_groups: names,
                    seconds,
                }
            }
            // A plan over the weight budget is refused like an invalid one: the same version
            // is not built again on every poll.
            Err(e @ EngineError::OverBudget(_)) => {
                let error = e.to_string();
                self.refuse(ConfigAction::Rejected, &md5, previous, &error);
                state.rejected = Some((md5.clone(), error.clone()));
                ReloadOutcome::Rejected { md5, error }
            }
            Err(e) => {
                let error = e.to_string();
                self.refuse(ConfigAction::Failed, &md5, previous, &error);
                ReloadOutcome::Failed { md5, error }
            }
        }
    }

    /// A version that does not take effect (rejected or failed): log, count, event; the plan
    /// in force stays.
    fn refuse(&self, action: ConfigAction, md5: &str, previous: Option<String>, error: &str) {
        let what = match action {
            ConfigAction::Rejected => "sensitive_layers.json rejected",
            _ => "could not apply sensitive_layers.json",
        };
        tracing::error!(source = %self.source, %md5, %error, "{what}; keeping the plan in force");
        self.metrics.reload(match action {
            ConfigAction::Rejected => ReloadResult::Rejected,
            _ => ReloadResult::Failed,
        });
        self.update_status(|s| {
            match action {
                ConfigAction::Rejected => s.rejected_total += 1,
                _ => s.failed_total += 1,
            }
            s.last_error = Some(error.to_string());
        });
        self.event(action, md5, previous, Some(error.to_string()), vec![]);
    }

    /// Build the changed groups (and the tables, when their form changes) off the actors'
    /// threads, then swap them in one message and reconfigure the monitor. All or nothing:
    /// when reconfiguring fails after the swap, the old forms are built and swapped back, so
    /// weights and recorded plan never disagree. Returns the groups whose form changed.
    async fn apply(&self, old: &LivePlan, new: &LivePlan) -> Result<Vec<GroupId>> {
        let default = self.base.default_residency;
        let changed: Vec<(GroupId, GroupForm)> = new
            .residency
            .keys()
            .map(|g| (*g, new.form(*g, default)))
            .filter(|(g, f)| old.form(*g, default) != *f)
            .collect();
        let tables = (new.embeddings != old.embeddings).then_some(new.embeddings);
        let column_errors = if changed.is_empty() && tables.is_none() {
            Vec::new()
        } else {
            self.swap(changed.clone(), tables, self.base.weight_budget)
                .await?
        };
        if let Err(e) = self.reconfigure(new, column_errors).await {
            if !changed.is_empty() || tables.is_some() {
                let back: Vec<(GroupId, GroupForm)> = changed
                    .iter()
                    .map(|(g, _)| (*g, old.form(*g, default)))
                    .collect();
                let old_tables = tables.map(|_| old.embeddings);
                match self.swap(back, old_tables, None).await {
                    Ok(_) => {
                        tracing::warn!(error = %e, "reconfiguring the monitor failed: the previous weights are back")
                    }
                    Err(e2) => {
                        tracing::error!(error = %e, rollback_error = %e2, "reconfiguring the monitor failed and the previous weights could not be restored")
                    }
                }
            }
            return Err(e);
        }
        Ok(changed.into_iter().map(|(g, _)| g).collect())
    }

    /// Build `groups` in their forms and the tables in `tables` (blocking loader, off the
    /// actors' threads) and swap them into the executor in one message. Returns the new
    /// forms' column errors.
    async fn swap(
        &self,
        groups: Vec<(GroupId, GroupForm)>,
        tables: Option<EmbeddingDtype>,
        within: Option<WeightBudget>,
    ) -> Result<Vec<(GroupId, Option<Arc<ColumnError>>)>> {
        let dir = self.model_dir.clone();
        let mcfg = self.model_config.clone();
        let (load, load_tables) = (self.loader, self.table_loader);
        let forms = self.base.forms_with(self.base.embeddings);
        let (built, tables) = tokio::task::spawn_blocking(move || -> Result<_> {
            let ck = Checkpoint::open(&dir)?;
            let groups = groups
                .into_iter()
                .map(|(g, f)| load(&ck, &mcfg, g, f, forms))
                .collect::<Result<Vec<PreparedGroup>>>()?;
            let tables = tables.map(|t| load_tables(&ck, &mcfg, t)).transpose()?;
            Ok((groups, tables))
        })
        .await
        .map_err(|e| EngineError::Config(format!("group loading task failed: {e}")))??;
        let column_errors = built
            .iter()
            .map(|p| (p.group, p.column_error.clone()))
            .collect();
        self.executor
            .send(SwapWeights {
                groups: built,
                tables,
                within,
            })
            .await
            .map_err(|_| EngineError::Stopped)??;
        Ok(column_errors)
    }

    /// The monitor takes the new thresholds and residencies.
    async fn reconfigure(
        &self,
        new: &LivePlan,
        column_errors: Vec<(GroupId, Option<Arc<ColumnError>>)>,
    ) -> Result<()> {
        crate::faults::before_reconfigure()?;
        if let Some(m) = &self.monitor {
            m.send(Reconfigure {
                config: new.monitor.clone(),
                residencies: new.residency.iter().map(|(g, r)| (*g, *r)).collect(),
                md5: new.md5.clone(),
                column_errors,
            })
            .await
            .map_err(|_| EngineError::Stopped)?;
        }
        Ok(())
    }
}

/// Write the plan in force into the status.
pub(crate) fn describe(s: &mut ConfigStatus, live: &LivePlan, base: &EngineConfig) {
    s.float_dtype = Some(base.float_dtype);
    s.float_budget = Some(live.budget.setting.to_string());
    s.float_budget_bytes = live.budget.budget_bytes;
    s.float_bytes = live.budget.float_bytes;
    s.tables = Some(live.embeddings);
    s.table_bytes = live.budget.table_bytes;
    s.split_activations = Some(base.split_activations);
    s.over_budget = live.budget.demoted.iter().map(|g| g.to_string()).collect();
    s.md5 = live.md5.clone();
    s.k = live.monitor.k;
    s.trigger_rate = live.monitor.trigger_rate;
    s.window_requests = live.monitor.window_requests;
    s.residency = live
        .residency
        .iter()
        .map(|(g, r)| (g.to_string(), *r))
        .collect();
    s.quant_format = live
        .quant
        .iter()
        .filter(|(_, q)| **q != QuantFormat::Q8_0)
        .map(|(g, q)| (g.to_string(), *q))
        .collect();
}

/// Polls the source on a timer and answers manual reloads.
pub struct ConfigActor {
    pub reloader: Arc<Reloader>,
}

impl Actor for ConfigActor {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Self::Context) {
        ctx.set_mailbox_capacity(16);
        ctx.run_interval(self.reloader.base.reload_interval, |act, ctx| {
            let r = act.reloader.clone();
            ctx.spawn(
                async move {
                    r.reload(Trigger::Poll).await;
                }
                .into_actor(act),
            );
        });
    }
}

/// Reload now (SIGHUP, `POST /admin/config/reload`), under the asker's span when it is
/// traced (its config event then belongs to that trace).
#[derive(Message)]
#[rtype(result = "ReloadOutcome")]
pub struct ReloadNow(pub Option<tracing::Span>);

impl Handler<ReloadNow> for ConfigActor {
    type Result = ResponseFuture<ReloadOutcome>;
    fn handle(&mut self, msg: ReloadNow, _: &mut Self::Context) -> Self::Result {
        use tracing::Instrument;
        let r = self.reloader.clone();
        let span = msg.0.unwrap_or_else(tracing::Span::none);
        Box::pin(async move { r.reload(Trigger::Manual).await }.instrument(span))
    }
}
