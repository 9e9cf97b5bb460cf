//! One telemetry init for every binary: human-readable or JSON logs via `tracing`, and —
//! when an OTLP endpoint is configured — trace export through OpenTelemetry.
//!
//! Traces are `tracing` spans turned into OpenTelemetry spans by `tracing-opentelemetry`
//! (spans of target [`TRACE_TARGET`] only; the log never shows them). Export runs on the
//! SDK's batch thread with a bounded queue: serving never waits for the collector, and a dead
//! collector costs a failed export, counted in `quantmesh_otel_export_failures_total`. Without
//! an endpoint no span is created at all (one branch per request; see [`enabled`]).
//!
//! Configuration follows the OpenTelemetry variables, which win over the `[telemetry]`
//! section of the config file: `OTEL_EXPORTER_OTLP_ENDPOINT` (or `…_TRACES_ENDPOINT`),
//! `OTEL_EXPORTER_OTLP_PROTOCOL` (`grpc`, `http/protobuf`), `OTEL_SERVICE_NAME`,
//! `OTEL_RESOURCE_ATTRIBUTES`, `OTEL_TRACES_SAMPLER[_ARG]`, `OTEL_BSP_*`.

pub mod runbooks;

use opentelemetry::propagation::{Extractor, Injector, TextMapPropagator};
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_otlp::WithExportConfig;
#[cfg(feature = "otlp-tls")]
use opentelemetry_otlp::{WithHttpConfig, WithTonicConfig};
use opentelemetry_sdk::error::OTelSdkResult;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::{SdkTracerProvider, SpanData, SpanExporter};
use prometheus::IntCounterVec;
use quantmesh_settings::{LogFormat, OtlpProtocol, TelemetrySettings};
use quantmesh_types::trace::{TraceHook, TARGET as TRACE_TARGET};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::OnceLock;
use tracing_opentelemetry::OpenTelemetrySpanExt;
use tracing_subscriber::filter::{filter_fn, EnvFilter, Targets};
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::Layer;

static ENABLED: AtomicBool = AtomicBool::new(false);

/// Whether traces are exported (an OTLP endpoint is configured and the exporter started).
/// Callers create trace spans only when this is true.
pub fn enabled() -> bool {
    ENABLED.load(Ordering::Relaxed)
}

/// A metric built from a static definition. Definitions are constants, so a failure is a
/// programming error that the tests catch.
pub fn must<T>(r: prometheus::Result<T>) -> T {
    r.unwrap_or_else(|e| panic!("invalid metric definition: {e}"))
}

/// Export outcomes; the HTTP server registers them into its registry.
pub fn export_counters() -> &'static IntCounterVec {
    static C: OnceLock<IntCounterVec> = OnceLock::new();
    C.get_or_init(|| {
        let c = must(IntCounterVec::new(
            prometheus::Opts::new(
                "quantmesh_otel_spans_total",
                "Spans handed to the OTLP exporter, by outcome (exported, failed: the collector \
                 refused or could not be reached; the batch is dropped, serving is unaffected).",
            ),
            &["outcome"],
        ));
        for o in ["exported", "failed"] {
            c.with_label_values(&[o]);
        }
        c
    })
}

/// Keeps the exporter alive; [`Telemetry::shutdown`] flushes what is queued.
#[derive(Default)]
pub struct Telemetry {
    provider: Option<SdkTracerProvider>,
}

/// The hook the engine uses to stamp events with a span's `traceparent` (`None` when
/// traces are off).
pub fn trace_hook() -> Option<TraceHook> {
    enabled().then(|| TraceHook::new(traceparent))
}

impl Telemetry {
    /// Flush queued spans (bounded by the exporter's timeout) and stop the exporter.
    pub fn shutdown(&mut self) {
        if let Some(p) = self.provider.take() {
            ENABLED.store(false, Ordering::Relaxed);
            if let Err(e) = p.shutdown() {
                tracing::warn!(error = %e, "flushing traces at shutdown failed");
            }
        }
    }
}

