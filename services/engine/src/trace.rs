//! Request traces inside the engine, written with `tracing` alone.
//!
//! The engine never talks OpenTelemetry: the caller that owns the exporter (the gateway)
//! hands in a request's span (`GenerateRequest::trace`) and a [`TraceHook`]
//! that turns a span into its W3C `traceparent`. The engine hangs its phase spans under the
//! request's span —
//!
//! ```text
//! <request span, the caller's>
//! ├─ quantmesh.tokenize   render + encode on the tokenizer pool
//! ├─ quantmesh.queue      submitted → admitted by the scheduler
//! ├─ quantmesh.prefill    admitted → prompt computed (cached prompt tokens as an attribute)
//! └─ quantmesh.decode     prompt computed → finished: one span per answer, one `step` event
//!                         per engine step it took part in, precision decisions as events
//! ```
//!
//! — and stamps each fallback or config event with the `traceparent` of the request or of
//! the decision that made it, so a consumer of the event stream can open its trace.
//! Without a hook and a request span nothing here creates a span: a branch per request.

use tracing::Span;

pub use quantmesh_types::trace::{TraceHook, TARGET};

/// A sequence's place in its request's trace: the request's span and the phase span open
/// now (dropping it ends the phase).
#[derive(Debug)]
pub(crate) struct SeqTrace {
    request: Span,
    phase: Span,
}

impl SeqTrace {
    /// Submitted: waiting in the queue.
    pub(crate) fn queued(request: Span) -> Self {
        let phase = tracing::info_span!(target: TARGET, parent: &request, "quantmesh.queue");
        Self { request, phase }
    }

    pub(crate) fn request(&self) -> &Span {
        &self.request
    }

    /// End the phase open now (before the next one starts, so phases never overlap).
    fn end_phase(&mut self) {
        self.phase = Span::none();
    }

    /// Admitted: its prompt is being computed.
    pub(crate) fn prefilling(&mut self, prompt_tokens: usize, cached_tokens: usize) {
        self.end_phase();
        self.phase = tracing::info_span!(
            target: TARGET,
            parent: &self.request,
            "quantmesh.prefill",
            gen_ai.usage.input_tokens = prompt_tokens as i64,
            quantmesh.cached_tokens = cached_tokens as i64,
        );
    }

    /// Its prompt is computed: tokens are sampled from now on.
    pub(crate) fn decoding(&mut self, seq: u64) {
        self.end_phase();
        self.phase = Self::decode_span(&self.request, seq);
    }

    fn decode_span(request: &Span, seq: u64) -> Span {
        tracing::info_span!(
            target: TARGET,
            parent: request,
            "quantmesh.decode",
            quantmesh.seq_id = seq as i64,
            gen_ai.usage.output_tokens = tracing::field::Empty,
            gen_ai.response.finish_reason = tracing::field::Empty,
        )
    }

    /// Another answer to the same prompt (`n > 1`), decoding from the shared prompt pages.
    pub(crate) fn fork(&self, seq: u64) -> Self {
        Self {
            request: self.request.clone(),
            phase: Self::decode_span(&self.request, seq),
        }
    }

    /// One engine step this sequence took part in.
    pub(crate) fn step(&self, batch_seqs: usize, batch_tokens: usize, tokens: usize) {
        tracing::info!(
            target: TARGET,
            parent: &self.phase,
            batch_seqs = batch_seqs as i64,
            batch_tokens = batch_tokens as i64,
            tokens = tokens as i64,
            "step"
        );
    }

    /// Finished: what it produced and why it stopped (the span ends when the sequence is
    /// dropped).
    pub(crate) fn finished(&self, output_tokens: usize, reason: &str) {
        self.phase
            .record("gen_ai.usage.output_tokens", output_tokens as i64)
            .record("gen_ai.response.finish_reason", reason);
    }
}

/// The span of a decision the monitor took on its own (no request's trace): a root span,
/// ended at once, that the decision's event points to.
pub(crate) fn decision_span(ev: &quantmesh_types::FallbackEvent) -> Span {
    tracing::info_span!(
        target: TARGET,
        parent: None,
        "quantmesh.monitor.decision",
        quantmesh.model = %ev.model,
        quantmesh.group = ev.group.as_deref().unwrap_or(""),
        quantmesh.granularity = ev.granularity.as_str(),
        quantmesh.action = ev.action.as_str(),
        quantmesh.reason = ev.reason.as_str(),
    )
}

/// Record a precision decision that touched a request as an event of the request's span.
pub(crate) fn note_decision(request: &Span, ev: &quantmesh_types::FallbackEvent) {
    tracing::info!(
        target: TARGET,
        parent: request,
        group = ev.group.as_deref().unwrap_or(""),
        granularity = ev.granularity.as_str(),
        action = ev.action.as_str(),
        reason = ev.reason.as_str(),
        kl = ev.kl.unwrap_or(f64::NAN),
        "precision fallback"
    );
}
