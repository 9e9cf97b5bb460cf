//! The live precision plan: the engine's own configuration overlaid with the
//! `sensitive_layers.json` in force. One pure function, so start-up and hot reload compute
//! the plan the same way and a reload to the same file is a no-op (idempotent).

use crate::config::EngineConfig;
use crate::monitor::{GroupOverride, MonitorConfig};
use quantmesh_types::{GroupId, GroupKind, Residency, ValidatedPlan};
use std::collections::BTreeMap;

/// What the engine runs with.
#[derive(Debug, Clone, PartialEq)]
pub struct LivePlan {
    /// md5 of the `sensitive_layers.json` in force (`None`: engine configuration only).
    pub md5: Option<String>,
    pub monitor: MonitorConfig,
    pub residency: BTreeMap<GroupId, Residency>,
}

/// Overlay `file` on `base`. Precedence, lowest first: `engine.default_residency`,
/// `engine.group_residency`, the file's groups (class → residency, or the explicit
/// `residency`); monitor thresholds: `engine.monitor`, the file's `thresholds`, the file's
/// per-group `monitor` overrides and `massive_channels`.
pub fn resolve(
    base: &EngineConfig,
    num_layers: usize,
    file: Option<(&ValidatedPlan, &str)>,
) -> LivePlan {
    let mut residency = BTreeMap::new();
    for l in 0..num_layers {
        for kind in GroupKind::ALL {
            let g = GroupId::new(l, kind);
            let r = base
                .group_residency
                .get(&g.to_string())
                .copied()
                .unwrap_or(base.default_residency);
            residency.insert(g, r);
        }
    }
    let mut monitor = base.monitor.clone();
    if let Some((plan, _)) = file {
        let t = &plan.file.thresholds;
        let set = |dst: &mut f64, v: Option<f64>| {
            if let Some(v) = v {
                *dst = v;
            }
        };
        set(&mut monitor.k, t.k);
        set(&mut monitor.trigger_rate, t.trigger_rate);
        set(&mut monitor.token_k, t.token_k);
        set(&mut monitor.shadow_sample_rate, t.shadow_sample_rate);
        set(&mut monitor.request_kl_limit, t.request_kl_limit);
        if let Some(w) = t.window_requests {
            monitor.window_requests = w;
        }
        if let Some(w) = t.recovery_windows {
            monitor.recovery_windows = w;
        }
        for (g, entry) in &plan.groups {
            residency.insert(*g, entry.effective_residency());
            let has_override = entry.monitor.is_some() || !entry.massive_channels.is_empty();
            if has_override {
                let o: &mut GroupOverride = monitor.overrides.entry(g.to_string()).or_default();
                if let Some(m) = &entry.monitor {
                    o.k = m.k.or(o.k);
                    o.trigger_rate = m.trigger_rate.or(o.trigger_rate);
                }
                o.massive_channels.extend(&entry.massive_channels);
                o.massive_channels.sort_unstable();
                o.massive_channels.dedup();
            }
        }
    }
    LivePlan {
        md5: file.map(|(_, md5)| md5.to_string()),
        monitor,
        residency,
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use quantmesh_types::{ModelShape, SensitiveLayers};

    fn shape() -> ModelShape {
        ModelShape {
            num_layers: 2,
            hidden_size: 64,
            intermediate_size: 128,
            attn_dim: 64,
            layout_md5: "x".into(),
        }
    }

    #[test]
    fn file_overlays_engine_config() {
        let mut base = EngineConfig::default();
        base.group_residency
            .insert("layers.0.o".into(), Residency::Int8);
        let text = r#"{"schema_version": 1, "thresholds": {"k": 6, "window_requests": 10},
            "groups": {"layers.1.down": {"class": "fp16", "monitor": {"k": 9}},
                       "layers.0.qkv": {"class": "w8a8", "massive_channels": [3, 1]}}}"#;
        let plan = SensitiveLayers::parse_for(text.as_bytes(), &shape()).unwrap();
        let live = resolve(&base, 2, Some((&plan, "m")));
        assert_eq!(live.md5.as_deref(), Some("m"));
        assert_eq!(live.monitor.k, 6.0);
        assert_eq!(live.monitor.window_requests, 10);
        assert_eq!(live.monitor.trigger_rate, base.monitor.trigger_rate);
        assert_eq!(
            live.residency[&"layers.1.down".parse().unwrap()],
            Residency::Float
        );
        assert_eq!(
            live.residency[&"layers.0.qkv".parse().unwrap()],
            Residency::Int8
        );
        assert_eq!(
            live.residency[&"layers.0.o".parse().unwrap()],
            Residency::Int8
        );
        assert_eq!(
            live.residency[&"layers.1.o".parse().unwrap()],
            Residency::Dual
        );
        assert_eq!(live.monitor.overrides["layers.1.down"].k, Some(9.0));
        assert_eq!(
            live.monitor.overrides["layers.0.qkv"].massive_channels,
            vec![1, 3]
        );
        // Without a file: the engine's configuration alone.
        let none = resolve(&base, 2, None);
        assert_eq!(none.monitor, base.monitor);
        assert_eq!(none.residency.len(), 8);
    }
}
