# Embedded all-in-one image (gateway + engine in one process).
# Not built in CI: no Docker engine runs on our build machines. See README "Status".
FROM rust:1.95-bookworm AS build
WORKDIR /src
COPY . .
RUN cargo build --release -p quantmesh

FROM debian:bookworm-slim
COPY --from=build /src/target/release/quantmesh /usr/local/bin/quantmesh
ENV QUANTMESH_HOST=0.0.0.0 QUANTMESH_MODEL_DIR=/models/quantmesh-tiny
VOLUME /models
EXPOSE 8080
ENTRYPOINT ["quantmesh"]
CMD ["serve"]
