//! The activation monitor's decision logic (pure; the monitor actor drives it).
//!
//! Statistic: per token and per monitored linear group, the abs-max of the group's input
//! row, computed in the forward pass, **excluding** massive fixed channels and skipped
//! positions. Real LLMs carry massive, input-invariant activations on a few channels and on
//! the first token (Sun et al. 2024); a naive detector fires on them constantly. So:
//!
//! 1. Warm-up phase A (`warmup_tokens / 2` rows per group): learn the fixed channels — a
//!    channel whose magnitude exceeds `massive_channel_ratio` × the row's median magnitude
//!    in at least `massive_channel_share` of the rows is massive and excluded from then on
//!    (plus any channels listed in the config). Any number of channels qualify, equal ones
//!    included; the rule lives in `quantmesh_model::massive`, shared with the pre-screen.
//!    Only the residual-stream readers (`qkv`, `gate_up`) learn them: learning them in
//!    `down` too removed the heavy-tailed-weight false fallbacks on one evaluation family
//!    and added eight on another (measured; see docs/design/monitor.md), so it stays off.
//!    Positions in `skip_positions` (default: 0, the attention-sink token) never count.
//! 2. Warm-up phase B (`warmup_tokens / 2` rows): collect the statistic with exclusions; set
//!    the running mean to the median and σ to 1.4826 × MAD (robust to the outliers we are
//!    looking for).
//! 3. Running: a row is an outlier when `x > max(mean + k·σ, mean·(1 + min_excess))` —
//!    the seed's kσ test *and* a material departure for the quantizer: the row's abs-max
//!    sets its INT8 scale, so a row at `(1 + e)` × the usual abs-max quantizes with a step
//!    `(1 + e)` × larger and `(1 + e)²` × the noise power. With `min_excess = 1` a row
//!    must carry ≥ 4× (6 dB) the usual quantization noise to count. The floor matters only
//!    where σ is tiny relative to the mean (attention-output groups: mean 0.68, σ 0.005,
//!    where `mean + 4σ` is 3 % above the mean and ordinary tails cross it); elsewhere kσ
//!    decides. Non-outlier rows update mean and variance as exponential moving averages
//!    (α = 1/256). Rows above `max(mean + token_k·σ, mean·(1 + min_excess))` are routed to
//!    the float path *in the same step* by the executor (per-token granularity).
//!
//! Windows end every `window_requests` finished requests. Per group, rate = outliers /
//! tokens in the window (windows with fewer than `min_window_tokens` tokens decide
//! nothing). Hysteresis: rate > `trigger_rate` with confidence (above
//! `trigger_rate + trigger_z·√(trigger_rate·(1 − trigger_rate)/tokens)`, a one-sided
//! binomial test, so a group whose true rate sits at the trigger does not enter on noise)
//! → fallback (float path, and that layer's
//! KV cache takes new tokens in float); in fallback, `recovery_windows` consecutive
//! windows with rate < `trigger_rate / 2` → back to INT8. A window in between resets the
//! quiet count, so a group cannot flap faster than once per `recovery_windows` windows.
//!
//! MLP coupling: `down`'s input is the SwiGLU product `silu(gate) · up`, so outliers
//! there are products of `gate_up` outputs, and an INT8 error in `gate_up` is multiplied
//! exactly on the rows that spike. When `down` falls back on its outlier rate, its layer's
//! `gate_up` follows it into float (mode `coupled`) and returns with it. The executor does
//! the same per token: rows routed to float at `down` get their `gate_up` recomputed in
//! float first.

mod evidence;
mod mask;
mod window;

use evidence::WindowEvidence;

use crate::backend::{ColumnError, SplitActivations};
use crate::kv::SeqId;
use crate::monitor::config::MonitorConfig;
use crate::precision::{DetectorParams, PathMask, StepOutput};
use quantmesh_model::massive::MassiveCounter;
use quantmesh_types::{
    now_ms, wire_name, FallbackAction, FallbackEvent, FallbackReason, Granularity, GroupId,
    Residency, WindowEvent, WindowGroup, FALLBACK_EVENT_SCHEMA_VERSION,
    WINDOW_EVENT_SCHEMA_VERSION,
};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;

