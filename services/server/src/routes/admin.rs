//! The admin routes (admin token): the live mask, the monitor's state, forced fallbacks,
//! the plan in force and its reload.

use super::door::*;
use crate::error::ApiError;
use crate::state::AppState;
use actix_web::http::StatusCode;
use actix_web::{web, HttpRequest, HttpResponse};
use quantmesh_engine::api::{ForceMode, ReloadOutcome};
use quantmesh_types::GroupId;
use serde_json::json;

pub(super) async fn get_mask(
    req: HttpRequest,
    state: web::Data<AppState>,
) -> Result<HttpResponse, ApiError> {
    check_admin(&req, &state)?;
    let m = state.engine()?.mask();
    Ok(HttpResponse::Ok().json(json!({
        "version": m.version,
        "float_groups": m.float_groups.iter().map(|g| g.to_string()).collect::<Vec<_>>(),
        "kv_float_layers": m.kv_float_layers,
        "float_requests": m.float_requests.len(),
        "float_batch": m.float_batch,
    })))
}

/// Every group's monitor state: mode, window rate, mean, σ, k, excluded channels, reason.
pub(super) async fn get_fallback(
    req: HttpRequest,
    state: web::Data<AppState>,
) -> Result<HttpResponse, ApiError> {
    check_admin(&req, &state)?;
    let report = state.engine()?.monitor_report().ok_or_else(|| {
        ApiError::BadRequest(
            "the activation monitor is disabled (engine.monitor.enabled = false)".into(),
        )
    })?;
    Ok(HttpResponse::Ok().json(report))
}

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct FallbackBody {
    /// Like `layers.1.down`.
    group: String,
    /// `float`, `int8` or `auto`.
    mode: ForceMode,
}

/// Force a group to float or INT8, or hand it back to the monitor (`auto`).
pub(super) async fn set_fallback(
    req: HttpRequest,
    payload: web::Payload,
    state: web::Data<AppState>,
) -> Result<HttpResponse, ApiError> {
    check_admin(&req, &state)?;
    let b: FallbackBody = json_body(&req, payload, &state).await?;
    let group: GroupId = b.group.parse().map_err(ApiError::BadRequest)?;
    let engine = state.engine()?;
    let layers = engine.info().config.num_hidden_layers;
    if group.layer >= layers {
        return Err(ApiError::BadRequest(format!(
            "{group}: the model has {layers} layers"
        )));
    }
    let span = server_span(&req).map(|s| s.0);
    let event_ids = engine.force_group_traced(group, b.mode, span).await?;
    Ok(HttpResponse::Ok()
        .json(json!({"group": group.to_string(), "mode": b.mode, "event_ids": event_ids})))
}

/// The hot-reload state: source, md5 in force, counters, live thresholds and residencies.
pub(super) async fn get_config(
    req: HttpRequest,
    state: web::Data<AppState>,
) -> Result<HttpResponse, ApiError> {
    check_admin(&req, &state)?;
    Ok(HttpResponse::Ok().json(state.engine()?.config_status()))
}

/// Reload sensitive_layers.json now. 200 applied/unchanged, 422 rejected (the old version
/// stays), 502 source unreadable, 500 valid but could not be applied.
pub(super) async fn reload_config(
    req: HttpRequest,
    state: web::Data<AppState>,
) -> Result<HttpResponse, ApiError> {
    check_admin(&req, &state)?;
    let span = server_span(&req).map(|s| s.0);
    let outcome = state.engine()?.reload_config_traced(span).await?;
    let status = match &outcome {
        ReloadOutcome::Applied { .. } | ReloadOutcome::Unchanged { .. } => StatusCode::OK,
        ReloadOutcome::Rejected { .. } => StatusCode::UNPROCESSABLE_ENTITY,
        ReloadOutcome::FetchFailed { .. } => StatusCode::BAD_GATEWAY,
        ReloadOutcome::Failed { .. } => StatusCode::INTERNAL_SERVER_ERROR,
        ReloadOutcome::Settling | ReloadOutcome::Busy => StatusCode::CONFLICT,
    };
    Ok(HttpResponse::build(status).json(outcome))
}
