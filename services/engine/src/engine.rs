//! The `Engine` handle: what the gateway (and tests, and benchmarks) call.

use crate::actors::{ExecutorActor, ExecutorState, MonitorActor, SchedulerActor, TokenizerActor};
use crate::block_manager::{BlockManager, SeqId};
use crate::checkpoint::Checkpoint;
use crate::config::{EngineConfig, ModelConfig};
use crate::error::{EngineError, Result};
use crate::events::{ChannelSink, EventSink, LogSink};
use crate::kv_cache::KvCache;
use crate::mask::MaskHandle;
use crate::messages::ForceGroup;
use crate::messages::{ApplyChatTemplate, Cancel, Drain, Encode, Submit};
use crate::model::LlamaModel;
use crate::monitor::{ForceMode, Monitor, MonitorReport};
use crate::plan::{model_shape, resolve, LivePlan};
use crate::reload::{ConfigActor, ConfigStatus, ReloadNow, ReloadOutcome, Reloader};
use crate::scheduler::{Scheduler, SchedulerLimits, SeqEvent, Sequence, SubmitError};
use crate::stats::{EngineStats, StatsCell};
use crate::tokenizer::{ChatMessage, IncrementalDecoder, TextTokenizer};
use actix::prelude::*;
use quantmesh_shared::{ConfigEvent, ModelShape, SensitiveLayers};
use quantmesh_shared::{FallbackEvent, GroupKind};
use quantmesh_shared::{FinishReason, GroupId, Residency, SamplingParams, Usage};
use quantmesh_store::Location;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;
use tokio::sync::mpsc;

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

struct Inner {
    scheduler: Addr<SchedulerActor>,
    tokenizer_actor: Addr<TokenizerActor>,
    tokenizer: Arc<TextTokenizer>,
    info: ModelInfo,
    stats: StatsCell,
    mask: MaskHandle,
    next_id: AtomicU64,
    eos: Vec<u32>,
    monitor: Option<Addr<MonitorActor>>,
    monitor_report: Arc<Mutex<MonitorReport>>,
    kl_samples: Arc<Mutex<Vec<f64>>>,
    events: ChannelSink,
    config_actor: Option<Addr<ConfigActor>>,
    config_status: Arc<Mutex<ConfigStatus>>,
}

#[derive(Clone)]
pub struct Engine {
    inner: Arc<Inner>,
}

/// What [`load_parts`] produces.
pub struct LoadedParts {
    pub model: LlamaModel,
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
    let mcfg = ModelConfig::load(model_dir)?;
    for key in cfg.group_residency.keys() {
        let g = key.parse::<GroupId>().map_err(EngineError::Config)?;
        if g.layer >= mcfg.num_hidden_layers {
            return Err(EngineError::Config(format!(
                "group_residency names {g} but the model has {} layers",
                mcfg.num_hidden_layers
            )));
        }
    }
    let ck = Checkpoint::open(model_dir)?;
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
    let live = resolve(
        cfg,
        mcfg.num_hidden_layers,
        validated.as_ref().map(|(p, m)| (p, m.as_str())),
    );
    let residency = |g: GroupId| {
        live.residency
            .get(&g)
            .copied()
            .unwrap_or(cfg.default_residency)
    };
    let model = LlamaModel::load_from(&ck, &mcfg, &residency)?;
    let tokenizer = TextTokenizer::load(model_dir)?;
    Ok(LoadedParts {
        model,
        tokenizer,
        model_config: mcfg,
        shape,
        live,
    })
}

impl Engine {
    /// Load the model from `model_dir` (with `cfg.sensitive_layers` when set) and start the
    /// actors, including the config actor that hot-reloads the plan. Must run inside an
    /// actix system (the gateway's, or `actix_rt::System`).
    pub async fn start(model_dir: &Path, cfg: EngineConfig, name: &str) -> Result<Engine> {
        Self::start_with_sinks(model_dir, cfg, name, Vec::new()).await
    }

    /// [`Engine::start`], publishing every fallback and config event to `sinks` as well as
    /// to the log and the in-process broadcast.
    pub async fn start_with_sinks(
        model_dir: &Path,
        cfg: EngineConfig,
        name: &str,
        sinks: Vec<Arc<dyn EventSink>>,
    ) -> Result<Engine> {
        let t0 = Instant::now();
        let source = match &cfg.sensitive_layers {
            Some(spec) => {
                Some(Location::parse(spec).map_err(|e| EngineError::Config(e.to_string()))?)
            }
            None => None,
        };
        let plan_bytes =
            match &source {
                Some(src) => Some(src.read().await.map_err(|e| {
                    EngineError::Config(format!("reading sensitive_layers.json: {e}"))
                })?),
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
            model = name,
            seconds = load_seconds,
            layers = parts.model_config.num_hidden_layers,
            weight_mib = parts.model.resident_bytes() / (1 << 20),
            sensitive_layers_md5 = ?parts.live.md5,
            "model loaded"
        );
        Ok(Self::from_parts(
            parts,
            cfg,
            name,
            model_dir,
            load_seconds,
            source,
            sinks,
        ))
    }

