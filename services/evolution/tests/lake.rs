//! The lake without Kafka: batches land partitioned, duplicates are dropped, a re-delivered
//! batch (crash between write and commit) replaces its files instead of doubling them,
//! unreadable records are kept, and DataFusion and DuckDB read the same counts.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use quantmesh_evolution::analysis::{self, Span};
use quantmesh_evolution::ingest::{Consumed, Writer};
use quantmesh_evolution::lake::Lake;
use quantmesh_kafka::KafkaSettings;
use quantmesh_types::{
    FallbackAction, FallbackEvent, FallbackReason, Granularity, WindowEvent, WindowGroup,
};
use std::sync::Arc;

const DAY: u64 = 86_400_000;
const T0: u64 = 1_790_000_000_000; // 2026-09-21

fn window(id: &str, t: u64, in_float: bool, kl: Vec<f64>) -> WindowEvent {
    WindowEvent {
        schema_version: 1,
        event_id: id.into(),
        timestamp_ms: t,
        duration_ms: 1000,
        model: "org/tiny".into(),
        window: 1,
        config_md5: None,
        groups: vec![
            WindowGroup {
                group: "layers.1.down".into(),
                tokens: 1000,
                outliers: 30,
                in_float,
                wanted_unavailable: false,
                residency: "dual".into(),
                mean_nsr: Some(0.002),
            },
            WindowGroup {
                group: "layers.0.o".into(),
                tokens: 1000,
                outliers: 0,
                in_float: false,
                wanted_unavailable: false,
                residency: "dual".into(),
                mean_nsr: None,
            },
        ],
        shadow_kl_seen: kl.len() as u64,
        shadow_kl: kl,
        kl_reference: None,
        request_kl_fallbacks: 0,
    }
}

fn fallback(id: &str, t: u64) -> FallbackEvent {
    FallbackEvent {
        schema_version: 1,
        event_id: id.into(),
        timestamp_ms: t,
        model: "org/tiny".into(),
        group: Some("layers.1.down".into()),
        granularity: Granularity::Layer,
        action: FallbackAction::Enter,
        reason: FallbackReason::OutlierRate,
        outlier_rate: Some(0.03),
        mean: Some(1.0),
        sigma: Some(0.1),
        k: Some(4.0),
        kl: None,
        kl_reference: None,
        token_ids: vec![],
        positions: vec![],
        request_id: None,
        config_md5: None,
        traceparent: None,
    }
}

fn rec(topic: &str, kind: &str, offset: i64, payload: String) -> Consumed {
    Consumed {
        topic: topic.into(),
        partition: 0,
        offset,
        event_type: Some(kind.into()),
        payload: Ok(payload),
    }
}

fn records(settings: &KafkaSettings, from: i64, n: i64) -> Vec<Consumed> {
    (from..from + n)
        .map(|i| {
            let t = T0 + (i as u64 % 2) * DAY; // two dates
            rec(
                &settings.window_topic,
                "window",
                i,
                serde_json::to_string(&window(
                    &format!("w{i}"),
                    t,
                    i % 4 == 0,
                    vec![0.001 * i as f64],
                ))
                .unwrap(),
            )
        })
        .collect()
}

async fn count(lake: &Lake, sql: &str) -> u64 {
    #[derive(serde::Deserialize)]
    struct Count {
        n: u64,
    }
    let ctx = analysis::session(lake).await.unwrap();
    let b = analysis::query(&ctx, sql).await.unwrap();
    analysis::rows::<Count>(&b).unwrap()[0].n
}

fn files(dir: &std::path::Path) -> Vec<String> {
    let mut out = Vec::new();
    for e in walk(dir) {
        out.push(e.strip_prefix(dir).unwrap().display().to_string());
    }
    out.sort();
    out
}

fn walk(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    if let Ok(rd) = std::fs::read_dir(dir) {
        for e in rd.flatten() {
            let p = e.path();
            if p.is_dir() {
                out.extend(walk(&p));
            } else {
                out.push(p);
            }
        }
    }
    out
}

