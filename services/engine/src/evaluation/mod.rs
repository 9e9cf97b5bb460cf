//! The monitor's evaluation suite: serve planted-truth checkpoints
//! ([`quantmesh_model::recipe`]) through the real engine with ordinary traffic and score
//! what the monitor did against what was planted.
//!
//! Per model: the groups that fell back on their outlier rate (every `enter` decision over
//! the run, not only the final state) against the planted sensitive MLPs — a planted layer
//! `L` expects `layers.L.down` and, coupled to it, `layers.L.gate_up` — giving precision and
//! recall; false fallbacks (any other group) and how many windows they were counted over;
//! the massive channels the warm-up learned in every residual-stream group against the
//! planted ones; and the mean teacher-forced KL to the float model of INT8-only, of the
//! monitor's final float set, and of the planted (oracle) set in float.
//!
//! The suite's small configuration runs in the test suite; the full one is the
//! `quantmesh-monitor-eval` binary, whose results are in docs/MEASUREMENTS.md.

use crate::api::Engine;
use crate::backend::cpu::LlamaModel;
use crate::backend::{
    Backend, EmbeddingDtype, FloatDtype, Forms, GroupForm, QuantFormat, RowPath, SeqChunk,
    SplitActivations, StepInput,
};
use crate::config::EngineConfig;
use crate::error::{EngineError, Result};
use crate::kv::{BlockManager, KvCache, KvFloatDtype, KvScale};
use crate::monitor::{GroupMode, MonitorConfig};
use crate::precision::{PathMask, StepRunner};
use quantmesh_model::recipe::{self, Planted, Recipe};
use quantmesh_model::{ModelConfig, TextTokenizer};
use quantmesh_types::{
    FallbackAction, FallbackReason, Granularity, GroupId, GroupKind, PrecisionClass, Residency,
    SamplingParams,
};
use std::collections::BTreeSet;
use std::path::Path;

/// Ordinary English text: the traffic's prompts and the KL measurement's held-out text.
mod real_model;
mod teacher;

pub use real_model::*;
pub use teacher::*;

pub use quantmesh_model::bundled::ORDINARY_TEXT;

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

/// What the monitor did on one planted model.
#[derive(Debug, Clone)]
pub struct CaseReport {
    pub name: String,
    /// `h192 i512 l5 6/2 f16 ×2` style summary of the recipe.
    pub shape: String,
    pub planted_sensitive: Vec<String>,
    /// Planted sensitive `down` groups and their coupled `gate_up`.
    pub expected: BTreeSet<String>,
    /// Groups that entered fallback on their outlier rate at any window.
    pub fell_back: BTreeSet<String>,
    /// Groups in float at the end of the run.
    pub final_float: BTreeSet<String>,
    pub windows: u64,
    pub massive_planted: Vec<usize>,
    /// Residual-stream groups (qkv, gate_up) whose learned channels include every planted one.
    pub massive_found_groups: usize,
    /// Channels learned in some residual-stream group that were not planted (emergent:
    /// e.g. an input-invariant value layer 0's attention writes from the planted ones).
    pub massive_extra: Vec<usize>,
    pub residual_groups: usize,
    /// Learned channels of the first `qkv` group (for the table).
    pub massive_found: Vec<usize>,
    /// Mean next-token KL(P_float ‖ P) over the held-out text: INT8 only, the monitor's
    /// final float set, the planted set in float.
    pub kl_int8: f64,
    pub kl_monitor: f64,
    pub kl_oracle: f64,
}

impl CaseReport {
    pub fn true_positives(&self) -> usize {
        self.fell_back.intersection(&self.expected).count()
    }
    pub fn false_fallbacks(&self) -> usize {
        self.fell_back.difference(&self.expected).count()
    }
    /// Share of fallbacks that were planted (1 when nothing fell back).
    pub fn precision(&self) -> f64 {
        if self.fell_back.is_empty() {
            1.0
        } else {
            self.true_positives() as f64 / self.fell_back.len() as f64
        }
    }
    /// Share of planted sensitive `down` groups that fell back (1 when nothing was planted).
    pub fn recall(&self) -> f64 {
        if self.planted_sensitive.is_empty() {
            1.0
        } else {
            let found = self
                .planted_sensitive
                .iter()
                .filter(|g| self.fell_back.contains(*g))
                .count();
            found as f64 / self.planted_sensitive.len() as f64
        }
    }
}

fn shape(r: &Recipe) -> String {
    let massive: Vec<String> = r
        .massive
        .iter()
        .map(|(c, m)| format!("{c}:{m:.0}"))
        .collect();
    format!(
        "h{} i{} l{} {}/{} {} ×{}, massive [{}]",
        r.hidden,
        r.intermediate,
        r.layers,
        r.heads,
        r.kv_heads,
        r.dtype,
        r.shards.max(1),
        massive.join(" ")
    )
}

