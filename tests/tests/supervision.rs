//! Supervision through the real embedded server, with faults injected by the engine's
//! test-only hook (feature `fault-injection`): a panicking step fails only its own requests
//! and the server keeps serving; a reload whose second half fails leaves the old weights
//! and plan in force. Faults are process-wide: nextest runs each test in its own process.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::{settings, wait_for, PlannedModel, Server, ADMIN_TOKEN};
use quantmesh_engine::faults;
use serde_json::{json, Value};

async fn metric(s: &Server, name: &str, label: Option<(&str, &str)>) -> f64 {
    let labels: Vec<(&str, &str)> = label.into_iter().collect();
    s.metrics().await.sum(name, &labels)
}

async fn ready(s: &Server) -> u16 {
    s.client
        .get(s.url("/ready"))
        .send()
        .await
        .unwrap()
        .status()
        .as_u16()
}

#[actix_rt::test]
async fn a_panicking_step_fails_only_its_requests_and_the_server_keeps_serving() {
    let s = Server::start(settings()).await;
    // Three long generations in flight together.
    let long = json!({"prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": true, "temperature": 0});
    let inflight: Vec<_> = (0..3)
        .map(|_| {
            let (client, url, body) = (s.client.clone(), s.url("/v1/completions"), long.clone());
            actix_rt::spawn(async move {
                let r = client.post(url).json(&body).send().await.unwrap();
                let status = r.status().as_u16();
                (status, r.json::<Value>().await.unwrap())
            })
        })
        .collect();
    wait_for(30, "three running requests", || async {
        (metric(&s, "quantmesh_num_requests_running", None).await >= 3.0).then_some(())
    })
    .await;
    faults::panic_next_steps(1);
    for t in inflight {
        let (status, body) = t.await.unwrap();
        assert_eq!(status, 500, "{body}");
        assert_eq!(body["error"]["type"], "server_error", "{body}");
    }
    // Contained, counted, and the engine is whole: ready, pages back, new requests served.
    assert_eq!(
        metric(
            &s,
            "quantmesh_engine_step_failures_total",
            Some(("cause", "panic"))
        )
        .await,
        1.0
    );
    assert_eq!(ready(&s).await, 200);
    wait_for(10, "every KV page back", || async {
        (metric(&s, "quantmesh_kv_cache_pages_used", None).await == 0.0).then_some(())
    })
    .await;
    assert_eq!(
        metric(&s, "quantmesh_num_requests_running", None).await,
        0.0
    );
    for prompt in ["Hello", "Once upon a time"] {
        let r = s
            .post(
                "/v1/completions",
                json!({"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": true}),
            )
            .await;
        assert_eq!(r.status(), 200);
        let b: Value = r.json().await.unwrap();
        assert_eq!(b["usage"]["completion_tokens"], 8, "{b}");
    }
    // A panic on every step for a while: each request fails alone, none hangs, and the
    // server recovers as soon as the fault is gone.
    faults::panic_next_steps(3);
    for _ in 0..3 {
        let r = s
            .post("/v1/completions", json!({"prompt": "Hi", "max_tokens": 4}))
            .await;
        assert_eq!(r.status(), 500);
    }
    let r = s
        .post("/v1/completions", json!({"prompt": "Hi", "max_tokens": 4}))
        .await;
    assert_eq!(r.status(), 200);
    assert_eq!(
        metric(
            &s,
            "quantmesh_engine_step_failures_total",
            Some(("cause", "panic"))
        )
        .await,
        4.0
    );
    assert_eq!(ready(&s).await, 200);
}

#[actix_rt::test]
async fn a_reload_failing_after_the_swap_rolls_the_weights_back() {
    let dir = tempfile::tempdir().unwrap();
    let model = PlannedModel::write(dir.path().join("model"));
    let version = |class: &str| {
        model.plan(
            json!({"k": 4.0, "trigger_rate": 0.01}),
            json!({"layers.1.down": {"class": class}}),
        )
    };
    let file = dir.path().join("sensitive_layers.json");
    let first = version("w8a8_per_channel");
    std::fs::write(&file, &first).unwrap();
    let mut st = settings();
    st.model.source = model.dir.display().to_string();
    st.engine.sensitive_layers = Some(file.display().to_string());
    st.engine.reload_interval = std::time::Duration::from_secs(3600);
    st.server.admin_token = Some(ADMIN_TOKEN.into());
    let s = Server::start(st).await;
    let before = s.admin_get("/admin/config").await;
    let bytes_before = metric(&s, "quantmesh_weight_resident_bytes", None).await;
    assert_eq!(before["residency"]["layers.1.down"], "dual");

    // int8-only `down`: fewer resident bytes once applied. The monitor's reconfiguration
    // fails after the swap: the swap is undone.
    let second = version("w8a8");
    std::fs::write(&file, &second).unwrap();
    faults::fail_next_reconfigures(1);
    let (code, body) = s.admin_post("/admin/config/reload").await;
    assert!(code >= 400, "{code} {body}");
    assert_eq!(body["result"], "failed", "{body}");
    let after = s.admin_get("/admin/config").await;
    assert_eq!(after["md5"], before["md5"], "the old plan is in force");
    assert_eq!(after["residency"], before["residency"]);
    assert_eq!(
        metric(&s, "quantmesh_weight_resident_bytes", None).await,
        bytes_before,
        "the old weights are back"
    );
    let r = s
        .post("/v1/completions", json!({"prompt": "Hi", "max_tokens": 4}))
        .await;
    assert_eq!(r.status(), 200);

    // Without the fault the same version applies.
    let (code, body) = s.admin_post("/admin/config/reload").await;
    assert_eq!(
        (code, body["result"].as_str()),
        (200, Some("applied")),
        "{body}"
    );
    assert_eq!(
        s.admin_get("/admin/config").await["residency"]["layers.1.down"],
        "int8"
    );
    assert!(metric(&s, "quantmesh_weight_resident_bytes", None).await < bytes_before);
}
