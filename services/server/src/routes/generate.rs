//! Completions and chat completions: the request's fields checked and translated, the
//! prompt prepared, the answers streamed (SSE) or gathered, their usage and timings noted.

use super::door::*;
use crate::auth::bearer;
use crate::error::ApiError;
use crate::logprobs;
use crate::openai::{
    positive_f32, AssistantMessage, ChatChoice, ChatCompletionResponse, ChatRequest,
    CompletionChoice, CompletionRequest, CompletionResponse, FinishReasonBody, SamplingFields,
    UsageBody,
};
use crate::request_trace::{GenerationTrace, ServerSpan};
use crate::state::AppState;
use actix_web::{web, HttpRequest, HttpResponse};
use bytes::Bytes;
use futures::StreamExt;
use quantmesh_engine::api::{GenerateRequest, Generation, GenerationEvent, Prompt};
use quantmesh_settings::PrefixCacheIsolation;
use quantmesh_types::{FinishReason, SamplingParams};
use serde_json::json;
use std::time::Instant;
use tokio::sync::OwnedSemaphorePermit;

/// Refuse what the request asks for and the server would not do; note the end user as a
/// hash (never the raw identifier).
fn check_fields(
    f: &SamplingFields,
    rest: &serde_json::Map<String, serde_json::Value>,
) -> Result<(), ApiError> {
    f.check_supported(rest)?;
    if let Some(user) = &f.user {
        tracing::debug!(user_md5 = %format!("{:x}", md5::compute(user)), "request from user");
    }
    Ok(())
}

/// The request's prefix-cache partition: its `cache_salt`, under its API key's partition
/// when keys are isolated. `None`: the shared partition.
fn cache_salt(
    req: &HttpRequest,
    state: &AppState,
    f: &SamplingFields,
) -> Result<Option<String>, ApiError> {
    if f.cache_salt
        .as_ref()
        .is_some_and(|s| s.is_empty() || s.chars().count() > 256)
    {
        return Err(ApiError::InvalidValue {
            param: "cache_salt".into(),
            message: "cache_salt must be 1 to 256 characters".into(),
        });
    }
    let key = match state.server.prefix_cache_isolation {
        PrefixCacheIsolation::PerApiKey => bearer(req),
        PrefixCacheIsolation::Shared => None,
    };
    Ok(match (key, &f.cache_salt) {
        (None, None) => None,
        // The key itself never leaves this function: only its hash partitions the cache.
        (Some(k), s) => Some(format!(
            "key:{:x}/{}",
            md5::compute(k),
            s.as_deref().unwrap_or("")
        )),
        (None, Some(s)) => Some(format!("salt:{s}")),
    })
}

/// Everything a generation request needs once validated.
struct Prepared {
    /// One per choice (`n`).
    generations: Vec<Generation>,
    permit: OwnedSemaphorePermit,
    arrived: Instant,
    stream: bool,
    include_usage: bool,
    /// Whether log-probabilities were asked for.
    logprobs: bool,
    /// Its spans, when traces are exported.
    trace: Option<GenerationTrace>,
}

const DEFAULT_COMPLETION_MAX_TOKENS: u32 = 16;
const DEFAULT_CHAT_MAX_TOKENS: u32 = 256;

fn sampling_params(f: &SamplingFields, endpoint: Endpoint) -> Result<SamplingParams, ApiError> {
    let default_max = match endpoint {
        Endpoint::Completions => DEFAULT_COMPLETION_MAX_TOKENS,
        Endpoint::Chat => DEFAULT_CHAT_MAX_TOKENS,
    };
    let top_k = match f.top_k {
        None | Some(0) | Some(-1) => 0,
        Some(k) if k > 0 => k as usize,
        Some(k) => {
            return Err(ApiError::BadRequest(format!(
                "top_k must be -1, 0 or positive, got {k}"
            )))
        }
    };
    let max_tokens = f
        .max_completion_tokens
        .or(f.max_tokens)
        .unwrap_or(default_max);
    let p = SamplingParams {
        temperature: f.temperature.unwrap_or(1.0),
        top_p: f.top_p.map_or(1.0, positive_f32),
        top_k,
        max_tokens: max_tokens as usize,
        stop: f.stop.clone().map(|s| s.into_vec()).unwrap_or_default(),
        seed: f.seed,
        stop_at_eos: !f.ignore_eos,
        presence_penalty: f.presence_penalty.unwrap_or(0.0),
        frequency_penalty: f.frequency_penalty.unwrap_or(0.0),
        repetition_penalty: f.repetition_penalty.map_or(1.0, positive_f32),
        logit_bias: f.logit_bias()?,
        logprobs: f.logprobs(matches!(endpoint, Endpoint::Chat))?,
    };
    Ok(p)
}

