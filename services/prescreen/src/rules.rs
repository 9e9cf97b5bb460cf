//! Classification rules, configurable by a TOML file.
//!
//! Each metric votes and the most conservative class wins:
//! 1. `energy > energy_fp16` → `fp16`.
//! 2. `R < r_aggressive` and KL(aggressive format) `< kl_aggressive` → the aggressive class
//!    (`w8a8` by default; `w4a16` when `aggressive = "w4a16"` and its own KL is below the
//!    bound, else `w8a8`).
//! 3. `R < r_fp16` and KL(`w8a8_per_channel`) `< kl_fp16` → `w8a8_per_channel`.
//! 4. Otherwise `fp16`.
//!
//! The spec words rule 3 as `10 ≤ R < 50 ∨ 0.015 ≤ KL < 0.05`. Read literally as a
//! first-match list that is not monotone (R = 60 with KL = 0.02 would be per-channel, yet
//! with the *better* KL = 0.01 fp16) and would serve R = 20 with KL = 0.3 in INT8. Reading
//! each bound as a limit on its own metric, as above, agrees with the literal rules wherever
//! they are monotone and is conservative elsewhere.

use crate::quant::Format;
use quantmesh_types::PrecisionClass;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Rules {
    pub r_aggressive: f64,
    pub r_fp16: f64,
    pub kl_aggressive: f64,
    pub kl_fp16: f64,
    pub energy_fp16: f64,
    /// `w8a8` or `w4a16`.
    pub aggressive: Format,
    /// Share of calibration rows in which a channel must be massive (magnitude above
    /// `massive_channel_ratio` × the row's median magnitude) for it to be listed as a massive
    /// channel (residual-stream groups only: qkv, gate_up). The monitor uses the same rule.
    pub massive_channel_share: f64,
    pub massive_channel_ratio: f32,
    /// Scale migration (SmoothQuant): its strength α in [0, 1) (0: none; 0.75 measured best
    /// on SmolLM2 among 0.5, 0.75 and 0.9, docs/MEASUREMENTS.md). Each group's
    /// factors come from its calibration activations and weights; they are kept where they
    /// bring the served 8-bit-activation product's output error to at most `smoothing_gain`
    /// times the unsmoothed one.
    pub smoothing_alpha: f64,
    /// Further strengths tried per group beside `smoothing_alpha` (each in (0, 1)): a group
    /// keeps the strength whose factors give its served W8A8 error on the calibration rows
    /// the lowest value, if that passes `smoothing_gain` (empty: one strength for every
    /// group).
    pub smoothing_alphas: Vec<f64>,
    /// See `smoothing_alpha` (in (0, 1]).
    pub smoothing_gain: f64,
    /// The fewest calibration tokens scale migration is computed from; with fewer the
    /// pre-screen writes no factors (and says so). Measured on SmolLM2 under 16-bit
    /// activations (rotation 128, monitor on, three held-out texts): factors from 903 tokens
    /// made the mean KL 5.3–7.4× that of no factors, from 4 747 tokens 0.60–0.65×
    /// (docs/MEASUREMENTS.md). 4096 lies between those two sizes; the boundary itself was not
    /// measured. The likely cause, not isolated: the factors come from each channel's largest
    /// calibration activation, and a peak the few tokens missed shrinks that channel's weight
    /// column, which then serves the real peak coarsely.
    pub smoothing_min_tokens: usize,
    /// The Hadamard block the engine rotates quantized activations by
    /// (`engine.rotation_block`; 0: none): the served error is measured under it.
    pub rotation_block: u32,
    /// Hook thresholds written to the output's `thresholds` (the spec's defaults).
    pub hook: HookDefaults,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct HookDefaults {
    pub k: f64,
    pub min_excess: f64,
    pub trigger_rate: f64,
    pub window_requests: usize,
    pub recovery_windows: usize,
    pub token_k: f64,
    pub shadow_sample_rate: f64,
    pub request_kl_limit: f64,
}

impl Default for HookDefaults {
    fn default() -> Self {
        Self {
            k: 4.0,
            min_excess: 1.0,
            trigger_rate: 0.01,
            window_requests: 1000,
            recovery_windows: 3,
            token_k: 16.0,
            shadow_sample_rate: 0.01,
            request_kl_limit: 0.02,
        }
    }
}

impl Default for Rules {
    fn default() -> Self {
        Self {
            r_aggressive: 10.0,
            r_fp16: 50.0,
            kl_aggressive: 0.015,
            kl_fp16: 0.05,
            energy_fp16: 0.42,
            aggressive: Format::W8a8,
            massive_channel_share: quantmesh_model::massive::DEFAULT_MASSIVE_SHARE,
            massive_channel_ratio: quantmesh_model::massive::DEFAULT_MASSIVE_RATIO,
            smoothing_alpha: 0.75,
            smoothing_alphas: Vec::new(),
            smoothing_gain: 0.9,
            smoothing_min_tokens: 4096,
            rotation_block: quantmesh_types::DEFAULT_ROTATION_BLOCK,
            hook: HookDefaults::default(),
        }
    }
}

/// The metrics a rule reads.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Scores {
    pub r: f64,
    pub energy: f64,
    pub kl_w8a8: f64,
    pub kl_w8a8_per_channel: f64,
    pub kl_w4a16: f64,
}

