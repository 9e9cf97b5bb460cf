//! Real git repositories for the tests: a bare plan repository (`plan_repo`), and a real git
//! server over HTTP that requires credentials: git's own `git http-backend` (the
//! smart-HTTP CGI program that ships with git) behind a small HTTP front that asks for Basic
//! authentication and refuses every request without the expected user and token, as a forge
//! does for a private repository. The front records each request's `Authorization` header for
//! the tests to check. Requests are read with `Content-Length` or chunked bodies; answers
//! close the connection.

use std::path::Path;
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Run git in `dir`; its stdout (a failure fails the test, with git's stderr).
pub fn git(dir: &Path, args: &[&str]) -> String {
    let out = std::process::Command::new("git")
        .arg("-C")
        .arg(dir)
        .args(args)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "git {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).to_string()
}

/// A bare repository `root/plans.git` whose `main` holds `sensitive_layers.json` with
/// `plan` (committed through a clone in `root/seed`). Returns its path.
pub fn plan_repo(root: &Path, plan: &str) -> std::path::PathBuf {
    git(
        root,
        &["init", "--quiet", "--bare", "-b", "main", "plans.git"],
    );
    git(root, &["clone", "--quiet", "plans.git", "seed"]);
    let seed = root.join("seed");
    std::fs::write(seed.join("sensitive_layers.json"), plan).unwrap();
    git(&seed, &["add", "."]);
    git(
        &seed,
        &[
            "-c",
            "user.name=t",
            "-c",
            "user.email=t@t",
            "commit",
            "--quiet",
            "-m",
            "plan",
        ],
    );
    git(&seed, &["push", "--quiet", "origin", "HEAD:main"]);
    root.join("plans.git")
}

/// The server: `url(repo)` is the clone URL of `root/repo`.
pub struct GitHttp {
    pub base: String,
    /// Every request's `Authorization` header ("" when it had none), in order.
    pub auth_seen: Arc<Mutex<Vec<String>>>,
}

impl GitHttp {
    pub fn url(&self, repo: &str) -> String {
        format!("{}/{repo}", self.base)
    }
}

fn base64(bytes: &[u8]) -> String {
    const A: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::new();
    for c in bytes.chunks(3) {
        let n = (u32::from(c[0]) << 16)
            | (u32::from(*c.get(1).unwrap_or(&0)) << 8)
            | u32::from(*c.get(2).unwrap_or(&0));
        for i in 0..4 {
            if i <= c.len() {
                out.push(A[(n >> (18 - 6 * i)) as usize & 63] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

/// The `Authorization` header of `user` with `token`.
pub fn basic(user: &str, token: &str) -> String {
    format!("Basic {}", base64(format!("{user}:{token}").as_bytes()))
}

/// Serve the bare repositories under `root`, answering only requests authorized as `user`
/// with `token`.
pub async fn start(root: &Path, user: &str, token: &str) -> GitHttp {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let auth_seen = Arc::new(Mutex::new(Vec::new()));
    let expected = basic(user, token);
    let (root, user) = (root.to_path_buf(), user.to_string());
    let seen = auth_seen.clone();
    tokio::spawn(async move {
        while let Ok((sock, _)) = listener.accept().await {
            let (root, user, expected, seen) =
                (root.clone(), user.clone(), expected.clone(), seen.clone());
            tokio::spawn(async move {
                let _ = serve_one(sock, &root, &user, &expected, &seen).await;
            });
        }
    });
    GitHttp { base, auth_seen }
}

async fn serve_one(
    mut sock: tokio::net::TcpStream,
    root: &Path,
    user: &str,
    expected: &str,
    seen: &Mutex<Vec<String>>,
) -> std::io::Result<()> {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 16384];
    let head_end = loop {
        let n = sock.read(&mut chunk).await?;
        if n == 0 {
            return Ok(());
        }
        buf.extend_from_slice(&chunk[..n]);
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break i;
        }
    };
    let head = String::from_utf8_lossy(&buf[..head_end]).to_string();
    let mut rest = buf[head_end + 4..].to_vec();
    let mut lines = head.lines();
    let mut first = lines.next().unwrap_or("").split_whitespace();
    let method = first.next().unwrap_or("").to_string();
    let target = first.next().unwrap_or("").to_string();
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_string()))
        .collect();
    let header = |k: &str| {
        headers
            .iter()
            .find(|(h, _)| h == k)
            .map(|(_, v)| v.clone())
            .unwrap_or_default()
    };
    let auth = header("authorization");
    seen.lock().unwrap().push(auth.clone());
    if auth != expected {
        let body = "authentication required\n";
        let answer = format!(
            "HTTP/1.1 401 Unauthorized\r\nWWW-Authenticate: Basic realm=\"git\"\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        );
        return sock.write_all(answer.as_bytes()).await;
    }
    // The body: by length, or chunked.
    let body = if header("transfer-encoding").eq_ignore_ascii_case("chunked") {
        let mut out = Vec::new();
        loop {
            if let Some(i) = rest.windows(2).position(|w| w == b"\r\n") {
                let size = usize::from_str_radix(String::from_utf8_lossy(&rest[..i]).trim(), 16)
                    .unwrap_or(0);
                if size == 0 {
                    break;
                }
                if rest.len() >= i + 2 + size + 2 {
                    out.extend_from_slice(&rest[i + 2..i + 2 + size]);
                    rest.drain(..i + 2 + size + 2);
                    continue;
                }
            }
            let n = sock.read(&mut chunk).await?;
            if n == 0 {
                break;
            }
            rest.extend_from_slice(&chunk[..n]);
        }
        out
    } else {
        let len: usize = header("content-length").parse().unwrap_or(0);
        while rest.len() < len {
            let n = sock.read(&mut chunk).await?;
            if n == 0 {
                break;
            }
            rest.extend_from_slice(&chunk[..n]);
        }
        rest.truncate(len);
        rest
    };
    let (path, query) = target.split_once('?').unwrap_or((&target, ""));
    let mut cgi = tokio::process::Command::new("git")
        .arg("http-backend")
        .env("GIT_PROJECT_ROOT", root)
        .env("GIT_HTTP_EXPORT_ALL", "1")
        .env("REMOTE_USER", user)
        .env("REMOTE_ADDR", "127.0.0.1")
        .env("REQUEST_METHOD", &method)
        .env("PATH_INFO", path)
        .env("QUERY_STRING", query)
        .env("CONTENT_TYPE", header("content-type"))
        .env("CONTENT_LENGTH", body.len().to_string())
        .env("HTTP_CONTENT_ENCODING", header("content-encoding"))
        .env("GIT_PROTOCOL", header("git-protocol"))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()?;
    if let Some(mut stdin) = cgi.stdin.take() {
        stdin.write_all(&body).await?;
    }
    let out = cgi.wait_with_output().await?;
    // CGI output: header lines, a blank line, the body.
    let split = out
        .stdout
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .map(|i| (i, 4))
        .or_else(|| {
            out.stdout
                .windows(2)
                .position(|w| w == b"\n\n")
                .map(|i| (i, 2))
        });
    let (cgi_head, cgi_body) = match split {
        Some((i, n)) => (
            String::from_utf8_lossy(&out.stdout[..i]).to_string(),
            out.stdout[i + n..].to_vec(),
        ),
        None => (String::new(), out.stdout.clone()),
    };
    let mut status = "200 OK".to_string();
    let mut answer_headers = String::new();
    for l in cgi_head
        .lines()
        .map(str::trim_end)
        .filter(|l| !l.is_empty())
    {
        match l.split_once(':') {
            Some((k, v)) if k.eq_ignore_ascii_case("status") => status = v.trim().to_string(),
            _ => {
                answer_headers.push_str(l);
                answer_headers.push_str("\r\n");
            }
        }
    }
    let mut answer = format!(
        "HTTP/1.1 {status}\r\n{answer_headers}Content-Length: {}\r\nConnection: close\r\n\r\n",
        cgi_body.len()
    )
    .into_bytes();
    answer.extend_from_slice(&cgi_body);
    sock.write_all(&answer).await
}

#[cfg(test)]
mod tests {
    #[test]
    fn base64_matches_the_rfc_examples() {
        assert_eq!(super::base64(b"f"), "Zg==");
        assert_eq!(super::base64(b"fo"), "Zm8=");
        assert_eq!(super::base64(b"foo"), "Zm9v");
        assert_eq!(super::base64(b"foobar"), "Zm9vYmFy");
    }
}