const EMA_ALPHA: f64 = 1.0 / 256.0;

/// How an operator pinned a group (admin API).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ForceMode {
    Float,
    Int8,
    Auto,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum GroupMode {
    Int8,
    Fallback,
    /// `gate_up` following its layer's `down` into float (see "MLP coupling").
    Coupled,
    ForcedFloat,
    ForcedInt8,
}

#[derive(Debug, Clone)]
struct GroupState {
    residency: Residency,
    /// Reads the residual stream (qkv, gate_up): the only groups that learn massive
    /// channels.
    residual_input: bool,
    k: f64,
    trigger: f64,
    min_excess: f64,
    /// Rows whose harm (output noise-to-signal ratio on the quantized path) exceeds this
    /// count as outliers too (0: off).
    max_nsr: f64,
    /// What the group's quantized weights do to each input column (the harm statistic).
    column_error: Option<Arc<ColumnError>>,
    /// Harm summed over the window's counted rows that carried one (for the mean in
    /// reports).
    window_harm: f64,
    window_harm_rows: u64,
    last_nsr: Option<f64>,
    massive: MassiveCounter,
    learn_rows: usize,
    warm: Vec<f32>,
    /// Channels left out of the statistic: configured ∪ learned, sorted.
    excluded: Vec<usize>,
    /// Massive channels learned during warm-up (kept across reconfigurations).
    learned: Vec<usize>,
    ready: bool,
    mean: f64,
    var: f64,
    window_tokens: u64,
    window_outliers: u64,
    last_rate: Option<f64>,
    mode: GroupMode,
    quiet: usize,
    reason: Option<FallbackReason>,
    wanted_unavailable: bool,
    /// Per-token bound published to the executor; refreshed when the group becomes ready
    /// and at every window end (not every step, so the mask is not republished per step).
    token_bound: f32,
    /// Rows that want float in this group, which holds no float copy, are served with
    /// ≈ 16-bit activations on its quantized weights (`split_activations = "copyless"`):
    /// its fallbacks, per token and per layer, are `split` rather than `unavailable`.
    split: bool,
}

impl GroupState {
    fn sigma(&self) -> f64 {
        self.var.max(0.0).sqrt()
    }
    /// `max(mean + k·σ, mean·(1 + min_excess))`: the kσ test and the material floor.
    fn bound(&self, k: f64) -> f64 {
        (self.mean + k * self.sigma()).max(self.mean * (1.0 + self.min_excess))
    }
    /// Whether the group has a better path than its 8-bit activations to fall back to: a
    /// float copy, or (copyless) 16-bit activations on its quantized weights.
    fn can_fall_back(&self) -> bool {
        self.residency.has_float() || self.split
    }
    /// The action a fallback of this group is: `enter` onto its float copy, `split` onto
    /// 16-bit activations, `unavailable` when it has neither.
    fn fallback_action(&self) -> FallbackAction {
        if self.residency.has_float() {
            FallbackAction::Enter
        } else if self.split {
            FallbackAction::Split
        } else {
            FallbackAction::Unavailable
        }
    }
    /// In fallback: every row on the group's better path (float, or 16-bit activations).
    fn in_float(&self) -> bool {
        matches!(
            self.mode,
            GroupMode::Fallback | GroupMode::Coupled | GroupMode::ForcedFloat
        ) && self.can_fall_back()
    }
    /// The per-token bound the executor applies (none while the group is pinned to INT8).
    fn detector_bound(&self) -> f32 {
        if self.mode == GroupMode::ForcedInt8 {
            f32::INFINITY
        } else {
            self.token_bound
        }
    }
    /// The column errors the executor measures the harm statistic with, once the group has
    /// a harm to measure.
    fn detector_columns(&self) -> Option<&Arc<ColumnError>> {
        self.column_error.as_ref().filter(|_| self.max_nsr > 0.0)
    }
    /// In fallback on a float copy (what moves the layer's KV cache to float too).
    fn on_float_copy(&self) -> bool {
        self.in_float() && self.residency.has_float()
    }
    /// Serve the group as `residency`, its copyless rows split when `split_fallback` says
    /// so; a group whose fallback path went away leaves fallback, marked "wanted,
    /// unavailable".
    fn serve_as(&mut self, residency: Residency, split_fallback: bool) {
        let was_float = self.in_float();
        self.residency = residency;
        self.split = split_fallback && residency.has_int8() && !residency.has_float();
        if was_float && !self.in_float() {
            self.mode = GroupMode::Int8;
            self.wanted_unavailable = true;
        }
    }
}

