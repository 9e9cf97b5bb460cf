//! HTTP routes. `configure` is used by the server and by tests alike.
//!
//! - here: the route table, health, readiness, models, metrics, and the front door every
//!   request passes (auth, body limit, admission);
//! - `generate.rs`: completions and chat completions, from the request's fields to the
//!   streamed or whole answer;
//! - `admin.rs`: the admin routes (mask, monitor, forced fallbacks, plan reload).

use crate::auth::{self, bearer};
use crate::error::{parse_json, ApiError};
use crate::logprobs;
use crate::openai::{
    positive_f32, AssistantMessage, ChatChoice, ChatCompletionResponse, ChatRequest,
    CompletionChoice, CompletionRequest, CompletionResponse, FinishReasonBody, HealthBody,
    ModelCard, ModelList, ReadyBody, SamplingFields, UsageBody,
};
use crate::request_trace::{GenerationTrace, ServerSpan};
use crate::state::AppState;
use actix_web::http::StatusCode;
use actix_web::{web, HttpRequest, HttpResponse};
use bytes::Bytes;
use futures::StreamExt;
use quantmesh_engine::api::{
    ForceMode, GenerateRequest, Generation, GenerationEvent, Prompt, ReloadOutcome,
};
use quantmesh_settings::PrefixCacheIsolation;
use quantmesh_types::{FinishReason, GroupId, SamplingParams};
use serde_json::json;
use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

mod admin;
mod generate;

use admin::{get_config, get_fallback, get_mask, reload_config, set_fallback};
use generate::generate;

pub fn configure(cfg: &mut web::ServiceConfig) {
    cfg.route("/health", web::get().to(health))
        .route("/ready", web::get().to(ready))
        .route("/metrics", web::get().to(metrics))
        .route("/openapi.json", web::get().to(openapi))
        .route("/v1/models", web::get().to(models))
        .route(
            "/v1/completions",
            web::post().to(generate::<CompletionRequest>),
        )
        .route(
            "/v1/chat/completions",
            web::post().to(generate::<ChatRequest>),
        )
        .route("/admin/mask", web::get().to(get_mask))
        .route("/admin/fallback", web::get().to(get_fallback))
        .route("/admin/fallback", web::post().to(set_fallback))
        .route("/admin/config", web::get().to(get_config))
        .route("/admin/config/reload", web::post().to(reload_config))
        .default_service(web::to(not_found));
}

/// 405 with `Allow` for a known path asked with another method; 404 otherwise.
async fn not_found(req: HttpRequest) -> Result<HttpResponse, ApiError> {
    if let Some(allow) = crate::openapi::allowed_methods(req.path()) {
        return Err(ApiError::MethodNotAllowed {
            method: req.method().to_string(),
            allow: allow.join(", "),
        });
    }
    Err(ApiError::NotFound(format!(
        "no route for {} {}",
        req.method(),
        req.path()
    )))
}

async fn health() -> HttpResponse {
    HttpResponse::Ok().json(HealthBody { status: "ok" })
}

async fn ready(state: web::Data<AppState>) -> Result<HttpResponse, ApiError> {
    let e = state.engine()?;
    e.readiness().map_err(ApiError::Unavailable)?;
    Ok(HttpResponse::Ok().json(ReadyBody {
        status: "ready",
        model: state.model_name.clone(),
        load_seconds: e.info().load_seconds,
    }))
}

/// The OpenAPI 3.1 document of these routes (security stated as this server enforces it).
async fn openapi(state: web::Data<AppState>) -> HttpResponse {
    HttpResponse::Ok().json(crate::openapi::document(
        !state.server.api_keys.is_empty(),
        state.admin_token.is_some(),
    ))
}

async fn metrics(state: web::Data<AppState>) -> HttpResponse {
    let in_flight = state
        .server
        .max_concurrent_requests
        .saturating_sub(state.admission.available_permits());
    state.metrics.in_flight().set(in_flight as i64);
    HttpResponse::Ok()
        .content_type("text/plain; version=0.0.4; charset=utf-8")
        .body(state.metrics.render(state.engine_if_loaded().is_some()))
}

fn now_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

async fn models(req: HttpRequest, state: web::Data<AppState>) -> Result<HttpResponse, ApiError> {
    check_api_key(&req, &state)?;
    let max_len = state.engine_if_loaded().map(|e| e.info().max_model_len);
    Ok(HttpResponse::Ok().json(ModelList {
        object: "list",
        data: vec![ModelCard {
            id: state.model_name.clone(),
            object: "model",
            created: now_secs(),
            owned_by: "quantmesh",
            max_model_len: max_len,
        }],
    }))
}

fn check_api_key(req: &HttpRequest, state: &AppState) -> Result<(), ApiError> {
    auth::api_key(req, &state.server.api_keys)
}

fn check_admin(req: &HttpRequest, state: &AppState) -> Result<(), ApiError> {
    auth::admin(req, state.admin_token.as_deref())
}

/// The request's server span, when traces are exported.
fn server_span(req: &HttpRequest) -> Option<ServerSpan> {
    use actix_web::HttpMessage;
    req.extensions().get::<ServerSpan>().cloned()
}

/// Read the body with the configured limit (413 beyond it).
async fn read_body(mut payload: web::Payload, limit: usize) -> Result<Bytes, ApiError> {
    let mut buf = bytes::BytesMut::new();
    while let Some(chunk) = payload.next().await {
        let chunk =
            chunk.map_err(|e| ApiError::BadRequest(format!("reading request body: {e}")))?;
        if buf.len() + chunk.len() > limit {
            return Err(ApiError::PayloadTooLarge { limit });
        }
        buf.extend_from_slice(&chunk);
    }
    Ok(buf.freeze())
}

/// Read a request's body within `limit`: a `Content-Length` over it is refused (413) before
/// a byte is read, and a body that grows past it while read is refused too.
pub async fn read_request_body(
    req: &HttpRequest,
    payload: web::Payload,
    limit: usize,
) -> Result<Bytes, ApiError> {
    let declared = req
        .headers()
        .get(actix_web::http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > limit as u64) {
        return Err(ApiError::PayloadTooLarge { limit });
    }
    read_body(payload, limit).await
}

/// Read (within the body limit) and parse a JSON request body.
async fn json_body<T: serde::de::DeserializeOwned>(
    req: &HttpRequest,
    payload: web::Payload,
    state: &AppState,
) -> Result<T, ApiError> {
    let body = read_request_body(req, payload, state.server.max_body_bytes).await?;
    parse_json(&body)
}

/// One of `limit` admission permits from `admission` (429 when none is left): taken before
/// a generation's body is read or its template rendered, so `max_concurrent_requests`
/// bounds that work too. The embedded server's and the mesh gateway's front door alike.
pub fn take_permit(
    admission: &Arc<Semaphore>,
    limit: usize,
) -> Result<OwnedSemaphorePermit, ApiError> {
    admission.clone().try_acquire_owned().map_err(|_| {
        ApiError::Overloaded(format!(
            "{limit} requests in flight (max_concurrent_requests)"
        ))
    })
}

/// A generation's admission permit on the embedded server (once the engine is loaded).
fn admit(state: &AppState) -> Result<OwnedSemaphorePermit, ApiError> {
    state.engine()?;
    take_permit(&state.admission, state.server.max_concurrent_requests)
}