/// Translate, admit and submit a request; the engine validates and tokenizes it.
#[allow(clippy::too_many_arguments)]
async fn prepare(
    state: &AppState,
    server: Option<ServerSpan>,
    f: &SamplingFields,
    cache_salt: Option<String>,
    prompt: Prompt,
    endpoint: Endpoint,
    permit: OwnedSemaphorePermit,
    arrived: Instant,
) -> Result<Prepared, ApiError> {
    let engine = state.engine()?;
    if let Some(m) = &f.model {
        if m != &state.model_name {
            return Err(ApiError::ModelNotFound(m.clone()));
        }
    }
    let params = sampling_params(f, endpoint)?;
    let params_logprobs = params.logprobs.is_some();
    let n = f.n.unwrap_or(1) as usize;
    let trace = server.map(|s| {
        let mask = engine.mask();
        GenerationTrace::start(
            &s.0,
            endpoint.operation(),
            &state.model_name,
            &params,
            n,
            &mask,
        )
    });
    let generations = engine
        .submit_n(
            GenerateRequest {
                prompt,
                params,
                max_input_tokens: Some(state.server.max_input_tokens),
                max_total_tokens: Some(state.server.max_total_tokens),
                cache_salt,
                trace: trace.as_ref().map(GenerationTrace::engine_span),
            },
            n,
        )
        .await?;
    let prompt_tokens = generations.first().map_or(0, |g| g.prompt_tokens());
    state.metrics.prompt_tokens.inc_by(prompt_tokens as u64);
    // OpenAI: the usage chunk is sent only when asked for.
    let include_usage = f
        .stream_options
        .as_ref()
        .and_then(|o| o.include_usage)
        .unwrap_or(false);
    Ok(Prepared {
        generations,
        permit,
        arrived,
        stream: f.stream,
        include_usage,
        logprobs: params_logprobs,
        trace,
    })
}

#[derive(Clone, Copy)]
pub(super) enum Endpoint {
    Completions,
    Chat,
}

impl Endpoint {
    fn label(self) -> &'static str {
        match self {
            Endpoint::Completions => "completions",
            Endpoint::Chat => "chat_completions",
        }
    }
    /// Log-probabilities in this endpoint's shape; `offset`: characters of completion text
    /// before the first entry.
    fn logprobs(self, entries: &[logprobs::Entry], offset: usize) -> serde_json::Value {
        match self {
            Endpoint::Completions => logprobs::completions(entries, offset),
            Endpoint::Chat => logprobs::chat(entries),
        }
    }

    /// `gen_ai.operation.name`.
    fn operation(self) -> &'static str {
        match self {
            Endpoint::Completions => "text_completion",
            Endpoint::Chat => "chat",
        }
    }

    fn id_prefix(self) -> &'static str {
        match self {
            Endpoint::Completions => "cmpl-",
            Endpoint::Chat => "chatcmpl-",
        }
    }
}

/// Per-request latency bookkeeping.
struct Timing {
    arrived: Instant,
    last: Option<Instant>,
    endpoint: Endpoint,
}

impl Timing {
    fn token(&mut self, state: &AppState) {
        let now = Instant::now();
        let ep = self.endpoint.label();
        match self.last {
            None => state
                .metrics
                .ttft
                .with_label_values(&[ep])
                .observe((now - self.arrived).as_secs_f64()),
            Some(prev) => state
                .metrics
                .itl
                .with_label_values(&[ep])
                .observe((now - prev).as_secs_f64()),
        }
        state.metrics.generation_tokens.inc();
        self.last = Some(now);
    }
    fn done(&self, state: &AppState) {
        state
            .metrics
            .e2e
            .with_label_values(&[self.endpoint.label()])
            .observe(self.arrived.elapsed().as_secs_f64());
    }
}

