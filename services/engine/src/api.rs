//! The engine's API: the only surface the gateway (and a remote-engine client later)
//! uses. [`Engine`] is a cheap handle to the running actors; requests go in as
//! [`GenerateRequest`]s (validated here, in one place) and come back as [`Generation`]
//! streams.

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

/// What [`load_parts`] produces.
pub struct LoadedParts {
    pub backend: Box<dyn Backend>,
    pub tokenizer: TextTokenizer,
    pub model_config: ModelConfig,
    pub shape: ModelShape,
    /// The plan the model was loaded with.
    pub live: LivePlan,
}

/// Load the model and tokenizer (blocking; call off the async reactor). `plan` is the
/// `sensitive_layers.json` to start with, as bytes; it is validated against the
/// checkpoint before any weight is loaded.
pub fn load_parts(
    model_dir: &Path,
    cfg: &EngineConfig,
    plan: Option<&[u8]>,
) -> Result<LoadedParts> {
    cfg.validate()?;
    // One look at the files: a GGUF header is parsed once for config, weights and tokenizer.
    let files = ModelFiles::open(model_dir)?;
    let mcfg = files.config()?;
    for key in cfg.group_residency.keys() {
        let g = key.parse::<GroupId>().map_err(EngineError::Config)?;
        if g.layer >= mcfg.num_hidden_layers {
            return Err(EngineError::Config(format!(
                "group_residency names {g} but the model has {} layers",
                mcfg.num_hidden_layers
            )));
        }
    }
    let ck = files.checkpoint()?;
    let shape = model_shape(&ck, &mcfg)?;
    let validated = match plan {
        Some(bytes) => {
            let md5 = format!("{:x}", md5::compute(bytes));
            let source = cfg
                .sensitive_layers
                .as_deref()
                .unwrap_or("sensitive_layers.json");
            let p = SensitiveLayers::parse_for(bytes, &shape)
                .map_err(|e| EngineError::Config(format!("{source}: {e}")))?;
            Some((p, md5))
        }
        None => None,
    };
    let live = resolve(cfg, &mcfg, validated.as_ref().map(|(p, m)| (p, m.as_str())));
    let form = |g: GroupId| live.form(g, cfg.default_residency);
    let mut model = LlamaModel::load_planned(&ck, &mcfg, &form, live.forms(cfg))?;
    note_float_rounding(&ck, cfg.float_dtype);
    let m = &cfg.monitor;
    // Filled lazily by shadow passes (a plan reload may turn them on later).
    if m.enabled && m.shadow_reference == crate::monitor::ShadowReference::Checkpoint {
        model = model.with_reference(ReferenceWeights::new(
            ck,
            mcfg.clone(),
            cfg.float_dtype,
            m.shadow_reference_cache_mib << 20,
        ));
    }
    let backend = Box::new(model);
    let tokenizer = files.tokenizer()?;
    Ok(LoadedParts {
        backend,
        tokenizer,
        model_config: mcfg,
        shape,
        live,
    })
}

/// Say so when float copies are not the checkpoint's exact values (a 16-bit copy of f32 or
/// quantized weights); a 16-bit checkpoint stored in its own dtype loses nothing.
fn note_float_rounding(ck: &Checkpoint, float: crate::backend::FloatDtype) {
    use crate::backend::FloatDtype;
    let q = quantmesh_model::names::members(GroupKind::Qkv)[0];
    let name = quantmesh_model::names::member_weight(0, q);
    let Ok(info) = ck.info(&name) else { return };
    let exact = match float {
        FloatDtype::F32 => true,
        FloatDtype::F16 => info.dtype == "F16",
        FloatDtype::Bf16 => info.dtype == "BF16",
    };
    if !exact {
        tracing::info!(
            stored = %info.dtype,
            float_dtype = float.as_str(),
            "float copies are the checkpoint's {} values rounded to {} (relative error about 5e-4 \
             for f16); engine.float_dtype = \"f32\" keeps them exact",
            info.dtype,
            float.as_str()
        );
    }
}

