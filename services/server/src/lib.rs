//! quantmesh server: the OpenAI-compatible HTTP API of the `serve` and `engine` roles — the
//! engine in the same process, request validation, limits, auth, the HTTP metrics, request
//! spans, the first-load plan and signals. The mesh gateway (`quantmesh-gateway`) reuses its
//! front door (auth, body limit, admission, errors, request spans).

pub mod auth;
pub mod error;
pub mod first_plan;
pub mod logprobs;
pub mod metrics;
pub mod model_source;
pub mod openai;
pub mod openapi;
pub mod request_trace;
pub mod routes;
pub mod server;
pub mod signals;
pub mod state;

pub use server::{run_embedded, serve_main};
pub use signals::shutdown_signal;