impl Rules {
    pub fn from_toml(text: &str) -> Result<Self, String> {
        let r: Rules = toml::from_str(text).map_err(|e| e.to_string())?;
        r.validate()?;
        Ok(r)
    }

    pub fn validate(&self) -> Result<(), String> {
        let pos = [
            self.r_aggressive,
            self.r_fp16,
            self.kl_aggressive,
            self.kl_fp16,
            self.energy_fp16,
        ];
        if pos.iter().any(|v| !(v.is_finite() && *v > 0.0)) {
            return Err("every threshold must be a positive number".into());
        }
        if self.r_aggressive > self.r_fp16 || self.kl_aggressive > self.kl_fp16 {
            return Err("r_aggressive <= r_fp16 and kl_aggressive <= kl_fp16 are required".into());
        }
        if self.aggressive == Format::W8a8PerChannel {
            return Err("aggressive must be w8a8 or w4a16".into());
        }
        if !(0.0..=1.0).contains(&self.massive_channel_share) {
            return Err("massive_channel_share must be in [0, 1]".into());
        }
        if !(self.massive_channel_ratio.is_finite() && self.massive_channel_ratio > 1.0) {
            return Err("massive_channel_ratio must be > 1".into());
        }
        if !(0.0..1.0).contains(&self.smoothing_alpha) {
            return Err("smoothing_alpha must be in [0, 1) (0: no scale migration)".into());
        }
        if self
            .smoothing_alphas
            .iter()
            .any(|a| !(*a > 0.0 && *a < 1.0))
        {
            return Err("every smoothing_alphas entry must be in (0, 1)".into());
        }
        if !(self.smoothing_gain > 0.0 && self.smoothing_gain <= 1.0) {
            return Err("smoothing_gain must be in (0, 1]".into());
        }
        if self.rotation_block > 4096
            || (self.rotation_block != 0 && !self.rotation_block.is_power_of_two())
        {
            return Err("rotation_block must be 0 (none) or a power of two up to 4096".into());
        }
        Ok(())
    }

    /// The class and the rule that chose it, in words.
    pub fn classify(&self, s: &Scores) -> (PrecisionClass, String) {
        if s.energy > self.energy_fp16 {
            return (
                PrecisionClass::Fp16,
                format!("energy {:.4} > {} → fp16", s.energy, self.energy_fp16),
            );
        }
        if s.r < self.r_aggressive {
            let w4 = self.aggressive == Format::W4a16 && s.kl_w4a16 < self.kl_aggressive;
            if w4 {
                return (
                    PrecisionClass::W4a16,
                    format!(
                        "R {:.3} < {} ∧ KL(w4a16) {:.5} < {} → w4a16",
                        s.r, self.r_aggressive, s.kl_w4a16, self.kl_aggressive
                    ),
                );
            }
            if s.kl_w8a8 < self.kl_aggressive {
                return (
                    PrecisionClass::W8a8,
                    format!(
                        "R {:.3} < {} ∧ KL(w8a8) {:.5} < {} → w8a8",
                        s.r, self.r_aggressive, s.kl_w8a8, self.kl_aggressive
                    ),
                );
            }
        }
        if s.r < self.r_fp16 && s.kl_w8a8_per_channel < self.kl_fp16 {
            return (
                PrecisionClass::W8a8PerChannel,
                format!(
                    "R {:.3} < {} ∧ KL(w8a8_per_channel) {:.5} < {} → w8a8_per_channel",
                    s.r, self.r_fp16, s.kl_w8a8_per_channel, self.kl_fp16
                ),
            );
        }
        let why = if s.r >= self.r_fp16 {
            format!("R {:.3} ≥ {}", s.r, self.r_fp16)
        } else {
            format!(
                "KL(w8a8_per_channel) {:.5} ≥ {}",
                s.kl_w8a8_per_channel, self.kl_fp16
            )
        };
        (PrecisionClass::Fp16, format!("{why} → fp16"))
    }

