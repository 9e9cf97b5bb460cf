//! The SRE surface, proven against real parts: every PromQL expression of the Grafana
//! dashboards (`dashboards/*.json`) and of the alert rules (`infra/prometheus/alerts.yml`) is
//! evaluated by a real Prometheus (Debian package) scraping the real server (`quantmesh
//! serve`, a real tansu broker) after a few hundred requests, a forced fallback and a config
//! reload. A query fails the test if Prometheus rejects it, if a dashboard query returns no
//! series, or if an alert's expression (its comparison removed) names a series the server
//! does not export. The dashboards are also checked structurally and against their generator;
//! every alert has a summary, a description and a runbook section that exists.
//!
//! Grafana itself is not installable from our registries: the dashboards are query-tested,
//! not screenshot-tested.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::collections::HashSet;
use std::path::PathBuf;
use std::time::{Duration, Instant};
use support::*;

fn repo() -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../.."))
}

/// Every dashboard, parsed.
fn dashboards() -> Vec<(String, serde_json::Value)> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(repo().join("dashboards")).unwrap() {
        let p = e.unwrap().path();
        if p.extension().is_some_and(|x| x == "json") {
            let v = serde_json::from_str(&std::fs::read_to_string(&p).unwrap())
                .unwrap_or_else(|e| panic!("{}: {e}", p.display()));
            out.push((p.file_name().unwrap().to_string_lossy().into_owned(), v));
        }
    }
    out.sort_by(|a, b| a.0.cmp(&b.0));
    out
}

/// (dashboard/panel, expr) for every query target.
fn dashboard_queries() -> Vec<(String, String)> {
    let mut out = Vec::new();
    for (file, d) in dashboards() {
        for p in d["panels"].as_array().unwrap() {
            for t in p["targets"].as_array().unwrap() {
                out.push((
                    format!("{file} / {}", p["title"].as_str().unwrap()),
                    t["expr"].as_str().unwrap().to_string(),
                ));
            }
        }
    }
    out
}

#[test]
fn dashboards_are_generated_well_formed_and_alerts_have_runbooks() {
    let out = std::process::Command::new("python3")
        .arg(repo().join("dashboards/generate.py"))
        .arg("--check")
        .output()
        .expect("python3");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let ds = |v: &serde_json::Value| v["datasource"]["uid"] == "${datasource}";
    let mut uids = HashSet::new();
    let all = dashboards();
    assert_eq!(all.len(), 4, "Overview, Precision, KV cache, Event path");
    for (file, d) in &all {
        assert!(
            uids.insert(d["uid"].as_str().unwrap().to_string()),
            "{file}: uid"
        );
        assert!(d["schemaVersion"].as_u64().unwrap() >= 39, "{file}");
        let vars: Vec<_> = d["templating"]["list"].as_array().unwrap().iter().collect();
        assert!(vars
            .iter()
            .any(|v| v["name"] == "datasource" && v["type"] == "datasource"));
        let mut ids = HashSet::new();
        for p in d["panels"].as_array().unwrap() {
            assert!(ids.insert(p["id"].as_u64().unwrap()), "{file}: panel ids");
            assert!(ds(p), "{file}: {} uses the datasource variable", p["title"]);
            assert!(p["gridPos"]["w"].as_u64().unwrap() > 0);
            let targets = p["targets"].as_array().unwrap();
            assert!(!targets.is_empty(), "{file}: {}", p["title"]);
            for t in targets {
                assert!(ds(t) && t["refId"].is_string() && t["expr"].is_string());
            }
        }
    }
    // Every alert: summary, description, and a runbook section that exists.
    let rules = std::fs::read_to_string(repo().join("infra/prometheus/alerts.yml")).unwrap();
    let runbooks = std::fs::read_to_string(repo().join("docs/runbooks.md")).unwrap();
    let alerts: Vec<&str> = rules
        .lines()
        .filter_map(|l| l.trim().strip_prefix("- alert: "))
        .collect();
    assert!(alerts.len() >= 11, "{alerts:?}");
    for a in &alerts {
        assert!(runbooks.contains(&format!("\n## {a}\n")), "runbook for {a}");
        // The process that raised the alert serves its runbook (`GET /runbooks`; the kafka
        // test follows a fired alert's link).
        assert!(
            rules.contains(&format!(
                "runbook_url: \"http://{{{{ $labels.instance }}}}/runbooks#{}\"",
                quantmesh_telemetry::runbooks::anchor(a)
            )),
            "runbook_url of {a}"
        );
    }
    assert_eq!(rules.matches("summary:").count(), alerts.len());
    assert_eq!(rules.matches("description:").count(), alerts.len());
}

/// The query with Grafana's variables bound as a user would see it: all instances, a
/// rate window that spans a few of this test's 1 s scrapes.
fn bind(expr: &str) -> String {
    expr.replace("$__rate_interval", "30s")
        .replace("$instance", ".*")
}

/// An alert expression without its final comparison: the series it compares.
fn compared(expr: &str) -> &str {
    let re_ops = [" > ", " < ", " >= ", " <= ", " == ", " != "];
    let cut = re_ops
        .iter()
        .filter_map(|op| expr.rfind(op))
        .max()
        .filter(|&i| {
            expr[i..]
                .trim_start_matches([' ', '>', '<', '=', '!'])
                .trim()
                .parse::<f64>()
                .is_ok()
        });
    cut.map_or(expr, |i| &expr[..i])
}

