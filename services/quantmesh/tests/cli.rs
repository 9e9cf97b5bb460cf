//! The real `quantmesh` binary: first run writes the bundled model, serves, answers HTTP,
//! and exits cleanly on SIGTERM.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

mod support;

fn http(addr: &str, req: &str) -> String {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    s.write_all(req.as_bytes()).unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    out
}

#[test]
fn serve_writes_the_model_answers_and_stops_on_sigterm() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("quantmesh-tiny");
    let mut child = Command::new(env!("CARGO_BIN_EXE_quantmesh"))
        .args(["serve", "--port", "0", "--log-format", "json"])
        .args(["--model", "bundled:tiny", "--models-dir"])
        .arg(dir.path())
        .env("RUST_LOG", "info")
        .stderr(Stdio::piped())
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let (addr, log, rx) = support::wait_ready_in_log(&mut child, Duration::from_secs(60));
    assert!(
        model.join("planted.json").exists(),
        "first run wrote the bundled model"
    );

    let body = r#"{"prompt": "Hello", "max_tokens": 4, "seed": 1}"#;
    let resp = http(&addr, &format!("POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}", body.len()));
    assert!(resp.starts_with("HTTP/1.1 200"), "{resp}");
    assert!(resp.contains("\"text_completion\""), "{resp}");

    let pid = child.id().to_string();
    // the shell builtin, so no procps is needed
    assert!(Command::new("sh")
        .args(["-c", &format!("kill -TERM {pid}")])
        .status()
        .unwrap()
        .success());
    let (done_tx, done_rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = done_tx.send(child.wait());
    });
    let status = done_rx
        .recv_timeout(Duration::from_secs(30))
        .expect("exits after SIGTERM")
        .unwrap();
    assert!(status.success(), "exit status {status}");
    // The process has exited; read its log to the end (the reader thread stops at EOF and
    // closes the channel), not just what the reader has forwarded so far.
    let mut rest: Vec<String> = Vec::new();
    while let Ok(line) = rx.recv_timeout(Duration::from_secs(10)) {
        rest.push(line);
    }
    assert!(
        rest.iter()
            .chain(&log)
            .any(|l| l.contains("SIGTERM received")),
        "logs the signal"
    );
    assert!(
        rest.iter().any(|l| l.contains("\"stopped\"")),
        "logs a clean stop"
    );
}

fn quantmesh(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_quantmesh"))
        .args(args)
        .output()
        .unwrap()
}

#[test]
fn prescreen_writes_uploads_and_refuses_an_unwritable_target_up_front() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("model");
    let m = model.to_str().unwrap();
    assert!(quantmesh(&["model", "init", "--out", m, "--shards", "2"])
        .status
        .success());
    let out = dir.path().join("sensitive_layers.json");
    let o = out.to_str().unwrap();

    // A target under a regular file cannot be written: fail before scanning anything.
    let blocker = dir.path().join("blocker");
    std::fs::write(&blocker, b"x").unwrap();
    let bad = format!("file://{}/plans", blocker.display());
    let r = quantmesh(&[
        "prescreen",
        "--quiet",
        "--model",
        m,
        "--out",
        o,
        "--upload",
        &bad,
    ]);
    assert!(!r.status.success());
    let err = String::from_utf8_lossy(&r.stderr);
    assert!(err.contains("not writable"), "{err}");
    assert!(!out.exists(), "no work was done");

    let store = format!("file://{}/plans", dir.path().display());
    let args = [
        "prescreen",
        "--quiet",
        "--model",
        m,
        "--out",
        o,
        "--upload",
        &store,
        "--max-prompts",
        "32",
        "--timestamp",
        "2026-11-22T00:00:00Z",
    ];
    let r = quantmesh(&args);
    let stdout = String::from_utf8_lossy(&r.stdout);
    assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
    assert!(
        stdout.contains("| fp16 |") && stdout.contains("MiB/s"),
        "{stdout}"
    );
    let bytes = std::fs::read(&out).unwrap();
    let md5 = format!("{:x}", md5::compute(&bytes));
    let version = dir
        .path()
        .join("plans/versions")
        .join(format!("{md5}.json"));
    assert_eq!(std::fs::read(&version).unwrap(), bytes);
    let latest: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.path().join("plans/latest")).unwrap()).unwrap();
    assert_eq!(latest["md5"], md5);
    // Idempotent: the same run stores nothing new.
    let r = quantmesh(&args);
    assert!(String::from_utf8_lossy(&r.stdout).contains("already stored"));
    // Bad arguments are explained.
    let r = quantmesh(&[
        "prescreen",
        "--model",
        m,
        "--out",
        o,
        "--timestamp",
        "yesterday",
    ]);
    assert!(!r.status.success());
    assert!(String::from_utf8_lossy(&r.stderr).contains("RFC 3339"));
}

/// A server whose log goes to a pipe (a file, a container's log driver) writes plain text:
/// no colour escape codes, and the probes that orchestrators poll every few seconds stay
/// out of the INFO log while real requests are in it.
#[test]
fn text_log_in_a_pipe_has_no_colour_codes_and_no_probe_lines() {
    let dir = tempfile::tempdir().unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_quantmesh"))
        .args(["serve", "--port", "0", "--log-format", "text"])
        .args(["--model", "bundled:tiny", "--models-dir"])
        .arg(dir.path())
        .env("RUST_LOG", "info")
        .env_remove("NO_COLOR")
        .stderr(Stdio::piped())
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let stderr = child.stderr.take().unwrap();
    let (tx, rx) = mpsc::channel::<String>();
    std::thread::spawn(move || {
        use std::io::BufRead;
        for line in std::io::BufReader::new(stderr)
            .lines()
            .map_while(Result::ok)
        {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    let mut log = Vec::new();
    let mut addr = None;
    while !log.iter().any(|l: &String| l.contains("ready: POST")) {
        let line = rx
            .recv_timeout(Duration::from_secs(60))
            .unwrap_or_else(|e| panic!("no ready line ({e}): {log:?}"));
        if let Some(a) = line.split("addr=").nth(1) {
            addr = a.split_whitespace().next().map(String::from);
        }
        log.push(line);
    }
    let addr = addr.expect("the listening line names the address");
    for path in ["/ready", "/health", "/metrics", "/ready"] {
        let resp = http(
            &addr,
            &format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"),
        );
        assert!(resp.starts_with("HTTP/1.1 200"), "{path}: {resp}");
    }
    let body = r#"{"prompt": "Hello", "max_tokens": 2, "seed": 1}"#;
    let resp = http(&addr, &format!("POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}", body.len()));
    assert!(resp.starts_with("HTTP/1.1 200"), "{resp}");
    assert!(Command::new("sh")
        .args(["-c", &format!("kill -TERM {}", child.id())])
        .status()
        .unwrap()
        .success());
    assert!(child.wait().unwrap().success());
    // The process has exited: the reader forwards the rest of the log, then closes.
    while let Ok(line) = rx.recv_timeout(Duration::from_secs(10)) {
        log.push(line);
    }
    let text = log.join("\n");
    assert!(
        !text.contains('\u{1b}'),
        "colour codes in a piped log:\n{text}"
    );
    let responses: Vec<&String> = log.iter().filter(|l| l.contains("response")).collect();
    assert!(
        responses.iter().any(|l| l.contains("/v1/completions")),
        "the completion's response line is logged:\n{text}"
    );
    assert!(
        !responses.iter().any(|l| ["/ready", "/health", "/metrics"]
            .iter()
            .any(|p| l.contains(p))),
        "probe responses at INFO:\n{text}"
    );
}