/// A group's state for the admin API and metrics.
#[derive(Debug, Clone, Serialize)]
pub struct GroupReport {
    pub group: String,
    pub residency: Residency,
    pub mode: GroupMode,
    pub ready: bool,
    pub mean: f64,
    pub sigma: f64,
    pub k: f64,
    pub trigger_rate: f64,
    /// Relative floor of the outlier bound (see the module docs).
    pub min_excess: f64,
    /// The current outlier bound `max(mean + k·σ, mean·(1 + min_excess))`.
    pub outlier_bound: Option<f64>,
    /// The harm bound: rows whose output noise-to-signal ratio on the quantized path
    /// exceeds it count as outliers (0: off).
    pub max_nsr: f64,
    /// Mean harm (output noise-to-signal ratio on the quantized path) over the last
    /// decided window's rows.
    pub last_window_nsr: Option<f64>,
    pub last_window_rate: Option<f64>,
    pub window_tokens: u64,
    pub window_outliers: u64,
    pub excluded_channels: Vec<usize>,
    pub reason: Option<FallbackReason>,
    pub wanted_fallback_unavailable: bool,
}

#[derive(Debug, Clone, Default, Serialize)]
pub struct MonitorReport {
    pub enabled: bool,
    pub windows_completed: u64,
    pub requests_in_window: usize,
    pub groups: Vec<GroupReport>,
    pub float_requests: usize,
    pub batch_float: bool,
    /// Decisions taken since start, by kind.
    pub decisions: Vec<DecisionCount>,
    /// Groups running their float path (in fallback, coupled or forced, and holding a
    /// float copy).
    pub groups_in_float: usize,
}

/// The kind of a fallback decision (the labels of `quantmesh_fallback_decisions_total`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
pub struct Decision {
    pub granularity: Granularity,
    pub reason: FallbackReason,
    pub action: FallbackAction,
}

