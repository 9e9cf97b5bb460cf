//! `[mesh]`: the engines a gateway routes to, how it spreads requests over them, and the
//! forms an engine entry may take (a URL, or a DNS name whose every address is an engine).

use serde::{Deserialize, Serialize};
use std::net::SocketAddr;
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
    /// the gateway discovers them) (`QUANTMESH_ENGINES`, comma-separated; `--engine`, repeatable).
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
    /// How long a connection to an engine may take to open.
    #[serde(with = "humantime_serde")]
    pub connect_timeout: Duration,
    /// How long an engine may take to begin its answer (the status line and headers) to a
    /// streaming request, `GET /v1/models` or `/openapi.json`. A non-streaming generation's
    /// answer begins only when it is complete: `request_timeout` bounds it.
    #[serde(with = "humantime_serde")]
    pub first_byte_timeout: Duration,
    /// Longest silence between two chunks of a streaming answer.
    #[serde(with = "humantime_serde")]
    pub idle_timeout: Duration,
    /// Longest time one request may take through the gateway, answer included (admin calls too).
    #[serde(with = "humantime_serde")]
    pub request_timeout: Duration,
    /// An engine whose `/ready` has not answered for this long is stalled (a stopped or
    /// wedged process, a partition): the requests in flight on it fail at once with 504
    /// `engine_timeout` (a started stream ends with that error event).
    #[serde(with = "humantime_serde")]
    pub stall_timeout: Duration,
    /// Consecutive transport failures (refused or lost connection, deadline passed) after
    /// which an engine is ejected (never the last one up): no requests for `ejection_time`,
    /// then back once its `/ready` answers 200 again.
    pub outlier_failures: u32,
    #[serde(with = "humantime_serde")]
    pub ejection_time: Duration,
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
            connect_timeout: Duration::from_secs(2),
            first_byte_timeout: Duration::from_secs(30),
            idle_timeout: Duration::from_secs(60),
            request_timeout: Duration::from_secs(600),
            stall_timeout: Duration::from_secs(10),
            outlier_failures: 5,
            ejection_time: Duration::from_secs(30),
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
            EngineEntry::parse(e)?;
        }
        if self.max_outstanding == 0 {
            return Err("mesh.max_outstanding must be > 0".into());
        }
        if self.health_interval.is_zero() || self.discovery_interval.is_zero() {
            return Err("mesh.health_interval and mesh.discovery_interval must be > 0".into());
        }
        for (name, d) in [
            ("connect_timeout", self.connect_timeout),
            ("first_byte_timeout", self.first_byte_timeout),
            ("idle_timeout", self.idle_timeout),
            ("request_timeout", self.request_timeout),
            ("stall_timeout", self.stall_timeout),
            ("ejection_time", self.ejection_time),
        ] {
            if d.is_zero() {
                return Err(format!("mesh.{name} must be > 0"));
            }
        }
        if self.stall_timeout < self.health_interval {
            return Err(format!(
                "mesh.stall_timeout ({:?}) must be at least mesh.health_interval ({:?}): a stall is seen by the health checks",
                self.stall_timeout, self.health_interval
            ));
        }
        if self.outlier_failures == 0 {
            return Err("mesh.outlier_failures must be > 0".into());
        }
        Ok(())
    }
}

/// One entry of `mesh.engines`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EngineEntry {
    /// `http://host:port`: one engine (its name is resolved per connection as usual).
    Static(String),
    /// `dns+http://host:port`: every address `host` resolves to is an engine.
    Dns(DnsService),
}

/// A service whose DNS name lists its engines.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DnsService {
    /// The entry as configured (labels the service's series).
    pub entry: String,
    /// `http` or `https`.
    pub scheme: String,
    pub host: String,
    pub port: u16,
}

impl EngineEntry {
    pub fn parse(entry: &str) -> Result<Self, String> {
        let entry = entry.trim();
        if let Some(rest) = entry.strip_prefix("dns+") {
            let url = url::Url::parse(rest)
                .map_err(|e| format!("engine service {entry:?} is not a URL: {e}"))?;
            if !matches!(url.scheme(), "http" | "https") {
                return Err(format!(
                    "engine service {entry:?}: use dns+http:// or dns+https://"
                ));
            }
            if url.path() != "/" || url.query().is_some() {
                return Err(format!(
                    "engine service {entry:?}: give only scheme, host and port"
                ));
            }
            let host = url
                .host_str()
                .ok_or_else(|| format!("engine service {entry:?} has no host"))?
                .trim_start_matches('[')
                .trim_end_matches(']')
                .to_string();
            let port = url
                .port_or_known_default()
                .ok_or_else(|| format!("engine service {entry:?} has no port"))?;
            return Ok(Self::Dns(DnsService {
                entry: entry.to_string(),
                scheme: url.scheme().to_string(),
                host,
                port,
            }));
        }
        if entry.starts_with("http://") || entry.starts_with("https://") {
            return Ok(Self::Static(entry.to_string()));
        }
        Err(format!(
            "engine {entry:?} is not an http://, https://, dns+http:// or dns+https:// URL"
        ))
    }
}

impl DnsService {
    /// The engine at `addr`: its name in metrics and admin answers, and its base URL.
    pub fn engine(&self, addr: SocketAddr) -> (String, String) {
        (
            format!("{}@{addr}", self.host),
            format!("{}://{addr}", self.scheme),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn addr(s: &str) -> SocketAddr {
        s.parse().expect("test address")
    }

    #[test]
    fn entries_parse_or_say_why_not() {
        assert_eq!(
            EngineEntry::parse("http://engine-1:8080"),
            Ok(EngineEntry::Static("http://engine-1:8080".into()))
        );
        let s = match EngineEntry::parse("dns+http://engine:8080") {
            Ok(EngineEntry::Dns(s)) => s,
            other => panic!("{other:?}"),
        };
        assert_eq!(
            (s.host.as_str(), s.port, s.scheme.as_str()),
            ("engine", 8080, "http")
        );
        match EngineEntry::parse("dns+https://engines.internal") {
            Ok(EngineEntry::Dns(s)) => assert_eq!(s.port, 443),
            other => panic!("{other:?}"),
        }
        for bad in [
            "engine-1:8080",
            "dns+ftp://engine:21",
            "dns+http://engine:8080/v1",
            "dns+engine:8080",
            "tcp://engine:8080",
        ] {
            assert!(EngineEntry::parse(bad).is_err(), "{bad} was accepted");
        }
        let (name, base) = s.engine(addr("[fd00::5]:8080"));
        assert_eq!(
            (name.as_str(), base.as_str()),
            ("engine@[fd00::5]:8080", "http://[fd00::5]:8080")
        );
    }
}
