"""The table of scripts/bench-llamacpp.sh, from the lines its run wrote: medians per server and
row, the better llama-server KV configuration as the peer, failed and short requests counted
and marked, and batch-1 decode as a share of the bound the measured read bandwidth sets: the
highest reading of the run, and the reading taken just before that server's measurements in
each round (median of the rounds' shares).

    python3 scripts/bench_table.py OUT THREADS ROUNDS "FILES" "LLAMA_FLAGS"
"""
import collections
import datetime
import platform
import statistics
import subprocess
import sys

NAN = float("nan")
SERVERS = ("quantmesh", "llama-f16", "llama-q8kv")
DESC = {
    "Q8_0": "SmolLM2-135M-Instruct Q8_0",
    "Q4_1": "SmolLM2-135M-Instruct Q4_1",
    "W2048": "W2048 = random-weight llama, hidden 2048, 4 layers, Q8_0",
    "W1024": "W1024 = random-weight llama of the bundled medium model's shape (hidden 1024, 8 layers), Q8_0",
    "Q4_K_M": "Q4_K_M = llama-server on SmolLM2's Q4_K_M file, quantmesh on the checkpoint at that file's tensor bytes",
}
def better(*xs):
    """The larger of the figures that were measured (NaN when none was)."""
    return max((x for x in xs if x == x), default=NAN)


NAMES = {
    "decode_b1": "decode tok/s, batch 1 (128 tokens)",
    "prefill_128": "prefill tok/s, 128-token prompt",
    "prefill_512": "prefill tok/s, 512-token prompt",
    "streams_8": "output tok/s, 8 concurrent streams",
    "streams_32": "output tok/s, 32 concurrent streams",
}