#[tokio::test]
async fn batches_land_partitioned_and_a_redelivered_batch_replaces_its_files() {
    let dir = tempfile::tempdir().unwrap();
    let settings = KafkaSettings::default();
    let lake = Arc::new(Lake::open(dir.path().to_str().unwrap()).unwrap());
    lake.sweep().await.unwrap();
    let mut w = Writer::new(lake.clone(), settings.clone(), 10_000, None);

    // Batch 1: offsets 0..10, committed.
    let r = w.write_batch(&records(&settings, 0, 10)).await.unwrap();
    assert_eq!((r.records, r.duplicates, r.rejected), (10, 0, 0));
    let names = files(dir.path());
    assert!(
        names.iter().any(|n| n
            == "window_groups/model=org_tiny/date=2026-09-21/p0-o00000000000000000000-00000000000000000009-quantmesh.monitor-windows.v1.parquet"),
        "{names:#?}"
    );
    assert!(names
        .iter()
        .any(|n| n.starts_with("shadow_kl/model=org_tiny/date=2026-09-22/")));
    // Batch 2: offsets 10..20 plus a duplicate of w3 (a relay retry) and a foreign record.
    let mut b2 = records(&settings, 10, 10);
    b2.push(rec(
        &settings.window_topic,
        "window",
        20,
        serde_json::to_string(&window("w3", T0, false, vec![])).unwrap(),
    ));
    b2.push(rec(&settings.topic, "fallback", 7, "{not json".into()));
    let r = w.write_batch(&b2).await.unwrap();
    assert_eq!((r.duplicates, r.rejected), (1, 1));
    // The process dies after writing batch 3 (offsets 21..30) but before committing it.
    let b3 = records(&settings, 21, 10);
    w.write_batch(&b3).await.unwrap();
    assert_eq!(count(&lake, "SELECT COUNT(*) AS n FROM windows").await, 30);

    // Restart: a new process (empty memory) re-reads from the committed offset 21, this
    // time in a batch of 5 then one of 5.
    let lake2 = Arc::new(Lake::open(dir.path().to_str().unwrap()).unwrap());
    assert!(lake2.sweep().await.unwrap() > 0);
    let mut w2 = Writer::new(lake2.clone(), settings.clone(), 10_000, None);
    let r = w2.write_batch(&records(&settings, 21, 5)).await.unwrap();
    assert!(r.superseded > 0, "{r:?}");
    w2.write_batch(&records(&settings, 26, 5)).await.unwrap();

    // Readers see each event once: 30 windows (w0…w19, w21…w30), 60 group rows, no
    // duplicate ids anywhere.
    assert_eq!(count(&lake2, "SELECT COUNT(*) AS n FROM windows").await, 30);
    assert_eq!(
        count(&lake2, "SELECT COUNT(DISTINCT event_id) AS n FROM windows").await,
        30
    );
    assert_eq!(
        count(&lake2, "SELECT COUNT(*) AS n FROM window_groups").await,
        60
    );
    assert_eq!(count(&lake2, "SELECT COUNT(*) AS n FROM rejected").await, 1);
    assert_eq!(
        count(
            &lake2,
            "SELECT COUNT(*) AS n FROM window_groups WHERE date = '2026-09-22'"
        )
        .await,
        30
    );

    // The analysis sees the same thing.
    let ctx = analysis::session(&lake2).await.unwrap();
    let ev = analysis::analyse(
        &ctx,
        "org/tiny",
        Span {
            since_ms: T0 as i64 - 1,
            until_ms: (T0 + 2 * DAY) as i64,
        },
        0.02,
    )
    .await
    .unwrap();
    assert_eq!(ev.windows, 30);
    assert_eq!(ev.groups.len(), 2);
    let down = ev
        .groups
        .iter()
        .find(|g| g.group == "layers.1.down")
        .unwrap();
    assert_eq!(down.windows, 30);
    assert_eq!(down.tokens, 30_000);
    assert_eq!(down.float_windows, 7); // offsets 0, 4, …, 16, 24, 28
    assert!((down.rate_p50.unwrap() - 0.03).abs() < 1e-9);
    // The served harm, token-weighted over the windows that measured it.
    assert!((down.served_nsr.unwrap() - 0.002).abs() < 1e-12, "{down:?}");
    let o = ev.groups.iter().find(|g| g.group == "layers.0.o").unwrap();
    assert_eq!(o.served_nsr, None);
    // KL samples 0.000 … 0.019 and 0.021 … 0.030 (one per window); 20 at or below 0.02.
    assert_eq!(ev.kl.samples, 30);
    assert_eq!(ev.kl.healthy_samples, 20);

    // A second query engine reads the lake as it is (DuckDB's Python package).
    let out = std::process::Command::new("python3")
        .arg("-c")
        .arg(format!(
            "import duckdb; print(duckdb.sql(\"SELECT COUNT(*), COUNT(DISTINCT event_id), MIN(model) FROM read_parquet('{}/window_groups/**/*.parquet', hive_partitioning=true)\").fetchone())",
            dir.path().display()
        ))
        .output()
        .expect("python3");
    assert!(
        out.status.success(),
        "DuckDB query failed (scripts/test.sh installs duckdb): {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        "(60, 30, 'org_tiny')"
    );
}

#[tokio::test]
async fn an_empty_lake_gives_empty_evidence() {
    let dir = tempfile::tempdir().unwrap();
    let lake = Lake::open(dir.path().to_str().unwrap()).unwrap();
    let ctx = analysis::session(&lake).await.unwrap();
    let ev = analysis::analyse(
        &ctx,
        "m",
        Span {
            since_ms: 0,
            until_ms: i64::MAX / 2,
        },
        0.02,
    )
    .await
    .unwrap();
    assert_eq!(ev.windows, 0);
    assert!(ev.groups.is_empty());
    let _ = fallback("x", 0);
}

/// The Spark job (`infra/spark/evidence.py`) stands an empty table of the right schema in for
/// a table with no file yet; it reads the schemas from `infra/spark/lake-tables.json`, which
/// must be these (`QUANTMESH_UPDATE_DOCS=1` rewrites it).
#[test]
fn the_spark_job_reads_the_lake_schemas_of_this_build() {
    use quantmesh_evolution::lake::tables::Table;
    let entries: Vec<String> = Table::ALL
        .iter()
        .map(|t| {
            format!(
                "  {}: {}",
                serde_json::to_string(t.name()).unwrap(),
                serde_json::to_string(&t.ddl()).unwrap()
            )
        })
        .collect();
    let want = format!("{{\n{}\n}}\n", entries.join(",\n"));
    let path =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../infra/spark/lake-tables.json");
    if std::env::var_os("QUANTMESH_UPDATE_DOCS").is_some() {
        std::fs::write(&path, &want).unwrap();
    }
    let have = std::fs::read_to_string(&path).unwrap_or_default();
    assert_eq!(
        have,
        want,
        "{} is not this build's lake schema: run this test with QUANTMESH_UPDATE_DOCS=1",
        path.display()
    );
    let parsed: serde_json::Value = serde_json::from_str(&have).unwrap();
    assert!(parsed["window_groups"]
        .as_str()
        .unwrap()
        .contains("`group` STRING NOT NULL"));
}
