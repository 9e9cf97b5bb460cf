//! The fault suite's harness: a small filesystem for the outbox, one engine container, the
//! admin toggler that makes fallback events, the load loops and the table's rows.

use crate::support::stack::{container_ip, Stack, TOKEN};
use crate::support::{self, poll, sum_metric};
use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// engine-2's outbox filesystem, and the space its outbox keeps free there.
pub(crate) const OUTBOX_FS_BYTES: u64 = 64 << 20;
pub(crate) const OUTBOX_RESERVE_BYTES: u64 = 16 << 20;
/// How long the broker stays down.
pub(crate) const OUTAGE: Duration = Duration::from_secs(60);

pub(crate) fn now_ms() -> u64 {
    quantmesh_types::now_ms()
}

/// A tmpfs of `bytes` mounted on a new directory (this host's, so it outlives the engine's
/// container across a restart); unmounted when dropped.
pub(crate) struct SmallFs {
    pub(crate) dir: PathBuf,
}

impl SmallFs {
    pub(crate) fn mount(parent: &Path, bytes: u64) -> SmallFs {
        let dir = parent.join("outbox-fs");
        std::fs::create_dir_all(&dir).unwrap();
        let out = Command::new("mount")
            .args(["-t", "tmpfs", "-o"])
            .arg(format!("size={bytes},mode=1777"))
            .arg("tmpfs")
            .arg(&dir)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "the disk-full fault mounts a {} MiB tmpfs for engine-2's outbox and needs root for it: {}",
            bytes >> 20,
            String::from_utf8_lossy(&out.stderr)
        );
        SmallFs { dir }
    }

    pub(crate) fn free(&self) -> u64 {
        fs2::available_space(&self.dir).unwrap()
    }

    /// Fill the filesystem with another file until `leave` bytes are free.
    pub(crate) fn fill_leaving(&self, leave: u64) {
        use std::io::Write;
        let mut f = std::fs::File::create(self.dir.join("filler")).unwrap();
        let chunk = vec![0u8; 1 << 20];
        while self.free() > leave {
            let n = (self.free() - leave).min(chunk.len() as u64) as usize;
            f.write_all(&chunk[..n]).unwrap();
            f.flush().unwrap();
        }
        f.sync_all().unwrap();
    }

    /// Fill the filesystem until a write fails with ENOSPC (another file, `filler-2`): the
    /// filesystem is truly full. `unfill_enospc` removes it again.
    pub(crate) fn fill_to_enospc(&self) {
        use std::io::Write;
        let mut f = std::fs::File::create(self.dir.join("filler-2")).unwrap();
        let chunk = vec![0u8; 64 << 10];
        loop {
            match f.write(&chunk).and_then(|n| f.flush().map(|_| n)) {
                Ok(0) => panic!("a write of {} bytes wrote nothing", chunk.len()),
                Ok(_) => {}
                Err(e) if e.raw_os_error() == Some(28) => break, // ENOSPC
                Err(e) => panic!("filling the outbox filesystem: {e}"),
            }
        }
        // Smaller writes until not even one byte fits.
        while f.write(&[0u8]).is_ok() {}
        assert_eq!(self.free(), 0, "the filesystem is full");
    }

    pub(crate) fn unfill_enospc(&self) {
        std::fs::remove_file(self.dir.join("filler-2")).unwrap();
    }

    pub(crate) fn unfill(&self) {
        std::fs::remove_file(self.dir.join("filler")).unwrap();
    }
}

impl Drop for SmallFs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.dir).output();
    }
}

/// One engine container as the test sees it: its service name and address.
#[derive(Clone)]
pub(crate) struct Engine {
    pub(crate) service: &'static str,
    pub(crate) ip: String,
}

impl Engine {
    pub(crate) fn of(stack: &Stack, service: &'static str) -> Engine {
        Engine {
            service,
            ip: container_ip(&stack.container(service)),
        }
    }

    /// The name the gateway gives it (found by DNS).
    pub(crate) fn name(&self) -> String {
        format!("engine@{}:8080", self.ip)
    }

    pub(crate) async fn metrics(&self, client: &reqwest::Client) -> String {
        support::scrape(client, &format!("http://{}:8080/metrics", self.ip)).await
    }

    pub(crate) async fn metric(
        &self,
        client: &reqwest::Client,
        name: &str,
        labels: &[&str],
    ) -> f64 {
        sum_metric(&self.metrics(client).await, name, labels)
    }

    pub(crate) async fn dropped(&self, client: &reqwest::Client, reason: &str) -> u64 {
        self.metric(
            client,
            "quantmesh_events_dropped_total",
            &[&format!("reason=\"{reason}\"")],
        )
        .await as u64
    }

