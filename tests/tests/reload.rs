//! Hot reload of sensitive_layers.json through the real embedded server: under streaming
//! load, with valid, invalid and truncated versions; poll interval; SIGHUP and the admin
//! route; an object-store `latest` pointer.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::{parse_sse, settings, wait_for, PlannedModel, Server, ADMIN_TOKEN};
use serde_json::{json, Value};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

const DOWN: &str = "layers.1.down";

struct Fixture {
    _dir: tempfile::TempDir,
    model: PlannedModel,
    file: PathBuf,
}

fn fixture() -> Fixture {
    let dir = tempfile::tempdir().unwrap();
    let model = PlannedModel::write(dir.path().join("model"));
    let file = dir.path().join("sensitive_layers.json");
    Fixture {
        _dir: dir,
        model,
        file,
    }
}

impl Fixture {
    /// A valid version: threshold k and the class of `layers.1.down`.
    fn version(&self, k: f64, down_class: &str) -> Vec<u8> {
        self.model.plan(
            json!({"k": k, "trigger_rate": 0.01}),
            json!({DOWN: {"class": down_class, "monitor": {"k": k + 1.0}}}),
        )
    }

    fn settings(&self, interval: &str) -> quantmesh_settings::Settings {
        let mut s = settings();
        s.model.source = self.model.dir.display().to_string();
        s.engine.sensitive_layers = Some(self.file.display().to_string());
        s.engine.reload_interval = humantime_parse(interval);
        s.server.admin_token = Some(ADMIN_TOKEN.into());
        s
    }
}

fn humantime_parse(s: &str) -> Duration {
    let (n, unit) = s.split_at(s.find(|c: char| !c.is_ascii_digit()).unwrap());
    let n: u64 = n.parse().unwrap();
    match unit {
        "ms" => Duration::from_millis(n),
        "s" => Duration::from_secs(n),
        _ => panic!("unit"),
    }
}

fn md5_hex(b: &[u8]) -> String {
    format!("{:x}", md5::compute(b))
}

fn expected_residency(class: &str) -> &'static str {
    match class {
        "fp16" => "float",
        "w8a8_per_channel" => "dual",
        _ => "int8",
    }
}

/// Streams completions until told to stop; counts successes and failures.
fn spawn_load(
    base: String,
    stop: Arc<AtomicBool>,
    ok: Arc<AtomicU64>,
    failed: Arc<AtomicU64>,
) -> actix_rt::task::JoinHandle<()> {
    actix_rt::spawn(async move {
        let client = reqwest::Client::new();
        let mut i = 0u64;
        while !stop.load(Ordering::Relaxed) {
            i += 1;
            let body = json!({"prompt": format!("Hello, world! Tell me {i}."), "max_tokens": 12,
                              "stream": true, "temperature": 0});
            let good = match client
                .post(format!("{base}/v1/completions"))
                .json(&body)
                .send()
                .await
            {
                Ok(r) if r.status() == 200 => match r.text().await {
                    Ok(text) => {
                        let (chunks, done) = parse_sse(&text);
                        done && !chunks.is_empty()
                            && chunks.iter().all(|c| c.get("error").is_none())
                    }
                    Err(_) => false,
                },
                _ => false,
            };
            if good {
                ok.fetch_add(1, Ordering::Relaxed);
            } else {
                failed.fetch_add(1, Ordering::Relaxed);
            }
        }
    })
}

async fn status(s: &Server) -> Value {
    s.admin_get("/admin/config").await
}

async fn wait_applied(s: &Server, md5: &str) -> Value {
    wait_for(20, &format!("md5 {md5} applied"), || async {
        let st = status(s).await;
        (st["md5"] == md5).then_some(st)
    })
    .await
}

async fn wait_rejected(s: &Server, before: u64) -> Value {
    wait_for(20, "a rejection", || async {
        let st = status(s).await;
        (st["rejected_total"].as_u64().unwrap() > before).then_some(st)
    })
    .await
}

