"""Logits of one text evaluated in differently shaped batches, for tests/test_batch_invariance.py.

    python -m tests.batch_invariance_probe MODEL.gguf TOKENS [--no-repack] [--cache-type TYPE]

Run in a process of its own: llama.cpp reads its kernel switches once per process. Prints, as
JSON, for each way of evaluating the text, whether the logits at every sampled position are
bit for bit those of the whole text in one batch.
"""

from __future__ import annotations

import json
import logging
import sys

import llama_cpp.llama_cpp as llama
import numpy as np

from fastrun_cpp.engine.batch import TokenBatch
from fastrun_cpp.engine.context import CACHE_TYPES
from fastrun_cpp.engine.model import LlamaModel
from fastrun_cpp.runtime.model_runtime import repacked_weights_are_batch_invariant


def context(model: LlamaModel, *, unified: bool, sequences: int, cache_type: str = "f16") -> llama.llama_context_p:
    params = llama.llama_context_default_params()
    params.n_ctx = 2048 * sequences
    params.n_batch = params.n_ubatch = 512
    params.n_seq_max = sequences
    params.n_threads = params.n_threads_batch = 2
    params.kv_unified = unified
    params.swa_full = True
    params.flash_attn_type = llama.LLAMA_FLASH_ATTN_TYPE_ENABLED
    params.type_k = params.type_v = CACHE_TYPES[cache_type]
    ctx = llama.llama_init_from_model(model.handle, params)
    assert ctx, "no context"
    return ctx


def evaluate(ctx, n_vocab: int, steps: list[list[tuple[int, list[int], int]]], seq: int) -> dict[int, np.ndarray]:
    """Decode `steps` (each a batch of (sequence, tokens, first position)); return the logits of
    sequence `seq` by position."""
    batch = TokenBatch(512)
    logits: dict[int, np.ndarray] = {}
    for step in steps:
        batch.clear()
        wanted = []
        for seq_id, tokens, start in step:
            last = batch.add(seq_id, tokens, start, logits=True)
            if seq_id == seq:
                wanted += [(start + i, last - len(tokens) + 1 + i) for i in range(len(tokens))]
        assert llama.llama_decode(ctx, batch.as_llama_batch()) == 0
        for position, index in wanted:
            row = llama.llama_get_logits_ith(ctx, index)
            logits[position] = np.ctypeslib.as_array(row, shape=(n_vocab,)).copy()
    return logits


def chunks(tokens: list[int], sizes: list[int], seq: int = 0) -> list[list[tuple[int, list[int], int]]]:
    steps, start, i = [], 0, 0
    while start < len(tokens):
        size = sizes[i % len(sizes)]
        steps.append([(seq, tokens[start:start + size], start)])
        start += size
        i += 1
    return steps


def main() -> None:
    path, count = sys.argv[1], int(sys.argv[2])
    options = sys.argv[3:]
    cache_type = options[options.index("--cache-type") + 1] if "--cache-type" in options else "f16"
    logging.basicConfig(level=logging.DEBUG, format="%(message)s")  # llama.cpp's log: which buffers it loads into
    # The deterministic mode's weights: repacked where the build's switch allows it (--no-repack:
    # in ggml's layout, so that Q4_0 and IQ4_NL weights take llamafile's kernels, as those whose
    # rows do not divide by 8 do when served).
    repack = repacked_weights_are_batch_invariant() and "--no-repack" not in options
    model = LlamaModel(path, n_gpu_layers=0, repack=repack)
    words = " ".join(f"Entry {i}: the crate {i * 37 % 101} left dock {i % 9} for port {i * 13 % 17}." for i in range(400))
    tokens = model.tokenize(words, add_special=True)[:count]
    n_vocab = model.n_vocab

    def fresh(steps, *, unified=False, sequences=1, seq=0):
        ctx = context(model, unified=unified, sequences=sequences, cache_type=cache_type)
        try:
            return evaluate(ctx, n_vocab, steps, seq)
        finally:
            llama.llama_free(ctx)

    whole = fresh(chunks(tokens, [512]))
    ways = {
        "one token at a time": fresh(chunks(tokens, [1])),
        "chunks of 7, 64, 100 and 3": fresh(chunks(tokens, [7, 64, 100, 3])),
    }
    # Another sequence's 37 tokens first, in one cache: this sequence's cells start at cell 37,
    # so KV tiles split its positions elsewhere; and it shares every batch with that sequence.
    junk = list(reversed(tokens[:37]))
    steps = [[(1, junk, 0)]]
    for step in chunks(tokens, [50]):
        (_, part, start), = step
        steps.append([(0, part, start), (1, [tokens[start % 37]], 37 + len(steps) - 1)])
    ways["after another sequence's cells, sharing its batches"] = fresh(steps, unified=True, sequences=2)
    print(json.dumps({
        name: [position for position in sorted(whole) if not np.array_equal(whole[position], logits[position])]
        for name, logits in ways.items()
    }))


if __name__ == "__main__":
    main()
