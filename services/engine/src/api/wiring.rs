//! Starting an engine: the plan read, the model loaded off the reactor, the actors started
//! with the handles they share.

use super::handle::*;
use super::load::log_plan;
use super::load::{load_parts, LoadedParts};
use crate::backend::Backend;
use crate::backend::SplitActivations;
use crate::config::EngineConfig;
use crate::error::EngineError;
use crate::error::Result;
use crate::events::EventSink;
use crate::events::{ChannelSink, LogSink};
use crate::executor::{ExecutorActor, ExecutorState};
use crate::kv::{BlockManager, KvCache};
use crate::metrics::EngineMetrics;
use crate::monitor::MonitorReport;
use crate::monitor::{Monitor, MonitorActor};
use crate::plan::LivePlan;
use crate::precision::{MaskHandle, StepRunner};
use crate::reload::ConfigStatus;
use crate::reload::{ConfigActor, Reloader, ReloaderParts};
use crate::sched::{Scheduler, SchedulerActor, SchedulerLimits, SchedulerParts};
use crate::stats::EngineStats;
use crate::stats::StatsCell;
use crate::tokenize::TokenizerActor;
use crate::trace::TraceHook;
use actix::prelude::*;
use quantmesh_model::ModelConfig;
use quantmesh_store::{Location, StoreError};
use quantmesh_types::{GroupId, GroupKind, Residency};
use std::path::Path;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};
use std::time::Instant;

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
        // Spikes count under every width: under `all` too a spiking row sent to a float
        // copy takes the weights' error with it (SmolLM2, three held-out texts: mean KL to
        // the float model 0.4–0.5x of the rule that counted them only for 8-bit rows).
        core.set_activation_spikes(true);
        core.set_width(cfg.split_activations);
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
                reported: std::time::Instant::now(),
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
            width,
        } = parts;
        // The kernels this process runs (detected, or `QUANTMESH_KERNEL`), said once: what a
        // benchmark records beside its figures.
        tracing::info!(
            isa = quantmesh_kernels::Isa::detect().as_str(),
            threads = quantmesh_kernels::Pool::global().threads(),
            "kernels chosen"
        );
        // The activation width in force (`auto` resolved by `load_parts`), said once.
        match width.ratio {
            Some(ratio) => tracing::info!(
                mode = width.mode.as_str(),
                ratio,
                source = width.source.as_str(),
                q4_ratio = width.q4.map(|(r, _)| r),
                q4_source = width.q4.map(|(_, s)| s.as_str()),
                threshold = crate::backend::cpu::width::CHEAPER_BY,
                "activation width chosen (engine.split_activations = \"auto\"): 16-bit activations cost {ratio:.2}x the 8-bit product here{}, so the quantized path runs {}",
                match width.q4 {
                    Some((r, _)) => format!(" and {r:.2}x the 4-bit one at one row"),
                    None => String::new(),
                },
                match width.mode {
                    SplitActivations::Copyless => "8-bit activations, the rows the monitor wants at higher precision carried at 16 bits",
                    SplitActivations::CopylessQ4 => "8-bit activations on the 4-bit groups (the rows the monitor wants at higher precision carried at 16 bits) and 16-bit ones on every Q8_0 row",
                    _ => "16-bit activations on every row",
                }
            ),
            None => tracing::info!(mode = width.mode.as_str(), "activation width as configured (engine.split_activations)"),
        }
        let cfg = EngineConfig {
            split_activations: width.mode,
            ..cfg
        };
        // Later plans (hot reload) resolve against the same settings as this one; a plan
        // whose tables resolve to another form rebuilds them.
        let registry = start.registry.clone().unwrap_or_default();
        let wiring = Wiring::new(&start, &registry, &cfg, &mcfg, backend.as_ref())?;
        wiring.metrics.set_activation_width(&width);
        if let Ok(mut st) = wiring.config_status.lock() {
            crate::reload::describe(&mut st, &live, &cfg);
        }
        log_plan(&live, &cfg, &backend.weight_bytes());
        let monitor = wiring.start_monitor(&cfg, &live, backend.as_ref());
        let (loader, table_loader) = (backend.group_loader(), backend.table_loader());
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
                    table_loader,
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
}
