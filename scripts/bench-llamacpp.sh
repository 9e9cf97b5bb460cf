#!/usr/bin/env bash
# quantmesh against llama.cpp's own server (`llama-server`, which batches: what a user would
# deploy instead) on SmolLM2-135M-Instruct: the same GGUF file, the same threads, the same
# machine and run, both over HTTP, in interleaved rounds; the table shows medians.
#
#   ./scripts/bench-llamacpp.sh            # ≈ 8 min the first time (builds llama-server), then ≈ 6 min
#
# Files: the wheel's Q4_1 file requantized to Q8_0 with llama.cpp's own quantizer (8-bit weights
# on both sides), and the Q4_1 file itself (quantmesh serves it as Q8_0 groups). `W2048` (not
# run unless named in BENCH_FILES): another shape on the same terms, a llama of hidden width
# 2048, 4 layers, 32 heads (8 for K/V), feed-forward 5632, random weights and SmolLM2's
# tokenizer (scripts/wide-gguf.py), quantized to Q8_0 by llama-quantize; `W1024` the same with
# the bundled medium model's shape (hidden 1024, 8 layers, 16 heads, 8 for K/V, feed-forward
# 2816) and SmolLM2's vocabulary. `Q4_K_M` (not run
# unless named): llama-server on the Q4_1 file requantized to Q4_K_M by llama-quantize, against
# quantmesh serving the Q4_1 checkpoint at the same bytes (`--weight-budget` = that file's
# tensor bytes, read with llama.cpp's gguf-py: the file without its header and metadata:
# the pre-screen's mix of 4- and 8-bit groups; the first round includes its one-off pre-screen
# in the start-up wait). scripts/bench-q4km.sh compares their quality.
# Rows: decode tok/s at batch 1 (one stream of 128 tokens); prefill tok/s of unique 128- and
# 512-token prompts (`max_tokens` 1, prompt tokens ÷ request time); total output tok/s with 8
# and 32 concurrent streams of 64 tokens. Both sides decode greedily (temperature 0, EOS
# ignored). llama-server runs in two KV configurations, its default f16 cache and
# `-fa on -ctk q8_0 -ctv q8_0` (8-bit like quantmesh's), and the better of the two per row is
# the peer: ratio = quantmesh ÷ that. Every round runs the servers in a fresh random order.
# A request that failed, or came back with fewer tokens than asked, is counted; a row with
# any is marked. Printed beside the table (scripts/bench_table.py): the CPU, llama.cpp's
# build id and flags, the kernels quantmesh chose, and the machine's read bandwidth (the
# kernel bench's STREAM-like read before every round, the highest reading) with batch-1
# decode as a share of the bound it sets
# (bandwidth ÷ the weight bytes a token reads: the file's tensors for llama-server,
# quantmesh's resident 8- and 4-bit tables and other weights, float copies left out), and
# beside it the decode's share of the bound read just before that server's measurements in
# the same round (median over the rounds).
#
# llama-server is built once from the llama.cpp that the llama-cpp-python 0.3.36 source
# package (PyPI) vendors, with scripts/llama-cpp-cmake-args.sh's flags, into $LLAMA_DIR.
# Settings: BENCH_THREADS (default: all cores), BENCH_ROUNDS (5), QUANTMESH_BENCH_MODELS (models),
# BENCH_FILES ("Q8_0 Q4_1"; also W2048, W1024, Q4_K_M), BENCH_OUT (target/bench-llamacpp), LLAMA_DIR,
# BENCH_DERIVED (target/bench-models: the files made here — requantized, random-weight — kept
# apart from the fetched model's directory, which must hold one checkpoint).
set -euo pipefail
cd "$(dirname "$0")/.."
log() { printf '\033[1m[bench]\033[0m %s\n' "$*" >&2; }

MODELS="${QUANTMESH_BENCH_MODELS:-models}"
DERIVED="${BENCH_DERIVED:-target/bench-models}"
THREADS="${BENCH_THREADS:-$(nproc)}"
ROUNDS="${BENCH_ROUNDS:-5}"
FILES="${BENCH_FILES:-Q8_0 Q4_1}"
# llama-server runs its AVX-512/VNNI kernels, never its AMX ones (scripts/llama-cpp-cmake-args.sh):
# built with GGML_AMX_INT8 on an AMX host that grants the tile state (2026-11-26, Intel Xeon,
# llama.cpp as vendored by llama-cpp-python 0.3.36), its first Q8_0 matmul dies with SIGILL on
# `tilezero` in tinygemm_kernel_amx, with or without the permission requested beforehand, so a
# user there runs the build without AMX.
LLAMA_FLAGS="$(scripts/llama-cpp-cmake-args.sh)"
LLAMA_DIR="${LLAMA_DIR:-$HOME/.cache/quantmesh/llama.cpp-0.3.36}"
OUT="${BENCH_OUT:-target/bench-llamacpp}"

