//! The spans of one HTTP request when traces are exported (see [`quantmesh_telemetry`]):
//!
//! ```text
//! POST /v1/chat/completions        server span (HTTP semantic conventions), child of the
//! │                                caller's `traceparent` when it sent one
//! └─ chat <model>                  GenAI span (gen_ai.* semantic conventions)
//!    ├─ quantmesh.tokenize ┐
//!    ├─ quantmesh.queue    │ made by the engine (its `trace` module)
//!    ├─ quantmesh.prefill  │
//!    ├─ quantmesh.decode   ┘ one per answer, `step` events, precision decisions as events
//!    └─ quantmesh.respond          detokenize and send (streamed or whole)
//! ```

use crate::state::AppState;
use actix_web::body::MessageBody;
use actix_web::dev::{ServiceRequest, ServiceResponse};
use actix_web::http::header::{HeaderName, HeaderValue};
use actix_web::middleware::Next;
use actix_web::{web, HttpMessage};
use opentelemetry::{Array, StringValue, Value};
use quantmesh_engine::api::{PathMask, TRACE_TARGET};
use quantmesh_types::{FinishReason, SamplingParams, Usage};
use tracing::Instrument;
use tracing::Span;
use tracing_opentelemetry::OpenTelemetrySpanExt;

/// The request id of the current request (from `X-Request-Id`, else a new UUID).
#[derive(Clone, Debug)]
pub struct RequestId(pub String);

pub async fn request_context(
    req: ServiceRequest,
    next: Next<impl MessageBody>,
) -> Result<ServiceResponse<impl MessageBody>, actix_web::Error> {
    let id = req
        .headers()
        .get("x-request-id")
        .and_then(|v| v.to_str().ok())
        .filter(|v| !v.is_empty() && v.len() <= 128)
        .map(String::from)
        .unwrap_or_else(|| uuid::Uuid::new_v4().to_string());
    req.extensions_mut().insert(RequestId(id.clone()));
    let method = req.method().to_string();
    let span =
        tracing::info_span!("request", request_id = %id, method = %method, path = %req.path());
    // The trace's server span, only when traces are exported.
    let server = quantmesh_telemetry::enabled()
        .then(|| server_span(&method, req.path(), &id, req.headers()));
    if let Some(s) = &server {
        req.extensions_mut().insert(ServerSpan(s.clone()));
    }
    let state = req.app_data::<web::Data<AppState>>().cloned();
    let started = std::time::Instant::now();
    let call = next.call(req).instrument(span.clone());
    let mut res = match &server {
        Some(s) => call.instrument(s.clone()).await?,
        None => call.await?,
    };
    let status = res.status();
    let pattern = res
        .request()
        .match_pattern()
        .unwrap_or_else(|| "unmatched".into());
    if let Some(s) = &server {
        server_done(s, &method, &pattern, status.as_u16());
        // The response names its trace (W3C Trace Context).
        if let Some(v) =
            quantmesh_telemetry::traceparent(s).and_then(|tp| HeaderValue::from_str(&tp).ok())
        {
            res.headers_mut()
                .insert(HeaderName::from_static("traceparent"), v);
        }
    }
    if let Some(state) = state {
        state
            .metrics
            .requests
            .with_label_values(&[pattern.as_str(), status.as_str()])
            .inc();
    }
    let ms = started.elapsed().as_millis() as u64;
    span.in_scope(|| match is_probe(&pattern) {
        // Orchestrators poll these every few seconds: at INFO they would bury the log.
        true => tracing::debug!(status = status.as_u16(), ms, "response"),
        false => tracing::info!(status = status.as_u16(), ms, "response"),
    });
    if let Ok(v) = HeaderValue::from_str(&id) {
        res.headers_mut()
            .insert(HeaderName::from_static("x-request-id"), v);
    }
    Ok(res)
}

/// Health, readiness and scrape routes: polled by machines, logged at DEBUG.
fn is_probe(pattern: &str) -> bool {
    matches!(pattern, "/health" | "/ready" | "/metrics")
}

/// The server span of a request, kept in the request's extensions by the middleware.
#[derive(Clone, Debug)]
pub struct ServerSpan(pub Span);