    pub fn from_parts(
        parts: LoadedParts,
        cfg: EngineConfig,
        name: &str,
        dir: &Path,
        load_seconds: f64,
        source: Option<Location>,
        extra_sinks: Vec<Arc<dyn EventSink>>,
    ) -> Engine {
        let LoadedParts {
            model,
            tokenizer: tok,
            model_config: mcfg,
            shape,
            live,
        } = parts;
        let kv = KvCache::new(
            mcfg.num_hidden_layers,
            cfg.num_pages,
            cfg.page_size,
            mcfg.kv_dim(),
            cfg.kv_float_dtype,
        );
        let stats = StatsCell::new(EngineStats {
            kv_pages_total: cfg.num_pages,
            kv_pages_free: cfg.num_pages,
            resident_weight_bytes: model.resident_bytes(),
            linear_weight_bytes: model.linear_bytes(),
            kv_bytes_per_token_int8: kv.bytes_per_token_layer(true) * mcfg.num_hidden_layers,
            kv_bytes_per_token_float: kv.bytes_per_token_layer(false) * mcfg.num_hidden_layers,
            ..Default::default()
        });
        let mask = MaskHandle::default();
        let residencies: Vec<(GroupId, Residency)> = (0..mcfg.num_hidden_layers)
            .flat_map(|l| GroupKind::ALL.map(|k| GroupId::new(l, k)))
            .map(|g| (g, model.residency(g)))
            .collect();
        let events = ChannelSink::new(1024);
        let mut sinks: Vec<Arc<dyn EventSink>> = vec![Arc::new(LogSink), Arc::new(events.clone())];
        sinks.extend(extra_sinks);
        let monitor_report = Arc::new(Mutex::new(MonitorReport::default()));
        let kl_samples = Arc::new(Mutex::new(Vec::new()));
        let monitor = cfg.monitor.enabled.then(|| {
            let mut core = Monitor::new(live.monitor.clone(), name, &residencies);
            core.config_md5 = live.md5.clone();
            MonitorActor {
                core,
                mask: mask.clone(),
                sinks: sinks.clone(),
                report: monitor_report.clone(),
                kl_samples: kl_samples.clone(),
            }
            .start()
        });
        let state = Arc::new(Mutex::new(ExecutorState {
            model,
            kv,
            mask: mask.clone(),
            kv_int8: cfg.kv_int8,
        }));
        let executor = SyncArbiter::start(1, move || ExecutorActor {
            state: state.clone(),
        });
        let config_status = Arc::new(Mutex::new(ConfigStatus::default()));
        let config_actor = source.map(|source| {
            ConfigActor {
                reloader: Arc::new(Reloader::new(
                    source,
                    cfg.clone(),
                    dir.to_path_buf(),
                    mcfg.clone(),
                    shape,
                    name.to_string(),
                    live.clone(),
                    executor.clone(),
                    monitor.clone(),
                    stats.clone(),
                    sinks.clone(),
                    config_status.clone(),
                )),
            }
            .start()
        });
        let tokenizer = Arc::new(tok);
        let t2 = tokenizer.clone();
        let tokenizer_actor = SyncArbiter::start(2, move || TokenizerActor {
            tokenizer: t2.clone(),
        });
        let core = Scheduler::new(
            BlockManager::new(cfg.num_pages, cfg.page_size, cfg.prefix_caching),
            SchedulerLimits {
                max_num_seqs: cfg.max_num_seqs,
                max_num_batched_tokens: cfg.max_num_batched_tokens,
                max_waiting: cfg.max_waiting,
            },
        );
        let mut scheduler = SchedulerActor::new(
            core,
            executor,
            mask.clone(),
            stats.clone(),
            cfg.max_waiting.max(16),
        );
        scheduler.monitor = monitor.clone().map(|m| m.recipient());
        let scheduler = scheduler.start();
        let max_model_len = mcfg
            .max_position_embeddings
            .min(cfg.num_pages * cfg.page_size);
        let eos = mcfg.eos_ids();
        Engine {
            inner: Arc::new(Inner {
                scheduler,
                tokenizer_actor,
                tokenizer,
                info: ModelInfo {
                    name: name.to_string(),
                    dir: dir.to_path_buf(),
                    config: mcfg,
                    max_model_len,
                    load_seconds,
                },
                stats,
                mask,
                next_id: AtomicU64::new(1),
                eos,
                monitor,
                monitor_report,
                kl_samples,
                events,
                config_actor,
                config_status,
            }),
        }
    }

    /// Reload `sensitive_layers.json` now (SIGHUP, admin API). Errors when no source is
    /// configured.
    pub async fn reload_config(&self) -> Result<ReloadOutcome> {
        let a = self.inner.config_actor.as_ref().ok_or_else(|| {
            EngineError::InvalidRequest(
                "no sensitive_layers source is configured (--sensitive-layers)".into(),
            )
        })?;
        a.send(ReloadNow).await.map_err(|_| EngineError::Stopped)
    }

