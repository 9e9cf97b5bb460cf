//! The memory budget for float copies: which groups that want a float copy (residency
//! `float` or `dual`) keep one when not all fit. The rest become INT8-only; when they later
//! want the float path, their rows are counted as "wanted fallback, unavailable" (metrics
//! and fallback events), which is the evidence the evolution job uses to promote them.
//!
//! The vocabulary tables come first: with `engine.embeddings = auto` they are stored in
//! f16 when their bytes beyond Q8_0 fit, and 16-bit tables (chosen or set) take those bytes
//! off the top; the groups share the rest.
//!
//! Ranking (most deserving first): `float` groups (their class says INT8 is not good
//! enough at all), then `dual` groups the monitor saw wanting float in served traffic, then
//! `dual` groups by the pre-screen's evidence: where the engine serves 8-bit activations
//! (`split_activations` `off` or `copyless`), first by the served W8A8 product's output
//! error on the calibration rows (`act8_nsr`, activations included: where 8-bit
//! activations hurt), then by the KL of the INT8 weights the engine serves
//! (`w8a8_per_channel`, closest to Q8_0's per-block scales), then by R; groups without
//! pre-screen evidence last, in layer order. Greedy in rank order: a group is kept
//! when its float copy still fits, so a large group that does not fit does not block
//! smaller ones behind it.

use crate::backend::EmbeddingDtype;
use quantmesh_types::{GroupEntry, GroupId, Residency};
use std::collections::BTreeMap;

pub use quantmesh_types::FloatBudget;

/// How deserving a group's float copy is; higher first.
#[derive(Debug, Clone, Copy, PartialEq, PartialOrd)]
pub struct Rank {
    /// 3 = `float` residency, 2 = `dual` that the monitor saw wanting float in served
    /// traffic (`observed`, written by the evolution service), 1 = `dual` with pre-screen
    /// evidence only, 0 = `dual` without evidence.
    tier: u8,
    /// Share of monitor windows the group wanted float (tier 2).
    wanted: f64,
    /// The served W8A8 harm where the engine serves 8-bit activations (0 otherwise).
    act8: f64,
    kl: f64,
    r: f64,
}

/// The rank of a group from its plan entry (`None`: no evidence). Served-traffic evidence
/// outranks the pre-screen's: a group the monitor kept wanting in float is what a float copy
/// is for, whatever its weights' offline KL — without this a group the evolution service
/// promoted could lose its new copy to the budget at the next reload. `eight_bit`: the
/// engine serves the quantized path 8-bit activations, so what W8A8 costs the group
/// (activations included) ranks before its weights' KL.
pub fn rank(residency: Residency, entry: Option<&GroupEntry>, eight_bit: bool) -> Rank {
    let metrics = entry.and_then(|e| e.metrics.as_ref());
    let wanted = entry
        .and_then(|e| e.observed.as_ref())
        .map_or(0.0, |o| o.wanted_float_share);
    let tier = match (residency, wanted > 0.0, metrics) {
        (Residency::Float, _, _) => 3,
        (_, true, _) => 2,
        (_, false, Some(_)) => 1,
        _ => 0,
    };
    let finite = |v: f64| if v.is_finite() { v } else { f64::MAX };
    Rank {
        tier,
        wanted: finite(wanted),
        act8: if eight_bit {
            entry
                .and_then(GroupEntry::served_act8_nsr)
                .map_or(0.0, finite)
        } else {
            0.0
        },
        kl: metrics.map_or(0.0, |m| finite(m.kl.w8a8_per_channel)),
        r: metrics.map_or(0.0, |m| finite(m.r)),
    }
}

/// What the budget did.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct BudgetOutcome {
    /// Groups that wanted a float copy and became INT8-only.
    pub demoted: Vec<GroupId>,
    /// Bytes of the float copies kept.
    pub float_bytes: usize,
    /// Bytes the vocabulary tables take beyond Q8_0 (16-bit tables), served before any
    /// group's copy ([`tables`]).
    pub table_bytes: usize,
    /// The budget in force (the plan's, else the engine's) and in bytes (`None`: unlimited).
    pub setting: FloatBudget,
    pub budget_bytes: Option<usize>,
}

/// How the vocabulary tables are stored under `budget_bytes` (`None`: unlimited) and what
/// they take from it: `setting` as given, or for `auto` f16 when its bytes beyond Q8_0
/// (`extra(f16)`) fit, else Q8_0. They are served before the groups' copies: one table
/// pair is read by every token and its error lands on the logits with nothing after it to
/// dilute it (measured on the bundled model: f16 tables take the first-load plan's KL from
/// 1.5× to 0.3× all-dual f32's for 0.01× all-f16's bytes; on SmolLM2 they do not fit 10 %).
pub fn tables(
    setting: EmbeddingDtype,
    budget_bytes: Option<usize>,
    extra: &dyn Fn(EmbeddingDtype) -> usize,
) -> (EmbeddingDtype, usize) {
    let chosen = match setting {
        EmbeddingDtype::Auto => {
            if budget_bytes.is_none_or(|b| extra(EmbeddingDtype::F16) <= b) {
                EmbeddingDtype::F16
            } else {
                EmbeddingDtype::Q8_0
            }
        }
        fixed => fixed,
    };
    (chosen, extra(chosen))
}

