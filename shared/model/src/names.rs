//! The Llama family's tensor names, in Hugging Face's spelling — the one vocabulary every
//! reader and writer of checkpoints uses (GGUF names are mapped onto these in `gguf.rs`).

use quantmesh_types::{GroupId, GroupKind};

pub const EMBED: &str = "model.embed_tokens.weight";
pub const FINAL_NORM: &str = "model.norm.weight";
pub const LM_HEAD: &str = "lm_head.weight";
/// Per-layer norms, relative to [`layer_prefix`].
pub const INPUT_NORM: &str = "input_layernorm";
pub const POST_NORM: &str = "post_attention_layernorm";

/// `model.layers.N.`
pub fn layer_prefix(layer: usize) -> String {
    format!("model.layers.{layer}.")
}

/// `model.layers.N.input_layernorm.weight`
pub fn input_norm(layer: usize) -> String {
    format!("{}{INPUT_NORM}.weight", layer_prefix(layer))
}

/// `model.layers.N.post_attention_layernorm.weight`
pub fn post_norm(layer: usize) -> String {
    format!("{}{POST_NORM}.weight", layer_prefix(layer))
}

/// The member tensors (relative to `model.layers.N.`) fused into a group, in the order
/// their output rows are concatenated.
pub fn members(kind: GroupKind) -> &'static [&'static str] {
    match kind {
        GroupKind::Qkv => &["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"],
        GroupKind::O => &["self_attn.o_proj"],
        GroupKind::GateUp => &["mlp.gate_proj", "mlp.up_proj"],
        GroupKind::Down => &["mlp.down_proj"],
    }
}

/// `model.layers.N.<member>.weight`
pub fn member_weight(layer: usize, member: &str) -> String {
    format!("{}{member}.weight", layer_prefix(layer))
}

/// `model.layers.N.<member>.bias`
pub fn member_bias(layer: usize, member: &str) -> String {
    format!("{}{member}.bias", layer_prefix(layer))
}

/// The (weight, bias) names of every member of group `g`.
pub fn group_tensors(g: GroupId) -> Vec<(String, String)> {
    members(g.kind)
        .iter()
        .map(|m| (member_weight(g.layer, m), member_bias(g.layer, m)))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_follow_hugging_face() {
        let g = GroupId::new(3, GroupKind::GateUp);
        assert_eq!(
            group_tensors(g)[1],
            (
                "model.layers.3.mlp.up_proj.weight".to_string(),
                "model.layers.3.mlp.up_proj.bias".to_string()
            )
        );
        assert_eq!(input_norm(0), "model.layers.0.input_layernorm.weight");
        assert_eq!(
            post_norm(1),
            "model.layers.1.post_attention_layernorm.weight"
        );
    }
}
