//! Offline weight pre-screen: score every linear group of a checkpoint — weight
//! dispersion R, output KL of pseudo-quantized weights on a calibration set, energy ratio,
//! input activation statistics — classify it by configurable rules, and write
//! `sensitive_layers.json` (schema v1, `quantmesh_types::sensitive`).
//!
//! See `metrics` for the exact definitions, `rules` for the classification, `scan` for how
//! the checkpoint is walked in bounded memory.

pub mod bits;
mod error;
pub mod metrics;
pub mod quant;
pub mod rules;
pub mod scan;
pub mod smoothing;
pub mod tables;

pub use error::PrescreenError;

use quantmesh_model::{model_shape, Checkpoint, ModelConfig, TextTokenizer};
use quantmesh_types::sensitive::{CalibrationInfo, Generator, HookThresholds, ModelFingerprint};
use quantmesh_types::{
    EmbeddingDtype, FloatBudget, GroupEntry, PrecisionClass, Residency, SensitiveLayers,
    WeightBudget, SENSITIVE_LAYERS_SCHEMA_VERSION,
};
use rules::Rules;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// What to run.
#[derive(Debug, Clone)]
pub struct Options {
    pub model: PathBuf,
    /// Calibration prompts; `None` = the set bundled with quantmesh.
    pub calibration: Option<PathBuf>,
    pub rules: Rules,
    /// Use at most this many prompts (0 = all).
    pub max_prompts: usize,
    /// Truncate each prompt to this many tokens (BOS included).
    pub max_tokens_per_prompt: usize,
    /// Compute the output KL on at most this many calibration tokens (evenly spaced).
    pub kl_tokens: usize,
    /// RFC 3339 timestamp to record (pin it for reproducible output).
    pub timestamp: String,
    /// Fit every group's bits (4 or 8) to this many bytes of resident weights (see
    /// [`bits`]); `None`: the rules' classes as they are.
    pub weight_budget: Option<WeightBudget>,
    /// Write the rules' hook thresholds into the plan's `thresholds` (what `quantmesh
    /// prescreen` does, so the file says what it serves with); `false` leaves them out, so
    /// the engine's configured `engine.monitor` stays in force (the first-load plan, which
    /// nobody wrote by hand).
    pub hook_thresholds: bool,
}

/// Calibration tokens per prompt, at most (`quantmesh prescreen --max-tokens-per-prompt`'s
/// default and the first-load plan's).
pub const DEFAULT_TOKENS_PER_PROMPT: usize = 64;

/// Calibration tokens the output KL is computed on, at most (`quantmesh prescreen
/// --kl-tokens`'s default and the first-load plan's): the first-load plan and `quantmesh
/// prescreen` with its defaults choose the same groups, float copies and scale migration.
pub const DEFAULT_KL_TOKENS: usize = 2048;

/// Under a weight budget, the most the float copies (and 16-bit vocabulary tables) may take,
/// as a share of the model's linear weights in 8 bits: what the chosen bits leave of the
/// budget, up to this share (the first-load plan's float budget), written into the plan as
/// its `float_budget` (with the `fp16` groups' bytes) so the engine keeps within it.
pub const FLOAT_RESERVE_PERCENT: f64 = 10.0;

/// What the pre-screen chooses, versioned: raised when a release changes its choices for the
/// same model and rules (2: scale migration; 3: none from fewer than `smoothing_min_tokens`
/// calibration tokens; 4: the served W8A8 harm, `act8_nsr`, measured for every group, which
/// the float budget ranks by where the engine serves 8-bit activations; 5: the first-load
/// plan calibrates on the whole bundled set, enough tokens for scale migration). The
/// first-load plan's cache is keyed by it, so an upgrade pre-screens once more rather than
/// serving an earlier revision's plan.
pub const PLAN_REVISION: u32 = 5;

