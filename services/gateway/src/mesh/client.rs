//! One actor per engine: forwards requests to it over HTTP (its mailbox is the engine's
//! bounded queue) and checks its `/ready` on a timer. The router reads the engine's state
//! from the shared [`EngineView`].
//!
//! Every wait on an engine is bounded ([`bounded`]): by a deadline, and by the engine's stall
//! signal — raised by the health check when `/ready` has not answered for
//! `mesh.stall_timeout`, it fails every call in flight on that engine at once.

use crate::mesh::metrics::MeshMetrics;
use actix::prelude::*;
use bytes::Bytes;
use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::watch;
use tokio::time::Instant;

/// Which deadline passed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stage {
    /// The answer had not begun (`mesh.first_byte_timeout`).
    FirstByte,
    /// A stream was silent between chunks (`mesh.idle_timeout`).
    Idle,
    /// The request as a whole (`mesh.request_timeout`).
    Request,
}

/// Why a call to an engine failed before its whole answer arrived.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Failure {
    /// No connection (refused, unreachable, not opened within `mesh.connect_timeout`): the
    /// engine never saw the request.
    Connect(String),
    /// The connection ended before any byte of the answer: the engine process died or reset
    /// it, and whatever it had begun ended with it.
    Closed(String),
    /// A deadline passed while waiting on the engine.
    Deadline(Stage),
    /// The engine stopped answering its health checks (`mesh.stall_timeout`).
    Stalled,
    /// The answer broke off after it had begun.
    Body(String),
    /// The engine's client has stopped (the request was never sent).
    Gone(String),
}

impl Failure {
    /// Its `kind` label (one of `metrics::FAILURE_KINDS`); `None` when the engine is not at
    /// fault (its client stopped).
    pub fn kind(&self) -> Option<&'static str> {
        Some(match self {
            Failure::Connect(_) => "connect",
            Failure::Closed(_) => "closed",
            Failure::Deadline(Stage::FirstByte) => "first_byte",
            Failure::Deadline(Stage::Idle) => "idle",
            Failure::Deadline(Stage::Request) => "request",
            Failure::Stalled => "stalled",
            Failure::Body(_) => "body",
            Failure::Gone(_) => return None,
        })
    }

    /// Whether another engine may take the request: only when the engine did not get it or
    /// ended before answering anything. A deadline or a stall is not retried (the engine may
    /// still be working on it), nor is an answer that broke off (it may have finished).
    pub fn retryable(&self) -> bool {
        matches!(
            self,
            Failure::Connect(_) | Failure::Closed(_) | Failure::Gone(_)
        )
    }

    /// A failed `send()` (no answer had begun).
    pub fn of_send(e: &reqwest::Error) -> Self {
        if e.is_connect() {
            Failure::Connect(error_chain(e))
        } else if e.is_timeout() {
            Failure::Deadline(Stage::FirstByte)
        } else {
            Failure::Closed(error_chain(e))
        }
    }

    /// What a client is told, naming the engine.
    pub fn describe(&self, engine: &str) -> String {
        match self {
            Failure::Connect(e) => format!("engine {engine} could not be reached: {e}"),
            Failure::Closed(e) => {
                format!("engine {engine} closed the connection before answering: {e}")
            }
            Failure::Deadline(Stage::FirstByte) => {
                format!("engine {engine} did not begin its answer within mesh.first_byte_timeout")
            }
            Failure::Deadline(Stage::Idle) => {
                format!("engine {engine} sent nothing for mesh.idle_timeout")
            }
            Failure::Deadline(Stage::Request) => {
                format!("engine {engine} did not finish within mesh.request_timeout")
            }
            Failure::Stalled => format!(
                "engine {engine} stalled: its /ready has not answered for mesh.stall_timeout"
            ),
            Failure::Body(e) => format!("engine {engine}'s answer broke off: {e}"),
            Failure::Gone(e) => format!("engine {engine}'s client has stopped: {e}"),
        }
    }

    /// A deadline passed or the engine stalled (504 `engine_timeout`), as opposed to a
    /// transport failure.
    pub fn is_timeout(&self) -> bool {
        matches!(self, Failure::Deadline(_) | Failure::Stalled)
    }
}

/// An error and its sources in one line (reqwest's own text omits the cause).
pub fn error_chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        text.push_str(": ");
        text.push_str(&s.to_string());
        source = s.source();
    }
    text
}