log "building release binaries"
cargo build --release --quiet -p quantmesh -p quantmesh-gateway --bin quantmesh --bin quantmesh-loadgen
cargo build --release --quiet -p quantmesh-kernels --example kernel-bench
BIN="${CARGO_TARGET_DIR:-target}/release"  # where cargo built them (CARGO_TARGET_DIR is honoured)

LLAMA_SERVER="$LLAMA_DIR/build/bin/llama-server"
LLAMA_QUANTIZE="$LLAMA_DIR/build/bin/llama-quantize"
if [ ! -x "$LLAMA_SERVER" ] || [ ! -x "$LLAMA_QUANTIZE" ]; then
  log "building llama-server and llama-quantize from llama-cpp-python 0.3.36's vendored llama.cpp (once, ≈ 8 min; flags: $LLAMA_FLAGS)"
  python3 -m pip install --quiet --user cmake ninja 2>/dev/null \
    || python3 -m pip install --quiet --user --break-system-packages cmake ninja
  export PATH="$HOME/.local/bin:$PATH"
  src="$(mktemp -d)"
  python3 -m pip download --quiet --no-deps --no-binary llama-cpp-python llama-cpp-python==0.3.36 -d "$src"
  tar xzf "$src"/llama_cpp_python-0.3.36.tar.gz -C "$src"
  mkdir -p "$(dirname "$LLAMA_DIR")"
  rm -rf "$LLAMA_DIR"
  mv "$src/llama_cpp_python-0.3.36/vendor/llama.cpp" "$LLAMA_DIR"
  # shellcheck disable=SC2046
  cmake -S "$LLAMA_DIR" -B "$LLAMA_DIR/build" -G Ninja $LLAMA_FLAGS -DLLAMA_CURL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON -DCMAKE_BUILD_TYPE=Release >/dev/null
  cmake --build "$LLAMA_DIR/build" --target llama-server llama-quantize -j "$(nproc)" >/dev/null
fi

"$BIN/quantmesh" model fetch smollm2-135m-instruct --dir "$MODELS" --quiet >/dev/null
DIR="$MODELS/smollm2-135m-instruct"
declare -A FILE=([Q4_1]="$DIR/SmolLM2-135M-Instruct.Q4_1.gguf" [Q8_0]="$DERIVED/SmolLM2-135M-Instruct.Q8_0.gguf"
  [W2048]="$DERIVED/random-llama-2048x4.Q8_0.gguf"
  [W1024]="$DERIVED/random-llama-1024x8.Q8_0.gguf"
  [Q4_K_M]="$DERIVED/SmolLM2-135M-Instruct.Q4_K_M.gguf")
mkdir -p "$DERIVED"
for tag in $FILES; do
  [ -n "${FILE[$tag]:-}" ] || { log "BENCH_FILES: unknown file $tag (Q8_0, Q4_1, W2048, W1024, Q4_K_M)"; exit 2; }
done
if [ ! -f "${FILE[Q8_0]}" ]; then
  log "requantizing to Q8_0 with llama-quantize"
  "$LLAMA_QUANTIZE" --allow-requantize "${FILE[Q4_1]}" "${FILE[Q8_0]}.partial" Q8_0 "$THREADS" >/dev/null 2>&1
  mv "${FILE[Q8_0]}.partial" "${FILE[Q8_0]}"
fi
if [[ " $FILES " == *" Q4_K_M "* ]] && [ ! -f "${FILE[Q4_K_M]}" ]; then
  log "requantizing to Q4_K_M with llama-quantize"
  "$LLAMA_QUANTIZE" --allow-requantize "${FILE[Q4_1]}" "${FILE[Q4_K_M]}.partial" Q4_K_M "$THREADS" >/dev/null 2>&1
  mv "${FILE[Q4_K_M]}.partial" "${FILE[Q4_K_M]}"
fi
# A GGUF file's tensor bytes (llama.cpp's gguf-py, which needs numpy, from PyPI when the
# machine lacks it): the file without its header and metadata.
python3 -c 'import numpy' 2>/dev/null || python3 -m pip install --quiet --user numpy 2>/dev/null \
  || python3 -m pip install --quiet --user --break-system-packages numpy