impl Drop for Telemetry {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// Logs only (command-line tools).
pub fn init(format: LogFormat, level: &str) {
    let _ = init_with(format, level, &TelemetrySettings::default());
}

/// Logs, and traces when `otel` (the `[telemetry]` settings, `OTEL_*` variables applied)
/// names an endpoint.
/// Returns the guard that owns the exporter; an exporter that cannot be built is logged and
/// traces stay off (serving does not depend on them).
pub fn init_with(format: LogFormat, level: &str, otel: &TelemetrySettings) -> Telemetry {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(level));
    // Trace spans are for the exporter; the log leaves them out.
    let not_trace = filter_fn(|m| m.target() != TRACE_TARGET);
    // Colour only for a person at a terminal: no escape codes in files, pipes or a
    // container's log driver.
    let fmt = tracing_subscriber::fmt::layer()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()));
    let fmt = match format {
        LogFormat::Json => fmt
            .json()
            .with_current_span(true)
            .with_span_list(false)
            .with_filter(filter)
            .with_filter(not_trace)
            .boxed(),
        LogFormat::Text => fmt.with_filter(filter).with_filter(not_trace).boxed(),
    };
    let settings = otel;
    let (provider, error) = match settings.otlp_endpoint.is_some() {
        true => match build_provider(settings) {
            Ok(p) => (Some(p), None),
            Err(e) => (None, Some(e)),
        },
        false => (None, None),
    };
    let otel_layer = provider.as_ref().map(|p| {
        tracing_opentelemetry::layer()
            .with_tracer(p.tracer("quantmesh"))
            // Busy/idle times and source locations are not worth their cost per span.
            .with_tracked_inactivity(false)
            .with_location(false)
            .with_filter(Targets::new().with_target(TRACE_TARGET, tracing::Level::INFO))
    });
    let installed = tracing_subscriber::registry()
        .with(fmt)
        .with(otel_layer)
        .try_init()
        .is_ok();
    if let Some(e) = error {
        tracing::error!(error = %e, "the OTLP trace exporter could not be built: traces are off");
    }
    match (provider, installed) {
        (Some(p), true) => {
            ENABLED.store(true, Ordering::Relaxed);
            tracing::info!(
                endpoint = settings.otlp_endpoint.as_deref().unwrap_or(""),
                protocol = settings.otlp_protocol.as_str(),
                service = settings.service_name,
                "exporting traces over OTLP"
            );
            Telemetry { provider: Some(p) }
        }
        _ => Telemetry::default(),
    }
}

fn build_provider(s: &TelemetrySettings) -> anyhow::Result<SdkTracerProvider> {
    let endpoint = s.otlp_endpoint.clone().unwrap_or_default();
    let https = endpoint.starts_with("https://");
    if let (Some(ca), false) = (&s.otlp_certificate, https) {
        anyhow::bail!(
            "an OTLP certificate ({}) is set but the endpoint {endpoint} is not https://",
            ca.display()
        );
    }
    if https && !cfg!(feature = "otlp-tls") {
        anyhow::bail!(
            "the OTLP endpoint {endpoint} is https:// but this build has no TLS for OTLP: build quantmesh with the `otlp-tls` feature (the container image has it), or use an http:// collector"
        );
    }
    // Built before entering the exporter's runtime: a blocking HTTP client must not be made
    // inside one.
    #[cfg(feature = "otlp-tls")]
    let http_client = match (s.otlp_protocol, https) {
        (OtlpProtocol::HttpProtobuf, true) => Some(tls::http_client(s)?),
        _ => None,
    };
    // The exporters' transports (tonic, hyper) need a Tokio reactor; the SDK's batch thread
    // has none. This small runtime is theirs alone, so export never touches the serving
    // threads.
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .thread_name("qm-otlp")
        .enable_all()
        .build()?;
    let exporter = {
        let _in_runtime = runtime.enter();
        match s.otlp_protocol {
            OtlpProtocol::Grpc => {
                let builder = opentelemetry_otlp::SpanExporter::builder()
                    .with_tonic()
                    .with_endpoint(endpoint);
                #[cfg(feature = "otlp-tls")]
                let builder = match https {
                    true => builder.with_tls_config(tls::grpc_config(s)?),
                    false => builder,
                };
                builder.build()?
            }
            OtlpProtocol::HttpProtobuf => {
                let builder = opentelemetry_otlp::SpanExporter::builder()
                    .with_http()
                    .with_endpoint(http_traces_url(&endpoint));
                #[cfg(feature = "otlp-tls")]
                let builder = match http_client {
                    Some(client) => builder.with_http_client(client),
                    None => builder,
                };
                builder.build()?
            }
        }
    };
    let resource = opentelemetry_sdk::Resource::builder()
        .with_service_name(s.service_name.clone())
        .build();
    Ok(SdkTracerProvider::builder()
        .with_batch_exporter(CountingExporter {
            inner: exporter,
            runtime,
        })
        .with_resource(resource)
        .build())
}

/// TLS to an `https://` collector: the system's roots, plus the CA of
/// `OTEL_EXPORTER_OTLP_CERTIFICATE` (`telemetry.otlp_certificate`) when given.
#[cfg(feature = "otlp-tls")]
mod tls {
    use super::TelemetrySettings;
    use anyhow::Context;
    use opentelemetry_otlp::tonic_types::transport::{Certificate, ClientTlsConfig};

    fn ca_pem(s: &TelemetrySettings) -> anyhow::Result<Option<Vec<u8>>> {
        s.otlp_certificate
            .as_ref()
            .map(|p| {
                std::fs::read(p)
                    .with_context(|| format!("reading the OTLP certificate {}", p.display()))
            })
            .transpose()
    }

