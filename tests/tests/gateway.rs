//! The gateway's retry rules, deadlines and honest errors, in one process: the real gateway
//! (`run_gateway`) in front of two real embedded engines on loopback, real HTTP between them.
//! Faults the engines cannot be told to make — an answer that breaks off, a partition — come
//! from a TCP relay between the gateway and engine-1 that the test controls. Each rule is
//! checked by counting the requests each engine answered.

#![allow(clippy::unwrap_used, clippy::expect_used)] // a failed step fails the test

mod common;

use common::{settings, Scrape, Server};
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// What the relay does with the traffic it carries.
const PASS: u8 = 0;
/// Answers to a POST end a few bytes after their head (the connection is then closed).
const CUT_POST_ANSWERS: u8 = 1;
/// Nothing is carried either way and new connections hang: a partition.
const BLACKHOLE: u8 = 2;

/// A TCP relay on a free port in front of `target` (host:port), in the mode `mode` holds.
async fn relay(target: String, mode: Arc<AtomicU8>) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((client, _)) = listener.accept().await {
            let (target, mode) = (target.clone(), mode.clone());
            tokio::spawn(async move {
                let Ok(server) = tokio::net::TcpStream::connect(&target).await else {
                    return;
                };
                let (mut cr, mut cw) = client.into_split();
                let (mut sr, mut sw) = server.into_split();
                let posted = Arc::new(AtomicU8::new(0));
                let up = {
                    let (mode, posted) = (mode.clone(), posted.clone());
                    async move {
                        let mut buf = vec![0u8; 64 << 10];
                        loop {
                            let n = match cr.read(&mut buf).await {
                                Ok(0) | Err(_) => return,
                                Ok(n) => n,
                            };
                            while mode.load(Ordering::SeqCst) == BLACKHOLE {
                                tokio::time::sleep(Duration::from_millis(20)).await;
                            }
                            if buf[..n].starts_with(b"POST ") {
                                posted.store(1, Ordering::SeqCst);
                            }
                            if sw.write_all(&buf[..n]).await.is_err() {
                                return;
                            }
                        }
                    }
                };
                let down = async move {
                    let mut buf = vec![0u8; 64 << 10];
                    loop {
                        let n = match sr.read(&mut buf).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => n,
                        };
                        while mode.load(Ordering::SeqCst) == BLACKHOLE {
                            tokio::time::sleep(Duration::from_millis(20)).await;
                        }
                        let cut = mode.load(Ordering::SeqCst) == CUT_POST_ANSWERS
                            && posted.load(Ordering::SeqCst) == 1;
                        if cut {
                            let head = buf[..n]
                                .windows(4)
                                .position(|w| w == b"\r\n\r\n")
                                .map_or(n, |p| (p + 4 + 5).min(n));
                            let _ = cw.write_all(&buf[..head]).await;
                            return; // both halves close: the answer broke off
                        }
                        if cw.write_all(&buf[..n]).await.is_err() {
                            return;
                        }
                    }
                };
                tokio::select! { _ = up => {}, _ = down => {} }
            });
        }
    });
    format!("http://{addr}")
}

struct Gateway {
    base: String,
    client: reqwest::Client,
    _stop: tokio::sync::oneshot::Sender<()>,
}

impl Gateway {
    /// The gateway in front of `engines`, with `mesh` settings adjusted by `tune`; returns
    /// once every engine is marked up.
    async fn start(
        engines: &[String],
        tune: impl FnOnce(&mut quantmesh_settings::Settings),
    ) -> Self {
        let mut s = quantmesh_settings::Settings::default();
        s.mesh.engines = engines.to_vec();
        s.mesh.health_interval = Duration::from_millis(200);
        s.mesh.stall_timeout = Duration::from_secs(2);
        tune(&mut s);
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let base = format!("http://{}", listener.local_addr().unwrap());
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        actix_rt::spawn(quantmesh_gateway::mesh::http::run_gateway(
            s,
            listener,
            async move {
                let _ = rx.await;
            },
        ));
        let gw = Gateway {
            base,
            client: reqwest::Client::new(),
            _stop: tx,
        };
        let want = engines.len() as f64;
        common::poll(
            Duration::from_secs(60),
            Duration::from_millis(50),
            || async {
                let m = Scrape::get(&gw.client, &gw.url("/metrics")).await;
                let up = m.sum("quantmesh_gateway_engine_up", &[]);
                (up == want)
                    .then_some(())
                    .ok_or(format!("{up} of {want} engines up"))
            },
        )
        .await;
        gw
    }

    fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    async fn complete(&self, body: serde_json::Value) -> reqwest::Response {
        self.client
            .post(self.url("/v1/completions"))
            .json(&body)
            .send()
            .await
            .unwrap()
    }

    async fn metric(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        Scrape::get(&self.client, &self.url("/metrics"))
            .await
            .sum(name, labels)
    }
}

/// Completion requests the engine answered, by status.
async fn answered(engine: &Server, status: &str) -> f64 {
    engine.metrics().await.sum(
        "quantmesh_requests_total",
        &[("endpoint", "/v1/completions"), ("status", status)],
    )
}

fn prompt() -> serde_json::Value {
    serde_json::json!({"prompt": "the gateway forwards this", "max_tokens": 4, "temperature": 0})
}

#[actix_rt::test]
async fn an_engines_500_is_its_answer_not_retried() {
    let (e1, e2) = (
        Server::start(settings()).await,
        Server::start(settings()).await,
    );
    let gw = Gateway::start(&[e1.base.clone(), e2.base.clone()], |_| {}).await;
    // engine-1 (first of two idle engines) takes it, and its step panics.
    quantmesh_engine::faults::panic_next_steps(1);
    let r = gw.complete(prompt()).await;
    assert_eq!(r.status(), 500);
    assert_eq!(r.headers()["x-quantmesh-engine"], "engine-1");
    let body: serde_json::Value = r.json().await.unwrap();
    assert_eq!(body["error"]["code"], "internal_error", "{body}");
    assert_eq!(answered(&e1, "500").await, 1.0);
    assert_eq!(answered(&e2, "200").await + answered(&e2, "500").await, 0.0);
    assert_eq!(gw.metric("quantmesh_gateway_retries_total", &[]).await, 0.0);
}

#[actix_rt::test]
async fn a_refused_connection_is_retried_on_another_engine() {
    let (mut e1, e2) = (
        Server::start(settings()).await,
        Server::start(settings()).await,
    );
    // Checked once at start, then not for a minute: engine-1 still looks up when it is gone.
    let gw = Gateway::start(&[e1.base.clone(), e2.base.clone()], |s| {
        s.mesh.health_interval = Duration::from_secs(60);
        s.mesh.stall_timeout = Duration::from_secs(60);
    })
    .await;
    let port = e1.base.rsplit(':').next().unwrap().parse::<u16>().unwrap();
    e1.shutdown();
    common::poll(
        Duration::from_secs(30),
        Duration::from_millis(20),
        || async {
            let refused = std::net::TcpStream::connect(("127.0.0.1", port)).is_err();
            refused
                .then_some(())
                .ok_or("engine-1 still accepts connections".to_string())
        },
    )
    .await;
    let r = gw.complete(prompt()).await;
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["x-quantmesh-engine"], "engine-2");
    assert_eq!(answered(&e2, "200").await, 1.0);
    let retries = gw
        .metric("quantmesh_gateway_retries_total", &[("engine", "engine-1")])
        .await;
    assert_eq!(retries, 1.0);
    let refused = gw
        .metric(
            "quantmesh_gateway_engine_failures_total",
            &[("engine", "engine-1"), ("kind", "connect")],
        )
        .await;
    assert_eq!(refused, 1.0);
}

#[actix_rt::test]
async fn an_answer_that_breaks_off_is_not_retried() {
    let (e1, e2) = (
        Server::start(settings()).await,
        Server::start(settings()).await,
    );
    let mode = Arc::new(AtomicU8::new(PASS));
    let via = relay(e1.base.trim_start_matches("http://").into(), mode.clone()).await;
    let gw = Gateway::start(&[via, e2.base.clone()], |_| {}).await;
    mode.store(CUT_POST_ANSWERS, Ordering::SeqCst);
    let r = gw.complete(prompt()).await;
    assert_eq!(r.status(), 502);
    let body: serde_json::Value = r.json().await.unwrap();
    assert_eq!(body["error"]["code"], "engine_failed", "{body}");
    // engine-1 did the work; engine-2 never saw the request.
    assert_eq!(answered(&e1, "200").await, 1.0);
    assert_eq!(answered(&e2, "200").await, 0.0);
    assert_eq!(gw.metric("quantmesh_gateway_retries_total", &[]).await, 0.0);
}

