//! Real parts for the Kafka tests: a tansu broker process, the `quantmesh` binary as a
//! process, a consumer group, metrics scraped over HTTP, a Prometheus server.

#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use rdkafka::consumer::{Consumer, StreamConsumer};
use rdkafka::message::Headers;
use rdkafka::{ClientConfig, Message};
use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::{Duration, Instant};

pub use quantmesh_testkit::metrics::{scrape_text as scrape, sum_metric};
#[allow(unused_imports)] // each test binary uses its share
pub use quantmesh_testkit::parts::{free_port, tansu_bin, wait_tcp, Broker, Prometheus};
pub use quantmesh_testkit::process::Process;
#[allow(unused_imports)] // each test binary uses its share
pub use quantmesh_testkit::{get_json, poll};

pub const ADMIN_TOKEN: &str = "kafka-test-token";
pub const TOPIC: &str = quantmesh_kafka::DEFAULT_TOPIC;
pub const CONFIG_TOPIC: &str = quantmesh_kafka::DEFAULT_CONFIG_TOPIC;

/// Streaming completions sent to `base` (a gateway) until `want` of them started on the
/// engine named `engine` (`x-quantmesh-engine`); each is returned after its first chunk, with
/// the number of requests sent. The others are read to their end in the background (they
/// keep the other engines busy).
pub async fn streams_on(
    client: &reqwest::Client,
    base: &str,
    engine: &str,
    want: usize,
    max_tokens: usize,
) -> (Vec<reqwest::Response>, usize) {
    let (mut streams, mut sent) = (Vec::new(), 0);
    while streams.len() < want {
        sent += 1;
        let mut r = client
            .post(format!("{base}/v1/completions"))
            .json(
                &serde_json::json!({"prompt": "Tell a long story", "max_tokens": max_tokens,
                                      "stream": true, "ignore_eos": true}),
            )
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        let on = r.headers()["x-quantmesh-engine"]
            .to_str()
            .unwrap()
            .to_string();
        let first = r.chunk().await.unwrap().unwrap();
        assert!(!first.is_empty());
        if on == engine {
            streams.push(r);
        } else {
            tokio::spawn(async move { while let Ok(Some(_)) = r.chunk().await {} });
        }
    }
    (streams, sent)
}

/// The rest of a stream whose engine was killed: it must end (within 60 s) with the
/// `engine_failed` error event and without `[DONE]`.
pub async fn assert_ends_with_engine_failed(mut r: reqwest::Response) {
    let rest = tokio::time::timeout(Duration::from_secs(60), async {
        let mut text = String::new();
        while let Ok(Some(b)) = r.chunk().await {
            text.push_str(&String::from_utf8_lossy(&b));
        }
        text
    })
    .await
    .expect("a stream on the killed engine hung");
    assert!(
        rest.contains("\"engine_failed\"") && !rest.contains("[DONE]"),
        "a started stream ends with the engine_failed error event: {rest}"
    );
}

/// The real `quantmesh serve` as a child process (the kit's [`Process`]).
pub struct Serve(Process);

impl std::ops::Deref for Serve {
    type Target = Process;
    fn deref(&self) -> &Process {
        &self.0
    }
}

impl std::ops::DerefMut for Serve {
    fn deref_mut(&mut self) -> &mut Process {
        &mut self.0
    }
}

/// `quantmesh` with the settings every test process shares.
pub fn quantmesh(args: &[&str]) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_quantmesh"));
    cmd.args(args)
        .env("QUANTMESH_ADMIN_TOKEN", ADMIN_TOKEN)
        .env("QUANTMESH_KV_PAGES", "256")
        // The tests drive the monitor on an all-dual model.
        .env("QUANTMESH_PLAN", "none")
        .env("RUST_LOG", "info,quantmesh::fallback=warn");
    cmd
}

impl Serve {
    /// Start `quantmesh serve` with Kafka at `brokers` and the outbox in `outbox`;
    /// `env` adds `QUANTMESH_*` settings. Waits until /ready.
    pub async fn start(model: &Path, outbox: &Path, brokers: &str, env: &[(&str, &str)]) -> Serve {
        let port = free_port();
        let log = outbox.parent().unwrap().join(format!("serve-{port}.log"));
        let mut cmd = quantmesh(&["serve", "--port", &port.to_string(), "--model"]);
        cmd.arg(model)
            .args(["--kafka-brokers", brokers, "--outbox-dir"])
            .arg(outbox)
            .envs(env.iter().copied());
        let s = Serve(Process::spawn(cmd, port, log));
        s.wait_ready(&reqwest::Client::new(), Duration::from_secs(180))
            .await;
        s
    }

    /// Sum of a metric's samples whose labels contain all of `labels`.
    pub async fn metric(&self, client: &reqwest::Client, name: &str, labels: &[&str]) -> f64 {
        sum_metric(&scrape(client, &self.url("/metrics")).await, name, labels)
    }

