//! Which engine gets a request.

use crate::mesh::client::{EngineClient, EngineView, Failure};
use crate::mesh::metrics::MeshMetrics;
use crate::mesh::{MeshSettings, Routing};
use actix::{Actor, Addr};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::collections::HashMap;
use std::hash::{Hash, Hasher};
use std::sync::{Arc, Mutex, RwLock};

/// Most prefixes remembered for affinity (the map is cleared when it grows past this).
const AFFINITY_CAPACITY: usize = 65_536;

/// Why no engine was chosen.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NoEngine {
    /// Every engine that is up has `max_outstanding` requests in flight.
    Saturated,
    /// No engine is up (or every one was tried).
    NoneUp,
}

/// How an engine was chosen (a metric label).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Choice {
    Affinity,
    Least,
    Random,
}

impl Choice {
    pub fn as_str(self) -> &'static str {
        match self {
            Choice::Affinity => "affinity",
            Choice::Least => "least",
            Choice::Random => "random",
        }
    }
}

/// An engine the gateway knows: what the router reads, and the actor that talks to it.
pub type Member = (Arc<EngineView>, Addr<EngineClient>);

/// How new engine clients are made (discovery adds engines while the gateway runs).
#[derive(Clone)]
pub struct ClientTemplate {
    pub http: reqwest::Client,
    pub health_interval: std::time::Duration,
    pub stall_timeout: std::time::Duration,
    /// Bound of each engine client's mailbox.
    pub queue: usize,
}

/// The engines and the routing state. The engine list only grows (an engine whose address
/// left DNS is retired, not removed), so an index names the same engine for the gateway's
/// whole life: retries' `tried` lists and prefix homes stay valid while the list changes.
pub struct Mesh {
    engines: RwLock<Arc<Vec<Member>>>,
    pub settings: MeshSettings,
    pub metrics: MeshMetrics,
    template: ClientTemplate,
    affinity: Mutex<HashMap<u64, usize>>,
    rng: Mutex<StdRng>,
}

impl Mesh {
    pub fn new(settings: MeshSettings, metrics: MeshMetrics, template: ClientTemplate) -> Self {
        Self {
            engines: RwLock::new(Arc::new(Vec::new())),
            settings,
            metrics,
            template,
            affinity: Mutex::new(HashMap::new()),
            rng: Mutex::new(StdRng::from_entropy()),
        }
    }

    /// The engines now (a snapshot; indices stay valid in later snapshots).
    pub fn engines(&self) -> Arc<Vec<Member>> {
        match self.engines.read() {
            Ok(e) => e.clone(),
            Err(poisoned) => poisoned.into_inner().clone(),
        }
    }

    fn client(&self, view: &Arc<EngineView>, generation: u64) -> Addr<EngineClient> {
        EngineClient {
            view: view.clone(),
            generation,
            http: self.template.http.clone(),
            health_interval: self.template.health_interval,
            stall_timeout: self.template.stall_timeout,
            queue: self.template.queue,
            metrics: self.metrics.clone(),
        }
        .start()
    }

    /// Replace the engine list by `f(current)` (copy on write: snapshots in use stay valid).
    fn update(&self, f: impl FnOnce(&mut Vec<Member>)) {
        let mut guard = match self.engines.write() {
            Ok(g) => g,
            Err(poisoned) => poisoned.into_inner(),
        };
        let mut next = Vec::clone(&guard);
        f(&mut next);
        *guard = Arc::new(next);
    }

    /// Start a client for a new engine and add it. Must run inside an actix system.
    pub fn add(&self, view: EngineView) -> Arc<EngineView> {
        let view = Arc::new(view);
        self.metrics.label(&view.name);
        tracing::info!(engine = %view.name, url = %view.base, "routing to engine");
        let addr = self.client(&view, view.generation());
        self.update(|e| e.push((view.clone(), addr)));
        view
    }

    /// List engine `i` again (its address is back in DNS) with a fresh client: the old one
    /// stopped when it found the engine retired.
    pub fn relist(&self, i: usize) -> bool {
        let Some((view, _)) = self.engines().get(i).cloned() else {
            return false;
        };
        if !view.set_listed(true) {
            return false;
        }
        let addr = self.client(&view, view.next_generation());
        self.update(|e| {
            if let Some(m) = e.get_mut(i) {
                m.1 = addr;
            }
        });
        true
    }

