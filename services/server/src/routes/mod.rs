//! HTTP routes. `configure` is used by the server and by tests alike.
//!
//! - here: the route table, health, readiness, models, metrics, and the front door every
//!   request passes (auth, body limit, admission);
//! - `generate.rs`: completions and chat completions, from the request's fields to the
//!   streamed or whole answer;
//! - `admin.rs`: the admin routes (mask, monitor, forced fallbacks, plan reload).

use crate::error::ApiError;
use crate::openai::{ChatRequest, CompletionRequest, HealthBody, ModelCard, ModelList, ReadyBody};
use crate::state::AppState;
use actix_web::{web, HttpRequest, HttpResponse};
use quantmesh_telemetry::runbooks;

mod admin;
mod door;
mod generate;

use admin::{get_config, get_fallback, get_mask, reload_config, set_fallback};
use door::{check_api_key, now_secs};
pub use door::{read_request_body, take_permit};
use generate::generate;

pub fn configure(cfg: &mut web::ServiceConfig) {
    cfg.route("/health", web::get().to(health))
        .route("/ready", web::get().to(ready))
        .route("/metrics", web::get().to(metrics))
        .route(runbooks::PATH, web::get().to(runbooks_page))
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

/// `GET /runbooks`: the alerts' runbooks, as every quantmesh process serves them.
pub async fn runbooks_page() -> HttpResponse {
    HttpResponse::Ok()
        .content_type(runbooks::CONTENT_TYPE)
        .body(runbooks::html())
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