/// A generation request body as the two endpoints take it.
pub(super) trait GenerationBody: serde::de::DeserializeOwned {
    const ENDPOINT: Endpoint;
    fn sampling(&self) -> &SamplingFields;
    /// The fields the typed body did not name (refused unless known and harmless).
    fn rest(&self) -> &serde_json::Map<String, serde_json::Value>;
    /// The sampling fields and the prompt.
    fn into_parts(self) -> Result<(SamplingFields, Prompt), ApiError>;
}

impl GenerationBody for CompletionRequest {
    const ENDPOINT: Endpoint = Endpoint::Completions;
    fn sampling(&self) -> &SamplingFields {
        &self.sampling
    }
    fn rest(&self) -> &serde_json::Map<String, serde_json::Value> {
        &self.rest
    }
    fn into_parts(self) -> Result<(SamplingFields, Prompt), ApiError> {
        let mut prompts = self.prompt.into_vec();
        if prompts.len() != 1 {
            return Err(ApiError::BadRequest(format!(
                "exactly one prompt per request is supported, got {}",
                prompts.len()
            )));
        }
        let text = prompts.remove(0);
        Ok((
            self.sampling,
            Prompt::Text {
                text,
                add_bos: true,
            },
        ))
    }
}

impl GenerationBody for ChatRequest {
    const ENDPOINT: Endpoint = Endpoint::Chat;
    fn sampling(&self) -> &SamplingFields {
        &self.sampling
    }
    fn rest(&self) -> &serde_json::Map<String, serde_json::Value> {
        &self.rest
    }
    fn into_parts(self) -> Result<(SamplingFields, Prompt), ApiError> {
        Ok((self.sampling, Prompt::Chat(self.messages)))
    }
}

/// `POST /v1/completions` and `POST /v1/chat/completions`: key, admission permit (before the
/// body is read), the body, its fields, the cache partition, then the engine.
pub(super) async fn generate<R: GenerationBody>(
    req: HttpRequest,
    payload: web::Payload,
    state: web::Data<AppState>,
) -> Result<HttpResponse, ApiError> {
    check_api_key(&req, &state)?;
    let arrived = Instant::now();
    let permit = admit(&state)?;
    let body: R = json_body(&req, payload, &state).await?;
    check_fields(body.sampling(), body.rest())?;
    let salt = cache_salt(&req, &state, body.sampling())?;
    let (sampling, prompt) = body.into_parts()?;
    let p = prepare(
        &state,
        server_span(&req),
        &sampling,
        salt,
        prompt,
        R::ENDPOINT,
        permit,
        arrived,
    )
    .await?;
    respond(state, p, R::ENDPOINT).await
}

/// One choice's events, tagged with its index.
type ChoiceEvents = futures::stream::BoxStream<'static, (usize, GenerationEvent)>;

/// The generations of a request as one stream of (choice index, event), in arrival order.
/// Dropping it drops the generations (cancelling those not finished).
fn merged(generations: Vec<Generation>) -> futures::stream::SelectAll<ChoiceEvents> {
    futures::stream::select_all(generations.into_iter().enumerate().map(|(i, g)| {
        futures::stream::unfold(g, |mut g| async move { g.next().await.map(|e| (e, g)) })
            .map(move |e| (i, e))
            .boxed()
    }))
}

/// What is known of one choice while its events arrive.
#[derive(Default)]
struct Choice {
    text: String,
    entries: Vec<logprobs::Entry>,
    /// Streaming: the role was sent (chat), characters sent (completions' `text_offset`).
    sent_role: bool,
    sent_chars: usize,
    finish: Option<FinishReason>,
    completion_tokens: usize,
}

