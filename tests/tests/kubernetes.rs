//! The Kubernetes manifests (`infra/k8s/`): every object validates against the API schema of
//! a stated Kubernetes version (kubernetes-validate, which bundles the schemas; the
//! prometheus-operator's CRDs are skipped by name and checked here by structure instead),
//! and the objects match the compose stack they mirror — the same commands, ports,
//! environment, health checks and stop grace — so the two cannot drift. No cluster runs
//! here: what a cluster would add (scheduling, volumes, DNS) is not checked.

use serde_yaml::{Mapping, Value};
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;

/// The Kubernetes version the manifests are written for and validated against.
const KUBERNETES_VERSION: &str = "1.34.0";

/// Kinds without a bundled schema: the prometheus-operator's CRDs (checked below) and the
/// kustomization itself.
const SKIPPED_KINDS: &[&str] = &["ServiceMonitor", "PrometheusRule", "Kustomization"];

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn read(p: &Path) -> String {
    std::fs::read_to_string(p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

fn manifests() -> Vec<PathBuf> {
    let kust: Value = serde_yaml::from_str(&read(&root().join("infra/k8s/kustomization.yaml")))
        .unwrap_or_else(|e| panic!("kustomization.yaml: {e}"));
    let list: Vec<PathBuf> = kust["resources"]
        .as_sequence()
        .unwrap_or_else(|| panic!("kustomization.yaml lists no resources"))
        .iter()
        .filter_map(Value::as_str)
        .map(|f| root().join("infra/k8s").join(f))
        .collect();
    // Every manifest in the folder is in the kustomization.
    let on_disk: BTreeSet<PathBuf> = std::fs::read_dir(root().join("infra/k8s"))
        .unwrap_or_else(|e| panic!("{e}"))
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "yaml"))
        .filter(|p| !p.ends_with("kustomization.yaml"))
        .collect();
    assert_eq!(
        on_disk,
        list.iter().cloned().collect::<BTreeSet<_>>(),
        "the kustomization's resources are not the folder's manifests"
    );
    list
}

/// Every object of every manifest.
fn objects() -> Vec<Value> {
    let mut out = Vec::new();
    for f in manifests() {
        let text = read(&f);
        let mut doc = String::new();
        for line in text.lines().chain(std::iter::once("---")) {
            if line.trim_end() == "---" {
                let v: Value =
                    serde_yaml::from_str(&doc).unwrap_or_else(|e| panic!("{}: {e}", f.display()));
                if !v.is_null() {
                    out.push(v);
                }
                doc.clear();
            } else {
                doc.push_str(line);
                doc.push('\n');
            }
        }
    }
    out
}

fn find<'a>(objects: &'a [Value], kind: &str, name: &str) -> &'a Value {
    objects
        .iter()
        .find(|o| o["kind"] == kind && o["metadata"]["name"] == name)
        .unwrap_or_else(|| panic!("no {kind} {name} in infra/k8s"))
}

/// `kubernetes-validate`, from the PATH or pip's user scripts.
fn validator() -> Command {
    let user = std::env::var("HOME")
        .map(|h| PathBuf::from(h).join(".local/bin/kubernetes-validate"))
        .ok()
        .filter(|p| p.exists());
    match user {
        Some(p) => Command::new(p),
        None => Command::new("kubernetes-validate"),
    }
}

