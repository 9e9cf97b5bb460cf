//! OTLP traces end to end, with real parts: the `quantmesh` binary as a process exporting
//! over OTLP/gRPC to an in-process collector (`fake-opentelemetry-collector`, a real OTLP
//! gRPC server), a tansu broker, an rdkafka consumer. A request sent with a known W3C
//! `traceparent` must come back as one span tree under that parent, and the fallback event
//! it caused must reach Kafka carrying the same trace id. Over TLS: the collector behind an
//! `https://` front whose certificate a private CA (made here by `openssl`) signed, trusted
//! through `OTEL_EXPORTER_OTLP_CERTIFICATE` — and refused without it.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use fake_opentelemetry_collector::{ExportedSpan, FakeCollectorServer};
use std::time::Duration;
use support::*;

const TRACE_ID: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const CALLER_SPAN: &str = "00f067aa0ba902b7";

/// A monitor that takes no layer or token decision but samples every step's shadow KL
/// against a limit every request exceeds: each request is put in float (per request,
/// reason `shadow_kl`), one event per request, tied to the request.
fn config(dir: &std::path::Path) -> String {
    let p = dir.join("quantmesh.toml");
    std::fs::write(
        &p,
        "[engine.monitor]\nk = 1e9\ntoken_k = 1e9\nrequest_kl_limit = 1e-9\nshadow_sample_rate = 1.0\n\n\
         [kafka]\nconnect_timeout = \"3s\"\ndelivery_timeout = \"2s\"\nshutdown_timeout = \"3s\"\n",
    )
    .unwrap();
    p.display().to_string()
}

fn attr<'a>(s: &'a ExportedSpan, key: &str) -> &'a str {
    s.attributes
        .get(key)
        .map(String::as_str)
        .unwrap_or_else(|| panic!("span {} has no attribute {key}: {:?}", s.name, s.attributes))
}

fn one<'a>(spans: &'a [ExportedSpan], name: &str) -> &'a ExportedSpan {
    let found: Vec<_> = spans.iter().filter(|s| s.name == name).collect();
    assert_eq!(
        found.len(),
        1,
        "expected one span {name:?}; got names {:?}",
        spans.iter().map(|s| &s.name).collect::<Vec<_>>()
    );
    found[0]
}