    /// Until every fallback decision made so far is recorded in the outbox or counted as
    /// dropped (the writer has seen them all).
    pub(crate) async fn wait_written(&self, client: &reqwest::Client) {
        poll(
            Duration::from_secs(60),
            Duration::from_millis(200),
            || async {
                let m = self.metrics(client).await;
                let made = match m.contains("# TYPE quantmesh_fallback_decisions_total ") {
                    true => sum_metric(&m, "quantmesh_fallback_decisions_total", &[]),
                    false => 0.0, // no decision yet (see `admin_events`)
                };
                let recorded = sum_metric(
                    &m,
                    "quantmesh_events_recorded_total",
                    &["event_type=\"fallback\""],
                );
                let dropped = sum_metric(&m, "quantmesh_events_dropped_total", &[]);
                match recorded + dropped >= made {
                    true => Ok(()),
                    false => Err(format!(
                        "{}: {made} decisions, {recorded} recorded, {dropped} dropped",
                        self.service
                    )),
                }
            },
        )
        .await
    }

    pub(crate) async fn wait_drained(&self, client: &reqwest::Client) {
        poll(
            Duration::from_secs(120),
            Duration::from_millis(250),
            || async {
                let depth = self
                    .metric(client, "quantmesh_events_outbox_depth", &[])
                    .await;
                match depth == 0.0 {
                    true => Ok(()),
                    false => Err(format!(
                        "{}: the outbox still holds {depth} events",
                        self.service
                    )),
                }
            },
        )
        .await
    }
}

/// Admin forced fallbacks through the gateway (fanned out to every engine), alternating
/// float / auto per group so that each call changes every engine's state: one event each.
/// Each call's answer names the events it made (`event_ids`): the faults' events are known
/// by identity.
pub(crate) struct Toggler {
    pub(crate) groups: Vec<String>,
    pub(crate) calls: usize,
}

impl Toggler {
    /// `rounds` calls per group; each must reach every engine. The ids of the events made.
    pub(crate) async fn fire(
        &mut self,
        client: &reqwest::Client,
        stack: &Stack,
        rounds: usize,
    ) -> HashSet<String> {
        let mut ids = HashSet::new();
        for _ in 0..rounds {
            for g in &self.groups {
                let body = stack.force(client, g, self.mode()).await;
                let engines = body["engines"].as_array().unwrap();
                assert_eq!(engines.len(), 2, "{body}");
                ids.extend(event_ids(&body));
            }
            self.calls += 1;
        }
        ids
    }

    /// Like [`Toggler::fire`] while an engine may be failing: the events of the engines
    /// that answered.
    pub(crate) async fn fire_some(
        &mut self,
        client: &reqwest::Client,
        stack: &Stack,
        rounds: usize,
    ) -> HashSet<String> {
        let mut ids = HashSet::new();
        for _ in 0..rounds {
            let tagged = self.fire_tagged(client, stack, &AtomicUsize::new(0)).await;
            ids.extend(tagged.into_iter().map(|(_, id)| id));
        }
        ids
    }

    /// One round that tolerates failing engines: (engine, event id) of each event made;
    /// `calls` counts the admin calls as they are answered.
    pub(crate) async fn fire_tagged(
        &mut self,
        client: &reqwest::Client,
        stack: &Stack,
        calls: &AtomicUsize,
    ) -> Vec<(String, String)> {
        let mut out = Vec::new();
        for g in &self.groups {
            let r = client
                .post(stack.url("/admin/fallback"))
                .bearer_auth(TOKEN)
                .json(&serde_json::json!({"group": g, "mode": self.mode()}))
                .send()
                .await
                .unwrap();
            out.extend(tagged_event_ids(
                &r.json::<serde_json::Value>().await.unwrap(),
            ));
            calls.fetch_add(1, Ordering::Relaxed);
        }
        self.calls += 1;
        out
    }

    fn mode(&self) -> &'static str {
        match self.calls.is_multiple_of(2) {
            true => "float",
            false => "auto",
        }
    }
}

/// The event ids in a fanned-out admin answer, from the engines that answered 200.
fn event_ids(body: &serde_json::Value) -> Vec<String> {
    tagged_event_ids(body)
        .into_iter()
        .map(|(_, id)| id)
        .collect()
}

