//! The microservice mesh without containers: `quantmesh gateway` in front of two
//! `quantmesh engine` processes on loopback, real HTTP between them. Load spreads over both;
//! an engine killed with SIGKILL under load costs no request that had not started streaming
//! (retried on the other engine), started streams end with an error event, nothing hangs,
//! and the gateway marks the engine down and back up; prefix affinity raises prefix-cache
//! hits over random routing.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use futures::StreamExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};
use support::{
    assert_ends_with_engine_failed, free_port, get_json, model_dir, quantmesh, scrape, streams_on,
    sum_metric, Process, ADMIN_TOKEN,
};

/// A `quantmesh` role (engine or gateway) on `port`, logging into `log`.
fn spawn(args: &[&str], port: u16, log: PathBuf, env: &[(&str, &str)]) -> Process {
    let mut cmd = quantmesh(args);
    cmd.envs(env.iter().copied())
        .args(["--port", &port.to_string()]);
    Process::spawn(cmd, port, log)
}

fn engine(root: &Path, model: &Path, port: u16) -> Process {
    let log = root.join(format!("engine-{port}.log"));
    spawn(
        &["engine", "--model", model.to_str().unwrap()],
        port,
        log,
        &[],
    )
}

fn gateway(root: &Path, engines: &[&Process], routing: &str) -> Process {
    let port = free_port();
    let mut args = vec!["gateway".to_string(), "--routing".into(), routing.into()];
    for e in engines {
        args.push("--engine".into());
        args.push(e.base.clone());
    }
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    spawn(&args, port, root.join(format!("gateway-{port}.log")), &[])
}

/// Until `p` answers `/ready` (two minutes at most).
async fn ready(p: &Process, client: &reqwest::Client) {
    p.wait_ready(client, Duration::from_secs(120)).await
}

async fn complete(client: &reqwest::Client, gw: &Process, prompt: &str) -> (u16, String) {
    let r = client
        .post(gw.url("/v1/completions"))
        .json(&serde_json::json!({"prompt": prompt, "max_tokens": 8, "temperature": 0}))
        .send()
        .await
        .unwrap();
    let engine = r
        .headers()
        .get("x-quantmesh-engine")
        .map(|v| v.to_str().unwrap().to_string())
        .unwrap_or_default();
    (r.status().as_u16(), engine)
}

