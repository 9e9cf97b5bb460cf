//! The Kubernetes manifests as a cluster would receive them: what `kubectl kustomize` renders
//! from `infra/k8s` (and from the CronJob overlay `infra/k8s-weekly-cronjob`) validates
//! strictly against the API schema of a stated Kubernetes version (kubernetes-validate, which
//! bundles the schemas; the prometheus-operator's CRDs are skipped by name and checked here by
//! structure instead), the image is set in one place, every ConfigMap and Secret key a
//! container reads exists or is documented as the user's, the pods are hardened and spread,
//! and the objects match the compose stack they mirror — the same commands, ports,
//! environment, health checks, written paths and stop grace — so the two cannot drift. No
//! cluster runs here: what a cluster would add (scheduling, volumes, DNS) is not checked.

#[path = "k8s/render.rs"]
mod render;

use render::*;
use serde_yaml::{Mapping, Value};
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;

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
fn every_rendered_object_validates_against_the_kubernetes_schema() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    for (name, folder) in [("base", BASE), ("cronjob", CRONJOB_OVERLAY)] {
        let file = dir.path().join(format!("{name}.yaml"));
        std::fs::write(&file, render_text(&root().join(folder))).unwrap_or_else(|e| panic!("{e}"));
        let (ok, text) = validate(&[file]);
        assert!(
            ok,
            "kubernetes-validate {KUBERNETES_VERSION}, {folder}:\n{text}"
        );
        // Only the named kinds may lack a schema.
        for line in text.lines().filter(|l| l.contains("Couldn't find schema")) {
            assert!(
                SKIPPED_KINDS
                    .iter()
                    .any(|k| line.contains(&format!("kind {k} "))),
                "a kind without a schema that is not skipped by name: {line}"
            );
        }
    }
    // The validator does refuse what the schema forbids.
    let bad = dir.path().join("bad.yaml");
    let text = render_text(&root().join(BASE)).replacen(
        "readOnlyRootFilesystem: true",
        "readOnlyRootFilesystm: true",
        1,
    );
    std::fs::write(&bad, text).unwrap_or_else(|e| panic!("{e}"));
    let (ok, text) = validate(&[bad]);
    assert!(
        !ok && text.contains("readOnlyRootFilesystm"),
        "an unknown field passed: {text}"
    );
}

/// The image the component `infra/k8s/image` sets: `newName:newTag`.
fn configured_image() -> String {
    let c: Value = serde_yaml::from_str(&read(&root().join(BASE).join("image/kustomization.yaml")))
        .unwrap_or_else(|e| panic!("image/kustomization.yaml: {e}"));
    let entries = c["images"].as_sequence().cloned().unwrap_or_default();
    assert_eq!(entries.len(), 1, "one image entry: {entries:?}");
    let e = &entries[0];
    assert_eq!(e["name"], "quantmesh");
    format!(
        "{}:{}",
        e["newName"].as_str().unwrap_or(""),
        e["newTag"].as_str().unwrap_or("")
    )
}

/// Every container whose image is not `image`, or that would pull on every start.
fn image_problems(objects: &[Value], image: &str) -> Vec<String> {
    let mut out = Vec::new();
    for (what, pod) in pods(objects) {
        for c in containers(pod) {
            let name = c["name"].as_str().unwrap_or("?");
            if c["image"].as_str() != Some(image) {
                out.push(format!(
                    "{what} {name}: image {:?}, not {image}",
                    c["image"]
                ));
            }
            if c["imagePullPolicy"] != "IfNotPresent" {
                out.push(format!(
                    "{what} {name}: imagePullPolicy {:?}",
                    c["imagePullPolicy"]
                ));
            }
        }
    }
    out
}

/// Copy a folder tree (the manifests, to change one in a test).
fn copy_tree(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap_or_else(|e| panic!("{e}"));
    for e in std::fs::read_dir(from).unwrap_or_else(|e| panic!("{e}")) {
        let e = e.unwrap_or_else(|e| panic!("{e}"));
        let target = to.join(e.file_name());
        if e.path().is_dir() {
            copy_tree(&e.path(), &target);
        } else {
            std::fs::copy(e.path(), target).unwrap_or_else(|e| panic!("{e}"));
        }
    }
}

