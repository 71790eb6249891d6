"""How llama.cpp splits one decode call over per-sequence KV streams, so the engine can keep
its steps to few splits and price each one.

With a KV stream per sequence (`kv_unified=False`, what the engine uses: attention then reads
only a sequence's own cells), llama.cpp evaluates a batch in micro-batches (`split_equal`),
each taking the same number of tokens from each of a run of consecutive sequence ids. Every
micro-batch is a pass over all the weights, so a step costs about one pass per micro-batch:
eight decoding slots 0..7 take one pass, slots 0, 2, 4, ... 14 take eight, and one slot's
draft beside seven plain decodes takes two.
"""

from __future__ import annotations

from typing import Sequence


def micro_batches(segments: Sequence[tuple[int, int]], n_ubatch: int) -> list[int]:
    """Rows of each micro-batch llama.cpp makes of a batch holding `segments` (sequence id,
    token count) in batch order: `llama_batch_allocr::split_equal(n_ubatch, sequential=true)`."""
    order: list[int] = []
    left: dict[int, int] = {}
    for seq, count in segments:
        if count > 0:
            if seq not in left:
                order.append(seq)
            left[seq] = left.get(seq, 0) + count
    rows: list[int] = []
    while any(left.values()):
        chosen: list[int] = []
        for seq in order:  # a run of consecutive ids, in batch order
            if left[seq] and (not chosen or seq == chosen[-1] + 1):
                chosen.append(seq)
                if len(chosen) > n_ubatch:
                    break
        per_seq = 1
        while all(left[seq] > per_seq for seq in chosen) and (per_seq + 1) * len(chosen) <= n_ubatch:
            per_seq += 1
        for seq in chosen:
            left[seq] -= per_seq
        rows.append(per_seq * len(chosen))
    return rows


def neighbours(seq: int, busy: set[int]) -> int:
    """How many of `seq`'s adjacent ids are busy: a slot taken next to running ones joins
    their run of consecutive ids (one micro-batch) instead of starting another."""
    return (seq - 1 in busy) + (seq + 1 in busy)
