//! A local stand-in for a git forge's REST API (GitHub's pulls and labels endpoints, for
//! repository `acme/plans`) — **test code only**: no git forge server is installable from
//! our registries. It records every request (method, path, auth header, JSON body) for the
//! tests to check, and keeps the open pull requests so that "find the open PR for this
//! branch" works. Shared by `services/evolution/tests/forge.rs` and the end-to-end loop in
//! `services/quantmesh/tests/evolution.rs` (included there by path).

#![allow(clippy::unwrap_used, clippy::expect_used, dead_code)]

use std::sync::{Arc, Mutex};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

#[derive(Debug, Clone)]
pub struct Req {
    pub method: String,
    pub path: String,
    pub auth: String,
    pub body: serde_json::Value,
}

#[derive(Default)]
pub struct Stub {
    pub requests: Vec<Req>,
    /// Open pull requests: (number, head branch).
    pub open: Vec<(u64, String)>,
}

/// A local stand-in for `api.github.com` (owner `acme`, repo `plans`).
pub async fn start_stub() -> (String, Arc<Mutex<Stub>>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let state = Arc::new(Mutex::new(Stub::default()));
    let st = state.clone();
    tokio::spawn(async move {
        loop {
            let (mut sock, _) = listener.accept().await.unwrap();
            let st = st.clone();
            tokio::spawn(async move {
                let mut buf = Vec::new();
                let mut chunk = [0u8; 8192];
                let (head, body) = loop {
                    let n = sock.read(&mut chunk).await.unwrap();
                    if n == 0 {
                        return;
                    }
                    buf.extend_from_slice(&chunk[..n]);
                    if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                        let head = String::from_utf8_lossy(&buf[..i]).to_string();
                        let len = head
                            .lines()
                            .find_map(|l| {
                                let (k, v) = l.split_once(':')?;
                                k.eq_ignore_ascii_case("content-length")
                                    .then(|| v.trim().parse::<usize>().ok())?
                            })
                            .unwrap_or(0);
                        while buf.len() < i + 4 + len {
                            let n = sock.read(&mut chunk).await.unwrap();
                            buf.extend_from_slice(&chunk[..n]);
                        }
                        break (head, buf[i + 4..i + 4 + len].to_vec());
                    }
                };
                let mut lines = head.lines();
                let mut first = lines.next().unwrap().split_whitespace();
                let method = first.next().unwrap().to_string();
                let path = first.next().unwrap().to_string();
                let auth = lines
                    .filter_map(|l| l.split_once(':'))
                    .find(|(k, _)| k.eq_ignore_ascii_case("authorization"))
                    .map(|(_, v)| v.trim().to_string())
                    .unwrap_or_default();
                let body: serde_json::Value =
                    serde_json::from_slice(&body).unwrap_or(serde_json::Value::Null);
                let (status, answer) = {
                    let mut s = st.lock().unwrap();
                    s.requests.push(Req {
                        method: method.clone(),
                        path: path.clone(),
                        auth,
                        body: body.clone(),
                    });
                    let route = path.split('?').next().unwrap().to_string();
                    match (method.as_str(), route.as_str()) {
                        ("GET", "/repos/acme/plans/pulls") => {
                            let list: Vec<_> = s
                                .open
                                .iter()
                                .map(|(n, h)| serde_json::json!({"number": n, "html_url": format!("https://forge/acme/plans/pull/{n}"), "head": {"ref": h}}))
                                .collect();
                            ("200 OK", serde_json::Value::Array(list))
                        }
                        ("POST", "/repos/acme/plans/pulls") => {
                            let n = s.open.len() as u64 + 1;
                            let head = body["head"].as_str().unwrap_or_default().to_string();
                            s.open.push((n, head.clone()));
                            (
                                "201 Created",
                                serde_json::json!({"number": n, "html_url": format!("https://forge/acme/plans/pull/{n}"), "head": {"ref": head}}),
                            )
                        }
                        ("PATCH", r) if r.starts_with("/repos/acme/plans/pulls/") => {
                            let n: u64 = r.rsplit('/').next().unwrap().parse().unwrap();
                            let head = s
                                .open
                                .iter()
                                .find(|(m, _)| *m == n)
                                .map(|(_, h)| h.clone())
                                .unwrap_or_default();
                            (
                                "200 OK",
                                serde_json::json!({"number": n, "html_url": format!("https://forge/acme/plans/pull/{n}"), "head": {"ref": head}}),
                            )
                        }
                        ("POST", r)
                            if r.starts_with("/repos/acme/plans/issues/")
                                && r.ends_with("/labels") =>
                        {
                            ("200 OK", serde_json::json!([{"name": "quantmesh"}]))
                        }
                        _ => ("404 Not Found", serde_json::json!({"message": "Not Found"})),
                    }
                };
                let text = answer.to_string();
                let resp = format!(
                    "HTTP/1.1 {status}\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{text}",
                    text.len()
                );
                let _ = sock.write_all(resp.as_bytes()).await;
            });
        }
    });
    (url, state)
}