/// The plan in force, in one log table: residencies, what the budget did, bytes by form.
fn log_plan(live: &LivePlan, cfg: &EngineConfig, w: &crate::backend::WeightBytes) {
    let count = |r: Residency| live.residency.values().filter(|x| **x == r).count();
    let mib = |b: usize| b as f64 / (1 << 20) as f64;
    let budget = match live.budget.budget_bytes {
        Some(b) => format!("{} ({:.1} MiB)", live.budget.setting, mib(b)),
        None => "unlimited".into(),
    };
    let table = format!(
        "\n| form | groups | MiB |\n|---|---|---|\n\
         | int8 only | {} | |\n| dual (int8 + {} copy) | {} | |\n| float only | {} | |\n\
         | int8 weights (Q8_0) | | {:.1} |\n| int4 weights (Q4_K/Q4_0, w4a16: {} groups) | | {:.1} |\n\
         | float copies | | {:.1} |\n\
         | embeddings, norms, lm_head (tables {}) | | {:.1} |\n\
         | total | | {:.1} = {:.2}× all-f16 ({:.1}) |\n\
         split activations: {}\n\
         float budget {budget}: tables {:.1} MiB beyond Q8_0, {} group(s) over it are INT8-only{}",
        count(Residency::Int8),
        cfg.float_dtype.as_str(),
        count(Residency::Dual),
        count(Residency::Float),
        mib(w.int8),
        live.quant
            .iter()
            .filter(|(g, q)| q.is_four_bit() && live.residency[*g].has_int8())
            .count(),
        mib(w.int4),
        mib(w.float),
        live.embeddings.as_str(),
        mib(w.other),
        mib(w.total()),
        w.ratio_to_f16(),
        mib(w.all_f16),
        cfg.split_activations.as_str(),
        mib(live.budget.table_bytes),
        live.budget.demoted.len(),
        if live.budget.demoted.is_empty() {
            String::new()
        } else {
            let names: Vec<String> = live
                .budget
                .demoted
                .iter()
                .take(8)
                .map(|g| g.to_string())
                .collect();
            let more = live.budget.demoted.len().saturating_sub(names.len());
            let tail = if more > 0 {
                format!(", … {more} more: GET /admin/config")
            } else {
                String::new()
            };
            format!(" ({}{tail})", names.join(", "))
        }
    );
    tracing::info!(sensitive_layers_md5 = ?live.md5, "precision plan in force:{table}");
}

/// Where the engine's model came from, for the handle and the config actor.
struct Origin<'a> {
    dir: &'a Path,
    load_seconds: f64,
    source: Option<Location>,
}

/// The handles the engine's actors share, and how each actor is started with them.
struct Wiring {
    name: String,
    mask: MaskHandle,
    /// Log, in-process broadcast, and the caller's sinks.
    sinks: Vec<Arc<dyn EventSink>>,
    events: ChannelSink,
    metrics: EngineMetrics,
    stats: StatsCell,
    monitor_report: Arc<Mutex<MonitorReport>>,
    config_status: Arc<Mutex<ConfigStatus>>,
    trace_hook: Option<TraceHook>,
}

impl Wiring {
    fn new(
        start: &EngineStart,
        registry: &prometheus::Registry,
        cfg: &EngineConfig,
        mcfg: &ModelConfig,
        backend: &dyn Backend,
    ) -> Result<Self> {
        let metrics = EngineMetrics::register(registry, &start.name)
            .map_err(|e| EngineError::Config(format!("registering the engine's metrics: {e}")))?;
        let weights = backend.weight_bytes();
        metrics.set_weights(&weights);
        let layers = mcfg.num_hidden_layers;
        let kv_bytes = |int8| {
            KvCache::bytes_per_token_layer_for(
                mcfg.kv_dim(),
                cfg.kv_scale.count(mcfg.kv_dim(), mcfg.head_dim()),
                cfg.kv_float_dtype,
                int8,
            ) * layers
        };
        let stats = StatsCell::new(EngineStats {
            kv_pages_total: cfg.num_pages,
            kv_pages_free: cfg.num_pages,
            resident_weight_bytes: backend.resident_bytes(),
            linear_weight_bytes: backend.linear_bytes(),
            weights,
            kv_bytes_per_token_int8: kv_bytes(true),
            kv_bytes_per_token_float: kv_bytes(false),
            ..Default::default()
        });
        let events = ChannelSink::new(1024);
        let mut sinks: Vec<Arc<dyn EventSink>> = vec![Arc::new(LogSink), Arc::new(events.clone())];
        sinks.extend(start.sinks.iter().cloned());
        Ok(Self {
            name: start.name.clone(),
            mask: MaskHandle::default(),
            sinks,
            events,
            metrics,
            stats,
            monitor_report: Default::default(),
            config_status: Default::default(),
            trace_hook: start.trace_hook.clone(),
        })
    }