/// What the weight budget chose.
#[derive(Debug, Clone, PartialEq)]
pub struct BitsOutcome {
    pub setting: WeightBudget,
    pub budget_bytes: u64,
    /// The smallest plan: every group that can be in 4 bits, with the fixed bytes (no float
    /// copies beyond the `fp16` groups).
    pub minimum_bytes: u64,
    /// Resident weight bytes of the chosen plan (fixed + groups + the float copies'
    /// reserve).
    pub planned_bytes: u64,
    /// The model with every weight in 16 bits.
    pub all_f16_bytes: u64,
    /// Groups in 4 and in 8 bits.
    pub four: usize,
    pub eight: usize,
    /// Σ of the chosen forms' predicted losses (the tables' included), and with every group
    /// and the tables in 8 bits.
    pub predicted_loss: f64,
    pub predicted_loss_all8: f64,
    /// The vocabulary tables' form when the budget chose it (`q8_0` or `q4_s8`); `None`
    /// where their width has neither (they count as fixed 8-bit bytes).
    pub tables: Option<EmbeddingDtype>,
}

/// Per-class totals for the summary table.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ClassTotals {
    pub groups: usize,
    pub params: usize,
}

#[derive(Debug, Clone)]
pub struct Outcome {
    pub file: SensitiveLayers,
    /// The exact bytes to write (pretty JSON, trailing newline).
    pub bytes: Vec<u8>,
    pub per_class: BTreeMap<String, ClassTotals>,
    /// Bytes of the linear weights: all FP16, in the classes' formats, and as the engine
    /// keeps them resident under the default class → residency mapping (FP16 float copies,
    /// at most the plan's float budget when a weight budget wrote one).
    pub bytes_all_fp16: f64,
    pub bytes_formats: f64,
    pub bytes_served: f64,
    /// Bytes of tensors read (every pass counted) and the calibration tokens used.
    pub bytes_scanned: u64,
    pub calibration_tokens: usize,
    /// Set when a weight budget chose the bits.
    pub bits: Option<BitsOutcome>,
}

/// The calibration set bundled with quantmesh (`services/prescreen/calibration/prompts.jsonl`).
pub const BUNDLED_CALIBRATION: &str = include_str!("../calibration/prompts.jsonl");

/// Prompts from a JSON-lines file (`{"prompt": "..."}` per line) or plain text (one per
/// line); `None` reads the bundled set. Blank lines are skipped. Returns the prompts and the
/// md5 of the file.
pub fn read_calibration(path: Option<&Path>) -> Result<(Vec<String>, String), PrescreenError> {
    let (bytes, label) = match path {
        Some(p) => (
            std::fs::read(p).map_err(|e| {
                PrescreenError::Calibration(format!("reading {}: {e}", p.display()))
            })?,
            p.display().to_string(),
        ),
        None => (
            BUNDLED_CALIBRATION.as_bytes().to_vec(),
            "bundled calibration set".to_string(),
        ),
    };
    let md5 = format!("{:x}", md5::compute(&bytes));
    let text = String::from_utf8(bytes)
        .map_err(|_| PrescreenError::Calibration(format!("{label} is not UTF-8")))?;
    let mut prompts = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() {
            continue;
        }
        if line.starts_with('{') {
            #[derive(serde::Deserialize)]
            struct Row {
                prompt: String,
            }
            let row: Row = serde_json::from_str(line)
                .map_err(|e| PrescreenError::Calibration(format!("{label}:{}: {e}", i + 1)))?;
            prompts.push(row.prompt);
        } else {
            prompts.push(line.to_string());
        }
    }
    if prompts.is_empty() {
        return Err(PrescreenError::Calibration(format!(
            "{label} holds no prompt"
        )));
    }
    Ok((prompts, md5))
}

/// md5 over the layout and every tensor's bytes, in name order; every float tensor is also
/// checked for NaN/Inf (a corrupt checkpoint fails here, naming the file and tensor, even in
/// tensors the scoring never reads).
fn content_md5(ck: &Checkpoint) -> Result<(String, u64), PrescreenError> {
    let mut ctx = md5::Context::new();
    let mut bytes = 0u64;
    for t in ck.layout()? {
        ctx.consume(t.layout_line().as_bytes());
        ck.verify(&t.name)?;
        ck.with_bytes(&t.name, |b| ctx.consume(b))?;
        bytes += t.bytes as u64;
        ck.release(&t.name);
    }
    Ok((format!("{:x}", ctx.finalize()), bytes))
}

