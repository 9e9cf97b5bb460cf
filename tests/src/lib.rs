//! quantmesh's test kit, shared by every end-to-end test (this crate's and the `quantmesh`
//! binary's): one wait on a condition, one metrics scraper that fails on a missing series,
//! one server-process builder, the real parts (tansu broker, Prometheus, free ports), one SSE
//! parser, the admin API's JSON reads, and a stand-in for a git forge's REST API
//! (`forge_stub`, where no real forge can be installed), a git server over HTTP that requires
//! credentials (`git_http`: git's own http-backend), and the check that keeps a
//! document's generated block current (`generated`).

#![allow(clippy::unwrap_used, clippy::expect_used)] // a failed step fails the test

pub mod forge_stub;
pub mod generated;
pub mod git_http;
pub mod metrics;
pub mod parts;
pub mod process;

use std::time::{Duration, Instant};

/// Run `check` every `every` until it gives `Ok`, for at most `within`; past that, fail with
/// the last `Err` it gave (what it saw). The one wait-on-a-condition loop of the tests.
pub async fn poll<T, F, Fut>(within: Duration, every: Duration, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, String>>,
{
    let t0 = Instant::now();
    loop {
        match check().await {
            Ok(v) => return v,
            Err(seen) => assert!(t0.elapsed() < within, "after {within:?}: {seen}"),
        }
        tokio::time::sleep(every).await;
    }
}

/// GET `url` with a bearer token and parse the JSON answer (the admin API's reads).
pub async fn get_json(client: &reqwest::Client, url: &str, token: &str) -> serde_json::Value {
    client
        .get(url)
        .bearer_auth(token)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap()
}

/// Parse an SSE body into the JSON payloads of its `data:` lines (without `[DONE]`), and
/// whether `[DONE]` was seen.
pub fn parse_sse(body: &str) -> (Vec<serde_json::Value>, bool) {
    let mut out = Vec::new();
    let mut done = false;
    for line in body.lines() {
        if let Some(d) = line.strip_prefix("data: ") {
            if d == "[DONE]" {
                done = true;
            } else {
                out.push(serde_json::from_str(d).expect("chunk is JSON"));
            }
        }
    }
    (out, done)
}
