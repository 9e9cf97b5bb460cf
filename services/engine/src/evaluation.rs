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
//! `quantmesh-monitor-eval` binary, whose table is in ARCHITECTURE.md.

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

/// An empty KV cache (f16 float pages, the default C8 scale) and its block manager: `pages`
/// pages of `page` tokens.
pub fn scratch_cache(cfg: &ModelConfig, pages: usize, page: usize) -> (KvCache, BlockManager) {
    scratch_cache_with(cfg, pages, page, KvScale::default())
}

/// [`scratch_cache`] with C8 scales as `scale` says.
pub fn scratch_cache_with(
    cfg: &ModelConfig,
    pages: usize,
    page: usize,
    scale: KvScale,
) -> (KvCache, BlockManager) {
    (
        KvCache::new(
            cfg.num_hidden_layers,
            pages,
            page,
            cfg.kv_dim(),
            KvFloatDtype::F16,
        )
        .with_scale(scale, cfg.head_dim()),
        BlockManager::new(pages, page, false),
    )
}

/// One step appending `toks` to each admitted sequence (logits for every chunk).
pub fn step_for(bm: &mut BlockManager, seqs: &[(u64, Vec<u32>)]) -> Result<StepInput> {
    let mut step = StepInput::default();
    for (id, toks) in seqs {
        let start = bm.num_tokens(*id).unwrap_or(0);
        let out = bm
            .append(*id, toks.len())
            .map_err(|e| EngineError::Config(format!("KV pages: {e}")))?;
        step.copies.extend(out.copies);
        step.chunks.push(SeqChunk {
            seq: *id,
            tokens: toks.clone(),
            start_pos: start,
            slots: out.slots,
            block_table: bm.block_table(*id).unwrap_or_default().to_vec(),
            want_logits: true,
        });
    }
    Ok(step)
}

/// Mean next-token KL(P_float ‖ P_mask) for each mask over [`ORDINARY_TEXT`], teacher-forced
/// (the model loaded by [`Reference::load_class`]).
pub fn teacher_forced_kl(
    dir: &Path,
    class: PrecisionClass,
    split: SplitActivations,
    masks: &[PathMask],
) -> Result<Vec<f64>> {
    let r = Reference::load_class(dir, class, split)?;
    r.mean_kl(&r.texts, masks)
}

/// A checkpoint loaded for KL measurements, and [`ORDINARY_TEXT`] tokenized.
pub struct Reference {
    pub cfg: ModelConfig,
    pub model: LlamaModel,
    pub texts: Vec<Vec<u32>>,
}

impl Reference {
    /// Every group dual with exact f32 float copies and its quantized form the one `class`
    /// is served with ([`QuantFormat::for_class`]), quantized-path rows split as `split`
    /// says, f32 vocabulary tables: the served linear groups against their own float weights.
    pub fn load_class(dir: &Path, class: PrecisionClass, split: SplitActivations) -> Result<Self> {
        let cfg = ModelConfig::load(dir)?;
        let ck = quantmesh_model::Checkpoint::open(dir)?;
        let form = |g: GroupId| GroupForm {
            residency: Residency::Dual,
            quant: QuantFormat::for_class(class, crate::plan::group_in_dim(&cfg, g.kind)),
        };
        let forms = Forms {
            float: FloatDtype::F32,
            embeddings: EmbeddingDtype::F32,
            split,
        };
        let model = LlamaModel::load_planned(&ck, &cfg, &form, forms)?;
        Self::with_model(dir, cfg, model)
    }

    fn with_model(dir: &Path, cfg: ModelConfig, model: LlamaModel) -> Result<Self> {
        let tok = TextTokenizer::load(dir)?;
        let texts = ORDINARY_TEXT
            .iter()
            .map(|t| tok.encode(t, true))
            .collect::<std::result::Result<Vec<_>, _>>()
            .map_err(|e| EngineError::Config(e.to_string()))?;
        Ok(Self { cfg, model, texts })
    }

