//! The compose stack with real containers on this machine's Docker engine, no registry:
//! images built from the imported Debian base (`scripts/base-image.sh`) — quantmesh from the
//! binary cargo just built (Dockerfile target `prebuilt`; gateway and two engines), tansu for
//! Kafka, Debian's Prometheus — brought up with `docker-compose.yml` + `compose.test.yml` and
//! checked: every service healthy, a chat completion from the real model through the
//! gateway's published port, a forced fallback (fanned out by the gateway) read back from the
//! broker by `quantmesh events tail`, Prometheus scraping the gateway and both engines,
//! `docker compose stop engine-1` under load (graceful, exit 0, no failed request) and
//! `start engine-1` (it rejoins the gateway's rotation).
//!
//! Needs a Docker engine (`./scripts/test.sh` makes the base image). Where none exists,
//! `QUANTMESH_SKIP_DOCKER=1` skips these tests with a message; CI machines have one.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use futures::StreamExt;
use std::process::Command;
use std::time::{Duration, Instant};

use support::stack::{
    build_images, compose_cmd, container_ip, docker_available, model_copy, run, Stack, ROOT,
    S3_USER, TOKEN,
};

async fn chat(client: &reqwest::Client, stack: &Stack) -> serde_json::Value {
    let r = client
        .post(stack.url("/v1/chat/completions"))
        .json(&serde_json::json!({
            "messages": [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}],
            "max_tokens": 16, "temperature": 0,
        }))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    r.json().await.unwrap()
}

/// The gateway's `/admin/config`: every engine's answer under `engines`.
async fn admin_config(client: &reqwest::Client, stack: &Stack) -> serde_json::Value {
    support::get_json(client, &stack.url("/admin/config"), TOKEN).await
}

