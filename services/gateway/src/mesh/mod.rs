//! The gateway role of the microservice mesh (`quantmesh gateway`): the OpenAI API in front
//! of engine processes (`quantmesh engine`), reached over HTTP.
//!
//! ```text
//! client ──HTTP──▶ gateway: auth, body limit, routing ──HTTP (streaming)──▶ engine-1
//!                    │  one EngineClient actor per engine (bounded mailbox,     engine-2
//!                    │  health check on /ready every `health_interval`)          …
//!                    └─ /admin/* fans out to every engine, answers labelled by engine
//! ```
//!
//! Routing (`route.rs`): among engines that are up and below `max_outstanding`, the least
//! outstanding — unless the request's prefix was last sent to an engine that is at most
//! `affinity_slack` requests busier, which then gets it (its prefix cache likely holds the
//! prompt's first KV pages); a request sent elsewhere because its home was busy does not move
//! the prefix's home. A request that has not produced a byte for the client yet is
//! retried on another engine when its engine fails (connection refused or reset, 5xx); a
//! stream that had started ends with an error event. Every engine saturated: 429; none up:
//! 503. Engines come from config (`http://engine-1:8080`) or from DNS (`dns+http://engine:8080`:
//! every address the name resolves to, re-resolved every `discovery_interval`;
//! `discovery.rs`). The engines' internal API is the versioned OpenAI `/v1` API they serve themselves
//! (documented by their `/openapi.json`), plus `/ready`, `/metrics` and `/admin/*`.

pub mod client;
pub mod discovery;
pub mod http;
pub mod route;

use serde::{Deserialize, Serialize};
use std::time::Duration;

/// How requests are spread over engines.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum Routing {
    /// Least outstanding requests, with prefix affinity.
    #[default]
    LeastOutstanding,
    /// Uniformly at random among engines with room (a baseline for measurements).
    Random,
}

/// `[mesh]`: the engines a gateway routes to and how.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct MeshSettings {
    /// Engine base URLs, e.g. `http://engine-1:8080`, or DNS services whose name lists the
    /// engines, e.g. `dns+http://engine:8080` (every address it resolves to is an engine;
    /// see `discovery.rs`) (`QUANTMESH_ENGINES`, comma-separated; `--engine`, repeatable).
    pub engines: Vec<String>,
    pub routing: Routing,
    /// Requests in flight per engine before it counts as saturated.
    pub max_outstanding: usize,
    /// How often each engine's `/ready` is checked.
    #[serde(with = "humantime_serde")]
    pub health_interval: Duration,
    /// How often `dns+http://` services are resolved again.
    #[serde(with = "humantime_serde")]
    pub discovery_interval: Duration,
    /// Characters of the prompt (or of the rendered messages) that key prefix affinity:
    /// about a KV page's worth of tokens.
    pub affinity_chars: usize,
    /// How many more requests in flight the affinity engine may have than the least busy
    /// one and still get the request.
    pub affinity_slack: usize,
}

impl Default for MeshSettings {
    fn default() -> Self {
        Self {
            engines: Vec::new(),
            routing: Routing::default(),
            max_outstanding: 64,
            health_interval: Duration::from_secs(1),
            discovery_interval: Duration::from_secs(5),
            affinity_chars: 64,
            affinity_slack: 2,
        }
    }
}

impl MeshSettings {
    pub fn validate(&self) -> Result<(), String> {
        if self.engines.is_empty() {
            return Err(
                "the gateway needs at least one engine (--engine URL or QUANTMESH_ENGINES)".into(),
            );
        }
        for e in &self.engines {
            discovery::EngineEntry::parse(e)?;
        }
        if self.max_outstanding == 0 {
            return Err("mesh.max_outstanding must be > 0".into());
        }
        if self.health_interval.is_zero() || self.discovery_interval.is_zero() {
            return Err("mesh.health_interval and mesh.discovery_interval must be > 0".into());
        }
        Ok(())
    }
}