tensor_bytes() { PYTHONPATH="$LLAMA_DIR/gguf-py" python3 -c 'import sys; from gguf import GGUFReader; print(sum(int(t.n_bytes) for t in GGUFReader(sys.argv[1]).tensors))' "$1"; }
# What quantmesh serves for each file: the file itself, except for Q4_K_M (the checkpoint at
# that file's tensor bytes: tensors against tensors, the tokenizer's metadata left out).
declare -A SERVE_ARGS=()
for tag in $FILES; do SERVE_ARGS[$tag]="--model ${FILE[$tag]}"; done
if [[ " $FILES " == *" Q4_K_M "* ]]; then
  Q4KM_TENSORS="$(tensor_bytes "${FILE[Q4_K_M]}")"
  SERVE_ARGS[Q4_K_M]="--model ${FILE[Q4_1]} --weight-budget $Q4KM_TENSORS"
fi
# The random-weight shapes (scripts/wide-gguf.py's arguments), written in f16 and quantized
# to Q8_0 by llama-quantize.
declare -A SHAPE=([W2048]="--hidden 2048 --ffn 5632 --layers 4 --heads 32 --kv-heads 8"
  [W1024]="--hidden 1024 --ffn 2816 --layers 8 --heads 16 --kv-heads 8")
for tag in W2048 W1024; do
  if [[ " $FILES " == *" $tag "* ]] && [ ! -f "${FILE[$tag]}" ]; then
    log "writing the random-weight llama $tag (scripts/wide-gguf.py ${SHAPE[$tag]}) and quantizing it to Q8_0"
    mkdir -p "$(dirname "${FILE[$tag]}")"
    f16="${FILE[$tag]%.Q8_0.gguf}.f16.gguf"
    # shellcheck disable=SC2086 # the shape is a list of arguments
    PYTHONPATH="$LLAMA_DIR/gguf-py" python3 scripts/wide-gguf.py "${FILE[Q8_0]}" "$f16" ${SHAPE[$tag]}
    "$LLAMA_QUANTIZE" "$f16" "${FILE[$tag]}.partial" Q8_0 "$THREADS" >/dev/null 2>&1
    mv "${FILE[$tag]}.partial" "${FILE[$tag]}"
    rm -f "$f16"
  fi
done

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
# A prompt of about $1 tokens that no earlier request shared (a fresh number first, then
# English text from the machine's license files).
prompt() {
  python3 - "$1" "$RANDOM$RANDOM" <<'PY'
import sys, pathlib
n, salt = int(sys.argv[1]), sys.argv[2]
words = pathlib.Path("/usr/share/common-licenses/Apache-2.0").read_text().split()
print(f"Request {salt}: " + " ".join(words[: int(n * 0.72)]))
PY
}
# "tok/s failed short" of one unique prompt of about $2 tokens against server $1 (prefill
# tok/s = prompt tokens ÷ request time; a non-200 answer or one without usage is failed).
prefill() {
  local body
  body="$(python3 -c 'import json,sys; print(json.dumps({"prompt": sys.stdin.read(), "max_tokens": 1, "temperature": 0}))' <<<"$(prompt "$2")")"
  curl -s -o "$OUT/prefill.json" -w '%{http_code} %{time_total}' -H 'content-type: application/json' -d "$body" "$1/v1/completions" \
    | python3 -c '
import json, sys
code, t = sys.stdin.read().split()
try:
    assert code == "200"
    print(json.load(open(sys.argv[1]))["usage"]["prompt_tokens"] / float(t), 0, 0)
except Exception:
    print("nan", 1, 0)' "$OUT/prefill.json"
}
loadgen() { # url, concurrency, max tokens -> "output tok/s failed short" (the table's last row)
  "$BIN/quantmesh-loadgen" --url "$1" --concurrency "$2" --requests "$(( $2 * 2 ))" --max-tokens "$3" --temperature 0 2>&1 \
    | tail -1 | awk -F'|' '{gsub(/ /,"",$3); gsub(/ /,"",$7); split($3, n, "/"); print $7, n[2]+0, n[3]+0}'
}
measure() { # who, tag, url -> lines "who tag metric value failed short"
  local url="$3"
  "$BIN/quantmesh-loadgen" --url "$url" --concurrency 1 --requests 1 --max-tokens 8 >/dev/null 2>&1 || true # warm-up
  echo "$1 $2 decode_b1 $(loadgen "$url" 1 128)"
  for n in 128 512; do echo "$1 $2 prefill_$n $(prefill "$url" "$n")"; done
  for c in 8 32; do echo "$1 $2 streams_$c $(loadgen "$url" "$c" 64)"; done
}
# llama-server's two KV configurations (the better per row is the peer).
declare -A LLAMA_KV=([llama-f16]="" [llama-q8kv]="-fa on -ctk q8_0 -ctv q8_0")

