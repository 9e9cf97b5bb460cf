//! A bounded soak of the real server process (`quantmesh serve`, a real tansu broker, real
//! HTTP): 32 concurrent clients with random `max_tokens`, streaming and not, 10 % of streams
//! dropped mid-way, some with penalties; meanwhile a forced fallback every 2 s and a
//! `sensitive_layers.json` reload every 5 s. At the end: no 5xx, no failed transport, every
//! KV page back in the pool, the outbox drained, RSS growth under the bound below.
//!
//! `QUANTMESH_SOAK_SECS` sets the length (default 120 s in the suite; run longer by hand:
//! `QUANTMESH_SOAK_SECS=1800 cargo nextest run -p quantmesh --test soak --no-capture`).

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use support::*;

/// RSS may grow this much over the soak (after a warm-up that sizes the allocator's arenas
/// and the prefix cache): the KV pool and weights are allocated up front, so growth beyond
/// it is a leak.
const RSS_GROWTH_BOUND_MIB: f64 = 96.0;

fn rss_mib(pid: u32) -> f64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
        .map_or(f64::NAN, |kb| kb / 1024.0)
}

/// xorshift64*: a per-client random stream without another dependency.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

#[derive(Default)]
struct Counts {
    ok: AtomicU64,
    disconnected: AtomicU64,
    client_errors: AtomicU64,
    overloaded: AtomicU64,
    server_errors: AtomicU64,
    transport_errors: AtomicU64,
    incomplete_streams: AtomicU64,
}

