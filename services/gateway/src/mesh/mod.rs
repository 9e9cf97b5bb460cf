//! The gateway role of the microservice mesh (`quantmesh gateway`): the OpenAI API in front
//! of engine processes (`quantmesh engine`), reached over HTTP.
//!
//! ```text
//! client ──HTTP──▶ gateway: auth, body limit, routing ──HTTP (streaming)──▶ engine-1
//!                    │  one EngineClient actor per engine (bounded mailbox,     engine-2
//!                    │  health check on /ready every `health_interval`)          …
//!                    └─ /admin/* fans out to every engine, answers labelled by engine
//! ```
//!
//! Routing (`route.rs`): among engines that are up and below `max_outstanding`, the least
//! outstanding — unless the request's prefix was last sent to an engine that is at most
//! `affinity_slack` requests busier, which then gets it (its prefix cache likely holds the
//! prompt's first KV pages); a request sent elsewhere because its home was busy does not move
//! the prefix's home. Another engine gets a request only when the engine did not take it
//! and nothing of its answer arrived (connection refused or closed before the answer, 503,
//! 429); an engine's 500 or 4xx is passed on as it is, an answer that breaks off is a 502,
//! and every wait is bounded (`client::bounded`: connect, first byte, idle between chunks,
//! the whole request, and an engine stall seen by the health checks → 504 `engine_timeout`;
//! a stream that had started ends with an error event). Engines failing in a row are
//! ejected for a while (`Mesh::failed`). Every engine saturated: 429; none up: 503.
//! Engines come from config (`http://engine-1:8080`) or from DNS (`dns+http://engine:8080`:
//! every address the name resolves to, re-resolved every `discovery_interval`;
//! `discovery.rs`). The engines' internal API is the versioned OpenAI `/v1` API they serve themselves
//! (documented by their `/openapi.json`), plus `/ready`, `/metrics` and `/admin/*`.

pub mod client;
pub mod discovery;
pub mod http;
pub mod metrics;
pub mod route;

pub use quantmesh_settings::mesh::{MeshSettings, Routing};
