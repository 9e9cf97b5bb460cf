//! The gateway's HTTP surface in mesh mode and its start-up.

use crate::mesh::client::{
    bounded, call, error_chain, read_body, EngineView, Failure, Forward, InFlight, Stage,
};
use crate::mesh::discovery::{system_resolver, Discovery, EngineEntry};
use crate::mesh::metrics::MeshMetrics;
use crate::mesh::route::{affinity_key, ClientTemplate, Mesh, NoEngine};
use actix::Actor;
use actix_web::http::StatusCode;
use actix_web::{web, App, HttpMessage, HttpRequest, HttpResponse, HttpServer};
use bytes::Bytes;
use futures::StreamExt;
use prometheus::{Encoder, Registry, TextEncoder};
use quantmesh_server::auth;
use quantmesh_server::error::{parse_json, ApiError};
use quantmesh_server::request_trace::{RequestId, ServerSpan};
use quantmesh_server::routes::{read_request_body, take_permit};
use quantmesh_settings::Settings;
use serde_json::json;
use std::future::Future;
use std::net::TcpListener;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::Semaphore;
use tokio::time::Instant;

pub struct MeshState {
    pub settings: Settings,
    pub mesh: Arc<Mesh>,
    pub registry: Registry,
    /// One permit per generation in flight through the gateway (`max_concurrent_requests`),
    /// taken before its body is read: 429 when none is left, as on an engine.
    pub admission: Arc<Semaphore>,
}

/// Request headers passed on to engines as they came. `Authorization` goes through so an
/// engine's own API keys and its per-key prefix-cache partitions work behind the gateway.
const FORWARDED: [&str; 3] = ["content-type", "tracestate", "authorization"];

/// The headers an engine call carries: [`FORWARDED`], the request id the gateway logs under
/// (the caller's or a new one, set by the request middleware), and the trace context: the
/// gateway's own span when traces are exported (the engine's spans become its children),
/// else the caller's.
fn forwarded(req: &HttpRequest) -> Vec<(String, String)> {
    let header = |k: &str| {
        req.headers()
            .get(k)
            .and_then(|v| v.to_str().ok())
            .map(String::from)
    };
    let mut h: Vec<(String, String)> = FORWARDED
        .iter()
        .filter_map(|k| Some((k.to_string(), header(k)?)))
        .collect();
    let ext = req.extensions();
    if let Some(id) = ext.get::<RequestId>() {
        h.push(("x-request-id".into(), id.0.clone()));
    }
    let own = ext
        .get::<ServerSpan>()
        .and_then(|s| quantmesh_telemetry::traceparent(&s.0));
    if let Some(tp) = own.or_else(|| header("traceparent")) {
        h.push(("traceparent".into(), tp));
    }
    h
}

/// The engine's answer headers a client also gets from the gateway: its trace (replaced by
/// the gateway's own span when the gateway exports traces) and request id.
fn copy_trace_headers(from: &reqwest::header::HeaderMap, to: &mut actix_web::HttpResponseBuilder) {
    for k in ["traceparent", "x-request-id"] {
        if let Some(v) = from.get(k).and_then(|v| v.to_str().ok()) {
            to.insert_header((k, v.to_string()));
        }
    }
}

fn reject(state: &MeshState, why: NoEngine) -> ApiError {
    match why {
        NoEngine::Saturated => {
            state
                .mesh
                .metrics
                .rejected
                .with_label_values(&["saturated"])
                .inc();
            ApiError::Overloaded(format!(
                "every engine has {} requests in flight (mesh.max_outstanding)",
                state.mesh.settings.max_outstanding
            ))
        }
        NoEngine::NoneUp => {
            state
                .mesh
                .metrics
                .rejected
                .with_label_values(&["no_engine"])
                .inc();
            ApiError::Unavailable("no engine is up".into())
        }
    }
}

/// The SSE event that ends a stream whose engine failed after it had started: code
/// `engine_timeout` when a deadline passed or the engine stalled, else `engine_failed`.
fn stream_error(engine: &str, f: &Failure) -> Bytes {
    let code = match f.is_timeout() {
        true => "engine_timeout",
        false => "engine_failed",
    };
    let body = json!({"error": {
        "message": format!("{} (while streaming)", f.describe(engine)),
        "type": "server_error", "code": code, "param": null,
    }});
    Bytes::from(format!("data: {body}\n\n"))
}

