//! The planted-truth family: a case per recipe, scored against what was planted, and the
//! table of all cases.

use crate::serve::*;
use crate::teacher::*;
use quantmesh_engine::error::{EngineError, Result};
use quantmesh_engine::precision::PathMask;
use quantmesh_model::recipe::{self, Planted, Recipe};
use quantmesh_types::{GroupId, GroupKind};
use std::collections::BTreeSet;
use std::path::Path;

/// What the monitor did on one planted model.
#[derive(Debug, Clone)]
pub struct CaseReport {
    pub name: String,
    /// `h192 i512 l5 6/2 f16 ×2` style summary of the recipe.
    pub shape: String,
    pub planted_sensitive: Vec<String>,
    /// Planted sensitive `down` groups and their coupled `gate_up`.
    pub expected: BTreeSet<String>,
    /// Groups that entered fallback on their outlier rate at any window.
    pub fell_back: BTreeSet<String>,
    /// Groups in float at the end of the run.
    pub final_float: BTreeSet<String>,
    pub windows: u64,
    pub massive_planted: Vec<usize>,
    /// Residual-stream groups (qkv, gate_up) whose learned channels include every planted one.
    pub massive_found_groups: usize,
    /// Channels learned in some residual-stream group that were not planted (emergent:
    /// e.g. an input-invariant value layer 0's attention writes from the planted ones).
    pub massive_extra: Vec<usize>,
    pub residual_groups: usize,
    /// Learned channels of the first `qkv` group (for the table).
    pub massive_found: Vec<usize>,
    /// Mean next-token KL(P_float ‖ P) over the held-out text: INT8 only, the monitor's
    /// final float set, the planted set in float.
    pub kl_int8: f64,
    pub kl_monitor: f64,
    pub kl_oracle: f64,
}

impl CaseReport {
    pub fn true_positives(&self) -> usize {
        self.fell_back.intersection(&self.expected).count()
    }
    pub fn false_fallbacks(&self) -> usize {
        self.fell_back.difference(&self.expected).count()
    }
    /// Share of fallbacks that were planted (1 when nothing fell back).
    pub fn precision(&self) -> f64 {
        if self.fell_back.is_empty() {
            1.0
        } else {
            self.true_positives() as f64 / self.fell_back.len() as f64
        }
    }
    /// Share of planted sensitive `down` groups that fell back (1 when nothing was planted).
    pub fn recall(&self) -> f64 {
        if self.planted_sensitive.is_empty() {
            1.0
        } else {
            let found = self
                .planted_sensitive
                .iter()
                .filter(|g| self.fell_back.contains(*g))
                .count();
            found as f64 / self.planted_sensitive.len() as f64
        }
    }
}

fn shape(r: &Recipe) -> String {
    let massive: Vec<String> = r
        .massive
        .iter()
        .map(|(c, m)| format!("{c}:{m:.0}"))
        .collect();
    format!(
        "h{} i{} l{} {}/{} {} ×{}, massive [{}]",
        r.hidden,
        r.intermediate,
        r.layers,
        r.heads,
        r.kv_heads,
        r.dtype,
        r.shards.max(1),
        massive.join(" ")
    )
}

