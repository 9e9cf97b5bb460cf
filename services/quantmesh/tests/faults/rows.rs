//! The fault suite's rows: one fault each, under load, with its expectation asserted and its
//! events recorded by identity for the table.

use crate::harness::*;
use crate::support::stack::{run, Stack, TOKEN};
use crate::support::{self, poll, sum_metric};
use std::collections::HashSet;
use std::path::Path;
use std::process::Command;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// What every row works with.
pub(crate) struct Ctx<'a> {
    pub(crate) stack: &'a Stack,
    pub(crate) client: reqwest::Client,
    pub(crate) toggler: Toggler,
    pub(crate) tmp: &'a Path,
}

impl Ctx<'_> {
    /// Both engines as they are now (an engine's address may change when it restarts or
    /// rejoins the network).
    fn engines(&self) -> (Engine, Engine) {
        (
            Engine::of(self.stack, "engine-1"),
            Engine::of(self.stack, "engine-2"),
        )
    }

    /// A gateway series' value summed over `labels`.
    async fn gateway_metric(&self, name: &str, labels: &[&str]) -> f64 {
        sum_metric(&self.stack.metrics(&self.client).await, name, labels)
    }

    /// `docker compose kill -s SIGNAL service`.
    fn signal(&self, service: &str, signal: &str) {
        run(&mut self.stack.cmd(&["kill", "-s", signal, service]));
    }

    /// Start `service` again and wait until it is healthy and the gateway routes to it.
    async fn restart(&self, service: &'static str) -> Engine {
        run(&mut self.stack.cmd(&["start", service]));
        self.stack
            .wait_healthy(&[service], Duration::from_secs(240));
        let e = Engine::of(self.stack, service);
        wait_gateway_sees(&self.client, self.stack, &e, 1.0).await;
        e
    }

    /// Start the broker (a no-op when it runs) and wait until it is healthy.
    fn broker_back(&self) {
        run(&mut self.stack.cmd(&["start", "kafka"]));
        self.stack
            .wait_healthy(&["kafka"], Duration::from_secs(120));
    }

    /// Both engines' outboxes empty (the broker has everything).
    async fn drained(&self) {
        let (e1, e2) = self.engines();
        e1.wait_drained(&self.client).await;
        e2.wait_drained(&self.client).await;
    }

    /// Requests the gateway has failed on `engine` as stalled.
    async fn stalled_on(&self, engine: &Engine) -> f64 {
        let label = format!("engine=\"{}\"", engine.name());
        self.gateway_metric(
            "quantmesh_gateway_engine_failures_total",
            &[&label, "kind=\"stalled\""],
        )
        .await
    }

    /// Until the gateway has failed a request on `engine` as stalled beyond the `before`
    /// it had counted; how long that took from `since`.
    async fn wait_stall_seen(&self, engine: &Engine, before: f64, since: Instant) -> Duration {
        poll(
            Duration::from_secs(60),
            Duration::from_millis(100),
            || async {
                match self.stalled_on(engine).await > before {
                    true => Ok(()),
                    false => Err(format!("no request failed as stalled on {}", engine.name())),
                }
            },
        )
        .await;
        since.elapsed()
    }
}

/// engine-1 SIGKILLed while it holds requests.
pub(crate) async fn engine_killed_under_load(cx: &mut Ctx<'_>) -> Row {
    let (e1, _) = cx.engines();
    let t_from = now_ms();
    let retried_label = format!("engine=\"{}\"", e1.name());
    let retries_before = cx
        .gateway_metric("quantmesh_gateway_retries_total", &[&retried_label])
        .await;
    // Two streams that have started on engine-1.
    let (streams, sent) =
        support::streams_on(&cx.client, &cx.stack.url(""), &e1.name(), 2, 400).await;
    let stop = Arc::new(AtomicBool::new(false));
    let traffic = load(cx.stack, 6, stop.clone());
    let created = cx.toggler.fire(&cx.client, cx.stack, 2).await;
    e1.wait_written(&cx.client).await;
    // Kill it while it holds requests that have not answered yet (beyond the streams).
    wait_outstanding(&cx.client, cx.stack, Some(&e1), 3.0).await;
    cx.signal("engine-1", "SIGKILL");
    let failed_streams = streams.len();
    for s in streams {
        support::assert_ends_with_engine_failed(s).await;
    }
    wait_gateway_sees(&cx.client, cx.stack, &e1, 0.0).await;
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
    let retried = cx
        .gateway_metric("quantmesh_gateway_retries_total", &[&retried_label])
        .await
        - retries_before;
    assert!(retried >= 1.0, "no request was retried after the kill");
    eprintln!("engine SIGKILL: {retried} requests retried on engine-2, {o:?}");
    cx.restart("engine-1").await;
    cx.drained().await;
    Row {
        fault: "engine SIGKILL under load",
        expected: "unstarted requests retried elsewhere; started streams end with engine_failed; no event lost",
        sent: o.sent + sent,
        failed: failed_streams,
        events: Some(Made::since(t_from, created)),
    }
}

