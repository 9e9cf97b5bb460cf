//! The fault suite: the compose test stack in real containers (gateway, two engines serving
//! the real model, tansu for Kafka, Prometheus, the S3 server), with one fault at a time
//! under load, each with its stated expectation and a counted result:
//!
//! - **engine SIGKILL** with requests in flight: requests that had received no byte are
//!   retried on the other engine (the gateway's retry counter moves), streams already
//!   started end with the documented `engine_failed` error event, nothing hangs, and the
//!   events the killed engine had recorded are relayed after its restart;
//! - **broker outage** of a minute under load: serving goes on, and every event created
//!   during the outage reaches the topic after the broker is back (once each after
//!   deduplication on `event_id`);
//! - **outbox filesystem full** (engine-2's outbox on a 64 MiB tmpfs, filled by another
//!   file): serving goes on, the events it cannot keep are counted (`disk_full`) and alerted
//!   by Prometheus, the engine restarts on the full filesystem with its stored events intact,
//!   and once there is room every event it kept is delivered;
//! - **gateway restart** under load: the engines are not restarted, and clients see
//!   connection errors only while the gateway is down (no HTTP error status);
//! - **plan store** unreachable during polls, then a bad plan published, then a good one:
//!   the plan in force is kept through both (failed polls and the rejection counted), and the
//!   good plan is applied by every engine without a restart.
//!
//! Events are the admin-forced fallbacks (one per engine per call, each engine's
//! `quantmesh_fallback_decisions_total{reason="admin"}` counts them when they are created);
//! a fault's events are the admin events on the topic timestamped within its window. Waits
//! are on conditions (health, metrics, the topic), never fixed sleeps; the broker outage
//! lasts a minute because a minute is the fault. The table printed at the end is the one in
//! the README's operations section.
//!
//! Needs a Docker engine and root (to mount the small filesystem); `QUANTMESH_SKIP_DOCKER=1`
//! skips it with a message, like the other container tests.

#![allow(clippy::unwrap_used, clippy::expect_used)]

#[path = "faults/harness.rs"]
mod harness;
mod support;

