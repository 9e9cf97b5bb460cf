//! A local OTLP/gRPC trace receiver for benchmarks (`scripts/bench-tracing.sh`): accepts
//! every span a server exports and counts them, so tracing is measured with export really
//! happening. Prints `listening http://ADDR` first, then a running span count every second.
//! Built on `fake-opentelemetry-collector` (a real OTLP gRPC server); not a product part.
//!
//! ```text
//! cargo run --release -p quantmesh --example otlp_sink
//! ```

use fake_opentelemetry_collector::FakeCollectorServer;
use std::io::Write;
use std::time::{Duration, Instant};

#[tokio::main(flavor = "multi_thread", worker_threads = 1)]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut collector = FakeCollectorServer::start().await?;
    println!("listening {}", collector.endpoint());
    std::io::stdout().flush()?;
    let mut total = 0usize;
    let mut last = Instant::now();
    loop {
        total += collector
            .exported_spans(1, Duration::from_millis(200))
            .await
            .len();
        if last.elapsed() >= Duration::from_secs(1) {
            println!("spans {total}");
            std::io::stdout().flush()?;
            last = Instant::now();
        }
    }
}