/// What a failure that ends a request (not retried) tells the client.
fn failure_error(engine: &str, f: &Failure) -> ApiError {
    match f {
        _ if f.is_timeout() => ApiError::EngineTimeout(f.describe(engine)),
        Failure::Body(_) => ApiError::BadGateway(f.describe(engine)),
        _ => ApiError::Unavailable(f.describe(engine)),
    }
}

/// An engine's answer passed to the client as it came (status, content type, body), with the
/// trace headers and the engine's name.
fn pass_through(
    engine: &str,
    status: u16,
    headers: &reqwest::header::HeaderMap,
    body: Bytes,
) -> HttpResponse {
    let status = StatusCode::from_u16(status).unwrap_or(StatusCode::BAD_GATEWAY);
    let content_type = headers
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("application/json")
        .to_string();
    let mut answer = HttpResponse::build(status);
    copy_trace_headers(headers, &mut answer);
    answer
        .content_type(content_type)
        .insert_header(("x-quantmesh-engine", engine.to_string()))
        .body(body)
}

/// An engine's answer that says it did not take the request (and another engine may): 503
/// (loading, shutting down, cannot serve) or 429 (its own queue is full).
fn refused(status: u16) -> bool {
    matches!(status, 429 | 503)
}

/// Why the last engine tried did not serve the request: what the client gets when no engine
/// is left to try.
enum LastTry {
    /// The engine's own refusal, passed on unchanged.
    Answer(String, u16, reqwest::header::HeaderMap, Bytes),
    Failed(String),
}

