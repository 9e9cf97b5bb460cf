//! The real embedded server on a free port, real HTTP.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;
#[path = "http/fields.rs"]
mod fields;

use common::{parse_sse, settings, Server, ADMIN_TOKEN};
use futures::StreamExt;
use serde_json::json;
use std::time::Duration;

#[actix_rt::test]
async fn completion_chat_and_models() {
    let s = Server::start(settings()).await;
    let r = s.post("/v1/completions", json!({"model": "quantmesh-tiny", "prompt": "Hello", "max_tokens": 8, "temperature": 0, "ignore_eos": true})).await;
    assert_eq!(r.status(), 200);
    assert!(r.headers().contains_key("x-request-id"));
    let b: serde_json::Value = r.json().await.unwrap();
    assert_eq!(b["object"], "text_completion");
    assert_eq!(b["choices"][0]["finish_reason"], "length");
    assert_eq!(b["usage"]["completion_tokens"], 8);
    assert!(!b["choices"][0]["text"].as_str().unwrap().is_empty());

    let r = s
        .post(
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}),
        )
        .await;
    assert_eq!(r.status(), 200);
    let b: serde_json::Value = r.json().await.unwrap();
    assert_eq!(b["object"], "chat.completion");
    assert_eq!(b["choices"][0]["message"]["role"], "assistant");

    let b: serde_json::Value = s
        .client
        .get(s.url("/v1/models"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(b["data"][0]["id"], "quantmesh-tiny");
    assert_eq!(
        s.client
            .get(s.url("/health"))
            .send()
            .await
            .unwrap()
            .status(),
        200
    );
}

#[actix_rt::test]
async fn streaming_is_incremental_and_matches_non_streaming() {
    let s = Server::start(settings()).await;
    for path in ["/v1/completions", "/v1/chat/completions"] {
        let mut body = if path == "/v1/completions" {
            json!({"prompt": "Once upon a time", "max_tokens": 24, "temperature": 0.9, "seed": 42, "ignore_eos": true})
        } else {
            json!({"messages": [{"role": "user", "content": "Tell me a story"}], "max_tokens": 24, "temperature": 0.9, "seed": 42, "ignore_eos": true})
        };
        let plain: serde_json::Value = s.post(path, body.clone()).await.json().await.unwrap();
        body["stream"] = json!(true);
        // OpenAI: no usage chunk unless asked for.
        let text = s.post(path, body.clone()).await.text().await.unwrap();
        let (chunks, done) = parse_sse(&text);
        assert!(
            done && chunks
                .iter()
                .all(|c| c.get("usage").is_none_or(|u| u.is_null())),
            "{text}"
        );
        body["stream_options"] = json!({"include_usage": true});
        let r = s.post(path, body).await;
        assert_eq!(r.status(), 200);
        assert!(r.headers()["content-type"]
            .to_str()
            .unwrap()
            .starts_with("text/event-stream"));
        let mut stream = r.bytes_stream();
        let mut reads = 0;
        let mut text = String::new();
        while let Some(chunk) = stream.next().await {
            reads += 1;
            text.push_str(std::str::from_utf8(&chunk.unwrap()).unwrap());
        }
        assert!(
            reads > 2,
            "{path}: expected incremental delivery, got {reads} network reads"
        );
        let (chunks, done) = parse_sse(&text);
        assert!(done, "[DONE] terminator");
        let usage = chunks.last().unwrap()["usage"].clone();
        assert_eq!(usage["completion_tokens"], 24);
        let streamed: String = chunks
            .iter()
            .filter_map(|c| {
                let ch = &c["choices"][0];
                ch["text"]
                    .as_str()
                    .or(ch["delta"]["content"].as_str())
                    .map(String::from)
            })
            .collect();
        let want = plain["choices"][0]["text"]
            .as_str()
            .or(plain["choices"][0]["message"]["content"].as_str())
            .unwrap();
        assert_eq!(streamed, want, "{path}");
        let finals: Vec<_> = chunks
            .iter()
            .filter(|c| {
                !c["choices"][0]["finish_reason"].is_null()
                    && c["choices"].as_array().is_some_and(|a| !a.is_empty())
            })
            .collect();
        assert_eq!(finals.len(), 1);
        assert_eq!(finals[0]["choices"][0]["finish_reason"], "length");
    }
}

#[actix_rt::test]
async fn bad_input_gets_clear_4xx_and_server_stays_healthy() {
    let mut st = settings();
    st.server.max_body_bytes = 4096;
    st.server.max_input_tokens = 100;
    st.server.max_total_tokens = 200;
    let s = Server::start(st).await;
    let cases: Vec<(&str, Vec<u8>, u16)> = vec![
        ("malformed JSON", b"{\"prompt\": ".to_vec(), 400),
        ("not JSON", b"hello".to_vec(), 400),
        ("empty body", Vec::new(), 400),
        ("invalid UTF-8", b"{\"prompt\": \"\xff\xfe\"}".to_vec(), 400),
        ("wrong type", br#"{"prompt": 5}"#.to_vec(), 422),
        ("missing prompt", br#"{"max_tokens": 5}"#.to_vec(), 422),
        (
            "negative max_tokens",
            br#"{"prompt": "a", "max_tokens": -1}"#.to_vec(),
            422,
        ),
        (
            "zero max_tokens",
            br#"{"prompt": "a", "max_tokens": 0}"#.to_vec(),
            400,
        ),
        (
            "absurd max_tokens",
            br#"{"prompt": "a", "max_tokens": 4000000000}"#.to_vec(),
            400,
        ),
        (
            "temperature out of range",
            br#"{"prompt": "a", "temperature": 7}"#.to_vec(),
            400,
        ),
        (
            "top_p zero",
            br#"{"prompt": "a", "top_p": 0}"#.to_vec(),
            400,
        ),
        (
            "negative top_k",
            br#"{"prompt": "a", "top_k": -5}"#.to_vec(),
            400,
        ),
        ("empty prompt", br#"{"prompt": ""}"#.to_vec(), 400),
        ("n > 8", br#"{"prompt": "a", "n": 9}"#.to_vec(), 400),
        ("n = 0", br#"{"prompt": "a", "n": 0}"#.to_vec(), 400),
        (
            "unknown model",
            br#"{"prompt": "a", "model": "gpt-17"}"#.to_vec(),
            404,
        ),
        (
            "prompt too long",
            format!(r#"{{"prompt": "{}"}}"#, "x".repeat(150)).into_bytes(),
            400,
        ),
        (
            "too large",
            format!(r#"{{"prompt": "{}"}}"#, "x".repeat(5000)).into_bytes(),
            413,
        ),
    ];
    for (name, body, want) in cases {
        let r = s.post_raw("/v1/completions", body).await;
        assert_eq!(r.status().as_u16(), want, "{name}");
        let b: serde_json::Value = r
            .json()
            .await
            .unwrap_or_else(|e| panic!("{name}: body is not JSON: {e}"));
        assert!(
            b["error"]["message"]
                .as_str()
                .is_some_and(|m| !m.is_empty()),
            "{name}: {b}"
        );
        assert!(
            b["error"]["type"].is_string() && b["error"]["code"].is_string(),
            "{name}: {b}"
        );
    }
    let chat_cases = vec![
        (json!({"messages": []}), 400),
        (
            json!({"messages": [{"role": "wizard", "content": "x"}]}),
            400,
        ),
        (json!({"messages": "hi"}), 422),
    ];
    for (body, want) in chat_cases {
        assert_eq!(
            s.post("/v1/chat/completions", body.clone())
                .await
                .status()
                .as_u16(),
            want,
            "{body}"
        );
    }
    assert_eq!(
        s.client.get(s.url("/nope")).send().await.unwrap().status(),
        404
    );
    // A known path with a method it does not take: 405 naming the allowed ones.
    let r = s.client.get(s.url("/v1/completions")).send().await.unwrap();
    assert_eq!(r.status(), 405);
    assert_eq!(r.headers()["allow"], "POST");
    // still healthy and serving
    assert_eq!(
        s.client
            .get(s.url("/health"))
            .send()
            .await
            .unwrap()
            .status(),
        200
    );
    assert_eq!(
        s.post("/v1/completions", json!({"prompt": "ok", "max_tokens": 2}))
            .await
            .status(),
        200
    );
}

#[actix_rt::test]
async fn overload_gets_429_and_disconnect_frees_pages() {
    let mut st = settings();
    st.server.max_concurrent_requests = 2;
    let s = Server::start(st).await;
    let long =
        json!({"prompt": "Count with me", "max_tokens": 1500, "stream": true, "ignore_eos": true});
    let a = s.post("/v1/completions", long.clone()).await;
    let b = s.post("/v1/completions", long.clone()).await;
    assert_eq!(a.status(), 200);
    assert_eq!(b.status(), 200);
    let mut sa = a.bytes_stream();
    sa.next().await.unwrap().unwrap();
    // Two in flight: the third is refused at once, with a JSON body.
    for _ in 0..5 {
        let c = s
            .post("/v1/completions", json!({"prompt": "x", "max_tokens": 2}))
            .await;
        assert_eq!(c.status(), 429);
        let e: serde_json::Value = c.json().await.unwrap();
        assert_eq!(e["error"]["code"], "overloaded");
    }
    assert!(s.gauge("quantmesh_kv_cache_pages_used").await > 0.0);
    assert_eq!(s.gauge("quantmesh_http_requests_in_flight").await, 2.0);
    // Clients go away: their requests are cancelled and every page comes back.
    drop(sa);
    drop(b);
    let mut freed = false;
    for _ in 0..100 {
        if s.gauge("quantmesh_kv_cache_pages_used").await == 0.0
            && s.gauge("quantmesh_num_requests_running").await == 0.0
        {
            freed = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(freed, "pages not freed after disconnect");
    assert_eq!(
        s.post("/v1/completions", json!({"prompt": "x", "max_tokens": 2}))
            .await
            .status(),
        200
    );
}

#[actix_rt::test]
async fn metrics_parse_as_prometheus_exposition() {
    let s = Server::start(settings()).await;
    s.post(
        "/v1/completions",
        json!({"prompt": "Hello", "max_tokens": 4}),
    )
    .await;
    s.post_raw("/v1/completions", b"{".to_vec()).await;
    let scrape = s.metrics().await;
    let names: std::collections::HashSet<&str> = scrape
        .parsed
        .samples
        .iter()
        .map(|x| x.metric.as_str())
        .collect();
    for want in [
        "quantmesh_requests_total",
        "quantmesh_time_to_first_token_seconds",
        "quantmesh_inter_token_latency_seconds",
        "quantmesh_e2e_request_latency_seconds",
        "quantmesh_num_requests_running",
        "quantmesh_num_requests_waiting",
        "quantmesh_kv_cache_pages_used",
        "quantmesh_kv_cache_pages_free",
        "quantmesh_kv_cache_fragmentation_ratio",
        "quantmesh_generation_tokens_total",
        "quantmesh_linear_rows_total",
    ] {
        assert!(names.contains(want), "missing {want}; have {names:?}");
    }
    let ok = scrape.parsed.samples.iter().find(|x| {
        x.metric == "quantmesh_requests_total"
            && x.labels.get("status") == Some("200")
            && x.labels.get("endpoint") == Some("/v1/completions")
    });
    assert!(ok.is_some());
    let bad =
        scrape.parsed.samples.iter().find(|x| {
            x.metric == "quantmesh_requests_total" && x.labels.get("status") == Some("400")
        });
    assert!(bad.is_some());
    assert_eq!(s.gauge("quantmesh_generation_tokens_total").await, 4.0);
}

#[actix_rt::test]
async fn api_keys_and_admin_routes() {
    let mut st = settings();
    st.server.api_keys = vec!["k1".into()];
    let s = Server::start(st).await;
    let body = json!({"prompt": "a", "max_tokens": 1});
    assert_eq!(s.post("/v1/completions", body.clone()).await.status(), 401);
    let r = s
        .client
        .post(s.url("/v1/completions"))
        .bearer_auth("wrong")
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 401);
    let r = s
        .client
        .post(s.url("/v1/completions"))
        .bearer_auth("k1")
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    // no admin token configured: admin routes are disabled and say so
    let r = s.client.get(s.url("/admin/mask")).send().await.unwrap();
    assert_eq!(r.status(), 403);
    let e: serde_json::Value = r.json().await.unwrap();
    assert!(e["error"]["message"]
        .as_str()
        .unwrap()
        .contains("QUANTMESH_ADMIN_TOKEN"));

    let mut st = settings();
    st.server.admin_token = Some(ADMIN_TOKEN.into());
    let s = Server::start(st).await;
    assert_eq!(
        s.client
            .get(s.url("/admin/fallback"))
            .send()
            .await
            .unwrap()
            .status(),
        401
    );
    let force = |group: &str, mode: &str| {
        s.client
            .post(s.url("/admin/fallback"))
            .bearer_auth(ADMIN_TOKEN)
            .json(&json!({"group": group, "mode": mode}))
            .send()
    };
    assert_eq!(force("layers.1.down", "float").await.unwrap().status(), 200);
    let g = s.fallback_group("layers.1.down").await;
    assert_eq!(g["mode"], "forced_float");
    assert_eq!(
        force("layers.99.down", "float").await.unwrap().status(),
        400
    );
    assert_eq!(
        force("layers.1.down", "sideways").await.unwrap().status(),
        422
    );
    // generation continues under the new mask, and float rows are counted
    assert_eq!(
        s.post("/v1/completions", json!({"prompt": "abc", "max_tokens": 3}))
            .await
            .status(),
        200
    );
    let scrape = s.metrics().await;
    let float_rows = scrape
        .parsed
        .samples
        .iter()
        .find(|x| {
            x.metric == "quantmesh_linear_rows_total" && x.labels.get("path") == Some("float")
        })
        .unwrap();
    assert!(matches!(float_rows.value, prometheus_parse::Value::Counter(v) if v > 0.0));
    assert_eq!(s.gauge("quantmesh_monitor_groups_in_fallback").await, 1.0);
    assert_eq!(force("layers.1.down", "auto").await.unwrap().status(), 200);
}

#[actix_rt::test]
async fn graceful_shutdown_finishes_in_flight_streams() {
    // The behaviour under test is "in-flight streams finish", not how fast: give the drain a
    // limit no loaded CI machine reaches (with 10 s a busy 2-core runner cut the stream).
    let mut st = settings();
    st.server.shutdown_timeout_secs = 120;
    let mut s = Server::start(st).await;
    let r = s.post("/v1/completions", json!({"prompt": "Shut down slowly", "max_tokens": 200, "stream": true, "ignore_eos": true, "stream_options": {"include_usage": true}})).await;
    assert_eq!(r.status(), 200);
    let mut stream = r.bytes_stream();
    let mut text = String::from_utf8(stream.next().await.unwrap().unwrap().to_vec()).unwrap();
    s.shutdown();
    while let Some(c) = stream.next().await {
        text.push_str(std::str::from_utf8(&c.unwrap()).unwrap());
    }
    let (chunks, done) = parse_sse(&text);
    assert!(done, "the in-flight stream ran to its end");
    assert_eq!(chunks.last().unwrap()["usage"]["completion_tokens"], 200);
    let task = s.task.take().unwrap();
    tokio::time::timeout(Duration::from_secs(15), task)
        .await
        .expect("server stopped in time")
        .unwrap()
        .unwrap();
    assert!(
        s.client.get(s.url("/health")).send().await.is_err(),
        "no longer accepting"
    );
}

/// The monitor finds the bundled model's planted sensitive group from ordinary traffic
/// through the real HTTP API, and a long stream keeps going across fallback enter and exit.
#[actix_rt::test]
async fn monitor_finds_sensitive_group_through_http_and_streams_survive_switches() {
    let mut st = settings();
    st.server.admin_token = Some(ADMIN_TOKEN.into());
    st.engine.monitor.window_requests = 8;
    st.engine.monitor.warmup_tokens = 256;
    st.engine.monitor.min_window_tokens = 32;
    // The planted harm is 8-bit activation harm: plain W8A8 rows, where spikes count.
    st.engine.split_activations = quantmesh_engine::backend::SplitActivations::Off;
    let s = Server::start(st).await;
    // A long stream that lives through the fallback decisions below.
    let long = s.post("/v1/completions", json!({"prompt": "Keep talking", "max_tokens": 400, "stream": true, "ignore_eos": true, "stream_options": {"include_usage": true}})).await;
    assert_eq!(long.status(), 200);
    let long = actix_rt::spawn(async move { long.text().await.unwrap() });
    let mut found = false;
    for round in 0..8 {
        let reqs = quantmesh_model::bundled::SAMPLE_PROMPTS
            .iter()
            .enumerate()
            .map(|(i, p)| {
                s.post(
                "/v1/completions",
                json!({"prompt": p, "max_tokens": 24, "temperature": 0.8, "seed": round * 10 + i}),
            )
            });
        for r in futures::future::join_all(reqs).await {
            assert_eq!(r.status(), 200);
        }
        let g = s.fallback_group("layers.1.down").await;
        if g["mode"] == "fallback" {
            found = true;
            assert!(g["last_window_rate"].as_f64().unwrap() > 0.01);
            break;
        }
    }
    assert!(
        found,
        "layers.1.down should be in fallback after ordinary traffic"
    );
    let scrape = s.metrics().await;
    let enter = scrape.parsed.samples.iter().find(|x| {
        x.metric == "quantmesh_fallback_decisions_total"
            && x.labels.get("granularity") == Some("layer")
            && x.labels.get("action") == Some("enter")
    });
    assert!(enter.is_some(), "layer fallback decision counted");
    // Exit by hand (int8), then back to automatic, while the long stream is running.
    for mode in ["int8", "auto"] {
        let r = s
            .client
            .post(s.url("/admin/fallback"))
            .bearer_auth(ADMIN_TOKEN)
            .json(&json!({"group": "layers.1.down", "mode": mode}))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        // The answer names the events the decision made: leaving float by hand makes one;
        // handing the group back to the monitor changes nothing here, and makes none.
        let answer: serde_json::Value = r.json().await.unwrap();
        let ids = answer["event_ids"].as_array().expect("event_ids");
        assert_eq!(ids.len(), usize::from(mode == "int8"), "{answer}");
        assert!(ids
            .iter()
            .all(|i| i.as_str().is_some_and(|i| !i.is_empty())));
        assert_eq!(
            s.post(
                "/v1/completions",
                json!({"prompt": "still fine?", "max_tokens": 8})
            )
            .await
            .status(),
            200
        );
    }
    let body = long.await.unwrap();
    let (chunks, done) = parse_sse(&body);
    assert!(done);
    assert_eq!(chunks.last().unwrap()["usage"]["completion_tokens"], 400);
}

/// Counters are updated where things happen, not derived at scrape time: many scrapes at
/// once all read the same totals, and scraping again changes nothing.
#[actix_rt::test]
async fn concurrent_scrapes_do_not_double_count() {
    let s = Server::start(settings()).await;
    let reqs = (0..4).map(|i| {
        s.post(
            "/v1/completions",
            json!({"prompt": format!("Hello {i}"), "max_tokens": 8, "ignore_eos": true}),
        )
    });
    for r in futures::future::join_all(reqs).await {
        assert_eq!(r.status(), 200);
    }
    let totals = |scrape: &common::Scrape| {
        let mut v: Vec<(String, String, u64)> = scrape
            .parsed
            .samples
            .iter()
            .filter(|x| {
                x.metric.ends_with("_total")
                    && (x.metric.starts_with("quantmesh_engine")
                        || x.metric.starts_with("quantmesh_linear")
                        || x.metric.starts_with("quantmesh_generation")
                        || x.metric.starts_with("quantmesh_prompt"))
            })
            .map(|x| {
                let n = match x.value {
                    prometheus_parse::Value::Counter(v) | prometheus_parse::Value::Untyped(v) => v,
                    _ => f64::NAN,
                };
                (
                    x.metric.clone(),
                    format!("{:?}", x.labels.get("path")),
                    n as u64,
                )
            })
            .collect();
        v.sort();
        v
    };
    let scrapes = futures::future::join_all((0..16).map(|_| s.metrics())).await;
    let first = totals(&scrapes[0]);
    let steps = first
        .iter()
        .find(|(m, _, _)| m == "quantmesh_engine_steps_total")
        .map(|t| t.2)
        .expect("steps counted");
    assert!(
        steps >= 8,
        "8 tokens per request take at least 8 steps: {steps}"
    );
    let gen = first
        .iter()
        .find(|(m, _, _)| m == "quantmesh_generation_tokens_total")
        .map(|t| t.2);
    assert_eq!(gen, Some(32));
    for sc in &scrapes[1..] {
        assert_eq!(totals(sc), first, "concurrent scrapes disagree");
    }
    assert_eq!(
        totals(&s.metrics().await),
        first,
        "a later scrape counted again"
    );
}
