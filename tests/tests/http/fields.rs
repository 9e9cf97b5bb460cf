//! What a request's fields do: honoured or refused (never ignored), limits checked before the
//! body is read, `n` choices, and the prefix cache's partitions.

use crate::common::{parse_sse, settings, Server};
use serde_json::json;
use std::time::Duration;

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
    // A value out of its range is refused by the engine's one check, naming the field.
    for (path, body, param) in [
        ("/v1/completions", cmpl(json!({"n": 9})), "n"),
        ("/v1/chat/completions", chat(json!({"n": 0})), "n"),
        (
            "/v1/completions",
            cmpl(json!({"temperature": 3})),
            "temperature",
        ),
        ("/v1/chat/completions", chat(json!({"top_p": 0})), "top_p"),
        (
            "/v1/completions",
            cmpl(json!({"presence_penalty": 3})),
            "presence_penalty",
        ),
        (
            "/v1/completions",
            cmpl(json!({"logit_bias": {"65": 500}})),
            "logit_bias",
        ),
        ("/v1/completions", cmpl(json!({"logprobs": 21})), "logprobs"),
    ] {
        let r = s.post(path, body.clone()).await;
        assert_eq!(r.status(), 400, "{body}");
        let b: serde_json::Value = r.json().await.unwrap();
        assert_eq!(b["error"]["param"], param, "{b}");
        assert_eq!(b["error"]["code"], "invalid_value", "{b}");
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