#[test]
fn the_image_is_set_in_one_place() {
    let image = configured_image();
    // The tag is the workspace's version, so a release changes it with the code.
    let version = read(&root().join("Cargo.toml"))
        .lines()
        .find_map(|l| l.strip_prefix("version = \""))
        .map(|v| v.trim_end_matches('"').to_string())
        .unwrap_or_else(|| panic!("no workspace version"));
    assert_eq!(image, format!("quantmesh:{version}"));
    for folder in [BASE, CRONJOB_OVERLAY] {
        let problems = image_problems(&render(&root().join(folder)), &image);
        assert!(problems.is_empty(), "{folder}: {problems:#?}");
    }
    // Every manifest names the image only as `quantmesh`, for the component to set.
    for folder in [BASE, CRONJOB_OVERLAY] {
        for e in std::fs::read_dir(root().join(folder)).unwrap_or_else(|e| panic!("{e}")) {
            let p = e.unwrap_or_else(|e| panic!("{e}")).path();
            if p.extension().is_some_and(|x| x == "yaml") {
                for l in read(&p)
                    .lines()
                    .filter(|l| l.trim_start().starts_with("image:"))
                {
                    assert_eq!(l.trim(), "image: quantmesh", "{}", p.display());
                }
            }
        }
    }
    // An image changed in one manifest only is found.
    let tmp = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let copy = tmp.path().join("k8s");
    copy_tree(&root().join(BASE), &copy);
    let gateway = copy.join("gateway.yaml");
    std::fs::write(
        &gateway,
        read(&gateway).replacen(
            "image: quantmesh\n",
            "image: registry.example/quantmesh:2\n",
            1,
        ),
    )
    .unwrap_or_else(|e| panic!("{e}"));
    let problems = image_problems(&render(&copy), &image);
    assert!(
        problems.len() == 1 && problems[0].contains("registry.example/quantmesh:2"),
        "{problems:#?}"
    );
}

/// The Secret keys docs/kubernetes.md tells the user to create.
fn documented_secret_keys() -> BTreeSet<String> {
    read(&root().join("docs/kubernetes.md"))
        .split("--from-literal=")
        .skip(1)
        .filter_map(|s| s.split('=').next())
        .map(str::to_string)
        .collect()
}

/// Every ConfigMap key a container reads that no rendered ConfigMap has, and every Secret key
/// that docs/kubernetes.md does not tell the user to create. An `optional: true` reference
/// must still name a key that exists or is documented: optional is for "may be unset", not
/// for a typo.
fn reference_problems(objects: &[Value], secret_keys: &BTreeSet<String>) -> Vec<String> {
    let configmap = |name: &str| -> Option<&Mapping> {
        objects
            .iter()
            .find(|o| o["kind"] == "ConfigMap" && o["metadata"]["name"] == name)
            .and_then(|o| o["data"].as_mapping())
    };
    let mut out = Vec::new();
    for (what, pod) in pods(objects) {
        for c in containers(pod) {
            let cname = c["name"].as_str().unwrap_or("?");
            for from in c["envFrom"].as_sequence().into_iter().flatten() {
                if let Some(n) = from["configMapRef"]["name"].as_str() {
                    if configmap(n).is_none() {
                        out.push(format!("{what} {cname}: no ConfigMap {n}"));
                    }
                }
                if from["secretRef"].is_mapping() {
                    out.push(format!("{what} {cname}: a whole Secret as envFrom"));
                }
            }
            for e in c["env"].as_sequence().into_iter().flatten() {
                let var = e["name"].as_str().unwrap_or("?");
                let cm = &e["valueFrom"]["configMapKeyRef"];
                if let (Some(n), Some(k)) = (cm["name"].as_str(), cm["key"].as_str()) {
                    if !configmap(n).is_some_and(|m| m.contains_key(k)) {
                        out.push(format!(
                            "{what} {cname} {var}: ConfigMap {n} has no key {k}"
                        ));
                    }
                }
                let sk = &e["valueFrom"]["secretKeyRef"];
                if let (Some(n), Some(k)) = (sk["name"].as_str(), sk["key"].as_str()) {
                    if n != "quantmesh-secrets" || !secret_keys.contains(k) {
                        out.push(format!(
                            "{what} {cname} {var}: Secret {n} key {k} is not in docs/kubernetes.md"
                        ));
                    }
                }
            }
        }
    }
    out
}

