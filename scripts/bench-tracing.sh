#!/usr/bin/env bash
# What traces cost: the same streaming load against `quantmesh serve` with OTLP export off
# and on (every request sampled, spans exported over gRPC to a local receiver that accepts
# them all), interleaved, same model, same machine. Prints TTFT / TPOT / throughput per
# round and the ratios on ÷ off of the medians.
#
#   ./scripts/bench-tracing.sh [ROUNDS] [MODEL]   # defaults: 3, smollm2-135m-instruct (bundled:small works offline)
#
# The engine bench (quantmesh-engine-bench) drives the backend directly, without actors or
# HTTP, so it cannot see tracing; this measures the whole serving path instead.
set -euo pipefail
cd "$(dirname "$0")/.."
rounds="${1:-3}"
model="${2:-smollm2-135m-instruct}"
models_dir="${QUANTMESH_TEST_MODELS:-$HOME/.cache/quantmesh/test-models}"
out=target/bench-tracing
mkdir -p "$out"
cargo build --quiet --release -p quantmesh --bin quantmesh --example otlp_sink
cargo build --quiet --release -p quantmesh-gateway --bin quantmesh-loadgen
bin=target/release
port=$((20000 + RANDOM % 20000))

"$bin/examples/otlp_sink" > "$out/sink.log" 2>&1 &
sink=$!
trap 'kill $sink 2>/dev/null || true' EXIT
for _ in $(seq 1 50); do grep -q listening "$out/sink.log" && break; sleep 0.1; done
endpoint=$(awk '/listening/ {print $2; exit}' "$out/sink.log")

run() { # $1 = off|on, $2 = round
  local env=(QUANTMESH_PLAN=none)
  [ "$1" = on ] && env+=(OTEL_EXPORTER_OTLP_ENDPOINT="$endpoint" OTEL_EXPORTER_OTLP_PROTOCOL=grpc)
  env "${env[@]}" "$bin/quantmesh" serve --model "$model" --port "$port" \
    --models-dir "$models_dir" > "$out/serve-$1-$2.log" 2>&1 &
  local pid=$!
  for _ in $(seq 1 600); do curl -sf "http://127.0.0.1:$port/ready" >/dev/null && break; sleep 0.2; done
  # Warm-up, then the measured load.
  "$bin/quantmesh-loadgen" --url "http://127.0.0.1:$port" --concurrency 4 --requests 8 --max-tokens 16 >/dev/null
  "$bin/quantmesh-loadgen" --url "http://127.0.0.1:$port" --concurrency 8 --requests 64 --max-tokens 64 \
    > "$out/load-$1-$2.txt"
  kill -TERM "$pid"; wait "$pid" || true
}
for i in $(seq 1 "$rounds"); do
  for mode in off on; do
    echo "[bench-tracing] round $i: traces $mode" >&2
    run "$mode" "$i"
  done
done
sleep 1.5
spans=$(awk '/^spans/ {n=$2} END {print n+0}' "$out/sink.log")

python3 - "$out" "$rounds" "$spans" <<'PY'
import sys, statistics
out, rounds, spans = sys.argv[1], int(sys.argv[2]), sys.argv[3]
def row(path):
    for line in open(path):
        c = [x.strip() for x in line.strip().strip("|").split("|")]
        if len(c) == 6 and c[0].isdigit():
            ttft = [float(x) for x in c[2].split("/")]
            itl = [float(x) for x in c[3].split("/")]
            return ttft[0], itl[0], float(c[5])
    raise SystemExit(f"no result row in {path}")
res = {m: [row(f"{out}/load-{m}-{i}.txt") for i in range(1, rounds + 1)] for m in ("off", "on")}
print(f"\nTraces off vs on (OTLP/gRPC to a local receiver, every request sampled; {rounds} interleaved rounds, 64 streaming requests of 64 tokens at concurrency 8; {spans} spans received):\n")
print("| traces | TTFT p50 ms (per round) | TPOT (ITL p50) ms (per round) | output tok/s (per round) |")
print("|---|---|---|---|")
for m in ("off", "on"):
    r = res[m]
    print(f"| {m} | {' / '.join(f'{x[0]:.1f}' for x in r)} | {' / '.join(f'{x[1]:.2f}' for x in r)} | {' / '.join(f'{x[2]:.1f}' for x in r)} |")
med = {m: [statistics.median(x[k] for x in res[m]) for k in range(3)] for m in res}
print(f"| **on ÷ off (medians)** | {med['on'][0]/med['off'][0]:.3f} | {med['on'][1]/med['off'][1]:.3f} | {med['on'][2]/med['off'][2]:.3f} |")
PY