/// What serving a model with ordinary traffic showed the monitor.
#[derive(Debug, Clone)]
pub struct Observed {
    pub report: crate::monitor::MonitorReport,
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
    let seen = |rep: &crate::monitor::MonitorReport| {
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

/// Write `r` under `dir`, serve it with `opts`, and score the monitor.
pub async fn run_case(dir: &Path, r: &Recipe, opts: &EvalOptions) -> Result<CaseReport> {
    let planted: Planted = recipe::write(dir, r, &recipe::card(r))?;
    let observed = observe(dir, &r.name, opts, false).await?;
    let final_float = observed.final_float();
    let Observed { report, fell_back } = observed;
    let expected: BTreeSet<GroupId> = r
        .sensitive
        .iter()
        .flat_map(|&l| {
            [
                GroupId::new(l, GroupKind::Down),
                GroupId::new(l, GroupKind::GateUp),
            ]
        })
        .collect();
    let mut want_massive = planted.massive_channels.clone();
    want_massive.sort_unstable();
    let residual: Vec<_> = report
        .groups
        .iter()
        .filter(|g| {
            g.group
                .parse::<GroupId>()
                .is_ok_and(|id| matches!(id.kind, GroupKind::Qkv | GroupKind::GateUp))
        })
        .collect();
    let massive_found_groups = residual
        .iter()
        .filter(|g| want_massive.iter().all(|c| g.excluded_channels.contains(c)))
        .count();
    let massive_extra: Vec<usize> = residual
        .iter()
        .flat_map(|g| g.excluded_channels.iter().copied())
        .filter(|c| !want_massive.contains(c))
        .collect::<BTreeSet<_>>()
        .into_iter()
        .collect();
    let massive_found = residual
        .first()
        .map(|g| g.excluded_channels.clone())
        .unwrap_or_default();

    let (kl_int8, kl_monitor, kl_oracle) = {
        let dir = dir.to_path_buf();
        let masks = [
            PathMask::default(),
            PathMask::with_float_groups(final_float.iter().copied()),
            PathMask::with_float_groups(expected.iter().copied()),
        ];
        let (class, split) = (opts.class, opts.split);
        let kls =
            tokio::task::spawn_blocking(move || teacher_forced_kl(&dir, class, split, &masks))
                .await
                .map_err(|e| EngineError::Config(format!("KL task: {e}")))??;
        (kls[0], kls[1], kls[2])
    };
    let names = |set: &BTreeSet<GroupId>| set.iter().map(|g| g.to_string()).collect();
    Ok(CaseReport {
        name: r.name.clone(),
        shape: shape(r),
        planted_sensitive: planted.sensitive_groups.clone(),
        expected: names(&expected),
        fell_back,
        final_float: names(&final_float),
        windows: report.windows_completed,
        massive_planted: want_massive,
        massive_found_groups,
        massive_extra,
        residual_groups: residual.len(),
        massive_found,
        kl_int8,
        kl_monitor,
        kl_oracle,
    })
}

/// The suite's table (markdown).
pub fn table(cases: &[CaseReport]) -> String {
    let mut s = String::from(
        "| model | shape | planted | fell back | P | R | false | windows | massive planted (groups with all) | extra learned | KL INT8 | KL monitor | KL oracle |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|\n",
    );
    let join = |v: &BTreeSet<String>| {
        if v.is_empty() {
            "—".to_string()
        } else {
            v.iter().cloned().collect::<Vec<_>>().join(", ")
        }
    };
    for c in cases {
        s += &format!(
            "| {} | {} | {} | {} | {:.2} | {:.2} | {} | {} | {:?} ({}/{}) | {:?} | {:.5} | {:.5} | {:.5} |\n",
            c.name,
            c.shape,
            if c.planted_sensitive.is_empty() {
                "—".into()
            } else {
                c.planted_sensitive.join(", ")
            },
            join(&c.fell_back),
            c.precision(),
            c.recall(),
            c.false_fallbacks(),
            c.windows,
            c.massive_planted,
            c.massive_found_groups,
            c.residual_groups,
            c.massive_extra,
            c.kl_int8,
            c.kl_monitor,
            c.kl_oracle,
        );
    }
    let clean: Vec<_> = cases
        .iter()
        .filter(|c| c.planted_sensitive.is_empty())
        .collect();
    let planted: Vec<_> = cases
        .iter()
        .filter(|c| !c.planted_sensitive.is_empty())
        .collect();
    let mean = |v: &[&CaseReport], f: &dyn Fn(&CaseReport) -> f64| {
        v.iter().map(|c| f(c)).sum::<f64>() / v.len().max(1) as f64
    };
    s += &format!(
        "\n{} models ({} clean, {} planted): mean precision {:.2}, mean recall {:.2}, false fallbacks on clean models {} over {} windows, on planted models {}; every planted massive channel learned in {}/{} residual groups.\n",
        cases.len(),
        clean.len(),
        planted.len(),
        mean(&planted, &|c| c.precision()),
        mean(&planted, &|c| c.recall()),
        clean.iter().map(|c| c.false_fallbacks()).sum::<usize>(),
        clean.iter().map(|c| c.windows).sum::<u64>(),
        planted.iter().map(|c| c.false_fallbacks()).sum::<usize>(),
        cases.iter().map(|c| c.massive_found_groups).sum::<usize>(),
        cases.iter().map(|c| c.residual_groups).sum::<usize>(),
    );
    s
}
