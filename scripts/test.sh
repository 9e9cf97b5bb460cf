#!/usr/bin/env bash
# Run quantmesh's whole test suite on a fresh machine: installs what the tests need,
# then runs every test of the workspace with cargo-nextest.
#
#   ./scripts/test.sh [extra nextest args]
set -euo pipefail
cd "$(dirname "$0")/.."

log() { printf '\033[1m[test.sh]\033[0m %s\n' "$*" >&2; }

if ! cargo nextest --version >/dev/null 2>&1; then
  log "cargo-nextest not found: installing it (one-off, a few minutes)"
  cargo install cargo-nextest --locked
fi

# Tests build the bundled model themselves (quantmesh model init); nothing to download.
log "running the test suite"
exec cargo nextest run --workspace --no-fail-fast "$@"