impl Decision {
    pub fn of(ev: &FallbackEvent) -> Self {
        Self {
            granularity: ev.granularity,
            reason: ev.reason,
            action: ev.action,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct DecisionCount {
    #[serde(flatten)]
    pub decision: Decision,
    pub count: u64,
}

pub struct Monitor {
    cfg: MonitorConfig,
    /// Whether activation spikes count (the engine counts them under every activation
    /// width; a test or tool can turn them off).
    activation_spikes: bool,
    /// Whether a row that wants float in a group without a float copy is served with
    /// ≈ 16-bit activations instead (`split_activations = "copyless"`): its per-token
    /// decision is then a `split`, not `unavailable`.
    split_fallback: bool,
    /// Whether a row the harm test flags counts toward its group's fallback where that
    /// fallback would be `split` (16-bit activations): not under `copyless_q4`. There a
    /// 4-bit group's harm is its weights' error, which 16-bit activations leave as it was,
    /// and a Q8_0 group already carries 16 bits on every row (wide), so a split fallback
    /// would change nothing for it.
    harm_splits: bool,
    model: String,
    groups: BTreeMap<GroupId, GroupState>,
    requests_in_window: usize,
    windows: u64,
    float_requests: HashSet<SeqId>,
    batch_float: bool,
    decisions: BTreeMap<Decision, u64>,
    pub config_md5: Option<String>,
    /// The current window's evidence, and the events of the windows closed since the actor
    /// last took them (one per window, in order).
    window: WindowEvidence,
    closed_windows: Vec<WindowEvent>,
}

/// Channels excluded by configuration: the global list for groups reading the residual
/// stream, plus the group's own list.
fn configured_channels(cfg: &MonitorConfig, g: GroupId) -> Vec<usize> {
    let residual_input = matches!(
        g.kind,
        quantmesh_types::GroupKind::Qkv | quantmesh_types::GroupKind::GateUp
    );
    let mut v = if residual_input {
        cfg.massive_channels.clone()
    } else {
        Vec::new()
    };
    if let Some(o) = cfg.overrides.get(&g.to_string()) {
        v.extend(&o.massive_channels);
    }
    v.sort_unstable();
    v.dedup();
    v
}

fn union(a: &[usize], b: &[usize]) -> Vec<usize> {
    let mut v: Vec<usize> = a.iter().chain(b).copied().collect();
    v.sort_unstable();
    v.dedup();
    v
}

fn median(v: &mut [f32]) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    if v.is_empty() {
        0.0
    } else {
        v[v.len() / 2] as f64
    }
}

impl Monitor {
    pub fn new(cfg: MonitorConfig, model: &str, residencies: &[(GroupId, Residency)]) -> Self {
        let groups = residencies
            .iter()
            .map(|(g, r)| {
                let o = cfg
                    .overrides
                    .get(&g.to_string())
                    .cloned()
                    .unwrap_or_default();
                let residual_input = matches!(
                    g.kind,
                    quantmesh_types::GroupKind::Qkv | quantmesh_types::GroupKind::GateUp
                );
                let excluded = configured_channels(&cfg, *g);
                (
                    *g,
                    GroupState {
                        residency: *r,
                        residual_input,
                        k: o.k.unwrap_or(cfg.k),
                        trigger: o.trigger_rate.unwrap_or(cfg.trigger_rate),
                        min_excess: o.min_excess.unwrap_or(cfg.min_excess),
                        max_nsr: o.max_nsr.unwrap_or(cfg.max_nsr),
                        column_error: None,
                        window_harm: 0.0,
                        window_harm_rows: 0,
                        last_nsr: None,
                        massive: MassiveCounter::default(),
                        learn_rows: 0,
                        warm: Vec::new(),
                        excluded,
                        learned: Vec::new(),
                        ready: false,
                        mean: 0.0,
                        var: 0.0,
                        window_tokens: 0,
                        window_outliers: 0,
                        last_rate: None,
                        mode: GroupMode::Int8,
                        quiet: 0,
                        reason: None,
                        wanted_unavailable: false,
                        token_bound: f32::INFINITY,
                        split: false,
                    },
                )
            })
            .collect();
        Self {
            cfg,
            activation_spikes: true,
            split_fallback: false,
            harm_splits: true,
            model: model.to_string(),
            groups,
            requests_in_window: 0,
            windows: 0,
            float_requests: HashSet::new(),
            batch_float: false,
            decisions: BTreeMap::new(),
            config_md5: None,
            window: WindowEvidence::new(),
            closed_windows: Vec::new(),
        }
    }

    /// The evidence of the windows closed since the last call, oldest first (one event per
    /// window: a batch of finished requests can close more than one).
    pub fn take_windows(&mut self) -> Vec<WindowEvent> {
        std::mem::take(&mut self.closed_windows)
    }

    pub fn config(&self) -> &MonitorConfig {
        &self.cfg
    }

    /// Hot reload: new thresholds and residencies. Learned state (running statistics,
    /// learned channels, modes) is kept. `k` applies from the next observation, the
    /// trigger rate and window size at the next window end; a group that lost its float
    /// copy (and is not served split) leaves fallback and is marked "wanted, unavailable".
    pub fn reconfigure(
        &mut self,
        cfg: MonitorConfig,
        residencies: &[(GroupId, Residency)],
        config_md5: Option<String>,
    ) {
        for (g, r) in residencies {
            if let Some(s) = self.groups.get_mut(g) {
                s.serve_as(*r, self.split_fallback);
            }
        }
        for (g, s) in self.groups.iter_mut() {
            let o = cfg
                .overrides
                .get(&g.to_string())
                .cloned()
                .unwrap_or_default();
            s.k = o.k.unwrap_or(cfg.k);
            s.trigger = o.trigger_rate.unwrap_or(cfg.trigger_rate);
            s.min_excess = o.min_excess.unwrap_or(cfg.min_excess);
            s.max_nsr = o.max_nsr.unwrap_or(cfg.max_nsr);
            s.excluded = union(&configured_channels(&cfg, *g), &s.learned);
            if s.ready {
                s.token_bound = s.bound(cfg.token_k) as f32;
            }
        }
        self.cfg = cfg;
        self.config_md5 = config_md5;
    }

    /// Whether activation spikes count as outliers. The engine counts them under every
    /// activation width: under `all` a spike no longer coarsens the 16-bit activations, but
    /// a spiking row sent to a float copy leaves the weights' error behind too, and on
    /// SmolLM2 that halved the served model's KL to the float one (the harm test alone did
    /// not catch those rows).
    pub fn set_activation_spikes(&mut self, on: bool) {
        self.activation_spikes = on;
    }

    /// The activation width the quantized path is served at. Under `copyless` and
    /// `copyless_q4` rows that want float in a group without a float copy are served split:
    /// their per-token decisions become `split`, and a group whose outlier rate passes its
    /// trigger falls back per layer onto 16-bit activations (a `split` layer decision)
    /// instead of reporting `unavailable`. Under `copyless_q4` only activation spikes count
    /// toward such a split fallback, not the harm test (the weights' error, which 16-bit
    /// activations do not touch); the harm statistic is still reported.
    pub fn set_width(&mut self, mode: SplitActivations) {
        let on = mode.copyless();
        self.split_fallback = on;
        self.harm_splits = mode != SplitActivations::CopylessQ4;
        for s in self.groups.values_mut() {
            s.serve_as(s.residency, on);
        }
    }

    /// What each group's quantized weights do to its input columns (at start, and for the
    /// groups a reload rebuilt): the harm statistic's weights. `None` for a group without a
    /// quantized form.
    pub fn set_column_errors(
        &mut self,
        errors: impl IntoIterator<Item = (GroupId, Option<Arc<ColumnError>>)>,
    ) {
        for (g, e) in errors {
            if let Some(s) = self.groups.get_mut(&g) {
                s.column_error = e;
            }
        }
    }

    fn event(
        &mut self,
        group: Option<GroupId>,
        granularity: Granularity,
        action: FallbackAction,
        reason: FallbackReason,
    ) -> FallbackEvent {
        *self
            .decisions
            .entry(Decision {
                granularity,
                reason,
                action,
            })
            .or_default() += 1;
        let st = group.and_then(|g| self.groups.get(&g));
        FallbackEvent {
            schema_version: FALLBACK_EVENT_SCHEMA_VERSION,
            event_id: uuid_v4(),
            timestamp_ms: now_ms(),
            model: self.model.clone(),
            group: group.map(|g| g.to_string()),
            granularity,
            action,
            reason,
            outlier_rate: st.and_then(|s| s.last_rate),
            mean: st.filter(|s| s.ready).map(|s| s.mean),
            sigma: st.filter(|s| s.ready).map(|s| s.sigma()),
            k: st.map(|s| s.k),
            kl: None,
            kl_reference: None,
            token_ids: Vec::new(),
            positions: Vec::new(),
            request_id: None,
            config_md5: self.config_md5.clone(),
            traceparent: None,
        }
    }

    /// Feed one step's observations. Returns the decisions taken.
    pub fn observe(&mut self, out: &StepOutput) -> Vec<FallbackEvent> {
        let mut events = Vec::new();
        let half = self.cfg.warmup_tokens / 2;
        for obs in &out.obs {
            let Some(s) = self.groups.get_mut(&obs.group) else {
                continue;
            };
            for (i, &x) in obs.stats.iter().enumerate() {
                if !x.is_finite() {
                    continue; // skipped position (NaN marker) or non-finite (handled below)
                }
                if !s.ready {
                    if s.learn_rows < half {
                        if let Some(found) = obs.massive.get(i).filter(|_| s.residual_input) {
                            s.massive.add(found);
                        }
                        s.learn_rows += 1;
                        if s.learn_rows == half {
                            // (empty for groups that do not read the residual stream)
                            s.learned = s.massive.massive(self.cfg.massive_channel_share);
                            s.massive = MassiveCounter::default();
                            s.excluded = union(&s.excluded, &s.learned);
                        }
                        // Rows seen while learning were measured without exclusions.
                        continue;
                    }
                    s.warm.push(x);
                    if s.warm.len() >= half.max(1) {
                        let med = median(&mut s.warm);
                        let mut dev: Vec<f32> = s
                            .warm
                            .iter()
                            .map(|v| (*v as f64 - med).abs() as f32)
                            .collect();
                        let mad = median(&mut dev);
                        let sigma = (1.4826 * mad).max(1e-3 * med.abs()).max(1e-6);
                        s.mean = med;
                        s.var = sigma * sigma;
                        s.ready = true;
                        s.warm = Vec::new();
                        s.token_bound = s.bound(self.cfg.token_k) as f32;
                    }
                    continue;
                }
                s.window_tokens += 1;
                let x = x as f64;
                // The activation test (a spike, material for the quantizer) or the harm
                // test (the quantized weights hurt this row's output).
                let above = x > s.bound(s.k);
                let spike = above && self.activation_spikes;
                let harm = obs.harm.get(i).map(|h| *h as f64).filter(|h| h.is_finite());
                if let Some(h) = harm {
                    s.window_harm += h;
                    s.window_harm_rows += 1;
                }
                let harmful = s.max_nsr > 0.0
                    && harm.is_some_and(|h| h > s.max_nsr)
                    && (self.harm_splits || !s.split);
                if spike || harmful {
                    s.window_outliers += 1;
                }
                // The running statistics leave out rows above the bound either way.
                if !above {
                    let d = x - s.mean;
                    s.mean += EMA_ALPHA * d;
                    s.var = (1.0 - EMA_ALPHA) * (s.var + EMA_ALPHA * d * d);
                }
            }
            if !obs.token_float_rows.is_empty() {
                // Group the routed rows by request: one per-token event per (group, request).
                let mut by_seq: BTreeMap<SeqId, (Vec<u32>, Vec<usize>)> = BTreeMap::new();
                for &r in &obs.token_float_rows {
                    if let Some(&(seq, pos, tok)) = out.rows.get(r) {
                        let e = by_seq.entry(seq).or_default();
                        e.0.push(tok);
                        e.1.push(pos);
                    }
                }
                let group = obs.group;
                let action = s.fallback_action();
                for (seq, (toks, pos)) in by_seq {
                    let mut ev = self.event(
                        Some(group),
                        Granularity::Token,
                        action,
                        FallbackReason::ExtremeToken,
                    );
                    if self.cfg.event_token_ids {
                        ev.token_ids = toks;
                    }
                    ev.positions = pos;
                    ev.request_id = Some(seq);
                    events.push(ev);
                }
            }
        }
        for &(seq, kl) in &out.shadow_kl {
            if kl.is_finite() {
                self.window.sample(kl, out.shadow_reference);
            }
            if kl > self.cfg.request_kl_limit && self.float_requests.insert(seq) {
                self.window.request_kl_fallbacks += 1;
                let mut ev = self.event(
                    None,
                    Granularity::Request,
                    FallbackAction::Enter,
                    FallbackReason::ShadowKl,
                );
                ev.kl = Some(kl);
                ev.kl_reference = out.shadow_reference;
                ev.request_id = Some(seq);
                events.push(ev);
            }
        }
        if out.non_finite {
            events.push(self.event(
                None,
                Granularity::Batch,
                FallbackAction::Enter,
                FallbackReason::NonFinite,
            ));
        }
        events
    }

    /// Requests finished: forget their per-request flags; end the window every
    /// `window_requests` requests.
    pub fn requests_finished(&mut self, seqs: &[SeqId]) -> Vec<FallbackEvent> {
        let mut events = Vec::new();
        for s in seqs {
            self.float_requests.remove(s);
            self.requests_in_window += 1;
            if self.requests_in_window >= self.cfg.window_requests.max(1) {
                events.extend(self.end_window());
            }
        }
        events
    }

    /// Pin a group (admin API).
    pub fn force(&mut self, g: GroupId, mode: ForceMode) -> Result<Vec<FallbackEvent>, String> {
        let s = self
            .groups
            .get_mut(&g)
            .ok_or_else(|| format!("no group {g}"))?;
        if mode == ForceMode::Float && !s.residency.has_float() {
            return Err(format!(
                "{g} holds only INT8 weights (residency int8): no float path to force"
            ));
        }
        let was_float = s.in_float();
        s.mode = match mode {
            ForceMode::Float => GroupMode::ForcedFloat,
            ForceMode::Int8 => GroupMode::ForcedInt8,
            ForceMode::Auto => GroupMode::Int8,
        };
        s.quiet = 0;
        s.reason = Some(FallbackReason::Admin);
        let now_float = s.in_float();
        let mut events = Vec::new();
        if was_float != now_float {
            let action = if now_float {
                FallbackAction::Enter
            } else {
                FallbackAction::Exit
            };
            events.push(self.event(Some(g), Granularity::Layer, action, FallbackReason::Admin));
        }
        Ok(events)
    }

    pub fn mode(&self, g: GroupId) -> Option<GroupMode> {
        self.groups.get(&g).map(|s| s.mode)
    }

    pub fn report(&self) -> MonitorReport {
        MonitorReport {
            enabled: self.cfg.enabled,
            windows_completed: self.windows,
            requests_in_window: self.requests_in_window,
            groups: self
                .groups
                .iter()
                .map(|(g, s)| GroupReport {
                    group: g.to_string(),
                    residency: s.residency,
                    mode: s.mode,
                    ready: s.ready,
                    mean: s.mean,
                    sigma: s.sigma(),
                    k: s.k,
                    trigger_rate: s.trigger,
                    min_excess: s.min_excess,
                    outlier_bound: s.ready.then(|| s.bound(s.k)),
                    max_nsr: s.max_nsr,
                    last_window_nsr: s.last_nsr,
                    last_window_rate: s.last_rate,
                    window_tokens: s.window_tokens,
                    window_outliers: s.window_outliers,
                    excluded_channels: s.excluded.clone(),
                    reason: s.reason,
                    wanted_fallback_unavailable: s.wanted_unavailable,
                })
                .collect(),
            float_requests: self.float_requests.len(),
            batch_float: self.batch_float,
            decisions: self
                .decisions
                .iter()
                .map(|(d, n)| DecisionCount {
                    decision: *d,
                    count: *n,
                })
                .collect(),
            groups_in_float: self.groups.values().filter(|s| s.in_float()).count(),
        }
    }
}

/// A random UUID v4 string.
pub fn uuid_v4() -> String {
    uuid::Uuid::new_v4().to_string()
}

#[cfg(test)]
mod tests;