    /// Mean next-token KL(P_float ‖ P_mask) per mask over `texts` (see
    /// [`teacher_forced_kl_on`]), and the number of positions.
    fn mean_kl_n(&self, texts: &[Vec<u32>], masks: &[PathMask]) -> Result<(Vec<f64>, usize)> {
        let (sums, n) = teacher_forced_kl_on(&self.model, &self.cfg, texts, masks)?;
        Ok((sums.into_iter().map(|s| s / n.max(1) as f64).collect(), n))
    }

    pub fn mean_kl(&self, texts: &[Vec<u32>], masks: &[PathMask]) -> Result<Vec<f64>> {
        Ok(self.mean_kl_n(texts, masks)?.0)
    }
}

/// Summed next-token KL(P_float-only ‖ P_mask) for each mask over `texts` (token ids), and
/// the number of positions summed (see [`teacher_forced_on`]).
pub fn teacher_forced_kl_on(
    model: &dyn crate::backend::Backend,
    cfg: &ModelConfig,
    texts: &[Vec<u32>],
    masks: &[PathMask],
) -> Result<(Vec<f64>, usize)> {
    let t = teacher_forced_on(model, cfg, texts, masks)?;
    Ok((t.kl_sums, t.positions))
}

/// What [`teacher_forced_on`] measured.
#[derive(Debug, Clone, Default)]
pub struct TeacherForced {
    /// Per mask: summed next-token KL(P_float-only ‖ P_mask).
    pub kl_sums: Vec<f64>,
    /// Positions summed (every text's positions after the first).
    pub positions: usize,
    /// Per mask, the float-only reference first: summed negative log-likelihood of the
    /// text's actual next token, over `nll_positions` (positions that have one).
    pub nll_sums: Vec<f64>,
    pub nll_positions: usize,
}

impl TeacherForced {
    /// Perplexity of the float-only reference (index 0) and of each mask (index `m + 1`).
    pub fn perplexity(&self, i: usize) -> f64 {
        (self.nll_sums[i] / self.nll_positions.max(1) as f64).exp()
    }
}

/// The texts run together, one token of each per step from an empty cache (a batch of
/// sequences, as the engine serves them), once all-float (the reference) and once per mask:
/// each position's KL to the reference and each mask's likelihood of the actual next token.
pub fn teacher_forced_on(
    model: &dyn crate::backend::Backend,
    cfg: &ModelConfig,
    texts: &[Vec<u32>],
    masks: &[PathMask],
) -> Result<TeacherForced> {
    let all_float = PathMask::all_groups_float(cfg.num_hidden_layers);
    let mut runner = StepRunner::default();
    let mut out = TeacherForced {
        kl_sums: vec![0f64; masks.len()],
        nll_sums: vec![0f64; masks.len() + 1],
        ..Default::default()
    };
    let mut reference: Vec<Vec<Vec<f32>>> = Vec::new();
    for (m, mask) in std::iter::once(&all_float).chain(masks).enumerate() {
        let logits = teacher_forced_logits(cfg, texts, |step, kv| {
            Ok(runner.run(model, step, mask, kv, true)?.logits)
        })?;
        // Long runs (the oracle's one mask per group) say how far they are.
        if masks.len() >= 16 && m % 10 == 0 {
            eprintln!("  teacher-forced KL: {m} of {} masks", masks.len());
        }
        for (ids, got) in texts.iter().zip(&logits) {
            for (pos, l) in got.iter().enumerate().skip(1) {
                if let Some(&next) = ids.get(pos + 1) {
                    out.nll_sums[m] += quantmesh_model::ops::nll_logits(l, next);
                    if m == 0 {
                        out.nll_positions += 1;
                    }
                }
            }
        }
        if m == 0 {
            reference = logits;
            continue;
        }
        for (want, got) in reference.iter().zip(&logits) {
            for (w, g) in want.iter().zip(got).skip(1) {
                out.kl_sums[m - 1] += quantmesh_model::ops::kl_logits(w, g);
                if m == 1 {
                    out.positions += 1;
                }
            }
        }
    }
    Ok(out)
}

