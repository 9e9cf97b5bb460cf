//! One step under the precision policy, the same for every backend: the served pass under
//! the mask; on a sampled share of steps a float-only shadow pass first (KL to the float
//! model per sequence); after a NaN/Inf in activations or logits the whole step again in
//! float.

use crate::backend::{Backend, GroupOutcome, StepInput};
use crate::error::Result;
use crate::kv::{KvCache, SeqId};
use crate::precision::mask::PathMask;
use crate::precision::probe::GroupObs;
use crate::precision::router::MaskRouter;
use quantmesh_model::ops::kl_logits;
use quantmesh_types::{GroupId, KlReference};

/// What a step produced.
#[derive(Debug, Clone, Default)]
pub struct StepOutput {
    /// Logits of the last token of each chunk that asked for them.
    pub logits: Vec<(SeqId, Vec<f32>)>,
    /// Row counts per group and path.
    pub outcomes: Vec<(GroupId, GroupOutcome)>,
    /// The mask version this step ran under.
    pub mask_version: u64,
    pub num_tokens: usize,
    /// (sequence, position, token id) of every row, in row order.
    pub rows: Vec<(SeqId, usize, u32)>,
    /// Activation statistics per monitored group (empty when monitoring is off).
    pub obs: Vec<GroupObs>,
    /// Sampled KL(P_float ‖ P_served) per sequence with logits (shadow steps only).
    pub shadow_kl: Vec<(SeqId, f64)>,
    /// What the shadow pass's reference was (set on shadow steps).
    pub shadow_reference: Option<KlReference>,
    /// NaN/Inf seen in activations or logits: the step was recomputed in float.
    pub non_finite: bool,
    /// Time spent choosing paths (mask checks and per-token routing).
    pub mask_check_ns: u64,
    /// Time spent computing activation statistics (monitoring).
    pub stats_ns: u64,
}

/// Runs steps on a backend under the mask. Holds the step counter that spreads shadow
/// passes evenly (a Weyl sequence: deterministic, no RNG).
#[derive(Debug, Default)]
pub struct StepRunner {
    steps: u64,
}

impl StepRunner {
    /// Run one step. `kv_int8`: whether new KV entries are stored in INT8 (layers listed in
    /// `mask.kv_float_layers` store float regardless).
    ///
    /// With monitoring on, a deterministic `shadow_sample_rate` share of steps first runs a
    /// float-only pass to get `KL(P_float ‖ P_served)` for each sequence's next token: every
    /// group on its float copy, the step's own K/V written in float (the served pass then
    /// rewrites those slots, so the cache holds served values). Earlier tokens' K/V are the
    /// served cache's. Groups holding no float copy take the checkpoint's weights where the
    /// backend keeps a reference, else run INT8 in the reference as well: the output says
    /// which reference it was (`KlReference`). A NaN/Inf in activations
    /// or logits makes the whole step recompute in float.
    pub fn run(
        &mut self,
        backend: &dyn Backend,
        step: &StepInput,
        mask: &PathMask,
        kv: &mut KvCache,
        kv_int8: bool,
    ) -> Result<StepOutput> {
        for &(src, dst) in &step.copies {
            kv.copy_page(src, dst);
        }
        let n = self.steps;
        self.steps += 1;
        let float_mask = || PathMask {
            float_batch: true,
            detector: None,
            ..mask.clone()
        };
        let shadow = match &mask.detector {
            Some(d) if d.shadow_sample_rate > 0.0 && !mask.float_batch => {
                ((n as f64 * 0.618_033_988_749_895) % 1.0) < d.shadow_sample_rate
            }
            _ => false,
        };
        let shadow_logits = if shadow {
            let reference = pass(backend, step, &float_mask(), kv, false, true)?;
            // Every row asked for float: any row computed on quantized weights (plain or
            // split) means a group had no float copy to give it.
            let partial = reference
                .outcomes
                .iter()
                .any(|(_, o)| o.int8_rows + o.split_rows > 0);
            Some((
                reference.logits,
                if partial {
                    KlReference::PartialFloatWeights
                } else {
                    KlReference::FloatWeights
                },
            ))
        } else {
            None
        };
        let mut out = pass(backend, step, mask, kv, kv_int8, false)?;
        let bad_logits = out.logits.iter().any(|(_, l)| !all_finite(l));
        if out.non_finite || bad_logits {
            tracing::warn!(
                tokens = out.num_tokens,
                "non-finite activations or logits: recomputing the step in float"
            );
            let again = pass(backend, step, &float_mask(), kv, kv_int8, false)?;
            out.logits = again.logits;
            out.outcomes.extend(again.outcomes);
            out.non_finite = true;
        }
        if let Some((fl, reference)) = shadow_logits {
            out.shadow_reference = Some(reference);
            out.shadow_kl = fl
                .iter()
                .zip(&out.logits)
                .filter(|((a, _), (b, _))| a == b)
                .map(|((s, f), (_, q))| (*s, kl_logits(f, q)))
                .collect();
        }
        Ok(out)
    }
}

/// Whether every value of `x` is finite: the exponent bits of each value and-ed together
/// in one branch-free pass (it vectorizes; a step checks every logit of every row).
fn all_finite(x: &[f32]) -> bool {
    const EXP: u32 = 0x7f80_0000;
    x.chunks(1024)
        .all(|c| c.iter().fold(true, |ok, v| ok & (v.to_bits() & EXP != EXP)))
}

/// One pass of the backend under one mask; `reference`: the shadow pass (every group on
/// [`crate::backend::RowPath::Reference`]).
fn pass(
    backend: &dyn Backend,
    step: &StepInput,
    mask: &PathMask,
    kv: &mut KvCache,
    kv_int8: bool,
    reference: bool,
) -> Result<StepOutput> {
    let mut router = MaskRouter::new(mask, step.rows(), kv_int8);
    if reference {
        router = router.reference();
    }
    let logits = backend.pass(step, &mut router, kv)?.logits;
    Ok(StepOutput {
        logits,
        outcomes: router.outcomes,
        mask_version: mask.version,
        num_tokens: step.num_tokens(),
        rows: step
            .chunks
            .iter()
            .flat_map(|c| {
                c.tokens
                    .iter()
                    .enumerate()
                    .map(move |(i, t)| (c.seq, c.start_pos + i, *t))
            })
            .collect(),
        obs: router.obs,
        shadow_kl: Vec::new(),
        shadow_reference: None,
        non_finite: router.non_finite,
        mask_check_ns: router.mask_check_ns,
        stats_ns: router.stats_ns,
    })
}

#[cfg(test)]
mod tests {
    use super::all_finite;

    #[test]
    fn a_single_non_finite_value_anywhere_is_found() {
        let mut x = vec![1.5f32; 5000];
        assert!(all_finite(&x));
        assert!(all_finite(&[]));
        for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
            for at in [0, 1023, 1024, 4999] {
                x[at] = bad;
                assert!(!all_finite(&x), "{bad} at {at}");
                x[at] = f32::MAX;
                assert!(all_finite(&x));
            }
        }
    }
}
