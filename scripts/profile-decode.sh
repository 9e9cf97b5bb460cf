#!/usr/bin/env bash
# Where a served decode token's time goes: the engine's step against the gap between two
# steps, and the CPU each of the server's threads spends per token.
#
# Serves a model with `quantmesh serve`, decodes REQUESTS streams of TOKENS tokens one at a
# time with quantmesh-loadgen (greedy), and meanwhile
#   - times every decode step and the hops between two steps with perf uprobes on the
#     engine's own functions: the step (`StepRunner::run`), the executor's reply (the
#     `Execute` handler's return), the scheduler taking it (`SchedulerActor::step_done`), the
#     next step scheduled (`Scheduler::schedule`), the next step started;
#   - reads each thread's CPU time from /proc before and after.
# Prints two tables. Needs `perf` with uprobes (root, or perf_event_paranoid ≤ 1 and
# tracefs access) and release binaries with their symbols (the release profile keeps them).
# The probes cost a few microseconds per event; the figures are for comparing builds on one
# machine, not for the benchmark tables (scripts/bench-llamacpp.sh).
#
#   MODEL=path/to/model.gguf ./scripts/profile-decode.sh [extra `quantmesh serve` flags]
#
# Environment: MODEL (required), BIN (default target/release), THREADS (default: the cores),
# REQUESTS (default 4), TOKENS (default 128), PORT (default 8097).
set -euo pipefail
cd "$(dirname "$0")/.."
log() { printf '[profile-decode] %s\n' "$*" >&2; }

: "${MODEL:?set MODEL to a GGUF file or a model directory}"
BIN="${BIN:-target/release}"
THREADS="${THREADS:-$(nproc)}"
REQUESTS="${REQUESTS:-4}"
TOKENS="${TOKENS:-128}"
PORT="${PORT:-8097}"
QM="$BIN/quantmesh"
for b in "$QM" "$BIN/quantmesh-loadgen"; do
  [ -x "$b" ] || { log "$b missing: cargo build --release -p quantmesh -p quantmesh-gateway --bin quantmesh --bin quantmesh-loadgen"; exit 1; }
done
command -v perf >/dev/null || { log "perf not found (Debian: apt-get install linux-perf)"; exit 1; }

