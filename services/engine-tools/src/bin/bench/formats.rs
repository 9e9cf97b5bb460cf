//! Storage forms compared: float-copy dtypes, the 4-bit candidates against Q8_0, and the
//! teacher-forced KL / perplexity runs they are scored with.

use crate::steps::*;
use quantmesh_engine::backend::cpu::LlamaModel;
use quantmesh_engine::backend::Backend;
use quantmesh_engine::precision::{PathMask, StepRunner};
use quantmesh_model::ModelConfig;
use quantmesh_types::Residency;
use std::time::Instant;

/// How fast and how exact a float copy is in each storage dtype, on this model's group
/// shapes: the float path casts its input to the weight's dtype, multiplies with candle's
/// CPU gemm, casts back. Errors are against the f32 product, relative to its abs-max.
pub(crate) fn float_dtype_section(cfg: &ModelConfig) -> Result<(), Box<dyn std::error::Error>> {
    use candle_core::quantized::{GgmlDType, QMatMul, QTensor};
    use candle_core::{DType, Device, Module, Tensor};
    use quantmesh_types::GroupKind;
    println!();
    println!("Float copy storage: matmul time per call (median of 15) and error vs f32:");
    println!();
    println!("| group | batch | f32 µs | f16 µs | × f32 | bf16 µs | × f32 | Q8_0 µs | × f32 | f16 rel. err | bf16 rel. err |");
    println!("|---|---|---|---|---|---|---|---|---|---|---|");
    let time =
        |f: &dyn Fn() -> candle_core::Result<Tensor>| -> Result<(f64, Tensor), candle_core::Error> {
            let mut v = Vec::new();
            let mut last = f()?;
            for _ in 0..15 {
                let t = Instant::now();
                last = f()?;
                v.push(t.elapsed().as_secs_f64() * 1e6);
            }
            v.sort_by(|a, b| a.total_cmp(b));
            Ok((v[v.len() / 2], last))
        };
    for kind in GroupKind::ALL {
        let out: usize = quantmesh_model::ops::member_shapes(cfg, kind)
            .iter()
            .map(|s| s[0])
            .sum();
        let inp = quantmesh_model::ops::member_shapes(cfg, kind)[0][1];
        let w = Tensor::randn(0f32, 0.02, (out, inp), &Device::Cpu)?;
        let (w16, wb16) = (w.to_dtype(DType::F16)?, w.to_dtype(DType::BF16)?);
        let q = QMatMul::from_qtensor(QTensor::quantize(&w, GgmlDType::Q8_0)?)?;
        for b in [1usize, 8, 32] {
            let x = Tensor::randn(0f32, 1.0, (b, inp), &Device::Cpu)?;
            let (t32, y32) = time(&|| x.matmul(&w.t()?))?;
            let (t16, y16) = time(&|| {
                x.to_dtype(DType::F16)?
                    .matmul(&w16.t()?)?
                    .to_dtype(DType::F32)
            })?;
            let (tb, yb) = time(&|| {
                x.to_dtype(DType::BF16)?
                    .matmul(&wb16.t()?)?
                    .to_dtype(DType::F32)
            })?;
            let (tq, _) = time(&|| q.forward(&x))?;
            let scale = y32.abs()?.max_all()?.to_scalar::<f32>()?.max(1e-12);
            let err = |y: &Tensor| -> candle_core::Result<f32> {
                Ok((y - &y32)?.abs()?.max_all()?.to_scalar::<f32>()? / scale)
            };
            println!(
                "| {} | {b} | {t32:.0} | {t16:.0} | {:.2} | {tb:.0} | {:.2} | {tq:.0} | {:.2} | {:.1e} | {:.1e} |",
                kind.name(),
                t16 / t32,
                tb / t32,
                tq / t32,
                err(&y16)?,
                err(&yb)?
            );
        }
    }
    Ok(())
}

