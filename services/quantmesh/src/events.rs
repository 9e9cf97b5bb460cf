//! `quantmesh events …`: read the event topics.

use clap::Subcommand;
use std::path::PathBuf;

#[derive(Subcommand)]
pub enum EventsCommand {
    /// Print fallback events (or config events) from Kafka as JSON lines or a table.
    ///
    /// JSON lines are the payloads exactly as published (schema:
    /// shared/schemas/fallback_event.v1.schema.json); pipe them to jq. Without --group an
    /// ephemeral consumer group is used and nothing is committed; with --group the offsets
    /// are committed, so the next run continues where this one stopped.
    Tail(TailArgs),
}

#[derive(clap::Args)]
pub struct TailArgs {
    /// Kafka bootstrap brokers, HOST:PORT[,…] [default: kafka.brokers from --config].
    #[arg(long, env = "QUANTMESH_KAFKA_BROKERS")]
    brokers: Option<String>,
    /// quantmesh TOML config whose [kafka] section to use (topics, librdkafka properties).
    #[arg(long, env = "QUANTMESH_CONFIG")]
    config: Option<PathBuf>,
    /// Topic to read [default: kafka.topic, or kafka.config_topic with --config-events].
    #[arg(long)]
    topic: Option<String>,
    /// Read configuration events (reload applied / rejected / failed) instead.
    #[arg(long)]
    config_events: bool,
    /// Start at the oldest retained event, not only new ones.
    #[arg(long)]
    from_beginning: bool,
    /// Consumer group (offsets committed). Default: an ephemeral group.
    #[arg(long)]
    group: Option<String>,
    /// Output format.
    #[arg(long, value_enum, default_value = "json")]
    format: TailFormatArg,
    /// Exit after this many events.
    #[arg(long)]
    limit: Option<u64>,
    /// Exit when no event arrived for this long (e.g. `10s`). Default: run until Ctrl-C.
    #[arg(long, value_parser = humantime::parse_duration)]
    idle_timeout: Option<std::time::Duration>,
}

#[derive(Clone, Copy, clap::ValueEnum)]
pub enum TailFormatArg {
    Json,
    Table,
}

/// Run an `events` subcommand.
pub fn run(cmd: EventsCommand) -> anyhow::Result<()> {
    match cmd {
        EventsCommand::Tail(args) => tail_cmd(args),
    }
}

fn tail_cmd(args: TailArgs) -> anyhow::Result<()> {
    use quantmesh_kafka::tail::{tail, TailFormat, TailOptions};
    quantmesh_telemetry::init(quantmesh_settings::LogFormat::Text, "warn");
    let mut settings = quantmesh_settings::Settings::load(args.config.as_deref())?.kafka;
    if let Some(b) = args.brokers {
        settings.brokers = b;
    }
    anyhow::ensure!(
        settings.enabled(),
        "no Kafka brokers: pass --brokers HOST:PORT, set QUANTMESH_KAFKA_BROKERS, or kafka.brokers in --config"
    );
    if let Some(t) = args.topic {
        if args.config_events {
            settings.config_topic = t;
        } else {
            settings.topic = t;
        }
    }
    let opts = TailOptions {
        settings,
        group: args.group,
        from_beginning: args.from_beginning,
        config_events: args.config_events,
        format: match args.format {
            TailFormatArg::Json => TailFormat::Json,
            TailFormatArg::Table => TailFormat::Table,
        },
        limit: args.limit,
        idle_timeout: args.idle_timeout,
    };
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(async {
        let stdout = std::io::stdout();
        let mut out = stdout.lock();
        tokio::select! {
            r = tail(&opts, &mut out) => {
                let n = r?;
                tracing::info!(events = n, "done");
            }
            _ = tokio::signal::ctrl_c() => {}
        }
        anyhow::Ok(())
    })
}