/// Fit the float copies in `residency` into `budget_bytes`. `float_bytes(g)` is what group
/// `g`'s float copy costs; `rank(g)` how deserving it is. Pure; demoted groups become
/// `int8`.
pub fn apply(
    residency: &mut BTreeMap<GroupId, Residency>,
    budget_bytes: Option<usize>,
    float_bytes: &dyn Fn(GroupId) -> usize,
    rank: &dyn Fn(GroupId) -> Rank,
) -> BudgetOutcome {
    let mut wanting: Vec<GroupId> = residency
        .iter()
        .filter(|(_, r)| r.has_float())
        .map(|(g, _)| *g)
        .collect();
    let mut out = BudgetOutcome {
        budget_bytes,
        ..Default::default()
    };
    let Some(budget) = budget_bytes else {
        out.float_bytes = wanting.iter().map(|g| float_bytes(*g)).sum();
        return out;
    };
    // Highest rank first; ties in layer order (stable sort over the BTreeMap order).
    wanting.sort_by(|a, b| {
        rank(*b)
            .partial_cmp(&rank(*a))
            .unwrap_or(std::cmp::Ordering::Equal)
    });
    for g in wanting {
        let cost = float_bytes(g);
        if out.float_bytes + cost <= budget {
            out.float_bytes += cost;
        } else {
            residency.insert(g, Residency::Int8);
            out.demoted.push(g);
        }
    }
    out.demoted.sort();
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use quantmesh_types::GroupKind;

    #[test]
    fn budgets_parse() {
        assert_eq!("10%".parse(), Ok(FloatBudget::Percent(10.0)));
        assert_eq!(FloatBudget::Percent(10.0).to_string(), "10%");
        assert_eq!("64MiB".parse(), Ok(FloatBudget::Bytes(64 << 20)));
        assert_eq!("1000".parse(), Ok(FloatBudget::Bytes(1000)));
        assert_eq!("unlimited".parse(), Ok(FloatBudget::Unlimited));
        assert!("ten".parse::<FloatBudget>().is_err());
        assert!("-5%".parse::<FloatBudget>().is_err());
        assert_eq!(FloatBudget::Percent(10.0).bytes(1000), Some(100));
    }

    fn gid(i: usize) -> GroupId {
        GroupId::new(i / 4, GroupKind::ALL[i % 4])
    }

    proptest! {
        /// For any plan, sizes, ranks and budget: the kept float copies fit, only groups
        /// that wanted a float copy are demoted, and no demoted group would have fitted
        /// in what was left (greedy in rank order).
        #[test]
        fn budget_is_respected(
            plan in proptest::collection::vec((0u8..3, 1usize..5000, 0u32..100), 1..40),
            budget in 0usize..60_000,
        ) {
            let mut residency = BTreeMap::new();
            let mut sizes = BTreeMap::new();
            let mut ranks = BTreeMap::new();
            for (i, (r, size, kl)) in plan.iter().enumerate() {
                let g = gid(i);
                residency.insert(g, [Residency::Int8, Residency::Dual, Residency::Float][*r as usize]);
                sizes.insert(g, *size);
                ranks.insert(g, Rank { tier: 1, wanted: 0.0, act8: 0.0, kl: *kl as f64, r: 0.0 });
            }
            let before = residency.clone();
            let out = apply(&mut residency, Some(budget), &|g| sizes[&g], &|g| ranks[&g]);
            let kept: usize = residency.iter().filter(|(_, r)| r.has_float()).map(|(g, _)| sizes[g]).sum();
            prop_assert!(kept <= budget);
            prop_assert_eq!(kept, out.float_bytes);
            for g in &out.demoted {
                prop_assert!(before[g].has_float());
                prop_assert_eq!(residency[g], Residency::Int8);
                // It did not fit when its turn came; at the end even less room is left.
                prop_assert!(sizes[g] > budget - out.float_bytes);
            }
            for (g, r) in &residency {
                if !out.demoted.contains(g) {
                    prop_assert_eq!(*r, before[g]);
                }
            }
        }
    }

    #[test]
    fn higher_kl_keeps_its_copy() {
        let mut residency = BTreeMap::new();
        for i in 0..3 {
            residency.insert(gid(i), Residency::Dual);
        }
        let kl = [0.01, 0.5, 0.1];
        let out = apply(&mut residency, Some(100), &|_| 60, &|g| Rank {
            tier: 1,
            wanted: 0.0,
            act8: 0.0,
            kl: kl[g.kind.index()],
            r: 0.0,
        });
        assert_eq!(out.demoted, vec![gid(0), gid(2)]);
        assert_eq!(residency[&gid(1)], Residency::Dual);
        assert_eq!(out.float_bytes, 60);
    }
}