/// The 4-bit candidates for `w4a16` against Q8_0, on the checkpoint's own weights: matmul
/// time per call (median of 15) at batch 1/8/32, output error against the f32 weights
/// (relative Frobenius norm, inputs N(0, 1)), bytes per weight; then, with a text, the whole
/// model with every group in each format (teacher-forced KL to the float model, perplexity).
pub(crate) fn quant_format_section(
    dir: &std::path::Path,
    cfg: &ModelConfig,
    text: Option<&std::path::Path>,
    max_tokens: usize,
) -> Result<(), Box<dyn std::error::Error>> {
    use candle_core::quantized::{GgmlDType, QMatMul, QTensor};
    use candle_core::{Device, Module, Tensor};
    use quantmesh_engine::backend::{GroupForm, QuantFormat};
    use quantmesh_types::{GroupId, GroupKind};
    let ck = quantmesh_model::Checkpoint::open(dir)?;
    println!();
    println!("Quantized forms on the checkpoint's weights (layer {}): matmul µs per call (median of 15), × Q8_0, relative output error:", cfg.num_hidden_layers / 2);
    println!();
    use quantmesh_engine::backend::cpu::linear::QuantKernel;
    // Q8_0 and q4_s8 on quantmesh's kernels (activations to 8 bits: W8A8, W4A8), llama.cpp's
    // Q4_0, Q4_1 and Q4_K on candle's.
    const FORMS: [&str; 5] = ["Q8_0", "q4_s8", "Q4_0", "Q4_1", "Q4_K"];
    print!("| group [out × in] | batch | Q8_0 µs |");
    for f in &FORMS[1..] {
        print!(" {f} µs | × Q8_0 |");
    }
    for f in FORMS {
        print!(" err {f} |");
    }
    println!();
    println!(
        "|---|---|---|{}{}",
        "---|---|".repeat(FORMS.len() - 1),
        "---|".repeat(FORMS.len())
    );
    type Product = Box<dyn Fn(&Tensor) -> Result<Tensor, Box<dyn std::error::Error>>>;
    let time = |f: &Product, x: &Tensor| -> Result<(f64, Tensor), Box<dyn std::error::Error>> {
        let mut v = Vec::new();
        let mut last = f(x)?;
        for _ in 0..15 {
            let t = Instant::now();
            last = f(x)?;
            v.push(t.elapsed().as_secs_f64() * 1e6);
        }
        v.sort_by(|a, b| a.total_cmp(b));
        Ok((v[v.len() / 2], last))
    };
    for kind in GroupKind::ALL {
        let g = GroupId::new(cfg.num_hidden_layers / 2, kind);
        let w = quantmesh_model::ops::GroupWeights::load(&ck, cfg, g)?.weight;
        let (out, inp) = w.dims2()?;
        let ours = |f: QuantFormat| -> Result<Option<Product>, Box<dyn std::error::Error>> {
            let k = QuantKernel::quantize(&w, f)?;
            Ok(Some(Box::new(move |x: &Tensor| Ok(k.forward(x)?))))
        };
        let candle = |d: GgmlDType| -> Result<Option<Product>, Box<dyn std::error::Error>> {
            // Q4_K packs 256 weights per super-block: only rows that 256 divides.
            if !inp.is_multiple_of(d.block_size()) {
                return Ok(None);
            }
            let q = QMatMul::from_qtensor(QTensor::quantize(&w, d)?)?;
            Ok(Some(Box::new(move |x: &Tensor| Ok(q.forward(x)?))))
        };
        let qs: Vec<Option<Product>> = vec![
            ours(QuantFormat::Q8_0)?,
            ours(QuantFormat::Q4S8)?,
            candle(GgmlDType::Q4_0)?,
            candle(GgmlDType::Q4_1)?,
            candle(GgmlDType::Q4K)?,
        ];
        for b in [1usize, 8, 32] {
            let x = Tensor::randn(0f32, 1.0, (b, inp), &Device::Cpu)?;
            let y32 = x.matmul(&w.t()?)?;
            let norm = y32.sqr()?.sum_all()?.to_scalar::<f32>()?.sqrt().max(1e-12);
            let mut times = Vec::new();
            let mut errs = Vec::new();
            for q in &qs {
                match q {
                    Some(q) => {
                        let (t, y) = time(q, &x)?;
                        times.push(Some(t));
                        errs.push(Some(
                            (y - &y32)?.sqr()?.sum_all()?.to_scalar::<f32>()?.sqrt() / norm,
                        ));
                    }
                    None => {
                        times.push(None);
                        errs.push(None);
                    }
                }
            }
            let t8 = times[0].unwrap_or(f64::NAN);
            let cell = |t: &Option<f64>| match t {
                Some(t) => format!("{t:.0} | {:.2}", t / t8),
                None => "— | —".into(),
            };
            let e = |e: &Option<f32>| e.map_or("—".into(), |e| format!("{e:.4}"));
            println!(
                "| {} [{out} × {inp}] | {b} | {t8:.0} | {} | {} |",
                kind.name(),
                times[1..].iter().map(cell).collect::<Vec<_>>().join(" | "),
                errs.iter().map(e).collect::<Vec<_>>().join(" | "),
            );
        }
    }
    println!();
    println!("Bytes per weight: Q8_0 1.0625, q4_s8 0.578 (widths 256 divides; 576: 0.583), Q4_0 0.5625, Q4_1 0.625, Q4_K 0.5625; f16 2.");
    let Some(text) = text else {
        return Ok(());
    };
    let tok = quantmesh_model::tokenizer::TextTokenizer::load(dir)?;
    let mut ids = tok.encode(&std::fs::read_to_string(text)?, true)?;
    ids.truncate(max_tokens);
    let reference = LlamaModel::load(dir, cfg, &|_| Residency::Float)?;
    println!();
    println!("Every linear group in one quantized form ({} tokens, windows of {KL_WINDOW}, C8 KV; KL to the f32 float model, teacher-forced):", ids.len());
    println!();
    println!("| form | linear MiB | perplexity | mean KL | × Q8_0 KL |");
    println!("|---|---|---|---|---|");
    let mut kl8 = None;
    let q4k_or_0 = |g: GroupId| {
        let in_dim = quantmesh_model::ops::member_shapes(cfg, g.kind)[0][1];
        match in_dim.is_multiple_of(256) {
            true => QuantFormat::Q4K,
            false => QuantFormat::Q4_0,
        }
    };
    let rows: [(&str, &dyn Fn(GroupId) -> QuantFormat); 4] = [
        ("q8_0 (w8a8)", &|_| QuantFormat::Q8_0),
        ("q4_s8 everywhere (w4a16 as served)", &|_| QuantFormat::Q4S8),
        ("q4_k where 256 divides, else q4_0", &q4k_or_0),
        ("q4_0 everywhere", &|_| QuantFormat::Q4_0),
    ];
    for (label, quant) in rows {
        let form = |g: GroupId| GroupForm::new(Residency::Int8, quant(g));
        let model = LlamaModel::load_planned(&ck, cfg, &form, Default::default())?;
        let w = model.weight_bytes();
        let (ppl, kls) = teacher_forced(&model, &reference, cfg, &ids, &PathMask::default(), true)?;
        let kl = KlSummary::of(&kls).mean;
        let base = *kl8.get_or_insert(kl);
        println!(
            "| {label} | {:.1} | {ppl:.3} | {kl:.5} | {:.2} |",
            (w.int8 + w.int4) as f64 / (1 << 20) as f64,
            kl / base
        );
    }
    Ok(())
}

