//! `quantmesh`: the umbrella CLI.
//!
//! config → telemetry → build → serve → wait for a signal → drain with a timeout.

mod events;
#[cfg(feature = "evolution")]
mod evolve;
mod model;
mod plan;
mod prescreen;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "quantmesh",
    version,
    about = "Serve quantized LLMs with online INT8→FP16 fallback.",
    long_about = "quantmesh serves Llama-family models with INT8 weights and an exact float copy of the layers that\n\
                  need one, switching precision per layer, token, request or batch while it runs.\n\n\
                  Quick start:\n  quantmesh serve            # fetches SmolLM2-135M-Instruct on first run (98 MB), listens on 127.0.0.1:8080\n  \
                  curl -s localhost:8080/v1/chat/completions -H 'content-type: application/json' \\\n       \
                  -d '{\"messages\":[{\"role\":\"user\",\"content\":\"What is the capital of France?\"}],\"max_tokens\":32}'\n\n\
                  Offline (no download): quantmesh serve --model bundled:tiny   # synthetic model, random weights"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the embedded all-in-one stack: gateway and engine actors in one process.
    Serve(quantmesh_settings::ServeFlags),
    /// Run one engine for a gateway (mesh mode): the model, scheduler, executor, monitor,
    /// config reload and event outbox behind the versioned OpenAI `/v1` API, `/ready`,
    /// `/metrics` and `/admin/*`. Same flags as `serve`; `QUANTMESH_ENGINE_NAME` labels
    /// every series of its `/metrics` with `engine="<name>"`.
    Engine(quantmesh_settings::ServeFlags),
    /// Run the gateway (mesh mode): the OpenAI API, auth and limits in front of engine
    /// processes reached over HTTP; least-outstanding routing with prefix affinity, another
    /// engine tried only when one did not take the request (refused, closed before answering,
    /// 503, 429), deadlines on every wait (504 `engine_timeout`; `[mesh]` timeouts in the
    /// config file), stalled and failing engines taken out, 429 when all are saturated, admin
    /// fan-out; engines listed by URL or found by DNS (`--engine dns+http://engine:8080`).
    Gateway(quantmesh_settings::GatewayFlags),
    /// Manage model checkpoints.
    #[command(subcommand)]
    Model(model::ModelCommand),
    /// Offline pre-screen: score every linear group (R, output KL, energy, activation
    /// statistics), classify it, write sensitive_layers.json and optionally upload it.
    #[command(long_about = prescreen::PRESCREEN_HELP)]
    Prescreen(prescreen::PrescreenArgs),
    /// Check or publish a sensitive_layers.json (e.g. a merged evolution pull request).
    #[command(subcommand)]
    Plan(plan::PlanCommand),
    /// The event topics in Kafka.
    #[command(subcommand)]
    Events(events::EventsCommand),
    /// The evolution service: Kafka → Parquet lake → weekly DataFusion analysis → a new
    /// sensitive_layers.json in a pull request.
    #[cfg(feature = "evolution")]
    #[command(long_about = evolve::EVOLVE_HELP)]
    Evolve(evolve::EvolveArgs),
    /// The evolution service (not in this build: rebuild with `--features evolution`).
    #[cfg(not(feature = "evolution"))]
    #[command(disable_help_flag = true)]
    Evolve {
        #[arg(trailing_var_arg = true, allow_hyphen_values = true, hide = true)]
        args: Vec<String>,
    },
}

fn main() -> anyhow::Result<()> {
    quantmesh_engine::api::leave_the_cores_to_the_kernel_pool();
    match Cli::parse().command {
        Command::Serve(flags) | Command::Engine(flags) => quantmesh_server::serve_main(&flags),
        Command::Gateway(flags) => quantmesh_gateway::gateway_main(&flags),
        Command::Prescreen(args) => prescreen::run(args),
        Command::Events(cmd) => events::run(cmd),
        Command::Model(cmd) => model::run(cmd),
        #[cfg(feature = "evolution")]
        Command::Evolve(args) => evolve::run(args),
        #[cfg(not(feature = "evolution"))]
        Command::Evolve { .. } => anyhow::bail!(
            "this quantmesh was built without the evolution service: rebuild with \
             `cargo build --release -p quantmesh --features evolution`"
        ),
        Command::Plan(cmd) => plan::run(cmd),
    }
}
