//! The engine handle: what it holds, and its queries and admin operations.

use crate::error::EngineError;
use crate::error::Result;
use crate::events::ChannelSink;
use crate::events::EventSink;
use crate::executor::ExecutorActor;
use crate::monitor::ForceGroup;
use crate::monitor::MonitorActor;
use crate::monitor::{ForceMode, MonitorReport};
use crate::precision::MaskHandle;
use crate::precision::PathMask;
use crate::reload::{ConfigActor, ReloadNow};
use crate::reload::{ConfigStatus, ReloadOutcome};
use crate::request::Prompt;
use crate::sched::Drain;
use crate::sched::SchedulerActor;
use crate::stats::EngineStats;
use crate::stats::StatsCell;
use crate::tokenize::EncodePrompt;
use crate::tokenize::TokenizerActor;
use crate::trace::TraceHook;
use actix::prelude::*;
use quantmesh_model::TextTokenizer;
use quantmesh_model::{ChatMessage, ModelConfig};
use quantmesh_store::{Location, StoreError};
use quantmesh_types::{ConfigEvent, FallbackEvent, GroupId};
use std::path::PathBuf;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};

/// Static facts about the loaded model.
#[derive(Debug, Clone)]
pub struct ModelInfo {
    pub name: String,
    pub dir: PathBuf,
    pub config: ModelConfig,
    /// Longest prompt + completion the engine accepts.
    pub max_model_len: usize,
    pub load_seconds: f64,
}

/// Most answers one request may sample (`n`).
pub const MAX_N: usize = 8;

/// How an engine is started besides its configuration.
#[derive(Clone, Default)]
pub struct EngineStart {
    /// The served model name (events, metrics' `model_name`).
    pub name: String,
    /// Where fallback and config events go besides the log and the in-process broadcast.
    pub sinks: Vec<Arc<dyn EventSink>>,
    /// Where the engine registers its metrics (a private registry when `None`).
    pub registry: Option<prometheus::Registry>,
    /// Turns spans into W3C `traceparent`s when the caller exports traces: the monitor's
    /// and the reloader's events then carry one (see [`crate::trace`]).
    pub trace_hook: Option<TraceHook>,
}

impl EngineStart {
    pub fn named(name: &str) -> Self {
        Self {
            name: name.to_string(),
            ..Default::default()
        }
    }
}

pub(super) struct Inner {
    pub(super) scheduler: Addr<SchedulerActor>,
    pub(super) executor: Addr<ExecutorActor>,
    pub(super) tokenizer_actor: Addr<TokenizerActor>,
    pub(super) tokenizer: Arc<TextTokenizer>,
    pub(super) info: ModelInfo,
    pub(super) stats: StatsCell,
    pub(super) mask: MaskHandle,
    pub(super) next_id: AtomicU64,
    pub(super) eos: Vec<u32>,
    pub(super) monitor: Option<Addr<MonitorActor>>,
    pub(super) monitor_report: Arc<Mutex<MonitorReport>>,
    pub(super) events: ChannelSink,
    pub(super) config_actor: Option<Addr<ConfigActor>>,
    pub(super) config_status: Arc<Mutex<ConfigStatus>>,
    pub(super) registry: prometheus::Registry,
}

#[derive(Clone)]
pub struct Engine {
    pub(super) inner: Arc<Inner>,
}

/// Whether a configured plan source answers "no such object" (nothing published there
/// yet). Any other outcome — readable, unreachable, malformed — is false: those are for
/// [`Engine::start`] to serve or report.
pub async fn plan_source_is_empty(spec: Option<&str>) -> bool {
    let Some(Ok(loc)) = spec.map(Location::parse) else {
        return false;
    };
    matches!(loc.read().await, Err(StoreError::NotFound(_)))
}

impl Engine {
    /// Reload `sensitive_layers.json` now (SIGHUP, admin API). Errors when no source is
    /// configured.
    pub async fn reload_config(&self) -> Result<ReloadOutcome> {
        self.reload_config_traced(None).await
    }

    /// [`Engine::reload_config`] as part of the trace of `span` (an admin request's).
    pub async fn reload_config_traced(&self, span: Option<tracing::Span>) -> Result<ReloadOutcome> {
        let a = self.inner.config_actor.as_ref().ok_or_else(|| {
            EngineError::InvalidRequest(
                "no sensitive_layers source is configured (--sensitive-layers)".into(),
            )
        })?;
        a.send(ReloadNow(span))
            .await
            .map_err(|_| EngineError::Stopped)
    }

