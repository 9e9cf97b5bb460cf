//! The Kafka event path end to end, with real parts only: the `quantmesh` binary as a
//! process, a tansu broker process (Kafka protocol, memory storage), rdkafka consumer groups,
//! the JSON Schema files consumers get, a real Prometheus evaluating the alert rules.
//!
//! Ground truth for "nothing lost" is the engine's own decision counter
//! (`quantmesh_fallback_decisions_total`, counted by the monitor when it creates an event,
//! before any sink sees it), compared with the distinct `event_id`s consumed.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use quantmesh_outbox::{FullPolicy, Outbox};
use std::collections::HashSet;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};
use support::*;

fn schema(name: &str) -> jsonschema::Validator {
    let path = format!("{}/../../shared/schemas/{name}", env!("CARGO_MANIFEST_DIR"));
    let s: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    jsonschema::validator_for(&s).unwrap()
}

/// A config file with short Kafka timeouts (so outages are noticed within the test) and a
/// monitor that takes no decision on its own (the bundled model's planted outliers would
/// otherwise add events at a rate the test does not control; admin decisions still are
/// monitor decisions, published the same way).
fn config(dir: &Path, extra: &str) -> String {
    let p = dir.join("quantmesh.toml");
    std::fs::write(
        &p,
        format!(
            "[engine.monitor]\nk = 1e9\ntoken_k = 1e9\nrequest_kl_limit = 1e9\nshadow_sample_rate = 0.0\n\n[kafka]\nconnect_timeout = \"3s\"\ndelivery_timeout = \"2s\"\nshutdown_timeout = \"3s\"\n{extra}"
        ),
    )
    .unwrap();
    p.display().to_string()
}

/// A temp root with the bundled model, a broker (running or not yet) and the config file.
struct Fx {
    root: tempfile::TempDir,
    model: std::path::PathBuf,
    broker: Broker,
    cfg: String,
}

impl Fx {
    fn new(broker_running: bool, extra_kafka: &str) -> Fx {
        let root = tempfile::tempdir().unwrap();
        let model = model_dir(root.path());
        let broker = match broker_running {
            true => Broker::start(root.path()),
            false => Broker::absent(root.path()),
        };
        let cfg = config(root.path(), extra_kafka);
        Fx {
            root,
            model,
            broker,
            cfg,
        }
    }

    fn outbox(&self) -> std::path::PathBuf {
        self.root.path().join("outbox")
    }

    async fn serve(&self, env: &[(&str, &str)]) -> Serve {
        let mut all = vec![("QUANTMESH_CONFIG", self.cfg.as_str())];
        all.extend_from_slice(env);
        Serve::start(&self.model, &self.outbox(), &self.broker.addr(), &all).await
    }
}

/// Wait until the relay has emptied the outbox.
async fn drained(s: &Serve, c: &reqwest::Client) {
    s.wait_outbox_drained(c, Duration::from_secs(120)).await;
}

