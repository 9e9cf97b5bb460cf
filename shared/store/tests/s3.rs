//! The store against a real S3 API server on loopback: s3s-fs (crates.io; `scripts/test.sh`
//! installs it), SigV4-signed requests over HTTP, as an engine or `quantmesh plan publish`
//! talks to MinIO or AWS S3. Credentials and endpoint come from the `AWS_*` variables, as in
//! production.

#![cfg(feature = "cloud")]
#![allow(clippy::unwrap_used, clippy::expect_used)]

use bytes::Bytes;
use quantmesh_store::{Location, StoreError, VersionedStore};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

struct S3Server {
    child: Child,
    port: u16,
    _root: tempfile::TempDir,
}

impl Drop for S3Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn s3_server(buckets: &[&str]) -> S3Server {
    let root = tempfile::tempdir().unwrap();
    for b in buckets {
        std::fs::create_dir_all(root.path().join(b)).unwrap();
    }
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let child = Command::new("s3s-fs")
        .args(["--host", "127.0.0.1", "--port", &port.to_string()])
        .args(["--access-key", "test-key", "--secret-key", "test-secret"])
        .arg(root.path())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("s3s-fs, the S3 server the tests use (cargo install s3s-fs --features binary; scripts/test.sh does)");
    let t0 = Instant::now();
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "s3s-fs did not listen"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    S3Server {
        child,
        port,
        _root: root,
    }
}

/// The object store settings the engines get in the compose stack, by environment.
fn aws_env(port: u16, secret: &str) {
    // nextest runs each test in its own process: nothing else reads this environment.
    std::env::set_var("AWS_ENDPOINT", format!("http://127.0.0.1:{port}"));
    std::env::set_var("AWS_ALLOW_HTTP", "true");
    std::env::set_var("AWS_REGION", "us-east-1");
    std::env::set_var("AWS_ACCESS_KEY_ID", "test-key");
    std::env::set_var("AWS_SECRET_ACCESS_KEY", secret);
}

#[tokio::test]
async fn plans_publish_and_read_back_through_a_real_s3_api() {
    let s3 = s3_server(&["plans"]);
    aws_env(s3.port, "test-secret");
    let latest = Location::parse("s3://plans/model-a/latest").unwrap();
    // An empty store answers "not found" (an engine with an optional source waits for it).
    assert!(
        matches!(latest.read().await, Err(StoreError::NotFound(_))),
        "{:?}",
        latest.read().await
    );
    let vs = VersionedStore::parse("s3://plans/model-a").unwrap();
    vs.check_writable().await.unwrap();
    let a = vs.publish(Bytes::from_static(b"{\"v\":1}")).await.unwrap();
    assert_eq!(a.latest_url, "s3://plans/model-a/latest");
    assert_eq!(&latest.read().await.unwrap()[..], b"{\"v\":1}");
    // Publishing is idempotent and content-addressed; latest follows the newest.
    let again = vs.publish(Bytes::from_static(b"{\"v\":1}")).await.unwrap();
    assert_eq!(again.object, a.object);
    let b = vs.publish(Bytes::from_static(b"{\"v\":2}")).await.unwrap();
    assert_ne!(a.object, b.object);
    assert_eq!(&latest.read().await.unwrap()[..], b"{\"v\":2}");
    let old = Location::parse(&a.object_url).unwrap();
    assert_eq!(&old.read().await.unwrap()[..], b"{\"v\":1}");

    // Wrong credentials are an error that says so, not "not found".
    aws_env(s3.port, "wrong-secret");
    let denied = Location::parse("s3://plans/model-a/latest")
        .unwrap()
        .read()
        .await
        .unwrap_err();
    assert!(matches!(denied, StoreError::Io(..)), "{denied}");
    let vs = VersionedStore::parse("s3://plans/model-a").unwrap();
    assert!(matches!(
        vs.check_writable().await,
        Err(StoreError::NotWritable(..))
    ));
}