#[actix_rt::test]
async fn a_partitioned_engine_fails_its_requests_within_the_stall_deadline() {
    let e1 = Server::start(settings()).await;
    let mode = Arc::new(AtomicU8::new(PASS));
    let via = relay(e1.base.trim_start_matches("http://").into(), mode.clone()).await;
    let gw = Gateway::start(&[via], |_| {}).await;
    // A stream that has begun, and a non-streaming request: both in flight at the partition.
    let long = serde_json::json!({"prompt": "a long one", "max_tokens": 2000, "ignore_eos": true});
    let mut stream_body = long.clone();
    stream_body["stream"] = true.into();
    let mut stream = gw.complete(stream_body).await;
    assert_eq!(stream.status(), 200);
    assert!(stream.chunk().await.unwrap().is_some(), "the stream began");
    let plain = tokio::spawn({
        let (client, url) = (gw.client.clone(), gw.url("/v1/completions"));
        async move {
            let r = client.post(url).json(&long).send().await.unwrap();
            (
                r.status().as_u16(),
                r.json::<serde_json::Value>().await.unwrap(),
            )
        }
    });
    common::poll(
        Duration::from_secs(30),
        Duration::from_millis(20),
        || async {
            let n = gw.metric("quantmesh_gateway_engine_outstanding", &[]).await;
            (n >= 2.0).then_some(()).ok_or(format!("{n} in flight"))
        },
    )
    .await;
    let t0 = Instant::now();
    mode.store(BLACKHOLE, Ordering::SeqCst);
    // stall_timeout is 2 s; a minute is "hung".
    let (status, body) = tokio::time::timeout(Duration::from_secs(60), plain)
        .await
        .expect("the request hung on a partitioned engine")
        .unwrap();
    assert_eq!(status, 504, "{body}");
    assert_eq!(body["error"]["code"], "engine_timeout", "{body}");
    let mut rest = Vec::new();
    while let Some(c) = tokio::time::timeout(Duration::from_secs(60), stream.chunk())
        .await
        .expect("the stream hung on a partitioned engine")
        .unwrap()
    {
        rest.extend_from_slice(&c);
    }
    let text = String::from_utf8_lossy(&rest);
    assert!(text.contains("\"engine_timeout\""), "{text}");
    assert!(t0.elapsed() < Duration::from_secs(30), "{:?}", t0.elapsed());
    let stalled = gw
        .metric(
            "quantmesh_gateway_engine_failures_total",
            &[("kind", "stalled")],
        )
        .await;
    assert_eq!(stalled, 2.0);
    // New requests are refused at once while it is down; it comes back when the partition heals.
    let r = gw.complete(prompt()).await;
    assert_eq!(r.status(), 503);
    mode.store(PASS, Ordering::SeqCst);
    common::poll(
        Duration::from_secs(30),
        Duration::from_millis(50),
        || async {
            let status = gw.complete(prompt()).await.status();
            (status == 200)
                .then_some(())
                .ok_or(format!("answered {status}"))
        },
    )
    .await;
}

#[actix_rt::test]
async fn an_engines_401_reaches_the_client_on_every_route() {
    let mut s = settings();
    s.server.api_keys = vec!["engine-key".into()];
    let e1 = Server::start(s).await;
    let gw = Gateway::start(std::slice::from_ref(&e1.base), |_| {}).await;
    for (method, path) in [("GET", "/v1/models"), ("POST", "/v1/completions")] {
        let req = match method {
            "GET" => gw.client.get(gw.url(path)),
            _ => gw.client.post(gw.url(path)).json(&prompt()),
        };
        let r = req.bearer_auth("wrong-key").send().await.unwrap();
        assert_eq!(r.status(), 401, "{method} {path}");
        let body: serde_json::Value = r.json().await.unwrap();
        assert_eq!(body["error"]["code"], "invalid_api_key", "{body}");
    }
    let r = gw
        .client
        .get(gw.url("/v1/models"))
        .bearer_auth("engine-key")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(
        gw.metric(
            "quantmesh_gateway_rejected_total",
            &[("reason", "no_engine")]
        )
        .await,
        0.0
    );
}