    pub(super) fn grpc_config(s: &TelemetrySettings) -> anyhow::Result<ClientTlsConfig> {
        let config = ClientTlsConfig::new().with_native_roots();
        Ok(match ca_pem(s)? {
            Some(pem) => config.ca_certificate(Certificate::from_pem(pem)),
            None => config,
        })
    }

    pub(super) fn http_client(s: &TelemetrySettings) -> anyhow::Result<reqwest::blocking::Client> {
        let pem = ca_pem(s)?;
        // reqwest's blocking client owns a runtime of its own: made on a plain thread.
        std::thread::spawn(move || {
            let mut builder = reqwest::blocking::Client::builder();
            if let Some(pem) = pem {
                let ca = reqwest::Certificate::from_pem(&pem)
                    .context("the OTLP certificate is not a PEM certificate")?;
                builder = builder.add_root_certificate(ca);
            }
            builder.build().context("building the OTLP HTTP client")
        })
        .join()
        .map_err(|_| anyhow::anyhow!("building the OTLP HTTP client panicked"))?
    }
}

/// OTLP/HTTP wants the signal's path: a base URL (as `OTEL_EXPORTER_OTLP_ENDPOINT` is) gets
/// `/v1/traces` appended.
fn http_traces_url(endpoint: &str) -> String {
    match endpoint.trim_end_matches('/') {
        e if e.ends_with("/v1/traces") => e.to_string(),
        e => format!("{e}/v1/traces"),
    }
}

/// Runs the real exporter inside its own runtime and counts what became of each batch.
#[derive(Debug)]
struct CountingExporter {
    inner: opentelemetry_otlp::SpanExporter,
    runtime: tokio::runtime::Runtime,
}

impl SpanExporter for CountingExporter {
    async fn export(&self, batch: Vec<SpanData>) -> OTelSdkResult {
        let n = batch.len() as u64;
        let result = InRuntime {
            handle: self.runtime.handle().clone(),
            fut: std::pin::pin!(self.inner.export(batch)),
        }
        .await;
        let outcome = if result.is_ok() { "exported" } else { "failed" };
        export_counters().with_label_values(&[outcome]).inc_by(n);
        result
    }

    fn shutdown_with_timeout(&self, timeout: std::time::Duration) -> OTelSdkResult {
        let _in_runtime = self.runtime.enter();
        self.inner.shutdown_with_timeout(timeout)
    }

    fn force_flush(&self) -> OTelSdkResult {
        self.inner.force_flush()
    }

    fn set_resource(&mut self, resource: &opentelemetry_sdk::Resource) {
        self.inner.set_resource(resource);
    }
}

/// Polls a future with a Tokio runtime entered, so the I/O it creates registers with that
/// runtime's reactor (driven by the runtime's own thread).
struct InRuntime<F> {
    handle: tokio::runtime::Handle,
    fut: F,
}

impl<F: std::future::Future + Unpin> std::future::Future for InRuntime<F> {
    type Output = F::Output;
    fn poll(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<F::Output> {
        let _in_runtime = self.handle.enter();
        std::pin::Pin::new(&mut self.fut).poll(cx)
    }
}

/// The W3C `traceparent` of a span (`None` when it has no valid trace context).
pub fn traceparent(span: &tracing::Span) -> Option<String> {
    let cx = span.context();
    let mut carrier = Carrier::default();
    TraceContextPropagator::new().inject_context(&cx, &mut carrier);
    carrier.traceparent
}

/// Make `span` a child of the W3C trace context of a request (its `traceparent` and
/// `tracestate` headers), when there is a valid one.
pub fn set_remote_parent(
    span: &tracing::Span,
    traceparent: Option<&str>,
    tracestate: Option<&str>,
) {
    let cx = TraceContextPropagator::new().extract(&Headers {
        traceparent,
        tracestate,
    });
    use opentelemetry::trace::TraceContextExt;
    if cx.span().span_context().is_valid() {
        let _ = span.set_parent(cx);
    }
}

#[derive(Default)]
struct Carrier {
    traceparent: Option<String>,
}

impl Injector for Carrier {
    fn set(&mut self, key: &str, value: String) {
        if key == "traceparent" {
            self.traceparent = Some(value);
        }
    }
}

/// The trace-context headers of a request.
struct Headers<'a> {
    traceparent: Option<&'a str>,
    tracestate: Option<&'a str>,
}

impl Extractor for Headers<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        match key {
            "traceparent" => self.traceparent,
            "tracestate" => self.tracestate,
            _ => None,
        }
    }
    fn keys(&self) -> Vec<&str> {
        vec!["traceparent", "tracestate"]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn http_endpoint_gets_the_signal_path_once() {
        assert_eq!(http_traces_url("http://c:4318"), "http://c:4318/v1/traces");
        assert_eq!(http_traces_url("http://c:4318/"), "http://c:4318/v1/traces");
        assert_eq!(
            http_traces_url("http://c:4318/v1/traces"),
            "http://c:4318/v1/traces"
        );
    }
}