fn validate(files: &[PathBuf]) -> (bool, String) {
    let out = validator()
        .args(["--strict", "--kubernetes-version", KUBERNETES_VERSION])
        .args(files)
        .output()
        .unwrap_or_else(|e| {
            panic!("kubernetes-validate (PyPI; scripts/test.sh installs it) does not run: {e}")
        });
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

#[test]
fn every_manifest_validates_against_the_kubernetes_schema() {
    let mut files = manifests();
    files.push(root().join("infra/k8s/kustomization.yaml"));
    let (ok, text) = validate(&files);
    assert!(ok, "kubernetes-validate {KUBERNETES_VERSION}:\n{text}");
    // Only the named kinds may lack a schema.
    for line in text.lines().filter(|l| l.contains("Couldn't find schema")) {
        assert!(
            SKIPPED_KINDS
                .iter()
                .any(|k| line.contains(&format!("kind {k} "))),
            "a kind without a schema that is not skipped by name: {line}"
        );
    }
    // The validator does refuse what the schema forbids.
    let dir = std::env::temp_dir().join(format!("quantmesh-k8s-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("{e}"));
    let bad = dir.join("bad.yaml");
    let engine = read(&root().join("infra/k8s/engine.yaml")).replacen(
        "terminationGracePeriodSeconds: 40",
        "terminationGracePeriod: 40",
        1,
    );
    std::fs::write(&bad, engine).unwrap_or_else(|e| panic!("{e}"));
    let (ok, text) = validate(&[bad]);
    assert!(
        !ok && text.contains("terminationGracePeriod"),
        "an unknown field passed: {text}"
    );
    let _ = std::fs::remove_dir_all(dir);
}

/// The compose file with its `<<` merge keys applied.
fn compose() -> Value {
    let mut v: Value = serde_yaml::from_str(&read(&root().join("docker-compose.yml")))
        .unwrap_or_else(|e| panic!("docker-compose.yml: {e}"));
    v.apply_merge().unwrap_or_else(|e| panic!("{e}"));
    // Merge keys nest (`environment: <<: *engine-env`): apply until none is left.
    for _ in 0..4 {
        v.apply_merge().unwrap_or_else(|e| panic!("{e}"));
    }
    v
}

/// What compose's `${NAME:-default}` gives when NAME is unset (`None` for a required
/// `${NAME:?…}`, a secret the user must set).
fn compose_value(v: &str) -> Option<String> {
    let mut out = String::new();
    let mut rest = v;
    while let Some(i) = rest.find("${") {
        out.push_str(&rest[..i]);
        let end = rest[i..].find('}').map(|e| i + e)?;
        let inner = &rest[i + 2..end];
        if inner.contains(":?") {
            return None;
        }
        out.push_str(inner.split_once(":-").map(|(_, d)| d).unwrap_or(""));
        rest = &rest[end + 1..];
    }
    out.push_str(rest);
    Some(out)
}

/// A container's environment: name → value (`None` for a secret), `$(NAME)` references
/// expanded, ConfigMap keys read.
fn k8s_env(objects: &[Value], container: &Value) -> BTreeMap<String, Option<String>> {
    let configmap = |name: &Value| -> &Mapping {
        find(objects, "ConfigMap", name.as_str().unwrap_or(""))["data"]
            .as_mapping()
            .unwrap_or_else(|| panic!("ConfigMap {name:?} has no data"))
    };
    let mut env = BTreeMap::new();
    for from in container["envFrom"].as_sequence().into_iter().flatten() {
        for (k, v) in configmap(&from["configMapRef"]["name"]) {
            env.insert(
                k.as_str().unwrap_or("").to_string(),
                v.as_str().map(str::to_string),
            );
        }
    }
    for e in container["env"].as_sequence().into_iter().flatten() {
        let name = e["name"].as_str().unwrap_or("").to_string();
        let value = if let Some(v) = e["value"].as_str() {
            let mut v = v.to_string();
            for (k, known) in &env {
                if let Some(known) = known {
                    v = v.replace(&format!("$({k})"), known);
                }
            }
            Some(v)
        } else if let Some(r) = e["valueFrom"]["configMapKeyRef"].as_mapping() {
            let key = r.get("key").and_then(Value::as_str).unwrap_or("");
            configmap(&e["valueFrom"]["configMapKeyRef"]["name"])
                .get(key)
                .and_then(Value::as_str)
                .map(str::to_string)
        } else {
            None
        };
        env.insert(name, value);
    }
    env
}

/// The container of a workload.
fn container(workload: &Value) -> &Value {
    &workload["spec"]["template"]["spec"]["containers"][0]
}

/// Values that name the cluster's own addresses (or pods), which differ from compose's by
/// design.
const ADDRESSES: &[&str] = &[
    "QUANTMESH_KAFKA_BROKERS",
    "AWS_ENDPOINT",
    "OTEL_EXPORTER_OTLP_ENDPOINT",
    "QUANTMESH_ENGINES",
    "QUANTMESH_ENGINE_NAME",
];

/// The health check compose relies on for a service: its own `healthcheck`, else the
/// image's `HEALTHCHECK` — as (path, port).
fn compose_health(service: &Value) -> (String, u16) {
    let test = match service["healthcheck"]["test"].as_sequence() {
        Some(t) => t
            .iter()
            .filter_map(Value::as_str)
            .collect::<Vec<_>>()
            .join(" "),
        None => read(&root().join("Dockerfile"))
            .split("HEALTHCHECK")
            .nth(1)
            .and_then(|s| s.split("\nSTOPSIGNAL").next())
            .unwrap_or_else(|| panic!("the Dockerfile has no HEALTHCHECK"))
            .replace("${QUANTMESH_PORT:-8080}", "8080"),
    };
    let path = test
        .split("GET ")
        .nth(1)
        .and_then(|s| s.split_whitespace().next())
        .unwrap_or_else(|| panic!("no path in {test}"))
        .to_string();
    let port = test
        .split("/dev/tcp/127.0.0.1/")
        .nth(1)
        .map(|s| {
            s.chars()
                .take_while(char::is_ascii_digit)
                .collect::<String>()
        })
        .and_then(|p| p.parse().ok())
        .unwrap_or_else(|| panic!("no port in {test}"));
    (path, port)
}

#[test]
fn the_manifests_match_the_compose_stack() {
    let objects = objects();
    let compose = compose();
    // compose service → (workload kind, name)
    let pairs = [
        ("gateway", "Deployment", "quantmesh-gateway"),
        ("engine-1", "StatefulSet", "quantmesh-engine"),
        ("evolution", "Deployment", "quantmesh-evolution"),
    ];
    for (service, kind, name) in pairs {
        let svc = &compose["services"][service];
        let workload = find(&objects, kind, name);
        let c = container(workload);
        let why = format!("compose {service} vs {kind} {name}");
        // The same image and command.
        assert_eq!(c["image"], svc["image"], "{why}: image");
        assert_eq!(c["args"], svc["command"], "{why}: command");
        // The same environment, by name, and the same values where they are not addresses.
        let k8s = k8s_env(&objects, c);
        let ours: BTreeMap<String, Option<String>> = svc["environment"]
            .as_mapping()
            .unwrap_or_else(|| panic!("{why}: no environment"))
            .iter()
            .map(|(k, v)| {
                let v = match v {
                    Value::String(s) => compose_value(s),
                    Value::Null => None,
                    other => Some(
                        serde_yaml::to_string(other)
                            .unwrap_or_default()
                            .trim()
                            .to_string(),
                    ),
                };
                (k.as_str().unwrap_or("").to_string(), v)
            })
            .collect();
        assert_eq!(
            ours.keys().collect::<Vec<_>>(),
            k8s.keys().collect::<Vec<_>>(),
            "{why}: environment variables"
        );
        for (k, v) in &ours {
            let theirs = &k8s[k];
            match (v, theirs) {
                _ if ADDRESSES.contains(&k.as_str()) => {}
                // A secret on one side is a secret (or an empty default) on the other.
                (None, None) | (Some(_), None) | (None, Some(_)) => {}
                (Some(a), Some(b)) => assert_eq!(a, b, "{why}: {k}"),
            }
        }
        // The same port, and a readiness probe on the path compose's health check asks.
        let (path, port) = compose_health(svc);
        let http = c["ports"]
            .as_sequence()
            .and_then(|p| p.iter().find(|p| p["name"] == "http"))
            .unwrap_or_else(|| panic!("{why}: no port named http"));
        assert_eq!(
            http["containerPort"].as_u64(),
            Some(u64::from(port)),
            "{why}: port"
        );
        assert_eq!(
            c["readinessProbe"]["httpGet"]["path"],
            path.as_str(),
            "{why}: readiness"
        );
        assert_eq!(
            c["readinessProbe"]["httpGet"]["port"], "http",
            "{why}: readiness"
        );
        // The same stop grace where compose sets one.
        if let Some(grace) = svc["stop_grace_period"].as_str() {
            let secs: u64 = grace
                .trim_end_matches('s')
                .parse()
                .unwrap_or_else(|e| panic!("{grace}: {e}"));
            assert_eq!(
                workload["spec"]["template"]["spec"]["terminationGracePeriodSeconds"].as_u64(),
                Some(secs),
                "{why}: grace"
            );
        }
        // Not root, no privilege escalation, resources bounded.
        let pod_sc = &workload["spec"]["template"]["spec"]["securityContext"];
        assert_eq!(pod_sc["runAsNonRoot"], true, "{why}");
        assert_eq!(
            c["securityContext"]["allowPrivilegeEscalation"], false,
            "{why}"
        );
        for r in ["requests", "limits"] {
            for k in ["cpu", "memory"] {
                assert!(c["resources"][r][k].is_string(), "{why}: {r}.{k}");
            }
        }
        // A Service exposes the workload's port.
        let selector = &workload["spec"]["selector"]["matchLabels"];
        let service_obj = objects
            .iter()
            .find(|o| o["kind"] == "Service" && o["spec"]["selector"] == *selector)
            .unwrap_or_else(|| panic!("{why}: no Service selects it"));
        assert_eq!(
            service_obj["spec"]["ports"][0]["targetPort"], "http",
            "{why}"
        );
    }

    // The gateway finds the engines through a headless Service on the engines' port.
    let gateway = container(find(&objects, "Deployment", "quantmesh-gateway"));
    let engines = k8s_env(&objects, gateway)["QUANTMESH_ENGINES"]
        .clone()
        .unwrap_or_default();
    let host_port = engines
        .strip_prefix("dns+http://")
        .unwrap_or_else(|| panic!("QUANTMESH_ENGINES = {engines}: not dns+http://"));
    let (host, port) = host_port.split_once(':').unwrap_or((host_port, "80"));
    let headless = find(&objects, "Service", host);
    assert_eq!(
        headless["spec"]["clusterIP"], "None",
        "{host} is not headless"
    );
    assert_eq!(
        headless["spec"]["ports"][0]["port"].as_u64(),
        port.parse().ok()
    );
    let engine = find(&objects, "StatefulSet", "quantmesh-engine");
    assert_eq!(
        headless["spec"]["selector"],
        engine["spec"]["selector"]["matchLabels"]
    );
    assert_eq!(engine["spec"]["serviceName"], host);

    // Every PodDisruptionBudget and the autoscaler point at a workload that exists.
    for pdb in objects
        .iter()
        .filter(|o| o["kind"] == "PodDisruptionBudget")
    {
        let sel = &pdb["spec"]["selector"]["matchLabels"];
        assert!(
            objects
                .iter()
                .any(|o| o["spec"]["selector"]["matchLabels"] == *sel
                    && o["kind"] != "PodDisruptionBudget"),
            "{pdb:?} selects nothing"
        );
    }
    let hpa = find(&objects, "HorizontalPodAutoscaler", "quantmesh-engine");
    let target = &hpa["spec"]["scaleTargetRef"];
    find(
        &objects,
        target["kind"].as_str().unwrap_or(""),
        target["name"].as_str().unwrap_or(""),
    );
    // The metric it scales on is one the engines export.
    let metric = hpa["spec"]["metrics"][0]["pods"]["metric"]["name"]
        .as_str()
        .unwrap_or("");
    assert!(
        read(&root().join("services/engine/src/metrics.rs")).contains(&format!("\"{metric}\"")),
        "the engines export no {metric}"
    );

    // The CRDs, checked by structure: the rules are alerts.yml's, and scraping selects every
    // workload's Service by its http port.
    let rules = find(&objects, "PrometheusRule", "quantmesh");
    let alerts: Value = serde_yaml::from_str(&read(&root().join("infra/prometheus/alerts.yml")))
        .unwrap_or_else(|e| panic!("alerts.yml: {e}"));
    assert_eq!(
        rules["spec"]["groups"], alerts["groups"],
        "PrometheusRule ≠ alerts.yml"
    );
    let monitor = find(&objects, "ServiceMonitor", "quantmesh");
    assert_eq!(monitor["spec"]["endpoints"][0]["port"], "http");
    assert_eq!(monitor["spec"]["endpoints"][0]["path"], "/metrics");
    let scraped: BTreeSet<&str> = monitor["spec"]["selector"]["matchExpressions"][0]["values"]
        .as_sequence()
        .into_iter()
        .flatten()
        .filter_map(Value::as_str)
        .collect();
    let services: BTreeSet<&str> = objects
        .iter()
        .filter(|o| o["kind"] == "Service")
        .filter_map(|o| o["metadata"]["labels"]["app.kubernetes.io/name"].as_str())
        .collect();
    assert_eq!(
        scraped, services,
        "the ServiceMonitor does not scrape every Service"
    );
}

#[test]
fn compose_values_read_as_compose_reads_them() {
    assert_eq!(compose_value("${A:-x}/latest").as_deref(), Some("x/latest"));
    assert_eq!(compose_value("${A:-}").as_deref(), Some(""));
    assert_eq!(compose_value("plain").as_deref(), Some("plain"));
    assert_eq!(compose_value("${A:?set it}"), None);
}
