//! The activation width the quantized path runs at by default, measured on this machine
//! (`engine.split_activations = "auto"`): the 8-bit and 16-bit products timed on the
//! model's own widest shape, and 8-bit activations chosen (`copyless`: only the rows the
//! monitor wants at higher precision carry 16 bits) where they are meaningfully cheaper.
//! Where they are not and the plan stores groups in 4 bits, the 4-bit product is timed
//! too (at one row, a decode step's shape): where 8-bit activations are meaningfully
//! cheaper there, `copyless_q4` (8-bit activations on the 4-bit groups only).

use crate::error::Result;
use quantmesh_config::SplitActivations;
use quantmesh_kernels::{ActBits, Activations, Isa, PackedQ4, PackedQ8, Pool, Q8Layout};
use std::path::Path;
use std::time::Instant;

/// 16-bit activations must cost at least this many times the 8-bit product before `auto`
/// chooses 8-bit ones: below it the speed would not pay for the quality.
pub const CHEAPER_BY: f64 = 1.15;

/// Rows of the timed product: a batch of concurrent decodes or a prefill chunk, where the
/// product's arithmetic (not its weight bytes) sets the time and the widths can differ.
const ROWS: usize = 32;

/// Rows of the timed 4-bit product: one decode step's, where a 4-bit plan's bytes are
/// meant to pay (a batch's products are arithmetic-bound at either width).
const Q4_ROWS: usize = 1;

/// Products per timed run of [`measure_q4`]: one product at one row is too short to time
/// on its own.
const Q4_PRODUCTS_PER_RUN: usize = 8;

/// Pairs of runs [`measure`] times.
const PAIRS: usize = 15;

/// Overrides the measured ratio (tests, and operators who measured elsewhere):
/// `QUANTMESH_ACTIVATION_WIDTH_RATIO=1.4` acts as if 16-bit activations cost 1.4× here.
pub const RATIO_ENV: &str = "QUANTMESH_ACTIVATION_WIDTH_RATIO";

/// As [`RATIO_ENV`], for the 4-bit product at one row ([`measure_q4`]), read only where
/// the Q8_0 ratio chose `all` and the plan has 4-bit groups.
pub const Q4_RATIO_ENV: &str = "QUANTMESH_ACTIVATION_WIDTH_RATIO_Q4";

/// The product a ratio is timed on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Product {
    /// Q8_0 weights, [`ROWS`] rows ([`measure`]).
    Q8,
    /// 4-bit weights, [`Q4_ROWS`] row ([`measure_q4`]).
    Q4,
}

impl Product {
    fn env(self) -> &'static str {
        match self {
            Product::Q8 => RATIO_ENV,
            Product::Q4 => Q4_RATIO_ENV,
        }
    }

    fn measure(self, out: usize, input: usize) -> Result<f64> {
        match self {
            Product::Q8 => measure(out, input),
            Product::Q4 => measure_q4(out, input),
        }
    }
}

/// Where `auto`'s ratio came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RatioSource {
    /// An explicit mode: nothing measured.
    Configured,
    /// [`RATIO_ENV`].
    Forced,
    /// Timed by this start ([`measure`]).
    Measured,
    /// Read from the model's cache ([`CACHE_FILE`]): timed by an earlier start on this
    /// machine, kernels and build, or by a replica that shares the model's volume.
    Remembered,
}

impl RatioSource {
    pub fn as_str(self) -> &'static str {
        match self {
            RatioSource::Configured => "configured",
            RatioSource::Forced => "forced",
            RatioSource::Measured => "measured",
            RatioSource::Remembered => "remembered",
        }
    }
}

/// What `auto` measured and chose.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct WidthChoice {
    /// The mode in force.
    pub mode: SplitActivations,
    /// Time of the 16-bit product over the 8-bit one (`None`: not measured, an explicit
    /// setting).
    pub ratio: Option<f64>,
    pub source: RatioSource,
    /// The 4-bit product's ratio at one row and where it came from (`None`: not needed: an
    /// explicit setting, a Q8_0 ratio that chose `copyless`, or a plan without 4-bit
    /// groups).
    pub q4: Option<(f64, RatioSource)>,
}