    /// The monitor actor (the mask's one writer), unless monitoring is off.
    fn start_monitor(
        &self,
        cfg: &EngineConfig,
        live: &LivePlan,
        backend: &dyn Backend,
    ) -> Option<Addr<MonitorActor>> {
        if !cfg.monitor.enabled {
            return None;
        }
        let layers = backend.config().num_hidden_layers;
        let residencies: Vec<(GroupId, Residency)> = (0..layers)
            .flat_map(|l| GroupKind::ALL.map(|k| GroupId::new(l, k)))
            .map(|g| (g, backend.residency(g)))
            .collect();
        let mut core = Monitor::new(live.monitor.clone(), &self.name, &residencies);
        core.set_column_errors(
            residencies
                .iter()
                .map(|(g, _)| (*g, backend.column_error(*g))),
        );
        core.set_activation_spikes(cfg.split_activations != SplitActivations::All);
        core.config_md5 = live.md5.clone();
        Some(
            MonitorActor {
                core,
                mask: self.mask.clone(),
                sinks: self.sinks.clone(),
                report: self.monitor_report.clone(),
                metrics: self.metrics.clone(),
                trace_hook: self.trace_hook.clone(),
                traced: Default::default(),
            }
            .start(),
        )
    }

    /// The executor: one thread owning the backend and the KV bytes.
    fn start_executor(
        &self,
        cfg: &EngineConfig,
        mcfg: &ModelConfig,
        backend: Box<dyn Backend>,
        monitor: Option<&Addr<MonitorActor>>,
    ) -> Addr<ExecutorActor> {
        let kv = KvCache::new(
            mcfg.num_hidden_layers,
            cfg.num_pages,
            cfg.page_size,
            mcfg.kv_dim(),
            cfg.kv_float_dtype,
        )
        .with_scale(cfg.kv_scale, mcfg.head_dim());
        let state = Arc::new(Mutex::new(ExecutorState {
            backend,
            kv,
            runner: StepRunner::default(),
            mask: self.mask.clone(),
            kv_int8: cfg.kv_int8,
            monitor: monitor.map(|m| m.clone().recipient()),
            metrics: self.metrics.clone(),
            stats: self.stats.clone(),
        }));
        SyncArbiter::start(1, move || ExecutorActor {
            state: state.clone(),
        })
    }

    /// The scheduler: queue, running set, KV page metadata.
    fn start_scheduler(
        &self,
        cfg: &EngineConfig,
        executor: Addr<ExecutorActor>,
        monitor: Option<&Addr<MonitorActor>>,
    ) -> Addr<SchedulerActor> {
        SchedulerActor::new(SchedulerParts {
            core: Scheduler::new(
                BlockManager::new(cfg.num_pages, cfg.page_size, cfg.prefix_caching),
                SchedulerLimits {
                    max_num_seqs: cfg.max_num_seqs,
                    max_num_batched_tokens: cfg.max_num_batched_tokens,
                    max_waiting: cfg.max_waiting,
                },
            ),
            executor,
            stats: self.stats.clone(),
            metrics: self.metrics.clone(),
            mailbox_capacity: cfg.max_waiting.max(16),
            monitor: monitor.map(|m| m.clone().recipient()),
            traced: monitor
                .filter(|_| self.trace_hook.is_some())
                .map(|m| m.clone().recipient()),
        })
        .start()
    }
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
    /// Load the model from `model_dir` (with `cfg.sensitive_layers` when set) and start the
    /// actors, including the config actor that hot-reloads the plan. Must run inside an
    /// actix system (the gateway's, or `actix_rt::System`).
    pub async fn start(model_dir: &Path, cfg: EngineConfig, name: &str) -> Result<Engine> {
        Self::start_with(model_dir, cfg, EngineStart::named(name)).await
    }