def main(out, threads, rounds, files, flags):
    files = files.split()
    v = collections.defaultdict(list)
    bad = collections.Counter()
    for line in open(f"{out}/results.txt"):
        who, tag, metric, value, failed, short = (line.split() + ["nan", "1", "0"])[:6]
        try:
            v[who, tag, metric].append(float(value))
        except ValueError:
            v[who, tag, metric].append(NAN)
        bad[who, tag, metric, "failed"] += int(failed) if failed.isdigit() else 1
        bad[who, tag, metric, "short"] += int(short) if short.isdigit() else 0
    about = collections.defaultdict(list)
    for line in open(f"{out}/about.txt"):
        if line.split():
            k, *rest = line.split()
            about[k].append(rest)
    readings = sorted(float(r[0]) for r in about["bandwidth"])
    bw = readings[-1] if readings else NAN
    def cpuinfo(key):
        return next(
            (l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.split(":")[0].strip() == key),
            None,
        )

    # A VM may name the CPU only by its brand ("AMD EPYC"): family and model tell the class.
    cpu = cpuinfo("model name") or platform.processor()
    flags = (cpuinfo("flags") or "").split()
    simd = [f for f in ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "amx_int8") if f in flags]
    cpu += f" (family {cpuinfo('cpu family')} model {cpuinfo('model')}; {' '.join(simd) or 'no AVX2'})"
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    kernels = sorted({" ".join(r) for r in about["kernels"]}) or ["not logged"]
    width = sorted({" ".join(r) for r in about["width"]}) or ["as configured"]
    build = " ".join(about["llama_build"][0]).replace("_", " ") if about["llama_build"] else "unknown"

    def med(who, tag, m):
        # failed measurements (NaN) are counted in the last column, not averaged in
        ok = [x for x in v[who, tag, m] if x == x]
        return statistics.median(ok) if ok else NAN

    print(f"{'; '.join(DESC[t] for t in files)}.")
    print(f"Machine: {cpu}, {threads} threads each; {datetime.date.today()}, quantmesh {commit}; "
          f"median of {rounds} rounds, the servers in a random order each round.")
    print("Sampling: greedy on both sides (temperature 0, EOS ignored). KV cache: quantmesh INT8; "
          "llama-server f16, and q8_0 with flash attention.")
    print(f"quantmesh kernels (isa, threads): {', '.join(kernels)}; activation width (mode, ratio): {', '.join(width)}.")
    print(f"llama.cpp: as vendored by llama-cpp-python 0.3.36, `llama-server --version`: {build}; flags {flags}.")
    spread = f" (the highest of {len(readings)} readings, one before each round; lowest {readings[0]:.1f})" if len(readings) > 1 else ""
    print(f"Read bandwidth (STREAM-like, {threads} threads): {bw:.1f} GB/s{spread}.\n")
    print("| file | metric | quantmesh | llama-server f16 KV | llama-server q8_0 KV + FA | ratio to the better | failed / short |")
    print("|---|---|---|---|---|---|---|")
    marked = False
    for tag in files:
        for m, name in NAMES.items():
            q, f16, q8 = (med(w, tag, m) for w in SERVERS)
            peer = better(f16, q8)
            fails = sum(bad[w, tag, m, "failed"] for w in SERVERS)
            shorts = sum(bad[w, tag, m, "short"] for w in SERVERS)
            flag = " ⚠" if fails or shorts else ""
            marked |= bool(flag)
            print(f"| {tag} | {name} | {q:.0f} | {f16:.0f} | {q8:.0f} | {q / peer:.2f}×{flag} | {fails} / {shorts} |")
    if marked:
        print("\n⚠ = some request in that row failed or came back short (last column): its figures count fewer tokens.")
    qbytes = {r[0]: float(r[1]) for r in about["quantmesh_bytes"] if len(r) > 1}
    lbytes = {r[0]: float(r[1]) for r in about["llama_bytes"] if len(r) > 1}
    # Readings taken just before each server's measurements, in round order, paired with
    # that server's batch-1 decode of the same round.
    paired = collections.defaultdict(list)
    for r in about["bandwidth_at"]:
        if len(r) > 2:
            paired[r[0], r[1]].append(float(r[2]))

    def paired_share(who, tag, nbytes):
        # median over rounds of decode ÷ (the reading beside it ÷ bytes)
        shares = [d * nbytes / (b * 1e9) for d, b in zip(v[who, tag, "decode_b1"], paired[who, tag])
                  if d == d and b > 0]
        return (statistics.median(shares) if shares else NAN), len(shares)

    print("\n| file | weight bytes per token: quantmesh / llama-server | decode bound (bandwidth ÷ bytes), tok/s | "
          "quantmesh decode, share of its bound | llama-server decode (better KV), share of its bound | "
          "quantmesh decode, share of the bound read just before it | llama-server (better KV), the same |")
    print("|---|---|---|---|---|---|---|")
    for tag in files:
        q = med("quantmesh", tag, "decode_b1")
        l = better(med("llama-f16", tag, "decode_b1"), med("llama-q8kv", tag, "decode_b1"))
        qb_bytes, lb_bytes = qbytes.get(tag, NAN), lbytes.get(tag, NAN)
        qb, lb = bw * 1e9 / qb_bytes, bw * 1e9 / lb_bytes
        qp, n = paired_share("quantmesh", tag, qb_bytes)
        lp = better(paired_share("llama-f16", tag, lb_bytes)[0], paired_share("llama-q8kv", tag, lb_bytes)[0])
        print(f"| {tag} | {qb_bytes / 1e6:.0f} MB / {lb_bytes / 1e6:.0f} MB | {qb:.0f} / {lb:.0f} | {q / qb:.0%} | {l / lb:.0%} "
              f"| {qp:.0%} (median of {n}) | {lp:.0%} |")
    for tag in files:
        b1, s32 = med("quantmesh", tag, "decode_b1"), med("quantmesh", tag, "streams_32")
        print(f"\nquantmesh, {tag}: 32 streams ÷ its own batch-1 decode = {s32 / b1:.1f}×", end="")
    print(f"\nRaw lines: {out}/results.txt, {out}/about.txt")


if __name__ == "__main__":
    main(*sys.argv[1:6])