/// [`choose`] for `model`, timed on its widest product (`gate_up`: `[2 · intermediate,
/// hidden]`) and remembered in `cache` (the model's cache folder,
/// [`quantmesh_model::files::cache_dir`]; `None`: timed every time); `four_bit`: the plan
/// the model starts with stores groups in 4 bits. The weights loaded after it are packed
/// in the order the kernel for the chosen width reads fastest
/// ([`quantmesh_kernels::set_packing_width`]: 8-bit activations under `off` and
/// `copyless`, 16-bit ones under `all` and `copyless_q4`).
pub fn choose_for(
    setting: SplitActivations,
    model: &quantmesh_model::ModelConfig,
    cache: Option<&Path>,
    four_bit: bool,
) -> Result<WidthChoice> {
    let choice = choose(
        setting,
        2 * model.intermediate_size,
        model.hidden_size,
        cache,
        four_bit,
    )?;
    quantmesh_kernels::set_packing_width(packing_width(choice.mode));
    Ok(choice)
}

/// The activation width most rows of `mode` run at.
pub fn packing_width(mode: SplitActivations) -> ActBits {
    match mode {
        SplitActivations::Off | SplitActivations::Copyless => ActBits::Eight,
        // `copyless_q4`'s Q8_0 rows all run at 16 bits (its 4-bit groups' packing does not
        // depend on the width).
        SplitActivations::CopylessQ4 | SplitActivations::All | SplitActivations::Auto => {
            ActBits::Sixteen
        }
    }
}

/// Resolve `setting` for a model whose widest linear group is `[out, in]`: an explicit
/// mode stands; `auto` takes the Q8_0 ratio ([`ratio_for`]) and decides by [`decide`];
/// where that says `all` and the plan has `four_bit` groups, the 4-bit ratio too, decided
/// by [`decide_q4`].
pub fn choose(
    setting: SplitActivations,
    out: usize,
    input: usize,
    cache: Option<&Path>,
    four_bit: bool,
) -> Result<WidthChoice> {
    if setting != SplitActivations::Auto {
        return Ok(WidthChoice {
            mode: setting,
            ratio: None,
            source: RatioSource::Configured,
            q4: None,
        });
    }
    let (ratio, source) = ratio_for(Product::Q8, out, input, cache)?;
    let mut choice = WidthChoice {
        mode: decide(ratio),
        ratio: Some(ratio),
        source,
        q4: None,
    };
    if choice.mode == SplitActivations::All && four_bit {
        let q4 = ratio_for(Product::Q4, out, input, cache)?;
        choice.mode = decide_q4(q4.0);
        choice.q4 = Some(q4);
    }
    Ok(choice)
}

/// `product`'s ratio: its environment variable ([`RATIO_ENV`], [`Q4_RATIO_ENV`]), else the
/// ratio remembered in `cache` for this machine, else measured (and remembered there).
fn ratio_for(
    product: Product,
    out: usize,
    input: usize,
    cache: Option<&Path>,
) -> Result<(f64, RatioSource)> {
    Ok(match ratio_from_env(product.env())? {
        Some(r) => (r, RatioSource::Forced),
        None => match cache {
            Some(dir) => remembered(dir, product, out, input)?,
            None => (product.measure(out, input)?, RatioSource::Measured),
        },
    })
}

/// `var` when set to something (empty, as a compose file's `${VAR:-}` leaves it, is
/// unset); anything but a positive number is an error.
fn ratio_from_env(var: &str) -> Result<Option<f64>> {
    std::env::var(var).map_or(Ok(None), |v| parse_ratio(var, &v))
}

/// A ratio variable's (`var`'s) value read.
fn parse_ratio(var: &str, v: &str) -> Result<Option<f64>> {
    let t = v.trim();
    if t.is_empty() {
        return Ok(None);
    }
    t.parse::<f64>()
        .ok()
        .filter(|r| r.is_finite() && *r > 0.0)
        .map(Some)
        .ok_or_else(|| {
            crate::error::EngineError::Config(format!("{var}={v:?} is not a positive number"))
        })
}

/// The file in a model's cache folder that remembers `auto`'s measurements, one per
/// [`machine_key`].
pub const CACHE_FILE: &str = "activation_width.json";

