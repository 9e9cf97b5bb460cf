# Test-stack stand-in for MinIO (compose.test.yml): s3s-fs, an implementation of the S3 REST
# API (SigV4 auth, buckets as directories) from crates.io (`cargo install s3s-fs --features
# binary`), on the same debian:bookworm-slim base. Build context: a directory holding that
# binary as `s3s-fs`. It takes MinIO's root credentials from the same variables and makes
# the buckets named in S3_BUCKETS at start (MinIO needs the `minio-init` job for that).
FROM debian:bookworm-slim
COPY s3s-fs /usr/local/bin/s3s-fs
RUN mkdir -p /data && chown nobody:nogroup /data
USER nobody
ENV S3_BUCKETS=quantmesh
EXPOSE 9000
HEALTHCHECK --interval=2s --timeout=2s --retries=30 \
  CMD ["bash", "-c", "exec 3<>/dev/tcp/127.0.0.1/9000"]
ENTRYPOINT ["bash", "-c", "for b in $S3_BUCKETS; do mkdir -p \"$0/$b\"; done; exec s3s-fs --host 0.0.0.0 --port 9000 --access-key \"$MINIO_ROOT_USER\" --secret-key \"$MINIO_ROOT_PASSWORD\" \"$0\""]
CMD ["/data"]
