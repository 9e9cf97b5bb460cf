//! One checkpoint served through the real engine with ordinary traffic, and what the monitor
//! did meanwhile: every decision, the final report, the groups that fell back.

use quantmesh_engine::api::Engine;
use quantmesh_engine::backend::SplitActivations;
use quantmesh_engine::config::EngineConfig;
use quantmesh_engine::error::{EngineError, Result};
use quantmesh_engine::monitor::{GroupMode, MonitorConfig};
use quantmesh_model::bundled::ORDINARY_TEXT;
use quantmesh_model::ModelConfig;
use quantmesh_types::{
    FallbackAction, FallbackReason, Granularity, GroupId, GroupKind, PrecisionClass, Residency,
    SamplingParams,
};
use std::collections::BTreeSet;
use std::path::Path;

/// How a case is driven.
#[derive(Debug, Clone)]
pub struct EvalOptions {
    /// Requests per model.
    pub requests: usize,
    /// Requests in flight at once.
    pub concurrency: usize,
    /// Tokens generated per request.
    pub max_tokens: usize,
    pub monitor: MonitorConfig,
    /// The class every group is served as (its quantized form, `QuantFormat::for_class`);
    /// every group keeps an exact float copy so the monitor can fall back anywhere.
    pub class: PrecisionClass,
    /// Which quantized-path rows carry split activations. The planted family's truth is
    /// activation harm (input spikes against INT8-hostile weights), which exists only where
    /// activations are quantized to 8 bits, so its default is `off`; a real model is
    /// served with the engine's default (`all`) unless told otherwise.
    pub split: SplitActivations,
}

impl Default for EvalOptions {
    fn default() -> Self {
        Self {
            requests: 200,
            concurrency: 8,
            max_tokens: 24,
            monitor: MonitorConfig {
                window_requests: 20,
                warmup_tokens: 256,
                min_window_tokens: 32,
                shadow_sample_rate: 0.0,
                ..Default::default()
            },
            class: PrecisionClass::W8a8,
            split: SplitActivations::Off,
        }
    }
}

/// What serving a model with ordinary traffic showed the monitor.
#[derive(Debug, Clone)]
pub struct Observed {
    pub report: quantmesh_engine::monitor::MonitorReport,
    /// Groups that entered fallback on their outlier rate at any window.
    pub fell_back: BTreeSet<String>,
}

impl Observed {
    /// Groups the monitor had in float (automatic fallback or coupled) when the run ended.
    pub fn final_float(&self) -> BTreeSet<GroupId> {
        self.report
            .groups
            .iter()
            .filter(|g| matches!(g.mode, GroupMode::Fallback | GroupMode::Coupled))
            .filter_map(|g| g.group.parse().ok())
            .collect()
    }
}

