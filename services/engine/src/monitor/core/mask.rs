//! What the monitor publishes into the fallback mask: its groups' paths, the request and
//! batch flags, and the detector parameters the executor measures each step with; and the
//! check, made after every step, of whether the published mask still holds all of it.

use super::*;
use crate::precision::{same_column_error, GroupDetector};

impl Monitor {
    /// The detector parameters the executor needs (published inside the mask).
    pub fn detector_params(&self) -> Option<Arc<DetectorParams>> {
        if !self.cfg.enabled {
            return None;
        }
        let groups = self
            .groups
            .iter()
            .map(|(g, s)| {
                (
                    *g,
                    GroupDetector {
                        excluded_channels: s.excluded.clone(),
                        token_bound: s.detector_bound(),
                        learn_channels: self.learning(s),
                        massive_ratio: self.cfg.massive_channel_ratio,
                        column_error: s.detector_columns().cloned(),
                    },
                )
            })
            .collect();
        Some(Arc::new(DetectorParams {
            groups,
            skip_positions: self.cfg.skip_positions.clone(),
            shadow_sample_rate: self.cfg.shadow_sample_rate,
        }))
    }

    /// Only residual-stream readers keep what they learn: the probes measure massive
    /// channels for them alone.
    fn learning(&self, s: &GroupState) -> bool {
        s.residual_input && !s.ready && s.learn_rows < self.cfg.warmup_tokens / 2
    }

    /// Whether `mask` already holds everything [`Monitor::apply_to`] would write into it,
    /// found without building anything (the monitor asks after every step, and almost
    /// always nothing changed).
    pub fn mask_is_current(&self, mask: &PathMask) -> bool {
        let kv_layers_match = self
            .float_copy_layers()
            .all(|l| mask.kv_float_layers.contains(&l))
            && mask
                .kv_float_layers
                .iter()
                .all(|l| self.float_copy_layers().any(|f| f == *l));
        mask.float_groups.iter().eq(self.float_groups())
            && kv_layers_match
            && mask.float_requests == self.float_requests
            && mask.float_batch == self.batch_float
            && self.detector_is_current(mask.detector.as_deref())
    }

    /// The groups whose every row takes its better path, ascending.
    fn float_groups(&self) -> impl Iterator<Item = &GroupId> {
        self.groups
            .iter()
            .filter(|(_, s)| s.in_float())
            .map(|(g, _)| g)
    }

    /// The layers of the groups in fallback on a float copy (their KV cache goes float too;
    /// a split group's rows keep their quantized weights, and its layer's KV stays as it is),
    /// once per such group.
    fn float_copy_layers(&self) -> impl Iterator<Item = usize> + '_ {
        self.groups
            .iter()
            .filter(|(_, s)| s.on_float_copy())
            .map(|(g, _)| g.layer)
    }

    /// [`Monitor::mask_is_current`] for the detector parameters: equal to what
    /// [`Monitor::detector_params`] builds, under the same comparison as theirs.
    fn detector_is_current(&self, published: Option<&DetectorParams>) -> bool {
        let Some(d) = published else {
            return !self.cfg.enabled;
        };
        self.cfg.enabled
            && d.skip_positions == self.cfg.skip_positions
            && d.shadow_sample_rate == self.cfg.shadow_sample_rate
            && d.groups.len() == self.groups.len()
            && self.groups.iter().zip(&d.groups).all(|((g, s), (pg, p))| {
                // Destructured so that a new field cannot be left out of the check.
                let GroupDetector {
                    excluded_channels,
                    token_bound,
                    learn_channels,
                    massive_ratio,
                    column_error,
                } = p;
                g == pg
                    && *excluded_channels == s.excluded
                    && *token_bound == s.detector_bound()
                    && *learn_channels == self.learning(s)
                    && *massive_ratio == self.cfg.massive_channel_ratio
                    && same_column_error(column_error.as_ref(), s.detector_columns())
            })
    }

    /// Write the monitor's decisions into a mask (keeps explicit per-token rows).
    pub fn apply_to(&self, mask: &mut PathMask) {
        mask.float_groups = self.float_groups().copied().collect();
        mask.kv_float_layers = self.float_copy_layers().collect();
        mask.float_requests = self.float_requests.clone();
        mask.float_batch = self.batch_float;
        mask.detector = self.detector_params();
    }
}
