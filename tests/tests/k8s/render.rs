//! The manifests as a cluster would receive them (`kubectl kustomize`), and what the tests
//! read out of them: shared by kubernetes.rs and kubernetes_compose.rs.

#![allow(dead_code)]

use serde::Deserialize;
use serde_yaml::{Mapping, Value};
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;

/// The Kubernetes version the manifests are written for and validated against.
pub const KUBERNETES_VERSION: &str = "1.34.0";

/// Kinds without a bundled schema: the prometheus-operator's CRDs (checked below).
pub const SKIPPED_KINDS: &[&str] = &["ServiceMonitor", "PrometheusRule"];

/// The base and the overlay, as folders of the repository.
pub const BASE: &str = "infra/k8s";
pub const CRONJOB_OVERLAY: &str = "infra/k8s-weekly-cronjob";

pub fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

pub fn read(p: &Path) -> String {
    std::fs::read_to_string(p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

/// `kubectl kustomize DIR`: the YAML a cluster would be sent.
pub fn render_text(dir: &Path) -> String {
    let out = Command::new("kubectl")
        .arg("kustomize")
        .arg(dir)
        .output()
        .unwrap_or_else(|e| panic!("kubectl (with its kustomize) does not run: {e}"));
    assert!(
        out.status.success(),
        "kubectl kustomize {}: {}",
        dir.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap_or_else(|e| panic!("{e}"))
}

/// The rendered objects of DIR.
pub fn render(dir: &Path) -> Vec<Value> {
    serde_yaml::Deserializer::from_str(&render_text(dir))
        .map(|d| Value::deserialize(d).unwrap_or_else(|e| panic!("{}: {e}", dir.display())))
        .filter(|v| !v.is_null())
        .collect()
}

/// The base's rendered objects, after checking that every manifest in its folder is one of
/// its resources.
pub fn objects() -> Vec<Value> {
    let dir = root().join(BASE);
    let kust: Value = serde_yaml::from_str(&read(&dir.join("kustomization.yaml")))
        .unwrap_or_else(|e| panic!("kustomization.yaml: {e}"));
    let listed: BTreeSet<PathBuf> = kust["resources"]
        .as_sequence()
        .unwrap_or_else(|| panic!("kustomization.yaml lists no resources"))
        .iter()
        .filter_map(Value::as_str)
        .map(|f| dir.join(f))
        .collect();
    let on_disk: BTreeSet<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{e}"))
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "yaml"))
        .filter(|p| !p.ends_with("kustomization.yaml"))
        .collect();
    assert_eq!(
        on_disk, listed,
        "the kustomization's resources are not the folder's manifests"
    );
    render(&dir)
}

pub fn find<'a>(objects: &'a [Value], kind: &str, name: &str) -> &'a Value {
    objects
        .iter()
        .find(|o| o["kind"] == kind && o["metadata"]["name"] == name)
        .unwrap_or_else(|| panic!("no {kind} {name} rendered"))
}

/// Every pod template: (what holds it, its pod spec).
pub fn pods(objects: &[Value]) -> Vec<(String, &Value)> {
    objects
        .iter()
        .filter_map(|o| {
            let spec = match o["kind"].as_str()? {
                "Deployment" | "StatefulSet" => &o["spec"]["template"]["spec"],
                "CronJob" => &o["spec"]["jobTemplate"]["spec"]["template"]["spec"],
                _ => return None,
            };
            Some((
                format!(
                    "{} {}",
                    o["kind"].as_str()?,
                    o["metadata"]["name"].as_str()?
                ),
                spec,
            ))
        })
        .collect()
}

/// A pod's containers, init containers first.
pub fn containers(pod: &Value) -> Vec<&Value> {
    pod["initContainers"]
        .as_sequence()
        .into_iter()
        .flatten()
        .chain(pod["containers"].as_sequence().into_iter().flatten())
        .collect()
}

/// A container's environment: name → value (`None` for a secret), `$(NAME)` references
/// expanded, ConfigMap keys read.
pub fn k8s_env(objects: &[Value], container: &Value) -> BTreeMap<String, Option<String>> {
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
pub fn container(workload: &Value) -> &Value {
    &workload["spec"]["template"]["spec"]["containers"][0]
}