/// Serve the checkpoint in `dir` (every group dual, `opts.monitor`) with `opts.requests`
/// ordinary requests and return what the monitor saw and decided. `chat`: wrap each text in
/// the model's chat template (real chat traffic) instead of sending it raw.
pub async fn observe(dir: &Path, name: &str, opts: &EvalOptions, chat: bool) -> Result<Observed> {
    // Another class than the default Q8_0 everywhere: a plan file that says so.
    let plan = match opts.class {
        PrecisionClass::W8a8 => None,
        class => Some(every_group_plan(&ModelConfig::load(dir)?, class)?),
    };
    let cfg = EngineConfig {
        monitor: opts.monitor.clone(),
        default_residency: Residency::Dual,
        split_activations: opts.split,
        sensitive_layers: plan
            .as_ref()
            .map(|p| p.path().to_string_lossy().into_owned()),
        ..Default::default()
    };
    let engine = Engine::start(dir, cfg, name).await?;
    // Every layer decision, collected while the traffic runs (the broadcast is bounded).
    // Told to stop once the monitor has seen every request, it drains what is buffered:
    // the monitor actor publishes a decision's events before the report that counts its
    // request (`MonitorActor::publish`).
    let mut rx = engine.subscribe_fallback_events();
    let (stop_tx, mut stop_rx) = tokio::sync::oneshot::channel::<()>();
    let collector = tokio::spawn(async move {
        use tokio::sync::broadcast::error::{RecvError, TryRecvError};
        let mut entered = BTreeSet::new();
        let mut lost = 0u64;
        let mut note = |ev: quantmesh_types::FallbackEvent| {
            if ev.granularity == Granularity::Layer
                && ev.reason == FallbackReason::OutlierRate
                && matches!(
                    ev.action,
                    FallbackAction::Enter | FallbackAction::Unavailable
                )
            {
                if let Some(g) = ev.group {
                    entered.insert(g);
                }
            }
        };
        let mut stopping = false;
        loop {
            tokio::select! {
                ev = rx.recv() => match ev {
                    Ok(ev) => note(ev),
                    Err(RecvError::Lagged(n)) => lost += n,
                    Err(RecvError::Closed) => break,
                },
                _ = &mut stop_rx => stopping = true,
            }
            if stopping {
                loop {
                    match rx.try_recv() {
                        Ok(ev) => note(ev),
                        Err(TryRecvError::Lagged(n)) => lost += n,
                        Err(TryRecvError::Empty | TryRecvError::Closed) => break,
                    }
                }
                break;
            }
        }
        (entered, lost)
    });
    let tok = engine.tokenizer().clone();
    let mut prompts: Vec<Vec<u32>> = Vec::new();
    for text in ORDINARY_TEXT {
        let ids = if chat {
            let rendered = engine.apply_chat_template(&[quantmesh_model::ChatMessage {
                role: "user".into(),
                content: text.to_string(),
            }])?;
            engine.encode(rendered, false).await?
        } else {
            tok.encode(text, true)
                .map_err(|e| EngineError::Config(e.to_string()))?
        };
        prompts.push(ids);
    }
    let mut done = 0usize;
    while done < opts.requests {
        let n = opts.concurrency.min(opts.requests - done).max(1);
        let gens = (done..done + n).map(|i| {
            let e = engine.clone();
            let prompt = prompts[i % prompts.len()].clone();
            async move {
                let params = SamplingParams {
                    temperature: 0.8,
                    seed: Some(i as u64),
                    max_tokens: opts.max_tokens,
                    ..Default::default()
                };
                match e.generate(prompt, params).await {
                    Ok(g) => {
                        g.collect().await;
                        Ok(())
                    }
                    Err(e) => Err(e),
                }
            }
        });
        for res in futures::future::join_all(gens).await {
            res?;
        }
        done += n;
        if opts.requests >= 100 && done % 40 < n {
            eprintln!("  served {done} of {} requests", opts.requests);
        }
    }
    // The monitor handles observations asynchronously: wait until it has seen every request.
    let window = opts.monitor.window_requests.max(1);
    let seen = |rep: &quantmesh_engine::monitor::MonitorReport| {
        rep.windows_completed as usize * window + rep.requests_in_window
    };
    let mut report = engine
        .monitor_report()
        .ok_or_else(|| EngineError::Config("monitor is off".into()))?;
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while seen(&report) < opts.requests {
        if std::time::Instant::now() > deadline {
            return Err(EngineError::Config(format!(
                "the monitor saw {} of {} requests within 60 s",
                seen(&report),
                opts.requests
            )));
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        report = engine
            .monitor_report()
            .ok_or_else(|| EngineError::Config("monitor is off".into()))?;
    }
    if std::env::var_os("QUANTMESH_EVAL_VERBOSE").is_some() {
        for g in &report.groups {
            eprintln!(
                "  {} {:?} mean={:.3} sigma={:.4} bound={:?} rate={:?} excluded={:?}",
                g.group,
                g.mode,
                g.mean,
                g.sigma,
                g.outlier_bound,
                g.last_window_rate,
                g.excluded_channels
            );
        }
    }
    let _ = stop_tx.send(());
    let (fell_back, lost) = collector
        .await
        .map_err(|e| EngineError::Config(format!("event collector: {e}")))?;
    engine.drain().await;
    if lost > 0 {
        return Err(EngineError::Config(format!(
            "the event collector fell {lost} events behind: decisions were lost"
        )));
    }
    Ok(Observed { report, fell_back })
}

/// A `sensitive_layers.json` (in a temporary file) that serves every group of a model as
/// `class`, dual.
fn every_group_plan(cfg: &ModelConfig, class: PrecisionClass) -> Result<tempfile::NamedTempFile> {
    let groups: serde_json::Map<String, serde_json::Value> = (0..cfg.num_hidden_layers)
        .flat_map(|l| GroupKind::ALL.map(|k| GroupId::new(l, k)))
        .map(|g| {
            (
                g.to_string(),
                serde_json::json!({"class": class, "residency": "dual"}),
            )
        })
        .collect();
    let plan = serde_json::json!({
        "schema_version": quantmesh_types::SENSITIVE_LAYERS_SCHEMA_VERSION,
        "groups": groups,
    });
    let mut f = tempfile::Builder::new()
        .prefix("quantmesh-eval-plan-")
        .suffix(".json")
        .tempfile()
        .map_err(|e| EngineError::Config(format!("plan file: {e}")))?;
    serde_json::to_writer(&mut f, &plan)
        .map_err(|e| EngineError::Config(format!("plan file: {e}")))?;
    Ok(f)
}