    /// A call to `view`'s engine failed: counted by kind, and the engine ejected after
    /// `outlier_failures` in a row (Envoy's consecutive gateway failures) while another
    /// engine is up.
    pub fn failed(&self, view: &EngineView, failure: &Failure) {
        let Some(kind) = failure.kind() else {
            return;
        };
        self.metrics
            .failures
            .with_label_values(&[&view.name, kind])
            .inc();
        // Never the last engine up: with nothing else to route to, ejecting it would turn
        // its failures into refusals of every request.
        let others_up = self
            .engines()
            .iter()
            .any(|(v, _)| v.is_up() && !std::ptr::eq(Arc::as_ptr(v), view));
        let (limit, time) = (self.settings.outlier_failures, self.settings.ejection_time);
        if view.failed(limit, time, others_up) {
            tracing::warn!(engine = %view.name, failures = self.settings.outlier_failures, ejection_s = self.settings.ejection_time.as_secs_f64(), last = ?failure, "engine ejected as an outlier: no requests until its time is over and its /ready answers 200");
            self.metrics
                .ejections
                .with_label_values(&[&view.name])
                .inc();
            self.metrics.up(&view.name, false);
        }
    }

    /// Engines that are up.
    pub fn up(&self) -> usize {
        self.engines().iter().filter(|(v, _)| v.is_up()).count()
    }

    /// Engines that are listed (static ones, and discovered ones still in DNS).
    pub fn listed(&self) -> usize {
        self.engines().iter().filter(|(v, _)| v.is_listed()).count()
    }

    /// Choose an engine for a request keyed `key` (its prefix), not among `tried`.
    pub fn pick(&self, key: Option<u64>, tried: &[usize]) -> Result<(usize, Choice), NoEngine> {
        let engines = self.engines();
        let views: Vec<(usize, usize)> = engines
            .iter()
            .enumerate()
            .filter(|(i, (v, _))| v.is_up() && !tried.contains(i))
            .map(|(i, (v, _))| (i, v.outstanding()))
            .collect();
        let (i, choice) = choose(
            &views,
            self.settings.max_outstanding,
            self.settings.routing,
            key.and_then(|k| self.affinity.lock().ok()?.get(&k).copied()),
            self.settings.affinity_slack,
            &mut *self.rng.lock().map_err(|_| NoEngine::NoneUp)?,
        )?;
        // A prefix keeps its home while that engine is up: a request sent elsewhere because
        // its home was busy does not move it (that would spread the prefix over every
        // engine's cache). A prefix without a home, or whose home is down or was tried and
        // failed, gets the engine chosen now.
        if let (Some(k), Ok(mut a)) = (key, self.affinity.lock()) {
            let home_ok = a.get(&k).is_some_and(|h| {
                *h == i || (engines.get(*h).is_some_and(|(v, _)| v.is_up()) && !tried.contains(h))
            });
            if !home_ok {
                if a.len() >= AFFINITY_CAPACITY {
                    a.clear();
                }
                a.insert(k, i);
            }
        }
        Ok((i, choice))
    }
}

/// The routing rule, pure: `up` lists (engine, requests in flight) of the candidates.
pub fn choose(
    up: &[(usize, usize)],
    max_outstanding: usize,
    routing: Routing,
    affinity: Option<usize>,
    slack: usize,
    rng: &mut impl Rng,
) -> Result<(usize, Choice), NoEngine> {
    if up.is_empty() {
        return Err(NoEngine::NoneUp);
    }
    let room: Vec<(usize, usize)> = up
        .iter()
        .copied()
        .filter(|(_, n)| *n < max_outstanding)
        .collect();
    if room.is_empty() {
        return Err(NoEngine::Saturated);
    }
    if routing == Routing::Random {
        return Ok((room[rng.gen_range(0..room.len())].0, Choice::Random));
    }
    let least = room.iter().map(|(_, n)| *n).min().unwrap_or(0);
    if let Some(&(i, n)) = affinity.and_then(|a| room.iter().find(|(i, _)| *i == a)) {
        if n <= least + slack {
            return Ok((i, Choice::Affinity));
        }
    }
    let pick = room
        .iter()
        .find(|(_, n)| *n == least)
        .map_or(room[0].0, |(i, _)| *i);
    Ok((pick, Choice::Least))
}