async fn client_loop(base: String, seed: u64, until: Instant, counts: Arc<Counts>) -> Vec<f64> {
    let client = reqwest::Client::new();
    let mut rng = Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1);
    let mut latencies = Vec::new();
    let prompts = [
        "The weather today",
        "Once upon a time",
        "Hello, world!",
        "1, 2, 3,",
        "Tell me about the sea",
    ];
    while Instant::now() < until {
        let stream = rng.below(10) < 7;
        let disconnect = stream && rng.below(10) == 0;
        let mut body = serde_json::json!({
            "prompt": prompts[rng.below(prompts.len() as u64) as usize],
            "max_tokens": 1 + rng.below(48),
            "temperature": (rng.below(10) as f64) / 10.0,
            "stream": stream,
        });
        if rng.below(20) == 0 {
            body["frequency_penalty"] = serde_json::json!(1.0);
            body["logit_bias"] = serde_json::json!({"65": 5});
        }
        let t0 = Instant::now();
        let r = client
            .post(format!("{base}/v1/completions"))
            .json(&body)
            .send()
            .await;
        let r = match r {
            Ok(r) => r,
            Err(_) => {
                counts.transport_errors.fetch_add(1, Ordering::Relaxed);
                continue;
            }
        };
        match r.status().as_u16() {
            200 => {}
            429 => {
                counts.overloaded.fetch_add(1, Ordering::Relaxed);
                tokio::time::sleep(Duration::from_millis(20)).await;
                continue;
            }
            s if s >= 500 => {
                counts.server_errors.fetch_add(1, Ordering::Relaxed);
                eprintln!("5xx: {s} {}", r.text().await.unwrap_or_default());
                continue;
            }
            _ => {
                counts.client_errors.fetch_add(1, Ordering::Relaxed);
                continue;
            }
        }
        if disconnect {
            // Read the first chunk, then go away mid-stream.
            let mut r = r;
            let _ = r.chunk().await;
            drop(r);
            counts.disconnected.fetch_add(1, Ordering::Relaxed);
            continue;
        }
        match r.text().await {
            Ok(text) if !stream || text.contains("[DONE]") => {
                if text.contains("\"error\"") {
                    counts.incomplete_streams.fetch_add(1, Ordering::Relaxed);
                } else {
                    counts.ok.fetch_add(1, Ordering::Relaxed);
                    latencies.push(t0.elapsed().as_secs_f64() * 1000.0);
                }
            }
            Ok(_) => {
                counts.incomplete_streams.fetch_add(1, Ordering::Relaxed);
            }
            Err(_) => {
                counts.transport_errors.fetch_add(1, Ordering::Relaxed);
            }
        }
    }
    latencies
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn soak_with_churn_leaks_nothing_and_fails_nothing() {
    let secs: u64 = std::env::var("QUANTMESH_SOAK_SECS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(120);
    let root = tempfile::tempdir().unwrap();
    let broker = Broker::start(root.path());
    let (model, plan_path, serve) = serve_with_plan(
        root.path(),
        &broker.addr(),
        "max_concurrent_requests = 48",
        "window_requests = 50",
    )
    .await;
    let plan = |class: &str| plan_with_class(&model, "layers.1.down", class);
    let pid = serve.pid().unwrap();
    let http = reqwest::Client::new();

    // Warm-up: every code path once, so the allocator and caches reach their working size.
    let warm = Arc::new(Counts::default());
    let handles: Vec<_> = (0..32)
        .map(|i| {
            tokio::spawn(client_loop(
                serve.base.clone(),
                1000 + i,
                Instant::now() + Duration::from_secs(5),
                warm.clone(),
            ))
        })
        .collect();
    for h in handles {
        h.await.unwrap();
    }
    let rss_start = rss_mib(pid);

    let t0 = Instant::now();
    let until = t0 + Duration::from_secs(secs);
    let counts = Arc::new(Counts::default());
    let clients: Vec<_> = (0..32)
        .map(|i| tokio::spawn(client_loop(serve.base.clone(), i, until, counts.clone())))
        .collect();
    // The churn: a forced fallback every 2 s, a reload to the other class every 5 s.
    let (mut forces, mut reloads, mut reload_failures) = (0u32, 0u32, 0u32);
    let groups = groups();
    let mut next_reload = Instant::now() + Duration::from_secs(5);
    let mut class = "w8a8_per_channel";
    while Instant::now() < until {
        tokio::time::sleep(Duration::from_secs(2)).await;
        let g = &groups[forces as usize % groups.len()];
        let mode = if forces % 2 == 0 { "float" } else { "auto" };
        let r = http
            .post(serve.url("/admin/fallback"))
            .bearer_auth(ADMIN_TOKEN)
            .json(&serde_json::json!({"group": g, "mode": mode}))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200, "{}", r.text().await.unwrap_or_default());
        forces += 1;
        if Instant::now() >= next_reload {
            next_reload += Duration::from_secs(5);
            class = if class == "fp16" {
                "w8a8_per_channel"
            } else {
                "fp16"
            };
            std::fs::write(&plan_path, plan(class)).unwrap();
            let r = http
                .post(serve.url("/admin/config/reload"))
                .bearer_auth(ADMIN_TOKEN)
                .send()
                .await
                .unwrap();
            let code = r.status().as_u16();
            let body: serde_json::Value = r.json().await.unwrap_or_default();
            if code == 200 && body["result"] == "applied" {
                reloads += 1;
            } else {
                reload_failures += 1;
                eprintln!("reload: {code} {body}");
            }
        }
    }
    let mut latencies = Vec::new();
    for c in clients {
        latencies.extend(c.await.unwrap());
    }
    let elapsed = t0.elapsed().as_secs_f64();

    // Quiescent: nothing running, every page back, every event delivered.
    let settle = Instant::now();
    let (mut used, mut running) = (f64::NAN, f64::NAN);
    while settle.elapsed() < Duration::from_secs(30) {
        used = serve
            .metric(&http, "quantmesh_kv_cache_pages_used", &[])
            .await;
        running = serve
            .metric(&http, "quantmesh_num_requests_running", &[])
            .await
            + serve
                .metric(&http, "quantmesh_num_requests_waiting", &[])
                .await;
        if used == 0.0 && running == 0.0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let mut depth = f64::NAN;
    while settle.elapsed() < Duration::from_secs(90) {
        depth = serve
            .metric(&http, "quantmesh_events_outbox_depth", &[])
            .await;
        if depth == 0.0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let rss_end = rss_mib(pid);
    let load = |a: &AtomicU64| a.load(Ordering::Relaxed);
    let c = &counts;
    let finished = load(&c.ok);
    eprintln!(
        "\nsoak: {elapsed:.0} s, 32 clients, {forces} forced fallbacks, {reloads} reloads ({reload_failures} failed)\n\
         | completed | disconnected | 4xx | 429 | 5xx | transport errors | broken streams | req/s | p50 ms | p99 ms | pages leaked | outbox left | RSS start MiB | RSS end MiB |\n\
         |---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n\
         | {finished} | {} | {} | {} | {} | {} | {} | {:.1} | {:.0} | {:.0} | {used} | {depth} | {rss_start:.0} | {rss_end:.0} |",
        load(&c.disconnected),
        load(&c.client_errors),
        load(&c.overloaded),
        load(&c.server_errors),
        load(&c.transport_errors),
        load(&c.incomplete_streams),
        finished as f64 / elapsed,
        percentile(&latencies, 0.5),
        percentile(&latencies, 0.99),
    );
    assert!(finished > 0 && load(&c.disconnected) > 0, "the soak ran");
    assert_eq!(load(&c.server_errors), 0, "5xx during the soak");
    assert_eq!(load(&c.transport_errors), 0, "transport errors");
    assert_eq!(load(&c.incomplete_streams), 0, "streams that broke off");
    assert_eq!(load(&c.client_errors), 0, "4xx for valid requests");
    assert_eq!(reload_failures, 0, "reloads that did not apply");
    assert!(reloads > 0);
    assert_eq!(
        (used, running),
        (0.0, 0.0),
        "KV pages or requests left behind"
    );
    assert_eq!(depth, 0.0, "events left in the outbox");
    assert!(
        rss_end - rss_start < RSS_GROWTH_BOUND_MIB,
        "RSS grew {:.0} MiB (bound {RSS_GROWTH_BOUND_MIB})",
        rss_end - rss_start
    );
}
