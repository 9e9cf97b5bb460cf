#!/usr/bin/env bash
# Engine bench before/after: builds quantmesh-engine-bench at BASE (a git revision) and at
# the working tree, runs them interleaved on the same machine, and prints the speed tables
# side by side with ratios (after ÷ before). For refactors that must not cost speed.
#
#   ./scripts/bench-compare.sh BASE [ROUNDS] [-- bench args]
#   ./scripts/bench-compare.sh a0650c3 2 -- --size small --batches 1,8
#
# Each binary runs ROUNDS times (default 2), alternating; the best of its rounds counts
# (highest tok/s, lowest ms). Raw outputs: target/bench-compare/{base,head}-N.txt.
set -euo pipefail
cd "$(dirname "$0")/.."
base_rev="${1:?usage: bench-compare.sh BASE [ROUNDS] [-- bench args]}"
shift
rounds=2
if [ $# -gt 0 ] && [ "$1" != "--" ]; then rounds="$1"; shift; fi
[ "${1:-}" = "--" ] && shift
out=target/bench-compare
mkdir -p "$out"
export CARGO_TARGET_DIR="$PWD/$out/target"

wt="$out/base-src"
if [ -d "$wt" ]; then git worktree remove --force "$wt" 2>/dev/null || rm -rf "$wt"; fi
git worktree prune
git worktree add --detach --quiet "$wt" "$base_rev"
trap 'git worktree remove --force "$wt" 2>/dev/null || true' EXIT

build() { # $1 = source dir, $2 = where to copy the binary
  echo "[bench-compare] building the bench in $1" >&2
  # The bench lives in quantmesh-engine-tools (in quantmesh-engine at older revisions).
  local pkg=quantmesh-engine-tools
  [ -d "$1/services/engine-tools" ] || pkg=quantmesh-engine
  cargo build --quiet --release -p "$pkg" --bin quantmesh-engine-bench \
    --manifest-path "$1/Cargo.toml"
  cp "$CARGO_TARGET_DIR/release/quantmesh-engine-bench" "$2"
}
build "$wt" "$out/bench-base"
build "$PWD" "$out/bench-head"

for i in $(seq 1 "$rounds"); do
  for which in base head; do
    echo "[bench-compare] round $i: $which" >&2
    (cd "$out" && "./bench-$which" "$@") > "$out/$which-$i.txt"
  done
done

python3 - "$out" "$rounds" "$base_rev" <<'PY'
import re, sys, glob
out, rounds, rev = sys.argv[1], int(sys.argv[2]), sys.argv[3]

def tables(path):
    """Speed rows keyed by (plan, batch) and monitoring rows keyed by variant."""
    speed, mon = {}, {}
    for line in open(path):
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 7 and cells[2].isdigit():
            speed[(cells[0], int(cells[2]))] = (float(cells[3]), float(cells[5]))
        elif len(cells) == 5 and re.match(r"^[\d.]+ \(", cells[1] or ""):
            # "median (min)": the minimum is the steadier estimate on a noisy VM.
            num = lambda c: float(c.split("(")[1].rstrip(")"))
            mon[cells[0]] = (num(cells[1]), num(cells[3]))
    return speed, mon

def best(which):
    speed, mon = {}, {}
    for p in sorted(glob.glob(f"{out}/{which}-*.txt")):
        s, m = tables(p)
        for k, (a, b) in s.items():
            o = speed.get(k, (0.0, 0.0))
            speed[k] = (max(o[0], a), max(o[1], b))
        for k, (a, b) in m.items():
            o = mon.get(k, (float("inf"), float("inf")))
            mon[k] = (min(o[0], a), min(o[1], b))
    return speed, mon

(bs, bm), (hs, hm) = best("base"), best("head")
print(f"\nEngine bench, before ({rev}) vs after (working tree); best of {rounds} interleaved runs each\n")
print("| plan | batch | prefill tok/s before | after | × | decode tok/s before | after | × |")
print("|---|---|---|---|---|---|---|---|")
for k in sorted(set(bs) & set(hs), key=lambda k: (k[0], k[1])):
    (bp, bd), (hp, hd) = bs[k], hs[k]
    print(f"| {k[0]} | {k[1]} | {bp:.1f} | {hp:.1f} | {hp/bp:.3f} | {bd:.1f} | {hd:.1f} | {hd/bd:.3f} |")
if bm and hm:
    print("\n| monitoring variant (min of 9 runs) | prefill ms before | after | × | TPOT ms before | after | × |")
    print("|---|---|---|---|---|---|---|")
    for k in [k for k in bm if k in hm]:
        (bp, bt), (hp, ht) = bm[k], hm[k]
        print(f"| {k} | {bp:.2f} | {hp:.2f} | {hp/bp:.3f} | {bt:.2f} | {ht:.2f} | {ht/bt:.3f} |")
PY
