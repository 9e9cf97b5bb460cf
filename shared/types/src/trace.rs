//! How a caller that exports traces lends the engine its trace context: the engine writes
//! spans with `tracing` alone and asks a [`TraceHook`] for a span's W3C `traceparent`.

use std::sync::Arc;
use tracing::Span;

/// The `tracing` target of every span and event the engine makes for traces. Log output
/// leaves it out (spans are for the trace exporter, not the log).
pub const TARGET: &str = "quantmesh::trace";

type TraceparentOf = dyn Fn(&Span) -> Option<String> + Send + Sync;

/// Turns a span into the W3C `traceparent` of its exported trace (`None` when it is not
/// exported). Installed by whoever owns the exporter.
#[derive(Clone)]
pub struct TraceHook(Arc<TraceparentOf>);

impl TraceHook {
    pub fn new(f: impl Fn(&Span) -> Option<String> + Send + Sync + 'static) -> Self {
        Self(Arc::new(f))
    }

    pub fn traceparent(&self, span: &Span) -> Option<String> {
        (self.0)(span)
    }
}

impl std::fmt::Debug for TraceHook {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("TraceHook")
    }
}
