//! `quantmesh-s3` on loopback, through object_store's S3 client (SigV4 over HTTP, as tansu
//! and the engines use it): conditional writes made at the same moment are a
//! compare-and-swap — of many PUTs naming the same ETag exactly one succeeds and the others
//! are refused as failed preconditions, and of many creates of one new key exactly one
//! succeeds. Plain s3s-fs lets several through (its check and its write are not one step).

#![allow(clippy::unwrap_used, clippy::expect_used)]

use object_store::aws::AmazonS3Builder;
use object_store::path::Path;
use object_store::{ObjectStore, ObjectStoreExt, PutMode, PutOptions, PutPayload, UpdateVersion};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

struct Server {
    child: Child,
    port: u16,
    _root: tempfile::TempDir,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn server() -> Server {
    let root = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(root.path().join("log")).unwrap();
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let child = Command::new(env!("CARGO_BIN_EXE_quantmesh-s3"))
        .args(["--host", "127.0.0.1", "--port", &port.to_string()])
        .args(["--access-key", "test-key", "--secret-key", "test-secret"])
        .arg(root.path())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let t0 = Instant::now();
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(t0.elapsed() < Duration::from_secs(20), "not listening");
        std::thread::sleep(Duration::from_millis(20));
    }
    Server {
        child,
        port,
        _root: root,
    }
}

fn store(port: u16) -> Arc<dyn ObjectStore> {
    Arc::new(
        AmazonS3Builder::new()
            .with_endpoint(format!("http://127.0.0.1:{port}"))
            .with_allow_http(true)
            .with_region("us-east-1")
            .with_bucket_name("log")
            .with_access_key_id("test-key")
            .with_secret_access_key("test-secret")
            .build()
            .unwrap(),
    )
}

/// `writers` PUTs of `key` in `mode` at once, each with its own content (no write leaves the
/// ETag it found): (succeeded, refused as a failed precondition or an existing object).
async fn race(
    s: &Arc<dyn ObjectStore>,
    key: &Path,
    mode: PutMode,
    writers: usize,
) -> (usize, usize) {
    let puts = (0..writers).map(|i| {
        let (s, key, mode) = (s.clone(), key.clone(), mode.clone());
        tokio::spawn(async move {
            let body = PutPayload::from(format!("{key} {mode:?} writer {i}"));
            let opts = PutOptions {
                mode,
                ..Default::default()
            };
            s.put_opts(&key, body, opts).await
        })
    });
    let (mut won, mut refused) = (0, 0);
    for r in futures::future::join_all(puts).await {
        match r.unwrap() {
            Ok(_) => won += 1,
            Err(object_store::Error::Precondition { .. })
            | Err(object_store::Error::AlreadyExists { .. }) => refused += 1,
            Err(e) => panic!("a conditional PUT failed otherwise: {e}"),
        }
    }
    (won, refused)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_conditional_puts_are_a_compare_and_swap() {
    let srv = server();
    let s = store(srv.port);
    for round in 0..10 {
        // Creates of one new key: one wins.
        let fresh = Path::from(format!("offsets/{round}"));
        assert_eq!(
            race(&s, &fresh, PutMode::Create, 8).await,
            (1, 7),
            "round {round}"
        );
        // Swaps from the version every writer read: one wins, and the object is its write.
        let head = s.head(&fresh).await.unwrap();
        let seen = UpdateVersion {
            e_tag: head.e_tag.clone(),
            version: head.version.clone(),
        };
        assert_eq!(
            race(&s, &fresh, PutMode::Update(seen.clone()), 8).await,
            (1, 7),
            "round {round}"
        );
        let now = s.head(&fresh).await.unwrap();
        assert_ne!(
            now.e_tag, seen.e_tag,
            "round {round}: the winner's write is there"
        );
        // The old version no longer matches.
        assert_eq!(race(&s, &fresh, PutMode::Update(seen), 1).await, (0, 1));
    }
    // Plain writes and reads still work.
    let p = Path::from("plain/object");
    s.put(&p, PutPayload::from_static(b"hello")).await.unwrap();
    let body = s.get(&p).await.unwrap().bytes().await.unwrap();
    assert_eq!(body, bytes::Bytes::from_static(b"hello"));
}