/// Note one event of choice `i`: timing (choice 0 drives TTFT/ITL; every token counts),
/// log-probabilities, text. Returns the text delta of a `Text` event.
fn observe(
    state: &AppState,
    timing: &mut Timing,
    choice: &mut Choice,
    i: usize,
    ev: GenerationEvent,
    usage: &mut quantmesh_types::Usage,
) -> Option<String> {
    match ev {
        GenerationEvent::Text {
            text,
            token,
            logprobs,
        } => {
            if token.is_some() {
                if i == 0 {
                    timing.token(state);
                } else {
                    state.metrics.generation_tokens.inc();
                }
                if let Some(lp) = logprobs {
                    choice.entries.push(lp.into());
                }
            }
            Some(text)
        }
        GenerationEvent::Done {
            reason,
            usage: u,
            cached_tokens,
        } => {
            if i == 0 {
                // Per request (its choices share one prompt lookup).
                state
                    .metrics
                    .prefix_cache_queries
                    .inc_by(u.prompt_tokens as u64);
                state.metrics.prefix_cache_hits.inc_by(cached_tokens as u64);
            }
            if reason != FinishReason::Error {
                state
                    .metrics
                    .request_success
                    .with_label_values(&[FinishReasonBody::from(reason).as_str()])
                    .inc();
            }
            choice.finish = Some(reason);
            choice.completion_tokens = u.completion_tokens;
            usage.prompt_tokens = u.prompt_tokens;
            usage.completion_tokens += u.completion_tokens;
            usage.total_tokens = usage.prompt_tokens + usage.completion_tokens;
            None
        }
    }
}