/// The server span for `method path`, a child of the W3C context in `headers`.
pub fn server_span(
    method: &str,
    path: &str,
    request_id: &str,
    headers: &actix_web::http::header::HeaderMap,
) -> Span {
    let span = tracing::info_span!(
        target: TRACE_TARGET,
        "http",
        otel.name = %format!("{method} {path}"),
        otel.kind = "server",
        otel.status_code = tracing::field::Empty,
        http.request.method = %method,
        url.path = %path,
        http.route = tracing::field::Empty,
        http.response.status_code = tracing::field::Empty,
        quantmesh.request_id = %request_id,
    );
    let header = |name: &str| headers.get(name).and_then(|v| v.to_str().ok());
    quantmesh_telemetry::set_remote_parent(&span, header("traceparent"), header("tracestate"));
    span
}

/// Name the server span by its route and record the status.
pub fn server_done(span: &Span, method: &str, route: &str, status: u16) {
    span.record("otel.name", format!("{method} {route}"))
        .record("http.route", route)
        .record("http.response.status_code", status);
    if status >= 500 {
        span.record("otel.status_code", "ERROR");
    }
}

/// A generation request's GenAI span and the response span under it.
pub struct GenerationTrace {
    genai: Span,
    respond: Option<Span>,
}

impl GenerationTrace {
    /// The GenAI span of a `operation` (`chat`, `text_completion`) request, under `server`;
    /// `mask`: the precision in force when it arrived.
    pub fn start(
        server: &Span,
        operation: &'static str,
        model: &str,
        params: &SamplingParams,
        n: usize,
        mask: &PathMask,
    ) -> Self {
        const LISTED: usize = 16;
        let mut in_float: Vec<String> = mask
            .float_groups
            .iter()
            .take(LISTED)
            .map(|g| g.to_string())
            .collect();
        if mask.float_groups.len() > LISTED {
            in_float.push(format!("… {} more", mask.float_groups.len() - LISTED));
        }
        let genai = tracing::info_span!(
            target: TRACE_TARGET,
            parent: server,
            "gen_ai",
            otel.name = %format!("{operation} {model}"),
            otel.status_code = tracing::field::Empty,
            gen_ai.operation.name = operation,
            gen_ai.provider.name = "quantmesh",
            gen_ai.request.model = %model,
            gen_ai.request.max_tokens = params.max_tokens as i64,
            gen_ai.request.temperature = params.temperature as f64,
            gen_ai.request.top_p = params.top_p as f64,
            gen_ai.request.seed = tracing::field::Empty,
            gen_ai.request.choice.count = n as i64,
            gen_ai.response.id = tracing::field::Empty,
            gen_ai.response.model = %model,
            gen_ai.usage.input_tokens = tracing::field::Empty,
            gen_ai.usage.output_tokens = tracing::field::Empty,
            quantmesh.groups_in_float = mask.float_groups.len() as i64,
            quantmesh.groups_in_float.names = %in_float.join(","),
            quantmesh.batch_in_float = mask.float_batch,
        );
        if let Some(seed) = params.seed {
            genai.record("gen_ai.request.seed", seed as i64);
        }
        Self {
            genai,
            respond: None,
        }
    }

    /// The span the engine hangs its phase spans under.
    pub fn engine_span(&self) -> Span {
        self.genai.clone()
    }

    /// The answer is being detokenized and sent.
    pub fn responding(&mut self, id: &str, stream: bool) {
        self.genai.record("gen_ai.response.id", id);
        self.respond = Some(tracing::info_span!(
            target: TRACE_TARGET,
            parent: &self.genai,
            "quantmesh.respond",
            quantmesh.stream = stream,
        ));
    }

    /// Everything was sent (or the request failed): usage and finish reasons; the spans end
    /// when this is dropped.
    pub fn finished(&mut self, usage: &Usage, reasons: &[Option<FinishReason>]) {
        self.genai
            .record("gen_ai.usage.input_tokens", usage.prompt_tokens as i64)
            .record("gen_ai.usage.output_tokens", usage.completion_tokens as i64);
        let names: Vec<StringValue> = reasons
            .iter()
            .map(|r| r.map_or("error", FinishReason::as_str).to_string().into())
            .collect();
        if reasons
            .iter()
            .any(|r| r.is_none_or(|r| r == FinishReason::Error))
        {
            self.genai.record("otel.status_code", "ERROR");
        }
        self.genai.set_attribute(
            "gen_ai.response.finish_reasons",
            Value::Array(Array::String(names)),
        );
        self.respond = None;
    }
}