    /// Wait until the server has counted at least `at_least` requests
    /// (`quantmesh_requests_total`): traffic is flowing.
    pub async fn wait_requests(&self, client: &reqwest::Client, at_least: f64, within: Duration) {
        poll(within, Duration::from_millis(50), || async {
            let n = self.metric(client, "quantmesh_requests_total", &[]).await;
            match n >= at_least {
                true => Ok(()),
                false => Err(format!("only {n} requests counted, waiting for {at_least}")),
            }
        })
        .await
    }

    /// Wait until the relay has emptied the outbox (`quantmesh_events_outbox_depth` 0).
    pub async fn wait_outbox_drained(&self, client: &reqwest::Client, within: Duration) {
        poll(within, Duration::from_millis(200), || async {
            let depth = self
                .metric(client, "quantmesh_events_outbox_depth", &[])
                .await;
            match depth == 0.0 {
                true => Ok(()),
                false => Err(format!("outbox did not drain: {depth} events left")),
            }
        })
        .await
    }

    /// Every fallback event the engine's monitor has created (independent of the Kafka path).
    pub async fn decisions(&self, client: &reqwest::Client) -> u64 {
        self.metric(client, "quantmesh_fallback_decisions_total", &[])
            .await as u64
    }
}

/// Groups the tests toggle (one task per group, so each call changes its state).
pub fn groups() -> Vec<String> {
    let mut g = Vec::new();
    for l in 0..4 {
        for k in ["qkv", "o", "gate_up", "down"] {
            g.push(format!("layers.{l}.{k}"));
        }
    }
    g
}

/// Make the engine emit `per_group` events for every group: admin forces alternating
/// float / auto (each one an enter or exit decision of the monitor → one event). Returns
/// the number of successful calls.
pub async fn fire_events(client: &reqwest::Client, base: &str, per_group: usize) -> usize {
    fire_events_from(client, base, 0, per_group).await
}

/// [`fire_events`] continuing a toggle sequence at `first` (odd: the groups are in float
/// now, so start with `auto`).
pub async fn fire_events_from(
    client: &reqwest::Client,
    base: &str,
    first: usize,
    per_group: usize,
) -> usize {
    let tasks = groups().into_iter().map(|g| {
        let (client, url) = (client.clone(), format!("{base}/admin/fallback"));
        async move {
            let mut ok = 0;
            for i in first..first + per_group {
                let mode = if i % 2 == 0 { "float" } else { "auto" };
                let r = client
                    .post(&url)
                    .bearer_auth(ADMIN_TOKEN)
                    .json(&serde_json::json!({"group": g, "mode": mode}))
                    .send()
                    .await;
                if r.is_ok_and(|r| r.status() == 200) {
                    ok += 1;
                }
            }
            ok
        }
    });
    futures::future::join_all(tasks).await.into_iter().sum()
}

/// Steady serving traffic until `stop`: short streaming completions, counting outcomes and
/// latencies.
#[derive(Default, Debug)]
pub struct Traffic {
    pub ok: usize,
    pub failed: usize,
    pub latencies_ms: Vec<(Instant, f64)>,
}

pub async fn traffic(base: String, stop: tokio::sync::watch::Receiver<bool>) -> Traffic {
    let client = reqwest::Client::new();
    let mut t = Traffic::default();
    while !*stop.borrow() {
        let t0 = Instant::now();
        let r = client
            .post(format!("{base}/v1/completions"))
            .json(&serde_json::json!({"prompt": "The weather today", "max_tokens": 8, "stream": true}))
            .send()
            .await;
        let ok = match r {
            Ok(r) if r.status() == 200 => r.text().await.is_ok_and(|b| b.contains("[DONE]")),
            _ => false,
        };
        if ok {
            t.ok += 1;
            t.latencies_ms
                .push((t0, t0.elapsed().as_secs_f64() * 1000.0));
        } else {
            t.failed += 1;
        }
    }
    t
}

pub fn percentile(v: &[f64], p: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    s[((s.len() - 1) as f64 * p).round() as usize]
}

/// One consumed message.
#[derive(Debug, Clone)]
pub struct Consumed {
    pub key: String,
    pub headers: HashMap<String, String>,
    pub payload: serde_json::Value,
}

/// A consumer group reading `topic` from the beginning.
pub fn consumer(brokers: &str, group: &str, topic: &str) -> StreamConsumer {
    let c: StreamConsumer = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set("group.id", group)
        .set("auto.offset.reset", "earliest")
        .set("enable.auto.commit", "true")
        .set("session.timeout.ms", "10000")
        .create()
        .unwrap();
    c.subscribe(&[topic]).unwrap();
    c
}

