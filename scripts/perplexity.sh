#!/usr/bin/env bash
# Perplexity of SmolLM2-135M-Instruct on real English (the GPL-3 text every Debian machine
# has), first N tokens in windows of 256: quantmesh's float plan, INT8-only plan and the plan
# its activation monitor reaches, and llama.cpp on the same file and the same token ids.
#
#   ./scripts/perplexity.sh [TOKENS=1024] [TEXT=/usr/share/common-licenses/GPL-3]
set -euo pipefail
cd "$(dirname "$0")/.."
TOKENS="${1:-1024}"
TEXT="${2:-/usr/share/common-licenses/GPL-3}"
MODELS="${QUANTMESH_BENCH_MODELS:-models}"
cargo build --release --quiet -p quantmesh -p quantmesh-engine-tools --bin quantmesh --bin quantmesh-engine-bench
target/release/quantmesh model fetch smollm2-135m-instruct --dir "$MODELS" --quiet >/dev/null
GGUF="$MODELS/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf"
target/release/quantmesh-engine-bench --model "$GGUF" --plans dual --batches 1 --prompt-len 16 \
  --decode-steps 4 --ppl-text "$TEXT" --ppl-tokens "$TOKENS" | sed -n '/^Perplexity/,$p'
python3 - "$GGUF" "$TEXT" "$TOKENS" <<'PY'
import json, subprocess, sys
gguf, text, n = sys.argv[1], open(sys.argv[2]).read(), int(sys.argv[3])
run = lambda req: json.loads(subprocess.run([sys.executable, "scripts/llama_ref.py"], input=json.dumps(req),
                                            text=True, capture_output=True, check=True).stdout)
ids = run({"op": "tokenize", "model": gguf, "texts": [text]})["ids"][0][:n]
r = run({"op": "perplexity", "model": gguf, "ids": ids, "ctx": 256})
print(f"| llama.cpp (same file, same {len(ids)} token ids, windows of 256) | {r['ppl']:.3f} | |")
PY