/// `/v1/completions` and `/v1/chat/completions`: route, forward, stream through.
///
/// Retry policy: another engine gets the request only when nothing of the answer reached the
/// gateway and the engine did not take the request — the connection was refused or not
/// opened, it closed before any byte of the answer (the process died), or the engine answered
/// 503 or 429. Never after an answer began, never on another status (a 500 is the engine's
/// answer and goes to the client as it is), never after a deadline or a stall (504
/// `engine_timeout`: the engine may still be working on it).
async fn generate(
    req: HttpRequest,
    payload: web::Payload,
    state: web::Data<MeshState>,
) -> Result<HttpResponse, ApiError> {
    let mesh_settings = &state.mesh.settings;
    let deadline = Instant::now() + mesh_settings.request_timeout;
    auth::api_key(&req, &state.settings.server.api_keys)?;
    let permit = take_permit(
        &state.admission,
        state.settings.server.max_concurrent_requests,
    )?;
    let body = read_request_body(&req, payload, state.settings.server.max_body_bytes).await?;
    let v: serde_json::Value = parse_json(&body)?;
    let stream = v.get("stream").and_then(|s| s.as_bool()).unwrap_or(false);
    let key = affinity_key(&v, mesh_settings.affinity_chars);
    let headers = forwarded(&req);
    let mut tried = Vec::new();
    let mut last: Option<LastTry> = None;
    loop {
        let (i, choice) = match (state.mesh.pick(key, &tried), last.take()) {
            (Ok(p), _) => p,
            // Every engine tried refused it: the last one's answer, unchanged.
            (Err(NoEngine::NoneUp), Some(LastTry::Answer(engine, status, h, b))) => {
                return Ok(pass_through(&engine, status, &h, b))
            }
            (Err(NoEngine::NoneUp), Some(LastTry::Failed(why))) => {
                return Err(ApiError::Unavailable(format!(
                    "the request failed on {} engine(s), none left to try; the last: {why}",
                    tried.len()
                )))
            }
            (Err(why), _) => return Err(reject(&state, why)),
        };
        tried.push(i);
        let engines = state.mesh.engines();
        let Some((view, addr)) = engines.get(i) else {
            continue;
        };
        let in_flight = InFlight::new(view.clone(), state.mesh.metrics.clone());
        // A stream must begin within first_byte_timeout; a non-streaming answer begins only
        // when it is complete.
        let (head_by, stage) = match stream {
            true => earlier(deadline, mesh_settings.first_byte_timeout, Stage::FirstByte),
            false => (deadline, Stage::Request),
        };
        let sent = call(
            addr,
            Forward {
                method: reqwest::Method::POST,
                path: req.path().to_string(),
                body: body.clone(),
                headers: headers.clone(),
                deadline: head_by,
                stage,
            },
        )
        .await;
        let retry = |why: &str| {
            tracing::warn!(engine = %view.name, why, "retrying the request on another engine");
            state
                .mesh
                .metrics
                .retries
                .with_label_values(&[&view.name])
                .inc();
        };
        let resp = match sent {
            Ok(r) if refused(r.status().as_u16()) => {
                let (status, h) = (r.status().as_u16(), r.headers().clone());
                let b = read_body(view, deadline, r).await.unwrap_or_default();
                retry(&format!("the engine answered {status}"));
                last = Some(LastTry::Answer(view.name.clone(), status, h, b));
                continue;
            }
            Ok(r) => r,
            Err(f) => {
                state.mesh.failed(view, &f);
                if f.retryable() {
                    retry(&f.describe(&view.name));
                    last = Some(LastTry::Failed(f.describe(&view.name)));
                    continue;
                }
                return Err(failure_error(&view.name, &f));
            }
        };
        let status = resp.status().as_u16();
        let headers_back = resp.headers().clone();
        let routed = || {
            state
                .mesh
                .metrics
                .routed
                .with_label_values(&[&view.name, choice.as_str()])
                .inc()
        };
        if !stream || !(200..300).contains(&status) {
            // The answer has begun: whatever happens now is not retried (the engine may
            // have done the work).
            return match read_body(view, deadline, resp).await {
                Ok(b) => {
                    view.succeeded();
                    routed();
                    Ok(pass_through(&view.name, status, &headers_back, b))
                }
                Err(f) => {
                    state.mesh.failed(view, &f);
                    Err(failure_error(&view.name, &f))
                }
            };
        }
        routed();
        let engine = view.name.clone();
        let (view, mesh) = (view.clone(), state.mesh.clone());
        let (idle, failures) = (
            mesh_settings.idle_timeout,
            state.mesh.metrics.stream_failures.clone(),
        );
        // The stream holds the engine's in-flight slot and the gateway's admission permit
        // until it ends.
        let held = Some((in_flight, permit));
        let body = futures::stream::unfold(
            (resp.bytes_stream().boxed(), held, false),
            move |(mut s, guard, done)| {
                let (view, mesh, failures) = (view.clone(), mesh.clone(), failures.clone());
                async move {
                    if done {
                        return None;
                    }
                    let (by, stage) = earlier(deadline, idle, Stage::Idle);
                    let next = bounded(&view, by, stage, s.next()).await;
                    let failure = match next {
                        Ok(Some(Ok(b))) => {
                            return Some((Ok::<Bytes, actix_web::Error>(b), (s, guard, false)))
                        }
                        Ok(None) => {
                            view.succeeded();
                            return None;
                        }
                        Ok(Some(Err(e))) => Failure::Body(error_chain(&e)),
                        Err(f) => f,
                    };
                    tracing::warn!(engine = %view.name, failure = ?failure, "engine failed mid-stream");
                    failures.with_label_values(&[&view.name]).inc();
                    mesh.failed(&view, &failure);
                    Some((Ok(stream_error(&view.name, &failure)), (s, None, true)))
                }
            },
        );
        let mut answer = HttpResponse::Ok();
        copy_trace_headers(&headers_back, &mut answer);
        return Ok(answer
            .content_type("text/event-stream")
            .insert_header(("Cache-Control", "no-cache"))
            .insert_header(("x-quantmesh-engine", engine))
            .streaming(body));
    }
}

/// The earlier of the request's `deadline` and `within` from now (a limit of kind `stage`),
/// and which of the two it is.
fn earlier(deadline: Instant, within: Duration, stage: Stage) -> (Instant, Stage) {
    let own = Instant::now() + within;
    match own < deadline {
        true => (own, stage),
        false => (deadline, Stage::Request),
    }
}