/// Every position's next-token logits of each text, teacher-forced: the texts run as one
/// batch of sequences from an empty cache, one token of each per step, each step through
/// `pass`.
fn teacher_forced_logits(
    cfg: &ModelConfig,
    texts: &[Vec<u32>],
    mut pass: impl FnMut(&StepInput, &mut KvCache) -> Result<Vec<(u64, Vec<f32>)>>,
) -> Result<Vec<Vec<Vec<f32>>>> {
    let page = 16;
    let pages: usize = texts.iter().map(|t| t.len().div_ceil(page) + 1).sum();
    let (mut kv, mut bm) = scratch_cache(cfg, pages, page);
    for (i, ids) in texts.iter().enumerate() {
        bm.admit(i as u64, &[], ids.len())
            .map_err(|e| EngineError::Config(format!("KV pages: {e}")))?;
    }
    let longest = texts.iter().map(Vec::len).max().unwrap_or(0);
    let mut logits: Vec<Vec<Vec<f32>>> = vec![Vec::new(); texts.len()];
    for t in 0..longest {
        let seqs: Vec<(u64, Vec<u32>)> = texts
            .iter()
            .enumerate()
            .filter(|(_, ids)| t < ids.len())
            .map(|(i, ids)| (i as u64, vec![ids[t]]))
            .collect();
        let step = step_for(&mut bm, &seqs)?;
        let out = pass(&step, &mut kv)?;
        if out.len() != seqs.len() {
            return Err(EngineError::Config(format!(
                "a step of {} sequences returned {} logits",
                seqs.len(),
                out.len()
            )));
        }
        for (seq, l) in out {
            logits
                .get_mut(seq as usize)
                .ok_or_else(|| EngineError::Config(format!("logits for unknown sequence {seq}")))?
                .push(l);
        }
    }
    Ok(logits)
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

/// The monitor on a real checkpoint (no planted truth): serve `dir` with ordinary chat
/// traffic and report, as markdown, every group's statistic and outlier rate, the massive
/// channels learned, the groups that fell back, and the teacher-forced KL to the float model
/// of INT8-only and of the monitor's final float set; with `oracle`, also the oracle at the
/// same float parameters ([`oracle_at_same_bytes`]).
pub async fn real_model_report(dir: &Path, opts: &EvalOptions, oracle: bool) -> Result<String> {
    let observed = observe(dir, "real", opts, true).await?;
    let final_float = observed.final_float();
    let Observed { report, fell_back } = observed;
    // One load of the model serves the KL and, when asked, the oracle.
    let (kls, oracle_text) = {
        let dir = dir.to_path_buf();
        let chosen = final_float.clone();
        let (class, split) = (opts.class, opts.split);
        tokio::task::spawn_blocking(move || -> Result<(Vec<f64>, Option<String>)> {
            let r = Reference::load_class(&dir, class, split)?;
            let kls = r.mean_kl(
                &r.texts,
                &[
                    PathMask::default(),
                    PathMask::with_float_groups(chosen.iter().copied()),
                ],
            )?;
            let o = if oracle {
                Some(oracle_at_same_bytes(&r, &chosen)?)
            } else {
                None
            };
            Ok((kls, o))
        })
        .await
        .map_err(|e| EngineError::Config(format!("KL task: {e}")))??
    };
    let mut s = format!(
        "{} requests of ordinary chat traffic, window {} requests, {} windows.\n\n",
        opts.requests, opts.monitor.window_requests, report.windows_completed
    );
    let mut groups: Vec<_> = report.groups.iter().collect();
    groups.sort_by(|a, b| {
        b.last_window_rate
            .unwrap_or(0.0)
            .total_cmp(&a.last_window_rate.unwrap_or(0.0))
            .then(a.group.cmp(&b.group))
    });
    let rates: Vec<f64> = groups.iter().filter_map(|g| g.last_window_rate).collect();
    let nonzero = rates.iter().filter(|r| **r > 0.0).count();
    s += &format!(
        "Outlier rate in the last window: {} of {} groups above 0, max {:.4}; groups that fell back at any window: {}.\n\n",
        nonzero,
        groups.len(),
        rates.iter().cloned().fold(0.0, f64::max),
        if fell_back.is_empty() {
            "none".to_string()
        } else {
            fell_back.iter().cloned().collect::<Vec<_>>().join(", ")
        }
    );
    s += "| group | mode | mean | σ | σ/mean | bound | last rate | last NSR | learned massive channels |\n|---|---|---|---|---|---|---|---|---|\n";
    for g in groups.iter().take(16) {
        s += &format!(
            "| {} | {:?} | {:.3} | {:.4} | {:.3} | {} | {} | {} | {:?} |\n",
            g.group,
            g.mode,
            g.mean,
            g.sigma,
            g.sigma / g.mean.max(1e-9),
            g.outlier_bound.map_or("—".into(), |b| format!("{b:.3}")),
            g.last_window_rate.map_or("—".into(), |r| format!("{r:.4}")),
            g.last_window_nsr.map_or("—".into(), |r| format!("{r:.2e}")),
            g.excluded_channels
        );
    }
    // The harm statistic by kind: where the quantized weights hurt the traffic.
    let mut nsr_by_kind = std::collections::BTreeMap::<String, Vec<f64>>::new();
    for g in &report.groups {
        if let Some(n) = g.last_window_nsr {
            let kind = g.group.rsplit('.').next().unwrap_or("").to_string();
            nsr_by_kind.entry(kind).or_default().push(n);
        }
    }
    if !nsr_by_kind.is_empty() {
        s += &format!(
            "\nHarm (mean output noise-to-signal ratio in the last window, bound {:.2e}) by kind, min / median / max: {}.\n",
            opts.monitor.max_nsr,
            nsr_by_kind
                .iter_mut()
                .map(|(k, v)| {
                    v.sort_by(|a, b| a.total_cmp(b));
                    format!(
                        "{k} {:.1e} / {:.1e} / {:.1e}",
                        v[0],
                        v[v.len() / 2],
                        v[v.len() - 1]
                    )
                })
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
    let cv: Vec<f64> = report
        .groups
        .iter()
        .filter(|g| g.ready)
        .map(|g| g.sigma / g.mean.max(1e-9))
        .collect();
    let mut by_kind = std::collections::BTreeMap::<String, (f64, usize)>::new();
    for (g, c) in report.groups.iter().filter(|g| g.ready).zip(&cv) {
        let kind = g.group.rsplit('.').next().unwrap_or("").to_string();
        let e = by_kind.entry(kind).or_default();
        e.0 += c;
        e.1 += 1;
    }
    s += &format!(
        "\n(top 16 of {} groups by last rate). Mean σ/mean by kind: {}.\n\n",
        report.groups.len(),
        by_kind
            .iter()
            .map(|(k, (sum, n))| format!("{k} {:.3}", sum / *n as f64))
            .collect::<Vec<_>>()
            .join(", ")
    );
    s += &format!(
        "Teacher-forced mean KL to the float model over the held-out text: INT8 only {:.5}; with the monitor's final float set ({} groups) {:.5}.\n",
        kls[0],
        final_float.len(),
        kls[1]
    );
    if let Some(o) = oracle_text {
        s += &o;
    }
    Ok(s)
}

/// The oracle the monitor is measured against: every group's own KL contribution (KL of
/// the quantized model minus KL with that group alone in float, over the held-out texts),
/// then groups put in float in that order until they hold as many float parameters as the
/// monitor's `chosen` set; report both sets' KL and the share of the oracle's KL reduction
/// the monitor reached. Then the same comparison for rankings by the groups' measured harm
/// ([`harm_by_group`]) at a few float shares: how well a statistic the monitor can compute
/// online orders the groups.
pub fn oracle_at_same_bytes(r: &Reference, chosen: &BTreeSet<GroupId>) -> Result<String> {
    let cfg = &r.cfg;
    let texts = &r.texts;
    let groups: Vec<GroupId> = (0..cfg.num_hidden_layers)
        .flat_map(|l| GroupKind::ALL.map(|k| GroupId::new(l, k)))
        .collect();
    let mut masks = vec![PathMask::default()];
    masks.extend(groups.iter().map(|g| PathMask::with_float_groups([*g])));
    eprintln!(
        "oracle: every group's own KL gain ({} masks over {} texts)",
        masks.len(),
        texts.len()
    );
    let (kl, n) = r.mean_kl_n(texts, &masks)?;
    let kl_quantized = kl[0];
    let mut gain: Vec<(GroupId, f64)> = groups
        .iter()
        .zip(&kl[1..])
        .map(|(g, k)| (*g, kl_quantized - k))
        .collect();
    gain.sort_by(|a, b| b.1.total_cmp(&a.1));
    let params = |g: &GroupId| crate::plan::group_params(cfg, g.kind);
    let total: usize = groups.iter().map(params).sum();
    // Groups in `order` until `budget` parameters are used (a group that would overflow is
    // skipped, a smaller one after it may still fit).
    let take = |order: &[GroupId], budget: usize| {
        let mut set = BTreeSet::new();
        let mut used = 0;
        for g in order {
            if used + params(g) <= budget {
                used += params(g);
                set.insert(*g);
            }
        }
        (set, used)
    };
    let oracle_order: Vec<GroupId> = gain.iter().map(|(g, _)| *g).collect();
    let budget: usize = chosen.iter().map(params).sum();
    let (oracle, _) = take(&oracle_order, budget);
    let final_sets = teacher_forced_on(
        &r.model,
        cfg,
        texts,
        &[
            PathMask::default(),
            PathMask::with_float_groups(chosen.iter().copied()),
            PathMask::with_float_groups(oracle.iter().copied()),
        ],
    )?;
    let kl: Vec<f64> = final_sets.kl_sums[1..]
        .iter()
        .map(|s| s / final_sets.positions.max(1) as f64)
        .collect();
    let reach = |got: f64, best: f64| {
        if kl_quantized - best > 0.0 {
            (kl_quantized - got) / (kl_quantized - best)
        } else {
            f64::NAN
        }
    };
    let top: Vec<String> = gain
        .iter()
        .take(8)
        .map(|(g, d)| format!("{g} {d:.5}"))
        .collect();
    let mut out = format!(
        "\nOracle at the same float parameters ({:.1} % of the linear weights; {} texts, {n} positions): quantized only {:.5}, monitor's set ({} groups) {:.5}, oracle's set ({} groups) {:.5}: the monitor reaches {:.0} % of the oracle's KL reduction. Largest single-group KL reductions: {}.\n",
        100.0 * budget as f64 / total.max(1) as f64,
        texts.len(),
        kl_quantized,
        chosen.len(),
        kl[0],
        oracle.len(),
        kl[1],
        100.0 * reach(kl[0], kl[1]),
        top.join(", ")
    );
    out += &format!(
        "Perplexity of the actual next tokens ({} positions): float {:.3}, quantized only {:.3}, monitor's set {:.3}, oracle's set {:.3}.\n",
        final_sets.nll_positions,
        final_sets.perplexity(0),
        final_sets.perplexity(1),
        final_sets.perplexity(2),
        final_sets.perplexity(3)
    );
    // Rankings by harm statistics against the oracle at fixed float shares.
    eprintln!("oracle: harm rankings at {HARM_SHARES:?} of the linear parameters");
    let harm = harm_by_group(r, texts)?;
    let rank = |key: &dyn Fn(&GroupHarm) -> f64| {
        let mut v: Vec<(GroupId, f64)> = harm.iter().map(|(g, h)| (*g, key(h))).collect();
        v.sort_by(|a, b| b.1.total_cmp(&a.1));
        v.into_iter().map(|(g, _)| g).collect::<Vec<_>>()
    };
    let rankings: Vec<(&str, Vec<GroupId>)> = vec![
        ("traffic NSR", rank(&|h| h.nsr_of_power)),
        ("mean row NSR", rank(&|h| h.mean_row_nsr)),
        ("output error power", rank(&|h| h.error_power)),
        ("weight NSR", rank(&|h| h.weight_nsr)),
        (
            "traffic NSR without massive channels",
            rank(&|h| h.nsr_without_massive),
        ),
    ];
    if std::env::var_os("QUANTMESH_EVAL_VERBOSE").is_some() {
        out += "\n| group | single-group KL gain | traffic NSR | mean row NSR | without massive | weight NSR |\n|---|---|---|---|---|---|\n";
        for (g, d) in &gain {
            if let Some(h) = harm.get(g) {
                out += &format!(
                    "| {g} | {d:.5} | {:.2e} | {:.2e} | {:.2e} | {:.2e} |\n",
                    h.nsr_of_power, h.mean_row_nsr, h.nsr_without_massive, h.weight_nsr
                );
            }
        }
    }
    out += &format!(
        "\nRankings against the oracle (Spearman ρ with the single-group gains; reach = share of the oracle's KL reduction at the same float parameters):\n\n| ranking | ρ | {} |\n|---|---|{}\n",
        HARM_SHARES
            .iter()
            .map(|f| format!("reach at {:.0} %", 100.0 * f))
            .collect::<Vec<_>>()
            .join(" | "),
        "---|".repeat(HARM_SHARES.len())
    );
    for (name, order) in &rankings {
        let rho = spearman(&oracle_order, order);
        let mut cells = Vec::new();
        for f in HARM_SHARES {
            let (set, used) = take(order, (f * total as f64) as usize);
            let (best, _) = take(&oracle_order, used);
            let kl = r.mean_kl(
                texts,
                &[
                    PathMask::with_float_groups(set.iter().copied()),
                    PathMask::with_float_groups(best.iter().copied()),
                ],
            )?;
            cells.push(format!(
                "{:.0} % ({:.5} vs {:.5})",
                100.0 * reach(kl[0], kl[1]),
                kl[0],
                kl[1]
            ));
        }
        out += &format!("| {name} | {rho:.2} | {} |\n", cells.join(" | "));
    }
    Ok(out)
}

/// Float shares of the linear parameters the harm rankings are scored at.
const HARM_SHARES: [f64; 4] = [0.05, 0.1, 0.2, 0.4];

/// Spearman's rank correlation of two orderings of the same groups.
fn spearman(a: &[GroupId], b: &[GroupId]) -> f64 {
    let pos: std::collections::BTreeMap<GroupId, usize> =
        b.iter().enumerate().map(|(i, g)| (*g, i)).collect();
    let n = a.len() as f64;
    let d2: f64 = a
        .iter()
        .enumerate()
        .filter_map(|(i, g)| pos.get(g).map(|j| (i as f64 - *j as f64).powi(2)))
        .sum();
    1.0 - 6.0 * d2 / (n * (n * n - 1.0)).max(1.0)
}

/// One group's measured harm on traffic: what its quantized weights do to the inputs it
/// actually sees ([`crate::backend::ColumnError`]).
#[derive(Debug, Clone, Copy, Default)]
pub struct GroupHarm {
    /// Output noise-to-signal ratio for the traffic's mean input power per channel.
    pub nsr_of_power: f64,
    /// Mean over rows of each row's output noise-to-signal ratio.
    pub mean_row_nsr: f64,
    /// Expected squared output error per row, `Σ_j E[x_j²]·error_j`.
    pub error_power: f64,
    /// The weights alone: `Σ error_j / Σ energy_j` (every channel equally loud).
    pub weight_nsr: f64,
    /// [`GroupHarm::nsr_of_power`] without the channels whose mean power is over 36× the
    /// median channel's (6× in magnitude: the massive, input-invariant channels).
    pub nsr_without_massive: f64,
}

/// Every quantized group's [`GroupHarm`] on `texts` (teacher-forced, all groups on their
/// quantized path, position 0 left out as the monitor does).
pub fn harm_by_group(
    r: &Reference,
    texts: &[Vec<u32>],
) -> Result<std::collections::BTreeMap<GroupId, GroupHarm>> {
    #[derive(Default)]
    struct Acc {
        power: Vec<f64>,
        nsr_sum: f64,
        rows: usize,
    }
    struct PowerProbe<'a> {
        model: &'a LlamaModel,
        rows: Vec<(u64, usize)>,
        acc: std::collections::BTreeMap<GroupId, Acc>,
    }
    impl crate::backend::Router for PowerProbe<'_> {
        fn route(&mut self, g: GroupId, input: &candle_core::Tensor) -> Result<RowPath> {
            let Some(ce) = self.model.column_error(g) else {
                return Ok(RowPath::AllInt8);
            };
            let (n, d) = input.dims2()?;
            let data = input.flatten_all()?.to_vec1::<f32>()?;
            let acc = self.acc.entry(g).or_default();
            acc.power.resize(d, 0.0);
            for r in 0..n {
                if self.rows.get(r).is_none_or(|(_, p)| *p == 0) {
                    continue;
                }
                let row = &data[r * d..(r + 1) * d];
                for (p, x) in acc.power.iter_mut().zip(row) {
                    *p += (*x as f64) * (*x as f64);
                }
                acc.nsr_sum += ce.nsr(row) as f64;
                acc.rows += 1;
            }
            Ok(RowPath::AllInt8)
        }
        fn coupled_gate_up_rows(&mut self, _layer: usize) -> Vec<usize> {
            Vec::new()
        }
        fn kv_int8(&self, _layer: usize) -> bool {
            true
        }
        fn record(&mut self, _g: GroupId, _o: crate::backend::GroupOutcome) {}
    }
    let mut probe = PowerProbe {
        model: &r.model,
        rows: Vec::new(),
        acc: Default::default(),
    };
    teacher_forced_logits(&r.cfg, texts, |step, kv| {
        probe.rows = step.rows();
        Ok(r.model.pass(step, &mut probe, kv)?.logits)
    })?;
    let mut out = std::collections::BTreeMap::new();
    for (g, acc) in probe.acc {
        let Some(ce) = r.model.column_error(g) else {
            continue;
        };
        let rows = acc.rows.max(1) as f64;
        let power: Vec<f64> = acc.power.iter().map(|p| p / rows).collect();
        let error_power = power
            .iter()
            .zip(&ce.error)
            .map(|(p, e)| p * *e as f64)
            .sum();
        let weight_nsr = ce.error.iter().map(|e| *e as f64).sum::<f64>()
            / ce.energy
                .iter()
                .map(|e| *e as f64)
                .sum::<f64>()
                .max(f64::MIN_POSITIVE);
        let mut sorted = power.clone();
        sorted.sort_by(|a, b| a.total_cmp(b));
        let median = sorted.get(sorted.len() / 2).copied().unwrap_or(0.0);
        let ordinary: Vec<f64> = power
            .iter()
            .map(|p| if *p > 36.0 * median { 0.0 } else { *p })
            .collect();
        out.insert(
            g,
            GroupHarm {
                nsr_without_massive: ce.nsr_of_power(&ordinary),
                nsr_of_power: ce.nsr_of_power(&power),
                mean_row_nsr: acc.nsr_sum / rows,
                error_power,
                weight_nsr,
            },
        );
    }
    Ok(out)
}
