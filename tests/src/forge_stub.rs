//! A local stand-in for a git forge's REST API (GitHub's pulls and labels endpoints, for
//! repository `acme/plans`) — **test code only**: no git forge server is installable from
//! our registries. It records every request (method, path, auth header, JSON body) for the
//! tests to check, and keeps the pull requests (open, closed, merged) so that looking up a
//! branch's pull requests works. Lists are paged like Gitea's (`limit`, `page`, no `head`
//! filter): a client that reads one page misses older ones. Used by
//! `services/evolution/tests/forge.rs` and the end-to-end loop in
//! `services/quantmesh/tests/evolution.rs`.

use std::sync::{Arc, Mutex};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

#[derive(Debug, Clone)]
pub struct Req {
    pub method: String,
    pub path: String,
    pub auth: String,
    pub body: serde_json::Value,
}

#[derive(Debug, Clone)]
pub struct Pr {
    pub number: u64,
    pub head: String,
    pub open: bool,
    pub merged: bool,
}

#[derive(Default)]
pub struct Stub {
    pub requests: Vec<Req>,
    pub pulls: Vec<Pr>,
}

impl Stub {
    /// A new pull request from `head` (what `POST /pulls` does).
    pub fn add(&mut self, head: &str) -> u64 {
        let number = self.pulls.len() as u64 + 1;
        self.pulls.push(Pr {
            number,
            head: head.into(),
            open: true,
            merged: false,
        });
        number
    }

    /// Close pull request `number`, merged or not (what a reviewer does).
    pub fn close(&mut self, number: u64, merged: bool) {
        let p = self.pulls.iter_mut().find(|p| p.number == number).unwrap();
        p.open = false;
        p.merged = merged;
    }

    pub fn open(&self) -> Vec<&Pr> {
        self.pulls.iter().filter(|p| p.open).collect()
    }
}

fn pr_json(p: &Pr) -> serde_json::Value {
    let n = p.number;
    serde_json::json!({
        "number": n,
        "html_url": format!("https://forge/acme/plans/pull/{n}"),
        "head": {"ref": p.head},
        "state": if p.open { "open" } else { "closed" },
        "merged_at": if p.merged { serde_json::json!("2026-01-01T00:00:00Z") } else { serde_json::Value::Null },
    })
}

/// A query parameter of `path`.
fn param<'a>(path: &'a str, key: &str) -> Option<&'a str> {
    path.split_once('?')?
        .1
        .split('&')
        .filter_map(|kv| kv.split_once('='))
        .find(|(k, _)| *k == key)
        .map(|(_, v)| v)
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
                            let state = param(&path, "state").unwrap_or("open");
                            let limit: usize = param(&path, "limit")
                                .and_then(|v| v.parse().ok())
                                .unwrap_or(30);
                            let page: usize = param(&path, "page")
                                .and_then(|v| v.parse().ok())
                                .unwrap_or(1);
                            // Newest first, like both forges' default order.
                            let list: Vec<_> = s
                                .pulls
                                .iter()
                                .rev()
                                .filter(|p| state == "all" || (state == "open") == p.open)
                                .skip((page - 1) * limit)
                                .take(limit)
                                .map(pr_json)
                                .collect();
                            ("200 OK", serde_json::Value::Array(list))
                        }
                        ("POST", "/repos/acme/plans/pulls") => {
                            let head = body["head"].as_str().unwrap_or_default().to_string();
                            let n = s.add(&head);
                            let p = s.pulls[n as usize - 1].clone();
                            ("201 Created", pr_json(&p))
                        }
                        ("PATCH", r) if r.starts_with("/repos/acme/plans/pulls/") => {
                            let n: u64 = r.rsplit('/').next().unwrap().parse().unwrap();
                            match s.pulls.iter().find(|p| p.number == n) {
                                Some(p) => ("200 OK", pr_json(p)),
                                None => {
                                    ("404 Not Found", serde_json::json!({"message": "Not Found"}))
                                }
                            }
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
