//! `quantmesh evolve` with real parts: a tansu broker, a real `quantmesh serve` publishing
//! its monitor windows, extra events (with duplicates) produced straight to the topics, the
//! `quantmesh evolve` binary SIGKILLed between writing a batch and committing its offsets,
//! and DuckDB reading the lake it leaves.

#![allow(clippy::unwrap_used, clippy::expect_used)]

#[path = "evolution/spark.rs"]
mod spark;
mod support;

use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::ClientConfig;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};
use support::*;

const SYNTHETIC: usize = 200;
const DUPLICATES: usize = 50;

fn window_payload(i: usize) -> String {
    serde_json::json!({
        "schema_version": 1, "event_id": format!("synthetic-{i}"),
        "timestamp_ms": quantmesh_types::now_ms(), "duration_ms": 1000,
        "model": "synthetic", "window": i, "config_md5": null,
        "groups": [{"group": "layers.1.down", "tokens": 100, "outliers": 3, "in_float": i.is_multiple_of(3),
                    "wanted_unavailable": false, "residency": "dual"}],
        "shadow_kl": [0.001], "shadow_kl_seen": 1, "kl_reference": "float_weights",
        "request_kl_fallbacks": 0
    })
    .to_string()
}

async fn produce(brokers: &str) {
    let p: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set("message.timeout.ms", "10000")
        .create()
        .unwrap();
    let topic = quantmesh_kafka::settings::DEFAULT_WINDOW_TOPIC;
    for i in (0..SYNTHETIC).chain(0..DUPLICATES) {
        let payload = window_payload(i);
        let key = format!("synthetic/{i}");
        let rec = FutureRecord::to(topic).payload(&payload).key(&key).headers(
            OwnedHeaders::new().insert(Header {
                key: "event-type",
                value: Some("window"),
            }),
        );
        p.send(rec, Duration::from_secs(10)).await.unwrap();
    }
    // And one record no reader could use: kept in `rejected`, not lost.
    let rec = FutureRecord::to(topic)
        .payload("{\"schema_version\": 7}")
        .key("bad")
        .headers(OwnedHeaders::new().insert(Header {
            key: "event-type",
            value: Some("window"),
        }));
    p.send(rec, Duration::from_secs(10)).await.unwrap();
}

fn evolve(
    cfg: &str,
    lake: &str,
    brokers: &str,
    log: &std::path::Path,
    pause: Option<&str>,
) -> std::process::Child {
    let f = std::fs::File::create(log).unwrap();
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_quantmesh"));
    cmd.args([
        "evolve",
        "--once",
        "--dry-run",
        "--config",
        cfg,
        "--lake",
        lake,
        "--brokers",
        brokers,
        "--model",
        "synthetic",
        "--ingest-idle",
        "4s",
    ])
    .stdout(f.try_clone().unwrap())
    .stderr(f)
    .stdin(Stdio::null());
    if let Some(p) = pause {
        cmd.env("QUANTMESH_EVOLUTION_PAUSE_BEFORE_COMMIT", p);
    }
    cmd.spawn().unwrap()
}