/// Read until `done(&seen)` holds or `timeout`; events keyed by `event_id` (duplicates from
/// at-least-once delivery collapse).
pub async fn collect(
    c: &StreamConsumer,
    timeout: Duration,
    mut done: impl FnMut(&HashMap<String, Consumed>) -> bool,
) -> HashMap<String, Consumed> {
    let mut seen = HashMap::new();
    let t0 = Instant::now();
    while !done(&seen) && t0.elapsed() < timeout {
        let m = match tokio::time::timeout(Duration::from_millis(500), c.recv()).await {
            Ok(Ok(m)) => m,
            _ => continue,
        };
        let payload: serde_json::Value =
            serde_json::from_slice(m.payload().unwrap_or_default()).expect("payload is JSON");
        let mut headers = HashMap::new();
        if let Some(h) = m.headers() {
            for hd in h.iter() {
                headers.insert(
                    hd.key.to_string(),
                    String::from_utf8_lossy(hd.value.unwrap_or_default()).to_string(),
                );
            }
        }
        let key = String::from_utf8_lossy(m.key().unwrap_or_default()).to_string();
        let id = payload["event_id"].as_str().unwrap().to_string();
        seen.insert(
            id,
            Consumed {
                key,
                headers,
                payload,
            },
        );
    }
    seen
}

pub fn ids(m: &HashMap<String, Consumed>) -> HashSet<String> {
    m.keys().cloned().collect()
}

/// A model directory written once per test binary run (the bundled tiny model).
pub fn model_dir(root: &Path) -> PathBuf {
    let dir = root.join("model");
    quantmesh_model::bundled::init_model(&dir, &Default::default()).unwrap();
    dir
}

/// A `sensitive_layers.json` for the model in `model` giving `group` the class `class`.
pub fn plan_with_class(model: &Path, group: &str, class: &str) -> Vec<u8> {
    use quantmesh_model::checkpoint::Checkpoint;
    use quantmesh_model::{model_shape, ModelConfig};
    let ck = Checkpoint::open(model).unwrap();
    let mcfg = ModelConfig::from_file(&model.join("config.json")).unwrap();
    let layout_md5 = model_shape(&ck, &mcfg).unwrap().layout_md5;
    serde_json::to_vec_pretty(&serde_json::json!({
        "schema_version": 1,
        "model": {"num_layers": mcfg.num_hidden_layers, "hidden_size": mcfg.hidden_size,
                  "intermediate_size": mcfg.intermediate_size, "layout_md5": layout_md5},
        "thresholds": {"k": 4.0, "trigger_rate": 0.01},
        "groups": {group: {"class": class}}
    }))
    .unwrap()
}

/// `quantmesh serve` on the bundled model (written under `root`) with a hot-reloadable
/// `sensitive_layers.json` (`layers.1.down` as `w8a8_per_channel`; rewrite it and POST
/// /admin/config/reload). `server` and `monitor` are TOML lines for those sections.
/// Returns the model directory, the plan's path and the server.
pub async fn serve_with_plan(
    root: &Path,
    brokers: &str,
    server: &str,
    monitor: &str,
) -> (PathBuf, PathBuf, Serve) {
    let model = model_dir(root);
    let plan_path = root.join("sensitive_layers.json");
    std::fs::write(
        &plan_path,
        plan_with_class(&model, "layers.1.down", "w8a8_per_channel"),
    )
    .unwrap();
    let cfg = root.join("quantmesh.toml");
    std::fs::write(
        &cfg,
        format!(
            "[server]\n{server}\n\n[engine]\nsensitive_layers = \"{}\"\nreload_interval = \"1h\"\n\n[engine.monitor]\n{monitor}\n",
            plan_path.display()
        ),
    )
    .unwrap();
    let serve = Serve::start(
        &model,
        &root.join("outbox"),
        brokers,
        &[("QUANTMESH_CONFIG", cfg.to_str().unwrap())],
    )
    .await;
    (model, plan_path, serve)
}

/// A `quantmesh serve --log-format json` child's stderr, read on a thread: waits until the
/// server logs `ready`. Returns the address from its `listening` line, the lines so far and
/// the channel the rest arrive on.
pub fn wait_ready_in_log(
    child: &mut Child,
    quiet_for: Duration,
) -> (String, Vec<String>, std::sync::mpsc::Receiver<String>) {
    use std::io::{BufRead, BufReader};
    let stderr = child.stderr.take().expect("stderr piped");
    let (tx, rx) = std::sync::mpsc::channel::<String>();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    let mut addr = None;
    let mut log = Vec::new();
    loop {
        let line = match rx.recv_timeout(quiet_for) {
            Ok(l) => l,
            Err(e) => panic!(
                "server log went quiet ({e}); log so far:\n{}",
                log.join("\n")
            ),
        };
        let v: serde_json::Value = serde_json::from_str(&line).unwrap_or_default();
        if v["fields"]["message"] == "listening" {
            addr = v["fields"]["addr"].as_str().map(String::from);
        }
        let ready = v["fields"]["message"]
            .as_str()
            .is_some_and(|m| m.starts_with("ready"));
        log.push(line);
        if ready {
            break;
        }
    }
    (addr.expect("listening line with addr"), log, rx)
}
pub mod stack;