/// [`CACHE_FILE`]'s contents.
#[derive(Debug, Default, serde::Serialize, serde::Deserialize)]
struct Remembered {
    /// [`machine_key`] → the ratio measured there.
    entries: std::collections::BTreeMap<String, RememberedRatio>,
}

#[derive(Debug, serde::Serialize, serde::Deserialize)]
struct RememberedRatio {
    ratio: f64,
    /// When it was measured (seconds since the Unix epoch).
    measured_at: u64,
}

/// The ratio for `[out, input]` on this machine from `dir`'s [`CACHE_FILE`], or measured
/// and written there. Measured under an exclusive lock on the folder's lock file, so
/// replicas that start together over one model volume time the product one at a time
/// (neither slowing the other's timing) and the later ones read the first one's result:
/// one machine, one choice, one plan. A folder that cannot be written (a read-only
/// volume) costs only the measurement at every start.
fn remembered(
    dir: &Path,
    product: Product,
    out: usize,
    input: usize,
) -> Result<(f64, RatioSource)> {
    let key = machine_key(product, out, input);
    let lock = quantmesh_model::files::lock_cache_file(
        &dir.join("activation_width.lock"),
        || tracing::debug!(dir = %dir.display(), "the activation width: another process is measuring it; waiting"),
    );
    let lock = match lock {
        Ok(f) => f,
        Err(e) => {
            tracing::warn!(dir = %dir.display(), error = %e, "the activation width cannot be remembered beside the model; measuring it at every start");
            return Ok((product.measure(out, input)?, RatioSource::Measured));
        }
    };
    let path = dir.join(CACHE_FILE);
    let mut book: Remembered = std::fs::read(&path)
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok())
        .unwrap_or_default();
    if let Some(r) = book.entries.get(&key) {
        if r.ratio.is_finite() && r.ratio > 0.0 {
            return Ok((r.ratio, RatioSource::Remembered));
        }
    }
    let ratio = product.measure(out, input)?;
    let measured_at = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    book.entries
        .insert(key, RememberedRatio { ratio, measured_at });
    // Whole or not at all: a temporary file, then a rename.
    let tmp = dir.join(format!("{CACHE_FILE}.{}.tmp", std::process::id()));
    let written = serde_json::to_vec_pretty(&book)
        .map_err(std::io::Error::other)
        .and_then(|b| std::fs::write(&tmp, b))
        .and_then(|()| std::fs::rename(&tmp, &path));
    if let Err(e) = written {
        let _ = std::fs::remove_file(&tmp);
        tracing::warn!(file = %path.display(), error = %e, "the measured activation width was not remembered");
    }
    drop(lock);
    Ok((ratio, RatioSource::Measured))
}

/// What the ratio depends on besides the shape: the processor (vendor, model, stepping),
/// the kernels chosen and the pool's threads, and this build (its version and the
/// executable's size and time, so a rebuilt kernel is timed again).
fn machine_key(product: Product, out: usize, input: usize) -> String {
    let build = std::env::current_exe()
        .and_then(std::fs::metadata)
        .map(|m| {
            let t = m
                .modified()
                .ok()
                .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
                .map_or(0, |d| d.as_secs());
            format!("{} bytes, {t}", m.len())
        })
        .unwrap_or_else(|_| "unknown".into());
    let product = match product {
        Product::Q8 => format!("product {out}x{input}"),
        Product::Q4 => format!("4-bit product {out}x{input} at {Q4_ROWS} row"),
    };
    format!(
        "{}; kernels {}, {} threads; build {} ({build}); {product}",
        processor(),
        Isa::current().as_str(),
        Pool::global().threads(),
        env!("CARGO_PKG_VERSION"),
    )
}

/// The first processor's identity from `/proc/cpuinfo` (x86: vendor, model name, family,
/// model, stepping; Arm: implementer, part, variant, revision), else the architecture.
fn processor() -> String {
    const KEYS: [&str; 9] = [
        "vendor_id",
        "model name",
        "cpu family",
        "model",
        "stepping",
        "CPU implementer",
        "CPU variant",
        "CPU part",
        "CPU revision",
    ];
    let text = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let fields: Vec<String> = text
        .lines()
        .take_while(|l| !l.trim().is_empty())
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim(), v.trim()))
        .filter(|(k, _)| KEYS.contains(k))
        .map(|(k, v)| format!("{k}={v}"))
        .collect();
    if fields.is_empty() {
        std::env::consts::ARCH.to_string()
    } else {
        fields.join(", ")
    }
}