#[actix_rt::test]
async fn valid_invalid_and_truncated_versions_under_streaming_load() {
    let fx = fixture();
    let first = fx.version(4.0, "w8a8_per_channel");
    std::fs::write(&fx.file, &first).unwrap();
    let s = Server::start(fx.settings("100ms")).await;
    let st = status(&s).await;
    assert_eq!(
        st["md5"],
        md5_hex(&first),
        "the start-up version is in force"
    );
    assert_eq!(st["residency"][DOWN], "dual");

    let stop = Arc::new(AtomicBool::new(false));
    let ok = Arc::new(AtomicU64::new(0));
    let failed = Arc::new(AtomicU64::new(0));
    let load: Vec<_> = (0..4)
        .map(|_| spawn_load(s.base.clone(), stop.clone(), ok.clone(), failed.clone()))
        .collect();

    let invalid: [&[u8]; 3] = [
        br#"{"schema_version": 1, "thresholds": {"k": 4, "trigger": 0.1}}"#,
        br#"{"schema_version": 1, "groups": {"layers.9.down": {"class": "fp16"}}}"#,
        br#"{"schema_version": 1, "thresholds": {"trigger_rate": 7}}"#,
    ];
    let classes = [
        "fp16",
        "w8a8",
        "w8a8_per_channel",
        "fp16",
        "w8a8",
        "w8a8_per_channel",
    ];
    let mut current = first.clone();
    let mut applied = 0;
    let mut rejected = 0;
    for (i, class) in classes.iter().enumerate() {
        let k = 5.0 + i as f64;
        let v = fx.version(k, class);
        // Every third version arrives through a torn write first: half the file, then all.
        if i % 3 == 2 {
            let before = status(&s).await["rejected_total"].as_u64().unwrap();
            std::fs::write(&fx.file, &v[..v.len() / 2]).unwrap();
            let st = wait_rejected(&s, before).await;
            rejected += 1;
            assert_eq!(st["md5"], md5_hex(&current), "a torn write never applies");
        }
        std::fs::write(&fx.file, &v).unwrap();
        let st = wait_applied(&s, &md5_hex(&v)).await;
        applied += 1;
        // Never a mixed state: md5, thresholds and residency all come from this version.
        assert_eq!(st["k"], k);
        assert_eq!(st["residency"][DOWN], expected_residency(class));
        let down = s.fallback_group(DOWN).await;
        assert_eq!(down["residency"], expected_residency(class));
        assert_eq!(
            down["k"],
            k + 1.0,
            "per-group override from the same version"
        );
        assert_eq!(
            s.labelled("quantmesh_config_info", "md5", &md5_hex(&v))
                .await,
            Some(1.0),
            "the md5 gauge follows the version in force"
        );
        current = v;

        // Then an invalid one: rejected, the previous version stays.
        let bad = invalid[i % invalid.len()];
        let before = st["rejected_total"].as_u64().unwrap();
        std::fs::write(&fx.file, bad).unwrap();
        let st = wait_rejected(&s, before).await;
        rejected += 1;
        assert_eq!(st["md5"], md5_hex(&current));
        assert_eq!(st["k"], k);
        assert!(
            st["last_error"].as_str().unwrap().contains("rejected")
                || st["last_error"].as_str().unwrap().contains("not valid")
        );
        assert_eq!(
            s.labelled("quantmesh_config_info", "md5", &md5_hex(&current))
                .await,
            Some(1.0)
        );
    }
    stop.store(true, Ordering::Relaxed);
    for h in load {
        h.await.unwrap();
    }
    let st = status(&s).await;
    assert_eq!(st["applied_total"], applied);
    assert_eq!(st["rejected_total"], rejected);
    assert_eq!(
        s.labelled("quantmesh_config_reloads_total", "result", "rejected")
            .await,
        Some(rejected as f64)
    );
    let (ok, failed) = (ok.load(Ordering::Relaxed), failed.load(Ordering::Relaxed));
    eprintln!(
        "requests: {ok} ok, {failed} failed; last apply took {}s",
        st["last_apply_seconds"]
    );
    assert_eq!(failed, 0, "zero failed requests during reloads");
    assert!(ok > 0);
}