/// Spans of `trace` until `done` holds on them (or a minute passes).
async fn spans_of(
    collector: &mut FakeCollectorServer,
    all: &mut Vec<ExportedSpan>,
    trace: &str,
    done: impl Fn(&[ExportedSpan]) -> bool,
) -> Vec<ExportedSpan> {
    let t0 = std::time::Instant::now();
    loop {
        let mine: Vec<ExportedSpan> = all
            .iter()
            .filter(|s| s.trace_id == trace)
            .cloned()
            .collect();
        if done(&mine) || t0.elapsed() > Duration::from_secs(60) {
            return mine;
        }
        all.extend(collector.exported_spans(1, Duration::from_secs(2)).await);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_traced_request_yields_its_span_tree_and_its_fallback_event_carries_the_trace() {
    let mut collector = FakeCollectorServer::start().await.unwrap();
    let root = tempfile::tempdir().unwrap();
    let model = model_dir(root.path());
    let broker = Broker::start(root.path());
    let cfg = config(root.path());
    let plan = root.path().join("sensitive_layers.json");
    std::fs::write(&plan, "{\"schema_version\": 1}").unwrap();
    let endpoint = collector.endpoint();
    let serve = Serve::start(
        &model,
        &root.path().join("outbox"),
        &broker.addr(),
        &[
            ("QUANTMESH_CONFIG", cfg.as_str()),
            ("QUANTMESH_SENSITIVE_LAYERS", plan.to_str().unwrap()),
            ("QUANTMESH_RELOAD_INTERVAL", "1h"),
            ("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint.as_str()),
            ("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc"),
            ("OTEL_SERVICE_NAME", "quantmesh-trace-test"),
            ("OTEL_BSP_SCHEDULE_DELAY", "100"),
        ],
    )
    .await;
    let client = reqwest::Client::new();
    let traceparent = format!("00-{TRACE_ID}-{CALLER_SPAN}-01");
    let r = client
        .post(serve.url("/v1/chat/completions"))
        .header("traceparent", &traceparent)
        .json(&serde_json::json!({
            "messages": [{"role": "user", "content": "Tell me about traces."}],
            "max_tokens": 6, "temperature": 0, "ignore_eos": true,
        }))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let answered = r
        .headers()
        .get("traceparent")
        .expect("the response names its trace")
        .to_str()
        .unwrap()
        .to_string();
    assert!(
        answered.starts_with(&format!("00-{TRACE_ID}-")) && !answered.contains(CALLER_SPAN),
        "response traceparent {answered} is not the server span of trace {TRACE_ID}"
    );
    let body: serde_json::Value = r.json().await.unwrap();
    let output_tokens = body["usage"]["completion_tokens"].as_u64().unwrap();
    assert_eq!(output_tokens, 6);

    // The span tree.
    let mut all = Vec::new();
    let names = [
        "POST /v1/chat/completions",
        "chat quantmesh-tiny",
        "quantmesh.tokenize",
        "quantmesh.queue",
        "quantmesh.prefill",
        "quantmesh.decode",
        "quantmesh.respond",
    ];
    let spans = spans_of(&mut collector, &mut all, TRACE_ID, |s| {
        names.iter().all(|n| s.iter().any(|x| x.name == *n))
    })
    .await;
    let server = one(&spans, "POST /v1/chat/completions");
    assert_eq!(
        server.parent_span_id, CALLER_SPAN,
        "server span under the caller's"
    );
    assert!(server.kind.contains("SERVER"), "{}", server.kind);
    assert!(attr(server, "http.response.status_code").contains("200"));
    assert!(attr(server, "http.route").contains("/v1/chat/completions"));
    assert!(
        answered.contains(&server.span_id),
        "response names the server span"
    );
    let genai = one(&spans, "chat quantmesh-tiny");
    assert_eq!(genai.parent_span_id, server.span_id);
    assert!(attr(genai, "gen_ai.operation.name").contains("\"chat\""));
    assert!(attr(genai, "gen_ai.request.model").contains("\"quantmesh-tiny\""));
    assert!(attr(genai, "gen_ai.request.max_tokens").contains("IntValue(6)"));
    assert!(attr(genai, "gen_ai.usage.output_tokens").contains("IntValue(6)"));
    assert!(attr(genai, "gen_ai.usage.input_tokens").contains("IntValue("));
    assert!(attr(genai, "gen_ai.response.finish_reasons").contains("\"length\""));
    assert!(attr(genai, "gen_ai.response.id").contains("chatcmpl-"));
    assert!(attr(genai, "quantmesh.groups_in_float").contains("IntValue(0)"));
    for phase in [
        "quantmesh.tokenize",
        "quantmesh.queue",
        "quantmesh.prefill",
        "quantmesh.decode",
        "quantmesh.respond",
    ] {
        assert_eq!(
            one(&spans, phase).parent_span_id,
            genai.span_id,
            "{phase} is a child of the GenAI span"
        );
    }
    // Phases in order: queue ends before prefill starts, prefill before decode.
    let (queue, prefill, decode) = (
        one(&spans, "quantmesh.queue"),
        one(&spans, "quantmesh.prefill"),
        one(&spans, "quantmesh.decode"),
    );
    assert!(queue.end_time_unix_nano <= prefill.start_time_unix_nano);
    assert!(prefill.end_time_unix_nano <= decode.start_time_unix_nano);
    assert!(attr(decode, "gen_ai.usage.output_tokens").contains("IntValue(6)"));
    assert!(attr(decode, "gen_ai.response.finish_reason").contains("\"length\""));
    let steps = decode.events.iter().filter(|e| e.name == "step").count();
    assert!(
        steps >= 5,
        "one step event per decode step (6 tokens: ≥ 5 steps after the prompt's), got {steps}"
    );
    // The precision decision that touched the request, as an event of its GenAI span.
    let decision = genai
        .events
        .iter()
        .find(|e| e.name == "precision fallback")
        .unwrap_or_else(|| panic!("no precision event on the GenAI span: {:?}", genai.events));
    assert!(decision.attributes["reason"].contains("shadow_kl"));
    assert!(decision.attributes["granularity"].contains("request"));

    // The fallback event that request caused reached Kafka with the same trace.
    let consumer = consumer(&broker.addr(), "trace-test", TOPIC);
    let seen = collect(&consumer, Duration::from_secs(60), |s| {
        s.values().any(|m| m.payload["reason"] == "shadow_kl")
    })
    .await;
    let ev = seen
        .values()
        .find(|m| m.payload["reason"] == "shadow_kl")
        .unwrap_or_else(|| panic!("no shadow_kl event consumed: {seen:?}"));
    let header = &ev.headers["traceparent"];
    assert!(
        header.starts_with(&format!("00-{TRACE_ID}-")),
        "event header traceparent {header} is not in trace {TRACE_ID}"
    );
    assert_eq!(ev.payload["traceparent"], header.as_str());
    assert!(ev.payload["request_id"].is_u64());

    // A reload asked for under a trace: its config event belongs to that trace.
    let reload_trace = "0af7651916cd43dd8448eb211c80319c";
    std::fs::write(&plan, "{ \"schema_version\": 1 }").unwrap();
    let r = client
        .post(serve.url("/admin/config/reload"))
        .bearer_auth(ADMIN_TOKEN)
        .header(
            "traceparent",
            format!("00-{reload_trace}-b7ad6b7169203331-01"),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let cc = support::consumer(&broker.addr(), "trace-test-config", CONFIG_TOPIC);
    let seen = collect(&cc, Duration::from_secs(60), |s| {
        s.values().any(|m| m.payload["action"] == "applied")
    })
    .await;
    let applied = seen
        .values()
        .find(|m| m.payload["action"] == "applied")
        .expect("the applied config event");
    assert!(
        applied.headers["traceparent"].starts_with(&format!("00-{reload_trace}-")),
        "{:?}",
        applied.headers
    );
    let reload_spans = spans_of(&mut collector, &mut all, reload_trace, |s| {
        s.iter().any(|x| x.name == "quantmesh.config.change")
    })
    .await;
    let change = one(&reload_spans, "quantmesh.config.change");
    let admin = one(&reload_spans, "POST /admin/config/reload");
    assert_eq!(change.parent_span_id, admin.span_id);

    // A fallback forced by an admin call under a trace: its event joins that trace.
    let force_trace = "5bd66ef5095369c7b0d1f8f4bd33716a";
    let r = client
        .post(serve.url("/admin/fallback"))
        .bearer_auth(ADMIN_TOKEN)
        .header(
            "traceparent",
            format!("00-{force_trace}-c7ad6b7169203331-01"),
        )
        .json(&serde_json::json!({"group": "layers.1.o", "mode": "float"}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200, "{}", r.text().await.unwrap());
    let seen = collect(&consumer, Duration::from_secs(60), |s| {
        s.values().any(|m| m.payload["reason"] == "admin")
    })
    .await;
    let forced = seen
        .values()
        .find(|m| m.payload["reason"] == "admin")
        .unwrap_or_else(|| panic!("no admin fallback event consumed: {seen:?}"));
    assert!(
        forced.headers["traceparent"].starts_with(&format!("00-{force_trace}-")),
        "the forced fallback's event starts its own trace: {:?}",
        forced.headers
    );

    // Export is counted.
    let m = scrape(&client, &serve.url("/metrics")).await;
    assert!(sum_metric(&m, "quantmesh_otel_spans_total", &["exported"]) >= names.len() as f64);
}

/// Traces off (no endpoint): no `traceparent` in responses, no header on events — and with
/// a collector that is not there, serving is unaffected and failures are only counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_collector_costs_nothing_but_a_counter() {
    let root = tempfile::tempdir().unwrap();
    let model = model_dir(root.path());
    let cfg = config(root.path());
    let dead = format!("http://127.0.0.1:{}", free_port());
    let serve = Serve::start(
        &model,
        &root.path().join("outbox"),
        "",
        &[
            ("QUANTMESH_CONFIG", cfg.as_str()),
            ("OTEL_EXPORTER_OTLP_ENDPOINT", dead.as_str()),
            ("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc"),
            ("OTEL_BSP_SCHEDULE_DELAY", "100"),
            ("OTEL_EXPORTER_OTLP_TIMEOUT", "500"),
        ],
    )
    .await;
    let client = reqwest::Client::new();
    for _ in 0..5 {
        let r = client
            .post(serve.url("/v1/completions"))
            .json(&serde_json::json!({"prompt": "hello", "max_tokens": 4}))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        assert!(r.headers().contains_key("traceparent"));
    }
    let m = wait_spans(&serve, "failed").await;
    assert_eq!(
        sum_metric(&m, "quantmesh_otel_spans_total", &["exported"]),
        0.0
    );
    // Still serving.
    let r = client
        .post(serve.url("/v1/completions"))
        .json(&serde_json::json!({"prompt": "hello", "max_tokens": 4}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);

    // Without an endpoint there is no trace at all.
    let off = Serve::start(
        &model,
        &root.path().join("outbox-off"),
        "",
        &[("QUANTMESH_CONFIG", cfg.as_str())],
    )
    .await;
    let r = client
        .post(off.url("/v1/completions"))
        .header("traceparent", format!("00-{TRACE_ID}-{CALLER_SPAN}-01"))
        .json(&serde_json::json!({"prompt": "hello", "max_tokens": 4}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert!(!r.headers().contains_key("traceparent"));
}

/// A TLS front for a plaintext collector: terminates TLS (ALPN `h2` and `http/1.1`) with a
/// certificate for `localhost` signed by a CA made for the test by `openssl`, and pipes the
/// bytes to `backend`. Counts completed and failed handshakes.
struct TlsFront {
    port: u16,
    ca: std::path::PathBuf,
    handshakes: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    refused: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    task: tokio::task::JoinHandle<()>,
}

fn openssl(dir: &std::path::Path, args: &[&str]) {
    let out = std::process::Command::new("openssl")
        .current_dir(dir)
        .args(args)
        .output()
        .expect("openssl (Debian's openssl package) makes the test's certificates");
    assert!(
        out.status.success(),
        "openssl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

impl TlsFront {
    async fn start(dir: &std::path::Path, backend: std::net::SocketAddr) -> TlsFront {
        use std::sync::atomic::{AtomicUsize, Ordering};
        use std::sync::Arc;
        use tokio_rustls::rustls;
        use tokio_rustls::rustls::pki_types::pem::PemObject;
        use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer};

        let ec = [
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
        ];
        let mut ca = vec![
            "req",
            "-x509",
            "-days",
            "1",
            "-subj",
            "/CN=quantmesh test CA",
        ];
        ca.extend(ec);
        ca.extend(["-keyout", "ca.key", "-out", "ca.pem"]);
        openssl(dir, &ca);
        let mut csr = vec!["req", "-subj", "/CN=localhost"];
        csr.extend(ec);
        csr.extend(["-keyout", "leaf.key", "-out", "leaf.csr"]);
        openssl(dir, &csr);
        std::fs::write(
            dir.join("leaf.ext"),
            "subjectAltName=DNS:localhost,IP:127.0.0.1\n",
        )
        .unwrap();
        openssl(
            dir,
            &[
                "x509",
                "-req",
                "-days",
                "1",
                "-in",
                "leaf.csr",
                "-CA",
                "ca.pem",
                "-CAkey",
                "ca.key",
                "-CAcreateserial",
                "-extfile",
                "leaf.ext",
                "-out",
                "leaf.pem",
            ],
        );
        let certs: Vec<CertificateDer<'static>> =
            CertificateDer::pem_file_iter(dir.join("leaf.pem"))
                .unwrap()
                .map(|c| c.unwrap())
                .collect();
        let key = PrivateKeyDer::from_pem_file(dir.join("leaf.key")).unwrap();
        let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
        let mut config = rustls::ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_no_client_auth()
            .with_single_cert(certs, key)
            .unwrap();
        config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
        let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let (handshakes, refused) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
        let task = tokio::spawn({
            let (handshakes, refused) = (handshakes.clone(), refused.clone());
            async move {
                while let Ok((tcp, _)) = listener.accept().await {
                    let (acceptor, handshakes, refused) =
                        (acceptor.clone(), handshakes.clone(), refused.clone());
                    tokio::spawn(async move {
                        let Ok(mut tls) = acceptor.accept(tcp).await else {
                            refused.fetch_add(1, Ordering::Relaxed);
                            return;
                        };
                        handshakes.fetch_add(1, Ordering::Relaxed);
                        if let Ok(mut plain) = tokio::net::TcpStream::connect(backend).await {
                            let _ = tokio::io::copy_bidirectional(&mut tls, &mut plain).await;
                        }
                    });
                }
            }
        });
        TlsFront {
            port,
            ca: dir.join("ca.pem"),
            handshakes,
            refused,
            task,
        }
    }

    fn endpoint(&self) -> String {
        format!("https://localhost:{}", self.port)
    }
}

impl Drop for TlsFront {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Until `quantmesh_otel_spans_total{outcome}` of `serve` is above zero.
async fn wait_spans(serve: &Serve, outcome: &str) -> String {
    let client = reqwest::Client::new();
    poll(
        Duration::from_secs(60),
        Duration::from_millis(200),
        || async {
            let m = scrape(&client, &serve.url("/metrics")).await;
            match sum_metric(&m, "quantmesh_otel_spans_total", &[outcome]) > 0.0 {
                true => Ok(m),
                false => Err(format!("no span {outcome}:\n{m}")),
            }
        },
    )
    .await
}

/// OTLP over TLS (build feature `otlp-tls`, on in the test command's build): gRPC to an
/// `https://` collector whose certificate a private CA signed reaches it when
/// `OTEL_EXPORTER_OTLP_CERTIFICATE` names the CA, and is refused (counted as failed, no span
/// delivered) when nothing says to trust it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(
    not(feature = "otlp-tls"),
    ignore = "needs the otlp-tls feature (the test command's build has it)"
)]
async fn spans_reach_an_https_collector_that_a_private_ca_signed() {
    use std::sync::atomic::Ordering;
    let mut collector = FakeCollectorServer::start().await.unwrap();
    let root = tempfile::tempdir().unwrap();
    let front = TlsFront::start(root.path(), collector.address()).await;
    let model = model_dir(root.path());
    let cfg = config(root.path());
    let endpoint = front.endpoint();
    let ca = front.ca.display().to_string();
    let traced = |outbox: &str, with_ca: bool| {
        let mut env = vec![
            ("QUANTMESH_CONFIG", cfg.clone()),
            ("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint.clone()),
            ("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc".to_string()),
            ("OTEL_SERVICE_NAME", "quantmesh-tls-test".to_string()),
            ("OTEL_BSP_SCHEDULE_DELAY", "100".to_string()),
            ("OTEL_EXPORTER_OTLP_TIMEOUT", "2000".to_string()),
        ];
        if with_ca {
            env.push(("OTEL_EXPORTER_OTLP_CERTIFICATE", ca.clone()));
        }
        (root.path().join(outbox), env)
    };
    let client = reqwest::Client::new();
    let complete = |serve: &Serve| {
        client
            .post(serve.url("/v1/completions"))
            .header("traceparent", format!("00-{TRACE_ID}-{CALLER_SPAN}-01"))
            .json(&serde_json::json!({"prompt": "hello", "max_tokens": 4}))
            .send()
    };

    // Trusted through the private CA: spans arrive, over TLS.
    let (outbox, env) = traced("outbox-tls", true);
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let serve = Serve::start(&model, &outbox, "", &env).await;
    assert_eq!(complete(&serve).await.unwrap().status(), 200);
    let mut all = Vec::new();
    let spans = spans_of(&mut collector, &mut all, TRACE_ID, |s| {
        s.iter().any(|x| x.name == "POST /v1/completions")
    })
    .await;
    assert!(
        spans.iter().any(|x| x.name == "POST /v1/completions"),
        "no server span came through the TLS front: {:?}",
        spans.iter().map(|s| &s.name).collect::<Vec<_>>()
    );
    wait_spans(&serve, "exported").await;
    assert!(front.handshakes.load(Ordering::Relaxed) >= 1);
    assert_eq!(front.refused.load(Ordering::Relaxed), 0);
    drop(serve);

    // Without the CA the certificate is not trusted: the handshake fails, the spans are
    // counted as failed, none is delivered.
    let (outbox, env) = traced("outbox-untrusted", false);
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let serve = Serve::start(&model, &outbox, "", &env).await;
    assert_eq!(complete(&serve).await.unwrap().status(), 200);
    let m = wait_spans(&serve, "failed").await;
    assert_eq!(
        sum_metric(&m, "quantmesh_otel_spans_total", &["exported"]),
        0.0,
        "{m}"
    );
    assert!(front.refused.load(Ordering::Relaxed) >= 1);
}
