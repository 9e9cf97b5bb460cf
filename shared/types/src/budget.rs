//! Memory budgets. For float copies, as configured (`engine.float_budget`) or written in a
//! plan (`sensitive_layers.json`'s `float_budget`, which wins and hot-reloads): the engine's
//! `budget` module decides which copies fit. For every resident weight
//! (`engine.weight_budget`, `quantmesh prescreen --weight-budget`): the pre-screen's `bits`
//! module chooses which groups take 4 and which 8 bits.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use std::fmt;
use std::str::FromStr;

/// Serde and JSON Schema for a budget written as a string: its `Display` form out, its
/// `FromStr` in (the parse error is the deserializer's), a string schema with `$desc`.
macro_rules! string_form {
    ($t:ident, $desc:literal) => {
        impl Serialize for $t {
            fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                s.collect_str(self)
            }
        }

        impl<'de> Deserialize<'de> for $t {
            fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                let s = String::deserialize(d)?;
                s.parse().map_err(serde::de::Error::custom)
            }
        }

        impl JsonSchema for $t {
            fn schema_name() -> std::borrow::Cow<'static, str> {
                stringify!($t).into()
            }
            fn json_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
                schemars::json_schema!({"type": "string", "description": $desc})
            }
        }
    };
}

/// How many bytes float copies of linear groups may take.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub enum FloatBudget {
    /// Every group keeps the float copy its residency asks for.
    #[default]
    Unlimited,
    /// A share of the model's INT8 linear weights, in percent (`"10%"`).
    Percent(f64),
    /// Bytes (`"64MiB"`, `"1000000"`).
    Bytes(u64),
}

impl FloatBudget {
    /// The budget in bytes for a model whose linear weights take `int8_bytes` in INT8.
    pub fn bytes(self, int8_bytes: usize) -> Option<usize> {
        match self {
            FloatBudget::Unlimited => None,
            FloatBudget::Percent(p) => Some((p / 100.0 * int8_bytes as f64).floor() as usize),
            FloatBudget::Bytes(b) => Some(b as usize),
        }
    }
}

impl FromStr for FloatBudget {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let t = s.trim();
        if t.eq_ignore_ascii_case("unlimited") || t.eq_ignore_ascii_case("none") {
            return Ok(FloatBudget::Unlimited);
        }
        if let Some(p) = t.strip_suffix('%') {
            let v: f64 = p.trim().parse().map_err(|_| bad(s))?;
            if !(0.0..=1000.0).contains(&v) {
                return Err(format!("float_budget {s:?}: a share must be in 0%..=1000%"));
            }
            return Ok(FloatBudget::Percent(v));
        }
        parse_bytes(t).map(FloatBudget::Bytes).ok_or_else(|| bad(s))
    }
}

/// Bytes written as a number with an optional unit (`"64MiB"`, `"1.5GB"`, `"1000000"`);
/// `None` for anything else, a negative or non-finite number included.
fn parse_bytes(t: &str) -> Option<u64> {
    let (num, mult) = [
        ("GiB", 1u64 << 30),
        ("MiB", 1 << 20),
        ("KiB", 1 << 10),
        ("GB", 1_000_000_000),
        ("MB", 1_000_000),
        ("kB", 1_000),
        ("B", 1),
    ]
    .iter()
    .find_map(|(suf, m)| t.strip_suffix(suf).map(|n| (n.trim(), *m)))
    .unwrap_or((t, 1));
    let v: f64 = num.parse().ok()?;
    (v >= 0.0 && v.is_finite()).then_some((v * mult as f64) as u64)
}

fn bad(s: &str) -> String {
    format!(
        "float_budget {s:?}: expected \"unlimited\", a share like \"10%\", or bytes like \"64MiB\""
    )
}

string_form!(
    FloatBudget,
    "\"unlimited\", a share of the INT8 linear weights like \"10%\", or bytes like \"64MiB\""
);

impl fmt::Display for FloatBudget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            FloatBudget::Unlimited => f.write_str("unlimited"),
            FloatBudget::Percent(p) => write!(f, "{p}%"),
            FloatBudget::Bytes(b) => write!(f, "{b}"),
        }
    }
}

/// How many bytes the resident weights may take: linear groups in their quantized forms and
/// float copies, the vocabulary tables and the norms. The pre-screen fits each group's bits
/// (4 or 8) to it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum WeightBudget {
    /// A share of the same model with every weight in 16 bits (`"0.38x"`).
    Ratio(f64),
    /// Bytes (`"100MiB"`, `"105000000"`).
    Bytes(u64),
}

impl WeightBudget {
    /// The budget in bytes for a model whose weights take `all_f16` bytes in 16 bits.
    pub fn bytes(self, all_f16: u64) -> u64 {
        match self {
            WeightBudget::Ratio(r) => (r * all_f16 as f64).floor() as u64,
            WeightBudget::Bytes(b) => b,
        }
    }
}

impl FromStr for WeightBudget {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let t = s.trim();
        let bad = || {
            format!(
                "weight_budget {s:?}: expected a share of the all-16-bit model like \"0.38x\" \
                 (more than 0, at most 2) or bytes like \"100MiB\" (more than 0)"
            )
        };
        if let Some(r) = t.strip_suffix(['x', 'X']) {
            let v: f64 = r.trim().parse().map_err(|_| bad())?;
            return match v > 0.0 && v <= 2.0 {
                true => Ok(WeightBudget::Ratio(v)),
                false => Err(bad()),
            };
        }
        match parse_bytes(t) {
            Some(b) if b > 0 => Ok(WeightBudget::Bytes(b)),
            _ => Err(bad()),
        }
    }
}

string_form!(
    WeightBudget,
    "a share of the all-16-bit model like \"0.38x\", or bytes like \"100MiB\""
);

impl fmt::Display for WeightBudget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            WeightBudget::Ratio(r) => write!(f, "{r}x"),
            WeightBudget::Bytes(b) => write!(f, "{b}"),
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn weight_budgets_parse_and_bad_ones_are_named() {
        assert_eq!("0.38x".parse(), Ok(WeightBudget::Ratio(0.38)));
        assert_eq!(" 1X ".parse(), Ok(WeightBudget::Ratio(1.0)));
        assert_eq!("100MiB".parse(), Ok(WeightBudget::Bytes(100 << 20)));
        assert_eq!("105000000".parse(), Ok(WeightBudget::Bytes(105_000_000)));
        assert_eq!(WeightBudget::Ratio(0.5).bytes(1000), 500);
        for bad in [
            "",
            "x",
            "0x",
            "-0.3x",
            "3x",
            "abc",
            "0",
            "-5MiB",
            "NaNx",
            "12 parsecs",
        ] {
            let e = bad.parse::<WeightBudget>().unwrap_err();
            assert!(e.starts_with("weight_budget "), "{bad}: {e}");
        }
        for s in ["0.38x", "1000"] {
            let b: WeightBudget = s.parse().unwrap();
            assert_eq!(b.to_string().parse::<WeightBudget>().unwrap(), b);
        }
    }
}
