//! Start the real embedded stack on a free port.

#![allow(dead_code)]

use quantmesh_settings::Settings;
pub use quantmesh_testkit::metrics::Scrape;
#[allow(unused_imports)] // each test binary uses its share
pub use quantmesh_testkit::{parse_sse, poll};
use std::time::Duration;

pub struct Server {
    pub base: String,
    pub client: reqwest::Client,
    shutdown: Option<tokio::sync::oneshot::Sender<()>>,
    pub task: Option<actix_rt::task::JoinHandle<anyhow::Result<()>>>,
    _dir: Option<tempfile::TempDir>,
}

pub fn settings() -> Settings {
    let mut s = Settings::default();
    // Empty: `Server::start` writes the bundled model into a temp dir the server owns.
    s.model.source = String::new();
    s.model.fetch_if_missing = false;
    s.engine.num_pages = 256;
    // These tests drive the monitor and hot reload on an all-dual model; the first-load
    // plan has its own tests (gateway `first_plan`, the CLI's real-model test).
    s.model.plan = quantmesh_settings::PlanMode::None;
    s.server.workers = 2;
    s.server.shutdown_timeout_secs = 10;
    s
}

impl Server {
    pub async fn start(mut settings: Settings) -> Server {
        let mut model = None;
        if settings.model.source.is_empty() {
            let dir = tempfile::tempdir().expect("tempdir");
            quantmesh_model::bundled::init_model(dir.path(), &Default::default())
                .expect("init model");
            settings.model.source = dir.path().display().to_string();
            model = Some(dir);
        }
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let base = format!("http://{}", listener.local_addr().expect("addr"));
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let task = actix_rt::spawn(quantmesh_server::run_embedded(
            settings,
            listener,
            async move {
                let _ = rx.await;
            },
        ));
        let client = reqwest::Client::new();
        for _ in 0..200 {
            if let Ok(r) = client.get(format!("{base}/ready")).send().await {
                if r.status() == 200 {
                    return Server {
                        base,
                        client,
                        shutdown: Some(tx),
                        task: Some(task),
                        _dir: model,
                    };
                }
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        panic!("server did not become ready");
    }

    pub fn url(&self, path: &str) -> String {
        format!("{}{}", self.base, path)
    }

    pub async fn post(&self, path: &str, body: serde_json::Value) -> reqwest::Response {
        self.client
            .post(self.url(path))
            .json(&body)
            .send()
            .await
            .expect("request")
    }

    pub async fn post_raw(&self, path: &str, body: Vec<u8>) -> reqwest::Response {
        self.client
            .post(self.url(path))
            .header("content-type", "application/json")
            .body(body)
            .send()
            .await
            .expect("request")
    }

    /// Begin graceful shutdown.
    pub fn shutdown(&mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
    }

    /// The server's `/metrics`, parsed by the kit's scraper.
    pub async fn metrics(&self) -> Scrape {
        Scrape::get(&self.client, &self.url("/metrics")).await
    }

    /// The value of the unlabelled series `name`; fails when it is missing.
    pub async fn gauge(&self, name: &str) -> f64 {
        self.metrics()
            .await
            .value(name, &[])
            .unwrap_or_else(|| panic!("metric {name} missing"))
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// The admin token the helpers below send (set it with `settings.server.admin_token`).
pub const ADMIN_TOKEN: &str = "admin-test-token";

impl Server {
    pub async fn admin_get(&self, path: &str) -> serde_json::Value {
        let r = self
            .client
            .get(self.url(path))
            .bearer_auth(ADMIN_TOKEN)
            .send()
            .await
            .expect("admin request");
        assert_eq!(r.status(), 200, "GET {path}");
        r.json().await.expect("admin JSON")
    }

    pub async fn admin_post(&self, path: &str) -> (u16, serde_json::Value) {
        let r = self
            .client
            .post(self.url(path))
            .bearer_auth(ADMIN_TOKEN)
            .send()
            .await
            .expect("admin request");
        let status = r.status().as_u16();
        (status, r.json().await.expect("admin JSON"))
    }

    /// One group's monitor state from `GET /admin/fallback`.
    pub async fn fallback_group(&self, group: &str) -> serde_json::Value {
        let report = self.admin_get("/admin/fallback").await;
        report["groups"]
            .as_array()
            .expect("groups")
            .iter()
            .find(|g| g["group"] == group)
            .unwrap_or_else(|| panic!("no group {group} in the report"))
            .clone()
    }

    /// The value of `name{label=value}`, if exposed (the metric itself must be declared).
    pub async fn labelled(&self, name: &str, label: &str, value: &str) -> Option<f64> {
        self.metrics().await.value(name, &[(label, value)])
    }
}

/// Poll `f` every 20 ms until it returns `Some`, at most `secs` seconds (the kit's `poll`).
pub async fn wait_for<T, F, Fut>(secs: u64, what: &str, mut f: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let within = Duration::from_secs(secs);
    poll(within, Duration::from_millis(20), || {
        let next = f();
        async move { next.await.ok_or_else(|| format!("waiting for {what}")) }
    })
    .await
}

/// The bundled model written into `dir`, with what a `sensitive_layers.json` for it names.
pub struct PlannedModel {
    pub dir: std::path::PathBuf,
    pub layout_md5: String,
    /// (layers, hidden size, intermediate size).
    pub dims: (usize, usize, usize),
}

impl PlannedModel {
    pub fn write(dir: std::path::PathBuf) -> PlannedModel {
        use quantmesh_model::checkpoint::Checkpoint;
        quantmesh_model::bundled::init_model(&dir, &Default::default()).expect("init model");
        let ck = Checkpoint::open(&dir).expect("checkpoint");
        let mcfg =
            quantmesh_model::ModelConfig::from_file(&dir.join("config.json")).expect("config");
        let layout_md5 = quantmesh_model::model_shape(&ck, &mcfg)
            .expect("shape")
            .layout_md5;
        let dims = (
            mcfg.num_hidden_layers,
            mcfg.hidden_size,
            mcfg.intermediate_size,
        );
        PlannedModel {
            dir,
            layout_md5,
            dims,
        }
    }

    /// A valid plan: these thresholds and per-group entries.
    pub fn plan(&self, thresholds: serde_json::Value, groups: serde_json::Value) -> Vec<u8> {
        serde_json::to_vec_pretty(&serde_json::json!({
            "schema_version": 1,
            "model": {"num_layers": self.dims.0, "hidden_size": self.dims.1,
                      "intermediate_size": self.dims.2, "layout_md5": self.layout_md5},
            "thresholds": thresholds,
            "groups": groups
        }))
        .expect("json")
    }
}