#[test]
fn every_configmap_and_secret_key_a_container_reads_exists_or_is_documented() {
    let keys = documented_secret_keys();
    assert!(keys.contains("aws-access-key-id"), "{keys:?}");
    for folder in [BASE, CRONJOB_OVERLAY] {
        let problems = reference_problems(&render(&root().join(folder)), &keys);
        assert!(problems.is_empty(), "{folder}: {problems:#?}");
    }
    // A key missing from the ConfigMap is found, in an init container's reference too.
    let mut objects = objects();
    for o in objects.iter_mut().filter(|o| o["kind"] == "ConfigMap") {
        if let Some(m) = o["data"].as_mapping_mut() {
            m.remove("QUANTMESH_MODEL");
        }
    }
    let problems = reference_problems(&objects, &keys);
    assert!(
        problems
            .iter()
            .any(|p| p.contains("fetch-model") && p.contains("no key QUANTMESH_MODEL")),
        "{problems:#?}"
    );
    // A Secret key the docs do not name is found.
    let mut fewer = keys.clone();
    fewer.remove("forge-token");
    let problems = reference_problems(&self::objects(), &fewer);
    assert!(
        problems.iter().any(|p| p.contains("key forge-token")),
        "{problems:#?}"
    );
}

#[test]
fn the_pods_are_hardened_spread_and_left_to_the_autoscaler() {
    let objects = objects();
    let account = find(&objects, "ServiceAccount", "quantmesh");
    assert_eq!(account["automountServiceAccountToken"], false);
    for folder in [BASE, CRONJOB_OVERLAY] {
        let objects = render(&root().join(folder));
        for (what, pod) in pods(&objects) {
            assert_eq!(pod["serviceAccountName"], "quantmesh", "{what}");
            assert_eq!(pod["automountServiceAccountToken"], false, "{what}");
            assert_eq!(pod["securityContext"]["runAsNonRoot"], true, "{what}");
            assert_eq!(
                pod["securityContext"]["seccompProfile"]["type"], "RuntimeDefault",
                "{what}"
            );
            for c in containers(pod) {
                let sc = &c["securityContext"];
                let why = format!("{what} {:?}", c["name"]);
                assert_eq!(sc["readOnlyRootFilesystem"], true, "{why}");
                assert_eq!(sc["allowPrivilegeEscalation"], false, "{why}");
                assert_eq!(sc["capabilities"]["drop"][0], "ALL", "{why}");
                for r in ["requests", "limits"] {
                    if c["resources"].is_mapping() {
                        assert!(c["resources"][r]["memory"].is_string(), "{why}: {r}");
                    }
                }
            }
        }
    }
    // What the autoscaler scales carries no replica count of its own.
    for hpa in objects
        .iter()
        .filter(|o| o["kind"] == "HorizontalPodAutoscaler")
    {
        let t = &hpa["spec"]["scaleTargetRef"];
        let target = find(
            &objects,
            t["kind"].as_str().unwrap_or(""),
            t["name"].as_str().unwrap_or(""),
        );
        assert!(
            target["spec"]["replicas"].is_null(),
            "{t:?} sets spec.replicas under an autoscaler"
        );
    }
    // Disruption budgets by maxUnavailable (an autoscaled count makes minAvailable drift).
    for pdb in objects
        .iter()
        .filter(|o| o["kind"] == "PodDisruptionBudget")
    {
        assert!(pdb["spec"]["minAvailable"].is_null(), "{pdb:?}");
        assert_eq!(pdb["spec"]["maxUnavailable"].as_u64(), Some(1), "{pdb:?}");
    }
    // Engines and gateways spread over nodes, each selecting its own pods.
    for (kind, name) in [
        ("StatefulSet", "quantmesh-engine"),
        ("Deployment", "quantmesh-gateway"),
    ] {
        let w = find(&objects, kind, name);
        let spread = w["spec"]["template"]["spec"]["topologySpreadConstraints"]
            .as_sequence()
            .cloned()
            .unwrap_or_default();
        assert!(
            spread
                .iter()
                .any(|c| c["topologyKey"] == "kubernetes.io/hostname"
                    && c["labelSelector"]["matchLabels"] == w["spec"]["selector"]["matchLabels"]),
            "{name}: no spread over nodes"
        );
    }
    // The engines' outbox volumes are kept when the set shrinks or is deleted.
    let engine = find(&objects, "StatefulSet", "quantmesh-engine");
    let keep = &engine["spec"]["persistentVolumeClaimRetentionPolicy"];
    assert_eq!(keep["whenScaled"], "Retain");
    assert_eq!(keep["whenDeleted"], "Retain");
    // The common operator setups select the monitoring objects.
    for kind in SKIPPED_KINDS {
        let o = find(&objects, kind, "quantmesh");
        assert!(
            o["metadata"]["labels"]["release"].is_string(),
            "{kind}: no release label"
        );
    }
    // The autoscaler's metric is one the adapter rule serves, from the engines' series.
    let hpa = find(&objects, "HorizontalPodAutoscaler", "quantmesh-engine");
    let metric = hpa["spec"]["metrics"][0]["pods"]["metric"]["name"]
        .as_str()
        .unwrap_or("");
    let adapter: Value = serde_yaml::from_str(&read(
        &root()
            .join(BASE)
            .join("addons/prometheus-adapter-values.yaml"),
    ))
    .unwrap_or_else(|e| panic!("{e}"));
    let rules = adapter["rules"]["custom"]
        .as_sequence()
        .cloned()
        .unwrap_or_default();
    assert!(
        rules.iter().any(|r| r["name"]["as"] == metric
            && r["seriesQuery"]
                .as_str()
                .is_some_and(|q| q.starts_with(&format!("{metric}{{")))
            && r["resources"]["overrides"]["pod"]["resource"] == "pod"),
        "no prometheus-adapter rule serves {metric}: {rules:?}"
    );
}

