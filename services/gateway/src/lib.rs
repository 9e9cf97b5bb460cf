//! quantmesh gateway: the mesh role (`quantmesh gateway`) — the OpenAI API in front of
//! engine processes reached over HTTP, with routing, health checks, DNS discovery and the
//! admin fan-out. Its front door (auth, limits, errors, request spans) is the server's.

pub mod mesh;

use anyhow::Context;
use quantmesh_server::shutdown_signal;
use std::net::TcpListener;

pub use mesh::http::run_gateway;

/// `quantmesh gateway`: settings from flags, telemetry, bind, route to the engines until
/// SIGINT/SIGTERM, drain.
pub fn gateway_main(flags: &quantmesh_settings::GatewayFlags) -> anyhow::Result<()> {
    let s = flags.settings()?;
    let mut telemetry = quantmesh_telemetry::init_with(s.log.format, &s.log.level, &s.telemetry);
    let listener = TcpListener::bind((s.server.host.as_str(), s.server.port))
        .with_context(|| format!("binding {}:{}", s.server.host, s.server.port))?;
    let served = actix_rt::System::new().block_on(run_gateway(s, listener, shutdown_signal()));
    telemetry.shutdown();
    served
}
