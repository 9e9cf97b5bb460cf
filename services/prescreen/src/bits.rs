//! Bits under a byte target: which linear groups take 4 bits and which 8, so that the
//! resident weights fit a budget with the least predicted quality loss.
//!
//! Each group has two forms with measured costs: its bytes in 4 bits (`q4_s8`) and in 8
//! (Q8_0), and the error each form adds to the residual stream, measured by the pre-screen
//! after the rest of the group's layer half (so a group whose error the next group amplifies
//! pays for it). The vocabulary tables are one more candidate with the same two forms
//! (their error measured on the lookup and on the logits, `tables`). Everything else
//! resident (norms, `fp16` groups, the float copies' reserve) is fixed and comes off the top. Starting from every group in 4 bits, raising a group to 8 costs its extra
//! bytes and gains its error difference; which raises to make is a 0/1 knapsack over the slack,
//! solved exactly by dynamic programming over byte units (each raise's bytes rounded *up* to
//! a unit, so the chosen plan never exceeds the budget; at most 4 096 units, so a unit is a
//! small fraction of the slack). The sum of per-group errors is the predicted loss: the
//! pre-screen measures each group alone, and the plan's real effect is measured on held-out
//! text by `quantmesh-engine-bench --memory-table`.

/// One group's two forms.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Candidate {
    pub bytes4: u64,
    pub bytes8: u64,
    /// Predicted loss (the error the group adds to the residual stream) in 4 and in 8 bits.
    pub loss4: f64,
    pub loss8: f64,
}

/// The bits chosen for a group.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Bits {
    Four,
    Eight,
}

/// The plan the knapsack chose.
#[derive(Debug, Clone, PartialEq)]
pub struct Choice {
    pub bits: Vec<Bits>,
    /// Bytes of the groups in their chosen forms.
    pub bytes: u64,
    /// Σ of the chosen forms' losses.
    pub loss: f64,
}

/// Why no plan fits.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error(
    "weight_budget of {budget} bytes is below the smallest plan: every group in 4 bits takes \
     {minimum} bytes with the rest of the weights (the vocabulary tables in 4 bits too where \
     their width has that form)"
)]
pub struct BelowMinimum {
    pub budget: u64,
    pub minimum: u64,
}

/// Units the slack is divided into (the knapsack's table has one column per unit).
const UNITS: u64 = 4096;

/// A loss the knapsack can compare (a non-finite KL: the worst there is, kept finite so sums
/// stay ordered).
fn finite(v: f64) -> f64 {
    if v.is_finite() {
        v.max(0.0)
    } else {
        1e12
    }
}