/// `copyless` where 16-bit activations cost at least [`CHEAPER_BY`] times 8-bit ones,
/// else `all`.
pub fn decide(ratio: f64) -> SplitActivations {
    if ratio >= CHEAPER_BY {
        SplitActivations::Copyless
    } else {
        SplitActivations::All
    }
}

/// `copyless_q4` where 16-bit activations cost the 4-bit product at one row at least
/// [`CHEAPER_BY`] times 8-bit ones, else `all`.
pub fn decide_q4(ratio: f64) -> SplitActivations {
    if ratio >= CHEAPER_BY {
        SplitActivations::CopylessQ4
    } else {
        SplitActivations::All
    }
}

/// The 16-bit product's time over the 8-bit one for a `[out, in]` Q8_0 weight and
/// [`ROWS`] rows on this machine's kernels, each width on the weights ordered for it
/// ([`Q8Layout::for_width`]): [`PAIRS`] pairs of runs back to back (in alternating order),
/// the median of the pairs' ratios. A pair's two runs see the same neighbours, so a load
/// that comes and goes moves few pairs and the median not at all. Rounded to four decimals,
/// which a timing ratio does not resolve anyway and which [`CACHE_FILE`]'s JSON keeps
/// exactly: a replica that reads it decides on the very value the measuring start did
/// (a full-precision float came back from the file one bit off).
pub fn measure(out: usize, input: usize) -> Result<f64> {
    let input = input.next_multiple_of(quantmesh_kernels::BLOCK);
    let w = timing_weights(out, input);
    let isa = Isa::current();
    let packed = |bits| PackedQ8::quantize_in(&w, out, input, Q8Layout::for_width(isa, bits));
    let (p8, p16) = (packed(ActBits::Eight)?, packed(ActBits::Sixteen)?);
    let x = timing_rows(ROWS, input);
    let pool = Pool::global();
    let mut a = Activations::new();
    paired_ratio(|bits: ActBits| -> Result<f64> {
        let packed = if bits == ActBits::Eight { &p8 } else { &p16 };
        let t = Instant::now();
        a.quantize(&x, ROWS, input, bits)?;
        std::hint::black_box(packed.matmul_vec(&a, isa, pool)?);
        Ok(t.elapsed().as_secs_f64())
    })
}

/// As [`measure`], for a `[out, in]` 4-bit weight at [`Q4_ROWS`] row ([`Q4_PRODUCTS_PER_RUN`]
/// products per timed run): the kernel a 4-bit plan's decode runs at each width.
pub fn measure_q4(out: usize, input: usize) -> Result<f64> {
    let input = input.next_multiple_of(quantmesh_kernels::BLOCK);
    let w = PackedQ4::quantize(&timing_weights(out, input), out, input)?;
    let x = timing_rows(Q4_ROWS, input);
    let (isa, pool) = (Isa::current(), Pool::global());
    let mut a = Activations::new();
    let mut y = vec![0f32; Q4_ROWS * out];
    paired_ratio(|bits: ActBits| -> Result<f64> {
        let t = Instant::now();
        for _ in 0..Q4_PRODUCTS_PER_RUN {
            a.quantize(&x, Q4_ROWS, input, bits)?;
            w.matmul(&a, &mut y, isa, pool)?;
            std::hint::black_box(&y);
        }
        Ok(t.elapsed().as_secs_f64())
    })
}

/// A `[out, in]` weight for timing (values spread over ±0.5, no zeros in a block).
fn timing_weights(out: usize, input: usize) -> Vec<f32> {
    (0..out * input)
        .map(|i| ((i as f32) * 0.618_034).fract() - 0.5)
        .collect()
}

