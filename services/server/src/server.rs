//! The HTTP server as a library function: it takes its listener and a shutdown future, so
//! tests start it in-process on port 0.

use crate::first_plan;
use crate::model_source::ModelSource;
use crate::request_trace;
use crate::routes;
use crate::signals::shutdown_signal;
use crate::state::AppState;
use actix_web::dev::ServerHandle;
use actix_web::{web, App, HttpServer};
use anyhow::Context;
use quantmesh_engine::api::{Engine, EngineStart, EventSink, FloatBudget};
use quantmesh_kafka::{EventPipeline, KafkaMetrics};
use quantmesh_settings::PlanMode;
use quantmesh_settings::Settings;
use std::future::Future;
use std::net::TcpListener;
use std::sync::Arc;
use std::time::Duration;

/// Build and start the HTTP server on `listener`. Signals are left to the caller.
pub fn start_http(
    listener: TcpListener,
    state: web::Data<AppState>,
) -> std::io::Result<actix_web::dev::Server> {
    let workers = match state.server.workers {
        0 => std::thread::available_parallelism()
            .map(|n| n.get().min(4))
            .unwrap_or(2),
        n => n,
    };
    let timeout = state.server.shutdown_timeout_secs;
    Ok(HttpServer::new(move || {
        App::new()
            .app_data(state.clone())
            .wrap(actix_web::middleware::from_fn(
                request_trace::request_context,
            ))
            .configure(routes::configure)
    })
    // Streaming responses are many small writes: without TCP_NODELAY, Nagle's algorithm and
    // the client's delayed ACK hold the first token back by ~40 ms.
    .on_connect(|conn, _| {
        if let Some(tcp) = conn.downcast_ref::<actix_web::rt::net::TcpStream>() {
            let _ = tcp.set_nodelay(true);
        }
    })
    .listen(listener)?
    .workers(workers)
    .shutdown_timeout(timeout)
    .disable_signals()
    .run())
}

/// The first-load plan of the model in `dir` (cached beside it; computed by the pre-screen
/// when missing), with the plan's default float budget unless one is configured.
async fn first_load_plan(
    dir: &std::path::Path,
    settings: &Settings,
    engine_cfg: &mut quantmesh_engine::api::EngineConfig,
) -> anyhow::Result<std::path::PathBuf> {
    let (model, prompts) = (dir.to_path_buf(), settings.model.plan_prompts);
    let (budget, rotation) = (engine_cfg.weight_budget, engine_cfg.rotation_block);
    let plan =
        tokio::task::spawn_blocking(move || first_plan::ensure(&model, prompts, budget, rotation))
            .await
            .context("first-load plan task")?
            .context("computing the first-load precision plan (`--plan none` skips it)")?;
    if engine_cfg.float_budget == FloatBudget::Unlimited {
        engine_cfg.float_budget = settings.model.plan_float_budget;
    }
    Ok(plan.path)
}

/// Make `source` present on disk (fetching or writing it when allowed), load it and start
/// the engine, served as `name`; its events also go to `sinks`, its metrics into
/// `registry`.
pub async fn load_engine(
    settings: &Settings,
    source: ModelSource,
    name: &str,
    sinks: Vec<Arc<dyn EventSink>>,
    registry: Option<prometheus::Registry>,
) -> anyhow::Result<Engine> {
    let fetch = settings.model.fetch_if_missing;
    let dir = tokio::task::spawn_blocking(move || source.materialize(fetch))
        .await
        .context("model fetch task")??;
    let mut engine_cfg = settings.engine.clone();
    let auto = settings.model.plan == PlanMode::Auto;
    if auto && engine_cfg.sensitive_layers.is_none() {
        let plan = first_load_plan(&dir, settings, &mut engine_cfg).await?;
        engine_cfg.sensitive_layers = Some(plan.display().to_string());
    } else if auto
        && engine_cfg.sensitive_layers_optional
        && engine_cfg.initial_plan.is_none()
        && quantmesh_engine::api::plan_source_is_empty(engine_cfg.sensitive_layers.as_deref()).await
    {
        // An empty plan store: serve the first-load plan until a plan is published there.
        engine_cfg.initial_plan = Some(first_load_plan(&dir, settings, &mut engine_cfg).await?);
    }
    tracing::info!(path = %dir.display(), model = %name, "loading model");
    let start = EngineStart {
        name: name.to_string(),
        sinks,
        registry,
        trace_hook: quantmesh_telemetry::trace_hook(),
    };
    Engine::start_with(&dir, engine_cfg, start)
        .await
        .with_context(|| format!("loading the model from {}", dir.display()))
}