    /// The plan in force (md5, thresholds, residencies, float budget), the reload counters,
    /// and the resident weights by form.
    pub fn config_status(&self) -> ConfigStatus {
        let mut st = self
            .inner
            .config_status
            .lock()
            .map(|s| s.clone())
            .unwrap_or_default();
        st.weights = Some(self.inner.stats.get().weights);
        st
    }

    /// Configuration changes (applied / rejected) from now on.
    pub fn subscribe_config_events(&self) -> tokio::sync::broadcast::Receiver<ConfigEvent> {
        self.inner.events.subscribe_config()
    }

    pub fn info(&self) -> &ModelInfo {
        &self.inner.info
    }

    pub fn stats(&self) -> EngineStats {
        self.inner.stats.get()
    }

    /// Whether the engine can serve: every actor on the request path is alive. A panicking
    /// step does not make it unready (the panic is contained to that step's requests); an
    /// actor whose thread or context has stopped does.
    pub fn readiness(&self) -> std::result::Result<(), String> {
        let i = &self.inner;
        let dead = [
            ("scheduler", i.scheduler.connected()),
            ("executor", i.executor.connected()),
            ("tokenizer", i.tokenizer_actor.connected()),
        ]
        .into_iter()
        .filter(|(_, up)| !up)
        .map(|(name, _)| name)
        .collect::<Vec<_>>();
        match dead.is_empty() {
            true => Ok(()),
            false => Err(format!("engine actors stopped: {}", dead.join(", "))),
        }
    }

    /// The registry holding the engine's metrics (the caller's, when it passed one).
    pub fn registry(&self) -> &prometheus::Registry {
        &self.inner.registry
    }

    /// The fallback mask in force (read-only: the monitor actor is its one writer).
    pub fn mask(&self) -> Arc<PathMask> {
        self.inner.mask.load()
    }

    pub fn tokenizer(&self) -> &Arc<TextTokenizer> {
        &self.inner.tokenizer
    }

    /// Token ids of a prompt (on the tokenizer pool).
    pub async fn tokenize(&self, prompt: Prompt) -> Result<Vec<u32>> {
        self.inner
            .tokenizer_actor
            .send(EncodePrompt(prompt))
            .await
            .map_err(|_| EngineError::Stopped)?
    }

    /// Token ids of `text`.
    pub async fn encode(&self, text: String, add_bos: bool) -> Result<Vec<u32>> {
        self.tokenize(Prompt::Text { text, add_bos }).await
    }

    /// The prompt text the chat template renders for `messages` (for inspection; serving
    /// renders and encodes in one tokenizer call).
    pub fn apply_chat_template(&self, messages: &[ChatMessage]) -> Result<String> {
        Ok(self.inner.tokenizer.apply_chat_template(messages)?)
    }

    /// Every fallback decision from now on (bounded broadcast; see `events::ChannelSink`).
    pub fn subscribe_fallback_events(&self) -> tokio::sync::broadcast::Receiver<FallbackEvent> {
        self.inner.events.subscribe()
    }

    /// Every closed monitor window's evidence from now on (bounded broadcast).
    pub fn subscribe_window_events(
        &self,
    ) -> tokio::sync::broadcast::Receiver<quantmesh_types::WindowEvent> {
        self.inner.events.subscribe_windows()
    }

    /// The monitor's state per group; `None` when monitoring is off.
    pub fn monitor_report(&self) -> Option<MonitorReport> {
        self.inner.monitor.as_ref()?;
        self.inner.monitor_report.lock().ok().map(|r| r.clone())
    }

    /// Pin a group to float or INT8, or hand it back to the monitor; the ids of the events
    /// the decision made.
    pub async fn force_group(&self, group: GroupId, mode: ForceMode) -> Result<Vec<String>> {
        self.force_group_traced(group, mode, None).await
    }

    /// [`Engine::force_group`] as part of the trace of `span` (an admin request's): the
    /// decision is noted in it and its events carry its `traceparent`.
    pub async fn force_group_traced(
        &self,
        group: GroupId,
        mode: ForceMode,
        span: Option<tracing::Span>,
    ) -> Result<Vec<String>> {
        let m = self.inner.monitor.as_ref().ok_or_else(|| {
            EngineError::InvalidRequest("the activation monitor is disabled".into())
        })?;
        m.send(ForceGroup { group, mode, span })
            .await
            .map_err(|_| EngineError::Stopped)?
            .map_err(EngineError::InvalidRequest)
    }

    /// Stop admitting new requests and wait until running ones have finished.
    pub async fn drain(&self) {
        let _ = self.inner.scheduler.send(Drain).await;
    }
}
