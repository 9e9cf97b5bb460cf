//! quantmesh gateway: the OpenAI-compatible HTTP API in front of the engine.

pub mod auth;
pub mod error;
pub mod first_plan;
pub mod logprobs;
pub mod mesh;
pub mod metrics;
pub mod model_source;
pub mod openai;
pub mod openapi;
pub mod request_trace;
pub mod routes;
pub mod server;
pub mod settings;
pub mod signals;
pub mod state;
pub mod telemetry;

pub use mesh::http::run_gateway;
pub use server::{gateway_main, run_embedded, serve_main};
pub use settings::{GatewayFlags, LogFormat, ServeFlags, Settings};
pub use signals::shutdown_signal;