/// Run the pre-screen. `progress` sees one tick per linear member tensor.
pub fn run(opts: &Options, progress: &dyn scan::Progress) -> Result<Outcome, PrescreenError> {
    let mcfg = ModelConfig::load(&opts.model)?;
    let ck = Checkpoint::open(&opts.model)?;
    let shape = model_shape(&ck, &mcfg)?;
    let tokenizer = TextTokenizer::load(&opts.model)?;
    let (prompts, calib_md5) = read_calibration(opts.calibration.as_deref())?;
    let take = if opts.max_prompts == 0 {
        prompts.len()
    } else {
        opts.max_prompts.min(prompts.len())
    };
    let max_len = opts
        .max_tokens_per_prompt
        .clamp(2, mcfg.max_position_embeddings);
    let mut ids = Vec::with_capacity(take);
    for p in &prompts[..take] {
        let mut t = tokenizer.encode(p, true)?;
        t.truncate(max_len);
        ids.push(t);
    }
    let batch = scan::Batch::new(&ids, opts.kl_tokens)?;
    let calibration_tokens = batch.tokens.len();
    tracing::info!(
        prompts = take,
        tokens = calibration_tokens,
        layers = mcfg.num_hidden_layers,
        "pre-screen: calibration tokenized"
    );

    tracing::debug!(rss_kib = ?rss_kib(), "before content hash");
    let (content, hashed_bytes) = content_md5(&ck)?;
    tracing::debug!(rss_kib = ?rss_kib(), "after content hash");
    let rope = scan::rope_for(&mcfg, &batch)?;
    let mut h = scan::embed(&ck, &mcfg, &batch)?;
    let mut scored_all = Vec::new();
    let mut linear_stored = 0u64;
    let ctx = scan::Ctx {
        ck: &ck,
        cfg: &mcfg,
        batch: &batch,
        rope: &rope,
        rules: &opts.rules,
        progress,
    };
    for l in 0..mcfg.num_hidden_layers {
        let (next, scored) = scan::layer(&ctx, l, h)?;
        h = next;
        tracing::debug!(layer = l, rss_kib = ?rss_kib(), "layer scored");
        for (g, s) in scored {
            linear_stored += s.stored_bytes as u64;
            tracing::debug!(group = %g, class = ?s.entry.class, rule = ?s.entry.rule, "group scored");
            scored_all.push((g, s));
        }
    }
    let (bits, float_budget) = match opts.weight_budget {
        Some(b) => {
            let tables = tables::costs(&ck, &mcfg, &batch, &h)?;
            tracing::info!(
                ?tables,
                "pre-screen: the vocabulary tables' cost in 8 and 4 bits"
            );
            let (outcome, reserve) = fit_bits(&mcfg, b, &mut scored_all, tables)?;
            (Some(outcome), Some(FloatBudget::Bytes(reserve)))
        }
        None => (None, None),
    };
    drop(h);
    let mut groups: BTreeMap<String, GroupEntry> = BTreeMap::new();
    let mut per_class: BTreeMap<String, ClassTotals> = BTreeMap::new();
    let (mut all_fp16, mut formats, mut quantized, mut float) = (0.0, 0.0, 0.0, 0.0);
    for (g, s) in scored_all {
        let class = s.entry.class;
        let t = per_class.entry(class_name(class).to_string()).or_default();
        t.groups += 1;
        t.params += s.params;
        let p = s.params as f64;
        let bytes = scan::format_bytes(class, s.rows, s.cols) as f64;
        all_fp16 += 2.0 * p;
        formats += bytes;
        // w8a8 → Q8_0, w4a16 → q4_s8: what the engine serves them with; float copies in f16.
        let r = s.entry.effective_residency();
        quantized += if r == Residency::Float { 0.0 } else { bytes };
        float += if r.has_float() { 2.0 * p } else { 0.0 };
        groups.insert(g.to_string(), s.entry);
    }
    // Under a weight budget the plan's float budget caps the float copies the engine keeps.
    if let Some(FloatBudget::Bytes(b)) = float_budget {
        float = f64::min(float, b as f64);
    }
    let served = quantized + float;
    let hook = &opts.rules.hook;
    let file = SensitiveLayers {
        schema_version: SENSITIVE_LAYERS_SCHEMA_VERSION,
        model: Some(ModelFingerprint {
            num_layers: shape.num_layers,
            hidden_size: shape.hidden_size,
            intermediate_size: shape.intermediate_size,
            layout_md5: shape.layout_md5.clone(),
            content_md5: Some(content),
        }),
        generator: Some(Generator {
            tool: "quantmesh prescreen".into(),
            version: env!("CARGO_PKG_VERSION").into(),
            timestamp: opts.timestamp.clone(),
            calibration: Some(CalibrationInfo {
                md5: calib_md5,
                prompts: take,
                tokens: calibration_tokens,
            }),
            rules: Some(opts.rules.as_map()),
        }),
        thresholds: if opts.hook_thresholds {
            HookThresholds {
                k: Some(hook.k),
                min_excess: Some(hook.min_excess),
                // The engine's harm bound applies unless an operator sets one.
                max_nsr: None,
                trigger_rate: Some(hook.trigger_rate),
                window_requests: Some(hook.window_requests),
                recovery_windows: Some(hook.recovery_windows),
                token_k: Some(hook.token_k),
                shadow_sample_rate: Some(hook.shadow_sample_rate),
                request_kl_limit: Some(hook.request_kl_limit),
            }
        } else {
            HookThresholds::default()
        },
        groups,
        // 4-bit tables are the weight budget's choice; otherwise the engine's setting (its
        // `auto` puts 16-bit tables in the float budget when they fit).
        tables: bits
            .as_ref()
            .and_then(|b| b.tables)
            .filter(|t| *t == EmbeddingDtype::Q4S8),
        // The server's own budget applies (the first-load plan sets 10 %) unless a weight
        // budget reserved the float copies' share; an operator or the evolution job writes
        // one here to change it by reload.
        float_budget,
    };
    // What we write must be what the engine accepts.
    let bytes = file
        .to_bytes()
        .map_err(|e| PrescreenError::Calibration(format!("serializing the result: {e}")))?;
    SensitiveLayers::parse_for(&bytes, &shape).map_err(|e| {
        PrescreenError::Calibration(format!("internal error: the result does not validate: {e}"))
    })?;
    Ok(Outcome {
        file,
        bytes,
        per_class,
        bytes_all_fp16: all_fp16,
        bytes_formats: formats,
        bytes_served: served,
        // Content hash pass + three passes over every linear tensor, as stored in the files.
        bytes_scanned: hashed_bytes + 3 * linear_stored,
        calibration_tokens,
        bits,
    })
}

