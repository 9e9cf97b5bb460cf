#!/usr/bin/env bash
# quantmesh against llama.cpp (llama-cpp-python, same machine, same run, same GGUF files) on
# SmolLM2-135M-Instruct: the original Q4_1 file and a Q8_0 requantization of it (made with
# llama.cpp's llama_model_quantize, so both sides run 8-bit weights).
#
#   ./scripts/bench-llamacpp.sh            # prints a markdown table (≈ 10 min on 2 cores)
#
# Rows: prefill tok/s (128- and 512-token prompts) and decode tok/s at batch 1, in-process on
# both sides (quantmesh-engine-bench / llama_ref.py bench); total output tok/s with 8 and 32
# concurrent streaming requests over HTTP (quantmesh serve vs llama-cpp-python's server,
# both driven by quantmesh-loadgen). Ratios are quantmesh ÷ llama.cpp.
# Needs: llama-cpp-python (scripts/test.sh installs it); installs its [server] extra.
set -euo pipefail
cd "$(dirname "$0")/.."
log() { printf '\033[1m[bench]\033[0m %s\n' "$*" >&2; }

MODELS="${QUANTMESH_BENCH_MODELS:-models}"
THREADS="${BENCH_THREADS:-$(nproc)}"
export LLAMA_THREADS="$THREADS"
REQUESTS_PER_CLIENT="${BENCH_REQUESTS_PER_CLIENT:-2}"
MAX_TOKENS="${BENCH_MAX_TOKENS:-64}"

log "building release binaries"
cargo build --release --quiet -p quantmesh -p quantmesh-engine -p quantmesh-gateway \
  --bin quantmesh --bin quantmesh-engine-bench --bin quantmesh-loadgen
BIN=target/release

if ! python3 -c 'import uvicorn, fastapi, sse_starlette, starlette_context, pydantic_settings' >/dev/null 2>&1; then
  log "installing llama-cpp-python's server extra (fastapi, uvicorn, …)"
  python3 -m pip install --quiet --user "llama-cpp-python[server]==0.3.36" 2>/dev/null \
    || python3 -m pip install --quiet --user --break-system-packages "llama-cpp-python[server]==0.3.36"
fi

"$BIN/quantmesh" model fetch smollm2-135m-instruct --dir "$MODELS" --quiet >/dev/null
DIR="$MODELS/smollm2-135m-instruct"
Q41="$DIR/SmolLM2-135M-Instruct.Q4_1.gguf"
Q80="$DIR/SmolLM2-135M-Instruct.Q8_0.gguf"
if [ ! -f "$Q80" ]; then
  log "requantizing to Q8_0 with llama.cpp (llama_model_quantize)"
  printf '{"op":"quantize","model":"%s","out":"%s","type":"q8_0"}' "$Q41" "$Q80.partial" \
    | python3 scripts/llama_ref.py >/dev/null
  mv "$Q80.partial" "$Q80"
fi

# Raw outputs (engine bench tables, loadgen tables, server logs) stay here for inspection.
OUT="${BENCH_OUT:-target/bench-llamacpp}"
rm -rf "$OUT"; mkdir -p "$OUT"
trap 'kill $(jobs -p) 2>/dev/null || true' EXIT
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
wait_ready() { # url, seconds
  for _ in $(seq 1 "$(( $2 * 5 ))"); do
    curl -fs "$1" >/dev/null 2>&1 && return 0
    sleep 0.2
  done
  return 1
}
loadgen() { # base url, concurrency -> the loadgen table (its last row is the result)
  "$BIN/quantmesh-loadgen" --url "$1" --concurrency "$2" --requests "$(( $2 * REQUESTS_PER_CLIENT ))" \
    --max-tokens "$MAX_TOKENS" 2>&1
}

for tag in Q4_1 Q8_0; do
  file="$Q41"; [ "$tag" = Q8_0 ] && file="$Q80"
  log "$tag: in-process prefill/decode (quantmesh)"
  for plen in 128 512; do
    "$BIN/quantmesh-engine-bench" --model "$file" --batches 1 --prompt-len "$plen" --decode-steps 64 \
      --json "$OUT/ours-$tag-$plen.json" >"$OUT/ours-$tag-$plen.txt"
  done
  log "$tag: in-process prefill/decode (llama.cpp)"
  python3 - "$file" "$OUT/llama-$tag.json" <<'EOF'
