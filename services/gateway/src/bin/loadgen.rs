//! `quantmesh-loadgen`: a small load generator for a running quantmesh (or any
//! OpenAI-compatible) server. Sends streaming completions from N concurrent clients and
//! prints TTFT, inter-token latency and throughput as a table, with the requests that
//! failed and those that came back short (fewer tokens than asked for; EOS is ignored, so a
//! short answer means the server cut it off).
//!
//! ```text
//! quantmesh-loadgen --url http://127.0.0.1:8080 --concurrency 8 --requests 64 --max-tokens 64
//! ```

use clap::Parser;
use futures::StreamExt;
use std::time::{Duration, Instant};

#[derive(Parser)]
#[command(about = "Load generator: streaming completions, prints TTFT / ITL / throughput")]
struct Args {
    #[arg(long, default_value = "http://127.0.0.1:8080")]
    url: String,
    /// Concurrent clients.
    #[arg(long, default_value_t = 8)]
    concurrency: usize,
    /// Total requests.
    #[arg(long, default_value_t = 64)]
    requests: usize,
    /// Tokens to generate per request (EOS ignored).
    #[arg(long, default_value_t = 64)]
    max_tokens: usize,
    /// Sampling temperature sent with every request: 0 (the default) is greedy decoding,
    /// which every OpenAI-compatible server does the same way, so servers compared with one
    /// command sample alike.
    #[arg(long, default_value_t = 0.0)]
    temperature: f64,
    /// Prompt text.
    #[arg(
        long,
        default_value = "The history of computing began with mechanical calculators, and"
    )]
    prompt: String,
    /// Bearer API key, if the server requires one.
    #[arg(long, env = "QUANTMESH_API_KEY")]
    api_key: Option<String>,
}

struct Sample {
    ttft: Duration,
    itl: Vec<Duration>,
    tokens: usize,
    total: Duration,
}

fn pct(v: &mut [f64], p: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    v[((v.len() - 1) as f64 * p).round() as usize]
}

async fn one(client: &reqwest::Client, a: &Args) -> anyhow::Result<Sample> {
    let body = serde_json::json!({"prompt": a.prompt, "max_tokens": a.max_tokens, "stream": true, "ignore_eos": true, "temperature": a.temperature});
    let mut req = client.post(format!("{}/v1/completions", a.url)).json(&body);
    if let Some(k) = &a.api_key {
        req = req.bearer_auth(k);
    }
    let t0 = Instant::now();
    let resp = req.send().await?;
    anyhow::ensure!(resp.status().is_success(), "HTTP {}", resp.status());
    let mut stream = resp.bytes_stream();
    let (mut first, mut last) = (None, None);
    let mut itl = Vec::new();
    let mut tokens = 0;
    let mut buf = String::new();
    while let Some(chunk) = stream.next().await {
        buf.push_str(&String::from_utf8_lossy(&chunk?));
        while let Some(i) = buf.find("\n\n") {
            let event: String = buf.drain(..i + 2).collect();
            let Some(data) = event.trim().strip_prefix("data: ") else {
                continue;
            };
            if data == "[DONE]" {
                continue;
            }
            let v: serde_json::Value = serde_json::from_str(data)?;
            if v["choices"].as_array().is_some_and(|c| !c.is_empty())
                && v["choices"][0]["finish_reason"].is_null()
            {
                let now = Instant::now();
                tokens += 1;
                match last {
                    None => first = Some(now - t0),
                    Some(prev) => itl.push(now - prev),
                }
                last = Some(now);
            }
        }
    }
    Ok(Sample {
        ttft: first.unwrap_or_default(),
        itl,
        tokens,
        total: t0.elapsed(),
    })
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let a = Args::parse();
    // A fresh connection per request: a pooled keep-alive connection that the server closed
    // while idle fails the next request sent on it ("error sending request"), which would
    // count against whichever server closes idle connections first.
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(0)
        .build()?;
    let started = Instant::now();
    let results: Vec<anyhow::Result<Sample>> = futures::stream::iter(0..a.requests)
        .map(|_| one(&client, &a))
        .buffer_unordered(a.concurrency.max(1))
        .collect()
        .await;
    let wall = started.elapsed().as_secs_f64();
    let (ok, errs): (Vec<_>, Vec<_>) = results.into_iter().partition(|r| r.is_ok());
    let samples: Vec<Sample> = ok.into_iter().filter_map(Result::ok).collect();
    for e in errs.iter().filter_map(|r| r.as_ref().err()).take(3) {
        eprintln!("request failed: {e}");
    }
    let mut ttft: Vec<f64> = samples.iter().map(|s| s.ttft.as_secs_f64() * 1e3).collect();
    let mut itl: Vec<f64> = samples
        .iter()
        .flat_map(|s| s.itl.iter().map(|d| d.as_secs_f64() * 1e3))
        .collect();
    let mut e2e: Vec<f64> = samples
        .iter()
        .map(|s| s.total.as_secs_f64() * 1e3)
        .collect();
    let tokens: usize = samples.iter().map(|s| s.tokens).sum();
    let short = samples.iter().filter(|s| s.tokens < a.max_tokens).count();
    println!("| concurrency | requests ok / failed / short | TTFT p50 / p90 ms | ITL p50 / p90 ms | e2e p50 ms | output tok/s |");
    println!("|---|---|---|---|---|---|");
    println!(
        "| {} | {} / {} / {} | {:.1} / {:.1} | {:.2} / {:.2} | {:.0} | {:.0} |",
        a.concurrency,
        samples.len(),
        errs.len(),
        short,
        pct(&mut ttft, 0.5),
        pct(&mut ttft, 0.9),
        pct(&mut itl, 0.5),
        pct(&mut itl, 0.9),
        pct(&mut e2e, 0.5),
        tokens as f64 / wall
    );
    Ok(())
}