/// Choose each group's bits under `budget` (see [`bits`]): `fp16` groups stay float, the
/// others take `w4a16` or keep their 8-bit class; a group whose class wanted a float copy
/// keeps wanting one (`dual`) in 4 bits too. Returns what was chosen and the plan's float
/// budget (bytes): the `fp16` groups' weights and the float copies' reserve.
fn fit_bits(
    cfg: &ModelConfig,
    budget: WeightBudget,
    scored: &mut [(quantmesh_types::GroupId, scan::Scored)],
    tables: Option<tables::TableCost>,
) -> Result<(BitsOutcome, u64), PrescreenError> {
    let table_count = if cfg.tie_word_embeddings { 1 } else { 2 };
    let table_params = table_count * cfg.vocab_size * cfg.hidden_size;
    let norm_params = cfg.hidden_size * (2 * cfg.num_hidden_layers + 1);
    let linear_params: usize = scored.iter().map(|(_, s)| s.params).sum();
    let all_f16 = 2 * (table_params + norm_params + linear_params) as u64;
    let eight = |s: &scan::Scored| scan::format_bytes(PrecisionClass::W8a8, s.rows, s.cols);
    let reserve = (FLOAT_RESERVE_PERCENT / 100.0
        * scored.iter().map(|(_, s)| eight(s)).sum::<u64>() as f64) as u64;
    // The float budget covers the fp16 groups' weights too (the engine charges every float
    // copy to it, theirs first).
    let mut float = 0;
    let mut candidates = Vec::new();
    let mut index = Vec::new();
    for (i, (_, s)) in scored.iter().enumerate() {
        if s.entry.class == PrecisionClass::Fp16 {
            float += 2 * s.params as u64;
            continue;
        }
        let (loss4, loss8) = s
            .entry
            .metrics
            .as_ref()
            .map_or((f64::INFINITY, 0.0), |m| m.bits_cost());
        candidates.push(bits::Candidate {
            bytes4: scan::format_bytes(PrecisionClass::W4a16, s.rows, s.cols),
            bytes8: eight(s),
            loss4,
            loss8,
        });
        index.push(i);
    }
    // The bits come first: the pre-screen measures what each group loses in 4 and 8 bits,
    // not what its float copy would win back. The float copies' reserve takes what the bits
    // leave, up to its share.
    // The vocabulary tables are the last candidate when they have both forms; otherwise
    // fixed bytes.
    let table_bytes = match tables {
        Some(t) => {
            candidates.push(bits::Candidate {
                bytes4: t.bytes4,
                bytes8: t.bytes8,
                loss4: t.loss4,
                loss8: t.loss8,
            });
            0
        }
        None => {
            table_count as u64
                * scan::format_bytes(PrecisionClass::W8a8, cfg.vocab_size, cfg.hidden_size)
        }
    };
    let fixed = table_bytes + 4 * norm_params as u64 + float;
    let budget_bytes = budget.bytes(all_f16);
    let choice = bits::choose(&candidates, fixed, budget_bytes).map_err(|e| {
        PrescreenError::Budget(format!(
            "{e} ({:.3}x of the all-16-bit model's {all_f16} bytes; tables, norms, fp16 groups \
             take {fixed} bytes)",
            e.minimum as f64 / all_f16 as f64
        ))
    })?;
    let copies = reserve.min(budget_bytes - fixed - choice.bytes);
    float += copies;
    let table_form = tables.map(|_| match choice.bits.last() {
        Some(bits::Bits::Four) => EmbeddingDtype::Q4S8,
        _ => EmbeddingDtype::Q8_0,
    });
    let mut four = 0;
    for (&i, &b) in index.iter().zip(&choice.bits) {
        let entry = &mut scored[i].1.entry;
        if b == bits::Bits::Four {
            four += 1;
            let wanted_copy = entry.effective_residency() == Residency::Dual;
            entry.class = PrecisionClass::W4a16;
            entry.residency = wanted_copy.then_some(Residency::Dual);
            entry.rule = Some(format!("weight_budget {budget}: 4 bits"));
            // Served with its 4-bit harm bound: traffic that hurts it more than calibration
            // did shows as outlier windows, the evidence to raise its bits.
            entry.fit_harm_bound_to_class();
        }
    }
    let outcome = BitsOutcome {
        setting: budget,
        budget_bytes,
        minimum_bytes: fixed + candidates.iter().map(|c| c.bytes4).sum::<u64>(),
        planned_bytes: fixed + choice.bytes + copies,
        all_f16_bytes: all_f16,
        four,
        eight: index.len() - four,
        predicted_loss: choice.loss,
        predicted_loss_all8: candidates.iter().map(|c| c.loss8).sum(),
        tables: table_form,
    };
    tracing::info!(?outcome, "pre-screen: bits fitted to the weight budget");
    Ok((outcome, float))
}