/// (engine, event id) for each event in a fanned-out admin answer.
pub(crate) fn tagged_event_ids(body: &serde_json::Value) -> Vec<(String, String)> {
    let mut out = Vec::new();
    for e in body["engines"].as_array().into_iter().flatten() {
        if e["status"] != 200 {
            continue;
        }
        let engine = e["engine"].as_str().unwrap_or_default().to_string();
        for id in e["body"]["event_ids"].as_array().into_iter().flatten() {
            out.push((engine.clone(), id.as_str().unwrap().to_string()));
        }
    }
    out
}

/// The admin fallback events on the topic: how many times each id was read, and each id's
/// timestamp.
pub(crate) fn topic_events(stack: &Stack) -> std::collections::HashMap<String, (usize, u64)> {
    let mut seen = std::collections::HashMap::new();
    for ev in stack.events(&["--idle-timeout", "10s"]) {
        if ev["reason"] == "admin" {
            let id = ev["event_id"].as_str().unwrap().to_string();
            let t = ev["timestamp_ms"].as_u64().unwrap();
            seen.entry(id).or_insert((0, t)).0 += 1;
        }
    }
    seen
}

/// The events a fault made, by identity, and what it allows to be missing.
#[derive(Default)]
pub(crate) struct Made {
    /// Every event id the fault's admin calls were answered with.
    pub(crate) created: HashSet<String>,
    /// From and to (Unix ms): admin events on the topic in it that nobody created are strays.
    pub(crate) window: (u64, u64),
    /// Ids that may be missing because their engine refused to store them, and how many
    /// its drop counters counted over the fault (the dropped column is the smaller).
    pub(crate) may_drop: HashSet<String>,
    pub(crate) counted_drops: u64,
    /// Ids that may be missing because they were not yet durable when their engine was
    /// killed (accepted, in the writer's queue).
    pub(crate) may_lose: HashSet<String>,
}

impl Made {
    /// The events `created` by a fault that began at `t_from` (Unix ms) and ends now, with
    /// nothing allowed to be missing.
    pub(crate) fn since(t_from: u64, created: HashSet<String>) -> Made {
        Made {
            created,
            window: (t_from, now_ms()),
            ..Made::default()
        }
    }
}

/// A fault's events as the table shows them.
pub(crate) struct Events {
    pub(crate) created: usize,
    pub(crate) delivered: usize,
    /// The ids counted in `delivered` (looked up again after the last fault).
    pub(crate) delivered_ids: HashSet<String>,
    /// Missing, and counted as dropped by their engine (as the fault allows).
    pub(crate) dropped: usize,
    /// Missing, and not yet durable at a kill (as the fault allows).
    pub(crate) not_durable: usize,
    /// Missing and accounted for by nothing: must be 0.
    pub(crate) lost: usize,
    /// Extra copies of delivered events (at-least-once; consumers dedup on `event_id`).
    pub(crate) duplicates: usize,
    /// Admin events on the topic in the fault's window that no admin answer named: must be 0.
    pub(crate) strays: usize,
}

impl Events {
    /// `made` against the topic; `all` is every id any fault created.
    pub(crate) fn account(
        topic: &std::collections::HashMap<String, (usize, u64)>,
        made: &Made,
        all: &HashSet<String>,
    ) -> Events {
        let missing: Vec<&String> = made
            .created
            .iter()
            .filter(|id| !topic.contains_key(*id))
            .collect();
        let droppable = missing
            .iter()
            .filter(|id| made.may_drop.contains(**id))
            .count();
        let dropped = droppable.min(made.counted_drops as usize);
        let not_durable = missing
            .iter()
            .filter(|id| made.may_lose.contains(**id))
            .count();
        let duplicates = made
            .created
            .iter()
            .filter_map(|id| topic.get(id))
            .map(|(n, _)| n - 1)
            .sum();
        let (from, to) = made.window;
        let strays = topic
            .iter()
            .filter(|(id, (_, t))| (from..=to).contains(t) && !all.contains(*id))
            .count();
        let delivered_ids: HashSet<String> = made
            .created
            .iter()
            .filter(|id| topic.contains_key(*id))
            .cloned()
            .collect();
        Events {
            created: made.created.len(),
            delivered: delivered_ids.len(),
            delivered_ids,
            dropped,
            not_durable,
            lost: missing.len() - dropped - not_durable,
            duplicates,
            strays,
        }
    }
}

/// Outcomes of requests sent during a fault.
#[derive(Default, Debug, Clone, Copy)]
pub(crate) struct Outcomes {
    pub(crate) sent: usize,
    pub(crate) ok: usize,
    /// Answered with an HTTP error status.
    pub(crate) http_errors: usize,
    /// Of the HTTP errors: 504 `engine_timeout` (a deadline passed or the engine stalled).
    pub(crate) timeouts: usize,
    /// No answer: refused, reset, closed.
    pub(crate) connection_errors: usize,
}

