//! The activation width the quantized path runs at by default, measured on this machine
//! (`engine.split_activations = "auto"`): the 8-bit and 16-bit products timed on the
//! model's own widest shape, and 8-bit activations chosen (`copyless`: only the rows the
//! monitor wants at higher precision carry 16 bits) where they are meaningfully cheaper.

use crate::error::Result;
use quantmesh_config::SplitActivations;
use quantmesh_kernels::{ActBits, Activations, Isa, PackedQ8, Pool, Q8Layout};
use std::time::Instant;

/// 16-bit activations must cost at least this many times the 8-bit product before `auto`
/// chooses 8-bit ones: below it the speed would not pay for the quality.
pub const CHEAPER_BY: f64 = 1.15;

/// Rows of the timed product: a batch of concurrent decodes or a prefill chunk, where the
/// product's arithmetic (not its weight bytes) sets the time and the widths can differ.
const ROWS: usize = 32;

/// Pairs of runs [`measure`] times.
const PAIRS: usize = 15;

/// Overrides the measured ratio (tests, and operators who measured elsewhere):
/// `QUANTMESH_ACTIVATION_WIDTH_RATIO=1.4` acts as if 16-bit activations cost 1.4× here.
pub const RATIO_ENV: &str = "QUANTMESH_ACTIVATION_WIDTH_RATIO";

/// What `auto` measured and chose.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct WidthChoice {
    /// The mode in force.
    pub mode: SplitActivations,
    /// Time of the 16-bit product over the 8-bit one (`None`: not measured, an explicit
    /// setting).
    pub ratio: Option<f64>,
    /// Whether the ratio came from [`RATIO_ENV`] rather than this machine's kernels.
    pub forced: bool,
}

/// [`choose`] for `model`, timed on its widest product (`gate_up`: `[2 · intermediate,
/// hidden]`); the weights loaded after it are packed in the order the kernel for the chosen
/// width reads fastest ([`quantmesh_kernels::set_packing_width`]: 8-bit activations under
/// `off` and `copyless`, 16-bit ones under `all`).
pub fn choose_for(
    setting: SplitActivations,
    model: &quantmesh_model::ModelConfig,
) -> Result<WidthChoice> {
    let choice = choose(setting, 2 * model.intermediate_size, model.hidden_size)?;
    quantmesh_kernels::set_packing_width(packing_width(choice.mode));
    Ok(choice)
}

/// The activation width most rows of `mode` run at.
pub fn packing_width(mode: SplitActivations) -> ActBits {
    match mode {
        SplitActivations::Off | SplitActivations::Copyless => ActBits::Eight,
        SplitActivations::All | SplitActivations::Auto => ActBits::Sixteen,
    }
}

/// Resolve `setting` for a model whose widest linear group is `[out, in]`: an explicit
/// mode stands; `auto` measures (or reads [`RATIO_ENV`]) and decides by [`decide`].
pub fn choose(setting: SplitActivations, out: usize, input: usize) -> Result<WidthChoice> {
    if setting != SplitActivations::Auto {
        return Ok(WidthChoice {
            mode: setting,
            ratio: None,
            forced: false,
        });
    }
    let (ratio, forced) = match std::env::var(RATIO_ENV) {
        Ok(v) => (
            v.trim()
                .parse::<f64>()
                .ok()
                .filter(|r| r.is_finite() && *r > 0.0)
                .ok_or_else(|| {
                    crate::error::EngineError::Config(format!(
                        "{RATIO_ENV}={v:?} is not a positive number"
                    ))
                })?,
            true,
        ),
        Err(_) => (measure(out, input)?, false),
    };
    Ok(WidthChoice {
        mode: decide(ratio),
        ratio: Some(ratio),
        forced,
    })
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

/// The 16-bit product's time over the 8-bit one for a `[out, in]` Q8_0 weight and
/// [`ROWS`] rows on this machine's kernels, each width on the weights ordered for it
/// ([`Q8Layout::for_width`]): [`PAIRS`] pairs of runs back to back (in alternating order),
/// the median of the pairs' ratios. A pair's two runs see the same neighbours, so a load
/// that comes and goes moves few pairs and the median not at all.
pub fn measure(out: usize, input: usize) -> Result<f64> {
    let input = input.next_multiple_of(quantmesh_kernels::BLOCK);
    let w: Vec<f32> = (0..out * input)
        .map(|i| ((i as f32) * 0.618_034).fract() - 0.5)
        .collect();
    let isa = Isa::current();
    let packed = |bits| PackedQ8::quantize_in(&w, out, input, Q8Layout::for_width(isa, bits));
    let (p8, p16) = (packed(ActBits::Eight)?, packed(ActBits::Sixteen)?);
    let x: Vec<f32> = (0..ROWS * input)
        .map(|i| ((i as f32) * 0.414_213_5).fract() * 2.0 - 1.0)
        .collect();
    let pool = Pool::global();
    let mut a = Activations::new();
    let mut time = |bits: ActBits| -> Result<f64> {
        let packed = if bits == ActBits::Eight { &p8 } else { &p16 };
        let t = Instant::now();
        a.quantize(&x, ROWS, input, bits)?;
        std::hint::black_box(packed.matmul_vec(&a, isa, pool)?);
        Ok(t.elapsed().as_secs_f64())
    };
    // Warm-up: the pool's threads, the weights' pages.
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
    Ok(median(&mut ratios))
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
    }

    #[test]
    fn an_explicit_mode_is_never_measured() {
        for m in [
            SplitActivations::Off,
            SplitActivations::Copyless,
            SplitActivations::All,
        ] {
            assert_eq!(
                choose(m, 64, 64).unwrap(),
                WidthChoice {
                    mode: m,
                    ratio: None,
                    forced: false
                }
            );
        }
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
    }
}
