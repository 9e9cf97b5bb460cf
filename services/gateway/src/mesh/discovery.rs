//! Engines found by DNS. A `dns+http://engine:8080` entry in `mesh.engines` names a service
//! whose DNS name answers with one address per replica — a compose service scaled to N (or
//! several services sharing a network alias), a Kubernetes headless service. One
//! [`Discovery`] actor per such entry resolves it every `mesh.discovery_interval`: each new
//! address becomes an engine (its own client actor, named `engine@10.0.0.5:8080` in metrics
//! and admin answers), an engine whose address left the answer is retired (no longer routed
//! to, health-checked or fanned out to), and listed again if its address comes back. A failed
//! or empty answer changes nothing (a DNS hiccup must not empty the mesh) and is counted.

use crate::mesh::client::EngineView;
use crate::mesh::route::Mesh;
use actix::prelude::*;
use futures::future::BoxFuture;
pub use quantmesh_settings::mesh::{DnsService, EngineEntry};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

/// Resolves a host and port to socket addresses (the system resolver in production: it reads
/// `/etc/hosts` and asks the configured DNS servers, Docker's embedded one in compose).
pub type Resolver =
    Arc<dyn Fn(String, u16) -> BoxFuture<'static, std::io::Result<Vec<SocketAddr>>> + Send + Sync>;

pub fn system_resolver() -> Resolver {
    Arc::new(|host: String, port: u16| {
        Box::pin(async move {
            Ok(tokio::net::lookup_host((host.as_str(), port))
                .await?
                .collect())
        })
    })
}

/// What a DNS answer changes among a service's known engines.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Change {
    /// Addresses no engine has yet.
    pub add: Vec<SocketAddr>,
    /// Listed engines (mesh indices) whose address is no longer in the answer.
    pub retire: Vec<usize>,
    /// Retired engines whose address is back.
    pub relist: Vec<usize>,
}

/// The pure rule: `known` lists (mesh index, base URL, listed) of the service's engines.
pub fn diff(
    service: &DnsService,
    known: &[(usize, String, bool)],
    answer: &[SocketAddr],
) -> Change {
    let mut change = Change::default();
    let mut seen: Vec<String> = Vec::new();
    for addr in answer {
        let (_, base) = service.engine(*addr);
        if seen.contains(&base) {
            continue;
        }
        match known.iter().find(|(_, b, _)| *b == base) {
            None => change.add.push(*addr),
            Some((i, _, false)) => change.relist.push(*i),
            Some(_) => {}
        }
        seen.push(base);
    }
    change.retire = known
        .iter()
        .filter(|(_, b, listed)| *listed && !seen.contains(b))
        .map(|(i, _, _)| *i)
        .collect();
    change
}

/// Keeps one DNS service's engines in the mesh in step with its DNS answer.
pub struct Discovery {
    pub mesh: Arc<Mesh>,
    pub service: DnsService,
    pub interval: Duration,
    pub resolver: Resolver,
    /// A lookup is in flight (a slow resolver does not pile lookups up).
    busy: bool,
    /// The last lookup failed (failures are logged when they start and when they end).
    failing: bool,
}

impl Discovery {
    pub fn new(
        mesh: Arc<Mesh>,
        service: DnsService,
        interval: Duration,
        resolver: Resolver,
    ) -> Self {
        Self {
            mesh,
            service,
            interval,
            resolver,
            busy: false,
            failing: false,
        }
    }

    fn lookup(&mut self, ctx: &mut Context<Self>) {
        if self.busy {
            return;
        }
        self.busy = true;
        let answer = (self.resolver)(self.service.host.clone(), self.service.port);
        let timeout = self.interval.max(Duration::from_secs(2));
        ctx.spawn(
            async move {
                match tokio::time::timeout(timeout, answer).await {
                    Ok(r) => r,
                    Err(_) => Err(std::io::Error::new(
                        std::io::ErrorKind::TimedOut,
                        "DNS lookup timed out",
                    )),
                }
            }
            .into_actor(self)
            .map(|res, act, _| {
                act.busy = false;
                act.apply(res);
            }),
        );
    }