    /// The thresholds as a flat map (recorded in the output's `generator.rules`; the further
    /// smoothing strengths as `smoothing_alphas.0`, `.1`, …).
    pub fn as_map(&self) -> BTreeMap<String, f64> {
        let mut map = BTreeMap::from([
            ("r_aggressive".into(), self.r_aggressive),
            ("r_fp16".into(), self.r_fp16),
            ("kl_aggressive".into(), self.kl_aggressive),
            ("kl_fp16".into(), self.kl_fp16),
            ("energy_fp16".into(), self.energy_fp16),
            (
                "aggressive_w4a16".into(),
                f64::from(u8::from(self.aggressive == Format::W4a16)),
            ),
            ("massive_channel_share".into(), self.massive_channel_share),
            (
                "massive_channel_ratio".into(),
                f64::from(self.massive_channel_ratio),
            ),
            ("smoothing_alpha".into(), self.smoothing_alpha),
            ("smoothing_gain".into(), self.smoothing_gain),
            (
                "smoothing_min_tokens".into(),
                self.smoothing_min_tokens as f64,
            ),
            ("rotation_block".into(), f64::from(self.rotation_block)),
        ]);
        for (i, a) in self.smoothing_alphas.iter().enumerate() {
            map.insert(format!("smoothing_alphas.{i}"), *a);
        }
        map
    }

    /// The strengths scale migration tries per group (none when `smoothing_alpha` is 0).
    pub fn smoothing_strengths(&self) -> Vec<f64> {
        if self.smoothing_alpha <= 0.0 {
            return Vec::new();
        }
        let mut v = vec![self.smoothing_alpha];
        for a in &self.smoothing_alphas {
            if !v.contains(a) {
                v.push(*a);
            }
        }
        v
    }

    /// The massive-channel rule these rules apply.
    pub fn massive_rule(&self) -> quantmesh_model::massive::MassiveRule {
        quantmesh_model::massive::MassiveRule {
            ratio: self.massive_channel_ratio,
            share: self.massive_channel_share,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use PrecisionClass::*;

    fn s(r: f64, kl: f64, energy: f64) -> Scores {
        Scores {
            r,
            energy,
            kl_w8a8: kl,
            kl_w8a8_per_channel: kl,
            kl_w4a16: kl,
        }
    }

    #[test]
    fn every_boundary_on_both_sides() {
        let rules = Rules::default();
        let c = |x: Scores| rules.classify(&x).0;
        // R = 10 boundary (KL small).
        assert_eq!(c(s(9.999, 0.001, 0.1)), W8a8);
        assert_eq!(c(s(10.0, 0.001, 0.1)), W8a8PerChannel);
        // KL = 0.015 boundary (R small).
        assert_eq!(c(s(5.0, 0.01499, 0.1)), W8a8);
        assert_eq!(c(s(5.0, 0.015, 0.1)), W8a8PerChannel);
        // R = 50 boundary.
        assert_eq!(c(s(49.99, 0.001, 0.1)), W8a8PerChannel);
        assert_eq!(c(s(50.0, 0.001, 0.1)), Fp16);
        // KL = 0.05 boundary.
        assert_eq!(c(s(5.0, 0.04999, 0.1)), W8a8PerChannel);
        assert_eq!(c(s(5.0, 0.05, 0.1)), Fp16);
        // Energy = 0.42 boundary overrides everything.
        assert_eq!(c(s(1.0, 0.0, 0.42)), W8a8);
        assert_eq!(c(s(1.0, 0.0, 0.4201)), Fp16);
        // Conservative where the literal reading is not monotone.
        assert_eq!(c(s(20.0, 0.3, 0.1)), Fp16);
        // Rule text names the rule.
        assert!(rules
            .classify(&s(60.0, 0.0, 0.1))
            .1
            .contains("R 60.000 ≥ 50"));
    }

    #[test]
    fn w4a16_when_asked_and_good_enough() {
        let rules = Rules {
            aggressive: Format::W4a16,
            ..Default::default()
        };
        let mut x = s(5.0, 0.001, 0.1);
        assert_eq!(rules.classify(&x).0, W4a16);
        x.kl_w4a16 = 0.02; // 4-bit too lossy, 8-bit fine
        assert_eq!(rules.classify(&x).0, W8a8);
    }

    #[test]
    fn rules_file_is_strict() {
        assert!(Rules::from_toml("r_aggressive = 8.0\n").is_ok());
        assert!(Rules::from_toml("r_agressive = 8.0\n").is_err());
        assert!(Rules::from_toml("r_aggressive = 80.0\n").is_err());
        assert_eq!(Rules::from_toml("").unwrap(), Rules::default());
    }
}

#[cfg(test)]
mod example_file {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn example_rules_file_is_the_defaults() {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../infra/prescreen-rules.example.toml"
        );
        let text = std::fs::read_to_string(path).unwrap();
        assert_eq!(Rules::from_toml(&text).unwrap(), Rules::default());
    }
}
