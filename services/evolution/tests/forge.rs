//! From the lake to a pull request: a real bare git repository on disk receives the branch,
//! and a local HTTP stub of the GitHub REST API (test code only: no git forge server is
//! installable from our registries) checks every request — method, path, auth header,
//! body fields. The same evidence never opens a second pull request; newer evidence updates
//! the open one's branch and body.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use quantmesh_testkit::forge_stub::{self, start_stub};
use quantmesh_testkit::git_http::{self, git};

use quantmesh_evolution::analysis::Span;
use quantmesh_evolution::forge::{ForgeKind, PrOutcome};
use quantmesh_evolution::ingest::{Consumed, Writer};
use quantmesh_evolution::lake::Lake;
use quantmesh_evolution::run::{run_once, EvidenceSource};
use quantmesh_evolution::EvolutionSettings;
use quantmesh_kafka::KafkaSettings;
use quantmesh_types::{WindowEvent, WindowGroup};
use std::path::Path;
use std::sync::Arc;

const T0: u64 = 1_790_000_000_000;

/// A bare repository whose `main` holds a plan with `layers.1.down` INT8-only.
fn plan_repo(root: &Path) -> String {
    git_http::plan_repo(
        root,
        r#"{"schema_version": 1, "groups": {"layers.1.down": {"class": "w8a8"}}}"#,
    )
    .display()
    .to_string()
}

/// 40 windows: `layers.1.down` (INT8-only) wanted float in every other one; `kl` per window.
async fn fill_lake(lake: &Arc<Lake>, from: i64, kl: f64) {
    let settings = KafkaSettings::default();
    let mut w = Writer::new(lake.clone(), settings.clone(), 10_000, None);
    lake.sweep().await.unwrap();
    let recs: Vec<Consumed> = (from..from + 40)
        .map(|i| {
            let ev = WindowEvent {
                schema_version: 1,
                event_id: format!("w{i}"),
                timestamp_ms: T0 + i as u64 * 1000,
                duration_ms: 1000,
                model: "tiny".into(),
                window: i as u64,
                config_md5: None,
                groups: vec![WindowGroup {
                    group: "layers.1.down".into(),
                    tokens: 500,
                    outliers: 20,
                    in_float: false,
                    wanted_unavailable: i % 2 == 0,
                    residency: "int8".into(),
                    mean_nsr: None,
                }],
                shadow_kl: vec![kl; 10],
                shadow_kl_seen: 10,
                kl_reference: None,
                request_kl_fallbacks: 0,
            };
            Consumed {
                topic: settings.window_topic.clone(),
                partition: 0,
                offset: i,
                event_type: Some("window".into()),
                payload: Ok(serde_json::to_string(&ev).unwrap()),
            }
        })
        .collect();
    w.write_batch(&recs).await.unwrap();
}