/// `GET /v1/models` and `GET /openapi.json`: the first engine that answers speaks for all
/// (they serve the same model and API). Its answer is passed on as it came — a 401 or 404
/// included; another engine is asked only when this one failed (no answer in time, a
/// transport failure, a 5xx).
async fn from_any_engine(
    req: HttpRequest,
    state: web::Data<MeshState>,
) -> Result<HttpResponse, ApiError> {
    if req.path().starts_with("/v1/") {
        auth::api_key(&req, &state.settings.server.api_keys)?;
    }
    let settings = &state.mesh.settings;
    let deadline = Instant::now() + settings.request_timeout;
    let mut last = None;
    for (view, addr) in state.mesh.engines().iter().filter(|(v, _)| v.is_up()) {
        let (head_by, stage) = earlier(deadline, settings.first_byte_timeout, Stage::FirstByte);
        let sent = call(
            addr,
            Forward {
                method: reqwest::Method::GET,
                path: req.path().to_string(),
                body: Bytes::new(),
                headers: forwarded(&req),
                deadline: head_by,
                stage,
            },
        )
        .await;
        let answer = match sent {
            Ok(r) => {
                let (status, h) = (r.status().as_u16(), r.headers().clone());
                read_body(view, deadline, r).await.map(|b| (status, h, b))
            }
            Err(f) => Err(f),
        };
        match answer {
            Ok((status, h, b)) if status < 500 => {
                view.succeeded();
                return Ok(pass_through(&view.name, status, &h, b));
            }
            Ok((status, _, b)) => {
                let why = format!(
                    "engine {} answered {status}: {}",
                    view.name,
                    String::from_utf8_lossy(&b)
                );
                tracing::warn!(engine = %view.name, path = req.path(), why, "GET failed on this engine");
                last = Some(why);
            }
            Err(f) => {
                state.mesh.failed(view, &f);
                tracing::warn!(engine = %view.name, path = req.path(), failure = ?f, "GET failed on this engine");
                last = Some(f.describe(&view.name));
            }
        }
    }
    match last {
        None => Err(reject(&state, NoEngine::NoneUp)),
        Some(why) => Err(ApiError::Unavailable(format!(
            "no engine could answer {}; the last: {why}",
            req.path()
        ))),
    }
}

/// `/admin/*`: the same call on every engine, answers labelled by engine. 200 when every
/// engine answered 2xx, else 502 (the per-engine answers say which failed and why). Each
/// call is bounded by `mesh.request_timeout` and ends at once if its engine stalls.
async fn admin(
    req: HttpRequest,
    payload: web::Payload,
    state: web::Data<MeshState>,
) -> Result<HttpResponse, ApiError> {
    auth::admin(&req, state.settings.server.admin_token.as_deref())?;
    let body = read_request_body(&req, payload, state.settings.server.max_body_bytes).await?;
    let method = reqwest::Method::from_bytes(req.method().as_str().as_bytes())
        .map_err(|e| ApiError::BadRequest(e.to_string()))?;
    let path = req
        .uri()
        .path_and_query()
        .map_or(req.path().to_string(), |p| p.to_string());
    let deadline = Instant::now() + state.mesh.settings.request_timeout;
    let engines = state.mesh.engines();
    let calls = engines
        .iter()
        .filter(|(v, _)| v.is_listed())
        .map(|(view, addr)| {
            let f = Forward {
                method: method.clone(),
                path: path.clone(),
                body: body.clone(),
                headers: forwarded(&req),
                deadline,
                stage: Stage::Request,
            };
            async move {
                let answer = match call(addr, f).await {
                    Ok(r) => {
                        let code = r.status().as_u16();
                        read_body(view, deadline, r).await.map(|b| (code, b))
                    }
                    Err(f) => Err(f),
                };
                match answer {
                    Ok((code, bytes)) => {
                        let body = serde_json::from_slice(&bytes).unwrap_or_else(|_| {
                            serde_json::Value::String(String::from_utf8_lossy(&bytes).into_owned())
                        });
                        json!({"engine": view.name, "status": code, "body": body})
                    }
                    Err(f) => {
                        json!({"engine": view.name, "status": null, "error": f.describe(&view.name)})
                    }
                }
            }
        });
    let answers = futures::future::join_all(calls).await;
    let all_ok = answers.iter().all(|a| {
        a["status"]
            .as_u64()
            .is_some_and(|s| (200..300).contains(&s))
    });
    let status = if all_ok {
        StatusCode::OK
    } else {
        StatusCode::BAD_GATEWAY
    };
    Ok(HttpResponse::build(status).json(json!({ "engines": answers })))
}

async fn health() -> HttpResponse {
    HttpResponse::Ok().json(json!({"status": "ok"}))
}

async fn ready(state: web::Data<MeshState>) -> Result<HttpResponse, ApiError> {
    let up = state.mesh.up();
    if up == 0 {
        return Err(ApiError::Unavailable("no engine is up".into()));
    }
    Ok(HttpResponse::Ok().json(json!({
        "status": "ready", "engines_up": up, "engines": state.mesh.listed(),
    })))
}

async fn metrics(state: web::Data<MeshState>) -> HttpResponse {
    let mut buf = Vec::new();
    if let Err(e) = TextEncoder::new().encode(&state.registry.gather(), &mut buf) {
        tracing::error!(error = %e, "encoding metrics failed");
    }
    HttpResponse::Ok()
        .content_type("text/plain; version=0.0.4; charset=utf-8")
        .body(buf)
}