    fn apply(&mut self, answer: std::io::Result<Vec<SocketAddr>>) {
        let service = &self.service;
        let metrics = &self.mesh.metrics;
        let addrs = match answer {
            Ok(a) if !a.is_empty() => a,
            other => {
                let why = match other {
                    Err(e) => e.to_string(),
                    Ok(_) => "no address".to_string(),
                };
                metrics
                    .discovery_errors
                    .with_label_values(&[&service.entry])
                    .inc();
                if !self.failing {
                    tracing::warn!(service = %service.entry, why, "engine service lookup failed; keeping its engines as they are");
                }
                self.failing = true;
                return;
            }
        };
        if self.failing {
            tracing::info!(service = %service.entry, "engine service resolves again");
            self.failing = false;
        }
        let engines = self.mesh.engines();
        let known: Vec<(usize, String, bool)> = engines
            .iter()
            .enumerate()
            .filter(|(_, (v, _))| v.service.as_deref() == Some(service.entry.as_str()))
            .map(|(i, (v, _))| (i, v.base.clone(), v.is_listed()))
            .collect();
        let change = diff(service, &known, &addrs);
        for addr in &change.add {
            let (name, base) = service.engine(*addr);
            self.mesh
                .add(EngineView::discovered(name, &base, &service.entry));
        }
        for &i in &change.retire {
            if let Some((view, _)) = engines.get(i) {
                if view.set_listed(false) {
                    metrics.up(&view.name, false);
                    tracing::warn!(engine = %view.name, service = %service.entry, "engine left DNS: retired");
                }
            }
        }
        for &i in &change.relist {
            if self.mesh.relist(i) {
                if let Some((view, _)) = engines.get(i) {
                    tracing::info!(engine = %view.name, service = %service.entry, "engine is back in DNS: listed again");
                }
            }
        }
        // After the change, the service's listed engines are exactly the distinct addresses
        // of the answer.
        let mut distinct = addrs;
        distinct.sort_unstable();
        distinct.dedup();
        let now = distinct.len();
        metrics
            .discovered
            .with_label_values(&[&service.entry])
            .set(now as i64);
    }
}

impl Actor for Discovery {
    type Context = Context<Self>;
    fn started(&mut self, ctx: &mut Self::Context) {
        tracing::info!(service = %self.service.entry, every = ?self.interval, "discovering engines by DNS");
        self.lookup(ctx);
        ctx.run_interval(self.interval, |act, ctx| act.lookup(ctx));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn service() -> DnsService {
        match EngineEntry::parse("dns+http://engine:8080") {
            Ok(EngineEntry::Dns(s)) => s,
            other => panic!("{other:?}"),
        }
    }

    fn addr(s: &str) -> SocketAddr {
        s.parse().expect("test address")
    }

    #[test]
    fn a_dns_answer_adds_retires_and_relists() {
        let s = service();
        let a = addr("10.0.0.2:8080");
        let b = addr("10.0.0.3:8080");
        let c = addr("10.0.0.4:8080");
        // First answer: everything is new (duplicates in the answer count once).
        assert_eq!(
            diff(&s, &[], &[a, b, a]),
            Change {
                add: vec![a, b],
                ..Change::default()
            }
        );
        let known = vec![
            (0, s.engine(a).1, true),
            (1, s.engine(b).1, true),
            (2, s.engine(c).1, false),
        ];
        // b left, c came back, d is new.
        let d = addr("10.0.0.5:8080");
        assert_eq!(
            diff(&s, &known, &[a, c, d]),
            Change {
                add: vec![d],
                retire: vec![1],
                relist: vec![2]
            }
        );
        // The same answer again changes nothing.
        assert_eq!(diff(&s, &known[..2], &[b, a]), Change::default());
    }
}