fn metric_names(expr: &str) -> HashSet<String> {
    let mut names = HashSet::new();
    let bytes = expr.as_bytes();
    let mut i = 0;
    while let Some(pos) = expr[i..].find("quantmesh_") {
        let start = i + pos;
        let mut end = start;
        while end < bytes.len() && (bytes[end].is_ascii_alphanumeric() || bytes[end] == b'_') {
            end += 1;
        }
        names.insert(expr[start..end].to_string());
        i = end;
    }
    names
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn every_dashboard_and_alert_query_runs_on_a_real_prometheus() {
    let root = tempfile::tempdir().unwrap();
    let broker = Broker::start(root.path());
    let (model, plan_path, serve) = serve_with_plan(
        root.path(),
        &broker.addr(),
        "",
        "window_requests = 20\nshadow_sample_rate = 0.2",
    )
    .await;
    let prom = Prometheus::start(root.path(), &format!("127.0.0.1:{}", serve.port));
    let http = reqwest::Client::new();

    // Load: a few hundred requests (streamed and not, some refused), a forced fallback, a
    // reload to another class.
    let force = http
        .post(serve.url("/admin/fallback"))
        .bearer_auth(ADMIN_TOKEN)
        .json(&serde_json::json!({"group": "layers.0.o", "mode": "float"}))
        .send()
        .await
        .unwrap();
    assert_eq!(force.status(), 200);
    let t0 = Instant::now();
    let mut tasks = Vec::new();
    for c in 0..16u64 {
        let (http, base) = (http.clone(), serve.base.clone());
        tasks.push(tokio::spawn(async move {
            for i in 0..20u64 {
                let body = if i == 7 {
                    serde_json::json!({"prompt": "x", "temperature": 9})
                } else {
                    serde_json::json!({"prompt": format!("Tell me about {c} and {i}"),
                        "max_tokens": 4 + (i % 8), "stream": i % 2 == 0})
                };
                let r = http
                    .post(format!("{base}/v1/completions"))
                    .json(&body)
                    .send()
                    .await
                    .unwrap();
                let _ = r.bytes().await;
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    std::fs::write(&plan_path, plan_with_class(&model, "layers.1.down", "fp16")).unwrap();
    let r = http
        .post(serve.url("/admin/config/reload"))
        .bearer_auth(ADMIN_TOKEN)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200, "{}", r.text().await.unwrap_or_default());
    eprintln!("load: 320 requests in {:.1} s", t0.elapsed().as_secs_f64());

    // Prometheus has scraped the load (a few samples after it, for rates).
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let v = prom.query_any(&http, "sum(quantmesh_requests_total)").await;
        let n = v["data"]["result"][0]["value"][1]
            .as_str()
            .and_then(|s| s.parse::<f64>().ok())
            .unwrap_or(0.0);
        if n >= 320.0 {
            break;
        }
        assert!(Instant::now() < deadline, "Prometheus did not scrape: {v}");
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    // Rates need samples after the load: wait for three scrapes of it.
    loop {
        let v = prom
            .query_any(&http, "max(count_over_time(quantmesh_requests_total[1m]))")
            .await;
        let scrapes = v["data"]["result"][0]["value"][1]
            .as_str()
            .and_then(|s| s.parse::<f64>().ok())
            .unwrap_or(0.0);
        if scrapes >= 3.0 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "Prometheus stopped scraping: {v}"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }

    let mut failures = Vec::new();
    let exported: HashSet<String> = {
        let v = prom
            .query_any(&http, "count by (__name__) ({__name__=~\"quantmesh_.+\"})")
            .await;
        v["data"]["result"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| s["metric"]["__name__"].as_str().unwrap().to_string())
            .collect()
    };
    let evolution_series: HashSet<String> = {
        let registry = prometheus::Registry::new();
        quantmesh_evolution::metrics::EvolutionMetrics::register(&registry).unwrap();
        registry
            .gather()
            .iter()
            .map(|f| f.name().to_string())
            .collect()
    };
    let queries = dashboard_queries();
    assert!(queries.len() >= 40, "{}", queries.len());
    for (where_, expr) in &queries {
        let v = prom.query_any(&http, &bind(expr)).await;
        if v["status"] != "success" {
            failures.push(format!("{where_}: {expr}: {}", v["error"]));
        } else if v["data"]["result"].as_array().is_none_or(|a| a.is_empty()) {
            failures.push(format!("{where_}: {expr}: no series"));
        }
    }
    let rules = prom.rules(&http).await;
    assert!(rules.len() >= 11, "rules loaded: {rules:?}");
    for (name, expr) in &rules {
        let v = prom.query_any(&http, expr).await;
        if v["status"] != "success" {
            failures.push(format!("alert {name}: {expr}: {}", v["error"]));
        }
        let lhs = compared(expr);
        // The evolution service's rules are about another process (`quantmesh evolve`, whose
        // /metrics tests/evolution.rs scrapes): their series must be the ones it registers.
        let evolution = expr.contains("quantmesh_evolution_");
        for m in metric_names(lhs) {
            let known = if evolution {
                evolution_series.contains(&m)
            } else {
                exported.contains(&m)
            };
            if !known {
                failures.push(format!("alert {name}: {m} is not exported"));
            }
        }
        if lhs != expr && !lhs.contains(" and ") && !evolution {
            let v = prom.query_any(&http, lhs).await;
            if v["data"]["result"].as_array().is_none_or(|a| a.is_empty()) {
                failures.push(format!("alert {name}: {lhs}: no series"));
            }
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {} queries failed:\n{}",
        failures.len(),
        queries.len() + rules.len(),
        failures.join("\n")
    );
    eprintln!(
        "{} dashboard queries and {} alert rules evaluated",
        queries.len(),
        rules.len()
    );
}
