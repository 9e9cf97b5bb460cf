//! One telemetry init for every binary: human-readable or JSON logs via `tracing`.
//! (OTLP export joins here when the tracing issue lands.)

use crate::settings::LogFormat;
use tracing_subscriber::EnvFilter;

pub fn init(format: LogFormat, level: &str) {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(level));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    let _ = match format {
        LogFormat::Json => builder
            .json()
            .with_current_span(true)
            .with_span_list(false)
            .try_init(),
        LogFormat::Text => builder.try_init(),
    };
}