async fn wait_metric(
    client: &reqwest::Client,
    p: &Process,
    name: &str,
    labels: &[&str],
    want: f64,
) {
    let t0 = Instant::now();
    loop {
        let v = sum_metric(&scrape(client, &p.url("/metrics")).await, name, labels);
        if v == want {
            return;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "{name}{labels:?} stuck at {v}, want {want}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn load_spreads_and_a_killed_engine_costs_no_unstarted_request() {
    let root = tempfile::tempdir().unwrap();
    let model = model_dir(root.path());
    let client = reqwest::Client::new();
    let mut e1 = engine(root.path(), &model, free_port());
    let e2 = engine(root.path(), &model, free_port());
    let gw = gateway(root.path(), &[&e1, &e2], "least-outstanding");
    for p in [&e1, &e2, &gw] {
        ready(p, &client).await;
    }
    wait_metric(&client, &gw, "quantmesh_gateway_engine_up", &[], 2.0).await;

    // Concurrent requests spread over both engines.
    let calls = (0..24).map(|i| {
        let (client, gw) = (&client, &gw);
        async move { complete(client, gw, &format!("request number {i} about spreading")).await }
    });
    let results = futures::future::join_all(calls).await;
    assert!(results.iter().all(|(s, _)| *s == 200), "{results:?}");
    let on = |name: &str| results.iter().filter(|(_, e)| e == name).count();
    assert!(on("engine-1") > 0 && on("engine-2") > 0, "{results:?}");

    // Streams that start on engine-1, then SIGKILL engine-1 while more requests arrive.
    let (streams, _) = streams_on(&client, &gw.url(""), "engine-1", 2, 200).await;
    let load = tokio::spawn({
        let (client, url) = (client.clone(), gw.url(""));
        async move {
            let calls = (0..32).map(|i| {
                let (client, url) = (client.clone(), url.clone());
                async move {
                    let r = client
                        .post(format!("{url}/v1/completions"))
                        .json(
                            &serde_json::json!({"prompt": format!("during the outage {i}"),
                                                  "max_tokens": 48, "ignore_eos": true}),
                        )
                        .send()
                        .await
                        .unwrap();
                    r.status().as_u16()
                }
            });
            futures::stream::iter(calls)
                .buffer_unordered(8)
                .collect::<Vec<u16>>()
                .await
        }
    });
    // Kill engine-1 while it holds requests that have not answered yet: more outstanding
    // there than the two started streams.
    let t0 = Instant::now();
    loop {
        let m = scrape(&client, &gw.url("/metrics")).await;
        if sum_metric(
            &m,
            "quantmesh_gateway_engine_outstanding",
            &["\"engine-1\""],
        ) >= 3.0
        {
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "engine-1 never held an unanswered request: {m}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    e1.kill();
    let statuses = tokio::time::timeout(Duration::from_secs(120), load)
        .await
        .expect("requests hung after the engine was killed")
        .unwrap();
    assert!(
        statuses.iter().all(|s| *s == 200),
        "every request that had not started succeeds on the other engine: {statuses:?}"
    );
    for s in streams {
        assert_ends_with_engine_failed(s).await;
    }
    wait_metric(
        &client,
        &gw,
        "quantmesh_gateway_engine_up",
        &["engine-1"],
        0.0,
    )
    .await;
    assert_eq!(
        client.get(gw.url("/ready")).send().await.unwrap().status(),
        200
    );
    let m = scrape(&client, &gw.url("/metrics")).await;
    assert!(sum_metric(&m, "quantmesh_gateway_stream_failures_total", &["engine-1"]) >= 2.0);
    // The requests it held unanswered were retried on engine-2 (counted against engine-1).
    assert!(
        sum_metric(&m, "quantmesh_gateway_retries_total", &["\"engine-1\""]) >= 1.0,
        "no request was retried after the kill:\n{m}"
    );

    // engine-1 comes back on its port: marked up, and it takes requests again.
    let e1 = engine(root.path(), &model, e1.port);
    ready(&e1, &client).await;
    wait_metric(&client, &gw, "quantmesh_gateway_engine_up", &[], 2.0).await;
    let calls = (0..16).map(|i| {
        let (client, gw) = (&client, &gw);
        async move { complete(client, gw, &format!("after the return {i}")).await }
    });
    let results = futures::future::join_all(calls).await;
    assert!(results.iter().all(|(s, _)| *s == 200));
    assert!(results.iter().any(|(_, e)| e == "engine-1"), "{results:?}");

    // Admin calls fan out, answers labelled by engine.
    let r = client
        .get(gw.url("/admin/fallback"))
        .bearer_auth(ADMIN_TOKEN)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let body: serde_json::Value = r.json().await.unwrap();
    let engines: Vec<&str> = body["engines"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["engine"].as_str().unwrap())
        .collect();
    assert_eq!(engines, ["engine-1", "engine-2"]);
    assert!(body["engines"][0]["body"]["groups"].is_array(), "{body}");
    // The model list and the API document come from the engines.
    let models: serde_json::Value = client
        .get(gw.url("/v1/models"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(models["data"][0]["id"], "quantmesh-tiny");
    let doc = client.get(gw.url("/openapi.json")).send().await.unwrap();
    assert_eq!(doc.status(), 200);
    // Unknown routes: a JSON 404.
    let r = client.get(gw.url("/nope")).send().await.unwrap();
    assert_eq!(r.status(), 404);
    assert!(r.json::<serde_json::Value>().await.unwrap()["error"]["message"].is_string());
}

/// Requests sharing a long prefix: sent by prefix affinity they hit the engines' prefix
/// caches more often than sent at random.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefix_affinity_raises_prefix_cache_hits_over_random_routing() {
    let root = tempfile::tempdir().unwrap();
    let model = model_dir(root.path());
    let client = reqwest::Client::new();
    let prefixes: Vec<String> = (0..4)
        .map(|p| {
            format!(
                "{p}: {}",
                "a shared system prompt about caching and routing ".repeat(5)
            )
        })
        .collect();
    let mut hits = Vec::new();
    for routing in ["least-outstanding", "random"] {
        let e1 = engine(root.path(), &model, free_port());
        let e2 = engine(root.path(), &model, free_port());
        let gw = gateway(root.path(), &[&e1, &e2], routing);
        for p in [&e1, &e2, &gw] {
            ready(p, &client).await;
        }
        wait_metric(&client, &gw, "quantmesh_gateway_engine_up", &[], 2.0).await;
        let calls = (0..48).map(|i| {
            let (client, gw) = (client.clone(), gw.url(""));
            let prompt = format!("{} question {i}", prefixes[i % 4]);
            async move {
                client
                    .post(format!("{gw}/v1/completions"))
                    .json(&serde_json::json!({"prompt": prompt, "max_tokens": 2}))
                    .send()
                    .await
                    .unwrap()
                    .status()
                    .as_u16()
            }
        });
        // Two at a time: the affinity engine is never more than the slack (2) busier, so
        // every request goes home; random routing sends each prefix to both engines.
        let statuses: Vec<u16> = futures::stream::iter(calls)
            .buffer_unordered(2)
            .collect()
            .await;
        assert!(statuses.iter().all(|s| *s == 200));
        let mut h = 0.0;
        for e in [&e1, &e2] {
            h += sum_metric(
                &scrape(&client, &e.url("/metrics")).await,
                "quantmesh_prefix_cache_hits_total",
                &[],
            );
        }
        let routed: Vec<String> = scrape(&client, &gw.url("/metrics"))
            .await
            .lines()
            .filter(|l| l.starts_with("quantmesh_gateway_routed_total"))
            .map(String::from)
            .collect();
        eprintln!("{routing}: {h} prompt tokens from the prefix caches; {routed:?}");
        hits.push(h);
    }
    assert!(
        hits[0] > hits[1],
        "affinity {} vs random {} prefix-cache hits",
        hits[0],
        hits[1]
    );
}

/// Engines found by DNS: `dns+http://localhost:PORT` resolves (through the system resolver)
/// to the engine on loopback, which serves under its discovered name; a service that does not
/// resolve is counted and changes nothing. (Addresses joining and leaving a name's answer are
/// tested with Docker's DNS in `compose.rs`, and the rule itself in `mesh/discovery.rs`.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engines_are_found_by_dns_and_a_name_that_does_not_resolve_is_counted() {
    let root = tempfile::tempdir().unwrap();
    let model = model_dir(root.path());
    let client = reqwest::Client::new();
    let port = free_port();
    // The gateway starts first: the name resolves before the engine listens, so the engine
    // is known (down) and comes up when its /ready answers.
    let (good, bad) = (
        format!("dns+http://localhost:{port}"),
        "dns+http://no-such-engine.invalid:8080".to_string(),
    );
    let gw_port = free_port();
    let gw = spawn(
        &["gateway", "--engine", &good, "--engine", &bad],
        gw_port,
        root.path().join("gateway-dns.log"),
        &[],
    );
    let engine = engine(root.path(), &model, port);
    for p in [&engine, &gw] {
        ready(p, &client).await;
    }
    let name = format!("localhost@127.0.0.1:{port}");
    wait_metric(
        &client,
        &gw,
        "quantmesh_gateway_engine_up",
        &[&format!("engine=\"{name}\"")],
        1.0,
    )
    .await;
    let (status, served_by) = complete(&client, &gw, "found by name").await;
    assert_eq!((status, served_by.as_str()), (200, name.as_str()));
    let m = scrape(&client, &gw.url("/metrics")).await;
    assert_eq!(
        sum_metric(
            &m,
            "quantmesh_gateway_discovered_engines",
            &[&format!("service=\"{good}\"")]
        ),
        1.0,
        "{m}"
    );
    // The unresolvable service: counted, no engine made up for it.
    let t0 = Instant::now();
    while sum_metric(
        &scrape(&client, &gw.url("/metrics")).await,
        "quantmesh_gateway_discovery_errors_total",
        &[&format!("service=\"{bad}\"")],
    ) < 1.0
    {
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "no lookup error counted"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let admin = get_json(&client, &gw.url("/admin/config"), ADMIN_TOKEN).await;
    let engines = admin["engines"].as_array().unwrap();
    assert_eq!(engines.len(), 1, "{admin}");
    assert_eq!(engines[0]["engine"], name.as_str());
}

/// Mesh mode keeps the embedded server's promises at its front door: the caller's API key
/// reaches the engine (whose keys and per-key cache partitions then work behind the
/// gateway), an oversized `Content-Length` is refused before the body is read, the
/// concurrency limit is taken before the read, and the answer names its request id and
/// trace like an engine's does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_gateway_forwards_keys_and_limits_before_reading_the_body() {
    use std::io::{Read, Write};
    let root = tempfile::tempdir().unwrap();
    let model = model_dir(root.path());
    let client = reqwest::Client::new();
    let key = "sk-engine-only-key";
    let engine = spawn(
        &["engine", "--model", model.to_str().unwrap()],
        free_port(),
        root.path().join("engine.log"),
        &[("QUANTMESH_API_KEYS", key)],
    );
    let config = root.path().join("gateway.toml");
    std::fs::write(
        &config,
        "[server]\nmax_body_bytes = 4096\nmax_concurrent_requests = 1\n",
    )
    .unwrap();
    let gw_port = free_port();
    let gw = spawn(
        &[
            "gateway",
            "--engine",
            &format!("http://127.0.0.1:{}", engine.port),
        ],
        gw_port,
        root.path().join("gateway.log"),
        &[("QUANTMESH_CONFIG", config.to_str().unwrap())],
    );
    for p in [&engine, &gw] {
        ready(p, &client).await;
    }
    let body = serde_json::json!({"prompt": "Hello", "max_tokens": 2});
    // A completion through the gateway with the engine's key.
    let keyed = || async {
        client
            .post(gw.url("/v1/completions"))
            .bearer_auth(key)
            .json(&body)
            .send()
            .await
            .unwrap()
    };

    // The key goes through: the engine accepts it, and refuses a call without one.
    let r = client
        .post(gw.url("/v1/completions"))
        .bearer_auth(key)
        .header("x-request-id", "req-through-the-gateway")
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200, "{}", r.text().await.unwrap());
    assert_eq!(r.headers()["x-request-id"], "req-through-the-gateway");
    let engine_log = std::fs::read_to_string(&engine.log).unwrap();
    assert!(
        engine_log.contains("req-through-the-gateway"),
        "the engine logs the caller's request id:\n{engine_log}"
    );
    let r = client
        .post(gw.url("/v1/completions"))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 401, "the engine's keys hold behind the gateway");
    let generated = r.headers().get("x-request-id").cloned();
    assert!(generated.is_some(), "a request id on every answer");

    // An oversized Content-Length: 413 at once, though the body never comes.
    let raw = |head: &str| {
        let mut s = std::net::TcpStream::connect(("127.0.0.1", gw_port)).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
        s.write_all(head.as_bytes()).unwrap();
        s
    };
    let mut big = raw(&format!(
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\nContent-Type: application/json\r\nContent-Length: 1000000000\r\n\r\n{{"
    ));
    let mut answer = [0u8; 64];
    let n = big
        .read(&mut answer)
        .expect("an answer before the body is sent");
    let answer = String::from_utf8_lossy(&answer[..n]);
    assert!(answer.starts_with("HTTP/1.1 413"), "{answer}");
    drop(big);
    // Its permit is back once a request gets through again.
    let t0 = Instant::now();
    loop {
        let r = keyed().await;
        if r.status() == 200 {
            break;
        }
        assert!(t0.elapsed() < Duration::from_secs(30), "{}", r.status());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    // A request whose body is still arriving holds the only permit: the next one is 429.
    // (The permit of the request before may outlive its answer by a moment: a slow request
    // refused for it is sent again.)
    let t0 = Instant::now();
    let mut slow = loop {
        let mut slow = raw(&format!(
            "POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\nContent-Type: application/json\r\nContent-Length: 200\r\n\r\n{{"
        ));
        slow.set_read_timeout(Some(Duration::from_millis(300)))
            .unwrap();
        let mut answer = [0u8; 64];
        match slow.read(&mut answer) {
            Ok(n) => {
                let answer = String::from_utf8_lossy(&answer[..n]).to_string();
                assert!(answer.starts_with("HTTP/1.1 429"), "{answer}");
                assert!(t0.elapsed() < Duration::from_secs(30), "never admitted");
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            // Waiting for the rest of its body: it holds the permit.
            Err(_) => {
                slow.set_read_timeout(Some(Duration::from_secs(20)))
                    .unwrap();
                break slow;
            }
        }
    };
    let t0 = Instant::now();
    let status = loop {
        let r = keyed().await;
        // The slow request reaches the gateway's handler a moment after its headers.
        if r.status() == 429 || t0.elapsed() > Duration::from_secs(30) {
            break r.status();
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(
        status,
        429,
        "max_concurrent_requests counts a request being read; gateway log:\n{}",
        std::fs::read_to_string(&gw.log).unwrap_or_default()
    );
    // The rest of its body (not JSON): a 400, and its permit goes back.
    slow.write_all(&[b' '; 199]).unwrap();
    let mut answer = [0u8; 64];
    let n = slow.read(&mut answer).unwrap();
    let answer = String::from_utf8_lossy(&answer[..n]);
    assert!(answer.starts_with("HTTP/1.1 400"), "{answer}");
    drop(slow);
    assert_eq!(keyed().await.status(), 200, "the permit came back");
}

/// A stalled engine (SIGSTOP: it accepts connections and never answers) does not hang the
/// requests it holds: the gateway sees its `/ready` silent for `mesh.stall_timeout` and fails
/// them with 504 `engine_timeout`; new requests are refused at once while it is down, and it
/// serves again after SIGCONT.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_engine_is_answered_within_the_deadline() {
    let root = tempfile::tempdir().unwrap();
    let model = model_dir(root.path());
    let client = reqwest::Client::new();
    let e1 = engine(root.path(), &model, free_port());
    let config = root.path().join("gateway.toml");
    std::fs::write(
        &config,
        "[mesh]\nhealth_interval = \"500ms\"\nstall_timeout = \"3s\"\n",
    )
    .unwrap();
    let gw = spawn(
        &[
            "gateway",
            "--config",
            config.to_str().unwrap(),
            "--engine",
            &e1.base,
        ],
        free_port(),
        root.path().join("gateway-stall.log"),
        &[],
    );
    for p in [&e1, &gw] {
        ready(p, &client).await;
    }
    wait_metric(&client, &gw, "quantmesh_gateway_engine_up", &[], 1.0).await;
    let held = tokio::spawn({
        let (client, url) = (client.clone(), gw.url("/v1/completions"));
        async move {
            let r = client
                .post(url)
                .json(
                    &serde_json::json!({"prompt": "held", "max_tokens": 2000, "ignore_eos": true}),
                )
                .send()
                .await
                .unwrap();
            (
                r.status().as_u16(),
                r.json::<serde_json::Value>().await.unwrap(),
            )
        }
    });
    wait_metric(
        &client,
        &gw,
        "quantmesh_gateway_engine_outstanding",
        &[],
        1.0,
    )
    .await;
    let signal = |sig: &str| {
        let pid = e1.pid().unwrap().to_string();
        let ok = std::process::Command::new("kill")
            .args([sig, &pid])
            .status()
            .unwrap()
            .success();
        assert!(ok, "kill {sig} {pid}");
    };
    signal("-STOP");
    let t0 = Instant::now();
    let (status, body) = tokio::time::timeout(Duration::from_secs(60), held)
        .await
        .expect("the request hung on a stalled engine")
        .unwrap();
    assert_eq!(status, 504, "{body}");
    assert_eq!(body["error"]["code"], "engine_timeout", "{body}");
    eprintln!("stalled engine: answered 504 after {:?}", t0.elapsed());
    let (s, _) = complete(&client, &gw, "while it is stopped").await;
    assert_eq!(s, 503, "a stalled engine is down: refused at once");
    signal("-CONT");
    wait_metric(&client, &gw, "quantmesh_gateway_engine_up", &[], 1.0).await;
    let (s, e) = complete(&client, &gw, "after SIGCONT").await;
    assert_eq!((s, e.as_str()), (200, "engine-1"));
}
