//! The gateway's error boundary: every failure becomes an OpenAI-shaped JSON body with
//! the right status, through one exhaustive match.

use actix_web::http::StatusCode;
use actix_web::{HttpResponse, ResponseError};
use quantmesh_engine::api::{EngineError, ModelError};
use schemars::JsonSchema;
use serde::Serialize;

#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    #[error("{0}")]
    BadRequest(String),
    #[error("{0}")]
    Unprocessable(String),
    /// A request field whose value is out of its range.
    #[error("{message}")]
    InvalidValue { param: String, message: String },
    /// A request field that is not supported (or not known): never silently ignored.
    #[error("{message}")]
    UnsupportedParam { param: String, message: String },
    #[error("request body is larger than the limit of {limit} bytes")]
    PayloadTooLarge { limit: usize },
    #[error("{0}")]
    Unauthorized(String),
    #[error("{0}")]
    Forbidden(String),
    #[error("the model {0:?} does not exist; see GET /v1/models")]
    ModelNotFound(String),
    #[error("{0}")]
    NotFound(String),
    #[error("method {method} is not allowed here; allowed: {allow}")]
    MethodNotAllowed { method: String, allow: String },
    #[error("server overloaded: {0}; retry later")]
    Overloaded(String),
    #[error("the model is still loading")]
    NotReady,
    #[error("the server is shutting down")]
    ShuttingDown,
    /// The engine is loaded but cannot serve (an actor has stopped).
    #[error("the engine cannot serve: {0}")]
    Unavailable(String),
    #[error("internal error: {0}")]
    Internal(String),
    /// The gateway's engine failed after it had begun answering (the answer broke off).
    #[error("{0}")]
    BadGateway(String),
    /// The gateway's engine did not answer within a deadline, or stalled.
    #[error("{0}")]
    EngineTimeout(String),
}

impl ApiError {
    /// The request field at fault, when one is.
    fn param(&self) -> Option<&str> {
        match self {
            ApiError::UnsupportedParam { param, .. } | ApiError::InvalidValue { param, .. } => {
                Some(param)
            }
            _ => None,
        }
    }

    /// Stable machine-readable (type, code).
    fn kind(&self) -> (&'static str, &'static str) {
        match self {
            ApiError::BadRequest(_) => ("invalid_request_error", "invalid_request"),
            ApiError::Unprocessable(_) => ("invalid_request_error", "invalid_type"),
            ApiError::UnsupportedParam { .. } => ("invalid_request_error", "unsupported_parameter"),
            ApiError::InvalidValue { .. } => ("invalid_request_error", "invalid_value"),
            ApiError::PayloadTooLarge { .. } => ("invalid_request_error", "payload_too_large"),
            ApiError::Unauthorized(_) => ("authentication_error", "invalid_api_key"),
            ApiError::Forbidden(_) => ("permission_error", "forbidden"),
            ApiError::ModelNotFound(_) => ("invalid_request_error", "model_not_found"),
            ApiError::NotFound(_) => ("invalid_request_error", "not_found"),
            ApiError::MethodNotAllowed { .. } => ("invalid_request_error", "method_not_allowed"),
            ApiError::Overloaded(_) => ("rate_limit_error", "overloaded"),
            ApiError::NotReady => ("service_unavailable", "model_loading"),
            ApiError::ShuttingDown => ("service_unavailable", "shutting_down"),
            ApiError::Unavailable(_) => ("service_unavailable", "engine_unavailable"),
            ApiError::Internal(_) => ("server_error", "internal_error"),
            ApiError::BadGateway(_) => ("server_error", "engine_failed"),
            ApiError::EngineTimeout(_) => ("server_error", "engine_timeout"),
        }
    }
}

