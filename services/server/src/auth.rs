//! Who may call what: API keys on `/v1`, the admin token on `/admin`. Shared by the
//! embedded server and the mesh gateway.

use crate::error::ApiError;
use actix_web::HttpRequest;

/// The bearer token a request carries.
pub fn bearer(req: &HttpRequest) -> Option<&str> {
    req.headers()
        .get("authorization")?
        .to_str()
        .ok()?
        .strip_prefix("Bearer ")
        .map(str::trim)
}

/// Constant-time comparison of a secret with what a client sent.
fn secret_eq(secret: &str, sent: &str) -> bool {
    use subtle::ConstantTimeEq;
    secret.as_bytes().ct_eq(sent.as_bytes()).into()
}

/// A `/v1` call: any of `keys` (none configured: open).
pub fn api_key(req: &HttpRequest, keys: &[String]) -> Result<(), ApiError> {
    if keys.is_empty() {
        return Ok(());
    }
    match bearer(req) {
        // Every key is compared, each in constant time: timing says nothing about any key.
        Some(k) if keys.iter().fold(false, |found, a| found | secret_eq(a, k)) => Ok(()),
        Some(_) => Err(ApiError::Unauthorized("invalid API key".into())),
        None => Err(ApiError::Unauthorized(
            "missing API key: send Authorization: Bearer <key>".into(),
        )),
    }
}

/// An `/admin` call: the admin token (none configured: admin routes are off).
pub fn admin(req: &HttpRequest, token: Option<&str>) -> Result<(), ApiError> {
    let Some(token) = token else {
        return Err(ApiError::Forbidden(
            "admin routes are disabled: set QUANTMESH_ADMIN_TOKEN to enable them".into(),
        ));
    };
    match bearer(req) {
        Some(t) if secret_eq(token, t) => Ok(()),
        _ => Err(ApiError::Unauthorized(
            "admin routes need Authorization: Bearer <QUANTMESH_ADMIN_TOKEN>".into(),
        )),
    }
}