    /// [`Engine::start`] with event sinks and a metrics registry.
    pub async fn start_with(
        model_dir: &Path,
        cfg: EngineConfig,
        start: EngineStart,
    ) -> Result<Engine> {
        let t0 = Instant::now();
        let source = match &cfg.sensitive_layers {
            Some(spec) => {
                Some(Location::parse(spec).map_err(|e| EngineError::Config(e.to_string()))?)
            }
            None => None,
        };
        let plan_bytes = match &source {
            Some(src) => match src.read().await {
                Ok(bytes) => Some(bytes),
                Err(StoreError::NotFound(what)) if cfg.sensitive_layers_optional => {
                    tracing::warn!(
                        source = %src,
                        missing = %what,
                        initial_plan = ?cfg.initial_plan,
                        "no plan published at the sensitive_layers source yet: serving the initial plan and polling for one"
                    );
                    match &cfg.initial_plan {
                        Some(p) => Some(std::fs::read(p).map(Into::into).map_err(|e| {
                            EngineError::Config(format!(
                                "reading the initial plan {}: {e}",
                                p.display()
                            ))
                        })?),
                        None => None,
                    }
                }
                Err(e) => {
                    return Err(EngineError::Config(format!(
                        "reading sensitive_layers.json: {e}"
                    )))
                }
            },
            None => None,
        };
        let dir = model_dir.to_path_buf();
        let cfg2 = cfg.clone();
        let parts =
            tokio::task::spawn_blocking(move || load_parts(&dir, &cfg2, plan_bytes.as_deref()))
                .await
                .map_err(|e| EngineError::Config(format!("model loading task failed: {e}")))??;
        let load_seconds = t0.elapsed().as_secs_f64();
        tracing::info!(
            model = start.name,
            seconds = load_seconds,
            layers = parts.model_config.num_hidden_layers,
            weight_mib = parts.backend.resident_bytes() / (1 << 20),
            sensitive_layers_md5 = ?parts.live.md5,
            "model loaded"
        );
        let origin = Origin {
            dir: model_dir,
            load_seconds,
            source,
        };
        Self::from_parts(parts, cfg, start, origin)
    }

    fn from_parts(
        parts: LoadedParts,
        cfg: EngineConfig,
        start: EngineStart,
        origin: Origin<'_>,
    ) -> Result<Engine> {
        let LoadedParts {
            backend,
            tokenizer,
            model_config: mcfg,
            shape,
            live,
        } = parts;
        // The tables are stored once, at load: later plans (hot reload) resolve against the
        // form they got, so the budget keeps charging what is resident.
        let cfg = EngineConfig {
            embeddings: live.embeddings,
            ..cfg
        };
        let registry = start.registry.clone().unwrap_or_default();
        let wiring = Wiring::new(&start, &registry, &cfg, &mcfg, backend.as_ref())?;
        if let Ok(mut st) = wiring.config_status.lock() {
            crate::reload::describe(&mut st, &live, &cfg);
        }
        log_plan(&live, &cfg, &backend.weight_bytes());
        let monitor = wiring.start_monitor(&cfg, &live, backend.as_ref());
        let loader = backend.group_loader();
        let executor = wiring.start_executor(&cfg, &mcfg, backend, monitor.as_ref());
        let config_actor = origin.source.map(|source| {
            ConfigActor {
                reloader: Arc::new(Reloader::new(ReloaderParts {
                    source,
                    base: cfg.clone(),
                    model_dir: origin.dir.to_path_buf(),
                    model_config: mcfg.clone(),
                    shape,
                    model_name: wiring.name.clone(),
                    live: live.clone(),
                    executor: executor.clone(),
                    monitor: monitor.clone(),
                    loader,
                    sinks: wiring.sinks.clone(),
                    status: wiring.config_status.clone(),
                    metrics: wiring.metrics.clone(),
                    trace_hook: wiring.trace_hook.clone(),
                })),
            }
            .start()
        });
        let tokenizer = Arc::new(tokenizer);
        let t2 = tokenizer.clone();
        let tokenizer_actor = SyncArbiter::start(2, move || TokenizerActor {
            tokenizer: t2.clone(),
        });
        let scheduler = wiring.start_scheduler(&cfg, executor.clone(), monitor.as_ref());
        let max_model_len = mcfg
            .max_position_embeddings
            .min(cfg.num_pages * cfg.page_size);
        let eos = mcfg.eos_ids();
        Ok(Engine {
            inner: Arc::new(Inner {
                scheduler,
                executor,
                tokenizer_actor,
                tokenizer,
                info: ModelInfo {
                    name: wiring.name.clone(),
                    dir: origin.dir.to_path_buf(),
                    config: mcfg,
                    max_model_len,
                    load_seconds: origin.load_seconds,
                },
                stats: wiring.stats,
                mask: wiring.mask,
                next_id: AtomicU64::new(1),
                eos,
                monitor,
                monitor_report: wiring.monitor_report,
                events: wiring.events,
                config_actor,
                config_status: wiring.config_status,
                registry,
            }),
        })
    }

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

