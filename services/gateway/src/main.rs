//! `quantmesh-gateway`: the gateway role on its own (the same as `quantmesh gateway`): the
//! OpenAI API in front of engine processes (`quantmesh engine`) reached over HTTP.

use clap::Parser;

#[derive(Parser)]
#[command(
    version,
    about = "quantmesh gateway: the OpenAI API in front of quantmesh engines (--engine URL or dns+http://NAME:PORT, repeatable)"
)]
struct Args {
    #[command(flatten)]
    flags: quantmesh_settings::GatewayFlags,
}

fn main() -> anyhow::Result<()> {
    quantmesh_gateway::gateway_main(&Args::parse().flags)
}
