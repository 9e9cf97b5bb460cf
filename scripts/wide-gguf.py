#!/usr/bin/env python3
"""Write a wider, shallower llama model as an f16 GGUF with random weights, borrowing the
tokenizer (vocabulary, merges, special tokens, chat template) of an existing GGUF: a shape
that is not SmolLM2's for speed comparisons on the same file. The weights are random (its
answers are noise); what it measures is speed at another width.

    PYTHONPATH=<llama.cpp>/gguf-py python3 scripts/wide-gguf.py TOKENIZER.gguf OUT.gguf \
        [--hidden 2048] [--ffn 5632] [--layers 4] [--heads 32] [--kv-heads 8] [--seed 7]

`gguf` is llama.cpp's own Python package (its `gguf-py` folder); quantize the result with
`llama-quantize OUT.gguf OUT.Q8_0.gguf Q8_0`.
"""
import argparse
import sys

import numpy as np

try:
    import gguf
except ImportError:
    sys.exit("wide-gguf.py: needs llama.cpp's gguf-py on PYTHONPATH")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("tokenizer", help="a llama-architecture GGUF whose tokenizer to copy")
    p.add_argument("out", help="the f16 GGUF to write")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--ffn", type=int, default=5632)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--seed", type=int, default=7)
    a = p.parse_args()
    if a.hidden % a.heads or a.heads % a.kv_heads or a.hidden % 32 or a.ffn % 32:
        sys.exit("wide-gguf.py: hidden must divide by heads and by 32, heads by kv-heads, ffn by 32")
    head_dim = a.hidden // a.heads

    src = gguf.GGUFReader(a.tokenizer)
    w = gguf.GGUFWriter(a.out, "llama")
    w.add_name(f"random llama {a.hidden}x{a.layers}")
    w.add_block_count(a.layers)
    w.add_context_length(8192)
    w.add_embedding_length(a.hidden)
    w.add_feed_forward_length(a.ffn)
    w.add_head_count(a.heads)
    w.add_head_count_kv(a.kv_heads)
    w.add_rope_freq_base(100000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(head_dim)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    vocab = 0
    for name, field in src.fields.items():
        if not name.startswith("tokenizer."):
            continue
        kind = field.types[0]
        if kind == gguf.GGUFValueType.ARRAY:
            sub = field.types[-1]
            if sub == gguf.GGUFValueType.STRING:
                value = [bytes(field.parts[i]).decode("utf-8") for i in field.data]
            else:
                value = [field.parts[i].tolist()[0] for i in field.data]
            if name == "tokenizer.ggml.tokens":
                vocab = len(value)
            w.add_key_value(name, value, kind, sub_type=sub)
        elif kind == gguf.GGUFValueType.STRING:
            w.add_key_value(name, bytes(field.parts[field.data[0]]).decode("utf-8"), kind)
        else:
            w.add_key_value(name, field.parts[field.data[0]].tolist()[0], kind)
    if not vocab:
        sys.exit(f"wide-gguf.py: {a.tokenizer} has no tokenizer.ggml.tokens")
    w.add_vocab_size(vocab)

    rng = np.random.default_rng(a.seed)

    def matrix(rows: int, cols: int) -> np.ndarray:
        # std 1/sqrt(cols): each product keeps its input's scale
        return (rng.standard_normal((rows, cols), dtype=np.float32) / np.sqrt(cols)).astype(np.float16)

    ones = np.ones(a.hidden, dtype=np.float32)
    w.add_tensor("token_embd.weight", matrix(vocab, a.hidden))
    w.add_tensor("output_norm.weight", ones)
    kv = a.kv_heads * head_dim
    for i in range(a.layers):
        b = f"blk.{i}."
        w.add_tensor(b + "attn_norm.weight", ones)
        w.add_tensor(b + "attn_q.weight", matrix(a.hidden, a.hidden))
        w.add_tensor(b + "attn_k.weight", matrix(kv, a.hidden))
        w.add_tensor(b + "attn_v.weight", matrix(kv, a.hidden))
        w.add_tensor(b + "attn_output.weight", matrix(a.hidden, a.hidden))
        w.add_tensor(b + "ffn_norm.weight", ones)
        w.add_tensor(b + "ffn_gate.weight", matrix(a.ffn, a.hidden))
        w.add_tensor(b + "ffn_up.weight", matrix(a.ffn, a.hidden))
        w.add_tensor(b + "ffn_down.weight", matrix(a.hidden, a.ffn))
        print(f"layer {i + 1}/{a.layers}", file=sys.stderr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


if __name__ == "__main__":
    main()