    /// The text of one token as the tokenizer decodes it alone (for log-probabilities;
    /// a byte-level token that is part of a multi-byte character decodes lossily).
    pub fn token_text(&self, id: u32) -> String {
        self.inner.tokenizer.decode(&[id]).unwrap_or_default()
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

    /// Validate a request, tokenize its prompt and queue it. The returned [`Generation`]
    /// yields text as it is produced; dropping it cancels the request and frees its KV
    /// pages. Every check of a request lives here.
    pub async fn submit(&self, req: GenerateRequest) -> Result<Generation> {
        self.submit_n(req, 1)
            .await?
            .into_iter()
            .next()
            .ok_or(EngineError::Stopped)
    }

    /// [`Engine::submit`] sampling `n` answers to one prompt (OpenAI's `n`, at most
    /// [`MAX_N`]): the prompt is computed once and the answers share its KV pages
    /// (copy-on-write); with a `seed`, answer `i` uses `seed + i`.
    pub async fn submit_n(&self, req: GenerateRequest, n: usize) -> Result<Vec<Generation>> {
        if n == 0 || n > MAX_N {
            return Err(EngineError::InvalidRequest(format!(
                "n must be in 1..={MAX_N}, got {n}"
            )));
        }
        let invalid = |m: String| Err(EngineError::InvalidRequest(m));
        let GenerateRequest {
            prompt,
            params,
            max_input_tokens,
            max_total_tokens,
            cache_salt,
            trace,
        } = req;
        params
            .validate()
            .map_err(|e| EngineError::InvalidRequest(e.to_string()))?;
        match &prompt {
            Prompt::Text { text, .. } if text.is_empty() => {
                return invalid("the prompt is empty".into())
            }
            Prompt::Chat(messages) => {
                if messages.is_empty() {
                    return invalid("messages must not be empty".into());
                }
                if let Some(m) = messages
                    .iter()
                    .find(|m| !matches!(m.role.as_str(), "system" | "user" | "assistant"))
                {
                    return invalid(format!(
                        "unknown role {:?}: expected system, user or assistant",
                        m.role
                    ));
                }
            }
            _ => {}
        }
        let ids = match prompt {
            // Already ids: no tokenizer round trip.
            Prompt::Tokens(ids) => ids,
            p => match &trace {
                Some(request) => {
                    use tracing::Instrument;
                    let span = tracing::info_span!(target: crate::trace::TARGET, parent: request, "quantmesh.tokenize");
                    self.tokenize(p).instrument(span).await?
                }
                None => self.tokenize(p).await?,
            },
        };
        if ids.is_empty() {
            return invalid("the prompt is empty".into());
        }
        let vocab = self.inner.info.config.vocab_size as u32;
        if let Some((bad, _)) = params.logit_bias.iter().find(|(t, _)| *t >= vocab) {
            return invalid(format!(
                "logit_bias names token id {bad}, outside the vocabulary (size {vocab})"
            ));
        }
        if let Some(bad) = ids.iter().find(|&&t| t >= vocab) {
            return invalid(format!(
                "token id {bad} is outside the vocabulary (size {vocab})"
            ));
        }
        if let Some(max) = max_input_tokens {
            if ids.len() > max {
                return invalid(format!(
                    "the prompt has {} tokens; max_input_tokens is {max}",
                    ids.len()
                ));
            }
        }
        if let Some(max) = max_total_tokens {
            if ids.len() + params.max_tokens > max {
                return invalid(format!(
                    "prompt ({} tokens) + max_tokens ({}) exceeds max_total_tokens {max}",
                    ids.len(),
                    params.max_tokens
                ));
            }
        }
        let max_len = self.inner.info.max_model_len;
        if ids.len() + params.max_tokens > max_len {
            return invalid(format!(
                "prompt ({} tokens) + max_tokens ({}) exceeds the model's maximum length {max_len}",
                ids.len(),
                params.max_tokens
            ));
        }
        let salt = cache_salt.as_deref().map_or(0, crate::kv::salt_of);
        self.enqueue(ids, params, n, salt, trace).await
    }

    /// [`Engine::submit`] for a tokenized prompt.
    pub async fn generate(&self, prompt: Vec<u32>, params: SamplingParams) -> Result<Generation> {
        self.submit(GenerateRequest::new(Prompt::Tokens(prompt), params))
            .await
    }

    async fn enqueue(
        &self,
        prompt: Vec<u32>,
        params: SamplingParams,
        n: usize,
        cache_salt: u64,
        trace: Option<tracing::Span>,
    ) -> Result<Vec<Generation>> {
        let ids: Vec<SeqId> = (0..n)
            .map(|_| self.inner.next_id.fetch_add(1, Ordering::Relaxed))
            .collect();
        let prompt_len = prompt.len();
        let mut channels = Vec::with_capacity(n);
        let mut sequences = Vec::with_capacity(n);
        for (i, &id) in ids.iter().enumerate() {
            let (tx, rx) = mpsc::unbounded_channel();
            let mut p = params.clone();
            p.seed = params.seed.map(|s| s.wrapping_add(i as u64));
            sequences.push(Sequence::new(id, prompt.clone(), p, self.inner.eos.clone()));
            channels.push((id, tx, rx));
        }
        let mut sequences = sequences.into_iter();
        let Some(first) = sequences.next() else {
            return Ok(Vec::new());
        };
        let seq = first
            .with_forks(sequences.collect())
            .with_cache_salt(cache_salt)
            .with_trace(trace);
        let mut senders = channels.iter().map(|(id, tx, _)| (*id, tx.clone()));
        let Some((_, events)) = senders.next() else {
            return Ok(Vec::new());
        };
        let fork_events = senders.collect();
        self.inner
            .scheduler
            .send(Submit {
                seq,
                events,
                fork_events,
            })
            .await
            .map_err(|_| EngineError::Stopped)?
            .map_err(|e| match e {
                SubmitError::QueueFull { .. } | SubmitError::ShuttingDown => {
                    EngineError::Overloaded(e.to_string())
                }
                SubmitError::NeverFits { .. } => EngineError::InvalidRequest(e.to_string()),
            })?;
        Ok(channels
            .into_iter()
            .map(|(id, tx, rx)| {
                drop(tx);
                Generation {
                    id,
                    rx,
                    decoder: IncrementalDecoder::default(),
                    tokenizer: self.inner.tokenizer.clone(),
                    scheduler: self.inner.scheduler.clone(),
                    stop: params.stop.clone(),
                    text: String::new(),
                    emitted: 0,
                    prompt_tokens: prompt_len,
                    completion_tokens: 0,
                    finish: None,
                    released: false,
                    done: false,
                }
            })
            .collect())
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

/// One item of a generation stream.
#[derive(Debug, Clone, PartialEq)]
pub enum GenerationEvent {
    /// New text; may be empty while a multi-byte character or a possible stop string is
    /// held back. `token` is the sampled token, `None` for text flushed at the end;
    /// `logprobs` its log-probabilities when the request asked for them.
    Text {
        text: String,
        token: Option<u32>,
        logprobs: Option<TokenLogprobs>,
    },
    Done {
        reason: FinishReason,
        usage: Usage,
        cached_tokens: usize,
    },
}

/// A running request. Yields text deltas, then one `Done`. Dropping it before `Done`
/// cancels the request and frees its KV pages.
pub struct Generation {
    id: SeqId,
    rx: mpsc::UnboundedReceiver<SeqEvent>,
    decoder: IncrementalDecoder,
    tokenizer: Arc<TextTokenizer>,
    scheduler: Addr<SchedulerActor>,
    stop: Vec<String>,
    /// All text decoded so far; `text[..emitted]` has been handed out.
    text: String,
    emitted: usize,
    prompt_tokens: usize,
    completion_tokens: usize,
    /// Set once the end is known; the next call reports it.
    finish: Option<(FinishReason, usize)>,
    /// The engine no longer holds the request (finished, or cancelled by us).
    released: bool,
    done: bool,
}

impl Generation {
    pub fn id(&self) -> SeqId {
        self.id
    }

    /// Tokens in the prompt.
    pub fn prompt_tokens(&self) -> usize {
        self.prompt_tokens
    }

    /// Longest suffix of `text[emitted..]` that could still grow into a stop string.
    fn holdback(&self) -> usize {
        let pending = &self.text[self.emitted..];
        let mut hold = 0;
        for s in &self.stop {
            if let Some((i, _)) = pending.char_indices().find(|(i, _)| {
                let tail = &pending[*i..];
                tail.len() < s.len() && s.starts_with(tail)
            }) {
                hold = hold.max(pending.len() - i);
            }
        }
        hold
    }

    fn find_stop(&self) -> Option<usize> {
        let pending = &self.text[self.emitted..];
        self.stop
            .iter()
            .filter_map(|s| pending.find(s.as_str()))
            .min()
            .map(|p| self.emitted + p)
    }

    fn usage(&self) -> Usage {
        Usage {
            prompt_tokens: self.prompt_tokens,
            completion_tokens: self.completion_tokens,
            total_tokens: self.prompt_tokens + self.completion_tokens,
        }
    }

    fn release(&mut self) {
        if !self.released {
            self.released = true;
            self.scheduler.do_send(Cancel(self.id));
        }
    }

    /// The next event, or `None` after `Done`.
    pub async fn next(&mut self) -> Option<GenerationEvent> {
        if self.done {
            return None;
        }
        if let Some((reason, cached_tokens)) = self.finish.take() {
            self.done = true;
            return Some(GenerationEvent::Done {
                reason,
                usage: self.usage(),
                cached_tokens,
            });
        }
        match self.rx.recv().await {
            Some(SeqEvent::Token {
                token, logprobs, ..
            }) => {
                self.completion_tokens += 1;
                let delta = self
                    .decoder
                    .push(&self.tokenizer, token)
                    .unwrap_or_else(|e| {
                        tracing::warn!(error = %e, "detokenization failed");
                        None
                    });
                self.text.push_str(&delta.unwrap_or_default());
                let upto = match self.find_stop() {
                    Some(at) => {
                        // A stop string: end here, free the engine's pages now.
                        self.release();
                        self.finish = Some((FinishReason::Stop, 0));
                        at
                    }
                    None => self.text.len() - self.holdback(),
                };
                let text = self.text[self.emitted..upto].to_string();
                self.emitted = upto;
                Some(GenerationEvent::Text {
                    text,
                    token: Some(token),
                    logprobs,
                })
            }
            Some(SeqEvent::Finished {
                reason,
                cached_tokens,
                ..
            }) => {
                self.released = true;
                let tail = self.decoder.flush(&self.tokenizer).unwrap_or_default();
                self.text.push_str(&tail);
                let (end, reason) = match self.find_stop() {
                    Some(at) => (at, FinishReason::Stop),
                    None => (self.text.len(), reason),
                };
                let text = self.text[self.emitted..end].to_string();
                self.emitted = end;
                if text.is_empty() {
                    self.done = true;
                    return Some(GenerationEvent::Done {
                        reason,
                        usage: self.usage(),
                        cached_tokens,
                    });
                }
                self.finish = Some((reason, cached_tokens));
                Some(GenerationEvent::Text {
                    text,
                    token: None,
                    logprobs: None,
                })
            }
            None => {
                self.done = true;
                self.released = true;
                Some(GenerationEvent::Done {
                    reason: FinishReason::Error,
                    usage: self.usage(),
                    cached_tokens: 0,
                })
            }
        }
    }

    /// Run to the end and collect the text (non-streaming use).
    pub async fn collect(mut self) -> (String, FinishReason, Usage, usize) {
        let mut text = String::new();
        while let Some(ev) = self.next().await {
            match ev {
                GenerationEvent::Text { text: t, .. } => text.push_str(&t),
                GenerationEvent::Done {
                    reason,
                    usage,
                    cached_tokens,
                } => return (text, reason, usage, cached_tokens),
            }
        }
        (text, FinishReason::Error, self.usage(), 0)
    }
}

impl Drop for Generation {
    fn drop(&mut self) {
        self.release();
    }
}
