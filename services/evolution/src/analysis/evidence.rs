//! What the proposal rules see: a week's evidence per group, for the shadow KL, and the
//! decision counts, assembled from the evidence tables whichever engine computed them.

use super::tables::{EvidenceTables, Span};
use serde::Serialize;
use std::collections::BTreeMap;

/// One group's week.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct GroupEvidence {
    pub group: String,
    /// Monitor windows that measured this group, and its rows in them.
    pub windows: u64,
    pub tokens: u64,
    pub outliers: u64,
    /// Distribution of the per-window outlier rate.
    pub rate_p50: Option<f64>,
    pub rate_p95: Option<f64>,
    pub rate_max: Option<f64>,
    /// Windows that ended with the group in float, and their share of all windows.
    pub float_windows: u64,
    pub float_share: f64,
    /// Windows in which the group wanted float but holds no float copy.
    pub unavailable_windows: u64,
    /// The residency the engine reported last.
    pub residency: String,
    /// The harm its quantized weights did on the span's traffic: the mean output
    /// noise-to-signal ratio of its rows (the monitor's statistic), token-weighted over the
    /// windows that measured it. `None` when none did.
    pub served_nsr: Option<f64>,
    /// Layer decisions: entries into float, exits, "wanted but unavailable".
    pub enters: u64,
    pub exits: u64,
    pub unavailable: u64,
    /// Per-token decisions (rows routed to float inside a step).
    pub token_decisions: u64,
}

/// Shadow-KL distribution (nats) over the week's samples.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct KlEvidence {
    pub samples: u64,
    pub p50: Option<f64>,
    pub p90: Option<f64>,
    pub p99: Option<f64>,
    pub max: Option<f64>,
    /// Samples at or below the request limit in force ("healthy" traffic) and their 99th
    /// percentile.
    pub healthy_samples: u64,
    pub healthy_p99: Option<f64>,
    /// Samples whose reference lacked some float weights (`partial_float_weights`).
    pub partial_reference: u64,
}

/// A decision count, as `quantmesh_fallback_decisions_total` labels it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct DecisionRow {
    pub group: Option<String>,
    pub granularity: String,
    pub reason: String,
    pub action: String,
    pub count: u64,
}

/// Everything the proposal rules see.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Evidence {
    pub model: String,
    pub since_ms: i64,
    pub until_ms: i64,
    /// The newest window event in the span (what the proposal is stamped with, so that the
    /// same evidence gives the same bytes whenever it is analysed).
    pub last_window_ms: Option<i64>,
    pub windows: u64,
    pub fallback_events: u64,
    pub request_kl_fallbacks: u64,
    pub groups: Vec<GroupEvidence>,
    pub kl: KlEvidence,
    pub decisions: Vec<DecisionRow>,
    /// Config versions applied and rejected in the span.
    pub configs_applied: u64,
    pub configs_rejected: u64,
}

/// A count column as the rules read it (a missing or negative count is 0).
fn count(v: Option<i64>) -> u64 {
    v.unwrap_or(0).max(0) as u64
}

impl Evidence {
    /// The evidence for `model` over `span`, from the rows of the evidence queries.
    pub fn from_tables(model: &str, span: Span, t: &EvidenceTables) -> Evidence {
        let decisions: Vec<DecisionRow> = t
            .decisions
            .iter()
            .map(|d| DecisionRow {
                group: d.group.clone(),
                granularity: d.granularity.clone().unwrap_or_default(),
                reason: d.reason.clone().unwrap_or_default(),
                action: d.action.clone().unwrap_or_default(),
                count: count(d.n),
            })
            .collect();
        let mut by_group: BTreeMap<String, GroupEvidence> = BTreeMap::new();
        for g in &t.groups {
            let Some(name) = g.group.clone() else {
                continue;
            };
            let windows = count(g.windows);
            let float_windows = count(g.float_windows);
            by_group.insert(
                name.clone(),
                GroupEvidence {
                    group: name,
                    windows,
                    tokens: count(g.tokens),
                    outliers: count(g.outliers),
                    rate_p50: g.rate_p50,
                    rate_p95: g.rate_p95,
                    rate_max: g.rate_max,
                    float_windows,
                    float_share: float_windows as f64 / windows.max(1) as f64,
                    unavailable_windows: count(g.unavailable_windows),
                    residency: g.residency.clone().unwrap_or_default(),
                    served_nsr: g.served_nsr.filter(|v| v.is_finite()),
                    ..Default::default()
                },
            );
        }
        let mut fallback_events = 0;
        for d in &decisions {
            fallback_events += d.count;
            let Some(g) = d.group.as_ref().and_then(|g| by_group.get_mut(g)) else {
                continue;
            };
            match (d.granularity.as_str(), d.action.as_str()) {
                ("layer", "enter") => g.enters += d.count,
                ("layer", "exit") => g.exits += d.count,
                ("layer", "unavailable") => g.unavailable += d.count,
                ("token", _) => g.token_decisions += d.count,
                _ => {}
            }
        }
        let kl = t.kl.first().cloned().unwrap_or_default();
        let windows = t.windows.first().cloned().unwrap_or_default();
        let configs = t.configs.first().cloned().unwrap_or_default();
        Evidence {
            model: model.to_string(),
            since_ms: span.since_ms,
            until_ms: span.until_ms,
            last_window_ms: windows.last_ms,
            windows: count(windows.n),
            fallback_events,
            request_kl_fallbacks: count(windows.request_kl),
            groups: by_group.into_values().collect(),
            kl: KlEvidence {
                samples: count(kl.n),
                p50: kl.p50,
                p90: kl.p90,
                p99: kl.p99,
                max: kl.max,
                healthy_samples: count(kl.healthy),
                healthy_p99: t.healthy.first().and_then(|h| h.p99),
                partial_reference: count(kl.partial),
            },
            decisions,
            configs_applied: count(configs.applied),
            configs_rejected: count(configs.rejected),
        }
    }
}
