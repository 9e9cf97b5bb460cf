//! The real embedded server on a free port, real HTTP.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::{parse_sse, settings, Server, ADMIN_TOKEN};
use futures::StreamExt;
use serde_json::json;
use std::time::Duration;

#[actix_rt::test]
async fn completion_chat_and_models() {
    let s = Server::start(settings()).await;
    let r = s.post("/v1/completions", json!({"model": "quantmesh-tiny", "prompt": "Hello", "max_tokens": 8, "temperature": 0})).await;
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
            json!({"prompt": "Once upon a time", "max_tokens": 24, "temperature": 0.9, "seed": 42})
        } else {
            json!({"messages": [{"role": "user", "content": "Tell me a story"}], "max_tokens": 24, "temperature": 0.9, "seed": 42})
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
    let names: std::collections::HashSet<&str> =
        scrape.samples.iter().map(|x| x.metric.as_str()).collect();
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
    let ok = scrape.samples.iter().find(|x| {
        x.metric == "quantmesh_requests_total"
            && x.labels.get("status") == Some("200")
            && x.labels.get("endpoint") == Some("/v1/completions")
    });
    assert!(ok.is_some());
    let bad = scrape
        .samples
        .iter()
        .find(|x| x.metric == "quantmesh_requests_total" && x.labels.get("status") == Some("400"));
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
    let enter = scrape.samples.iter().find(|x| {
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
    let totals = |scrape: &prometheus_parse::Scrape| {
        let mut v: Vec<(String, String, u64)> = scrape
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

async fn completion_text(s: &Server, body: serde_json::Value) -> String {
    let b: serde_json::Value = s.post("/v1/completions", body).await.json().await.unwrap();
    b["choices"][0]["text"].as_str().unwrap().to_string()
}

/// Every request field is honoured or refused with a 400 naming it — never silently
/// dropped; penalties and `logit_bias` change the output as documented.
#[actix_rt::test]
async fn request_fields_are_honoured_or_refused_never_ignored() {
    let s = Server::start(settings()).await;
    let chat = |extra: serde_json::Value| {
        let mut b = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4});
        b.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        b
    };
    let cmpl = |extra: serde_json::Value| {
        let mut b = json!({"prompt": "Hello there", "max_tokens": 4});
        b.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        b
    };
    let refused = [
        (
            "/v1/completions",
            cmpl(json!({"frobnicate": 1})),
            "frobnicate",
        ),
        (
            "/v1/chat/completions",
            chat(json!({"tools": [{"type": "function", "function": {"name": "f"}}]})),
            "tools",
        ),
        (
            "/v1/chat/completions",
            chat(json!({"response_format": {"type": "json_object"}})),
            "response_format",
        ),
        (
            "/v1/chat/completions",
            chat(json!({"logprobs": 3})),
            "logprobs",
        ),
        (
            "/v1/chat/completions",
            chat(json!({"top_logprobs": 2})),
            "top_logprobs",
        ),
        (
            "/v1/completions",
            cmpl(json!({"logprobs": true})),
            "logprobs",
        ),
        ("/v1/completions", cmpl(json!({"echo": true})), "echo"),
        ("/v1/completions", cmpl(json!({"n": 9})), "n"),
        (
            "/v1/completions",
            cmpl(json!({"logit_bias": {"x": 1}})),
            "logit_bias",
        ),
    ];
    for (path, body, param) in refused {
        let r = s.post(path, body.clone()).await;
        assert_eq!(r.status(), 400, "{body}");
        let b: serde_json::Value = r.json().await.unwrap();
        assert_eq!(b["error"]["param"], param, "{b}");
        assert_eq!(b["error"]["code"], "unsupported_parameter", "{b}");
    }
    for (body, what) in [
        (cmpl(json!({"presence_penalty": 3})), "presence_penalty"),
        (cmpl(json!({"repetition_penalty": 0})), "repetition_penalty"),
        (cmpl(json!({"logit_bias": {"999999": 1}})), "vocabulary"),
        (cmpl(json!({"logit_bias": {"65": 500}})), "logit_bias"),
        (cmpl(json!({"logprobs": 21})), "log-probabilities"),
    ] {
        let r = s.post("/v1/completions", body.clone()).await;
        assert_eq!(r.status(), 400, "{body}");
        let b: serde_json::Value = r.json().await.unwrap();
        assert!(
            b["error"]["message"].as_str().unwrap().contains(what),
            "{b}"
        );
    }
    // What asks for nothing is fine: nulls, the defaults, and `user`.
    for body in [
        chat(
            json!({"tools": null, "tool_choice": "none", "response_format": {"type": "text"},
                    "logprobs": false, "user": "alice", "parallel_tool_calls": false,
                    "max_completion_tokens": 4, "stream_options": null}),
        ),
        cmpl(json!({"echo": false, "best_of": 1, "logprobs": null, "suffix": null, "user": "bob"})),
    ] {
        let path = if body.get("messages").is_some() {
            "/v1/chat/completions"
        } else {
            "/v1/completions"
        };
        let r = s.post(path, body.clone()).await;
        assert_eq!(r.status(), 200, "{body}: {}", r.text().await.unwrap());
    }

    // Log-probabilities: one entry per token, the sampled one the most likely at
    // temperature 0, alternatives sorted; streamed entries add up to the tokens.
    let b: serde_json::Value = s
        .post(
            "/v1/completions",
            cmpl(json!({"logprobs": 3, "temperature": 0, "max_tokens": 6, "ignore_eos": true})),
        )
        .await
        .json()
        .await
        .unwrap();
    let lp = &b["choices"][0]["logprobs"];
    let toks = lp["tokens"].as_array().unwrap();
    assert_eq!(toks.len(), 6, "{b}");
    assert_eq!(
        toks.iter().map(|t| t.as_str().unwrap()).collect::<String>(),
        b["choices"][0]["text"].as_str().unwrap()
    );
    for (i, top) in lp["top_logprobs"].as_array().unwrap().iter().enumerate() {
        let mut vals: Vec<f64> = top
            .as_object()
            .unwrap()
            .values()
            .map(|v| v.as_f64().unwrap())
            .collect();
        assert!(!vals.is_empty() && vals.len() <= 3, "{top}");
        vals.sort_by(|a, b| b.total_cmp(a));
        let sampled = lp["token_logprobs"][i].as_f64().unwrap();
        assert!(sampled <= 0.0 && (sampled - vals[0]).abs() < 1e-5, "{lp}");
    }
    let b: serde_json::Value = s
        .post(
            "/v1/chat/completions",
            chat(json!({"logprobs": true, "top_logprobs": 2, "max_tokens": 5, "ignore_eos": true})),
        )
        .await
        .json()
        .await
        .unwrap();
    let content = b["choices"][0]["logprobs"]["content"].as_array().unwrap();
    assert_eq!(content.len(), 5, "{b}");
    assert!(
        content
            .iter()
            .all(|e| e["top_logprobs"].as_array().unwrap().len() == 2 && e["bytes"].is_array()),
        "{b}"
    );
    let text = s
        .post(
            "/v1/chat/completions",
            chat(json!({"logprobs": true, "max_tokens": 7, "ignore_eos": true, "stream": true})),
        )
        .await
        .text()
        .await
        .unwrap();
    let (chunks, _) = parse_sse(&text);
    let streamed: usize = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["logprobs"]["content"].as_array())
        .map(Vec::len)
        .sum();
    assert_eq!(streamed, 7, "{text}");

    // logit_bias: +100 on one byte token makes greedy decoding emit only it.
    let text = |b: serde_json::Value| completion_text(&s, b);
    let greedy = json!({"prompt": "The cat sat on the", "max_tokens": 24, "temperature": 0, "ignore_eos": true});
    for (id, ch) in [(65u32, "A"), (122, "z")] {
        let mut b = greedy.clone();
        b["logit_bias"] = json!({id.to_string(): 100});
        assert_eq!(text(b).await, ch.repeat(24));
    }
    // Penalties: the plain greedy text repeats tokens; with frequency and presence
    // penalties at their maximum, more distinct tokens appear (and a repetition penalty
    // changes the text too).
    let distinct = |t: &str| t.bytes().collect::<std::collections::HashSet<u8>>().len();
    let plain = text(greedy.clone()).await;
    assert!(
        distinct(&plain) < plain.len(),
        "the plain text repeats: {plain:?}"
    );
    let mut b = greedy.clone();
    b["frequency_penalty"] = json!(2.0);
    b["presence_penalty"] = json!(2.0);
    let penalised = text(b).await;
    assert!(
        distinct(&penalised) > distinct(&plain),
        "{plain:?} → {penalised:?}"
    );
    let mut b = greedy.clone();
    b["repetition_penalty"] = json!(2.0);
    assert_ne!(text(b).await, plain);
}

/// Limits come before work: a body declared over the limit is refused before a byte of it
/// is read, and with every permit taken a request is refused before its body is read.
#[actix_rt::test]
async fn limits_are_checked_before_the_body_is_read() {
    use std::io::{Read, Write};
    let mut st = settings();
    st.server.max_body_bytes = 4096;
    st.server.max_concurrent_requests = 1;
    let s = Server::start(st).await;
    let addr = s.base.trim_start_matches("http://").to_string();
    // Headers only, then wait: the answer must come without the body.
    let answer = |content_length: usize| {
        let addr = addr.clone();
        std::thread::spawn(move || {
            let mut c = std::net::TcpStream::connect(addr).unwrap();
            c.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
            write!(
                c,
                "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {content_length}\r\n\r\n{{\"prompt\": "
            )
            .unwrap();
            let mut buf = [0u8; 4096];
            let n = c.read(&mut buf).unwrap_or(0);
            String::from_utf8_lossy(&buf[..n]).to_string()
        })
    };
    let r = answer(1 << 30).join().unwrap();
    assert!(r.starts_with("HTTP/1.1 413"), "{r}");
    // One long stream holds the only permit.
    let long = s
        .post(
            "/v1/completions",
            json!({"prompt": "Keep talking", "max_tokens": 1500, "stream": true, "ignore_eos": true}),
        )
        .await;
    assert_eq!(long.status(), 200);
    let r = answer(100).join().unwrap();
    assert!(r.starts_with("HTTP/1.1 429"), "{r}");
    assert!(r.contains("max_concurrent_requests"), "{r}");
    drop(long);
}

/// `n` choices, whole and streamed: indexed, each finished, usage summing their tokens.
#[actix_rt::test]
async fn n_choices_whole_and_streamed() {
    let s = Server::start(settings()).await;
    for path in ["/v1/completions", "/v1/chat/completions"] {
        let mut body = if path == "/v1/completions" {
            json!({"prompt": "Once upon a time", "max_tokens": 12, "temperature": 1.0, "seed": 3, "n": 3, "ignore_eos": true, "logprobs": 1})
        } else {
            json!({"messages": [{"role": "user", "content": "Tell me a story"}], "max_tokens": 12, "temperature": 1.0, "seed": 3, "n": 3, "ignore_eos": true})
        };
        let b: serde_json::Value = s.post(path, body.clone()).await.json().await.unwrap();
        let choices = b["choices"].as_array().unwrap();
        assert_eq!(choices.len(), 3, "{b}");
        for (i, c) in choices.iter().enumerate() {
            assert_eq!(c["index"], i, "{b}");
            assert_eq!(c["finish_reason"], "length", "{b}");
        }
        assert_eq!(b["usage"]["completion_tokens"], 36, "{b}");
        let text = |c: &serde_json::Value| {
            c["text"]
                .as_str()
                .or(c["message"]["content"].as_str())
                .or(c["delta"]["content"].as_str())
                .unwrap_or("")
                .to_string()
        };
        let whole: Vec<String> = choices.iter().map(text).collect();
        assert!(whole[0] != whole[1] || whole[1] != whole[2], "{whole:?}");
        if path == "/v1/completions" {
            for c in choices {
                assert_eq!(c["logprobs"]["tokens"].as_array().unwrap().len(), 12, "{c}");
            }
        }
        // Streamed: the same three texts, interleaved by index; one finish per choice.
        body["stream"] = json!(true);
        body["stream_options"] = json!({"include_usage": true});
        let raw = s.post(path, body).await.text().await.unwrap();
        let (chunks, done) = parse_sse(&raw);
        assert!(done, "{raw}");
        let mut streamed = vec![String::new(); 3];
        let mut finishes = [0; 3];
        for c in &chunks {
            for ch in c["choices"].as_array().unwrap() {
                let i = ch["index"].as_u64().unwrap() as usize;
                streamed[i].push_str(&text(ch));
                if !ch["finish_reason"].is_null() {
                    finishes[i] += 1;
                }
            }
        }
        assert_eq!(streamed, whole, "{path}");
        assert_eq!(finishes, [1, 1, 1]);
        assert_eq!(chunks.last().unwrap()["usage"]["completion_tokens"], 36);
    }
}

/// Prefix-cache isolation: with `per_api_key`, a second tenant sending the same prompt
/// computes it (no cached pages, so no timing signal), the first tenant's repeat hits its
/// own pages; `cache_salt` partitions within a key (and without keys).
#[actix_rt::test]
async fn prefix_cache_is_partitioned_by_api_key_and_cache_salt() {
    let mut settings = settings();
    settings.server.api_keys = vec!["tenant-a".into(), "tenant-b".into()];
    settings.server.prefix_cache_isolation = quantmesh_settings::PrefixCacheIsolation::PerApiKey;
    let s = Server::start(settings).await;
    let hits = || async { s.gauge("quantmesh_prefix_cache_hit_pages_total").await };
    // Long enough to fill several 16-token pages.
    let prompt = "The quick brown fox jumps over the lazy dog. ".repeat(8);
    let send = |key: &'static str, salt: Option<&'static str>| {
        let mut body = json!({"prompt": prompt, "max_tokens": 2, "temperature": 0});
        if let Some(salt) = salt {
            body["cache_salt"] = json!(salt);
        }
        let req = s
            .client
            .post(s.url("/v1/completions"))
            .bearer_auth(key)
            .json(&body);
        async move {
            let r = req.send().await.expect("request");
            assert_eq!(r.status(), 200, "{}", r.text().await.unwrap_or_default());
        }
    };
    let h0 = hits().await;
    send("tenant-a", None).await;
    assert_eq!(hits().await, h0, "first request: nothing cached yet");
    send("tenant-b", None).await;
    assert_eq!(
        hits().await,
        h0,
        "another tenant must not hit tenant-a's pages"
    );
    send("tenant-a", Some("conversation-1")).await;
    assert_eq!(
        hits().await,
        h0,
        "another salt of the same tenant is another partition"
    );
    send("tenant-a", None).await;
    let h1 = hits().await;
    assert!(h1 > h0, "the same tenant hits its own pages ({h0} → {h1})");
    send("tenant-b", None).await;
    assert!(hits().await > h1, "tenant-b hits its own pages");
    // The same in vLLM's terms: prompt tokens looked up and served from the cache.
    let queries = s.gauge("quantmesh_prefix_cache_queries_total").await;
    let token_hits = s.gauge("quantmesh_prefix_cache_hits_total").await;
    assert!(
        token_hits > 0.0 && token_hits < queries,
        "{token_hits} of {queries}"
    );
    let finished =
        |r: &'static str| s.labelled("quantmesh_request_success_total", "finished_reason", r);
    let (length, stop) = (finished("length").await, finished("stop").await);
    assert_eq!(
        length.unwrap_or(0.0) + stop.unwrap_or(0.0),
        5.0,
        "{length:?} {stop:?}"
    );
    // A salt that is not 1 to 256 characters is refused, naming the field.
    let r = s
        .client
        .post(s.url("/v1/completions"))
        .bearer_auth("tenant-a")
        .json(&json!({"prompt": "x", "cache_salt": ""}))
        .send()
        .await
        .expect("request");
    assert_eq!(r.status(), 400);
    let v: serde_json::Value = r.json().await.expect("json");
    assert_eq!(v["error"]["param"], "cache_salt");
}
