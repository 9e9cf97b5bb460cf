//! The real `quantmesh` binary: first run writes the bundled model, serves, answers HTTP,
//! and exits cleanly on SIGTERM.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

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
    let model = dir.path().join("model");
    let mut child = Command::new(env!("CARGO_BIN_EXE_quantmesh"))
        .args(["serve", "--port", "0", "--log-format", "json", "--model"])
        .arg(&model)
        .env("RUST_LOG", "info")
        .stderr(Stdio::piped())
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    // Read the log until the server says where it listens and that it is ready.
    let stderr = child.stderr.take().unwrap();
    let (tx, rx) = mpsc::channel::<String>();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    let mut addr = None;
    let mut log = Vec::new();
    loop {
        let line = rx
            .recv_timeout(Duration::from_secs(60))
            .expect("server log went quiet");
        let v: serde_json::Value = serde_json::from_str(&line).unwrap_or_default();
        if v["fields"]["message"] == "listening" {
            addr = v["fields"]["addr"].as_str().map(String::from);
        }
        let ready = v["fields"]["message"]
            .as_str()
            .is_some_and(|m| m.starts_with("ready"));
        log.push(line);
        if ready {
            break;
        }
    }
    let addr = addr.expect("listening line with addr");
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
    let rest: Vec<String> = rx.try_iter().collect();
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