# The read bandwidth, measured before every round (no arguments: the bound uses the highest
# reading, since a reading taken while something else held the memory bus understates what
# the machine can do) and again just before each server's measurements (`bandwidth WHO TAG`,
# paired with that server's batch-1 decode: on a VM whose memory bandwidth moves between
# readings minutes apart, the decode's share of the bound read beside it says how close it
# came to what the memory delivered then).
bandwidth() { # [who tag]
  log "measuring the read bandwidth (kernel-bench --bandwidth-only, $THREADS threads)"
  QUANTMESH_THREADS="$THREADS" "$BIN/examples/kernel-bench" --bandwidth-only \
    | awk -v at="${1:+bandwidth_at $1 $2}" '/read bandwidth/ {print (at == "" ? "bandwidth" : at), $3}' >>"$OUT/about.txt"
}
echo "llama_build $("$LLAMA_SERVER" --version 2>&1 | grep -m1 -i 'version' | tr ' ' '_')" >>"$OUT/about.txt"
for tag in $FILES; do echo "llama_bytes $tag $(tensor_bytes "${FILE[$tag]}")" >>"$OUT/about.txt"; done

for round in $(seq 1 "$ROUNDS"); do
  bandwidth
  for tag in $FILES; do
    file="${FILE[$tag]}"
    for who in $(printf '%s\n' quantmesh llama-f16 llama-q8kv | shuf); do
      log "round $round/$ROUNDS, $tag: $who"
      port="$(free_port)"
      if [ "$who" = quantmesh ]; then
        # shellcheck disable=SC2086
        QUANTMESH_THREADS="$THREADS" "$BIN/quantmesh" serve ${SERVE_ARGS[$tag]} --port "$port" --log-format json \
          >"$OUT/serve-$tag-$round.log" 2>&1 &
        pid=$!
        wait_ready "http://127.0.0.1:$port/ready" 600 || { tail -20 "$OUT/serve-$tag-$round.log"; exit 1; }
        bandwidth quantmesh "$tag"
        measure quantmesh "$tag" "http://127.0.0.1:$port" >>"$OUT/results.txt"
        # The weight bytes a decode step reads (float copies are read only in fallback).
        curl -fs "http://127.0.0.1:$port/metrics" | awk -v tag="$tag" \
          '/^quantmesh_weight_bytes\{/ && !/form="float"/ {s += $2} END {print "quantmesh_bytes", tag, s}' >>"$OUT/about.txt"
        grep -m1 'kernels chosen' "$OUT/serve-$tag-$round.log" \
          | python3 -c 'import json,sys; f=json.loads(sys.stdin.read()).get("fields",{}); print("kernels", f.get("isa"), f.get("threads"))' >>"$OUT/about.txt" || true
        grep -m1 'activation width' "$OUT/serve-$tag-$round.log" \
          | python3 -c 'import json,sys; f=json.loads(sys.stdin.read()).get("fields",{}); print("width", f.get("mode"), f.get("ratio"))' >>"$OUT/about.txt" || true
      else
        # shellcheck disable=SC2086 # the KV settings are a list of arguments
        "$LLAMA_SERVER" -m "$file" -t "$THREADS" -tb "$THREADS" -np 32 -c 32768 ${LLAMA_KV[$who]} \
          --host 127.0.0.1 --port "$port" >"$OUT/$who-$tag-$round.log" 2>&1 &
        pid=$!
        wait_ready "http://127.0.0.1:$port/health" 180 || { tail -20 "$OUT/$who-$tag-$round.log"; exit 1; }
        bandwidth "$who" "$tag"
        measure "$who" "$tag" "http://127.0.0.1:$port" >>"$OUT/results.txt"
      fi
      kill -TERM "$pid"; wait "$pid" 2>/dev/null || true
    done
  done
done

python3 scripts/bench_table.py "$OUT" "$THREADS" "$ROUNDS" "$FILES" "$LLAMA_FLAGS"
