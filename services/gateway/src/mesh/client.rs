//! One actor per engine: forwards requests to it over HTTP (its mailbox is the engine's
//! bounded queue) and checks its `/ready` on a timer. The router reads the engine's state
//! from the shared [`EngineView`].

use crate::mesh::metrics::MeshMetrics;
use actix::prelude::*;
use bytes::Bytes;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// What the router knows of an engine.
#[derive(Debug)]
pub struct EngineView {
    /// Label in metrics and admin answers (`engine-1`, …, or its host:port).
    pub name: String,
    /// Base URL, no trailing slash.
    pub base: String,
    /// The DNS name this engine was discovered under (`dns+http://…` entries), if any.
    pub service: Option<String>,
    up: AtomicBool,
    /// False once a discovered engine's address has left its service's DNS answer: it is no
    /// longer routed to, checked or fanned out to (it may be listed again later).
    listed: AtomicBool,
    /// Which client is this engine's: a client whose generation is behind stops (a relisted
    /// engine gets a new client while the old one may still be waiting for its timer).
    generation: AtomicU64,
    outstanding: AtomicUsize,
}

impl EngineView {
    pub fn new(name: String, base: &str) -> Self {
        Self {
            name,
            base: base.trim_end_matches('/').to_string(),
            service: None,
            up: AtomicBool::new(false),
            listed: AtomicBool::new(true),
            generation: AtomicU64::new(0),
            outstanding: AtomicUsize::new(0),
        }
    }

    /// An engine found by resolving `service`.
    pub fn discovered(name: String, base: &str, service: &str) -> Self {
        Self {
            service: Some(service.to_string()),
            ..Self::new(name, base)
        }
    }

    /// Up (its `/ready` answered 200) and listed: requests may go to it.
    pub fn is_up(&self) -> bool {
        self.up.load(Ordering::Relaxed) && self.is_listed()
    }

    pub fn is_listed(&self) -> bool {
        self.listed.load(Ordering::Relaxed)
    }

    /// List or retire the engine; true when this changed it. A retired engine counts as down.
    pub fn set_listed(&self, listed: bool) -> bool {
        let changed = self.listed.swap(listed, Ordering::Relaxed) != listed;
        if changed && !listed {
            self.up.store(false, Ordering::Relaxed);
        }
        changed
    }

    /// Mark the engine up or down; true when this changed it.
    pub fn set_up(&self, up: bool) -> bool {
        self.up.swap(up, Ordering::Relaxed) != up
    }

    pub fn generation(&self) -> u64 {
        self.generation.load(Ordering::Relaxed)
    }

    /// A new client takes over; returns its generation.
    pub fn next_generation(&self) -> u64 {
        self.generation.fetch_add(1, Ordering::Relaxed) + 1
    }

    pub fn outstanding(&self) -> usize {
        self.outstanding.load(Ordering::Relaxed)
    }
}

/// A request in flight on an engine: counted from creation to drop (a stream holds it until
/// its last byte).
pub struct InFlight {
    view: Arc<EngineView>,
    metrics: MeshMetrics,
}

impl InFlight {
    pub fn new(view: Arc<EngineView>, metrics: MeshMetrics) -> Self {
        let n = view.outstanding.fetch_add(1, Ordering::Relaxed) + 1;
        metrics.outstanding(&view.name, n);
        Self { view, metrics }
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        let n = self.view.outstanding.fetch_sub(1, Ordering::Relaxed) - 1;
        self.metrics.outstanding(&self.view.name, n);
    }
}

/// Gateway → engine client: send this request to the engine.
#[derive(Message)]
#[rtype(result = "Result<reqwest::Response, reqwest::Error>")]
pub struct Forward {
    pub method: reqwest::Method,
    /// Path and query, e.g. `/v1/chat/completions`.
    pub path: String,
    pub body: Bytes,
    /// Headers passed on (content type, authorization for admin calls, trace context,
    /// request id).
    pub headers: Vec<(String, String)>,
}

pub struct EngineClient {
    pub view: Arc<EngineView>,
    /// The view's generation this client was started for.
    pub generation: u64,
    pub http: reqwest::Client,
    pub health_interval: Duration,
    /// Bound of the mailbox: requests waiting to be forwarded.
    pub queue: usize,
    pub metrics: MeshMetrics,
}

impl EngineClient {
    fn note(&self, up: bool, why: &str) {
        if self.view.set_up(up) {
            match up {
                true => {
                    tracing::info!(engine = %self.view.name, url = %self.view.base, "engine is up")
                }
                false => {
                    tracing::warn!(engine = %self.view.name, url = %self.view.base, why, "engine marked down")
                }
            }
        }
        self.metrics.up(&self.view.name, up);
    }

    fn check(&mut self, ctx: &mut Context<Self>) {
        if self.view.generation() != self.generation {
            // Replaced by a newer client (the engine was retired and listed again).
            ctx.stop();
            return;
        }
        if !self.view.is_listed() {
            // Retired by discovery: this client stops (no timer, no mailbox left behind for
            // every address a service ever had); `Mesh::relist` starts a new one if the
            // address comes back.
            self.metrics.up(&self.view.name, false);
            ctx.stop();
            return;
        }
        let req = self
            .http
            .get(format!("{}/ready", self.view.base))
            .timeout(self.health_interval.max(Duration::from_millis(500)));
        ctx.spawn(
            async move { req.send().await.map(|r| r.status().as_u16()) }
                .into_actor(self)
                .map(|res, act, _| match res {
                    _ if !act.view.is_listed() || act.view.generation() != act.generation => {}
                    Ok(200) => act.note(true, ""),
                    Ok(code) => act.note(false, &format!("/ready answered {code}")),
                    Err(e) => act.note(false, &e.to_string()),
                }),
        );
    }
}

impl Actor for EngineClient {
    type Context = Context<Self>;
    fn started(&mut self, ctx: &mut Self::Context) {
        ctx.set_mailbox_capacity(self.queue);
        self.check(ctx);
        ctx.run_interval(self.health_interval, |act, ctx| act.check(ctx));
    }
}

impl Handler<Forward> for EngineClient {
    type Result = ResponseFuture<Result<reqwest::Response, reqwest::Error>>;
    fn handle(&mut self, msg: Forward, _: &mut Self::Context) -> Self::Result {
        let mut req = self
            .http
            .request(msg.method, format!("{}{}", self.view.base, msg.path))
            .body(msg.body);
        for (k, v) in msg.headers {
            req = req.header(k, v);
        }
        let view = self.view.clone();
        let metrics = self.metrics.clone();
        Box::pin(async move {
            let res = req.send().await;
            if let Err(e) = &res {
                if e.is_connect() && view.set_up(false) {
                    tracing::warn!(engine = %view.name, error = %e, "engine marked down: connection failed");
                    metrics.up(&view.name, false);
                }
            }
            res
        })
    }
}
