//! The OpenAPI contract, fuzzed by a real tool against the real server: `quantmesh serve`
//! (bundled tiny model, API key and admin token set) and schemathesis (PyPI, installed by
//! scripts/test.sh; `QUANTMESH_SCHEMATHESIS` names another `st`). Every route of
//! `/openapi.json` gets a bounded number of generated requests, valid and invalid, with every
//! check schemathesis has (settings in `tests/schemathesis.toml`): no 5xx, every status
//! documented, every body (SSE events included) matches its schema and content type,
//! schema-invalid requests are refused with 4xx (nothing silently ignored), schema-valid ones
//! accepted, calls without the token refused, undeclared methods answered 405; afterwards the
//! server is still ready and still answers.
//!
//! Two allowances, both in the toml: a schema-valid generation request may exceed a limit
//! that depends on the tokenizer (prompt tokens + `max_tokens` > `max_total_tokens`: 400), and
//! admin requests may name a layer the model does not have or reload with no plan source.
//!
//! What it found while it was written (all fixed): 404 instead of 405 for undeclared methods;
//! `top_p`/`repetition_penalty` of 5e-324 rounded to 0 in f32 and refused; integers written
//! as `7.0` refused; unknown fields inside `stream_options` ignored; empty prompts documented
//! as valid; an undocumented 400 of the reload route.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::process::Command;
use std::time::Duration;
use support::*;

fn schemathesis() -> String {
    std::env::var("QUANTMESH_SCHEMATHESIS").unwrap_or_else(|_| {
        let local =
            std::path::Path::new(&std::env::var("HOME").unwrap_or_default()).join(".local/bin/st");
        if local.exists() {
            local.to_string_lossy().into_owned()
        } else {
            "st".into()
        }
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn schemathesis_finds_no_server_error_and_no_contract_violation() {
    let dir = tempfile::tempdir().unwrap();
    let model = model_dir(dir.path());
    let broker = Broker::absent(dir.path());
    // Short limits keep the fuzzed generations short (random `max_tokens` beyond them get
    // the documented 400), so the run's length does not depend on what was drawn.
    let cfg = dir.path().join("quantmesh.toml");
    std::fs::write(
        &cfg,
        "[server]\nmax_input_tokens = 64\nmax_total_tokens = 96\n",
    )
    .unwrap();
    let mut serve = Serve::start(
        &model,
        &dir.path().join("outbox"),
        &broker.addr(),
        // One secret for both, so one header authorises every route.
        &[
            ("QUANTMESH_API_KEYS", ADMIN_TOKEN),
            ("QUANTMESH_MAX_CONCURRENT_REQUESTS", "64"),
            ("QUANTMESH_CONFIG", cfg.to_str().unwrap()),
        ],
    )
    .await;
    let client = reqwest::Client::new();

    let doc: serde_json::Value = client
        .get(serve.url("/openapi.json"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(doc["openapi"], "3.1.0");
    assert!(doc["paths"]["/v1/chat/completions"]["post"]["security"].is_array());

    let report = dir.path().join("schemathesis.xml");
    let run = || {
        let url = serve.url("/openapi.json");
        let report = report.clone();
        let work = dir.path().to_path_buf();
        tokio::task::spawn_blocking(move || {
            Command::new(schemathesis())
                // Its cache (crash replays) goes to the test's temp dir, not the repository.
                .current_dir(&work)
                .arg("--config-file")
                .arg(concat!(
                    env!("CARGO_MANIFEST_DIR"),
                    "/tests/schemathesis.toml"
                ))
                .args(["run", &url])
                .args(["--max-examples", "30", "--seed", "7", "--workers", "2"])
                .args([
                    "--request-timeout",
                    "120",
                    "--phases",
                    "examples,coverage,fuzzing,stateful",
                ])
                .args(["-H", &format!("Authorization: Bearer {ADMIN_TOKEN}")])
                .args(["--report", "junit", "--report-junit-path"])
                .arg(&report)
                .env("NO_COLOR", "1")
                .output()
        })
    };
    let mut out = run()
        .await
        .unwrap()
        .expect("running schemathesis (scripts/test.sh installs it: pip install schemathesis)");
    // A crash inside schemathesis itself (a Python "Runtime Error", no check failed: seen
    // once as a KeyError in its code-inspection step) says nothing about the server: run it
    // once more. A failed check is never retried.
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    if !out.status.success() && text.contains("Runtime Error") && !text.contains("FAILURES") {
        eprintln!("schemathesis crashed internally; running it again:\n{text}");
        out = run().await.unwrap().expect("running schemathesis again");
    }
    let stdout = String::from_utf8_lossy(&out.stdout);
    eprintln!("{stdout}");
    assert!(
        out.status.success(),
        "schemathesis found contract violations:\n{stdout}\n{}\nserver log:\n{}",
        String::from_utf8_lossy(&out.stderr),
        std::fs::read_to_string(&serve.log).unwrap_or_default()
    );
    // It really exercised the generation routes.
    let junit = std::fs::read_to_string(&report).unwrap();
    for op in ["POST /v1/completions", "POST /v1/chat/completions"] {
        assert!(junit.contains(op), "{op} not tested:\n{junit}");
    }
    assert!(serve.metric(&client, "quantmesh_requests_total", &[]).await > 100.0);

    // Still healthy and still serving.
    let ready = client.get(serve.url("/ready")).send().await.unwrap();
    assert_eq!(ready.status(), 200);
    let r = client
        .post(serve.url("/v1/completions"))
        .bearer_auth(ADMIN_TOKEN)
        .json(&serde_json::json!({"prompt": "Hello", "max_tokens": 4}))
        .timeout(Duration::from_secs(60))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200, "{}", r.text().await.unwrap());
    assert_eq!(
        serve
            .metric(&client, "quantmesh_engine_step_failures_total", &[])
            .await,
        0.0
    );
    serve.terminate();
}
