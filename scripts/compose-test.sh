#!/usr/bin/env bash
# The compose test stack on its own: makes the base image (debootstrap + docker import, once),
# builds the quantmesh binary, then runs the container tests, which build the images
# (quantmesh from that binary, tansu, Debian's prometheus), bring up docker-compose.yml +
# compose.test.yml and check it (services/quantmesh/tests/compose.rs). The full suite
# (./scripts/test.sh) runs the same tests.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/base-image.sh
export QUANTMESH_TEST_MODELS="${QUANTMESH_TEST_MODELS:-$HOME/.cache/quantmesh/test-models}"
cargo run --quiet -p quantmesh --features evolution,cloud -- model fetch smollm2-135m-instruct --dir "$QUANTMESH_TEST_MODELS" --quiet
exec cargo nextest run -p quantmesh --features evolution,cloud --test compose --no-capture "$@"