#[test]
fn the_cronjob_overlay_runs_the_evolution_pod_once() {
    let base = objects();
    let overlay = render(&root().join(CRONJOB_OVERLAY));
    assert!(
        !overlay
            .iter()
            .any(|o| o["metadata"]["name"] == "quantmesh-evolution"
                && (o["kind"] == "Deployment" || o["kind"] == "Service")),
        "the overlay keeps the long-running evolution service"
    );
    let cron = find(&overlay, "CronJob", "quantmesh-evolution");
    let deployment = find(&base, "Deployment", "quantmesh-evolution");
    assert_eq!(
        cron["spec"]["schedule"],
        k8s_env(&base, container(deployment))["QUANTMESH_EVOLUTION_SCHEDULE"]
            .clone()
            .map(Value::String)
            .unwrap_or(Value::Null),
        "the CronJob's schedule is the service's"
    );
    assert_eq!(cron["spec"]["concurrencyPolicy"], "Forbid");
    // The same pod, but for what a run-once job has no use for.
    let mut job_pod = cron["spec"]["jobTemplate"]["spec"]["template"]["spec"].clone();
    let mut service_pod = deployment["spec"]["template"]["spec"].clone();
    assert_eq!(job_pod["restartPolicy"], "OnFailure");
    if let Some(m) = job_pod.as_mapping_mut() {
        m.remove("restartPolicy");
    }
    let job = &mut job_pod["containers"][0];
    assert_eq!(
        job["args"],
        serde_yaml::from_str::<Value>("[evolve, --once]").unwrap_or_default()
    );
    let service = &mut service_pod["containers"][0];
    for c in [job, service] {
        if let Some(m) = c.as_mapping_mut() {
            for k in ["args", "ports", "readinessProbe", "livenessProbe"] {
                m.remove(k);
            }
        }
    }
    assert_eq!(
        job_pod, service_pod,
        "the CronJob's pod is not the service's"
    );
}