#[actix_rt::test]
async fn poll_interval_is_honoured_and_manual_reloads_are_immediate() {
    let fx = fixture();
    std::fs::write(&fx.file, fx.version(4.0, "w8a8_per_channel")).unwrap();
    let s = Server::start(fx.settings("1s")).await;
    // Catch a poll edge, then change the file: the next poll (not a later one) applies it.
    let polls = status(&s).await["polls"].as_u64().unwrap();
    let n = wait_for(5, "a poll", || async {
        let p = status(&s).await["polls"].as_u64().unwrap();
        (p > polls).then_some(p)
    })
    .await;
    let v = fx.version(6.0, "fp16");
    let written = Instant::now();
    std::fs::write(&fx.file, &v).unwrap();
    let st = wait_applied(&s, &md5_hex(&v)).await;
    let took = written.elapsed();
    assert_eq!(
        st["polls"].as_u64().unwrap(),
        n + 1,
        "applied by the first poll after the change"
    );
    assert_eq!(
        (st["rejected_total"].as_u64(), st["failed_total"].as_u64()),
        (Some(0), Some(0)),
        "applied on the first try: {st}"
    );
    eprintln!("change → applied: {took:?} (interval 1s)");
    drop(s);

    // A long interval: nothing is seen early; SIGHUP and the admin route reload at once.
    std::fs::write(&fx.file, fx.version(4.0, "w8a8_per_channel")).unwrap();
    let s = Server::start(fx.settings("60s")).await;
    let polls = status(&s).await["polls"].as_u64().unwrap();
    let v = fx.version(7.0, "w8a8");
    std::fs::write(&fx.file, &v).unwrap();
    let st = status(&s).await;
    assert_ne!(st["md5"], md5_hex(&v), "no poll before the interval");
    assert_eq!(st["polls"].as_u64().unwrap(), polls);
    let (code, body) = s.admin_post("/admin/config/reload").await;
    assert_eq!(code, 200, "{body}");
    assert_eq!(body["result"], "applied");
    assert_eq!(body["changed_groups"], json!([DOWN]));
    assert_eq!(status(&s).await["md5"], md5_hex(&v));
    // Same bytes again: idempotent.
    let (code, body) = s.admin_post("/admin/config/reload").await;
    assert_eq!((code, body["result"].as_str()), (200, Some("unchanged")));
    // Invalid: 422 with the reason, old version kept.
    std::fs::write(&fx.file, br#"{"schema_version": 1, "extra": true}"#).unwrap();
    let (code, body) = s.admin_post("/admin/config/reload").await;
    assert_eq!(code, 422, "{body}");
    assert!(body["error"].as_str().unwrap().contains("extra"), "{body}");
    assert_eq!(status(&s).await["md5"], md5_hex(&v));
    // SIGHUP.
    let v2 = fx.version(8.0, "fp16");
    std::fs::write(&fx.file, &v2).unwrap();
    let pid = std::process::id().to_string();
    assert!(std::process::Command::new("kill")
        .args(["-HUP", &pid])
        .status()
        .unwrap()
        .success());
    wait_applied(&s, &md5_hex(&v2)).await;
    // Admin auth applies.
    let r = s
        .client
        .post(s.url("/admin/config/reload"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 401);
}

#[actix_rt::test]
async fn reloads_from_an_object_store_latest_pointer() {
    let fx = fixture();
    let prefix = format!("file://{}/plans", fx.file.parent().unwrap().display());
    let store = quantmesh_store::VersionedStore::parse(&prefix).unwrap();
    let v1 = fx.version(4.0, "w8a8_per_channel");
    let p1 = store.publish(v1.clone().into()).await.unwrap();
    let mut st = fx.settings("100ms");
    st.engine.sensitive_layers = Some(p1.latest_url.clone());
    let s = Server::start(st).await;
    assert_eq!(status(&s).await["md5"], md5_hex(&v1));
    let v2 = fx.version(9.0, "fp16");
    let p2 = store.publish(v2.clone().into()).await.unwrap();
    assert_eq!(p2.md5, md5_hex(&v2));
    let st = wait_applied(&s, &md5_hex(&v2)).await;
    assert_eq!(st["residency"][DOWN], "float");
    assert!(st["source"].as_str().unwrap().ends_with("/plans/latest"));
}

#[actix_rt::test]
async fn invalid_file_at_start_up_fails_with_its_name() {
    let fx = fixture();
    std::fs::write(
        &fx.file,
        br#"{"schema_version": 1, "groups": {"layers.0.mlp": {"class": "fp16"}}}"#,
    )
    .unwrap();
    let cfg = quantmesh_engine::EngineConfig {
        sensitive_layers: Some(fx.file.display().to_string()),
        ..Default::default()
    };
    let err = quantmesh_engine::Engine::start(&fx.model.dir, cfg, "t")
        .await
        .err()
        .expect("start must fail")
        .to_string();
    assert!(
        err.contains("sensitive_layers.json") && err.contains("layers.0.mlp"),
        "{err}"
    );
}

/// The plan's `float_budget` wins over the engine's and changes by reload like residencies:
/// a zero budget makes every float copy INT8-only (counted as over budget), removing it
/// brings them back.
#[actix_rt::test]
async fn the_plan_float_budget_applies_by_reload() {
    let fx = fixture();
    let with_budget = |budget: Option<&str>| {
        let mut v: Value = serde_json::from_slice(&fx.version(4.0, "fp16")).unwrap();
        if let Some(b) = budget {
            v["float_budget"] = json!(b);
        }
        serde_json::to_vec_pretty(&v).unwrap()
    };
    let first = with_budget(None);
    std::fs::write(&fx.file, &first).unwrap();
    let s = Server::start(fx.settings("60s")).await;
    let st = status(&s).await;
    assert_eq!(st["residency"][DOWN], "float");
    assert_eq!(st["float_budget"], "unlimited");
    assert_eq!(st["over_budget"], json!([]));
    let float_before = st["float_bytes"].as_u64().unwrap();
    assert!(float_before > 0);

    let zero = with_budget(Some("0B"));
    std::fs::write(&fx.file, &zero).unwrap();
    let (code, body) = s.admin_post("/admin/config/reload").await;
    assert_eq!(
        (code, body["result"].as_str()),
        (200, Some("applied")),
        "{body}"
    );
    let st = status(&s).await;
    assert_eq!(st["float_budget"], "0");
    assert_eq!(st["float_budget_bytes"], 0);
    assert_eq!(st["float_bytes"], 0);
    assert_eq!(st["residency"][DOWN], "int8", "over budget: INT8-only");
    assert!(
        st["over_budget"]
            .as_array()
            .unwrap()
            .iter()
            .any(|g| g == DOWN),
        "{st}"
    );
    assert_eq!(
        st["weights"]["float"], 0,
        "the float copies were dropped: {st}"
    );

    // An invalid budget is rejected by name; the plan in force stays.
    std::fs::write(&fx.file, with_budget(Some("lots"))).unwrap();
    let (code, body) = s.admin_post("/admin/config/reload").await;
    assert_eq!(code, 422, "{body}");
    assert!(
        body["error"].as_str().unwrap().contains("float_budget"),
        "{body}"
    );
    assert_eq!(status(&s).await["md5"], md5_hex(&zero));

    std::fs::write(&fx.file, &first).unwrap();
    let (code, _) = s.admin_post("/admin/config/reload").await;
    assert_eq!(code, 200);
    let st = status(&s).await;
    assert_eq!(st["residency"][DOWN], "float");
    assert_eq!(st["float_bytes"].as_u64().unwrap(), float_before);
}

/// A `w4a16` group is served with 4-bit weights (`q4_s8`): counted as `int4`, named in
/// `quant_format`, and a reload that changes the class rebuilds it in the other form, with
/// streaming requests running throughout and none failing.
#[actix_rt::test]
async fn a_w4a16_group_is_served_in_four_bits_and_switches_by_reload() {
    let fx = fixture();
    let w8 = fx.version(4.0, "w8a8");
    std::fs::write(&fx.file, &w8).unwrap();
    let s = Server::start(fx.settings("60s")).await;
    let st = status(&s).await;
    assert_eq!(st["weights"]["int4"], 0, "{st}");
    assert_eq!(st["quant_format"], json!({}), "{st}");
    let int8_before = st["weights"]["int8"].as_u64().unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let ok = Arc::new(AtomicU64::new(0));
    let failed = Arc::new(AtomicU64::new(0));
    let load: Vec<_> = (0..3)
        .map(|_| spawn_load(s.base.clone(), stop.clone(), ok.clone(), failed.clone()))
        .collect();

    let w4 = fx.version(4.0, "w4a16");
    std::fs::write(&fx.file, &w4).unwrap();
    let (code, body) = s.admin_post("/admin/config/reload").await;
    assert_eq!(
        (code, body["result"].as_str()),
        (200, Some("applied")),
        "{body}"
    );
    let st = status(&s).await;
    assert_eq!(st["quant_format"], json!({DOWN: "q4_s8"}), "{st}");
    assert_eq!(st["residency"][DOWN], "int8");
    // The down group's weights moved from 34 bytes per 32 to 18 per 32 and 4 per row and
    // super-block of up to 256.
    let int4 = st["weights"]["int4"].as_u64().unwrap();
    let int8 = st["weights"]["int8"].as_u64().unwrap();
    let (rows, cols) = (fx.model.dims.1 as u64, fx.model.dims.2 as u64); // down: [hidden, intermediate]
    assert_eq!(
        int4,
        rows * (cols / 32 * 18 + 4 * cols.div_ceil(256)),
        "{st}"
    );
    assert_eq!(int8_before - int8, rows * cols / 32 * 34, "{st}");
    // It serves.
    let r = reqwest::Client::new()
        .post(format!("{}/v1/completions", s.base))
        .json(&json!({"prompt": "Hello", "max_tokens": 8, "temperature": 0}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);

    std::fs::write(&fx.file, &w8).unwrap();
    let (code, _) = s.admin_post("/admin/config/reload").await;
    assert_eq!(code, 200);
    let st = status(&s).await;
    assert_eq!(st["weights"]["int4"], 0, "{st}");
    assert_eq!(st["weights"]["int8"].as_u64().unwrap(), int8_before);
    stop.store(true, Ordering::Relaxed);
    for h in load {
        h.await.unwrap();
    }
    let (ok, failed) = (ok.load(Ordering::Relaxed), failed.load(Ordering::Relaxed));
    assert_eq!(
        failed, 0,
        "zero failed requests while the bits changed ({ok} ok)"
    );
    assert!(ok > 0);
}