/// Completions through the gateway from `workers` loops until `stop`; each a short
/// non-streaming completion, read to the end.
pub(crate) fn load(
    stack: &Stack,
    workers: usize,
    stop: Arc<AtomicBool>,
) -> tokio::task::JoinHandle<Outcomes> {
    let url = stack.url("/v1/completions");
    tokio::spawn(async move {
        let client = reqwest::Client::builder()
            .timeout(Duration::from_secs(120))
            .build()
            .unwrap();
        let tasks = (0..workers).map(|w| {
            let (client, url, stop) = (client.clone(), url.clone(), stop.clone());
            async move {
                let mut o = Outcomes::default();
                let mut i = 0;
                while !stop.load(Ordering::Relaxed) {
                    i += 1;
                    o.sent += 1;
                    let r = client
                        .post(&url)
                        .json(
                            &serde_json::json!({"prompt": format!("Worker {w} asks question {i}:"),
                                                  "max_tokens": 12}),
                        )
                        .send()
                        .await;
                    match r {
                        Ok(r) if r.status() == 200 => match r.text().await {
                            Ok(_) => o.ok += 1,
                            Err(_) => o.connection_errors += 1,
                        },
                        Ok(r) => {
                            o.http_errors += 1;
                            let status = r.status();
                            let body = r.text().await.unwrap_or_default();
                            if status == 504 && body.contains("\"engine_timeout\"") {
                                o.timeouts += 1;
                            }
                        }
                        Err(_) => {
                            o.connection_errors += 1;
                            // Refused while the gateway is down: try again shortly.
                            tokio::time::sleep(Duration::from_millis(50)).await;
                        }
                    }
                }
                o
            }
        });
        let all = futures::future::join_all(tasks).await;
        all.into_iter().fold(Outcomes::default(), |a, o| Outcomes {
            sent: a.sent + o.sent,
            ok: a.ok + o.ok,
            http_errors: a.http_errors + o.http_errors,
            timeouts: a.timeouts + o.timeouts,
            connection_errors: a.connection_errors + o.connection_errors,
        })
    })
}

/// One row of the table.
pub(crate) struct Row {
    pub(crate) fault: &'static str,
    pub(crate) expected: &'static str,
    pub(crate) sent: usize,
    pub(crate) failed: usize,
    pub(crate) events: Option<Made>,
}

/// The dual groups (float copy held) of the first-load plan, at most `n`.
pub(crate) async fn dual_groups(client: &reqwest::Client, stack: &Stack, n: usize) -> Vec<String> {
    let cfg = support::get_json(client, &stack.url("/admin/config"), TOKEN).await;
    let mut groups: Vec<String> = cfg["engines"][0]["body"]["residency"]
        .as_object()
        .unwrap()
        .iter()
        .filter(|(_, r)| *r == "dual")
        .map(|(g, _)| g.clone())
        .collect();
    groups.sort();
    groups.truncate(n);
    assert!(
        !groups.is_empty(),
        "the first-load plan keeps no dual group: {cfg}"
    );
    groups
}

pub(crate) async fn wait_gateway_sees(
    client: &reqwest::Client,
    stack: &Stack,
    engine: &Engine,
    up: f64,
) {
    poll(
        Duration::from_secs(60),
        Duration::from_millis(250),
        || async {
            let m = stack.metrics(client).await;
            let v = sum_metric(
                &m,
                "quantmesh_gateway_engine_up",
                &[&format!("engine=\"{}\"", engine.name())],
            );
            match v == up {
                true => Ok(()),
                false => Err(format!(
                    "the gateway never saw {} ({}) as up={up}:\n{m}",
                    engine.service,
                    engine.name()
                )),
            }
        },
    )
    .await
}

/// Until the gateway holds at least `at_least` unanswered requests (on `engine`, or on all).
pub(crate) async fn wait_outstanding(
    client: &reqwest::Client,
    stack: &Stack,
    engine: Option<&Engine>,
    at_least: f64,
) {
    let label = engine.map(|e| format!("engine=\"{}\"", e.name()));
    let labels: Vec<&str> = label.iter().map(String::as_str).collect();
    poll(
        Duration::from_secs(60),
        Duration::from_millis(10),
        || async {
            let m = stack.metrics(client).await;
            match sum_metric(&m, "quantmesh_gateway_engine_outstanding", &labels) >= at_least {
                true => Ok(()),
                false => Err(format!(
                    "{} never held {at_least} requests:\n{m}",
                    engine.map_or("the gateway", |e| e.service)
                )),
            }
        },
    )
    .await
}
