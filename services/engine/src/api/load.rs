//! Loading: the model, its tokenizer and the plan it starts with, from disk.

use crate::backend::cpu::reference::ReferenceWeights;
use crate::backend::cpu::width::WidthChoice;
use crate::backend::cpu::LlamaModel;
use crate::backend::Backend;
use crate::config::EngineConfig;
use crate::error::EngineError;
use crate::error::Result;
use crate::plan::{resolve, LivePlan};
use quantmesh_model::ModelConfig;
use quantmesh_model::{model_shape, Checkpoint, ModelFiles, TextTokenizer};
use quantmesh_types::{GroupId, GroupKind, ModelShape, Residency, SensitiveLayers};
use std::path::Path;

/// What [`load_parts`] produces.
pub struct LoadedParts {
    pub backend: Box<dyn Backend>,
    pub tokenizer: TextTokenizer,
    pub model_config: ModelConfig,
    pub shape: ModelShape,
    /// The plan the model was loaded with.
    pub live: LivePlan,
    /// The activation width in force (`engine.split_activations`, `auto` resolved).
    pub width: WidthChoice,
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
    // `auto` measured (or read from the model's cache) before any weight is loaded, knowing
    // whether the plan stores groups in 4 bits.
    let four_bit = validated.as_ref().is_some_and(|(p, _)| {
        p.groups
            .values()
            .any(|e| crate::backend::QuantFormat::for_class(e.class).is_four_bit())
    });
    let width = crate::backend::cpu::width::choose_for(
        cfg.split_activations,
        &mcfg,
        Some(&quantmesh_model::files::cache_dir(model_dir)),
        four_bit,
    )?;
    let cfg = &EngineConfig {
        split_activations: width.mode,
        ..cfg.clone()
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
        width,
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
pub(super) fn log_plan(live: &LivePlan, cfg: &EngineConfig, w: &crate::backend::WeightBytes) {
    let count = |r: Residency| live.residency.values().filter(|x| **x == r).count();
    let mib = |b: usize| b as f64 / (1 << 20) as f64;
    let budget = match live.budget.budget_bytes {
        Some(b) => format!("{} ({:.1} MiB)", live.budget.setting, mib(b)),
        None => "unlimited".into(),
    };
    let table = format!(
        "\n| form | groups | MiB |\n|---|---|---|\n\
         | int8 only | {} | |\n| dual (int8 + {} copy) | {} | |\n| float only | {} | |\n\
         | int8 weights (Q8_0) | | {:.1} |\n| int4 weights (q4_s8, w4a16: {} groups) | | {:.1} |\n\
         | float copies | | {:.1} |\n\
         | embeddings, norms, lm_head (tables {}) | | {:.1} |\n\
         | total | | {:.1} = {:.2}× all-f16 ({:.1}) |\n\
         split activations: {}{}; rotation block {}; scale migration in {} group(s)\n\
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
        if cfg.split_activations.copyless() {
            format!(
                " ({} wide group(s) carry 16-bit activations on every row: {}engine.wide_activations = {})",
                live.wide
                    .iter()
                    .filter(|g| live.residency[*g].has_int8())
                    .count(),
                if cfg.split_activations == crate::backend::SplitActivations::CopylessQ4 {
                    "every Q8_0 group, and by "
                } else {
                    ""
                },
                cfg.wide_activations
            )
        } else {
            String::new()
        },
        cfg.rotation_block,
        live.smoothing
            .keys()
            .filter(|g| live.residency[*g].has_int8())
            .count(),
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