/// `model.name`, else the source's own name.
pub fn served_name(settings: &Settings, source: &ModelSource) -> String {
    if settings.model.name.is_empty() {
        source.default_name()
    } else {
        settings.model.name.clone()
    }
}

/// The embedded all-in-one stack: HTTP gateway and engine actors in one process. The
/// server listens at once (`/health` 200, `/ready` 503 while loading); returns after
/// `shutdown` resolves and in-flight requests have drained (bounded by the timeout).
pub async fn run_embedded(
    settings: Settings,
    listener: TcpListener,
    shutdown: impl Future<Output = ()>,
) -> anyhow::Result<()> {
    settings.validate()?;
    let source = ModelSource::from_settings(&settings.model)?;
    let model_name = served_name(&settings, &source);
    #[cfg(unix)]
    let sighup = crate::signals::listen_for_sighup();
    let admin = settings.server.admin_token.clone();
    if admin.is_none() {
        tracing::info!("QUANTMESH_ADMIN_TOKEN is unset: admin routes are disabled");
    }
    let state = web::Data::new(AppState::new(
        settings.server.clone(),
        model_name.clone(),
        admin,
    ));
    let addr = listener.local_addr()?;
    let server = start_http(listener, state.clone())?;
    let handle: ServerHandle = server.handle();
    let server_task = actix_rt::spawn(server);
    tracing::info!(%addr, "listening");

    let timeout = Duration::from_secs(settings.server.shutdown_timeout_secs);
    tokio::pin!(shutdown);
    let start = async {
        let pipeline = match settings.kafka.enabled() {
            true => {
                let metrics = KafkaMetrics::new();
                metrics
                    .register(state.metrics.registry())
                    .context("registering the Kafka metrics")?;
                let p = EventPipeline::start(settings.kafka.clone(), metrics)
                    .await
                    .context("starting the Kafka event path")?;
                Some(p)
            }
            false => {
                tracing::info!("kafka.brokers is empty: fallback events go to the log only");
                None
            }
        };
        let sinks = pipeline.iter().map(|p| p.sink()).collect();
        let registry = Some(state.metrics.registry().clone());
        let engine = load_engine(&settings, source, &model_name, sinks, registry).await?;
        anyhow::Ok((engine, pipeline))
    };
    let (engine, pipeline) = tokio::select! {
        e = start => match e {
            Ok(e) => e,
            Err(err) => {
                handle.stop(false).await;
                return Err(err);
            }
        },
        _ = &mut shutdown => {
            tracing::info!("shutdown requested while loading");
            handle.stop(false).await;
            return Ok(());
        }
    };
    state.set_engine(engine.clone());
    // Always: the first-load plan (a cached file the operator may edit) reloads like any
    // plan, and a plan-less server must not die on a reload signal either.
    #[cfg(unix)]
    if let Some(hup) = sighup {
        actix_rt::spawn(crate::signals::reload_on_sighup(hup, engine.clone()));
    }
    tracing::info!(model = %model_name, "ready: POST http://{addr}/v1/completions");

    shutdown.await;
    tracing::info!(
        timeout_secs = timeout.as_secs(),
        "shutting down: no new requests, draining in-flight ones"
    );
    state.begin_shutdown();
    // Stop accepting; actix waits for in-flight requests (streams included) up to the timeout.
    handle.stop(true).await;
    if tokio::time::timeout(timeout, engine.drain()).await.is_err() {
        tracing::warn!("engine did not drain within the timeout");
    }
    if let Some(p) = pipeline {
        p.shutdown().await;
    }
    let _ = server_task.await;
    tracing::info!("stopped");
    Ok(())
}

/// What a serving binary's `main` does: settings from flags, telemetry, bind, run the
/// embedded stack until SIGINT/SIGTERM, drain.
pub fn serve_main(flags: &quantmesh_settings::ServeFlags) -> anyhow::Result<()> {
    let s = flags.settings()?;
    let mut telemetry = quantmesh_telemetry::init_with(s.log.format, &s.log.level, &s.telemetry);
    let listener = TcpListener::bind((s.server.host.as_str(), s.server.port))
        .with_context(|| format!("binding {}:{}", s.server.host, s.server.port))?;
    let served = actix_rt::System::new().block_on(run_embedded(s, listener, shutdown_signal()));
    // Queued spans go out before the process ends (bounded by the exporter's timeout).
    telemetry.shutdown();
    served
}