/// The affinity key of a request body: a hash of the first `chars` characters of its prompt
/// (completions) or of its messages' roles and contents (chat) — the text its first KV pages
/// are computed from. `None` when the body has neither.
pub fn affinity_key(body: &serde_json::Value, chars: usize) -> Option<u64> {
    let mut text = String::new();
    if let Some(p) = body.get("prompt") {
        match p {
            serde_json::Value::String(s) => text.push_str(s),
            other => text.push_str(&other.to_string()),
        }
    } else if let Some(ms) = body.get("messages").and_then(|m| m.as_array()) {
        for m in ms {
            text.push_str(m.get("role").and_then(|r| r.as_str()).unwrap_or(""));
            text.push('\u{1f}');
            text.push_str(m.get("content").and_then(|c| c.as_str()).unwrap_or(""));
            text.push('\u{1e}');
            if text.chars().count() >= chars {
                break;
            }
        }
    } else {
        return None;
    }
    let prefix: String = text.chars().take(chars).collect();
    let mut h = std::collections::hash_map::DefaultHasher::new();
    prefix.hash(&mut h);
    Some(h.finish())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rng() -> StdRng {
        StdRng::seed_from_u64(7)
    }

    #[test]
    fn least_outstanding_wins_unless_affinity_is_close() {
        let up = [(0, 3), (1, 1), (2, 2)];
        let lo = Routing::LeastOutstanding;
        assert_eq!(
            choose(&up, 8, lo, None, 2, &mut rng()),
            Ok((1, Choice::Least))
        );
        // The affinity engine is 1 busier than the least: within the slack.
        assert_eq!(
            choose(&up, 8, lo, Some(2), 2, &mut rng()),
            Ok((2, Choice::Affinity))
        );
        // 2 busier with slack 1: load wins.
        assert_eq!(
            choose(&up, 8, lo, Some(0), 1, &mut rng()),
            Ok((1, Choice::Least))
        );
    }

    #[test]
    fn saturated_and_down_engines_are_told_apart() {
        let lo = Routing::LeastOutstanding;
        assert_eq!(
            choose(&[], 8, lo, None, 2, &mut rng()),
            Err(NoEngine::NoneUp)
        );
        assert_eq!(
            choose(&[(0, 8), (1, 9)], 8, lo, None, 2, &mut rng()),
            Err(NoEngine::Saturated)
        );
        // A saturated affinity engine is passed over.
        assert_eq!(
            choose(&[(0, 8), (1, 0)], 8, lo, Some(0), 100, &mut rng()),
            Ok((1, Choice::Least))
        );
    }

    #[test]
    fn random_spreads_over_engines_with_room() {
        let mut r = rng();
        let mut seen = [0; 3];
        for _ in 0..300 {
            let (i, c) = choose(
                &[(0, 0), (1, 5), (2, 8)],
                8,
                Routing::Random,
                Some(1),
                0,
                &mut r,
            )
            .unwrap();
            assert_eq!(c, Choice::Random);
            seen[i] += 1;
        }
        assert!(seen[0] > 100 && seen[1] > 100 && seen[2] == 0, "{seen:?}");
    }

    #[test]
    fn affinity_keys_follow_the_prefix() {
        let a = serde_json::json!({"prompt": "The same long prefix, then A"});
        let b = serde_json::json!({"prompt": "The same long prefix, then B"});
        assert_eq!(affinity_key(&a, 20), affinity_key(&b, 20));
        assert_ne!(affinity_key(&a, 40), affinity_key(&b, 40));
        let c = serde_json::json!({"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "x"}]});
        let d = serde_json::json!({"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "y"}]});
        assert_eq!(affinity_key(&c, 12), affinity_key(&d, 12));
        assert_eq!(affinity_key(&serde_json::json!({}), 12), None);
    }
}
