//! `quantmesh-gateway`: the gateway service on its own. Until the microservice mode lands
//! (gateway and engines as separate processes), it hosts the engine in-process exactly
//! like `quantmesh serve`; this binary is the seam where the remote-engine client plugs in.

use clap::Parser;
use quantmesh_gateway::{run_embedded, settings::LogFormat, shutdown_signal, telemetry, Settings};
use std::path::PathBuf;

#[derive(Parser)]
#[command(
    version,
    about = "quantmesh gateway: OpenAI-compatible HTTP API (engine in-process for now)"
)]
struct Args {
    /// TOML config file (see infra/quantmesh.example.toml).
    #[arg(long, env = "QUANTMESH_CONFIG")]
    config: Option<PathBuf>,
    #[arg(long)]
    host: Option<String>,
    #[arg(long)]
    port: Option<u16>,
    #[arg(long)]
    model: Option<PathBuf>,
    #[arg(long, value_enum)]
    log_format: Option<LogFormat>,
}

#[actix_rt::main]
async fn main() -> anyhow::Result<()> {
    let a = Args::parse();
    let mut s = Settings::load(a.config.as_deref())?;
    if let Some(h) = a.host {
        s.server.host = h;
    }
    if let Some(p) = a.port {
        s.server.port = p;
    }
    if let Some(m) = a.model {
        s.model.dir = m;
    }
    if let Some(f) = a.log_format {
        s.log.format = f;
    }
    telemetry::init(s.log.format, &s.log.level);
    let listener = std::net::TcpListener::bind((s.server.host.as_str(), s.server.port))?;
    run_embedded(s, listener, shutdown_signal()).await
}