/// This process's resident set (Linux), for the debug log.
fn rss_kib() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = s.lines().find(|l| l.starts_with("VmRSS:"))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

pub fn class_name(c: PrecisionClass) -> &'static str {
    match c {
        PrecisionClass::W4a16 => "w4a16",
        PrecisionClass::W8a8 => "w8a8",
        PrecisionClass::W8a8PerChannel => "w8a8_per_channel",
        PrecisionClass::Fp16 => "fp16",
    }
}

/// What a weight budget chose, in one line.
pub fn bits_line(b: &BitsOutcome) -> String {
    let mib = |v: u64| v as f64 / (1u64 << 20) as f64;
    format!(
        "weight budget {} = {:.2} MiB: planned {:.2} MiB ({:.3}x all-16-bit, smallest possible \
         {:.2} MiB); {} groups in 4 bits, {} in 8, vocabulary tables in {}; predicted loss \
         (summed residual error) {:.4} vs {:.4} all-8-bit\n",
        b.setting,
        mib(b.budget_bytes),
        mib(b.planned_bytes),
        b.planned_bytes as f64 / b.all_f16_bytes.max(1) as f64,
        mib(b.minimum_bytes),
        b.four,
        b.eight,
        b.tables
            .map_or("f16 (no 8- or 4-bit form at this width)", |t| t.as_str()),
        b.predicted_loss,
        b.predicted_loss_all8,
    )
}

