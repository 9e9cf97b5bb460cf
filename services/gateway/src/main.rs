//! `quantmesh-gateway`: the gateway service on its own. Until the microservice mode lands
//! (gateway and engines as separate processes), it hosts the engine in-process exactly
//! like `quantmesh serve`; this binary is the seam where the remote-engine client plugs in.

use clap::Parser;

#[derive(Parser)]
#[command(
    version,
    about = "quantmesh gateway: OpenAI-compatible HTTP API (engine in-process for now)"
)]
struct Args {
    #[command(flatten)]
    flags: quantmesh_gateway::ServeFlags,
}

fn main() -> anyhow::Result<()> {
    quantmesh_gateway::serve_main(&Args::parse().flags)
}
