# Test-stack stand-in for MinIO (compose.test.yml): quantmesh-s3 (tests/s3-server), s3s-fs's
# implementation of the S3 REST API (SigV4 auth, buckets as directories; crates.io) with its
# writes made one at a time so that conditional PUTs are atomic, on the same
# debian:bookworm-slim base. Build context: a directory holding that binary as `quantmesh-s3`.
# It takes MinIO's root credentials from the same variables and makes the buckets named in
# S3_BUCKETS at start (MinIO needs the `minio-init` job for that).
FROM debian:bookworm-slim
COPY quantmesh-s3 /usr/local/bin/quantmesh-s3
RUN mkdir -p /data && chown nobody:nogroup /data
USER nobody
ENV S3_BUCKETS=quantmesh
EXPOSE 9000
HEALTHCHECK --interval=2s --timeout=2s --retries=30 \
  CMD ["bash", "-c", "exec 3<>/dev/tcp/127.0.0.1/9000"]
ENTRYPOINT ["bash", "-c", "for b in $S3_BUCKETS; do mkdir -p \"$0/$b\"; done; exec quantmesh-s3 --host 0.0.0.0 --port 9000 --access-key \"$MINIO_ROOT_USER\" --secret-key \"$MINIO_ROOT_PASSWORD\" \"$0\""]
CMD ["/data"]