    /// The hot-reload state: md5 in force, counters, live thresholds and residencies.
    pub fn config_status(&self) -> ConfigStatus {
        self.inner
            .config_status
            .lock()
            .map(|s| s.clone())
            .unwrap_or_default()
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

    /// The live fallback mask (the activation monitor and admin routes publish here).
    pub fn mask(&self) -> &MaskHandle {
        &self.inner.mask
    }

    pub fn tokenizer(&self) -> &Arc<TextTokenizer> {
        &self.inner.tokenizer
    }

    pub async fn encode(&self, text: String, add_bos: bool) -> Result<Vec<u32>> {
        self.inner
            .tokenizer_actor
            .send(Encode { text, add_bos })
            .await
            .map_err(|_| EngineError::Stopped)?
    }

    pub async fn apply_chat_template(&self, messages: Vec<ChatMessage>) -> Result<String> {
        self.inner
            .tokenizer_actor
            .send(ApplyChatTemplate(messages))
            .await
            .map_err(|_| EngineError::Stopped)?
    }

    /// Queue a tokenized prompt. The returned [`Generation`] yields text as it is produced;
    /// dropping it cancels the request and frees its KV pages.
    pub async fn generate(&self, prompt: Vec<u32>, params: SamplingParams) -> Result<Generation> {
        params
            .validate()
            .map_err(|e| EngineError::InvalidRequest(e.to_string()))?;
        if prompt.is_empty() {
            return Err(EngineError::InvalidRequest("the prompt is empty".into()));
        }
        let vocab = self.inner.info.config.vocab_size as u32;
        if let Some(bad) = prompt.iter().find(|&&t| t >= vocab) {
            return Err(EngineError::InvalidRequest(format!(
                "token id {bad} is outside the vocabulary (size {vocab})"
            )));
        }
        let max_len = self.inner.info.max_model_len;
        if prompt.len() + params.max_tokens > max_len {
            return Err(EngineError::InvalidRequest(format!(
                "prompt ({} tokens) + max_tokens ({}) exceeds the model's maximum length {max_len}",
                prompt.len(),
                params.max_tokens
            )));
        }
        let id = self.inner.next_id.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = mpsc::unbounded_channel();
        let prompt_len = prompt.len();
        let stop = params.stop.clone();
        let seq = Sequence::new(id, prompt, params, self.inner.eos.clone());
        self.inner
            .scheduler
            .send(Submit { seq, events: tx })
            .await
            .map_err(|_| EngineError::Stopped)?
            .map_err(|e| match e {
                SubmitError::QueueFull { .. } | SubmitError::ShuttingDown => {
                    EngineError::Overloaded(e.to_string())
                }
                SubmitError::NeverFits { .. } => EngineError::InvalidRequest(e.to_string()),
            })?;
        Ok(Generation {
            id,
            rx,
            decoder: IncrementalDecoder::default(),
            tokenizer: self.inner.tokenizer.clone(),
            scheduler: self.inner.scheduler.clone(),
            stop,
            text: String::new(),
            emitted: 0,
            prompt_tokens: prompt_len,
            completion_tokens: 0,
            finish: None,
            released: false,
            done: false,
        })
    }

    /// Every fallback decision from now on (bounded broadcast; see `events::ChannelSink`).
    pub fn subscribe_fallback_events(&self) -> tokio::sync::broadcast::Receiver<FallbackEvent> {
        self.inner.events.subscribe()
    }

    /// The monitor's state per group; `None` when monitoring is off.
    pub fn monitor_report(&self) -> Option<MonitorReport> {
        self.inner.monitor.as_ref()?;
        self.inner.monitor_report.lock().ok().map(|r| r.clone())
    }

    /// Pin a group to float or INT8, or hand it back to the monitor.
    pub async fn force_group(&self, group: GroupId, mode: ForceMode) -> Result<()> {
        let m = self.inner.monitor.as_ref().ok_or_else(|| {
            EngineError::InvalidRequest("the activation monitor is disabled".into())
        })?;
        m.send(ForceGroup { group, mode })
            .await
            .map_err(|_| EngineError::Stopped)?
            .map_err(EngineError::InvalidRequest)
    }

    /// Shadow-KL samples recorded since the last call (for the metrics histogram).
    pub fn drain_shadow_kl(&self) -> Vec<f64> {
        self.inner
            .kl_samples
            .lock()
            .map(|mut k| std::mem::take(&mut *k))
            .unwrap_or_default()
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
    /// held back. `token` is the sampled token, `None` for text flushed at the end.
    Text { text: String, token: Option<u32> },
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
            Some(SeqEvent::Token { token, .. }) => {
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
                Some(GenerationEvent::Text { text, token: None })
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