impl ResponseError for ApiError {
    fn status_code(&self) -> StatusCode {
        match self {
            ApiError::BadRequest(_)
            | ApiError::UnsupportedParam { .. }
            | ApiError::InvalidValue { .. } => StatusCode::BAD_REQUEST,
            ApiError::Unprocessable(_) => StatusCode::UNPROCESSABLE_ENTITY,
            ApiError::PayloadTooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            ApiError::Unauthorized(_) => StatusCode::UNAUTHORIZED,
            ApiError::Forbidden(_) => StatusCode::FORBIDDEN,
            ApiError::ModelNotFound(_) | ApiError::NotFound(_) => StatusCode::NOT_FOUND,
            ApiError::MethodNotAllowed { .. } => StatusCode::METHOD_NOT_ALLOWED,
            ApiError::Overloaded(_) => StatusCode::TOO_MANY_REQUESTS,
            ApiError::NotReady | ApiError::ShuttingDown | ApiError::Unavailable(_) => {
                StatusCode::SERVICE_UNAVAILABLE
            }
            ApiError::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
            ApiError::BadGateway(_) => StatusCode::BAD_GATEWAY,
            ApiError::EngineTimeout(_) => StatusCode::GATEWAY_TIMEOUT,
        }
    }

    fn error_response(&self) -> HttpResponse {
        let (kind, code) = self.kind();
        let mut response = HttpResponse::build(self.status_code());
        if let ApiError::MethodNotAllowed { allow, .. } = self {
            response.insert_header((actix_web::http::header::ALLOW, allow.as_str()));
        }
        response.json(ErrorBody {
            error: ErrorDetail {
                message: self.to_string(),
                kind,
                code,
                param: self.param().map(str::to_string),
            },
        })
    }
}

impl From<EngineError> for ApiError {
    fn from(e: EngineError) -> Self {
        match e {
            EngineError::InvalidRequest(m) => ApiError::BadRequest(m),
            EngineError::InvalidParam { param, message } => ApiError::InvalidValue {
                param: param.into(),
                message,
            },
            EngineError::Overloaded(m) => ApiError::Overloaded(m),
            EngineError::Stopped => ApiError::ShuttingDown,
            EngineError::Model(ModelError::Tokenizer(m)) => {
                ApiError::BadRequest(format!("tokenization failed: {m}"))
            }
            EngineError::Model(ModelError::InvalidInput(m)) => ApiError::BadRequest(m),
            e @ (EngineError::Model(_)
            | EngineError::Config(_)
            | EngineError::OverBudget(_)
            | EngineError::Tensor(_)
            | EngineError::Kernel(_)
            | EngineError::StepPanicked(_)) => ApiError::Internal(e.to_string()),
        }
    }
}

/// Parse a JSON body with precise errors: invalid UTF-8 and syntax errors → 400, wrong
/// types or missing fields → 422.
pub fn parse_json<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    let text = std::str::from_utf8(body)
        .map_err(|e| ApiError::BadRequest(format!("request body is not valid UTF-8: {e}")))?;
    if text.trim().is_empty() {
        return Err(ApiError::BadRequest(
            "request body is empty; expected a JSON object".into(),
        ));
    }
    serde_json::from_str(text).map_err(|e| match e.classify() {
        serde_json::error::Category::Data => {
            ApiError::Unprocessable(format!("invalid request: {e}"))
        }
        serde_json::error::Category::Syntax
        | serde_json::error::Category::Eof
        | serde_json::error::Category::Io => ApiError::BadRequest(format!("malformed JSON: {e}")),
    })
}

/// Every error, in OpenAI's shape.
#[derive(Debug, Clone, Serialize, JsonSchema)]
pub struct ErrorBody {
    pub error: ErrorDetail,
}

#[derive(Debug, Clone, Serialize, JsonSchema)]
pub struct ErrorDetail {
    pub message: String,
    /// `invalid_request_error`, `authentication_error`, `permission_error`,
    /// `rate_limit_error`, `service_unavailable` or `server_error`.
    #[serde(rename = "type")]
    pub kind: &'static str,
    /// Stable machine-readable code, e.g. `unsupported_parameter`.
    pub code: &'static str,
    /// The request field at fault, when one is.
    pub param: Option<String>,
}