import json, subprocess, sys
req = {"op": "bench", "model": sys.argv[1], "prompt_lens": [128, 512], "decode": 64,
       "ids": list(range(1000, 1600))}
out = subprocess.run([sys.executable, "scripts/llama_ref.py"], input=json.dumps(req), text=True,
                     capture_output=True, check=True).stdout
open(sys.argv[2], "w").write(out)
EOF
  log "$tag: HTTP throughput (quantmesh serve)"
  port="$(free_port)"
  "$BIN/quantmesh" serve --model "$file" --port "$port" --log-format json >"$OUT/serve-$tag.log" 2>&1 &
  pid=$!
  wait_ready "http://127.0.0.1:$port/ready" 120 || { cat "$OUT/serve-$tag.log"; exit 1; }
  for c in 8 32; do loadgen "http://127.0.0.1:$port" "$c" > "$OUT/ours-http-$tag-$c.txt"; done
  kill -TERM "$pid"; wait "$pid" || true
  log "$tag: HTTP throughput (llama.cpp server)"
  port="$(free_port)"
  # interrupt_requests off: by default a new request aborts the running one.
  python3 -m llama_cpp.server --model "$file" --host 127.0.0.1 --port "$port" --n_threads "$THREADS" \
    --n_ctx 4096 --interrupt_requests False >"$OUT/llama-server-$tag.log" 2>&1 &
  pid=$!
  wait_ready "http://127.0.0.1:$port/v1/models" 120 || { cat "$OUT/llama-server-$tag.log"; exit 1; }
  for c in 8 32; do loadgen "http://127.0.0.1:$port" "$c" > "$OUT/llama-http-$tag-$c.txt"; done
  kill -TERM "$pid"; wait "$pid" 2>/dev/null || true
done

python3 - "$OUT" "$THREADS" <<'EOF'
import json, sys, pathlib
out, threads = pathlib.Path(sys.argv[1]), sys.argv[2]
def http(p):
    """(output tok/s, ok, failed) from a loadgen table's last row."""
    try:
        row = [c.strip() for c in p.read_text().strip().splitlines()[-1].split("|")]
        ok, failed = (int(x) for x in row[2].split("/"))
        return float(row[6]), ok, failed
    except Exception:
        return float("nan"), 0, 0
print(f"SmolLM2-135M-Instruct, {threads} threads each, same machine and run; ratio = quantmesh ÷ llama.cpp\n")
print("| file | metric | quantmesh | llama.cpp | ratio |")
print("|---|---|---|---|---|")
for tag in ("Q4_1", "Q8_0"):
    llama = json.loads((out / f"llama-{tag}.json").read_text())
    rows = []
    for plen in (128, 512):
        ours = json.loads((out / f"ours-{tag}-{plen}.json").read_text())["dual"]["batch_1"]
        rows.append((f"prefill {plen} tok/s", ours["prefill_tok_s"], llama["prefill"][str(plen)]))
    ours = json.loads((out / f"ours-{tag}-128.json").read_text())["dual"]["batch_1"]
    rows.append(("decode tok/s, batch 1", ours["decode_tok_s"], llama["decode_b1"]))
    for c in (8, 32):
        a, b = http(out / f"ours-http-{tag}-{c}.txt"), http(out / f"llama-http-{tag}-{c}.txt")
        note = "" if a[2] == b[2] == 0 else f" (failed requests: quantmesh {a[2]}, llama.cpp {b[2]})"
        rows.append((f"HTTP output tok/s, {c} concurrent streams{note}", a[0], b[0]))
    for name, a, b in rows:
        print(f"| {tag} | {name} | {a:.0f} | {b:.0f} | {a / b:.2f}× |")
print(f"\nRaw outputs: {out}. quantmesh runs its default plan (every group INT8 + float copy, INT8 path; C8 KV);"
      " the file's type is what the float copies are dequantized from.")
EOF