/// Write `r` under `dir`, serve it with `opts`, and score the monitor.
pub async fn run_case(dir: &Path, r: &Recipe, opts: &EvalOptions) -> Result<CaseReport> {
    let planted: Planted = recipe::write(dir, r, &recipe::card(r))?;
    let observed = observe(dir, &r.name, opts, false).await?;
    let final_float = observed.final_float();
    let Observed { report, fell_back } = observed;
    let expected: BTreeSet<GroupId> = r
        .sensitive
        .iter()
        .flat_map(|&l| {
            [
                GroupId::new(l, GroupKind::Down),
                GroupId::new(l, GroupKind::GateUp),
            ]
        })
        .collect();
    let mut want_massive = planted.massive_channels.clone();
    want_massive.sort_unstable();
    let residual: Vec<_> = report
        .groups
        .iter()
        .filter(|g| {
            g.group
                .parse::<GroupId>()
                .is_ok_and(|id| matches!(id.kind, GroupKind::Qkv | GroupKind::GateUp))
        })
        .collect();
    let massive_found_groups = residual
        .iter()
        .filter(|g| want_massive.iter().all(|c| g.excluded_channels.contains(c)))
        .count();
    let massive_extra: Vec<usize> = residual
        .iter()
        .flat_map(|g| g.excluded_channels.iter().copied())
        .filter(|c| !want_massive.contains(c))
        .collect::<BTreeSet<_>>()
        .into_iter()
        .collect();
    let massive_found = residual
        .first()
        .map(|g| g.excluded_channels.clone())
        .unwrap_or_default();

    let (kl_int8, kl_monitor, kl_oracle) = {
        let dir = dir.to_path_buf();
        let masks = [
            PathMask::default(),
            PathMask::with_float_groups(final_float.iter().copied()),
            PathMask::with_float_groups(expected.iter().copied()),
        ];
        let (class, split) = (opts.class, opts.split);
        let kls =
            tokio::task::spawn_blocking(move || teacher_forced_kl(&dir, class, split, &masks))
                .await
                .map_err(|e| EngineError::Config(format!("KL task: {e}")))??;
        (kls[0], kls[1], kls[2])
    };
    let names = |set: &BTreeSet<GroupId>| set.iter().map(|g| g.to_string()).collect();
    Ok(CaseReport {
        name: r.name.clone(),
        shape: shape(r),
        planted_sensitive: planted.sensitive_groups.clone(),
        expected: names(&expected),
        fell_back,
        final_float: names(&final_float),
        windows: report.windows_completed,
        massive_planted: want_massive,
        massive_found_groups,
        massive_extra,
        residual_groups: residual.len(),
        massive_found,
        kl_int8,
        kl_monitor,
        kl_oracle,
    })
}

/// The suite's table (markdown).
pub fn table(cases: &[CaseReport]) -> String {
    let mut s = String::from(
        "| model | shape | planted | fell back | P | R | false | windows | massive planted (groups with all) | extra learned | KL INT8 | KL monitor | KL oracle |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|\n",
    );
    let join = |v: &BTreeSet<String>| {
        if v.is_empty() {
            "—".to_string()
        } else {
            v.iter().cloned().collect::<Vec<_>>().join(", ")
        }
    };
    for c in cases {
        s += &format!(
            "| {} | {} | {} | {} | {:.2} | {:.2} | {} | {} | {:?} ({}/{}) | {:?} | {:.5} | {:.5} | {:.5} |\n",
            c.name,
            c.shape,
            if c.planted_sensitive.is_empty() {
                "—".into()
            } else {
                c.planted_sensitive.join(", ")
            },
            join(&c.fell_back),
            c.precision(),
            c.recall(),
            c.false_fallbacks(),
            c.windows,
            c.massive_planted,
            c.massive_found_groups,
            c.residual_groups,
            c.massive_extra,
            c.kl_int8,
            c.kl_monitor,
            c.kl_oracle,
        );
    }
    let clean: Vec<_> = cases
        .iter()
        .filter(|c| c.planted_sensitive.is_empty())
        .collect();
    let planted: Vec<_> = cases
        .iter()
        .filter(|c| !c.planted_sensitive.is_empty())
        .collect();
    let mean = |v: &[&CaseReport], f: &dyn Fn(&CaseReport) -> f64| {
        v.iter().map(|c| f(c)).sum::<f64>() / v.len().max(1) as f64
    };
    s += &format!(
        "\n{} models ({} clean, {} planted): mean precision {:.2}, mean recall {:.2}, false fallbacks on clean models {} over {} windows, on planted models {}; every planted massive channel learned in {}/{} residual groups.\n",
        cases.len(),
        clean.len(),
        planted.len(),
        mean(&planted, &|c| c.precision()),
        mean(&planted, &|c| c.recall()),
        clean.iter().map(|c| c.false_fallbacks()).sum::<usize>(),
        clean.iter().map(|c| c.windows).sum::<u64>(),
        planted.iter().map(|c| c.false_fallbacks()).sum::<usize>(),
        cases.iter().map(|c| c.massive_found_groups).sum::<usize>(),
        cases.iter().map(|c| c.residual_groups).sum::<usize>(),
    );
    s
}
