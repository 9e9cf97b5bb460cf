//! The monitor's evaluation suite, small configuration: the first three checkpoints of
//! planted-truth family 2, which the monitor was not built on — a clean one (f32, three
//! massive channels), one with one sensitive MLP (f16, hidden 192, six layers), one with two
//! (bf16 in two shards, four *equal* massive channels) — 200 ordinary requests each. It
//! guards what the full runs measured (docs/MEASUREMENTS.md's table, where family 11 still shows
//! heavy-tailed-weight false fallbacks).
//! The full family is `cargo run --release -p quantmesh-engine-tools --bin quantmesh-monitor-eval`.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use quantmesh_engine_tools::{run_case, table, EvalOptions};
use quantmesh_model::recipe::Recipe;

#[actix_rt::test]
async fn monitor_finds_planted_groups_only_on_models_it_was_not_built_on() {
    let opts = EvalOptions::default();
    let root = tempfile::tempdir().unwrap();
    let mut cases = Vec::new();
    for r in Recipe::family(2, 3) {
        cases.push(
            run_case(&root.path().join(&r.name), &r, &opts)
                .await
                .unwrap(),
        );
    }
    eprintln!("{}", table(&cases));
    let clean = &cases[0];
    assert!(clean.planted_sensitive.is_empty());
    assert!(clean.windows >= 10, "{} windows", clean.windows);
    assert_eq!(clean.false_fallbacks(), 0, "{:?}", clean.fell_back);
    for c in &cases[1..] {
        assert!(!c.planted_sensitive.is_empty());
        let found = format!(
            "{}: fell back {:?}, expected {:?}",
            c.name, c.fell_back, c.expected
        );
        assert_eq!(c.recall(), 1.0, "{found}");
        assert_eq!(c.precision(), 1.0, "{found}");
        // The planted truth is real (the planted groups in float remove most of the INT8
        // damage), and so does falling back where the monitor did.
        let kl = format!(
            "{}: KL INT8 {}, oracle {}, monitor {}",
            c.name, c.kl_int8, c.kl_oracle, c.kl_monitor
        );
        assert!(c.kl_oracle < 0.5 * c.kl_int8, "{kl}");
        assert!(c.kl_monitor < 0.5 * c.kl_int8, "{kl}");
    }
    for c in &cases {
        assert!(!c.massive_planted.is_empty());
        assert_eq!(
            c.massive_found_groups, c.residual_groups,
            "{}: planted {:?}, first group learned {:?}",
            c.name, c.massive_planted, c.massive_found
        );
    }
}
