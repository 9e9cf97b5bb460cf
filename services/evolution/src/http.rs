//! The long-running service's HTTP surface: `GET /metrics` (Prometheus text),
//! `GET /health` and `GET /runbooks` (the alerts' runbooks); anything else is a JSON 404.

use axum::http::{header, StatusCode};
use axum::response::IntoResponse;
use axum::routing::get;
use axum::Router;
use quantmesh_telemetry::runbooks;

/// The router over `registry`.
pub fn router(registry: prometheus::Registry) -> Router {
    Router::new()
        .route(
            "/metrics",
            get(move || {
                let registry = registry.clone();
                async move {
                    let mut out = Vec::new();
                    let enc = prometheus::TextEncoder::new();
                    match prometheus::Encoder::encode(&enc, &registry.gather(), &mut out) {
                        Ok(()) => (
                            StatusCode::OK,
                            [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
                            out,
                        )
                            .into_response(),
                        Err(e) => error(
                            StatusCode::INTERNAL_SERVER_ERROR,
                            "internal_error",
                            &e.to_string(),
                        ),
                    }
                }
            }),
        )
        .route(
            "/health",
            get(|| async { axum::Json(serde_json::json!({"status": "ok"})) }),
        )
        .route(
            runbooks::PATH,
            get(|| async {
                (
                    [(header::CONTENT_TYPE, runbooks::CONTENT_TYPE)],
                    runbooks::html(),
                )
            }),
        )
        .fallback(|| async { error(StatusCode::NOT_FOUND, "not_found", "not found") })
}

fn error(status: StatusCode, kind: &str, message: &str) -> axum::response::Response {
    (
        status,
        axum::Json(serde_json::json!({"error": {"message": message, "type": kind}})),
    )
        .into_response()
}

/// Serve `router` on `listener` until `stop` resolves.
pub async fn serve(
    listener: tokio::net::TcpListener,
    registry: prometheus::Registry,
    stop: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    axum::serve(listener, router(registry))
        .with_graceful_shutdown(stop)
        .await
}