# A function's file offset, for a uprobe: its address in the symbol table, moved from the
# executable segment's virtual address to its file offset.
offset_of() { # pattern in the mangled name
  local addr seg
  addr="$(nm "$QM" | grep -m1 -E "$1" | awk '{print $1}')"
  [ -n "$addr" ] || { log "no symbol matches $1 in $QM"; exit 1; }
  seg="$(readelf -lW "$QM" | awk '$1 == "LOAD" && / E / {print $2, $3; exit}')"
  read -r seg_off seg_vaddr <<<"$seg"
  printf '0x%x' $(( 16#$addr - seg_vaddr + seg_off ))
}
GROUP=quantmesh_profile
perf probe -q -d "$GROUP:*" 2>/dev/null || true
probe() { # name, symbol pattern, suffix (%return or empty)
  perf probe -q -x "$QM" -a "$GROUP:$1=$(offset_of "$2")$3" || { log "perf probe failed for $1"; exit 1; }
}
probe step_start '10StepRunner3run17h' ''
probe step_end '10StepRunner3run17h' '%return'
probe replied 'Execute\$GT\$\$GT\$6handle17h' '%return'
probe taken 'SchedulerActor9step_done17h' ''
probe scheduled '9Scheduler8schedule17h' ''
OUT="$(mktemp -d)"
cleanup() {
  [ -n "${pid:-}" ] && kill "$pid" 2>/dev/null || true
  perf probe -q -d "$GROUP:*" 2>/dev/null || true
  rm -rf "$OUT"
}
trap cleanup EXIT

QUANTMESH_THREADS="$THREADS" "$QM" serve --model "$MODEL" --port "$PORT" "$@" >"$OUT/serve.log" 2>&1 &
pid=$!
for _ in $(seq 1 600); do
  curl -fs "http://127.0.0.1:$PORT/ready" >/dev/null 2>&1 && break
  kill -0 "$pid" 2>/dev/null || { tail -20 "$OUT/serve.log"; exit 1; }
  sleep 1
done
load() { "$BIN/quantmesh-loadgen" --url "http://127.0.0.1:$PORT" --concurrency 1 --requests "$1" --max-tokens "$2" --temperature 0; }
load 1 16 >/dev/null 2>&1 # warm-up
cpu() { for t in /proc/"$pid"/task/*; do echo "$(basename "$t") $(tr ' ' '_' <"$t/comm") $(awk '{print $14 + $15}' "$t/stat")"; done | sort; }
cpu >"$OUT/cpu-before"
perf record -q -e "$GROUP:*" -p "$pid" -o "$OUT/perf.data" 2>/dev/null &
rec=$!
sleep 1
load "$REQUESTS" "$TOKENS" >"$OUT/load.txt" 2>&1
kill -INT "$rec"; wait "$rec" 2>/dev/null || true
cpu >"$OUT/cpu-after"
grep -m1 'activation width chosen' "$OUT/serve.log" | sed 's/.*: //' >&2 || true
perf script -i "$OUT/perf.data" 2>/dev/null >"$OUT/events.txt"

TICK="$(getconf CLK_TCK)" REQUESTS="$REQUESTS" TOKENS="$TOKENS" OUT="$OUT" python3 - <<'PY'
import os, re, statistics
out = os.environ["OUT"]
tokens = int(os.environ["REQUESTS"]) * int(os.environ["TOKENS"])
events, role = [], {}
for line in open(f"{out}/events.txt"):
    m = re.search(r"\s(\d+)\s+\[\d+\]\s+([\d.]+):\s+quantmesh_profile:(\w+?)(?:__return)?:", line)
    if m:
        events.append((float(m.group(2)), m.group(3)))
        role.setdefault(m.group(3), m.group(1))
names = {role.get("step_start"): "executor", role.get("taken"): "scheduler and monitor"}
# After each step's end: the time to the first of each later event before the next step.
after = {k: [] for k in ("replied", "taken", "scheduled", "step_start")}
steps, start = [], None
for i, (t, kind) in enumerate(events):
    if kind == "step_start":
        start = t
    elif kind == "step_end" and start is not None:
        steps.append(t - start)
        start = None
        seen = set()
        for t2, k2 in events[i + 1 : i + 16]:
            if k2 in after and k2 not in seen:
                seen.add(k2)
                after[k2].append(t2 - t)
            if k2 == "step_start":
                break
def row(name, xs):
    xs = [x for x in xs if x < 0.05]  # a pause between two requests is not a gap
    if not xs:
        return f"| {name} | – | – | 0 |"
    return f"| {name} | {statistics.median(xs) * 1e6:.0f} | {statistics.mean(xs) * 1e6:.0f} | {len(xs)} |"
print("| from a decode step's end to … | median µs | mean µs | steps |")
print("|---|---|---|---|")
print(row("the executor's reply sent (statistics handed to the monitor)", after["replied"]))
print(row("the scheduler taking the reply", after["taken"]))
print(row("the next step scheduled (tokens sampled and streamed)", after["scheduled"]))
print(row("the next step started (the gap)", after["step_start"]))
print()
print("| the decode step itself | median µs | mean µs | steps |")
print("|---|---|---|---|")
print(row("`StepRunner::run`", steps))
print()
tick = int(os.environ["TICK"])
before = {l.split()[0]: (l.split()[1], int(l.split()[2])) for l in open(f"{out}/cpu-before")}
per = {}
for l in open(f"{out}/cpu-after"):
    tid, comm, t = l.split()
    if tid in before:
        per[(comm, tid)] = (int(t) - before[tid][1]) / tick
print(f"| thread (CPU time over {tokens} decoded tokens) | CPU ms per token |")
print("|---|---|")
for (comm, tid), s in sorted(per.items(), key=lambda kv: -kv[1])[:6]:
    if s > 0:
        name = names.get(tid, "kernel pool worker" if comm.startswith("quantmesh-kern") else comm)
        print(f"| {name} ({tid}) | {s * 1e3 / tokens:.3f} |")
load = open(f"{out}/load.txt").read().strip().splitlines()
print()
print("\n".join(load[-3:]))
PY