/// Wait for `fut`, at most until `deadline` (then [`Failure::Deadline`]`(stage)`) and only
/// while `view`'s engine is not stalled (then [`Failure::Stalled`], at once — also when it
/// already is).
pub async fn bounded<T>(
    view: &EngineView,
    deadline: Instant,
    stage: Stage,
    fut: impl Future<Output = T>,
) -> Result<T, Failure> {
    let mut stalled = view.stalled.subscribe();
    tokio::select! {
        v = fut => Ok(v),
        _ = tokio::time::sleep_until(deadline) => Err(Failure::Deadline(stage)),
        _ = async {
            // A closed channel never signals (the view outlives its calls).
            if stalled.wait_for(|s| *s).await.is_err() {
                std::future::pending::<()>().await;
            }
        } => Err(Failure::Stalled),
    }
}

/// The client's answer to a [`Forward`], a stopped client included (the request was never
/// sent).
pub async fn call(addr: &Addr<EngineClient>, msg: Forward) -> Result<reqwest::Response, Failure> {
    addr.send(msg)
        .await
        .unwrap_or_else(|e| Err(Failure::Gone(e.to_string())))
}

/// The rest of an answer that has begun, read within `deadline` while the engine is not
/// stalled; a body that breaks off is [`Failure::Body`].
pub async fn read_body(
    view: &EngineView,
    deadline: Instant,
    resp: reqwest::Response,
) -> Result<Bytes, Failure> {
    bounded(view, deadline, Stage::Request, resp.bytes())
        .await?
        .map_err(|e| Failure::Body(error_chain(&e)))
}

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
    /// True while the engine is stalled: calls in flight wait on it turning true.
    stalled: watch::Sender<bool>,
    /// When the engine last answered anything (its `/ready`, or a forwarded call).
    last_answer: Mutex<Instant>,
    /// Transport failures since its last good answer (outlier detection).
    failures_in_row: AtomicU32,
    /// Out of routing until then (and until its `/ready` answers 200 after it).
    ejected_until: Mutex<Option<Instant>>,
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
            stalled: watch::channel(false).0,
            last_answer: Mutex::new(Instant::now()),
            failures_in_row: AtomicU32::new(0),
            ejected_until: Mutex::new(None),
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

    /// The engine answered (anything at all): not stalled, and its silence starts now.
    pub fn answered(&self) {
        if let Ok(mut t) = self.last_answer.lock() {
            *t = Instant::now();
        }
        self.stalled
            .send_if_modified(|s| std::mem::replace(s, false));
    }

    /// How long the engine has not answered anything.
    pub fn silent_for(&self) -> Duration {
        self.last_answer
            .lock()
            .map_or(Duration::ZERO, |t| t.elapsed())
    }

    /// Declare the engine stalled: every call in flight on it fails now. True when this
    /// changed it.
    pub fn stall(&self) -> bool {
        self.stalled
            .send_if_modified(|s| !std::mem::replace(s, true))
    }

    /// A call completed: the run of failures ends.
    pub fn succeeded(&self) {
        self.failures_in_row.store(0, Ordering::Relaxed);
    }

    /// A call failed in transport; true when this run of failures reached `limit` and the
    /// engine is now ejected until `for_how_long` has passed (and marked down). Never when
    /// `may_eject` is false (it is the last engine up: ejecting it would refuse everything).
    pub fn failed(&self, limit: u32, for_how_long: Duration, may_eject: bool) -> bool {
        let n = self.failures_in_row.fetch_add(1, Ordering::Relaxed) + 1;
        if n < limit || !may_eject {
            return false;
        }
        self.failures_in_row.store(0, Ordering::Relaxed);
        if let Ok(mut until) = self.ejected_until.lock() {
            *until = Some(Instant::now() + for_how_long);
        }
        self.up.store(false, Ordering::Relaxed);
        true
    }

    /// Ejected and its time not yet over.
    pub fn is_ejected(&self) -> bool {
        self.ejected_until
            .lock()
            .is_ok_and(|u| u.is_some_and(|t| Instant::now() < t))
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

/// Gateway → engine client: send this request to the engine and wait for its answer to
/// begin, until `deadline` (reported as `stage`) or a stall.
#[derive(Message)]
#[rtype(result = "Result<reqwest::Response, Failure>")]
pub struct Forward {
    pub method: reqwest::Method,
    /// Path and query, e.g. `/v1/chat/completions`.
    pub path: String,
    pub body: Bytes,
    /// Headers passed on (content type, authorization for admin calls, trace context,
    /// request id).
    pub headers: Vec<(String, String)>,
    pub deadline: Instant,
    pub stage: Stage,
}

pub struct EngineClient {
    pub view: Arc<EngineView>,
    /// The view's generation this client was started for.
    pub generation: u64,
    pub http: reqwest::Client,
    pub health_interval: Duration,
    /// `/ready` silent this long: the engine is stalled.
    pub stall_timeout: Duration,
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
        if !self.view.is_listed() && self.view.outstanding() == 0 {
            // Retired by discovery, nothing in flight: this client stops (no timer, no
            // mailbox left behind for every address a service ever had); `Mesh::relist`
            // starts a new one if the address comes back. While requests are still in
            // flight on it, it goes on checking, so a stall (its address gone with a
            // partition) still fails them.
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
                    _ if act.view.generation() != act.generation => {}
                    Ok(code) => {
                        act.view.answered();
                        // A retired engine is checked only for its silence.
                        if act.view.is_listed() {
                            match (code, act.view.is_ejected()) {
                                (200, false) => act.note(true, ""),
                                (200, true) => act.note(false, "ejected as an outlier"),
                                _ => act.note(false, &format!("/ready answered {code}")),
                            }
                        }
                    }
                    Err(e) => {
                        act.note(false, &error_chain(&e));
                        // Silent past the limit while it holds requests, or timing out (a stopped
                        // process, a partition): stalled. An engine that merely refuses
                        // connections (not started yet, or dead) is only down.
                        let silent = act.view.silent_for();
                        let hung = e.is_timeout() || act.view.outstanding() > 0;
                        if hung && silent >= act.stall_timeout && act.view.stall() {
                            tracing::error!(engine = %act.view.name, silent_s = silent.as_secs_f64(), in_flight = act.view.outstanding(), "engine stalled: its /ready has not answered for mesh.stall_timeout; failing the requests in flight on it");
                        }
                    }
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
    type Result = ResponseFuture<Result<reqwest::Response, Failure>>;
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
            let res = match bounded(&view, msg.deadline, msg.stage, req.send()).await {
                Ok(Ok(r)) => Ok(r),
                Ok(Err(e)) => Err(Failure::of_send(&e)),
                Err(f) => Err(f),
            };
            match &res {
                Ok(_) => view.answered(),
                Err(f @ Failure::Connect(_)) => {
                    if view.set_up(false) {
                        tracing::warn!(engine = %view.name, error = ?f, "engine marked down: connection failed");
                        metrics.up(&view.name, false);
                    }
                }
                Err(_) => {}
            }
            res
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_what_the_engine_did_not_take_is_retried() {
        for f in [
            Failure::Connect("refused".into()),
            Failure::Closed("reset".into()),
            Failure::Gone("stopped".into()),
        ] {
            assert!(f.retryable(), "{f:?}");
            assert!(!f.is_timeout(), "{f:?}");
        }
        for f in [
            Failure::Deadline(Stage::FirstByte),
            Failure::Deadline(Stage::Idle),
            Failure::Deadline(Stage::Request),
            Failure::Stalled,
        ] {
            assert!(!f.retryable() && f.is_timeout(), "{f:?}");
        }
        assert!(!Failure::Body("cut".into()).retryable());
        // Every kind an engine can be blamed for has its label; a stopped client has none.
        assert_eq!(Failure::Gone("x".into()).kind(), None);
        let every = [
            Failure::Connect(String::new()),
            Failure::Closed(String::new()),
            Failure::Deadline(Stage::FirstByte),
            Failure::Deadline(Stage::Idle),
            Failure::Deadline(Stage::Request),
            Failure::Stalled,
            Failure::Body(String::new()),
        ];
        let kinds: Vec<&str> = every.iter().filter_map(Failure::kind).collect();
        assert_eq!(kinds, crate::mesh::metrics::FAILURE_KINDS);
    }

    #[test]
    fn a_run_of_failures_ejects_an_engine_unless_it_is_the_last_one_up() {
        let v = EngineView::new("e".into(), "http://127.0.0.1:1");
        v.set_up(true);
        let ejection = Duration::from_secs(30);
        assert!(!v.failed(3, ejection, true));
        v.succeeded(); // a good answer ends the run
        assert!(!v.failed(3, ejection, true));
        assert!(!v.failed(3, ejection, true));
        assert!(v.failed(3, ejection, true), "the third in a row ejects");
        assert!(v.is_ejected() && !v.is_up());
        let last = EngineView::new("last".into(), "http://127.0.0.1:2");
        last.set_up(true);
        for _ in 0..10 {
            assert!(!last.failed(3, ejection, false));
        }
        assert!(!last.is_ejected() && last.is_up());
    }
}