use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use harness::*;
use support::stack::{build_images, docker_available, model_copy, run, Stack, TOKEN};
use support::{poll, sum_metric};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_stack_loses_nothing_under_faults() {
    if !docker_available() {
        return;
    }
    let t_all = Instant::now();
    let tmp = tempfile::tempdir().unwrap();
    build_images(tmp.path());
    let models = model_copy(tmp.path());
    let fs = SmallFs::mount(tmp.path(), OUTBOX_FS_BYTES);
    let overlay = tmp.path().join("compose.faults.yml");
    std::fs::write(
        &overlay,
        format!(
            "services:\n  engine-2:\n    volumes:\n      - {}:/var/lib/quantmesh/outbox\n    environment:\n      QUANTMESH_OUTBOX_MIN_FREE_BYTES: \"{OUTBOX_RESERVE_BYTES}\"\n",
            fs.dir.display()
        ),
    )
    .unwrap();
    let stack = Stack::new(&models, &[&overlay]);
    // Everything but the evolution service (not under test here).
    run(&mut stack.cmd(&["up", "-d", "--no-build", "gateway", "prometheus"]));
    let services = [
        "minio",
        "kafka",
        "engine-1",
        "engine-2",
        "gateway",
        "prometheus",
    ];
    stack.wait_healthy(&services, Duration::from_secs(300));
    let client = reqwest::Client::new();
    let (e1, e2) = (
        Engine::of(&stack, "engine-1"),
        Engine::of(&stack, "engine-2"),
    );
    wait_gateway_sees(&client, &stack, &e1, 1.0).await;
    wait_gateway_sees(&client, &stack, &e2, 1.0).await;
    let mut toggler = Toggler {
        groups: dual_groups(&client, &stack, 4).await,
        calls: 0,
    };
    let mut rows = Vec::new();

    // 1. engine-1 SIGKILLed with requests in flight.
    {
        let t_from = now_ms();
        let before = e1.admin_events(&client).await + e2.admin_events(&client).await;
        // Two streams that have started on engine-1.
        let (streams, sent) =
            support::streams_on(&client, &stack.url(""), &e1.name(), 2, 400).await;
        let stop = Arc::new(AtomicBool::new(false));
        let traffic = load(&stack, 6, stop.clone());
        toggler.fire(&client, &stack, 2).await;
        let created = e1.admin_events(&client).await + e2.admin_events(&client).await - before;
        e1.wait_written(&client).await;
        // Kill it while it holds requests that have not answered yet (beyond the streams).
        wait_outstanding(&client, &stack, Some(&e1), 3.0).await;
        run(&mut stack.cmd(&["kill", "-s", "SIGKILL", "engine-1"]));
        let failed_streams = streams.len();
        for s in streams {
            support::assert_ends_with_engine_failed(s).await;
        }
        wait_gateway_sees(&client, &stack, &e1, 0.0).await;
        stop.store(true, Ordering::Relaxed);
        let o = tokio::time::timeout(Duration::from_secs(180), traffic)
            .await
            .expect("requests hung after the engine was killed")
            .unwrap();
        assert_eq!(
            (o.http_errors, o.connection_errors),
            (0, 0),
            "every request that had not started succeeds on engine-2: {o:?}"
        );
        let m = stack.metrics(&client).await;
        let retried = sum_metric(
            &m,
            "quantmesh_gateway_retries_total",
            &[&format!("engine=\"{}\"", e1.name())],
        );
        assert!(
            retried >= 1.0,
            "no request was retried after the kill:\n{m}"
        );
        eprintln!("engine SIGKILL: {retried} requests retried on engine-2, {o:?}");
        run(&mut stack.cmd(&["start", "engine-1"]));
        stack.wait_healthy(&["engine-1"], Duration::from_secs(240));
        let e1_back = Engine::of(&stack, "engine-1");
        wait_gateway_sees(&client, &stack, &e1_back, 1.0).await;
        e1_back.wait_drained(&client).await;
        e2.wait_drained(&client).await;
        let (ids, read) = topic_events(&stack, t_from, now_ms());
        rows.push(Row {
            fault: "engine SIGKILL under load",
            expected: "unstarted requests retried elsewhere; started streams end with engine_failed; recorded events relayed after restart",
            sent: o.sent + sent,
            failed: failed_streams,
            events: Some(Events {
                created,
                dropped: 0,
                delivered: ids.len(),
                duplicates: read - ids.len(),
            }),
        });
    }
    let e1 = Engine::of(&stack, "engine-1");

    // 2. The broker stopped for a minute under load.
    {
        let t_from = now_ms();
        let before = e1.admin_events(&client).await + e2.admin_events(&client).await;
        let stop = Arc::new(AtomicBool::new(false));
        let traffic = load(&stack, 2, stop.clone());
        let t_down = Instant::now();
        run(&mut stack.cmd(&["stop", "kafka"]));
        toggler.fire(&client, &stack, 2).await;
        let created = e1.admin_events(&client).await + e2.admin_events(&client).await - before;
        for e in [&e1, &e2] {
            e.wait_written(&client).await;
        }
        // The relays have noticed.
        for e in [&e1, &e2] {
            poll(OUTAGE, Duration::from_millis(250), || async {
                match e.metric(&client, "quantmesh_kafka_broker_up", &[]).await {
                    0.0 => Ok(()),
                    _ => Err(format!("{} never saw the broker down", e.service)),
                }
            })
            .await;
        }
        while t_down.elapsed() < OUTAGE {
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        run(&mut stack.cmd(&["start", "kafka"]));
        stack.wait_healthy(&["kafka"], Duration::from_secs(120));
        e1.wait_drained(&client).await;
        e2.wait_drained(&client).await;
        stop.store(true, Ordering::Relaxed);
        let o = traffic.await.unwrap();
        assert_eq!(o.sent, o.ok, "serving goes on without the broker: {o:?}");
        let (ids, read) = topic_events(&stack, t_from, now_ms());
        rows.push(Row {
            fault: "broker stopped for a minute under load",
            expected:
                "serving goes on; every event created in the outage delivered once after dedup",
            sent: o.sent,
            failed: o.sent - o.ok,
            events: Some(Events {
                created,
                dropped: 0,
                delivered: ids.len(),
                duplicates: read - ids.len(),
            }),
        });
    }

    // 3. engine-2's outbox filesystem filled up (by another file) with events waiting in it.
    {
        let t_from = now_ms();
        let mut created = 0;
        let mut sent = 0;
        let mut failed = 0;
        let before = e1.admin_events(&client).await + e2.admin_events(&client).await;
        // Events waiting in the outbox when the disk fills: the broker is stopped first.
        run(&mut stack.cmd(&["stop", "kafka"]));
        toggler.fire(&client, &stack, 1).await;
        for e in [&e1, &e2] {
            e.wait_written(&client).await;
        }
        let waiting = e2
            .metric(&client, "quantmesh_events_outbox_depth", &[])
            .await;
        assert!(
            waiting > 0.0,
            "engine-2's outbox holds the events of the outage"
        );
        fs.fill_leaving(OUTBOX_RESERVE_BYTES / 2);
        let before_full = e2.admin_events(&client).await;
        let recorded_before = e2
            .metric(&client, "quantmesh_events_recorded_total", &[])
            .await;
        toggler.fire(&client, &stack, 1).await;
        // Every event engine-2 makes on the full filesystem is refused and counted
        // (`disk_full` also counts its monitor's window events of the time).
        let refused = e2.admin_events(&client).await - before_full;
        let disk_full = poll(
            Duration::from_secs(60),
            Duration::from_millis(200),
            || async {
                let n = e2.dropped(&client, "disk_full").await;
                match n >= refused {
                    true => Ok(n),
                    false => Err(format!(
                        "{refused} events made on the full filesystem, {n} counted as disk_full"
                    )),
                }
            },
        )
        .await;
        assert_eq!(
            e2.metric(&client, "quantmesh_events_recorded_total", &[])
                .await,
            recorded_before,
            "nothing is stored below the reserve ({disk_full} refused)"
        );
        // Serving goes on.
        for i in 0..4 {
            sent += 1;
            let r = client
                .post(stack.url("/v1/completions"))
                .json(
                    &serde_json::json!({"prompt": format!("On a full disk {i}:"), "max_tokens": 8}),
                )
                .send()
                .await
                .unwrap();
            if r.status() != 200 {
                failed += 1;
            }
        }
        // …and Prometheus alerts on the drops.
        poll(Duration::from_secs(90), Duration::from_secs(1), || async {
            let alerts = stack.prom(&client, "/api/v1/alerts").await;
            let firing = alerts["data"]["alerts"]
                .as_array()
                .unwrap()
                .iter()
                .any(|a| {
                    a["labels"]["alertname"] == "QuantmeshEventsDropped"
                        && a["labels"]["reason"] == "disk_full"
                        && a["state"] == "firing"
                });
            match firing {
                true => Ok(()),
                false => Err(format!("no disk_full alert: {alerts}")),
            }
        })
        .await;
        // A restart on the full filesystem: the outbox reopens with what it held.
        created += e1.admin_events(&client).await + e2.admin_events(&client).await - before;
        let held = e2
            .metric(&client, "quantmesh_events_outbox_depth", &[])
            .await;
        run(&mut stack.cmd(&["restart", "engine-2"]));
        stack.wait_healthy(&["engine-2"], Duration::from_secs(240));
        let e2b = Engine::of(&stack, "engine-2");
        assert_eq!(
            e2b.metric(&client, "quantmesh_events_outbox_depth", &[])
                .await,
            held,
            "the outbox reopened on the full filesystem with every event it held"
        );
        wait_gateway_sees(&client, &stack, &e2b, 1.0).await;
        // Room again (no restart needed), then the broker: everything kept is delivered.
        fs.unfill();
        let before = e1.admin_events(&client).await;
        toggler.fire(&client, &stack, 1).await;
        created += e1.admin_events(&client).await - before + e2b.admin_events(&client).await;
        for e in [&e1, &e2b] {
            e.wait_written(&client).await;
        }
        run(&mut stack.cmd(&["start", "kafka"]));
        stack.wait_healthy(&["kafka"], Duration::from_secs(120));
        e1.wait_drained(&client).await;
        e2b.wait_drained(&client).await;
        for reason in ["storage_error", "unreadable", "writer_failed"] {
            assert_eq!(e2b.dropped(&client, reason).await, 0, "{reason}");
        }
        let (ids, read) = topic_events(&stack, t_from, now_ms());
        rows.push(Row {
            fault: "outbox filesystem full, engine restarted on it",
            expected: "serving goes on; drops counted (disk_full) and alerted; outbox intact after restart",
            sent,
            failed,
            events: Some(Events {
                created,
                dropped: refused,
                delivered: ids.len(),
                duplicates: read - ids.len(),
            }),
        });
    }

    // 4. The gateway restarted under load.
    {
        let started = |s: &str| stack.inspect(s, "{{.State.StartedAt}}");
        let engines_started = (started("engine-1"), started("engine-2"));
        let stop = Arc::new(AtomicBool::new(false));
        let traffic = load(&stack, 4, stop.clone());
        // Under load first.
        wait_outstanding(&client, &stack, None, 2.0).await;
        run(&mut stack.cmd(&["restart", "gateway"]));
        // Back: ready, and serving again through the new process.
        poll(
            Duration::from_secs(60),
            Duration::from_millis(100),
            || async {
                let ready = client.get(stack.url("/ready")).send().await;
                match ready.is_ok_and(|r| r.status() == 200) {
                    true => Ok(()),
                    false => Err("the gateway did not come back".to_string()),
                }
            },
        )
        .await;
        let r = client
            .post(stack.url("/v1/completions"))
            .json(&serde_json::json!({"prompt": "After the restart", "max_tokens": 8}))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        stop.store(true, Ordering::Relaxed);
        let o = traffic.await.unwrap();
        assert_eq!(
            o.http_errors, 0,
            "clients see connection errors only: {o:?}"
        );
        assert_eq!(
            (started("engine-1"), started("engine-2")),
            engines_started,
            "the engines were not restarted"
        );
        rows.push(Row {
            fault: "gateway restarted under load",
            expected: "engines unaffected; clients see connection errors only while it is down",
            sent: o.sent + 1,
            failed: o.connection_errors,
            events: None,
        });
    }

    // 5. The plan store unreachable during polls, then a bad plan, then a good one.
    {
        let (e1, e2) = (
            Engine::of(&stack, "engine-1"),
            Engine::of(&stack, "engine-2"),
        );
        let stop = Arc::new(AtomicBool::new(false));
        let traffic = load(&stack, 2, stop.clone());
        let groups = toggler.groups.clone();
        assert!(
            groups.len() >= 2,
            "two dual groups for two plans: {groups:?}"
        );
        // Published from this host through the S3 API without `--model`, as a careless
        // publisher would: only the schema is checked here, the engines check the rest.
        let publish = |name: &str, plan: serde_json::Value| -> String {
            let file = tmp.path().join(name);
            let bytes = serde_json::to_vec_pretty(&plan).unwrap();
            std::fs::write(&file, &bytes).unwrap();
            run(Command::new(env!("CARGO_BIN_EXE_quantmesh"))
                .args(["plan", "publish"])
                .arg(&file)
                .args(["--to", "s3://quantmesh/plans"])
                .env("AWS_ENDPOINT", format!("http://127.0.0.1:{}", stack.s3))
                .env("AWS_ALLOW_HTTP", "true")
                .env("AWS_REGION", "us-east-1")
                .env("AWS_ACCESS_KEY_ID", support::stack::S3_USER)
                .env("AWS_SECRET_ACCESS_KEY", &stack.s3_secret));
            format!("{:x}", md5::compute(&bytes))
        };
        let float = |group: &str| {
            serde_json::json!({"schema_version": 1,
                               "groups": {group: {"class": "fp16", "residency": "float"}}})
        };
        let in_force = || async {
            let cfg = support::get_json(&client, &stack.url("/admin/config"), TOKEN).await;
            let md5s: Vec<String> = cfg["engines"]
                .as_array()
                .unwrap()
                .iter()
                .map(|e| e["body"]["md5"].as_str().unwrap_or("").to_string())
                .collect();
            md5s
        };
        let wait_in_force = |md5: String| {
            let in_force = &in_force;
            poll(
                Duration::from_secs(60),
                Duration::from_millis(250),
                move || {
                    let md5 = md5.clone();
                    async move {
                        let now = in_force().await;
                        match now.len() == 2 && now.iter().all(|m| *m == md5) {
                            true => Ok(()),
                            false => {
                                Err(format!("plan {md5} not applied by both engines: {now:?}"))
                            }
                        }
                    }
                },
            )
        };
        // Both engines' `quantmesh_config_reloads_total{result}`.
        let reloads = |result: &'static str| {
            let (e1, e2, client) = (e1.clone(), e2.clone(), client.clone());
            async move {
                let label = format!("result=\"{result}\"");
                let one = |e: Engine| {
                    let (client, label) = (client.clone(), label.clone());
                    async move {
                        e.metric(&client, "quantmesh_config_reloads_total", &[&label])
                            .await
                    }
                };
                (one(e1).await, one(e2).await)
            }
        };
        // Until both engines have counted more `result`s than `before`.
        let wait_counted = |result: &'static str, before: (f64, f64), what: String| {
            poll(
                Duration::from_secs(60),
                Duration::from_millis(250),
                move || {
                    let what = what.clone();
                    async move {
                        let now = reloads(result).await;
                        match now.0 > before.0 && now.1 > before.1 {
                            true => Ok(()),
                            false => Err(format!("{what}: {before:?} -> {now:?}")),
                        }
                    }
                },
            )
        };
        let first = publish("plan-first.json", float(&groups[0]));
        wait_in_force(first.clone()).await;

        // The store goes away: polls fail (each gives up after 10 s) and are counted; the plan
        // in force stays.
        let failed_before = reloads("fetch_error").await;
        run(&mut stack.cmd(&["stop", "minio"]));
        wait_counted(
            "fetch_error",
            failed_before,
            "failed polls not counted".into(),
        )
        .await;
        assert_eq!(in_force().await, [first.clone(), first.clone()]);
        run(&mut stack.cmd(&["start", "minio"]));
        stack.wait_healthy(&["minio"], Duration::from_secs(60));

        // A plan naming a group the model does not have: rejected by every engine, counted,
        // the old plan kept.
        let rejected_before = reloads("rejected").await;
        let bad = publish("plan-bad.json", float("layers.99.down"));
        wait_counted(
            "rejected",
            rejected_before,
            format!("the bad plan {bad} was not rejected by both engines"),
        )
        .await;
        assert_eq!(in_force().await, [first.clone(), first]);

        // A good one: applied by every engine, no restart.
        let good = publish("plan-good.json", float(&groups[1]));
        wait_in_force(good).await;
        stop.store(true, Ordering::Relaxed);
        let o = traffic.await.unwrap();
        assert_eq!(
            o.sent, o.ok,
            "serving goes on through the plan store's faults: {o:?}"
        );
        rows.push(Row {
            fault: "plan store unreachable during polls, then a bad plan, then a good one",
            expected: "serving goes on; the plan in force is kept through the outage and the bad plan (failed polls and the rejection counted); the good plan applied by every engine",
            sent: o.sent,
            failed: o.sent - o.ok,
            events: None,
        });
    }

    let mut table = String::from(
        "| fault | expectation | requests sent | failed | events created | dropped (counted) | delivered | duplicates before dedup | lost |\n|---|---|---|---|---|---|---|---|---|\n",
    );
    for r in &rows {
        let events = match &r.events {
            Some(e) => format!(
                "{} | {} | {} | {} | {}",
                e.created,
                e.dropped,
                e.delivered,
                e.duplicates,
                e.lost()
            ),
            None => "— | — | — | — | —".into(),
        };
        table.push_str(&format!(
            "| {} | {} | {} | {} | {events} |\n",
            r.fault, r.expected, r.sent, r.failed
        ));
    }
    eprintln!(
        "fault suite ({:.0} s):\n{table}",
        t_all.elapsed().as_secs_f64()
    );
    for r in &rows {
        if let Some(e) = &r.events {
            assert_eq!(e.lost(), 0, "events lost under '{}':\n{table}", r.fault);
        }
    }
}
