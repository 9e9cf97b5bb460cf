//! The Kubernetes manifests (rendered by `kubectl kustomize`) against the compose stack they
//! mirror: the same image, commands, ports, environment, health checks, written paths and
//! stop grace, so the two cannot drift.

#[path = "k8s/render.rs"]
mod render;

use render::*;
use serde_yaml::Value;
use std::collections::{BTreeMap, BTreeSet};

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
        // The same image (compose builds `:latest` locally; the cluster runs the release tag
        // the kustomization sets) and command.
        let repository = |v: &Value| {
            v.as_str()
                .and_then(|i| i.rsplit_once(':').map(|(r, _)| r.to_string()))
                .unwrap_or_default()
        };
        assert_eq!(
            repository(&c["image"]),
            repository(&svc["image"]),
            "{why}: image"
        );
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
        // The same paths written: compose's volumes and tmpfs mounts on a read-only root are
        // the pod's volume mounts on a read-only root.
        assert_eq!(
            svc["read_only"], true,
            "{why}: compose root filesystem not read-only"
        );
        let written: BTreeSet<String> = svc["volumes"]
            .as_sequence()
            .into_iter()
            .flatten()
            .filter_map(Value::as_str)
            .filter_map(|v| v.split(':').nth(1).map(str::to_string))
            .chain(
                svc["tmpfs"]
                    .as_sequence()
                    .into_iter()
                    .flatten()
                    .filter_map(Value::as_str)
                    .map(str::to_string),
            )
            .collect();
        let mounted: BTreeSet<String> = c["volumeMounts"]
            .as_sequence()
            .into_iter()
            .flatten()
            .filter_map(|m| m["mountPath"].as_str().map(str::to_string))
            .collect();
        assert_eq!(written, mounted, "{why}: written paths");
        // An init container runs the same image, as locked down as the container it prepares
        // for, with only mounts its pod has.
        let pod = &workload["spec"]["template"]["spec"];
        let volumes: BTreeSet<&str> = pod["volumes"]
            .as_sequence()
            .into_iter()
            .flatten()
            .filter_map(|v| v["name"].as_str())
            .chain(
                workload["spec"]["volumeClaimTemplates"]
                    .as_sequence()
                    .into_iter()
                    .flatten()
                    .filter_map(|v| v["metadata"]["name"].as_str()),
            )
            .collect();
        for init in pod["initContainers"].as_sequence().into_iter().flatten() {
            assert_eq!(init["image"], c["image"], "{why}: init container image");
            assert_eq!(
                init["securityContext"], c["securityContext"],
                "{why}: init container security"
            );
            for m in init["volumeMounts"].as_sequence().into_iter().flatten() {
                let name = m["name"].as_str().unwrap_or("");
                assert!(
                    volumes.contains(name),
                    "{why}: init mounts {name}, not a volume"
                );
            }
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
