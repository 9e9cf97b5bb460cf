//! `quantmesh-s3`: the S3 server the container tests stand in for MinIO (whose image cannot
//! be pulled here). It is s3s-fs — the S3 REST API over a directory, buckets as folders,
//! SigV4 auth, from crates.io — with one change: requests that write take one lock, so a
//! conditional PUT (`If-Match: <etag>`, `If-None-Match: *`) is the compare-and-swap the S3
//! API promises (AWS S3 and MinIO make it atomic). s3s-fs checks the condition and then
//! writes, with nothing between two requests: two PUTs naming the same ETag both succeed.
//! tansu's S3 storage takes a partition's next offset by such a swap, so on plain s3s-fs two
//! producers writing one partition at the same moment were given one offset and one of the
//! two batches was lost (seen in the compose test).
//!
//! ```text
//! quantmesh-s3 --host 0.0.0.0 --port 9000 --access-key KEY --secret-key SECRET /data
//! ```
//!
//! The arguments are s3s-fs's. Stops on SIGTERM or Ctrl-C, letting open connections finish
//! for up to 10 s.

use clap::Parser;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto::Builder as ConnBuilder;
use s3s::auth::SimpleAuth;
use s3s::dto::*;
use s3s::service::S3ServiceBuilder;
use s3s::{S3Request, S3Response, S3Result, S3};
use std::path::PathBuf;
use std::time::Duration;
use tokio::net::TcpListener;
use tokio::sync::Mutex;

#[derive(Debug, Parser)]
#[command(
    version,
    about = "An S3 API server over a directory (s3s-fs) whose writes are atomic"
)]
struct Opt {
    /// Address to listen on.
    #[arg(long, default_value = "localhost")]
    host: String,
    /// Port to listen on.
    #[arg(long, default_value_t = 9000)]
    port: u16,
    /// Access key clients sign with (with --secret-key; without both, no authentication).
    #[arg(long, requires = "secret_key")]
    access_key: Option<String>,
    /// Secret key clients sign with.
    #[arg(long, requires = "access_key")]
    secret_key: Option<String>,
    /// The directory holding the buckets (one folder each).
    root: PathBuf,
}

/// s3s-fs with its writing requests one at a time.
struct Serialized {
    fs: s3s_fs::FileSystem,
    writes: Mutex<()>,
}

/// The S3 trait for [`Serialized`]: the `reads` passed straight to s3s-fs, the `writes`
/// one at a time, so a condition checked is still true when the write lands. (One macro
/// makes the whole impl, so that `async_trait` sees the methods.)
macro_rules! serialized {
    (
        reads { $($read:ident: $rin:ident -> $rout:ident;)* }
        writes { $($write:ident: $win:ident -> $wout:ident;)* }
    ) => {
        #[async_trait::async_trait]
        impl S3 for Serialized {
            $(
                async fn $read(&self, req: S3Request<$rin>) -> S3Result<S3Response<$rout>> {
                    self.fs.$read(req).await
                }
            )*
            $(
                async fn $write(&self, req: S3Request<$win>) -> S3Result<S3Response<$wout>> {
                    let _one_at_a_time = self.writes.lock().await;
                    self.fs.$write(req).await
                }
            )*
        }
    };
}

serialized! {
    reads {
        get_object: GetObjectInput -> GetObjectOutput;
        head_object: HeadObjectInput -> HeadObjectOutput;
        head_bucket: HeadBucketInput -> HeadBucketOutput;
        list_buckets: ListBucketsInput -> ListBucketsOutput;
        list_objects: ListObjectsInput -> ListObjectsOutput;
        list_objects_v2: ListObjectsV2Input -> ListObjectsV2Output;
        get_bucket_location: GetBucketLocationInput -> GetBucketLocationOutput;
        list_parts: ListPartsInput -> ListPartsOutput;
        create_multipart_upload: CreateMultipartUploadInput -> CreateMultipartUploadOutput;
        upload_part: UploadPartInput -> UploadPartOutput;
        upload_part_copy: UploadPartCopyInput -> UploadPartCopyOutput;
        abort_multipart_upload: AbortMultipartUploadInput -> AbortMultipartUploadOutput;
    }
    writes {
        put_object: PutObjectInput -> PutObjectOutput;
        copy_object: CopyObjectInput -> CopyObjectOutput;
        complete_multipart_upload: CompleteMultipartUploadInput -> CompleteMultipartUploadOutput;
        delete_object: DeleteObjectInput -> DeleteObjectOutput;
        delete_objects: DeleteObjectsInput -> DeleteObjectsOutput;
        create_bucket: CreateBucketInput -> CreateBucketOutput;
        delete_bucket: DeleteBucketInput -> DeleteBucketOutput;
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let opt = Opt::parse();
    let fs = s3s_fs::FileSystem::new(&opt.root)
        .map_err(|e| anyhow::anyhow!("serving {}: {e:?}", opt.root.display()))?;
    let service = {
        let mut b = S3ServiceBuilder::new(Serialized {
            fs,
            writes: Mutex::new(()),
        });
        if let (Some(ak), Some(sk)) = (opt.access_key, opt.secret_key) {
            b.set_auth(SimpleAuth::from_single(ak, sk));
        }
        b.build()
    };
    let listener = TcpListener::bind((opt.host.as_str(), opt.port))
        .await
        .map_err(|e| anyhow::anyhow!("listening on {}:{}: {e}", opt.host, opt.port))?;
    eprintln!(
        "quantmesh-s3: serving {} at http://{}",
        opt.root.display(),
        listener.local_addr()?
    );
    let http = ConnBuilder::new(TokioExecutor::new());
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    loop {
        let socket = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((socket, _)) => socket,
                Err(e) => {
                    eprintln!("quantmesh-s3: accepting a connection: {e}");
                    continue;
                }
            },
            _ = tokio::signal::ctrl_c() => break,
            _ = term.recv() => break,
        };
        let conn = http.serve_connection(TokioIo::new(socket), service.clone());
        let conn = graceful.watch(conn.into_owned());
        tokio::spawn(async move {
            let _ = conn.await;
        });
    }
    tokio::select! {
        () = graceful.shutdown() => {}
        () = tokio::time::sleep(Duration::from_secs(10)) => {}
    }
    Ok(())
}