/// The summary table printed at the end.
pub fn summary_table(o: &Outcome) -> String {
    let mut s = String::from("| class | groups | parameters |\n|---|---|---|\n");
    for (class, t) in &o.per_class {
        s.push_str(&format!("| {class} | {} | {} |\n", t.groups, t.params));
    }
    let mib = |b: f64| b / (1u64 << 20) as f64;
    s.push_str(&format!(
        "\nlinear weights: all-FP16 {:.2} MiB · in the chosen formats {:.2} MiB ({:.2}×) · \
         resident as served (fp16 float-only, per-channel dual, 8/4-bit INT8-only; f16 float \
         copies, within the plan's float_budget when it has one) {:.2} MiB ({:.2}×)\n",
        mib(o.bytes_all_fp16),
        mib(o.bytes_formats),
        o.bytes_formats / o.bytes_all_fp16.max(1.0),
        mib(o.bytes_served),
        o.bytes_served / o.bytes_all_fp16.max(1.0),
    ));
    s.push_str(&smoothing_line(&o.file));
    s
}

/// How many groups carry scale migration, and what it did to their served W8A8 error (with
/// several strengths tried per group, how many groups kept each).
pub fn smoothing_line(file: &SensitiveLayers) -> String {
    let generator = file.generator.as_ref();
    let rule = |k: &str| generator?.rules.as_ref()?.get(k).copied();
    let tokens = generator
        .and_then(|g| g.calibration.as_ref())
        .map(|c| c.tokens);
    match (
        rule("smoothing_alpha"),
        rule("smoothing_min_tokens"),
        tokens,
    ) {
        (Some(alpha), _, _) if alpha <= 0.0 => return "scale migration: off\n".into(),
        (Some(_), Some(min), Some(tokens)) if (tokens as f64) < min => {
            return format!(
                "scale migration: off: {tokens} calibration tokens, fewer than the \
                 {min} its factors need (smoothing_min_tokens; `quantmesh prescreen` with \
                 the whole bundled set has enough)\n"
            )
        }
        _ => {}
    }
    let measured: Vec<(Option<f64>, f64, f64)> = file
        .groups
        .values()
        .filter_map(|e| {
            let a = e.metrics.as_ref()?.act8_nsr.as_ref()?;
            Some((e.smoothing.as_ref().map(|s| s.alpha), a.plain, a.smoothed))
        })
        .collect();
    if measured.is_empty() {
        return "scale migration: off\n".into();
    }
    let kept = measured.iter().filter(|m| m.0.is_some()).count();
    let plain: f64 = measured.iter().map(|m| m.1).sum();
    let served: f64 = measured
        .iter()
        .map(|m| if m.0.is_some() { m.2 } else { m.1 })
        .sum();
    let several = generator
        .and_then(|g| g.rules.as_ref())
        .is_some_and(|r| r.contains_key("smoothing_alphas.0"));
    let by_strength = if several {
        let mut n: BTreeMap<String, usize> = BTreeMap::new();
        for a in measured.iter().filter_map(|m| m.0) {
            *n.entry(format!("{a}")).or_default() += 1;
        }
        let parts: Vec<String> = n.iter().map(|(a, n)| format!("α {a}: {n}")).collect();
        format!(" (strengths kept: {})", parts.join(", "))
    } else {
        String::new()
    };
    format!(
        "scale migration: {} of {} groups smoothed{}; their served W8A8 output error \
         (noise-to-signal, calibration rows) {:.3e} -> {:.3e} summed over every group\n",
        kept,
        measured.len(),
        by_strength,
        plain,
        served
    )
}
