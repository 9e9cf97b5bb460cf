# Test-stack stand-in for prom/prometheus (compose.test.yml): Debian's prometheus binary
# (package `prometheus`, 2.42) on the same debian:bookworm-slim base. Build context: a
# directory holding that binary as `prometheus`. Configuration and rules are mounted as in
# docker-compose.yml.
FROM debian:bookworm-slim
COPY prometheus /usr/local/bin/prometheus
RUN mkdir -p /prometheus /etc/prometheus && chown nobody:nogroup /prometheus
USER nobody
EXPOSE 9090
HEALTHCHECK --interval=2s --timeout=2s --retries=30 \
  CMD ["bash", "-c", "exec 3<>/dev/tcp/127.0.0.1/9090 && printf 'GET /-/ready HTTP/1.0\\r\\n\\r\\n' >&3 && head -1 <&3 | grep -q ' 200 '"]
ENTRYPOINT ["prometheus"]
CMD ["--config.file=/etc/prometheus/prometheus.yml", "--storage.tsdb.path=/prometheus"]
