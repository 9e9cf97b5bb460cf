#!/usr/bin/env python3
"""llama.cpp (through llama-cpp-python) as the reference peer for quantmesh's parity tests
and benchmarks. One JSON request on stdin, one JSON answer on stdout.

    {"op": "tokenize", "model": PATH, "texts": [...]}
        -> {"ids": [[...], ...]}          (add_bos=False, special=True: as a chat prompt is encoded)
    {"op": "greedy", "model": PATH, "prompts": [[ids...], ...], "n": 32, "logits_out": PATH}
        -> {"tokens": [[...], ...]}       greedy continuations; with logits_out, the next-token
                                          logits at each generated position are written there as
                                          little-endian f32, prompt-major, [prompts, n, vocab]
    {"op": "perplexity", "model": PATH, "ids": [...], "ctx": 256}
        -> {"ppl": float, "tokens": int}  non-overlapping windows of ctx tokens
    {"op": "logits", "model": PATH, "ids": [...], "ctx": 256, "out": PATH}
        -> {"positions": int, "vocab": int}
                                          teacher-forced next-token logits in non-overlapping
                                          windows of ctx tokens (each from an empty context):
                                          for each window, positions 0..len-2 (the ones that
                                          have a next token), written to out as little-endian
                                          f32 [positions, vocab]
    {"op": "quantize", "model": PATH, "out": PATH, "type": "q8_0"}
        -> {"out": PATH}                  llama_model_quantize (requantize the file; q8_0,
                                          q4_k_m or f16)
    {"op": "size", "model": PATH}
        -> {"tensor_bytes": int}          the tensors' bytes (llama_model_size): the file
                                          without its header and metadata
    {"op": "bench", "model": PATH, "prompt_lens": [128, 512], "decode": 64, "batch": [8, 32]}
        -> prefill / decode tok/s in-process (see scripts/bench-llamacpp.sh)

Threads: LLAMA_THREADS (default: all cores). Nothing is downloaded here.
"""
import json
import os
import sys
import time


def load(path, **kw):
    from llama_cpp import Llama

    threads = int(os.environ.get("LLAMA_THREADS", os.cpu_count() or 1))
    return Llama(model_path=path, n_threads=threads, n_threads_batch=threads, verbose=False, **kw)


def op_tokenize(req):
    llm = load(req["model"], vocab_only=True)
    return {"ids": [llm.tokenize(t.encode("utf-8"), add_bos=False, special=True) for t in req["texts"]]}


def last_logits(llm):
    """Next-token logits after the last eval (llama-cpp-python keeps `scores` only with
    logits_all; the context holds the last output row either way)."""
    import numpy as np

    return np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),)).astype(np.float32)


def op_greedy(req):
    import numpy as np

    n = int(req.get("n", 32))
    longest = max(len(p) for p in req["prompts"]) + n + 8
    llm = load(req["model"], n_ctx=max(512, longest), logits_all=False, n_batch=512)
    vocab = llm.n_vocab()
    out_tokens = []
    sink = open(req["logits_out"], "wb") if req.get("logits_out") else None
    for prompt in req["prompts"]:
        llm.reset()
        llm.eval(prompt)
        toks = []
        for _ in range(n):
            logits = last_logits(llm)
            if sink:
                sink.write(logits.astype("<f4").tobytes())
            t = int(np.argmax(logits))
            toks.append(t)
            llm.eval([t])
        out_tokens.append(toks)
    if sink:
        sink.close()
    return {"tokens": out_tokens, "vocab": vocab}


def op_perplexity(req):
    import numpy as np

    ids, ctx = req["ids"], int(req.get("ctx", 256))
    llm = load(req["model"], n_ctx=ctx, logits_all=True, n_batch=ctx)
    nll, count = 0.0, 0
    for start in range(0, len(ids) - 1, ctx):
        window = ids[start : start + ctx]
        if len(window) < 2:
            break
        llm.reset()
        llm.eval(window)
        logits = np.array(llm.scores[: len(window)], dtype=np.float64)
        m = logits.max(axis=1, keepdims=True)
        logp = logits - m - np.log(np.exp(logits - m).sum(axis=1, keepdims=True))
        for i in range(len(window) - 1):
            nll -= logp[i, window[i + 1]]
            count += 1
    return {"ppl": float(np.exp(nll / count)), "tokens": count}


def op_logits(req):
    import numpy as np

    ids, ctx = req["ids"], int(req.get("ctx", 256))
    llm = load(req["model"], n_ctx=ctx, logits_all=True, n_batch=ctx)
    positions = 0
    with open(req["out"], "wb") as sink:
        for start in range(0, len(ids), ctx):
            window = ids[start : start + ctx]
            if len(window) < 2:
                break
            llm.reset()
            llm.eval(window)
            sink.write(np.asarray(llm.scores[: len(window) - 1], dtype="<f4").tobytes())
            positions += len(window) - 1
    return {"positions": positions, "vocab": llm.n_vocab()}


def op_quantize(req):
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = {"q8_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0, "q4_k_m": llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M,
                    "f16": llama_cpp.LLAMA_FTYPE_MOSTLY_F16}[req.get("type", "q8_0")]
    params.allow_requantize = True
    rc = llama_cpp.llama_model_quantize(req["model"].encode(), req["out"].encode(), params)
    if rc != 0:
        raise SystemExit(f"llama_model_quantize failed: {rc}")
    return {"out": req["out"]}


def op_size(req):
    """The bytes of the model's tensors (llama.cpp's llama_model_size): the file without its
    header and metadata (the tokenizer's vocabulary and merges among them)."""
    import llama_cpp

    llm = load(req["model"], n_ctx=64)
    return {"tensor_bytes": int(llama_cpp.llama_model_size(llm._model.model))}


def op_bench(req):
    """Prefill tok/s for each prompt length, decode tok/s at batch 1, in-process."""
    llm = load(req["model"], n_ctx=2048, n_batch=512)
    out = {"prefill": {}, "decode_b1": None}
    base = list(req["ids"])
    reps = int(req.get("reps", 3))
    for plen in req.get("prompt_lens", [128, 512]):
        prompt = (base * (plen // max(1, len(base)) + 1))[:plen]
        best = None
        for _ in range(reps):
            llm.reset()
            t = time.perf_counter()
            llm.eval(prompt)
            dt = time.perf_counter() - t
            best = dt if best is None else min(best, dt)
        out["prefill"][str(plen)] = plen / best
    n = int(req.get("decode", 64))
    best = None
    for _ in range(reps):
        llm.reset()
        llm.eval(base[:16])
        t = time.perf_counter()
        for _ in range(n):
            tok = int(last_logits(llm).argmax())
            llm.eval([tok])
        dt = time.perf_counter() - t
        best = dt if best is None else min(best, dt)
    out["decode_b1"] = n / best
    return out


def main():
    req = json.load(sys.stdin)
    ops = {"tokenize": op_tokenize, "greedy": op_greedy, "perplexity": op_perplexity,
           "logits": op_logits, "quantize": op_quantize, "bench": op_bench, "size": op_size}
    if req.get("op") not in ops:
        raise SystemExit(f"unknown op {req.get('op')!r}; one of {sorted(ops)}")
    json.dump(ops[req["op"]](req), sys.stdout)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
