//! Precision vocabulary: the pre-screen's classes and what each keeps resident.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use std::fmt;
use std::str::FromStr;

/// The class a weight group receives from the offline pre-screen (see `quantmesh prescreen --help`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum PrecisionClass {
    /// 4-bit weights, 16-bit activations: most aggressive.
    W4a16,
    /// 8-bit weights and activations, per-tensor scale.
    W8a8,
    /// 8-bit weights (per output channel) and activations: the middle class.
    W8a8PerChannel,
    /// Keep the group in float.
    Fp16,
}

impl PrecisionClass {
    /// The default mapping from class to residency: `fp16` → float only; `w8a8_per_channel` → dual; `w8a8`/`w4a16` → INT8 only.
    pub fn default_residency(self) -> Residency {
        match self {
            PrecisionClass::Fp16 => Residency::Float,
            PrecisionClass::W8a8PerChannel => Residency::Dual,
            PrecisionClass::W8a8 | PrecisionClass::W4a16 => Residency::Int8,
        }
    }
}

/// What a linear group keeps in memory, and therefore which paths it can take.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum Residency {
    /// Only the INT8 form: a fallback to exact float is impossible.
    Int8,
    /// INT8 and the exact float copy from the checkpoint: switchable per step.
    Dual,
    /// Only the float form.
    Float,
}

impl Residency {
    pub fn has_int8(self) -> bool {
        matches!(self, Residency::Int8 | Residency::Dual)
    }
    pub fn has_float(self) -> bool {
        matches!(self, Residency::Float | Residency::Dual)
    }
}

impl fmt::Display for Residency {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Residency::Int8 => "int8",
            Residency::Dual => "dual",
            Residency::Float => "float",
        })
    }
}

impl FromStr for Residency {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "int8" => Ok(Residency::Int8),
            "dual" => Ok(Residency::Dual),
            "float" => Ok(Residency::Float),
            other => Err(format!(
                "unknown residency {other:?}: expected int8, dual or float"
            )),
        }
    }
}

/// The four linear groups of a Llama decoder layer. Fused projections share a precision.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum GroupKind {
    /// q_proj, k_proj, v_proj fused.
    Qkv,
    /// o_proj.
    O,
    /// gate_proj, up_proj fused.
    GateUp,
    /// down_proj.
    Down,
}

impl GroupKind {
    pub const ALL: [GroupKind; 4] = [
        GroupKind::Qkv,
        GroupKind::O,
        GroupKind::GateUp,
        GroupKind::Down,
    ];

    /// Position of the group inside a layer (used to index per-group arrays).
    pub fn index(self) -> usize {
        match self {
            GroupKind::Qkv => 0,
            GroupKind::O => 1,
            GroupKind::GateUp => 2,
            GroupKind::Down => 3,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            GroupKind::Qkv => "qkv",
            GroupKind::O => "o",
            GroupKind::GateUp => "gate_up",
            GroupKind::Down => "down",
        }
    }
}

/// One linear group of one layer, e.g. `layers.3.gate_up`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct GroupId {
    pub layer: usize,
    pub kind: GroupKind,
}

impl GroupId {
    pub fn new(layer: usize, kind: GroupKind) -> Self {
        Self { layer, kind }
    }
}

impl fmt::Display for GroupId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "layers.{}.{}", self.layer, self.kind.name())
    }
}

impl FromStr for GroupId {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let err = || format!("bad group id {s:?}: expected layers.N.(qkv|o|gate_up|down)");
        let rest = s.strip_prefix("layers.").ok_or_else(err)?;
        let (layer, kind) = rest.split_once('.').ok_or_else(err)?;
        let layer = layer.parse().map_err(|_| err())?;
        let kind = GroupKind::ALL
            .into_iter()
            .find(|k| k.name() == kind)
            .ok_or_else(err)?;
        Ok(GroupId { layer, kind })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn group_id_round_trips() {
        for kind in GroupKind::ALL {
            let g = GroupId::new(7, kind);
            assert_eq!(g.to_string().parse::<GroupId>(), Ok(g));
        }
        assert!("layers.x.qkv".parse::<GroupId>().is_err());
        assert!("layers.1.mlp".parse::<GroupId>().is_err());
    }

    #[test]
    fn default_mapping_follows_spec() {
        assert_eq!(PrecisionClass::Fp16.default_residency(), Residency::Float);
        assert_eq!(
            PrecisionClass::W8a8PerChannel.default_residency(),
            Residency::Dual
        );
        assert_eq!(PrecisionClass::W8a8.default_residency(), Residency::Int8);
        assert_eq!(PrecisionClass::W4a16.default_residency(), Residency::Int8);
    }
}