/// Tokens per window of the teacher-forced KL/perplexity runs.
pub(crate) const KL_WINDOW: usize = 256;

/// One teacher-forced run: `model` under `mask`, its KV cache in C8 when `kv_int8`.
pub(crate) type Run<'a> = (&'a LlamaModel, &'a PathMask, bool);

/// `ids` in windows of `KL_WINDOW` tokens, each from an empty cache, one token per step
/// through every run: `each(row, next, logits)` gets the step's row (the window's sequence
/// id, the position inside it), the token that follows and each run's next-token logits,
/// for every position of a window that has a next token. Returns the
/// seconds each run's steps took (batch-1 decode steps, the mask's routing included).
pub(crate) fn walk_windows(
    cfg: &ModelConfig,
    ids: &[u32],
    runs: &[Run<'_>],
    mut each: impl FnMut((u64, usize), u32, &[Vec<f32>]) -> Result<(), Box<dyn std::error::Error>>,
) -> Result<Vec<f64>, Box<dyn std::error::Error>> {
    let mut seconds = vec![0f64; runs.len()];
    let page = 16;
    let mut runners: Vec<StepRunner> = runs.iter().map(|_| StepRunner::default()).collect();
    for (wi, window) in ids.chunks(KL_WINDOW).enumerate() {
        let id = 1_000_000 + wi as u64;
        let mut caches = Vec::with_capacity(runs.len());
        for _ in runs {
            let (kv, mut bm) = cache(cfg, KL_WINDOW.div_ceil(page) + 2, page);
            bm.admit(id, &[], KL_WINDOW).map_err(|e| e.to_string())?;
            caches.push((kv, bm));
        }
        for (position, pair) in window.windows(2).enumerate() {
            let mut logits = Vec::with_capacity(runs.len());
            for ((((model, mask, kv_int8), runner), (kv, bm)), secs) in runs
                .iter()
                .zip(&mut runners)
                .zip(&mut caches)
                .zip(&mut seconds)
            {
                let step = step_for(bm, &[(id, vec![pair[0]])]);
                let t = std::time::Instant::now();
                let mut out = runner.run(*model, &step, mask, kv, *kv_int8)?.logits;
                *secs += t.elapsed().as_secs_f64();
                logits.push(out.remove(0).1);
            }
            each((id, position), pair[1], &logits)?;
        }
    }
    Ok(seconds)
}

/// Teacher-forced perplexity of `ids` on `model` under `mask`, and every token's next-token
/// KL to `reference` (run all-float, float KV), in windows of `KL_WINDOW` tokens, one token
/// per step. [`KlSummary`] reduces the KLs: the mean is carried by a few tokens, so
/// configurations are compared on the median and tail too.
pub(crate) fn teacher_forced(
    model: &LlamaModel,
    reference: &LlamaModel,
    cfg: &ModelConfig,
    ids: &[u32],
    mask: &PathMask,
    kv_int8: bool,
) -> Result<(f64, Vec<f64>), Box<dyn std::error::Error>> {
    let t = teacher_forced_top1(model, reference, cfg, ids, mask, kv_int8)?;
    Ok((t.perplexity, t.kls))
}

/// What [`teacher_forced_top1`] measured.
pub(crate) struct Scored {
    pub(crate) perplexity: f64,
    pub(crate) kls: Vec<f64>,
    /// Positions whose most likely next token is the reference's.
    pub(crate) top1_agree: usize,
    /// The served model's probability of its own most likely next token, per position.
    pub(crate) top1_prob: Vec<f64>,
    /// The (sequence, position) row each position was computed in, as a mask names rows.
    pub(crate) rows: Vec<(u64, usize)>,
    /// Seconds the served model's steps took (batch 1, one token per step).
    pub(crate) served_seconds: f64,
}

/// [`teacher_forced`], and how often the served model's most likely next token is the
/// reference's.
pub(crate) fn teacher_forced_top1(
    model: &LlamaModel,
    reference: &LlamaModel,
    cfg: &ModelConfig,
    ids: &[u32],
    mask: &PathMask,
    kv_int8: bool,
) -> Result<Scored, Box<dyn std::error::Error>> {
    let all_float = PathMask::all_groups_float(cfg.num_hidden_layers);
    let (mut nll, mut kls, mut agree) = (0f64, Vec::with_capacity(ids.len()), 0);
    let (mut top1_prob, mut rows) = (Vec::with_capacity(ids.len()), Vec::with_capacity(ids.len()));
    let runs = [(model, mask, kv_int8), (reference, &all_float, false)];
    let argmax = |l: &[f32]| {
        l.iter()
            .enumerate()
            .max_by(|a, b| a.1.total_cmp(b.1))
            .map(|(i, _)| i)
    };
    let seconds = walk_windows(cfg, ids, &runs, |row, next, logits| {
        nll += quantmesh_model::ops::nll_logits(&logits[0], next);
        kls.push(quantmesh_model::ops::kl_logits(&logits[1], &logits[0]));
        let served_top = argmax(&logits[0]);
        agree += usize::from(served_top == argmax(&logits[1]));
        top1_prob.push(served_top.map_or(0.0, |t| {
            (-quantmesh_model::ops::nll_logits(&logits[0], t as u32)).exp()
        }));
        rows.push(row);
        Ok(())
    })?;
    let n = kls.len().max(1) as f64;
    Ok(Scored {
        perplexity: (nll / n).exp(),
        kls,
        top1_agree: agree,
        top1_prob,
        rows,
        served_seconds: seconds[0],
    })
}

/// A run's per-token KLs reduced: mean, median, p99 and the share of the total carried by
/// the worst 1 % of tokens.
pub(crate) struct KlSummary {
    pub(crate) mean: f64,
    pub(crate) median: f64,
    pub(crate) p99: f64,
    pub(crate) worst_share: f64,
}

impl KlSummary {
    pub(crate) fn of(kls: &[f64]) -> Self {
        let mut s = kls.to_vec();
        s.sort_by(f64::total_cmp);
        let total: f64 = s.iter().sum();
        // nearest rank; 0 for an empty run
        let at = |q: f64| {
            s.get(((s.len() as f64 - 1.0) * q).round().max(0.0) as usize)
                .copied()
                .unwrap_or(0.0)
        };
        let worst: f64 = s[s.len() - s.len().div_ceil(100)..].iter().sum();
        KlSummary {
            mean: total / s.len().max(1) as f64,
            median: at(0.5),
            p99: at(0.99),
            worst_share: worst / total.max(f64::MIN_POSITIVE),
        }
    }
}