/// `rows` activation rows of `input` values for timing (spread over ±1).
fn timing_rows(rows: usize, input: usize) -> Vec<f32> {
    (0..rows * input)
        .map(|i| ((i as f32) * 0.414_213_5).fract() * 2.0 - 1.0)
        .collect()
}

/// The 16-bit run's time over the 8-bit one, `time` timing one run at a width: after one
/// untimed run of each (the pool's threads, the weights' pages), [`PAIRS`] pairs back to
/// back in alternating order, the median of the pairs' ratios, rounded to four decimals.
fn paired_ratio(mut time: impl FnMut(ActBits) -> Result<f64>) -> Result<f64> {
    time(ActBits::Eight)?;
    time(ActBits::Sixteen)?;
    let mut ratios = Vec::with_capacity(PAIRS);
    for i in 0..PAIRS {
        let (t8, t16) = if i % 2 == 0 {
            let t8 = time(ActBits::Eight)?;
            (t8, time(ActBits::Sixteen)?)
        } else {
            let t16 = time(ActBits::Sixteen)?;
            (time(ActBits::Eight)?, t16)
        };
        ratios.push(t16 / t8.max(f64::MIN_POSITIVE));
    }
    Ok((median(&mut ratios) * 1e4).round() / 1e4)
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_rule_picks_eight_bits_only_where_they_are_cheaper() {
        assert_eq!(decide(1.45), SplitActivations::Copyless);
        assert_eq!(decide(CHEAPER_BY), SplitActivations::Copyless);
        assert_eq!(decide(1.05), SplitActivations::All);
        assert_eq!(decide(0.9), SplitActivations::All);
        assert_eq!(decide_q4(1.3), SplitActivations::CopylessQ4);
        assert_eq!(decide_q4(CHEAPER_BY), SplitActivations::CopylessQ4);
        assert_eq!(decide_q4(1.05), SplitActivations::All);
    }

    /// The 4-bit ratio is remembered under its own key beside the Q8_0 one, and both
    /// measurements give a ratio on this machine.
    #[test]
    fn the_four_bit_ratio_is_remembered_beside_the_eight_bit_one() {
        let dir = tempfile::tempdir().unwrap();
        let (r8, s8) = remembered(dir.path(), Product::Q8, 64, 64).unwrap();
        let (r4, s4) = remembered(dir.path(), Product::Q4, 64, 64).unwrap();
        assert_eq!((s8, s4), (RatioSource::Measured, RatioSource::Measured));
        assert!(r4.is_finite() && r4 > 0.0, "{r4}");
        assert_eq!(
            remembered(dir.path(), Product::Q4, 64, 64).unwrap(),
            (r4, RatioSource::Remembered)
        );
        assert_eq!(
            remembered(dir.path(), Product::Q8, 64, 64).unwrap(),
            (r8, RatioSource::Remembered)
        );
        let book: Remembered =
            serde_json::from_slice(&std::fs::read(dir.path().join(CACHE_FILE)).unwrap()).unwrap();
        assert_eq!(book.entries.len(), 2, "{book:?}");
        assert!(book
            .entries
            .keys()
            .any(|k| k.contains("4-bit product 64x64")));
    }

    #[test]
    fn the_vocabulary_projection_splits_under_every_mode_but_off() {
        assert!(!SplitActivations::Off.splits_table());
        assert!(SplitActivations::Copyless.splits_table());
        assert!(SplitActivations::All.splits_table());
        // Its group rows stay 8-bit under copyless unless they want float.
        assert!(!SplitActivations::Copyless.splits(false));
    }

    #[test]
    fn weights_are_packed_for_the_width_most_rows_run_at() {
        assert_eq!(packing_width(SplitActivations::Off), ActBits::Eight);
        assert_eq!(packing_width(SplitActivations::Copyless), ActBits::Eight);
        assert_eq!(packing_width(SplitActivations::All), ActBits::Sixteen);
        assert_eq!(
            packing_width(SplitActivations::CopylessQ4),
            ActBits::Sixteen
        );
    }

    #[test]
    fn an_explicit_mode_is_never_measured() {
        for m in [
            SplitActivations::Off,
            SplitActivations::Copyless,
            SplitActivations::CopylessQ4,
            SplitActivations::All,
        ] {
            assert_eq!(
                choose(m, 64, 64, None, true).unwrap(),
                WidthChoice {
                    mode: m,
                    ratio: None,
                    source: RatioSource::Configured,
                    q4: None,
                }
            );
        }
    }

    #[test]
    fn an_empty_override_is_unset_and_a_bad_one_an_error() {
        assert_eq!(parse_ratio(RATIO_ENV, "").unwrap(), None);
        assert_eq!(parse_ratio(RATIO_ENV, "  ").unwrap(), None);
        assert_eq!(parse_ratio(RATIO_ENV, " 1.4 ").unwrap(), Some(1.4));
        for bad in ["x", "0", "-1", "inf", "NaN"] {
            let e = parse_ratio(RATIO_ENV, bad).unwrap_err().to_string();
            assert!(e.contains(RATIO_ENV), "{e}");
        }
    }

    #[test]
    fn a_measured_ratio_is_remembered_beside_the_model_and_read_back() {
        let dir = tempfile::tempdir().unwrap();
        let (r1, s1) = remembered(dir.path(), Product::Q8, 64, 64).unwrap();
        assert_eq!(s1, RatioSource::Measured);
        assert!(r1.is_finite() && r1 > 0.0);
        assert_eq!(
            remembered(dir.path(), Product::Q8, 64, 64).unwrap(),
            (r1, RatioSource::Remembered)
        );
        // Another shape is another measurement, kept beside the first.
        assert_eq!(
            remembered(dir.path(), Product::Q8, 96, 64).unwrap().1,
            RatioSource::Measured
        );
        let book: Remembered =
            serde_json::from_slice(&std::fs::read(dir.path().join(CACHE_FILE)).unwrap()).unwrap();
        assert_eq!(book.entries.len(), 2, "{book:?}");
        assert!(book.entries.keys().all(|k| k.contains(&processor())));
        // Another machine's entry is not this one's.
        let other = Remembered {
            entries: [(
                "another processor".to_string(),
                RememberedRatio {
                    ratio: 9.0,
                    measured_at: 0,
                },
            )]
            .into(),
        };
        let fresh = tempfile::tempdir().unwrap();
        std::fs::write(
            fresh.path().join(CACHE_FILE),
            serde_json::to_vec(&other).unwrap(),
        )
        .unwrap();
        let (r, s) = remembered(fresh.path(), Product::Q8, 64, 64).unwrap();
        assert_eq!(s, RatioSource::Measured);
        assert_ne!(r, 9.0);
    }

    #[test]
    fn a_corrupt_cache_is_measured_again_and_rewritten() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join(CACHE_FILE), b"{not json").unwrap();
        assert_eq!(
            remembered(dir.path(), Product::Q8, 64, 64).unwrap().1,
            RatioSource::Measured
        );
        assert_eq!(
            remembered(dir.path(), Product::Q8, 64, 64).unwrap().1,
            RatioSource::Remembered
        );
    }

    #[test]
    fn replicas_starting_together_measure_once_and_agree() {
        let dir = tempfile::tempdir().unwrap();
        let runs: Vec<_> = (0..3)
            .map(|_| {
                let d = dir.path().to_path_buf();
                std::thread::spawn(move || remembered(&d, Product::Q8, 128, 64).unwrap())
            })
            .collect();
        let got: Vec<(f64, RatioSource)> = runs.into_iter().map(|h| h.join().unwrap()).collect();
        assert!(got.iter().all(|(r, _)| *r == got[0].0), "{got:?}");
        let measured = got
            .iter()
            .filter(|(_, s)| *s == RatioSource::Measured)
            .count();
        assert_eq!(measured, 1, "{got:?}");
    }

    #[test]
    fn the_median_is_the_middle_value() {
        assert_eq!(median(&mut [3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&mut [4.0, 1.0, 3.0, 2.0]), 2.5);
        assert!(median(&mut []).is_nan());
    }

    #[test]
    fn the_measurement_runs_on_this_machine_and_gives_a_ratio() {
        let r = measure(96, 200).unwrap();
        assert!(r.is_finite() && r > 0.0, "{r}");
        let r = measure_q4(96, 200).unwrap();
        assert!(r.is_finite() && r > 0.0, "{r}");
    }
}
