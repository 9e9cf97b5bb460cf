#!/usr/bin/env bash
# Activation width, rotation and scale migration on a real model, quality and speed, one run:
#   1. the first-load plan (`quantmesh prescreen`, as the engine makes it on first load; it
#      carries the pre-screen's scale-migration factors for the groups it smoothed);
#   2. the quality table: every --split-activations mode (off, copyless, all) × rotation
#      block (none, 128) × scale migration (none, the plan's) × monitor (on, off), each
#      serving that plan; with the monitor on, it is fed first by traffic texts that are
#      never scored; then every configuration is scored teacher-forced on held-out texts
#      against the f32 float model (the checkpoint's exact dequantization, float
#      activations): mean / median / p99 KL, top-1 agreement, perplexity, and each row's
#      mean KL against the `all` row's over the same tokens (a paired bootstrap's 95 % interval);
#   3. the speed table: the INT8-only model's prefill and decode (`quantmesh-engine-bench`,
#      no monitor, so `copyless` runs every row with 8-bit activations: its upper bound) in
#      `all`, in `copyless` and in what `auto` chose on this machine, at each of SHAPES
#      (prompt tokens : decode steps), ROUNDS interleaved rounds, medians and their ratios
#      to `all`, with the measured 16-bit / 8-bit product ratio that decided.
#
#   ./scripts/bench-activations.sh [MODEL_DIR_OR_GGUF]
#
# Env: BENCH_BIN (a folder holding built quantmesh and quantmesh-engine-bench: no build), TOKENS per held-out text (512; the mean of so few tokens is
# carried by a few of them: at 2 048 the ratio to `all` had intervals of about ±5–8 % on SmolLM2), ROUNDS (3), SHAPES ("512:32 64:64"), BENCH_OUT (a temp dir), SPEED_ONLY=1 (step 3
# alone); the quality table's axes: SPLITS (off,copyless,all), ROTATIONS (0,128), SMOOTHINGS
# (none,plan), MONITORS (on,off).
# Held-out texts: GPL-3, Apache-2.0, MPL-2.0; traffic: LGPL-2.1, Artistic (all under
# /usr/share/common-licenses on every Debian machine).
set -euo pipefail
cd "$(dirname "$0")/.."
log() { printf '[bench-activations +%dm%02ds] %s\n' $((SECONDS / 60)) $((SECONDS % 60)) "$*" >&2; }

CACHE="${QUANTMESH_TEST_MODELS:-$HOME/.cache/quantmesh/test-models}"
M="${1:-$CACHE/smollm2-135m-instruct}"
TOKENS="${TOKENS:-512}"
ROUNDS="${ROUNDS:-3}"
# Speed shapes, prompt tokens : decode steps: long prompts (attention over ~540 positions at
# 32 streams), and short chats of 64 tokens each (32 streams × 64 tokens, as a user's load).
SHAPES="${SHAPES:-512:32 64:64}"
OUT="${BENCH_OUT:-$(mktemp -d)}"
L=/usr/share/common-licenses
mkdir -p "$OUT"

if [ -n "${BENCH_BIN:-}" ]; then
  # Binaries built elsewhere (e.g. target/debug: the same numbers for quality, not for speed).
  BIN="$BENCH_BIN"
else
  log "building (release)"
  cargo build --release -q -p quantmesh -p quantmesh-engine-tools --bin quantmesh --bin quantmesh-engine-bench
  BIN=target/release
fi
[ -e "$M" ] || "$BIN/quantmesh" model fetch smollm2-135m-instruct --dir "$CACHE" --quiet

if [ "${SPEED_ONLY:-0}" != 1 ]; then
  log "1. the first-load plan"
  "$BIN/quantmesh" prescreen --model "$M" --out "$OUT/plan.json" --quiet > "$OUT/prescreen.txt"

  SPLITS="${SPLITS:-off,copyless,all}" ROTATIONS="${ROTATIONS:-0,128}"
  SMOOTHINGS="${SMOOTHINGS:-none,plan}" MONITORS="${MONITORS:-on,off}"
  log "2. quality: activations $SPLITS x rotation $ROTATIONS x smoothing $SMOOTHINGS x monitor $MONITORS"
  "$BIN/quantmesh-engine-bench" --model "$M" --activation-table "$OUT/plan.json" \
    --held-out "$L/GPL-3" --held-out "$L/Apache-2.0" --held-out "$L/MPL-2.0" \
    --traffic "$L/LGPL-2.1" --traffic "$L/Artistic" --ppl-tokens "$TOKENS" \
    --splits "$SPLITS" --rotations "$ROTATIONS" --smoothings "$SMOOTHINGS" --monitors "$MONITORS" \
    | tee "$OUT/quality.txt"
fi

log "3. speed: all, copyless and auto, $ROUNDS interleaved rounds, shapes $SHAPES"
for r in $(seq "$ROUNDS"); do
  for shape in $SHAPES; do
    for mode in all copyless auto; do
      "$BIN/quantmesh-engine-bench" --model "$M" --plans int8 --batches 1,32 --prompt-len "${shape%:*}" \
        --decode-steps "${shape#*:}" --split-activations "$mode" > "$OUT/speed-$mode-$shape-$r.txt"
    done
  done
done
python3 - "$OUT" "$ROUNDS" $SHAPES <<'PY'
import statistics, sys
out, rounds, shapes = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
modes = ("all", "copyless", "auto")
def rows(path):
    lines = open(path).read().splitlines()
    width = next((l for l in lines if l.startswith("activation width")), "?")
    got = {}
    for line in lines:
        c = [x.strip() for x in line.strip("|").split("|")]
        if len(c) == 7 and c[0] == "int8" and c[2].isdigit():
            got[int(c[2])] = (float(c[3]), float(c[5]))
    return width, got
med, widths = {}, {}
for shape in shapes:
    for mode in modes:
        runs = [rows(f"{out}/speed-{mode}-{shape}-{r}.txt") for r in range(1, rounds + 1)]
        widths[mode] = runs[0][0]
        for b in sorted(runs[0][1]):
            med[(shape, mode, b)] = tuple(statistics.median(r[1][b][i] for r in runs) for i in (0, 1))
print(f"\nSpeed (INT8-only model, no monitor; a shape is prompt tokens : decode steps; medians of {rounds} interleaved rounds, tok/s; ratios to all):\n")
for mode in modes:
    print(f"- {mode}: {widths[mode]}")
print()
print("| prompt : steps | batch | prefill all | prefill copyless | × | prefill auto | × | decode all | decode copyless | × | decode auto | × |")
print("|---|---|---|---|---|---|---|---|---|---|---|---|")
for shape in shapes:
    for b in sorted({b for (s, _, b) in med if s == shape}):
        (pa, da), (pc, dc), (pu, du) = (med[(shape, m, b)] for m in modes)
        print(f"| {shape.replace(':', ' : ')} | {b} | {pa:.0f} | {pc:.0f} | {pc / pa:.2f} | {pu:.0f} | {pu / pa:.2f} | {da:.1f} | {dc:.1f} | {dc / da:.2f} | {du:.1f} | {du / da:.2f} |")
PY
log "done: $OUT"