/// engine-1 SIGKILLed while the broker is down and its outbox holds events.
pub(crate) async fn engine_killed_with_the_broker_down(cx: &mut Ctx<'_>) -> Row {
    let (e1, e2) = cx.engines();
    let t_from = now_ms();
    run(&mut cx.stack.cmd(&["stop", "kafka"]));
    let created = cx.toggler.fire(&cx.client, cx.stack, 1).await;
    for e in [&e1, &e2] {
        e.wait_written(&cx.client).await;
    }
    let held = e1
        .metric(&cx.client, "quantmesh_events_outbox_depth", &[])
        .await;
    assert!(
        held > 0.0,
        "engine-1's outbox holds the events made without a broker"
    );
    cx.signal("engine-1", "SIGKILL");
    let e1 = cx.restart("engine-1").await;
    assert_eq!(
        e1.metric(&cx.client, "quantmesh_events_outbox_depth", &[])
            .await,
        held,
        "the outbox reopened after SIGKILL with every event it held"
    );
    cx.broker_back();
    cx.drained().await;
    Row {
        fault: "engine SIGKILL with the broker down and events in its outbox",
        expected: "the outbox's events relayed after the restart; none lost",
        sent: 0,
        failed: 0,
        events: Some(Made::since(t_from, created)),
    }
}