async fn respond(
    state: web::Data<AppState>,
    p: Prepared,
    endpoint: Endpoint,
) -> Result<HttpResponse, ApiError> {
    let id = format!("{}{}", endpoint.id_prefix(), uuid::Uuid::new_v4().simple());
    let created = now_secs();
    let model = state.model_name.clone();
    let timing = Timing {
        arrived: p.arrived,
        last: None,
        endpoint,
    };
    let n = p.generations.len();
    let mut trace = p.trace;
    if let Some(t) = &mut trace {
        t.responding(&id, p.stream);
    }
    if !p.stream {
        let mut events = merged(p.generations);
        let mut timing = timing;
        let mut choices: Vec<Choice> = (0..n).map(|_| Choice::default()).collect();
        let mut usage = quantmesh_types::Usage::default();
        while let Some((i, ev)) = events.next().await {
            if let Some(t) = observe(&state, &mut timing, &mut choices[i], i, ev, &mut usage) {
                choices[i].text.push_str(&t);
            }
        }
        timing.done(&state);
        drop(p.permit);
        if let Some(t) = &mut trace {
            let reasons: Vec<_> = choices.iter().map(|c| c.finish).collect();
            t.finished(&usage, &reasons);
        }
        if choices
            .iter()
            .any(|c| c.finish.is_none_or(|r| r == FinishReason::Error))
        {
            return Err(ApiError::Internal(
                "generation failed; see server logs".into(),
            ));
        }
        let lp = |c: &Choice| p.logprobs.then(|| endpoint.logprobs(&c.entries, 0));
        let usage = UsageBody::from(usage);
        return Ok(match endpoint {
            Endpoint::Completions => HttpResponse::Ok().json(CompletionResponse {
                id,
                object: "text_completion",
                created,
                model,
                choices: choices
                    .iter()
                    .enumerate()
                    .map(|(index, c)| CompletionChoice {
                        index,
                        text: c.text.clone(),
                        logprobs: lp(c),
                        finish_reason: c.finish.map(FinishReasonBody::from),
                    })
                    .collect(),
                usage,
            }),
            Endpoint::Chat => HttpResponse::Ok().json(ChatCompletionResponse {
                id,
                object: "chat.completion",
                created,
                model,
                choices: choices
                    .iter()
                    .enumerate()
                    .map(|(index, c)| ChatChoice {
                        index,
                        message: AssistantMessage {
                            role: "assistant",
                            content: c.text.clone(),
                        },
                        logprobs: lp(c),
                        finish_reason: c.finish.map(FinishReasonBody::from),
                    })
                    .collect(),
                usage,
            }),
        });
    }

    struct StreamState {
        events: futures::stream::SelectAll<ChoiceEvents>,
        choices: Vec<Choice>,
        usage: quantmesh_types::Usage,
        _permit: OwnedSemaphorePermit,
        timing: Timing,
        state: web::Data<AppState>,
        id: String,
        model: String,
        created: u64,
        endpoint: Endpoint,
        include_usage: bool,
        /// Whether the request asked for log-probabilities; those of tokens whose text is
        /// still held back wait in the choice's `entries` for its next chunk.
        logprobs: bool,
        finished: bool,
        trace: Option<GenerationTrace>,
    }
    fn sse(v: &serde_json::Value) -> Bytes {
        Bytes::from(format!("data: {v}\n\n"))
    }
    impl StreamState {
        fn chunk(
            &mut self,
            i: usize,
            text: Option<&str>,
            finish: Option<FinishReason>,
        ) -> serde_json::Value {
            let fr = finish.map(FinishReasonBody::from);
            let endpoint = self.endpoint;
            let c = &mut self.choices[i];
            let lp = match self.logprobs {
                false => serde_json::Value::Null,
                true => endpoint.logprobs(&std::mem::take(&mut c.entries), c.sent_chars),
            };
            c.sent_chars += text.map_or(0, |t| t.chars().count());
            let choice = match endpoint {
                Endpoint::Completions => {
                    json!({"index": i, "text": text.unwrap_or(""), "logprobs": lp, "finish_reason": fr})
                }
                Endpoint::Chat => {
                    let delta = match (text, c.sent_role) {
                        (Some(t), false) => json!({"role": "assistant", "content": t}),
                        (Some(t), true) => json!({"content": t}),
                        (None, false) => json!({"role": "assistant"}),
                        (None, true) => json!({}),
                    };
                    c.sent_role = true;
                    json!({"index": i, "delta": delta, "logprobs": lp, "finish_reason": fr})
                }
            };
            let object = match endpoint {
                Endpoint::Completions => "text_completion",
                Endpoint::Chat => "chat.completion.chunk",
            };
            json!({"id": self.id, "object": object, "created": self.created, "model": self.model, "choices": [choice]})
        }
    }
    let st = StreamState {
        events: merged(p.generations),
        choices: (0..n).map(|_| Choice::default()).collect(),
        usage: Default::default(),
        _permit: p.permit,
        timing,
        state: state.clone(),
        id,
        model,
        created,
        endpoint,
        include_usage: p.include_usage,
        logprobs: p.logprobs,
        finished: false,
        trace,
    };
    let body = futures::stream::unfold(st, |mut st| async move {
        if st.finished {
            return None;
        }
        loop {
            match st.events.next().await {
                Some((i, ev)) => {
                    let is_done = matches!(ev, GenerationEvent::Done { .. });
                    let text = observe(
                        &st.state,
                        &mut st.timing,
                        &mut st.choices[i],
                        i,
                        ev,
                        &mut st.usage,
                    );
                    let c = match (text, is_done) {
                        (Some(t), _) if !t.is_empty() => st.chunk(i, Some(&t), None),
                        (_, true) => {
                            let reason = st.choices[i].finish;
                            st.chunk(i, None, reason)
                        }
                        _ => continue,
                    };
                    return Some((Ok::<Bytes, actix_web::Error>(sse(&c)), st));
                }
                None => {
                    // Every choice has ended.
                    st.timing.done(&st.state);
                    if let Some(t) = &mut st.trace {
                        let reasons: Vec<_> = st.choices.iter().map(|c| c.finish).collect();
                        t.finished(&st.usage, &reasons);
                    }
                    let mut out = Vec::new();
                    if st.include_usage {
                        let obj = match st.endpoint {
                            Endpoint::Completions => "text_completion",
                            Endpoint::Chat => "chat.completion.chunk",
                        };
                        out.extend_from_slice(&sse(&json!({
                            "id": st.id, "object": obj, "created": st.created, "model": st.model,
                            "choices": [], "usage": UsageBody::from(st.usage),
                        })));
                    }
                    out.extend_from_slice(b"data: [DONE]\n\n");
                    st.finished = true;
                    return Some((Ok(Bytes::from(out)), st));
                }
            }
        }
    });
    Ok(HttpResponse::Ok()
        .content_type("text/event-stream")
        .insert_header(("Cache-Control", "no-cache"))
        .insert_header(("X-Accel-Buffering", "no"))
        .streaming(body))
}
