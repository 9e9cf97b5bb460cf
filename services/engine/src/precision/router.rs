//! [`MaskRouter`]: the fallback mask turned into per-group row paths for one pass — the
//! one place a backend's questions ("which rows of this group in float?", "this layer's
//! KV in INT8?", "which rows need `gate_up` again in float?") are answered.

use crate::backend::{GroupOutcome, Router, RowPath};
use crate::error::Result;
use crate::kv::SeqId;
use crate::precision::mask::PathMask;
use crate::precision::probe::{observe_rows, GroupObs};
use candle_core::Tensor;
use quantmesh_types::{GroupId, GroupKind};
use std::time::Instant;

/// Routes one pass of one step under one mask snapshot, and collects what the pass saw.
pub struct MaskRouter<'a> {
    mask: &'a PathMask,
    rows: Vec<(SeqId, usize)>,
    /// Whether the cache stores new K/V in INT8 at all (`engine.kv_int8`).
    kv_int8: bool,
    /// The shadow pass's reference: every group on [`RowPath::Reference`].
    reference: bool,
    pub obs: Vec<GroupObs>,
    pub outcomes: Vec<(GroupId, GroupOutcome)>,
    pub non_finite: bool,
    pub mask_check_ns: u64,
    pub stats_ns: u64,
}

impl<'a> MaskRouter<'a> {
    pub fn new(mask: &'a PathMask, rows: Vec<(SeqId, usize)>, kv_int8: bool) -> Self {
        Self {
            mask,
            rows,
            kv_int8,
            reference: false,
            obs: Vec::new(),
            outcomes: Vec::new(),
            non_finite: false,
            mask_check_ns: 0,
            stats_ns: 0,
        }
    }

    /// Route every group to [`RowPath::Reference`] (the shadow pass's float reference).
    pub fn reference(mut self) -> Self {
        self.reference = true;
        self
    }

    /// Which rows of the step take the float path through group `g` by the mask alone.
    fn mask_path(&self, g: GroupId) -> RowPath {
        let mask = self.mask;
        if mask.float_batch || mask.float_groups.contains(&g) {
            return RowPath::AllFloat;
        }
        let tokens = mask.float_tokens.get(&g);
        if mask.float_requests.is_empty() && tokens.is_none_or(|t| t.is_empty()) {
            return RowPath::AllInt8;
        }
        let float: Vec<usize> = self
            .rows
            .iter()
            .enumerate()
            .filter(|(_, (s, p))| {
                mask.float_requests.contains(s) || tokens.is_some_and(|t| t.contains(&(*s, *p)))
            })
            .map(|(i, _)| i)
            .collect();
        if float.is_empty() {
            RowPath::AllInt8
        } else {
            RowPath::FloatRows(float)
        }
    }
}

/// Add per-token float rows to a path.
fn with_token_rows(path: RowPath, extra: &[usize]) -> RowPath {
    if extra.is_empty() {
        return path;
    }
    match path {
        RowPath::AllFloat => RowPath::AllFloat,
        RowPath::Reference => RowPath::Reference,
        RowPath::AllInt8 => RowPath::FloatRows(extra.to_vec()),
        RowPath::FloatRows(mut v) => {
            v.extend_from_slice(extra);
            v.sort_unstable();
            v.dedup();
            RowPath::FloatRows(v)
        }
    }
}

impl Router for MaskRouter<'_> {
    /// Measure the group's input (when monitored), then choose its row path: the mask's
    /// rows plus the rows above the per-token bound.
    fn route(&mut self, g: GroupId, input: &Tensor) -> Result<RowPath> {
        if self.reference {
            return Ok(RowPath::Reference);
        }
        let det = self
            .mask
            .detector
            .as_ref()
            .and_then(|d| d.groups.get(&g).map(|gd| (d, gd)));
        let obs = match det {
            Some((d, gd)) => {
                let t = Instant::now();
                let (obs, bad) = observe_rows(g, gd, input, &self.rows, &d.skip_positions)?;
                self.stats_ns += t.elapsed().as_nanos() as u64;
                self.non_finite |= bad;
                Some(obs)
            }
            None => None,
        };
        let t = Instant::now();
        let mut path = self.mask_path(g);
        if let Some(o) = &obs {
            path = with_token_rows(path, &o.token_float_rows);
        }
        self.mask_check_ns += t.elapsed().as_nanos() as u64;
        self.obs.extend(obs);
        Ok(path)
    }

    /// MLP coupling per token: `down`'s input is `silu(gate)·up`, so rows routed to float at
    /// `down` by the per-token bound get `gate_up` recomputed in float (the spike is a
    /// product of it) — unless `gate_up` already runs in float for every row.
    fn coupled_gate_up_rows(&mut self, layer: usize) -> Vec<usize> {
        let down = GroupId::new(layer, GroupKind::Down);
        let gate_up = GroupId::new(layer, GroupKind::GateUp);
        if self.mask.float_batch || self.mask.float_groups.contains(&gate_up) {
            return Vec::new();
        }
        self.obs
            .last()
            .filter(|o| o.group == down)
            .map(|o| o.token_float_rows.clone())
            .unwrap_or_default()
    }

    fn kv_int8(&self, layer: usize) -> bool {
        self.kv_int8 && !self.mask.kv_float_layers.contains(&layer)
    }

    fn record(&mut self, g: GroupId, outcome: GroupOutcome) {
        self.outcomes.push((g, outcome));
    }
}
