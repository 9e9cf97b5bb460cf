//! The front door every route shares: keys, the body limit, admission permits, the request's
//! span.

use crate::auth;
use crate::error::{parse_json, ApiError};
use crate::request_trace::ServerSpan;
use crate::state::AppState;
use actix_web::{web, HttpRequest};
use bytes::Bytes;
use futures::StreamExt;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

pub(super) fn now_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

pub(super) fn check_api_key(req: &HttpRequest, state: &AppState) -> Result<(), ApiError> {
    auth::api_key(req, &state.server.api_keys)
}

pub(super) fn check_admin(req: &HttpRequest, state: &AppState) -> Result<(), ApiError> {
    auth::admin(req, state.admin_token.as_deref())
}

/// The request's server span, when traces are exported.
pub(super) fn server_span(req: &HttpRequest) -> Option<ServerSpan> {
    use actix_web::HttpMessage;
    req.extensions().get::<ServerSpan>().cloned()
}

/// Read the body with the configured limit (413 beyond it).
pub(super) async fn read_body(mut payload: web::Payload, limit: usize) -> Result<Bytes, ApiError> {
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
pub(super) async fn json_body<T: serde::de::DeserializeOwned>(
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
pub(super) fn admit(state: &AppState) -> Result<OwnedSemaphorePermit, ApiError> {
    state.engine()?;
    take_permit(&state.admission, state.server.max_concurrent_requests)
}
