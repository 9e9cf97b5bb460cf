#!/usr/bin/env bash
# What the mesh costs and gives: the same streaming load (a) straight to an engine (what the
# embedded `quantmesh serve` is), (b) through `quantmesh gateway` to that one engine — the
# gateway hop — and (c) through the gateway to two engines. Interleaved rounds, same model,
# same machine; prints TTFT p50/p90, ITL p50, throughput and the ratios to (a).
#
#   ./scripts/bench-mesh.sh [ROUNDS] [MODEL]   # defaults: 2, smollm2-135m-instruct
#
# On a 2-core machine two engines share the same cores, so (c) measures the routing, not a
# capacity gain; on real hardware each engine has its own.
set -euo pipefail
cd "$(dirname "$0")/.."
rounds="${1:-2}"
model="${2:-smollm2-135m-instruct}"
models_dir="${QUANTMESH_TEST_MODELS:-$HOME/.cache/quantmesh/test-models}"
out=target/bench-mesh
mkdir -p "$out"
cargo build --quiet --release -p quantmesh --bin quantmesh
cargo build --quiet --release -p quantmesh-gateway --bin quantmesh-loadgen
bin=target/release
base=$((20000 + RANDOM % 20000))
e1=$base; e2=$((base + 1)); gw1=$((base + 2)); gw2=$((base + 3))
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; }
trap cleanup EXIT
ready() { for _ in $(seq 1 900); do curl -sf "http://127.0.0.1:$1/ready" >/dev/null && return; sleep 0.2; done; echo "port $1 never ready" >&2; exit 1; }
for p in $e1 $e2; do
  QUANTMESH_PLAN=none "$bin/quantmesh" engine --model "$model" --models-dir "$models_dir" --port "$p" \
    > "$out/engine-$p.log" 2>&1 & pids+=($!)
  ready "$p"
done
"$bin/quantmesh" gateway --port "$gw1" --engine "http://127.0.0.1:$e1" > "$out/gw1.log" 2>&1 & pids+=($!)
"$bin/quantmesh" gateway --port "$gw2" --engine "http://127.0.0.1:$e1" --engine "http://127.0.0.1:$e2" \
  > "$out/gw2.log" 2>&1 & pids+=($!)
ready "$gw1"; ready "$gw2"
sleep 2
load() { "$bin/quantmesh-loadgen" --url "http://127.0.0.1:$1" --concurrency 8 --requests 48 --max-tokens 48 > "$2"; }
"$bin/quantmesh-loadgen" --url "http://127.0.0.1:$e1" --concurrency 4 --requests 8 --max-tokens 16 >/dev/null
for i in $(seq 1 "$rounds"); do
  echo "[bench-mesh] round $i" >&2
  load "$e1" "$out/direct-$i.txt"
  load "$gw1" "$out/gw1-$i.txt"
  load "$gw2" "$out/gw2-$i.txt"
done
python3 - "$out" "$rounds" <<'PY'
import sys, statistics
out, rounds = sys.argv[1], int(sys.argv[2])
def row(path):
    for line in open(path):
        c = [x.strip() for x in line.strip().strip("|").split("|")]
        if len(c) == 6 and c[0].isdigit():
            t = [float(x) for x in c[2].split("/")]
            return t[0], t[1], float(c[3].split("/")[0]), float(c[5])
    raise SystemExit(f"no result row in {path}")
names = {"direct": "engine directly (= embedded serve)", "gw1": "gateway → 1 engine", "gw2": "gateway → 2 engines"}
res = {k: [row(f"{out}/{k}-{i}.txt") for i in range(1, rounds + 1)] for k in names}
med = {k: [statistics.median(r[j] for r in v) for j in range(4)] for k, v in res.items()}
print(f"\nMesh (48 streaming requests × 48 tokens at concurrency 8, medians of {rounds} interleaved rounds):\n")
print("| path | TTFT p50 ms | TTFT p90 ms | ITL p50 ms | output tok/s | TTFT p50 × direct | tok/s × direct |")
print("|---|---|---|---|---|---|---|")
d = med["direct"]
for k, n in names.items():
    m = med[k]
    print(f"| {n} | {m[0]:.1f} | {m[1]:.1f} | {m[2]:.2f} | {m[3]:.1f} | {m[0]/d[0]:.3f} | {m[3]/d[3]:.3f} |")
PY