/// The bits minimising Σ loss with Σ bytes + `fixed` ≤ `budget`.
pub fn choose(groups: &[Candidate], fixed: u64, budget: u64) -> Result<Choice, BelowMinimum> {
    let base: u64 = groups.iter().map(|g| g.bytes4).sum();
    let minimum = base + fixed;
    if minimum > budget {
        return Err(BelowMinimum { budget, minimum });
    }
    let slack = budget - minimum;
    // The raises worth making: they gain, and cost bytes (a free raise is simply taken).
    let mut bits = vec![Bits::Four; groups.len()];
    let mut items = Vec::new();
    for (i, g) in groups.iter().enumerate() {
        let gain = finite(g.loss4) - finite(g.loss8);
        let cost = g.bytes8.saturating_sub(g.bytes4);
        if gain > 0.0 && cost == 0 {
            bits[i] = Bits::Eight;
        } else if gain > 0.0 {
            items.push((i, cost, gain));
        }
    }
    if items.iter().map(|&(_, c, _)| c).sum::<u64>() <= slack {
        items.iter().for_each(|&(i, _, _)| bits[i] = Bits::Eight);
    } else {
        let unit = slack.div_ceil(UNITS).max(1);
        let cap = (slack / unit) as usize;
        // best[c]: the largest gain within c units; took[k][c]: item k raised at c.
        let mut best = vec![0f64; cap + 1];
        let mut took = vec![vec![false; cap + 1]; items.len()];
        for (k, &(_, cost, gain)) in items.iter().enumerate() {
            let w = cost.div_ceil(unit) as usize;
            if w > cap {
                continue;
            }
            for c in (w..=cap).rev() {
                let with = best[c - w] + gain;
                if with > best[c] {
                    best[c] = with;
                    took[k][c] = true;
                }
            }
        }
        let mut c = cap;
        for (k, &(i, cost, _)) in items.iter().enumerate().rev() {
            if took[k][c] {
                bits[i] = Bits::Eight;
                c -= cost.div_ceil(unit) as usize;
            }
        }
    }
    let (mut bytes, mut loss) = (0u64, 0f64);
    for (g, b) in groups.iter().zip(&bits) {
        let (by, l) = match b {
            Bits::Four => (g.bytes4, g.loss4),
            Bits::Eight => (g.bytes8, g.loss8),
        };
        bytes += by;
        loss += finite(l);
    }
    Ok(Choice { bits, bytes, loss })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use proptest::prelude::*;

    fn candidate() -> impl Strategy<Value = Candidate> {
        (1u64..5_000_000, 0.0f64..1.0, 0.0f64..0.2, 1.6f64..2.4).prop_map(
            |(bytes4, loss4, share, ratio)| Candidate {
                bytes4,
                bytes8: (bytes4 as f64 * ratio) as u64,
                loss4,
                loss8: loss4 * share,
            },
        )
    }

    /// Every subset of raises: the best loss within the budget.
    fn brute_force(groups: &[Candidate], fixed: u64, budget: u64) -> f64 {
        let mut best = f64::INFINITY;
        for mask in 0u32..1 << groups.len() {
            let (mut bytes, mut loss) = (fixed, 0.0);
            for (i, g) in groups.iter().enumerate() {
                let eight = mask & (1 << i) != 0;
                bytes += if eight { g.bytes8 } else { g.bytes4 };
                loss += if eight { g.loss8 } else { g.loss4 };
            }
            if bytes <= budget {
                best = best.min(loss);
            }
        }
        best
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]
        /// Never over the budget; below the minimum, an error naming both numbers; else at
        /// least as good as every-group-in-4-bits and close to the best subset.
        #[test]
        fn never_exceeds_the_budget(
            groups in prop::collection::vec(candidate(), 0..12),
            fixed in 0u64..10_000_000,
            share in 0.0f64..1.3,
        ) {
            let min: u64 = fixed + groups.iter().map(|g| g.bytes4).sum::<u64>();
            let max: u64 = fixed + groups.iter().map(|g| g.bytes8.max(g.bytes4)).sum::<u64>();
            let budget = (min as f64 * 0.9 + (max - min) as f64 * share) as u64;
            match choose(&groups, fixed, budget) {
                Err(e) => {
                    prop_assert!(min > budget);
                    prop_assert_eq!(e, BelowMinimum { budget, minimum: min });
                }
                Ok(c) => {
                    prop_assert!(c.bytes + fixed <= budget, "{} + {fixed} > {budget}", c.bytes);
                    prop_assert_eq!(c.bits.len(), groups.len());
                    let all4: f64 = groups.iter().map(|g| g.loss4).sum();
                    prop_assert!(c.loss <= all4 + 1e-9);
                    prop_assert!(c.loss >= brute_force(&groups, fixed, budget) - 1e-9);
                    // Exact up to the rounding of each raise to a unit: as good as the best
                    // plan for a budget `n` units smaller (every such plan fits the table).
                    let unit = (budget - min).div_ceil(UNITS).max(1);
                    let smaller = budget.saturating_sub(groups.len() as u64 * unit).max(min);
                    let best = brute_force(&groups, fixed, smaller);
                    prop_assert!(c.loss <= best + 1e-9, "{} vs {best}", c.loss);
                }
            }
        }
    }

    #[test]
    fn a_budget_that_holds_everything_raises_every_group_and_one_below_raises_the_best() {
        let g = |bytes4, loss4| Candidate {
            bytes4,
            bytes8: 2 * bytes4,
            loss4,
            loss8: 0.0,
        };
        let groups = [g(100, 1.0), g(100, 5.0), g(300, 6.0)];
        let all = choose(&groups, 50, 50 + 1000).unwrap();
        assert_eq!(all.bits, [Bits::Eight; 3]);
        assert_eq!(all.bytes, 1000);
        // 200 bytes of slack: the two small groups (gain 6) beat the large one (gain 6 for
        // 300 bytes, which does not fit).
        let some = choose(&groups, 50, 50 + 500 + 200).unwrap();
        assert_eq!(some.bits, [Bits::Eight, Bits::Eight, Bits::Four]);
        assert_eq!(some.loss, 6.0);
        // 300 bytes: the large one alone (gain 6) ties the two small (gain 6) plus nothing;
        // either way the loss is 6 and the bytes fit.
        let tie = choose(&groups, 50, 50 + 500 + 300).unwrap();
        assert_eq!(tie.loss, 6.0);
        assert!(tie.bytes <= 800);
        assert_eq!(
            choose(&groups, 50, 549),
            Err(BelowMinimum {
                budget: 549,
                minimum: 550
            })
        );
    }
}