/// engine-1 SIGKILLed in the middle of a burst of admin calls (each makes an event).
pub(crate) async fn engine_killed_during_a_burst_of_writes(cx: &mut Ctx<'_>) -> Row {
    let (e1, _) = cx.engines();
    let t_from = now_ms();
    let calls = Arc::new(AtomicUsize::new(0));
    let killer = {
        let (calls, cmd) = (
            calls.clone(),
            cx.stack.cmd(&["kill", "-s", "SIGKILL", "engine-1"]),
        );
        tokio::spawn(async move {
            while calls.load(Ordering::Relaxed) < 12 {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            let mut cmd = cmd;
            run(&mut cmd);
        })
    };
    let mut created = HashSet::new();
    let mut on_e1 = HashSet::new();
    for _ in 0..8 {
        for (engine, id) in cx.toggler.fire_tagged(&cx.client, cx.stack, &calls).await {
            if engine == e1.name() {
                on_e1.insert(id.clone());
            }
            created.insert(id);
        }
    }
    killer.await.unwrap();
    cx.restart("engine-1").await;
    cx.drained().await;
    Row {
        fault: "engine SIGKILL during a burst of writes",
        expected: "every event made durable before the kill relayed; only the killed engine's events still queued for its writer may be missing",
        sent: 0,
        failed: 0,
        events: Some(Made {
            may_lose: on_e1,
            ..Made::since(t_from, created)
        }),
    }
}

/// engine-1 stopped (SIGSTOP) under load: it accepts connections and answers nothing.
pub(crate) async fn engine_stalled_under_load(cx: &mut Ctx<'_>) -> Row {
    engine_cut_off_under_load(
        cx,
        |cx| cx.signal("engine-1", "SIGSTOP"),
        |cx| cx.signal("engine-1", "SIGCONT"),
        "engine stalled (SIGSTOP) under load",
        "its held requests fail with 504 engine_timeout within mesh.stall_timeout; nothing else fails or hangs",
    )
    .await
}

/// engine-1 cut off the stack's network (`docker network disconnect`) under load, then
/// connected again under its service names.
pub(crate) async fn engine_partitioned_under_load(cx: &mut Ctx<'_>) -> Row {
    let id = cx.stack.container("engine-1");
    let networks = cx.stack.inspect(
        "engine-1",
        "{{range $k, $v := .NetworkSettings.Networks}}{{$k}} {{end}}",
    );
    let net = networks.split_whitespace().next().unwrap().to_string();
    let (id2, net2) = (id.clone(), net.clone());
    engine_cut_off_under_load(
        cx,
        move |_| run(Command::new("docker").args(["network", "disconnect", &net, &id])),
        move |_| {
            run(Command::new("docker").args([
                "network", "connect", "--alias", "engine", "--alias", "engine-1", &net2, &id2,
            ]))
        },
        "gateway↔engine network partition under load",
        "its held requests fail with 504 engine_timeout within mesh.stall_timeout; found again by DNS after; nothing else fails or hangs",
    )
    .await
}

/// engine-1 made unreachable by `cut` while it holds requests, then back by `heal`: the
/// requests it held fail fast with `engine_timeout`, nothing else fails, nothing hangs.
async fn engine_cut_off_under_load<C, H, R>(
    cx: &mut Ctx<'_>,
    cut: C,
    heal: H,
    fault: &'static str,
    expected: &'static str,
) -> Row
where
    C: FnOnce(&Ctx<'_>) -> R,
    H: FnOnce(&Ctx<'_>) -> R,
{
    let (e1, _) = cx.engines();
    let t_from = now_ms();
    let stop = Arc::new(AtomicBool::new(false));
    let traffic = load(cx.stack, 4, stop.clone());
    wait_outstanding(&cx.client, cx.stack, Some(&e1), 1.0).await;
    let before = cx.stalled_on(&e1).await;
    cut(cx);
    let took = cx.wait_stall_seen(&e1, before, Instant::now()).await;
    // Admin calls fail fast on the unreachable engine; engine-2's events are made.
    let created: HashSet<String> = cx.toggler.fire_some(&cx.client, cx.stack, 1).await;
    heal(cx);
    // Its address may be new (a network rejoined): found again by DNS.
    let e1 = Engine::of(cx.stack, "engine-1");
    wait_gateway_sees(&cx.client, cx.stack, &e1, 1.0).await;
    stop.store(true, Ordering::Relaxed);
    let o = tokio::time::timeout(Duration::from_secs(180), traffic)
        .await
        .unwrap_or_else(|_| panic!("requests hung: {fault}"))
        .unwrap();
    assert_eq!(o.connection_errors, 0, "{fault}: {o:?}");
    assert_eq!(
        o.http_errors, o.timeouts,
        "{fault}: every failure is a 504 engine_timeout: {o:?}"
    );
    assert!(o.timeouts >= 1, "{fault}: the held requests failed: {o:?}");
    // mesh.stall_timeout is 10 s; health checks every second, each waiting up to a second.
    assert!(
        took < Duration::from_secs(25),
        "{fault}: seen after {took:?}"
    );
    eprintln!("{fault}: held requests failed after {took:?}, {o:?}");
    cx.drained().await;
    Row {
        fault,
        expected,
        sent: o.sent,
        failed: o.http_errors,
        events: Some(Made::since(t_from, created)),
    }
}

/// The broker stopped for a minute under load.
pub(crate) async fn broker_stopped_under_load(cx: &mut Ctx<'_>) -> Row {
    let (e1, e2) = cx.engines();
    let t_from = now_ms();
    let stop = Arc::new(AtomicBool::new(false));
    let traffic = load(cx.stack, 2, stop.clone());
    let t_down = Instant::now();
    run(&mut cx.stack.cmd(&["stop", "kafka"]));
    let created = cx.toggler.fire(&cx.client, cx.stack, 2).await;
    for e in [&e1, &e2] {
        e.wait_written(&cx.client).await;
    }
    // The relays have noticed.
    for e in [&e1, &e2] {
        poll(OUTAGE, Duration::from_millis(250), || async {
            match e.metric(&cx.client, "quantmesh_kafka_broker_up", &[]).await {
                0.0 => Ok(()),
                _ => Err(format!("{} never saw the broker down", e.service)),
            }
        })
        .await;
    }
    while t_down.elapsed() < OUTAGE {
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    cx.broker_back();
    cx.drained().await;
    stop.store(true, Ordering::Relaxed);
    let o = traffic.await.unwrap();
    assert_eq!(o.sent, o.ok, "serving goes on without the broker: {o:?}");
    Row {
        fault: "broker stopped for a minute under load",
        expected: "serving goes on; every event created in the outage delivered after",
        sent: o.sent,
        failed: o.sent - o.ok,
        events: Some(Made::since(t_from, created)),
    }
}

/// Completions sent straight to `engine` (not through the gateway): how many were not 200.
async fn serve_directly(cx: &Ctx<'_>, engine: &Engine, n: usize, what: &str) -> usize {
    let mut failed = 0;
    for i in 0..n {
        let r = cx
            .client
            .post(format!("http://{}:8080/v1/completions", engine.ip))
            .json(&serde_json::json!({"prompt": format!("{what} {i}:"), "max_tokens": 8}))
            .send()
            .await
            .unwrap();
        if r.status() != 200 {
            failed += 1;
        }
    }
    failed
}

/// engine-2's outbox filesystem filled up (by another file) with events waiting in it: first
/// below the reserve, then to ENOSPC.
pub(crate) async fn outbox_filesystem_full(cx: &mut Ctx<'_>, fs: &SmallFs) -> Row {
    let (e1, e2) = cx.engines();
    let t_from = now_ms();
    let (mut sent, mut failed) = (0, 0);
    // Events waiting in the outbox when the disk fills: the broker is stopped first.
    run(&mut cx.stack.cmd(&["stop", "kafka"]));
    let mut created = cx.toggler.fire(&cx.client, cx.stack, 1).await;
    for e in [&e1, &e2] {
        e.wait_written(&cx.client).await;
    }
    let waiting = e2
        .metric(&cx.client, "quantmesh_events_outbox_depth", &[])
        .await;
    assert!(
        waiting > 0.0,
        "engine-2's outbox holds the events of the outage"
    );
    let recorded_before = e2
        .metric(&cx.client, "quantmesh_events_recorded_total", &[])
        .await;
    let disk_full_before = e2.dropped(&cx.client, "disk_full").await;
    let mut may_drop = HashSet::new();
    // Below the reserve, then truly full (ENOSPC): engine-2 refuses and counts its events,
    // and serves.
    for (phase, fill) in [("below the reserve", false), ("ENOSPC", true)] {
        match fill {
            false => fs.fill_leaving(OUTBOX_RESERVE_BYTES / 2),
            true => fs.fill_to_enospc(),
        }
        for (engine, id) in cx
            .toggler
            .fire_tagged(&cx.client, cx.stack, &AtomicUsize::new(0))
            .await
        {
            if engine == e2.name() {
                may_drop.insert(id.clone());
            }
            created.insert(id);
        }
        e2.wait_written(&cx.client).await;
        sent += 4;
        failed += serve_directly(cx, &e2, 4, &format!("On a full disk ({phase})")).await;
        assert_eq!(
            failed, 0,
            "engine-2 serves with its outbox's filesystem {phase}"
        );
    }
    let counted_drops = e2.dropped(&cx.client, "disk_full").await - disk_full_before;
    assert!(
        counted_drops as usize >= may_drop.len(),
        "{} events made on the full filesystem, {counted_drops} counted as disk_full",
        may_drop.len()
    );
    assert_eq!(
        e2.metric(&cx.client, "quantmesh_events_recorded_total", &[])
            .await,
        recorded_before,
        "nothing is stored below the reserve"
    );
    // …and Prometheus alerts on the drops.
    poll(Duration::from_secs(90), Duration::from_secs(1), || async {
        let alerts = cx.stack.prom(&cx.client, "/api/v1/alerts").await;
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
    // A restart on the full filesystem (below the reserve): the outbox reopens with what it
    // held.
    fs.unfill_enospc();
    let held = e2
        .metric(&cx.client, "quantmesh_events_outbox_depth", &[])
        .await;
    run(&mut cx.stack.cmd(&["restart", "engine-2"]));
    cx.stack
        .wait_healthy(&["engine-2"], Duration::from_secs(240));
    let e2 = Engine::of(cx.stack, "engine-2");
    assert_eq!(
        e2.metric(&cx.client, "quantmesh_events_outbox_depth", &[])
            .await,
        held,
        "the outbox reopened on the full filesystem with every event it held"
    );
    wait_gateway_sees(&cx.client, cx.stack, &e2, 1.0).await;
    // Room again (no restart needed), then the broker: everything kept is delivered.
    fs.unfill();
    created.extend(cx.toggler.fire(&cx.client, cx.stack, 1).await);
    for e in [&e1, &e2] {
        e.wait_written(&cx.client).await;
    }
    cx.broker_back();
    cx.drained().await;
    for reason in ["storage_error", "unreadable", "writer_failed"] {
        assert_eq!(e2.dropped(&cx.client, reason).await, 0, "{reason}");
    }
    Row {
        fault: "outbox filesystem full (below the reserve, then ENOSPC), engine restarted on it",
        expected: "engine-2 serves; the events it cannot keep counted (disk_full) and alerted; outbox intact after restart; everything kept delivered",
        sent,
        failed,
        events: Some(Made {
            may_drop,
            counted_drops,
            ..Made::since(t_from, created)
        }),
    }
}

/// The gateway restarted under load.
pub(crate) async fn gateway_restarted_under_load(cx: &mut Ctx<'_>) -> Row {
    let stack = cx.stack;
    let started = |s: &str| stack.inspect(s, "{{.State.StartedAt}}");
    let engines_started = (started("engine-1"), started("engine-2"));
    let stop = Arc::new(AtomicBool::new(false));
    let traffic = load(stack, 4, stop.clone());
    // Under load first.
    wait_outstanding(&cx.client, stack, None, 2.0).await;
    run(&mut stack.cmd(&["restart", "gateway"]));
    // Back: ready, and serving again through the new process.
    poll(
        Duration::from_secs(60),
        Duration::from_millis(100),
        || async {
            let ready = cx.client.get(stack.url("/ready")).send().await;
            match ready.is_ok_and(|r| r.status() == 200) {
                true => Ok(()),
                false => Err("the gateway did not come back".to_string()),
            }
        },
    )
    .await;
    let r = cx
        .client
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
    Row {
        fault: "gateway restarted under load",
        expected: "engines unaffected; clients see connection errors only while it is down",
        sent: o.sent + 1,
        failed: o.connection_errors,
        events: None,
    }
}

/// The plan store unreachable during polls, then a bad plan published, then a good one.
pub(crate) async fn plan_store_faults(cx: &mut Ctx<'_>) -> Row {
    let (stack, client, tmp) = (cx.stack, cx.client.clone(), cx.tmp);
    let toggler = &cx.toggler;
    let (e1, e2) = (Engine::of(stack, "engine-1"), Engine::of(stack, "engine-2"));
    let stop = Arc::new(AtomicBool::new(false));
    let traffic = load(stack, 2, stop.clone());
    let groups = toggler.groups.clone();
    assert!(
        groups.len() >= 2,
        "two dual groups for two plans: {groups:?}"
    );
    // Published from this host through the S3 API without `--model`, as a careless
    // publisher would: only the schema is checked here, the engines check the rest.
    let publish = |name: &str, plan: serde_json::Value| -> String {
        let file = tmp.join(name);
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
                        false => Err(format!("plan {md5} not applied by both engines: {now:?}")),
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
    // The broker is up and the engines' outboxes have drained into it.
    cx.broker_back();
    cx.drained().await;
    Row {
        fault: "plan store unreachable during polls, then a bad plan, then a good one",
        expected: "serving goes on; the plan in force is kept through the outage and the bad plan (failed polls and the rejection counted); the good plan applied by every engine",
        sent: o.sent,
        failed: o.sent - o.ok,
        events: None,
    }
}