#[test]
fn the_users_compose_file_is_valid() {
    if !docker_available() {
        return;
    }
    let compose = compose_cmd();
    for files in [
        vec!["docker-compose.yml"],
        vec!["docker-compose.yml", "compose.test.yml"],
    ] {
        let mut c = Command::new(&compose[0]);
        c.args(&compose[1..]).current_dir(ROOT);
        for f in &files {
            c.args(["-f", f]);
        }
        run(c
            .arg("config")
            .arg("-q")
            .env("QUANTMESH_TEST_MODEL_DIR", "/tmp")
            .env("MINIO_ROOT_USER", S3_USER)
            .env("MINIO_ROOT_PASSWORD", "not-a-real-secret"));
    }
    // No secrets in the file: without the object store's credentials (from .env) it refuses,
    // naming them.
    let out = Command::new(&compose[0])
        .args(&compose[1..])
        .current_dir(ROOT)
        .args(["-f", "docker-compose.yml", "config", "-q"])
        .env_remove("MINIO_ROOT_USER")
        .env_remove("MINIO_ROOT_PASSWORD")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("MINIO_ROOT_"),
        "{err}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_test_stack_serves_the_real_model_and_relays_events_in_containers() {
    if !docker_available() {
        return;
    }
    let t0 = Instant::now();
    let tmp = tempfile::tempdir().unwrap();
    let sizes = build_images(tmp.path());
    eprintln!(
        "image sizes: quantmesh {:.0} MB, tansu {:.0} MB, prometheus {:.0} MB, s3s-fs {:.0} MB (base debian:bookworm-slim included)",
        sizes.quantmesh as f64 / 1e6,
        sizes.tansu as f64 / 1e6,
        sizes.prometheus as f64 / 1e6,
        sizes.s3 as f64 / 1e6
    );

    let models = model_copy(tmp.path());
    let stack = Stack::new(&models, &[]);
    let (s3, s3_secret) = (stack.s3, stack.s3_secret.clone());
    run(&mut stack.cmd(&["up", "-d", "--no-build"]));
    let services = [
        "minio",
        "kafka-log",
        "kafka",
        "engine-1",
        "engine-2",
        "gateway",
        "prometheus",
        "evolution",
    ];
    // An engine's first start pre-screens the model on the whole calibration set (about a minute
    // alone on 2 cores, one engine for both: they share the model volume's lock), beside the
    // rest of the suite: the image's own start period (600 s) bounds it.
    stack.wait_healthy(&services, Duration::from_secs(600));
    let up = t0.elapsed();

    // A chat completion from the real model through the published port.
    let client = reqwest::Client::new();
    let body = chat(&client, &stack).await;
    let text = body["choices"][0]["message"]["content"].as_str().unwrap();
    assert!(text.contains("Paris"), "{body}");

    // A forced fallback on a group that holds a float copy, asked of the gateway, which fans
    // it out to both engines; the events reach the broker container.
    let cfg = admin_config(&client, &stack).await;
    let engines = cfg["engines"].as_array().unwrap();
    assert_eq!(engines.len(), 2, "{cfg}");
    // Replicas over one model volume on one machine serve one plan: the second engine reads
    // the activation width the first measured (the model's cache), so the float budget
    // keeps the same copies on both.
    assert_eq!(
        engines[0]["body"]["residency"], engines[1]["body"]["residency"],
        "{cfg}"
    );
    let group = engines[0]["body"]["residency"]
        .as_object()
        .unwrap()
        .iter()
        .find(|(_, r)| *r == "dual")
        .map(|(g, _)| g.clone())
        .expect("the first-load plan keeps some dual groups");
    stack.force(&client, &group, "float").await;
    // Read from the beginning until both are there. The test broker (tansu, its log in S3)
    // moves a partition's high watermark before it stores the batch, so a reader at the tip
    // while both engines produce can be handed the later batch and pass the earlier one,
    // which a later read from the beginning finds (docs/operations.md, "Operations: what a
    // fault costs").
    let t_read = Instant::now();
    let events = loop {
        let events = stack.events(&["--limit", "2", "--idle-timeout", "15s"]);
        if events.len() >= 2 || t_read.elapsed() > Duration::from_secs(90) {
            break events;
        }
    };
    assert_eq!(events.len(), 2, "one event per engine: {events:?}");
    for ev in &events {
        assert_eq!(ev["group"], group.as_str());
        assert_eq!(ev["reason"], "admin");
        assert_eq!(ev["action"], "enter");
    }

    // The plan store (S3, bucket made at start): nothing is published yet, so each engine
    // serves its first-load plan and polls `s3://quantmesh/plans/latest`.
    for e in engines {
        assert_eq!(e["body"]["source"], "s3://quantmesh/plans/latest", "{cfg}");
    }
    // A reviewed plan published from the host through the S3 API (as a merge job would)
    // reaches both engines by polling, without a restart.
    let plan = tmp.path().join("plan.json");
    std::fs::write(
        &plan,
        serde_json::to_vec_pretty(&serde_json::json!({
            "schema_version": 1,
            "groups": {group.as_str(): {"class": "fp16", "residency": "float"}},
        }))
        .unwrap(),
    )
    .unwrap();
    let model_dir = std::fs::read_dir(&models)
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.is_dir())
        .unwrap();
    let publish = run(Command::new(env!("CARGO_BIN_EXE_quantmesh"))
        .args(["plan", "publish"])
        .arg(&plan)
        .args(["--to", "s3://quantmesh/plans", "--model"])
        .arg(&model_dir)
        .env("AWS_ENDPOINT", format!("http://127.0.0.1:{s3}"))
        .env("AWS_ALLOW_HTTP", "true")
        .env("AWS_REGION", "us-east-1")
        .env("AWS_ACCESS_KEY_ID", S3_USER)
        .env("AWS_SECRET_ACCESS_KEY", &s3_secret));
    let published = String::from_utf8_lossy(&publish.stdout).to_string();
    let md5 = format!("{:x}", md5::compute(std::fs::read(&plan).unwrap()));
    assert!(published.contains(&md5), "{published}");
    let t_plan = Instant::now();
    loop {
        let cfg = admin_config(&client, &stack).await;
        let engines = cfg["engines"].as_array().unwrap();
        if engines.len() == 2
            && engines.iter().all(|e| {
                e["body"]["md5"] == md5.as_str() && e["body"]["residency"][&group] == "float"
            })
        {
            break;
        }
        assert!(
            t_plan.elapsed() < Duration::from_secs(60),
            "the published plan {md5} was not applied by both engines: {cfg}\n{}",
            stack.logs()
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }

    // Prometheus (in its container) scrapes the gateway and both engines and has loaded our
    // alert rules.
    let prom = |path: String| {
        let (client, stack) = (client.clone(), &stack);
        async move { stack.prom(&client, &path).await }
    };
    let t1 = Instant::now();
    loop {
        let targets = prom("/api/v1/targets".into()).await;
        let up = |instance: &str| {
            targets["data"]["activeTargets"]
                .as_array()
                .unwrap()
                .iter()
                .any(|t| t["labels"]["instance"] == instance && t["health"] == "up")
        };
        if up("gateway:8080") && up("engine-1:8080") && up("engine-2:8080") && up("evolution:9465")
        {
            break;
        }
        assert!(
            t1.elapsed() < Duration::from_secs(60),
            "target not up: {targets}"
        );
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    // Each engine labels its own series with its name (QUANTMESH_ENGINE_NAME).
    let named = prom(
        "/api/v1/query?query=count%20by%20(engine)%20(quantmesh_weight_resident_bytes)".into(),
    )
    .await;
    let mut engines: Vec<String> = named["data"]["result"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|r| r["metric"]["engine"].as_str().map(String::from))
        .collect();
    engines.sort();
    assert_eq!(engines, ["engine-1", "engine-2"], "{named}");
    let rules = prom("/api/v1/rules".into()).await;
    assert!(
        rules.to_string().contains("QuantmeshEventsDropped"),
        "alert rules not loaded: {rules}"
    );

    // `stop engine-1` under load: SIGTERM, it drains and exits 0; every request succeeds
    // (those it refuses while draining are retried on engine-2 before their first byte).
    let load = tokio::spawn({
        let (client, url) = (client.clone(), stack.url(""));
        async move {
            let calls = (0..24).map(|i| {
                let (client, url) = (client.clone(), url.clone());
                async move {
                    client
                        .post(format!("{url}/v1/completions"))
                        .json(
                            &serde_json::json!({"prompt": format!("Count to ten, take {i}:"),
                                                  "max_tokens": 24}),
                        )
                        .send()
                        .await
                        .map(|r| r.status().as_u16())
                        .unwrap_or(0)
                }
            });
            futures::stream::iter(calls)
                .buffer_unordered(4)
                .collect::<Vec<u16>>()
                .await
        }
    });
    // The gateway found the engines by DNS (`dns+http://engine:8080`, the alias both
    // engines carry): engine-1 is the engine named by its container's address.
    let gateway_metric = |m: String, ip: &str| {
        support::sum_metric(
            &m,
            "quantmesh_gateway_engine_up",
            &[&format!("engine=\"engine@{ip}:8080\"")],
        )
    };
    let id = stack.container("engine-1");
    let ip = container_ip(&id);
    let discovered = stack.metrics(&client).await;
    assert_eq!(
        gateway_metric(discovered.clone(), &ip),
        1.0,
        "engine-1 ({ip}) is not an engine the gateway discovered:\n{discovered}"
    );
    assert_eq!(
        support::sum_metric(&discovered, "quantmesh_gateway_discovered_engines", &[]),
        2.0,
        "{discovered}"
    );
    // Stop it while it holds requests (the gateway counts them outstanding).
    let t1 = Instant::now();
    loop {
        let m = stack.metrics(&client).await;
        let held = support::sum_metric(
            &m,
            "quantmesh_gateway_engine_outstanding",
            &[&format!("engine=\"engine@{ip}:8080\"")],
        );
        if held >= 1.0 {
            break;
        }
        assert!(
            t1.elapsed() < Duration::from_secs(60),
            "engine-1 never held a request:\n{m}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    run(&mut stack.cmd(&["stop", "engine-1"]));
    let statuses = load.await.unwrap();
    assert!(
        statuses.iter().all(|s| *s == 200),
        "{statuses:?}\n{}",
        stack.logs()
    );
    let code =
        run(Command::new("docker").args(["inspect", "--format", "{{.State.ExitCode}}", &id]));
    assert_eq!(
        String::from_utf8_lossy(&code.stdout).trim(),
        "0",
        "{}",
        stack.logs()
    );
    let metrics = || stack.metrics(&client);
    let t2 = Instant::now();
    while gateway_metric(metrics().await, &ip) != 0.0 {
        assert!(
            t2.elapsed() < Duration::from_secs(30),
            "the gateway never marked engine-1 down"
        );
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    run(&mut stack.cmd(&["start", "engine-1"]));
    stack.wait_healthy(&["engine-1"], Duration::from_secs(180));
    // Back in DNS (at the same address or a new one), it rejoins the rotation.
    let ip = container_ip(&stack.container("engine-1"));
    let t3 = Instant::now();
    while gateway_metric(metrics().await, &ip) != 1.0 {
        assert!(
            t3.elapsed() < Duration::from_secs(30),
            "engine-1 did not rejoin"
        );
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    let body = chat(&client, &stack).await;
    assert!(body["choices"][0]["message"]["content"].is_string());

    // The evolution service consumed the events into its lake (Prometheus scraped it).
    let t4 = Instant::now();
    loop {
        let v = prom("/api/v1/query?query=quantmesh_evolution_records_total".into()).await;
        let n = v["data"]["result"][0]["value"][1]
            .as_str()
            .and_then(|s| s.parse::<f64>().ok())
            .unwrap_or(0.0);
        if n > 0.0 {
            break;
        }
        assert!(
            t4.elapsed() < Duration::from_secs(60),
            "the evolution service landed nothing: {v}\n{}",
            stack.logs()
        );
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    // The lake is in the object store: Parquet files in the S3 server's bucket…
    let lake = run(&mut stack.cmd(&[
        "exec",
        "-T",
        "minio",
        "bash",
        "-c",
        "find /data/quantmesh/lake -name '*.parquet' | wc -l",
    ]));
    let files: usize = String::from_utf8_lossy(&lake.stdout)
        .trim()
        .parse()
        .unwrap();
    assert!(
        files > 0,
        "no Parquet in s3://quantmesh/lake\n{}",
        stack.logs()
    );
    // …which the analysis reads back through S3 (DataFusion over the same object store).
    let analysis = run(&mut stack.cmd(&[
        "exec",
        "-T",
        "evolution",
        "quantmesh",
        "evolve",
        "--once",
        "--dry-run",
        "--no-ingest",
    ]));
    let report = String::from_utf8_lossy(&analysis.stdout);
    // The proposal was validated against the served model's checkpoint (mounted from the
    // engines' model volume), not only against the schema.
    let log = String::from_utf8_lossy(&analysis.stderr);
    assert!(
        !log.contains("evolution.checkpoint is not set"),
        "the evolution service has no checkpoint to validate against:\n{log}"
    );
    // The counts come from the Parquet it read: the forced fallbacks' events and both
    // engines' applications of the published plan.
    let count_before = |what: &str| -> u64 {
        report
            .split(what)
            .next()
            .and_then(|head| head.split_whitespace().last())
            .and_then(|n| n.parse().ok())
            .unwrap_or(0)
    };
    assert!(report.contains("smollm2-135m-instruct"), "{report}");
    assert!(count_before(" fallback events") > 0, "{report}");
    assert!(
        report.contains("configs applied") && !report.contains("configs applied 0"),
        "{report}"
    );
    eprintln!(
        "compose test: images + stack healthy in {:.0} s, whole test {:.0} s",
        up.as_secs_f64(),
        t0.elapsed().as_secs_f64()
    );
}