#[tokio::test]
async fn evidence_becomes_one_pull_request_and_newer_evidence_updates_it() {
    let root = tempfile::tempdir().unwrap();
    let remote = plan_repo(root.path());
    let (api, stub) = start_stub().await;
    std::env::set_var("EVOLVE_FORGE_TEST_TOKEN", "s3cret");
    let lake = Arc::new(Lake::open(root.path().join("lake").to_str().unwrap()).unwrap());
    fill_lake(&lake, 0, 0.004).await;

    let mut s = EvolutionSettings {
        model: "tiny".into(),
        ..Default::default()
    };
    s.git.remote = remote.clone();
    s.git.checkout = root.path().join("checkout");
    s.forge.kind = ForgeKind::Github;
    s.forge.api_url = api.clone();
    s.forge.repository = "acme/plans".into();
    s.forge.token_env = "EVOLVE_FORGE_TEST_TOKEN".into();
    let span = Span {
        since_ms: T0 as i64,
        until_ms: T0 as i64 + 3_600_000,
    };

    // Dry run: a proposal, nothing pushed, nothing asked of the forge.
    let (report, _) = run_once(&s, EvidenceSource::Lake { lake: &lake, span }, true, None)
        .await
        .unwrap();
    assert!(report.outcome.is_none());
    let fields: Vec<_> = report
        .proposal
        .changes
        .iter()
        .map(|c| c.field.as_str())
        .collect();
    assert_eq!(
        fields,
        ["thresholds.request_kl_limit", "residency"],
        "{:?}",
        report.proposal.changes
    );
    assert!(stub.lock().unwrap().requests.is_empty());

    // First real run: branch pushed, PR opened and labelled.
    let (report, _) = run_once(&s, EvidenceSource::Lake { lake: &lake, span }, false, None)
        .await
        .unwrap();
    let Some(PrOutcome::Opened { branch, number, .. }) = report.outcome.clone() else {
        panic!("{:?}", report.outcome)
    };
    assert_eq!((branch.as_str(), number), ("quantmesh/evolve/tiny", 1));
    let shown = git(
        Path::new(&remote),
        &["show", "quantmesh/evolve/tiny:sensitive_layers.json"],
    );
    let plan: serde_json::Value = serde_json::from_str(&shown).unwrap();
    assert_eq!(plan["groups"]["layers.1.down"]["residency"], "dual");
    assert_eq!(plan["thresholds"]["request_kl_limit"], 0.006);
    {
        let st = stub.lock().unwrap();
        let methods: Vec<_> = st
            .requests
            .iter()
            .map(|r| (r.method.as_str(), r.path.split('?').next().unwrap()))
            .collect();
        assert_eq!(
            methods,
            [
                ("GET", "/repos/acme/plans/pulls"),
                ("POST", "/repos/acme/plans/pulls"),
                ("POST", "/repos/acme/plans/issues/1/labels"),
            ]
        );
        assert!(st.requests.iter().all(|r| r.auth == "Bearer s3cret"));
        assert!(
            st.requests[0]
                .path
                .contains("head=acme%3Aquantmesh%2Fevolve%2Ftiny"),
            "{}",
            st.requests[0].path
        );
        let create = &st.requests[1].body;
        assert_eq!(create["head"], "quantmesh/evolve/tiny");
        assert_eq!(create["base"], "main");
        let body = create["body"].as_str().unwrap();
        assert!(
            body.contains("| layers.1.down | residency | int8 | dual |"),
            "{body}"
        );
        assert!(body.contains("### Evidence"), "{body}");
        assert_eq!(
            st.requests[2].body["labels"],
            serde_json::json!(["quantmesh", "evolution"])
        );
    }
    let log = git(
        Path::new(&remote),
        &["log", "--format=%s", "quantmesh/evolve/tiny"],
    );
    assert!(log.starts_with("quantmesh evolution: 2 change(s)"), "{log}");

    // Same evidence again: nothing pushed, no second PR.
    let head = git(Path::new(&remote), &["rev-parse", "quantmesh/evolve/tiny"]);
    let (report, _) = run_once(&s, EvidenceSource::Lake { lake: &lake, span }, false, None)
        .await
        .unwrap();
    assert!(
        matches!(report.outcome, Some(PrOutcome::Unchanged { .. })),
        "{:?}",
        report.outcome
    );
    assert_eq!(
        git(Path::new(&remote), &["rev-parse", "quantmesh/evolve/tiny"]),
        head
    );
    assert_eq!(
        stub.lock()
            .unwrap()
            .requests
            .iter()
            .filter(|r| r.method == "POST" && r.path.ends_with("/pulls"))
            .count(),
        1
    );

    // Newer evidence (a heavier KL tail): the branch moves, the open PR is updated.
    fill_lake(&lake, 40, 0.008).await;
    let (report, _) = run_once(&s, EvidenceSource::Lake { lake: &lake, span }, false, None)
        .await
        .unwrap();
    assert!(
        matches!(report.outcome, Some(PrOutcome::Updated { number: 1, .. })),
        "{:?}",
        report.outcome
    );
    assert_ne!(
        git(Path::new(&remote), &["rev-parse", "quantmesh/evolve/tiny"]),
        head
    );
    {
        let st = stub.lock().unwrap();
        let last = st.requests.last().unwrap();
        assert_eq!(
            (last.method.as_str(), last.path.as_str()),
            ("PATCH", "/repos/acme/plans/pulls/1")
        );
        assert_eq!(st.open().len(), 1);
    }

    // A reviewer closes it without merging, and other branches' pull requests pile up past
    // a page: the same evidence again is not proposed again…
    {
        let mut st = stub.lock().unwrap();
        st.close(1, false);
        for i in 0..130 {
            let n = st.add(&format!("someone/else-{i}"));
            if i % 2 == 0 {
                st.close(n, true);
            }
        }
    }
    let posts = |stub: &std::sync::Arc<std::sync::Mutex<forge_stub::Stub>>| {
        stub.lock()
            .unwrap()
            .requests
            .iter()
            .filter(|r| r.method == "POST" && r.path.ends_with("/pulls"))
            .count()
    };
    let before = posts(&stub);
    let (report, _) = run_once(&s, EvidenceSource::Lake { lake: &lake, span }, false, None)
        .await
        .unwrap();
    assert!(
        matches!(report.outcome, Some(PrOutcome::Declined { number: 1, .. })),
        "{:?}",
        report.outcome
    );
    assert_eq!(posts(&stub), before, "a declined proposal was reopened");
    // …while changed evidence is: a new pull request.
    fill_lake(&lake, 80, 0.02).await;
    let (report, _) = run_once(&s, EvidenceSource::Lake { lake: &lake, span }, false, None)
        .await
        .unwrap();
    assert!(
        matches!(report.outcome, Some(PrOutcome::Opened { number: 132, .. })),
        "{:?}",
        report.outcome
    );
    assert_eq!(posts(&stub), before + 1);
    // The token never reached the log or the repository.
    assert!(!git(Path::new(&remote), &["log", "-p", "--all"]).contains("s3cret"));
}
