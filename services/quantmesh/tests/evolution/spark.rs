//! The evolution loop's lake read by Spark instead of DataFusion (part of evolution.rs's
//! end-to-end test).

use std::process::{Command, Stdio};

/// `quantmesh ARGS` with extra environment: whether it succeeded, and what it printed.
pub type Cli = fn(&[&str], &[(&str, &str)]) -> (bool, String);

/// What a lake holds beside the files its writer made: a leftover staging copy of one
/// (`….parquet.tmp`, its rows again if it were read), and that file rewritten by a newer
/// writer with a column the table's schema does not have (same rows). Returns what it did.
async fn disturb_the_lake(lake: &std::path::Path) -> String {
    use datafusion::dataframe::DataFrameWriteOptions;
    use datafusion::prelude::{lit, ParquetReadOptions, SessionContext};
    let mut dir = lake.join("fallback_events");
    // Down the model=…/date=… folders to the first one holding files.
    let file = loop {
        let mut entries: Vec<_> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().path())
            .collect();
        entries.sort();
        match entries
            .iter()
            .find(|p| p.extension().is_some_and(|x| x == "parquet"))
        {
            Some(f) => break f.clone(),
            None => dir = entries.into_iter().find(|p| p.is_dir()).unwrap(),
        }
    };
    let staging = file.with_extension("parquet.tmp");
    std::fs::copy(&file, &staging).unwrap();
    let ctx = SessionContext::new();
    let df = ctx
        .read_parquet(file.display().to_string(), ParquetReadOptions::default())
        .await
        .unwrap();
    let rows = df.clone().count().await.unwrap();
    let out = lake.join("rewritten.parquet");
    df.with_column("added_later", lit("a newer writer's column"))
        .unwrap()
        .write_parquet(
            &out.display().to_string(),
            DataFrameWriteOptions::new().with_single_file_output(true),
            None,
        )
        .await
        .unwrap();
    std::fs::rename(&out, &file).unwrap();
    format!(
        "{} ({rows} rows) copied to {} and rewritten with a column added_later",
        file.display(),
        staging.display()
    )
}

/// The lake the served traffic left, analysed by Spark (`infra/spark/evidence.py`, PySpark in
/// local mode) instead of DataFusion: the evidence tables are equal row for row, and
/// `quantmesh evolve --evidence` makes the same plan from Spark's file as from its own
/// analysis (and as the pull request carries). Both read the lake after a staging file and a
/// file with an extra column were left in it, and DataFusion's answer is the one it gave
/// before. A file split by another request limit is refused by name.
pub async fn same_evidence_and_proposal_on_spark(
    r: &std::path::Path,
    cfg: &str,
    served: &str,
    pushed_plan: &str,
    quantmesh: Cli,
) {
    use quantmesh_evolution::analysis::EvidenceFile;
    let has_pyspark = Command::new("python3")
        .args(["-c", "import pyspark"])
        .status()
        .is_ok_and(|s| s.success());
    assert!(
        has_pyspark,
        "PySpark is not installed (./scripts/test.sh installs pyspark and a Java runtime)"
    );
    let (since, until) = ("2000-01-01", "2100-01-01");
    let path = |n: &str| r.join(n).display().to_string();
    let (df_ev, df_plan) = (
        path("datafusion-evidence.json"),
        path("datafusion-plan.json"),
    );
    let (spark_ev, spark_plan) = (path("spark-evidence.json"), path("spark-plan.json"));
    let datafusion_evidence = |evidence: &str, plan: &str| {
        let (ok, out) = quantmesh(
            &[
                "evolve",
                "--once",
                "--dry-run",
                "--no-ingest",
                "--config",
                cfg,
                "--model",
                served,
                "--since",
                since,
                "--until",
                until,
                "--evidence-out",
                evidence,
                "--plan-out",
                plan,
            ],
            &[],
        );
        assert!(ok, "{out}");
    };
    let undisturbed = path("datafusion-evidence-undisturbed.json");
    datafusion_evidence(&undisturbed, &path("datafusion-plan-undisturbed.json"));
    let disturbed = disturb_the_lake(&r.join("lake")).await;
    eprintln!("lake: {disturbed}");
    datafusion_evidence(&df_ev, &df_plan);
    let job =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../infra/spark/evidence.py");
    let lake = path("lake");
    let spark = Command::new("python3")
        .arg(&job)
        .args([
            "--lake", &lake, "--model", served, "--since", since, "--until", until, "--out",
            &spark_ev, "--master", "local[2]",
        ])
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert!(
        spark.status.success(),
        "the Spark job failed:\n{}",
        String::from_utf8_lossy(&spark.stderr)
    );
    // `quantmesh evolve --once --dry-run` proposing from an evidence file.
    let from_file = |file: &str, more: &[&str]| {
        let mut args = vec![
            "evolve",
            "--once",
            "--dry-run",
            "--config",
            cfg,
            "--model",
            served,
            "--evidence",
            file,
        ];
        args.extend_from_slice(more);
        quantmesh(&args, &[])
    };
    let (ok, out) = from_file(&spark_ev, &["--plan-out", &spark_plan]);
    assert!(ok, "{out}");
    assert!(out.contains("Evidence from spark "), "{out}");

    let read = |p: &str| EvidenceFile::parse(p, &std::fs::read(p).unwrap()).unwrap();
    let (d, s) = (read(&df_ev), read(&spark_ev));
    assert!(d.engine.starts_with("datafusion") && s.engine.starts_with("spark"));
    assert!(
        d.tables == read(&undisturbed).tables,
        "DataFusion's answer changed with {disturbed}"
    );
    assert!(
        d.tables
            .groups
            .iter()
            .any(|g| g.group.as_deref() == Some("layers.1.down")),
        "{:?}",
        d.tables.groups
    );
    assert!(d.tables.kl[0].n.unwrap_or(0) > 0, "{:?}", d.tables.kl);
    assert!(!d.tables.decisions.is_empty());
    for (name, equal) in [
        ("groups", d.tables.groups == s.tables.groups),
        ("decisions", d.tables.decisions == s.tables.decisions),
        ("kl", d.tables.kl == s.tables.kl),
        ("healthy", d.tables.healthy == s.tables.healthy),
        ("windows", d.tables.windows == s.tables.windows),
        ("configs", d.tables.configs == s.tables.configs),
    ] {
        assert!(
            equal,
            "table {name} differs between DataFusion and Spark:\n{}\n{}",
            String::from_utf8_lossy(&d.to_bytes()),
            String::from_utf8_lossy(&s.to_bytes())
        );
    }
    let plan = |p: &str| -> serde_json::Value {
        serde_json::from_slice(&std::fs::read(p).unwrap()).unwrap()
    };
    assert_eq!(plan(&df_plan), plan(&spark_plan));
    assert_eq!(
        plan(&spark_plan),
        serde_json::from_str::<serde_json::Value>(pushed_plan).unwrap()
    );

    let mut other: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&spark_ev).unwrap()).unwrap();
    other["request_kl_limit"] = 0.5.into();
    let other_ev = path("other-limit.json");
    std::fs::write(&other_ev, other.to_string()).unwrap();
    let (ok, out) = from_file(&other_ev, &[]);
    assert!(!ok, "{out}");
    assert!(
        out.contains("other-limit.json")
            && out.contains("request_kl_limit 0.5")
            && out.contains("0.02"),
        "{out}"
    );
}
