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
# and 32 concurrent streams of 64 tokens. Ratio = quantmesh ÷ llama.cpp.
#
# llama-server is built once from the llama.cpp that the llama-cpp-python 0.3.36 source
# package (PyPI) vendors, with scripts/llama-cpp-cmake-args.sh's flags, into $LLAMA_DIR.
# Settings: BENCH_THREADS (default: all cores), BENCH_ROUNDS (3), QUANTMESH_BENCH_MODELS (models),
# BENCH_FILES ("Q8_0 Q4_1"; also W2048, W1024, Q4_K_M), BENCH_OUT (target/bench-llamacpp), LLAMA_DIR.
set -euo pipefail
cd "$(dirname "$0")/.."
log() { printf '\033[1m[bench]\033[0m %s\n' "$*" >&2; }

MODELS="${QUANTMESH_BENCH_MODELS:-models}"
THREADS="${BENCH_THREADS:-$(nproc)}"
ROUNDS="${BENCH_ROUNDS:-3}"
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
BIN=target/release

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
declare -A FILE=([Q4_1]="$DIR/SmolLM2-135M-Instruct.Q4_1.gguf" [Q8_0]="$DIR/SmolLM2-135M-Instruct.Q8_0.gguf"
  [W2048]="$MODELS/random-llama-2048/random-llama-2048x4.Q8_0.gguf"
  [W1024]="$MODELS/random-llama-1024/random-llama-1024x8.Q8_0.gguf"
  [Q4_K_M]="$DIR/SmolLM2-135M-Instruct.Q4_K_M.gguf")
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
# What quantmesh serves for each file: the file itself, except for Q4_K_M (the checkpoint at
# that file's tensor bytes: tensors against tensors, the tokenizer's metadata left out).
declare -A SERVE_ARGS=()
for tag in $FILES; do SERVE_ARGS[$tag]="--model ${FILE[$tag]}"; done
if [[ " $FILES " == *" Q4_K_M "* ]]; then
  Q4KM_TENSORS="$(PYTHONPATH="$LLAMA_DIR/gguf-py" python3 -c 'import sys; from gguf import GGUFReader; print(sum(int(t.n_bytes) for t in GGUFReader(sys.argv[1]).tensors))' "${FILE[Q4_K_M]}")"
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
# prefill tok/s of one unique prompt of about $2 tokens against server $1
prefill() {
  local body
  body="$(python3 -c 'import json,sys; print(json.dumps({"prompt": sys.stdin.read(), "max_tokens": 1, "temperature": 0}))' <<<"$(prompt "$2")")"
  curl -s -o "$OUT/prefill.json" -w '%{time_total}' -H 'content-type: application/json' -d "$body" "$1/v1/completions" \
    | python3 -c 'import json,sys; t=float(sys.stdin.read()); u=json.load(open(sys.argv[1]))["usage"]; print(u["prompt_tokens"]/t)' "$OUT/prefill.json"
}
loadgen() { # url, concurrency, max tokens -> output tok/s (the table's last row)
  "$BIN/quantmesh-loadgen" --url "$1" --concurrency "$2" --requests "$(( $2 * 2 ))" --max-tokens "$3" 2>&1 \
    | tail -1 | awk -F'|' '{gsub(/ /,"",$7); print $7}'
}
measure() { # who, tag, url -> lines "who tag metric value"
  local url="$3"
  "$BIN/quantmesh-loadgen" --url "$url" --concurrency 1 --requests 1 --max-tokens 8 >/dev/null 2>&1 || true # warm-up
  echo "$1 $2 decode_b1 $(loadgen "$url" 1 128)"
  for n in 128 512; do echo "$1 $2 prefill_$n $(prefill "$url" "$n")"; done
  for c in 8 32; do echo "$1 $2 streams_$c $(loadgen "$url" "$c" 64)"; done
}

for round in $(seq 1 "$ROUNDS"); do
  for tag in $FILES; do
    file="${FILE[$tag]}"
    log "round $round/$ROUNDS, $tag: quantmesh serve"
    port="$(free_port)"
    # shellcheck disable=SC2086
    QUANTMESH_THREADS="$THREADS" "$BIN/quantmesh" serve ${SERVE_ARGS[$tag]} --port "$port" --log-format json \
      >"$OUT/serve-$tag-$round.log" 2>&1 &
    pid=$!
    wait_ready "http://127.0.0.1:$port/ready" 600 || { tail -20 "$OUT/serve-$tag-$round.log"; exit 1; }
    measure quantmesh "$tag" "http://127.0.0.1:$port" >>"$OUT/results.txt"
    kill -TERM "$pid"; wait "$pid" || true
    log "round $round/$ROUNDS, $tag: llama-server"
    port="$(free_port)"
    "$LLAMA_SERVER" -m "$file" -t "$THREADS" -tb "$THREADS" -np 32 -c 32768 --host 127.0.0.1 --port "$port" \
      >"$OUT/llama-server-$tag-$round.log" 2>&1 &
    pid=$!
    wait_ready "http://127.0.0.1:$port/health" 180 || { tail -20 "$OUT/llama-server-$tag-$round.log"; exit 1; }
    measure llama.cpp "$tag" "http://127.0.0.1:$port" >>"$OUT/results.txt"
    kill -TERM "$pid"; wait "$pid" 2>/dev/null || true
  done
done

python3 - "$OUT/results.txt" "$THREADS" "$ROUNDS" "$FILES" <<'EOF'
import sys, statistics, collections, platform, subprocess
path, threads, rounds, files = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4].split()
v = collections.defaultdict(list)
for line in open(path):
    who, tag, metric, value = (line.split() + ["nan"])[:4]
    try:
        v[who, tag, metric].append(float(value))
    except ValueError:
        v[who, tag, metric].append(float("nan"))
cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), platform.processor())
about = {"Q8_0": "SmolLM2-135M-Instruct Q8_0", "Q4_1": "SmolLM2-135M-Instruct Q4_1",
         "W2048": "W2048 = random-weight llama, hidden 2048, 4 layers, Q8_0",
         "W1024": "W1024 = random-weight llama of the bundled medium model's shape (hidden 1024, 8 layers), Q8_0",
         "Q4_K_M": "Q4_K_M = llama-server on SmolLM2's Q4_K_M file, quantmesh on the checkpoint at that file's tensor bytes"}
print(f"{'; '.join(about[t] for t in files)} on {cpu}, {threads} threads each, median of {rounds} interleaved rounds; ratio = quantmesh ÷ llama-server\n")
print("| file | metric | quantmesh | llama-server | ratio |\n|---|---|---|---|---|")
names = {"decode_b1": "decode tok/s, batch 1 (128 tokens)", "prefill_128": "prefill tok/s, 128-token prompt",
         "prefill_512": "prefill tok/s, 512-token prompt", "streams_8": "output tok/s, 8 concurrent streams",
         "streams_32": "output tok/s, 32 concurrent streams"}
for tag in files:
    for m, name in names.items():
        a = statistics.median(v["quantmesh", tag, m] or [float("nan")])
        b = statistics.median(v["llama.cpp", tag, m] or [float("nan")])
        print(f"| {tag} | {name} | {a:.0f} | {b:.0f} | {a / b:.2f}× |")
for tag in files:
    b1 = statistics.median(v["quantmesh", tag, "decode_b1"] or [float("nan")])
    s32 = statistics.median(v["quantmesh", tag, "streams_32"] or [float("nan")])
    print(f"\nquantmesh, {tag}: 32 streams ÷ its own batch-1 decode = {s32 / b1:.1f}×", end="")
print(f"\nRaw lines: {path}")
EOF
