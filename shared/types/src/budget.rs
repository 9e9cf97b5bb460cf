//! The memory budget for float copies, as configured (`engine.float_budget`) or written in a
//! plan (`sensitive_layers.json`'s `float_budget`, which wins and hot-reloads). The engine's
//! `budget` module decides which copies fit.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use std::fmt;
use std::str::FromStr;

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
        let v: f64 = num.parse().map_err(|_| bad(s))?;
        if !(v >= 0.0 && v.is_finite()) {
            return Err(bad(s));
        }
        Ok(FloatBudget::Bytes((v * mult as f64) as u64))
    }
}

fn bad(s: &str) -> String {
    format!(
        "float_budget {s:?}: expected \"unlimited\", a share like \"10%\", or bytes like \"64MiB\""
    )
}

impl fmt::Display for FloatBudget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            FloatBudget::Unlimited => f.write_str("unlimited"),
            FloatBudget::Percent(p) => write!(f, "{p}%"),
            FloatBudget::Bytes(b) => write!(f, "{b}"),
        }
    }
}

impl Serialize for FloatBudget {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for FloatBudget {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

impl JsonSchema for FloatBudget {
    fn schema_name() -> std::borrow::Cow<'static, str> {
        "FloatBudget".into()
    }
    fn json_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
        schemars::json_schema!({
            "type": "string",
            "description": "\"unlimited\", a share of the INT8 linear weights like \"10%\", or bytes like \"64MiB\""
        })
    }
}