async fn wait_metric(
    s: &Serve,
    c: &reqwest::Client,
    name: &str,
    labels: &[&str],
    ok: impl Fn(f64) -> bool,
    within: Duration,
) -> f64 {
    let t0 = Instant::now();
    loop {
        let v = s.metric(c, name, labels).await;
        if ok(v) {
            return v;
        }
        assert!(t0.elapsed() < within, "{name}{labels:?} stuck at {v}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_thousand_events_reach_a_consumer_group_schema_valid() {
    let fx = Fx::new(true, "");
    let broker = &fx.broker;
    let plan = fx.root.path().join("sensitive_layers.json");
    std::fs::write(&plan, "{\"schema_version\": 1}").unwrap();
    let serve = fx
        .serve(&[
            ("QUANTMESH_SENSITIVE_LAYERS", plan.to_str().unwrap()),
            ("QUANTMESH_RELOAD_INTERVAL", "1h"),
        ])
        .await;
    let client = reqwest::Client::new();
    let consumer = consumer(&broker.addr(), "e2e-ten-thousand", TOPIC);

    let calls = fire_events(&client, &serve.base, 626).await;
    assert_eq!(calls, 16 * 626);
    let expected = serve.decisions(&client).await as usize;
    assert!(expected >= 10_000, "{expected} events");

    let seen = collect(&consumer, Duration::from_secs(180), |s| s.len() >= expected).await;
    assert_eq!(seen.len(), expected, "distinct events consumed vs created");
    let v = schema("fallback_event.v1.schema.json");
    for (id, m) in &seen {
        if let Err(e) = v.validate(&m.payload) {
            panic!(
                "event {id} is not valid against the schema: {e}\n{}",
                m.payload
            );
        }
        assert_eq!(m.headers["event-type"], "fallback");
        assert_eq!(m.headers["schema-version"], "1");
        assert_eq!(m.headers["content-type"], "application/json");
        let group = m.payload["group"].as_str().unwrap();
        assert_eq!(m.key, format!("quantmesh-tiny/{group}"));
    }
    assert_eq!(
        serve
            .metric(&client, "quantmesh_events_dropped_total", &[])
            .await,
        0.0
    );
    assert!(
        serve
            .metric(&client, "quantmesh_events_delivered_total", &["fallback"])
            .await
            >= expected as f64
    );

    // Config events go to their own topic: a rejected and an applied reload.
    let admin = |path: &str| client.post(serve.url(path)).bearer_auth(ADMIN_TOKEN).send();
    std::fs::write(&plan, "{\"schema_version\": 1, \"bogus\": true}").unwrap();
    assert_eq!(admin("/admin/config/reload").await.unwrap().status(), 422);
    let applied = "{ \"schema_version\": 1 }";
    std::fs::write(&plan, applied).unwrap();
    assert_eq!(admin("/admin/config/reload").await.unwrap().status(), 200);
    let cc = support::consumer(&broker.addr(), "e2e-config", CONFIG_TOPIC);
    let has = |s: &std::collections::HashMap<String, Consumed>, action: &str| {
        s.values().any(|m| m.payload["action"] == action)
    };
    let cfg_seen = collect(&cc, Duration::from_secs(60), |s| {
        has(s, "rejected") && has(s, "applied")
    })
    .await;
    assert!(
        has(&cfg_seen, "rejected") && has(&cfg_seen, "applied"),
        "{cfg_seen:?}"
    );
    let v = schema("config_event.v1.schema.json");
    let md5 = format!("{:x}", md5::compute(applied));
    for m in cfg_seen.values() {
        v.validate(&m.payload).unwrap();
        assert_eq!(m.headers["event-type"], "config");
        assert_eq!(m.key, "quantmesh-tiny/config");
        if m.payload["action"] == "applied" {
            assert_eq!(m.payload["md5"], md5.as_str());
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn broker_outage_loses_nothing_and_serving_goes_on() {
    let mut fx = Fx::new(true, "");
    let serve = fx.serve(&[]).await;
    let broker = &mut fx.broker;
    let client = reqwest::Client::new();
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let loads: Vec<_> = (0..2)
        .map(|_| tokio::spawn(traffic(serve.base.clone(), stop_rx.clone())))
        .collect();

    // Before: everything delivered and consumed (memory storage: the broker forgets it all
    // when stopped, so it is consumed first).
    fire_events(&client, &serve.base, 10).await;
    let before = serve.decisions(&client).await as usize;
    let c1 = consumer(&broker.addr(), "outage-before", TOPIC);
    let a = collect(&c1, Duration::from_secs(90), |s| s.len() >= before).await;
    assert_eq!(a.len(), before);
    drop(c1);

    broker.stop();
    let down_at = Instant::now();
    let during_calls = fire_events(&client, &serve.base, 20).await;
    assert_eq!(during_calls, 16 * 20, "admin calls kept succeeding");
    // Nothing can leave while the broker is down: every event of the outage piles up.
    wait_metric(
        &serve,
        &client,
        "quantmesh_events_outbox_depth",
        &[],
        |v| v >= 320.0,
        Duration::from_secs(30),
    )
    .await;
    wait_metric(
        &serve,
        &client,
        "quantmesh_kafka_broker_up",
        &[],
        |v| v == 0.0,
        Duration::from_secs(30),
    )
    .await;
    broker.restart();
    let up_at = Instant::now();
    fire_events(&client, &serve.base, 4).await;
    drained(&serve, &client).await;
    assert_eq!(
        serve
            .metric(&client, "quantmesh_kafka_broker_up", &[])
            .await,
        1.0
    );
    let total = serve.decisions(&client).await as usize;
    let c2 = consumer(&broker.addr(), "outage-after", TOPIC);
    let b = collect(&c2, Duration::from_secs(90), |s| a.len() + s.len() >= total).await;
    let all: HashSet<String> = ids(&a).union(&ids(&b)).cloned().collect();
    assert_eq!(all.len(), total, "every event created arrived");
    assert!(
        b.len() >= 16 * 24,
        "events produced during and after the outage arrived"
    );

    stop_tx.send(true).unwrap();
    let mut t = Traffic::default();
    for l in loads {
        let r = l.await.unwrap();
        t.ok += r.ok;
        t.failed += r.failed;
        t.latencies_ms.extend(r.latencies_ms);
    }
    assert_eq!(t.failed, 0, "requests failed during the outage");
    let during: Vec<f64> = t
        .latencies_ms
        .iter()
        .filter(|(at, _)| *at >= down_at && *at < up_at)
        .map(|(_, ms)| *ms)
        .collect();
    let outside: Vec<f64> = t
        .latencies_ms
        .iter()
        .filter(|(at, _)| *at < down_at || *at >= up_at)
        .map(|(_, ms)| *ms)
        .collect();
    assert!(!during.is_empty(), "no request completed during the outage");
    println!(
        "requests ok {}; latency ms p50/p99 with the broker up {:.1}/{:.1} ({} req), down {:.1}/{:.1} ({} req)",
        t.ok,
        percentile(&outside, 0.5),
        percentile(&outside, 0.99),
        outside.len(),
        percentile(&during, 0.5),
        percentile(&during, 0.99),
        during.len()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_mid_traffic_then_restart_relays_the_outbox() {
    let mut fx = Fx::new(true, "");
    let outbox = fx.outbox();
    let mut serve = fx.serve(&[]).await;
    let client = reqwest::Client::new();
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let load = tokio::spawn(traffic(serve.base.clone(), stop_rx.clone()));

    fire_events(&client, &serve.base, 6).await;
    let first = serve.decisions(&client).await as usize;
    let c1 = consumer(&fx.broker.addr(), "kill-before", TOPIC);
    let delivered = collect(&c1, Duration::from_secs(90), |s| s.len() >= first).await;
    assert_eq!(delivered.len(), first);
    drop(c1);

    // The broker goes away; events pile up in the outbox; then the engine is SIGKILLed
    // while requests are streaming.
    fx.broker.stop();
    fire_events(&client, &serve.base, 20).await;
    let created = serve.decisions(&client).await as usize;
    let recorded = wait_metric(
        &serve,
        &client,
        "quantmesh_events_recorded_total",
        &["fallback"],
        |v| v as usize >= created,
        Duration::from_secs(30),
    )
    .await as usize;
    assert_eq!(recorded, created);
    serve.kill();
    stop_tx.send(true).unwrap();
    let t = load.await.unwrap();
    assert!(t.ok > 0);

    // What the dead process left on disk.
    let left: HashSet<String> = {
        let ob = Outbox::open(&outbox, 1 << 30, FullPolicy::DropNewest).unwrap();
        ob.peek(usize::MAX)
            .into_iter()
            .map(|r| {
                let (_, rec) = r.unwrap();
                let v: serde_json::Value = serde_json::from_str(&rec.payload).unwrap();
                v["event_id"].as_str().unwrap().to_string()
            })
            .collect()
    };
    assert_eq!(
        left.len(),
        recorded - delivered.len(),
        "everything recorded and not yet delivered is in the outbox"
    );

    fx.broker.restart();
    let serve2 = fx.serve(&[]).await;
    let broker = &fx.broker;
    drained(&serve2, &client).await;
    let c2 = consumer(&broker.addr(), "kill-after", TOPIC);
    let after = collect(&c2, Duration::from_secs(90), |s| {
        left.iter().all(|id| s.contains_key(id))
    })
    .await;
    let missing: Vec<_> = left.iter().filter(|id| !after.contains_key(*id)).collect();
    assert!(
        missing.is_empty(),
        "{} outbox events never arrived",
        missing.len()
    );
    let all: HashSet<String> = ids(&delivered).union(&ids(&after)).cloned().collect();
    assert!(
        all.len() >= recorded,
        "arrived {} < recorded {recorded}",
        all.len()
    );
    println!(
        "created {created}, recorded {recorded}, delivered before the kill {}, left in the outbox {}, arrived in total {}",
        delivered.len(),
        left.len(),
        all.len()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn full_outbox_drops_the_newest_counts_and_fires_the_alert() {
    let mut fx = Fx::new(false, "outbox_max_bytes = 16384\n");
    let serve = fx.serve(&[]).await;
    let client = reqwest::Client::new();
    let prom = Prometheus::start(fx.root.path(), &format!("127.0.0.1:{}", serve.port));
    let t0 = Instant::now();
    loop {
        let v = prom.query(&client, "quantmesh_events_dropped_total").await;
        if v["data"]["result"]
            .as_array()
            .is_some_and(|r| !r.is_empty())
        {
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "prometheus never scraped the engine"
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }

    // First 16 events fit; the rest overflow the 16 KiB bound.
    fire_events(&client, &serve.base, 1).await;
    wait_metric(
        &serve,
        &client,
        "quantmesh_events_recorded_total",
        &["fallback"],
        |v| v >= 16.0,
        Duration::from_secs(30),
    )
    .await;
    // Event timestamps have millisecond resolution: step past the boundary so that no
    // second-phase event can carry the same millisecond as the last first-phase one.
    let first_phase_end = quantmesh_types::now_ms();
    tokio::time::sleep(Duration::from_millis(20)).await;
    fire_events_from(&client, &serve.base, 1, 6).await;
    let created = serve.decisions(&client).await as f64;
    wait_metric(
        &serve,
        &client,
        "quantmesh_events_dropped_total",
        &["outbox_full"],
        |v| v > 0.0,
        Duration::from_secs(30),
    )
    .await;
    // Both counters move until the writer has seen every event: read them together each
    // time (reading `dropped` once, at its first non-zero value, raced later drops).
    let t1 = Instant::now();
    let (recorded, dropped) = loop {
        let dropped = serve
            .metric(&client, "quantmesh_events_dropped_total", &["outbox_full"])
            .await;
        let recorded = serve
            .metric(&client, "quantmesh_events_recorded_total", &["fallback"])
            .await;
        if recorded + dropped >= created {
            break (recorded, dropped);
        }
        assert!(
            t1.elapsed() < Duration::from_secs(30),
            "recorded {recorded} + dropped {dropped} < created {created}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert_eq!(
        recorded + dropped,
        created,
        "every event recorded or counted as dropped"
    );
    assert!(
        serve
            .metric(&client, "quantmesh_events_outbox_bytes", &[])
            .await
            <= 16384.0
    );
    assert_eq!(
        serve
            .metric(&client, "quantmesh_kafka_broker_up", &[])
            .await,
        0.0
    );
    // Serving is unaffected.
    let r = client
        .post(serve.url("/v1/completions"))
        .json(&serde_json::json!({"prompt": "Hi", "max_tokens": 4}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);

    // The alert fires in a real Prometheus, and its runbook link resolves: the engine it
    // scraped serves the section the link names.
    let t0 = Instant::now();
    loop {
        let firing = prom.alerts(&client).await.into_iter().find(|a| {
            a["labels"]["alertname"] == "QuantmeshEventsDropped"
                && a["labels"]["reason"] == "outbox_full"
                && a["state"] == "firing"
        });
        if let Some(alert) = firing {
            let url = alert["annotations"]["runbook_url"].as_str().unwrap_or("");
            let (page, anchor) = url
                .split_once('#')
                .unwrap_or_else(|| panic!("runbook_url {url:?} has no anchor"));
            let r = client.get(page).send().await.unwrap();
            assert_eq!(r.status(), 200, "{url}");
            let body = r.text().await.unwrap();
            assert!(
                body.contains(&format!("<h2 id=\"{anchor}\">QuantmeshEventsDropped</h2>")),
                "{url}: no such section"
            );
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "alert did not fire: {:?}",
            prom.alerts(&client).await
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }

    // drop_newest: once a broker is there, what was kept is delivered, and it is the
    // oldest events (all 16 of the first phase).
    fx.broker.restart();
    drained(&serve, &client).await;
    let c = consumer(&fx.broker.addr(), "full-outbox", TOPIC);
    let got = collect(&c, Duration::from_secs(60), |s| s.len() as f64 >= recorded).await;
    assert_eq!(got.len() as f64, recorded);
    let mut stamps: Vec<i64> = got
        .values()
        .map(|m| {
            let t = m.payload["timestamp_ms"]
                .as_u64()
                .unwrap_or_else(|| panic!("an event without timestamp_ms: {}", m.payload));
            t as i64 - first_phase_end as i64
        })
        .collect();
    stamps.sort_unstable();
    let early = stamps.iter().filter(|&&t| t <= 0).count();
    assert_eq!(
        early, 16,
        "the first events were kept; delivered {} (recorded {recorded}, dropped {dropped}, created {created}), ms after the first phase: {stamps:?}",
        got.len()
    );
}

#[test]
fn alert_rules_are_valid_and_unit_tested() {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../../infra/prometheus");
    for args in [
        &["check", "rules", "alerts.yml"][..],
        &["test", "rules", "alerts_test.yml"],
    ] {
        let out = Command::new("promtool")
            .args(args)
            .current_dir(dir)
            .output()
            .expect(
                "promtool not found: ./scripts/test.sh installs the Debian package `prometheus`",
            );
        assert!(
            out.status.success(),
            "promtool {args:?}:\n{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_tail_prints_json_lines_and_tables_and_resumes_a_group() {
    let fx = Fx::new(true, "");
    let broker = &fx.broker;
    let serve = fx.serve(&[]).await;
    let client = reqwest::Client::new();
    fire_events(&client, &serve.base, 1).await;
    let n = serve.decisions(&client).await;
    assert_eq!(n, 16);
    wait_metric(
        &serve,
        &client,
        "quantmesh_events_delivered_total",
        &["fallback"],
        |v| v >= 16.0,
        Duration::from_secs(60),
    )
    .await;

    let tail = |args: &[&str]| {
        let out = Command::new(env!("CARGO_BIN_EXE_quantmesh"))
            .args([
                "events",
                "tail",
                "--brokers",
                &broker.addr(),
                "--idle-timeout",
                "30s",
            ])
            .args(args)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).unwrap()
    };
    let json = tail(&["--from-beginning", "--limit", "16", "--group", "people"]);
    let ids: HashSet<String> = json
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            v["event_id"].as_str().unwrap().to_string()
        })
        .collect();
    assert_eq!(ids.len(), 16);

    let table = tail(&["--from-beginning", "--limit", "16", "--format", "table"]);
    let lines: Vec<&str> = table.lines().collect();
    assert_eq!(lines.len(), 17, "{table}");
    assert!(lines[0].starts_with("TIME") && lines[0].contains("GROUP"));
    assert!(lines[1..]
        .iter()
        .all(|l| l.contains("quantmesh-tiny") && l.contains("admin")));

    // The same group continues after its committed offsets: only the new events.
    fire_events_from(&client, &serve.base, 1, 1).await;
    wait_metric(
        &serve,
        &client,
        "quantmesh_events_delivered_total",
        &["fallback"],
        |v| v >= 32.0,
        Duration::from_secs(60),
    )
    .await;
    let json = tail(&["--from-beginning", "--limit", "16", "--group", "people"]);
    let again: HashSet<String> = json
        .lines()
        .map(|l| {
            serde_json::from_str::<serde_json::Value>(l).unwrap()["event_id"]
                .as_str()
                .unwrap()
                .to_string()
        })
        .collect();
    assert_eq!(again.len(), 16);
    assert!(
        again.is_disjoint(&ids),
        "a group resumes after its committed offsets"
    );
}

#[test]
fn required_kafka_that_is_unreachable_stops_start_up_with_a_clear_error() {
    let root = tempfile::tempdir().unwrap();
    let cfg = config(root.path(), "required = true\n");
    let port = free_port();
    let out = Command::new(env!("CARGO_BIN_EXE_quantmesh"))
        .args([
            "serve",
            "--port",
            "0",
            "--kafka-brokers",
            &format!("127.0.0.1:{port}"),
        ])
        // The model is never written: the broker check comes first.
        .args(["--model", "bundled:tiny", "--models-dir"])
        .arg(root.path().join("models"))
        .arg("--outbox-dir")
        .arg(root.path().join("outbox"))
        .env("QUANTMESH_CONFIG", &cfg)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("Kafka broker unreachable") && err.contains("kafka.required"),
        "{err}"
    );
    assert!(
        !root.path().join("models").exists(),
        "stopped before the model"
    );
}