async fn not_found(req: HttpRequest) -> Result<HttpResponse, ApiError> {
    Err(ApiError::NotFound(format!(
        "no route for {} {} on the gateway",
        req.method(),
        req.path()
    )))
}

pub fn configure(cfg: &mut web::ServiceConfig) {
    cfg.route("/health", web::get().to(health))
        .route("/ready", web::get().to(ready))
        .route("/metrics", web::get().to(metrics))
        .route(
            quantmesh_telemetry::runbooks::PATH,
            web::get().to(quantmesh_server::routes::runbooks_page),
        )
        .route("/v1/models", web::get().to(from_any_engine))
        .route("/openapi.json", web::get().to(from_any_engine))
        .route("/v1/completions", web::post().to(generate))
        .route("/v1/chat/completions", web::post().to(generate))
        .route("/admin/{tail:.*}", web::route().to(admin))
        .default_service(web::to(not_found));
}

/// Start the engine clients and the HTTP server on `listener`; returns after `shutdown`
/// resolves and in-flight requests have finished (bounded by the shutdown timeout). Must run
/// inside an actix system.
pub async fn run_gateway(
    settings: Settings,
    listener: TcpListener,
    shutdown: impl Future<Output = ()>,
) -> anyhow::Result<()> {
    settings.validate()?;
    settings
        .mesh
        .validate()
        .map_err(|e| anyhow::anyhow!("mesh settings: {e}"))?;
    let registry = Registry::new();
    let metrics = MeshMetrics::register(&registry);
    let template = ClientTemplate {
        http: reqwest::Client::builder()
            .connect_timeout(settings.mesh.connect_timeout)
            .build()?,
        health_interval: settings.mesh.health_interval,
        stall_timeout: settings.mesh.stall_timeout,
        queue: settings.mesh.max_outstanding,
    };
    let mesh = Arc::new(Mesh::new(settings.mesh.clone(), metrics, template));
    #[cfg(unix)]
    actix_rt::spawn(quantmesh_server::signals::log_sighup_without_reload());
    // Static engines are named by their place in the list (engine-1, engine-2, …); each DNS
    // service gets a discovery actor that adds its engines as they resolve.
    for (i, entry) in settings.mesh.engines.iter().enumerate() {
        match EngineEntry::parse(entry).map_err(|e| anyhow::anyhow!("mesh settings: {e}"))? {
            EngineEntry::Static(url) => {
                mesh.add(EngineView::new(format!("engine-{}", i + 1), &url));
            }
            EngineEntry::Dns(service) => {
                Discovery::new(
                    mesh.clone(),
                    service,
                    settings.mesh.discovery_interval,
                    system_resolver(),
                )
                .start();
            }
        }
    }
    // Serve once an engine is up (its first health check passed), for at most
    // `mesh.connect_timeout`: a gateway that answered at once would refuse with 503 "no
    // engine is up" the requests that arrive while it discovers engines it is about to find
    // (a restart under load). Connections that arrive meanwhile wait in the listener's queue.
    let settle = Instant::now() + settings.mesh.connect_timeout;
    while mesh.up() == 0 && Instant::now() < settle {
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    let timeout = settings.server.shutdown_timeout_secs;
    let state = web::Data::new(MeshState {
        admission: Arc::new(Semaphore::new(settings.server.max_concurrent_requests)),
        settings,
        mesh,
        registry,
    });
    let addr = listener.local_addr()?;
    // The embedded server's request middleware: request id, the request's log line and
    // span (the gateway hop in the trace), its traceparent and x-request-id on the answer.
    let server = HttpServer::new(move || {
        App::new()
            .app_data(state.clone())
            .wrap(actix_web::middleware::from_fn(
                quantmesh_server::request_trace::request_context,
            ))
            .configure(configure)
    })
    .on_connect(|conn, _| {
        if let Some(tcp) = conn.downcast_ref::<actix_web::rt::net::TcpStream>() {
            let _ = tcp.set_nodelay(true);
        }
    })
    .listen(listener)?
    .shutdown_timeout(timeout)
    .disable_signals()
    .run();
    let handle = server.handle();
    let task = actix_rt::spawn(server);
    tracing::info!(%addr, "gateway listening");
    shutdown.await;
    tracing::info!("shutting down: no new requests, in-flight ones finish");
    handle.stop(true).await;
    let _ = task.await;
    tracing::info!("stopped");
    Ok(())
}