fn duckdb(sql: &str) -> String {
    let out = Command::new("python3")
        .arg("-c")
        .arg(format!(
            "import duckdb; print(duckdb.sql(\"{sql}\").fetchall())"
        ))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn served_windows_land_in_the_lake_once_across_a_sigkill_between_write_and_commit() {
    let root = tempfile::tempdir().unwrap();
    let broker = Broker::start(root.path());
    let model = model_dir(root.path());
    let cfg = root.path().join("quantmesh.toml");
    std::fs::write(
        &cfg,
        "[engine.monitor]\nwindow_requests = 4\nshadow_sample_rate = 0.5\n\n[kafka]\nconnect_timeout = \"3s\"\n\n[evolution]\nbatch_records = 60\nbatch_interval = \"1s\"\n",
    )
    .unwrap();
    let cfg = cfg.to_str().unwrap().to_string();
    let mut serve = Serve::start(
        &model,
        &root.path().join("outbox"),
        &broker.addr(),
        &[("QUANTMESH_CONFIG", cfg.as_str())],
    )
    .await;
    let client = reqwest::Client::new();
    for i in 0..24 {
        let r = client
            .post(serve.url("/v1/completions"))
            .json(&serde_json::json!({"prompt": format!("request {i}: the quick brown fox"), "max_tokens": 8}))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
    }
    // The server's windows reach the broker (its outbox drains).
    serve
        .wait_outbox_drained(&client, Duration::from_secs(60))
        .await;
    serve.terminate();
    produce(&broker.addr()).await;

    let lake = root.path().join("lake");
    let lake_s = lake.to_str().unwrap();
    // First run: killed while its first batch is written but not committed.
    let log1 = root.path().join("evolve-1.log");
    let mut first = evolve(&cfg, lake_s, &broker.addr(), &log1, Some("60s"));
    let t0 = Instant::now();
    loop {
        let log = std::fs::read_to_string(&log1).unwrap_or_default();
        if log.contains("batch written, committing offsets") {
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "no batch written:\n{log}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let before = duckdb(&format!(
        "SELECT COUNT(*) FROM read_parquet('{lake_s}/windows/**/*.parquet', hive_partitioning=true)"
    ));
    assert_ne!(
        before, "[(0,)]",
        "the batch should be in the lake before the kill"
    );
    first.kill().unwrap(); // SIGKILL
    first.wait().unwrap();

    // Second run: resumes at the committed offsets, replaces the killed batch's files.
    let log2 = root.path().join("evolve-2.log");
    let mut second = evolve(&cfg, lake_s, &broker.addr(), &log2, None);
    let status = tokio::task::spawn_blocking(move || second.wait().unwrap())
        .await
        .unwrap();
    let log = std::fs::read_to_string(&log2).unwrap();
    assert!(status.success(), "{log}");
    assert!(log.contains("### Evidence"), "{log}");

    let q = |t: &str| {
        duckdb(&format!(
            "SELECT model, COUNT(*), COUNT(DISTINCT event_id) FROM read_parquet('{lake_s}/{t}/**/*.parquet', hive_partitioning=true) GROUP BY model ORDER BY model"
        ))
    };
    let windows = q("windows");
    assert!(
        windows.contains(&format!("('synthetic', {SYNTHETIC}, {SYNTHETIC})")),
        "{windows}"
    );
    // The served model's windows landed too, each once.
    let served: Vec<&str> = windows
        .split("), (")
        .filter(|r| !r.contains("synthetic"))
        .collect();
    assert_eq!(served.len(), 1, "{windows}");
    let nums: Vec<u64> = served[0]
        .split(", ")
        .skip(1)
        .map(|n| {
            n.trim_matches(|c: char| !c.is_ascii_digit())
                .parse()
                .unwrap()
        })
        .collect();
    assert!(nums[0] >= 5 && nums[0] == nums[1], "{windows}");
    assert_eq!(
        duckdb(&format!(
            "SELECT COUNT(*) FROM read_parquet('{lake_s}/rejected/**/*.parquet')"
        )),
        "[(1,)]"
    );
}

use quantmesh_testkit::forge_stub;

/// The test kit's git, its output trimmed (revisions are passed on as arguments).
fn git(dir: &std::path::Path, args: &[&str]) -> String {
    quantmesh_testkit::git_http::git(dir, args)
        .trim()
        .to_string()
}

fn quantmesh(args: &[&str], env: &[(&str, &str)]) -> (bool, String) {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_quantmesh"));
    cmd.args(args).stdin(Stdio::null());
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd.output().unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

/// `quantmesh plan publish FILE --to STORE --model MODEL`, which must succeed.
fn publish(file: &std::path::Path, store: &str, model: &str) {
    let (ok, out) = quantmesh(
        &[
            "plan",
            "publish",
            file.to_str().unwrap(),
            "--to",
            store,
            "--model",
            model,
        ],
        &[],
    );
    assert!(ok, "{out}");
}

async fn admin_config(client: &reqwest::Client, serve: &Serve) -> serde_json::Value {
    get_json(client, &serve.url("/admin/config"), ADMIN_TOKEN).await
}

/// The whole loop: a server whose planted INT8-hostile group (`layers.1.down`) is INT8-only
/// keeps wanting a float copy it has not got → its window events say so → `quantmesh evolve
/// --once` lands them in the lake, proposes `dual` for that group, pushes a branch to a real
/// bare repository and opens a pull request on the forge stub → the test merges it
/// (fast-forward) and publishes the merged file to the versioned store the server polls →
/// the server applies it within one poll, with no failed request, and the group is `dual`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_loop_closes_from_served_traffic_to_a_merged_plan_the_server_reloads() {
    let root = tempfile::tempdir().unwrap();
    let r = root.path();
    let broker = Broker::start(r);
    let model = model_dir(r);
    let model_s = model.to_str().unwrap();

    // The plan in force: layers.1.down INT8-only. Published to the versioned store the server
    // polls, and the base branch of the plan repository.
    let initial = plan_with_class(&model, "layers.1.down", "w8a8");
    let initial_file = r.join("initial.json");
    std::fs::write(&initial_file, &initial).unwrap();
    let store = format!("file://{}", r.join("plans").display());
    publish(&initial_file, &store, model_s);
    let work = r.join("work");
    std::fs::create_dir_all(&work).unwrap();
    git(&work, &["init", "-q", "-b", "main"]);
    std::fs::write(work.join("sensitive_layers.json"), &initial).unwrap();
    git(&work, &["add", "sensitive_layers.json"]);
    git(
        &work,
        &[
            "-c",
            "user.name=t",
            "-c",
            "user.email=t@t",
            "commit",
            "-q",
            "-m",
            "initial plan",
        ],
    );
    let bare = r.join("plans.git");
    let (bare_s, work_s) = (bare.to_str().unwrap(), work.to_str().unwrap());
    let out = Command::new("git")
        .args(["clone", "-q", "--bare", work_s, bare_s])
        .output()
        .unwrap();
    assert!(out.status.success());

    let (stub_url, stub) = forge_stub::start_stub().await;
    let cfg = r.join("quantmesh.toml");
    std::fs::write(
        &cfg,
        format!(
            r#"[engine]
sensitive_layers = "{store}/latest"
reload_interval = "1s"
# the planted harm is 8-bit activation harm: plain W8A8 rows, where spikes count
split_activations = "off"

[engine.monitor]
window_requests = 8
warmup_tokens = 256
min_window_tokens = 32
shadow_sample_rate = 0.25

[evolution]
checkpoint = "{model_s}"
lake = "{lake}"
batch_interval = "1s"

[evolution.rules]
min_windows = 3
min_tokens = 100
min_kl_samples = 20

[evolution.git]
remote = "{bare_s}"
checkout = "{checkout}"

[evolution.forge]
kind = "github"
api_url = "{stub_url}"
repository = "acme/plans"
"#,
            lake = r.join("lake").display(),
            checkout = r.join("checkout").display(),
        ),
    )
    .unwrap();
    let cfg_s = cfg.to_str().unwrap().to_string();
    let serve = Serve::start(
        &model,
        &r.join("outbox"),
        &broker.addr(),
        &[("QUANTMESH_CONFIG", cfg_s.as_str())],
    )
    .await;
    let client = reqwest::Client::new();
    let before = admin_config(&client, &serve).await;
    assert_eq!(before["residency"]["layers.1.down"], "int8", "{before}");
    let models: serde_json::Value = client
        .get(serve.url("/v1/models"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let served = models["data"][0]["id"].as_str().unwrap().to_string();

    // Ordinary traffic (the bundled sample prompts, sampled): the planted group's outlier
    // rate crosses its trigger, and it holds no float copy.
    for round in 0..6u64 {
        let reqs =
            quantmesh_model::bundled::SAMPLE_PROMPTS
                .iter()
                .enumerate()
                .map(|(i, p)| {
                    let (client, url) = (client.clone(), serve.url("/v1/completions"));
                    async move {
                        let r = client
                    .post(url)
                    .json(&serde_json::json!({"prompt": p, "max_tokens": 24, "temperature": 0.8,
                                              "seed": round * 100 + i as u64}))
                    .send()
                    .await
                    .unwrap();
                        assert_eq!(r.status(), 200);
                    }
                });
        futures::future::join_all(reqs).await;
    }
    serve
        .wait_outbox_drained(&client, Duration::from_secs(60))
        .await;

    // One evolution run: ingest, analyse, propose, push, open the PR.
    let token = "ghp_test_token_never_logged";
    let (ok, out) = quantmesh(
        &[
            "evolve",
            "--once",
            "--config",
            &cfg_s,
            "--brokers",
            &broker.addr(),
            "--model",
            &served,
            "--ingest-idle",
            "4s",
        ],
        &[("QUANTMESH_FORGE_TOKEN", token)],
    );
    assert!(ok, "{out}");
    assert!(!out.contains(token), "the token was printed:\n{out}");
    assert!(out.contains("layers.1.down"), "{out}");
    let branch = format!(
        "quantmesh/evolve/{}",
        quantmesh_evolution::lake::tables::model_partition(&served)
    );
    let proposed = git(&bare, &["show", &format!("{branch}:sensitive_layers.json")]);
    let plan: serde_json::Value = serde_json::from_str(&proposed).unwrap();
    // Promoted to a float copy; its 8-bit form stays as it was.
    assert_eq!(
        (
            &plan["groups"]["layers.1.down"]["residency"],
            &plan["groups"]["layers.1.down"]["class"]
        ),
        (&serde_json::json!("dual"), &serde_json::json!("w8a8")),
        "{proposed}\n{out}"
    );
    {
        let s = stub.lock().unwrap();
        let opened: Vec<_> = s
            .requests
            .iter()
            .filter(|q| q.method == "POST" && q.path == "/repos/acme/plans/pulls")
            .collect();
        assert_eq!(opened.len(), 1, "{:?}", s.requests);
        assert_eq!(opened[0].auth, format!("Bearer {token}"));
        assert_eq!(opened[0].body["head"], branch.as_str());
        assert_eq!(opened[0].body["base"], "main");
        assert!(opened[0].body["body"]
            .as_str()
            .unwrap()
            .contains("layers.1.down"));
    }

    spark::same_evidence_and_proposal_on_spark(r, &cfg_s, &served, &proposed, quantmesh).await;

    // Merge (fast-forward), publish the merged file where the server polls, under traffic.
    let main_before = git(&bare, &["rev-parse", "main"]);
    let head = git(&bare, &["rev-parse", &branch]);
    git(&bare, &["merge-base", "--is-ancestor", &main_before, &head]);
    git(
        &bare,
        &["update-ref", "refs/heads/main", &head, &main_before],
    );
    let merged = r.join("merged.json");
    std::fs::write(&merged, git(&bare, &["show", "main:sensitive_layers.json"])).unwrap();
    let new_md5 = format!("{:x}", md5::compute(std::fs::read(&merged).unwrap()));

    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let served = serve.metric(&client, "quantmesh_requests_total", &[]).await;
    let load = tokio::spawn(traffic(serve.base.clone(), stop_rx));
    // Requests are flowing before the new plan is published...
    serve
        .wait_requests(&client, served + 2.0, Duration::from_secs(60))
        .await;
    let polls_before = serve
        .metric(&client, "quantmesh_config_polls_total", &[])
        .await;
    publish(&merged, &store, model_s);
    let t0 = Instant::now();
    let applied = loop {
        let c = admin_config(&client, &serve).await;
        if c["md5"] == new_md5.as_str() {
            break c;
        }
        assert!(t0.elapsed() < Duration::from_secs(60), "never applied: {c}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let polls = serve
        .metric(&client, "quantmesh_config_polls_total", &[])
        .await
        - polls_before;
    // ...and go on after it is applied.
    let served = serve.metric(&client, "quantmesh_requests_total", &[]).await;
    serve
        .wait_requests(&client, served + 2.0, Duration::from_secs(60))
        .await;
    stop_tx.send(true).unwrap();
    let load = load.await.unwrap();
    assert_eq!(applied["residency"]["layers.1.down"], "dual", "{applied}");
    // Applied by the first poll that could see it (the poll in flight at publish time may
    // have read the old version just before).
    assert!(polls <= 2.0, "took {polls} polls");
    assert!(load.ok > 0);
    assert_eq!(load.failed, 0, "requests failed during the reload");
    eprintln!(
        "loop closed: applied {:.2} s after publish ({polls} polls), {} requests served meanwhile",
        t0.elapsed().as_secs_f64(),
        load.ok
    );
}

/// A SIGTERM that arrives while a scheduled run is in progress is kept: the run finishes,
/// then the service stops (before, the signal was lost between waits and the service went
/// on to its next run). The run is held in its first step, cloning the plan repository from
/// a "git server" that accepts the connection and answers only when the test lets it go.
#[test]
fn a_sigterm_during_a_scheduled_run_stops_the_service_once_the_run_ends() {
    let root = tempfile::tempdir().unwrap();
    let r = root.path();
    let git_server = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let remote = format!("http://{}/plans.git", git_server.local_addr().unwrap());
    let cfg = r.join("quantmesh.toml");
    std::fs::write(
        &cfg,
        format!(
            r#"[evolution]
model = "synthetic"
lake = "{lake}"
listen = "127.0.0.1:0"
# every second: the first run starts at once
schedule = "* * * * * *"

[evolution.git]
remote = "{remote}"
"#,
            lake = r.join("lake").display()
        ),
    )
    .unwrap();
    let log = r.join("evolve.log");
    let f = std::fs::File::create(&log).unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_quantmesh"))
        .args(["evolve", "--config", cfg.to_str().unwrap()])
        .env("QUANTMESH_KAFKA_BROKERS", "")
        .stdout(f.try_clone().unwrap())
        .stderr(f)
        .stdin(Stdio::null())
        .spawn()
        .unwrap();
    let read_log = || std::fs::read_to_string(&log).unwrap_or_default();

    // The run has started once git is connected to the held server.
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let conn = git_server.accept().map(|(c, _)| c);
        let _ = tx.send(conn);
    });
    let conn = match rx.recv_timeout(Duration::from_secs(60)) {
        Ok(c) => c.unwrap(),
        Err(_) => {
            let _ = child.kill();
            panic!(
                "no scheduled run reached the git server; log:\n{}",
                read_log()
            );
        }
    };
    assert!(Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap()
        .success());
    // The service says it will finish the run first, and is still running while git waits.
    let deadline = Instant::now() + Duration::from_secs(30);
    while !read_log().contains("stop requested during a run") {
        assert!(
            Instant::now() < deadline,
            "the SIGTERM during the run was not seen; log:\n{}",
            read_log()
        );
        assert!(
            child.try_wait().unwrap().is_none(),
            "exited mid-run:\n{}",
            read_log()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(
        child.try_wait().unwrap().is_none(),
        "exited mid-run:\n{}",
        read_log()
    );

    // Let the run end (the clone fails): the service stops by itself, cleanly.
    drop(conn);
    let deadline = Instant::now() + Duration::from_secs(30);
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!(
                "the service did not stop after its run; log:\n{}",
                read_log()
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let text = read_log();
    assert!(status.success(), "exit {status}; log:\n{text}");
    assert!(text.contains("evolution run failed"), "{text}");
    assert!(text.contains("shutting down"), "{text}");
    // One run only: the service did not go on to wait for the next second's.
    assert_eq!(text.matches("next evolution run").count(), 1, "{text}");
}

/// With no plan repository and no `evolution.plan`, a run starts from the plan the engines
/// serve (the same config's `engine.sensitive_layers`), not from an empty plan: a dry run
/// over an empty lake proposes that plan unchanged, its bits and residencies included.
#[test]
fn a_run_without_a_plan_repository_starts_from_the_plan_the_engines_serve() {
    let root = tempfile::tempdir().unwrap();
    let (served, cfg, proposed) = (
        root.path().join("served.json"),
        root.path().join("quantmesh.toml"),
        root.path().join("proposed.json"),
    );
    let plan = r#"{"schema_version": 1, "groups": {"layers.1.down": {"class": "w4a16"},
                   "layers.0.qkv": {"class": "w8a8", "residency": "dual"}}}"#;
    std::fs::write(&served, plan).unwrap();
    let lake = root.path().join("lake");
    let toml = format!(
        "[engine]\nsensitive_layers = \"{}\"\n\n[evolution]\nlake = \"{}\"\n",
        served.display(),
        lake.display()
    );
    std::fs::write(&cfg, toml).unwrap();
    let (cfg, out_plan) = (cfg.to_str().unwrap(), proposed.to_str().unwrap());
    let args = [
        "evolve",
        "--once",
        "--dry-run",
        "--no-ingest",
        "--config",
        cfg,
    ];
    let more = ["--model", "served-model", "--plan-out", out_plan];
    let (ok, out) = quantmesh(&[&args[..], &more[..]].concat(), &[]);
    assert!(ok, "{out}");
    let plan: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&proposed).unwrap()).unwrap();
    assert_eq!(plan["groups"]["layers.1.down"]["class"], "w4a16", "{plan}");
    let qkv = &plan["groups"]["layers.0.qkv"]["residency"];
    assert_eq!(qkv, "dual", "{plan}");
}
