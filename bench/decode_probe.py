"""One-row decode cost of a llama.cpp context set up as fastrun-cpp's engine sets it up, in a
bare Python process (no server, no event loop): what llama.cpp alone costs per token, to set
against a server's. Compare with llama-server's own `timings.predicted_per_token_ms`.

    .venv/bin/python bench/decode_probe.py [--model smollm2|gemma|PATH] [--exact] [--unified] [--context N]

--context: the decodes follow a prompt of N tokens, as an answer to a long chat or an agent's
files does (attention then reads N cells a layer; compare llama-bench's `-d N`).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import structured  # noqa: E402
from bench.matrix import CTX, SLOTS  # noqa: E402  (as the matrix runs both servers)
from fastrun_cpp.runtime.model_runtime import deterministic_switches  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--exact", action="store_true", help="with deterministic mode's llama.cpp switches")
    parser.add_argument("--unified", action="store_true", help="one KV stream for all sequences (llama-server's)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=384)
    parser.add_argument("--context", type=int, default=40, help="prompt tokens before the decodes")
    args = parser.parse_args()
    if args.exact:
        os.environ.update(deterministic_switches())  # read by llama.cpp as it loads: set first
    import numpy as np
    import llama_cpp.llama_cpp as llama

    path = structured.model_paths().get(args.model) or Path(args.model)
    llama.llama_backend_init()
    model = llama.llama_model_load_from_file(str(path).encode(), llama.llama_model_default_params())
    params = llama.llama_context_default_params()
    params.n_ctx, params.n_batch, params.n_ubatch, params.n_seq_max = SLOTS * CTX, 512, 512, SLOTS
    params.n_threads = params.n_threads_batch = args.threads
    params.kv_unified = args.unified
    params.type_k = params.type_v = llama.GGML_TYPE_F16
    params.no_perf = True
    ctx = llama.llama_init_from_model(model, params)
    n_vocab = llama.llama_vocab_n_tokens(llama.llama_model_get_vocab(model))
    batch = llama.llama_batch_init(512, 0, 1)

    def decode(tokens: list[int], position: int) -> None:
        batch.n_tokens = len(tokens)
        for i, token in enumerate(tokens):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, position + i, 1
            batch.seq_id[i][0] = 3
            batch.logits[i] = i == len(tokens) - 1
        if llama.llama_decode(ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")

    prompt = [100 + i % 1000 for i in range(args.context)]
    for start in range(0, len(prompt), 512):
        decode(prompt[start:start + 512], start)
    position, seconds = len(prompt), []
    for _ in range(args.tokens):
        token = int(np.ctypeslib.as_array(llama.llama_get_logits_ith(ctx, -1), shape=(n_vocab,)).argmax())
        started = time.perf_counter()
        decode([token], position)
        seconds.append(time.perf_counter() - started)
        position += 1
    print(f"{path.name}: {'exact' if args.exact else 'fast'} kernels, {'unified' if args.unified else 'per-slot'} KV, "
          f"{args.threads} threads, after {args.context} tokens: one-row decode median {statistics.median(seconds) * 1000:.2f} ms, "
          f"mean {statistics.fmean(seconds) * 1000:.2f} ms over {args.tokens}")
    llama.llama_batch_free(batch)
    llama.llama_free(ctx)
    llama.llama_model_free(model)
    return 0


if __name__ == "__main__":
    sys.exit(main())
