//! The fallback mask: which path every layer group, token, request and batch takes.
//!
//! Published as an immutable snapshot through `arc-swap`: writers (the activation monitor,
//! admin routes, tests) build a new snapshot and swap it in; the executor loads it once
//! per step, so a decision takes effect at the next step and a step never sees a
//! half-applied mask.

use crate::backend::ColumnError;
use crate::kv::SeqId;
use arc_swap::ArcSwap;
use quantmesh_types::GroupId;
use std::collections::{BTreeSet, HashMap, HashSet};
use std::sync::Arc;

/// What the executor needs to compute the monitor's statistics and the per-token bound.
#[derive(Debug, Clone, Default)]
pub struct GroupDetector {
    /// Input channels left out of the statistic (massive fixed channels).
    pub excluded_channels: Vec<usize>,
    /// Rows whose statistic exceeds this run this group in float in the same step
    /// (`f32::INFINITY` until the group is warmed up).
    pub token_bound: f32,
    /// Report each row's massive channels (warm-up, learning the massive channels).
    pub learn_channels: bool,
    /// A channel is massive in a row above this multiple of the row's median magnitude
    /// (`quantmesh_model::massive`).
    pub massive_ratio: f32,
    /// What the group's quantized weights do to each input column: with it, each row's
    /// output noise-to-signal ratio on the quantized path is measured too (the harm
    /// statistic).
    pub column_error: Option<Arc<ColumnError>>,
}

/// Equal fields; the column errors (two floats per input column, compared each time the
/// monitor publishes) are taken as equal without reading them when both sides share one
/// table, as they do while the group's weights stay the same.
impl PartialEq for GroupDetector {
    fn eq(&self, other: &Self) -> bool {
        // Destructured so that a new field cannot be left out of the comparison.
        let GroupDetector {
            excluded_channels,
            token_bound,
            learn_channels,
            massive_ratio,
            column_error,
        } = self;
        same_column_error(column_error.as_ref(), other.column_error.as_ref())
            && *excluded_channels == other.excluded_channels
            && *token_bound == other.token_bound
            && *learn_channels == other.learn_channels
            && *massive_ratio == other.massive_ratio
    }
}

/// Two groups' column errors are the same: one shared table (read no further), or equal
/// tables, or none on both sides.
pub fn same_column_error(a: Option<&Arc<ColumnError>>, b: Option<&Arc<ColumnError>>) -> bool {
    match (a, b) {
        (Some(a), Some(b)) => Arc::ptr_eq(a, b) || a == b,
        (None, None) => true,
        _ => false,
    }
}

#[derive(Debug, Clone, Default, PartialEq)]
pub struct DetectorParams {
    pub groups: std::collections::BTreeMap<GroupId, GroupDetector>,
    /// Positions whose rows are never measured (attention sinks).
    pub skip_positions: Vec<usize>,
    /// Fraction of steps that also compute float-path logits (shadow KL).
    pub shadow_sample_rate: f64,
}

#[derive(Debug, Clone, Default, PartialEq)]
pub struct PathMask {
    /// Per-layer granularity: groups that run their float path for every row.
    pub float_groups: BTreeSet<GroupId>,
    /// Layers whose KV cache takes new tokens in float.
    pub kv_float_layers: BTreeSet<usize>,
    /// Per-token granularity: (sequence, absolute position) rows computed in float in a group.
    pub float_tokens: HashMap<GroupId, HashSet<(SeqId, usize)>>,
    /// Per-request granularity: every remaining token of these sequences runs in float.
    pub float_requests: HashSet<SeqId>,
    /// Per-batch granularity (last resort): the whole step runs in float.
    pub float_batch: bool,
    /// Bumped by every publish; reported with step results.
    pub version: u64,
    /// Activation monitoring parameters; `None` = monitoring off.
    pub detector: Option<Arc<DetectorParams>>,
}

impl PathMask {
    /// Every linear group of a `num_layers`-layer model on its float path (the reference
    /// the INT8 path is measured against).
    pub fn all_groups_float(num_layers: usize) -> Self {
        let mut m = PathMask::default();
        for l in 0..num_layers {
            for k in quantmesh_types::GroupKind::ALL {
                m.float_groups.insert(GroupId::new(l, k));
            }
        }
        m
    }

    /// These groups on their float path for every row, and their layers' KV cache taking
    /// new tokens in float — what a layer fallback does (`Monitor::apply_to`).
    pub fn with_float_groups(groups: impl IntoIterator<Item = GroupId>) -> Self {
        let float_groups: BTreeSet<GroupId> = groups.into_iter().collect();
        PathMask {
            kv_float_layers: float_groups.iter().map(|g| g.layer).collect(),
            float_groups,
            ..Default::default()
        }
    }
}

/// Shared handle to the current mask.
#[derive(Debug, Clone, Default)]
pub struct MaskHandle {
    inner: Arc<ArcSwap<PathMask>>,
}

impl MaskHandle {
    pub fn load(&self) -> Arc<PathMask> {
        self.inner.load_full()
    }

    /// Apply `f` to a copy of the current mask and publish it atomically. Only the monitor
    /// actor writes the mask.
    pub(crate) fn update(&self, f: impl Fn(&mut PathMask)) -> Arc<PathMask> {
        let mut published = None;
        self.inner.rcu(|cur| {
            let mut next = PathMask::clone(cur);
            f(&mut next);
            next.version = cur.version + 1;
            let next = Arc::new(next);
            published = Some(next.clone());
            next
        });
        published.unwrap_or_else(|| self.load())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Detectors are equal when their fields are, whether or not they share one column-error
    /// table; a different table, a missing one or another field makes them differ.
    #[test]
    fn detectors_compare_by_value_and_shared_tables_by_pointer() {
        let table = |e: f32| {
            Arc::new(ColumnError {
                error: vec![e, 0.5],
                energy: vec![1.0, 2.0],
            })
        };
        let det = |c: Option<Arc<ColumnError>>| GroupDetector {
            excluded_channels: vec![3],
            token_bound: 2.5,
            learn_channels: false,
            massive_ratio: 20.0,
            column_error: c,
        };
        let shared = table(0.25);
        assert_eq!(det(Some(shared.clone())), det(Some(shared.clone())));
        assert_eq!(det(Some(shared.clone())), det(Some(table(0.25))));
        assert_ne!(det(Some(shared.clone())), det(Some(table(0.75))));
        assert_ne!(det(Some(shared.clone())), det(None));
        assert_eq!(det(None), det(None));
        let mut other = det(Some(shared.clone()));
        other.token_bound = 3.0;
        assert_ne!(det(Some(shared.clone())), other);
        let mut other = det(Some(shared.clone()));
        other.excluded_channels.push(4);
        assert_ne!(det(Some(shared)), other);
    }
}
