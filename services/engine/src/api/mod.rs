//! The engine's API: the only surface the gateway (and a remote-engine client later)
//! uses. [`Engine`] is a cheap handle to the running actors; requests go in as
//! [`GenerateRequest`]s (validated here, in one place) and come back as [`Generation`]
//! streams.
//!
//! - `load.rs`: the model, tokenizer and plan read from disk ([`load_parts`]);
//! - `wiring.rs`: the actors started with the handles they share ([`Engine::start`]);
//! - `submit.rs`: a request checked, tokenized and queued ([`Engine::submit`]);
//! - `generation.rs`: the stream of one answer ([`Generation`]);
//! - here: the handle itself and its queries and admin operations.

use crate::backend::cpu::reference::ReferenceWeights;
use crate::backend::cpu::LlamaModel;
use crate::backend::Backend;
use crate::error::Result;
use crate::events::{ChannelSink, LogSink};
use crate::executor::{ExecutorActor, ExecutorState};
use crate::kv::{BlockManager, KvCache, SeqId};
use crate::metrics::EngineMetrics;
use crate::monitor::ForceGroup;
use crate::monitor::{Monitor, MonitorActor};
use crate::plan::{resolve, LivePlan};
use crate::precision::{MaskHandle, StepRunner};
use crate::reload::{ConfigActor, ReloadNow, Reloader, ReloaderParts};
use crate::sched::{Cancel, Drain, Submit};
use crate::sched::{
    Scheduler, SchedulerActor, SchedulerLimits, SchedulerParts, SeqEvent, Sequence, SubmitError,
};
use crate::stats::StatsCell;
use crate::tokenize::EncodePrompt;
use crate::tokenize::TokenizerActor;
use actix::prelude::*;
use quantmesh_model::{model_shape, Checkpoint, IncrementalDecoder, ModelFiles, TextTokenizer};
use quantmesh_store::{Location, StoreError};
use quantmesh_types::{
    ConfigEvent, FallbackEvent, FinishReason, GroupId, GroupKind, ModelShape, Residency,
    SamplingParams, SensitiveLayers, TokenLogprobs, Usage,
};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;
use tokio::sync::mpsc;

mod generation;
mod load;
mod submit;
mod wiring;

pub use crate::backend::cpu::leave_the_cores_to_the_kernel_pool;
pub use crate::backend::{EmbeddingDtype, FloatDtype, Forms, SplitActivations, WeightBytes};
pub use crate::budget::FloatBudget;
pub use crate::config::EngineConfig;
pub use crate::error::{EngineError, ModelError};
pub use crate::events::EventSink;
pub use crate::kv::{KvFloatDtype, KvScale};
pub use crate::metrics::EngineMetrics as Metrics;
pub use crate::monitor::{
    Decision, DecisionCount, ForceMode, GroupMode, GroupReport, MonitorConfig, MonitorReport,
};
pub use crate::precision::PathMask;
pub use crate::reload::{ConfigStatus, ReloadOutcome};
pub use crate::request::{GenerateRequest, Prompt};
pub use crate::stats::EngineStats;
pub use crate::trace::{TraceHook, TARGET as TRACE_TARGET};
pub use generation::{Generation, GenerationEvent, LogprobsText};
pub use load::{load_parts, LoadedParts};
pub use quantmesh_model::{ChatMessage, ModelConfig};

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

struct Inner {
    scheduler: Addr<SchedulerActor>,
    executor: Addr<ExecutorActor>,
    tokenizer_actor: Addr<TokenizerActor>,
    tokenizer: Arc<TextTokenizer>,
    info: ModelInfo,
    stats: StatsCell,
    mask: MaskHandle,
    next_id: AtomicU64,
    eos: Vec<u32>,
    monitor: Option<Addr<MonitorActor>>,
    monitor_report: Arc<Mutex<MonitorReport>>,
    events: ChannelSink,
    config_actor: Option<Addr<ConfigActor>>,
    config_status: Arc<Mutex<ConfigStatus>>,
    registry: prometheus::Registry,
}

#[derive(Clone)]
pub struct Engine {
    inner: Arc<Inner>,
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

    /// Pin a group to float or INT8, or hand it back to the monitor.
    pub async fn force_group(&self, group: GroupId, mode: ForceMode) -> Result<()> {
        self.force_group_traced(group, mode, None).await
    }

    /// [`Engine::force_group`] as part of the trace of `span` (an admin request's): the
    /// decision is noted in it and its events carry its `traceparent`.
    pub async fn force_group_traced(
        &self,
        group: GroupId,
        mode: ForceMode,
        span: Option<tracing::Span>,
    ) -> Result<()> {
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
