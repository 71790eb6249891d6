"""A llama_batch backed by numpy arrays, so filling it costs no per-token ctypes calls."""

from __future__ import annotations

import ctypes
from typing import Sequence

import llama_cpp.llama_cpp as llama
import numpy as np


class TokenBatch:
    """One decode step's tokens: each with its position, sequence and whether logits are wanted."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.size = 0
        self._tokens = np.zeros(capacity, dtype=np.int32)
        self._positions = np.zeros(capacity, dtype=np.int32)
        self._n_seq_ids = np.ones(capacity, dtype=np.int32)
        self._seq_ids = np.zeros(capacity, dtype=np.int32)
        self._logits = np.zeros(capacity, dtype=np.int8)
        # llama_batch wants one seq_id array per token; point each at its element of _seq_ids.
        seq_id_p = ctypes.POINTER(llama.llama_seq_id)
        base = self._seq_ids.ctypes.data
        itemsize = self._seq_ids.itemsize
        self._seq_id_ptrs = (seq_id_p * capacity)(
            *(ctypes.cast(base + i * itemsize, seq_id_p) for i in range(capacity))
        )
        self._batch = llama.llama_batch(
            n_tokens=0,
            token=self._tokens.ctypes.data_as(ctypes.POINTER(llama.llama_token)),
            embd=None,
            pos=self._positions.ctypes.data_as(ctypes.POINTER(llama.llama_pos)),
            n_seq_id=self._n_seq_ids.ctypes.data_as(ctypes.POINTER(ctypes.c_int32)),
            seq_id=self._seq_id_ptrs,
            logits=self._logits.ctypes.data_as(ctypes.POINTER(ctypes.c_int8)),
        )

    @property
    def free(self) -> int:
        return self.capacity - self.size

    def clear(self) -> None:
        self.size = 0

    def add(self, seq_id: int, tokens: Sequence[int], start_pos: int, *, logits: bool = False,
            logits_last: bool = False) -> int:
        """Append consecutive tokens of one sequence, with logits for all of them or the last
        one; return the batch index of the last one."""
        count = len(tokens)
        start, end = self.size, self.size + count
        if end > self.capacity:
            raise ValueError("batch overflow")
        self._tokens[start:end] = tokens
        self._positions[start:end] = np.arange(start_pos, start_pos + count, dtype=np.int32)
        self._seq_ids[start:end] = seq_id
        self._logits[start:end] = 1 if logits else 0
        if logits_last:
            self._logits[end - 1] = 1
        self.size = end
        return end - 1

    def as_llama_batch(self) -> llama.llama_batch:
        self._batch.n_tokens = self.size
        return self._batch


def embeddings_batch(embeddings: np.ndarray, seq_id: int, start_pos: int,
                     rope_positions: np.ndarray | None = None) -> tuple[llama.llama_batch, list]:
    """A llama_batch of input embeddings (no logits) for one sequence: an image's rows from the
    vision projector, one position a row from `start_pos`, or for an M-RoPE model
    `rope_positions` (int32, its four sections one after the other, as llama.cpp reads an
    embeddings batch's positions). Also returns the arrays it points into, which must outlive
    the decode."""
    count = len(embeddings)
    rows = np.ascontiguousarray(embeddings, dtype=np.float32)
    if rope_positions is not None:
        positions = np.ascontiguousarray(rope_positions, dtype=np.int32)
    else:
        positions = np.arange(start_pos, start_pos + count, dtype=np.int32)
    n_seq_ids = np.ones(count, dtype=np.int32)
    seq_ids = np.full(count, seq_id, dtype=np.int32)
    logits = np.zeros(count, dtype=np.int8)
    seq_id_p = ctypes.POINTER(llama.llama_seq_id)
    pointers = (seq_id_p * count)(*(ctypes.cast(seq_ids.ctypes.data + i * seq_ids.itemsize, seq_id_p)
                                    for i in range(count)))
    batch = llama.llama_batch(
        n_tokens=count,
        token=None,
        embd=rows.ctypes.data_as(ctypes.POINTER(ctypes.c_float)),
        pos=positions.ctypes.data_as(ctypes.POINTER(llama.llama_pos)),
        n_seq_id=n_seq_ids.ctypes.data_as(ctypes.POINTER(ctypes.c_int32)),
        seq_id=pointers,
        logits=logits.ctypes.data_as(ctypes.POINTER(ctypes.c_int8)),
    )
    return batch, [rows, positions, n_seq_ids, seq_ids, logits, pointers]
