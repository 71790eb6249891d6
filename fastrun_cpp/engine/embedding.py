"""Embeddings: a second llama.cpp context on the same weights, with pooled outputs.

Owned and run by the engine's scheduler thread, so embedding requests share the queue,
admission and capacity of generation. Each input is its own decode of one sequence, so an
input's vector never depends on what else is in the request (or in the engine).
"""

from __future__ import annotations

import llama_cpp.llama_cpp as llama
import numpy as np

from fastrun_cpp.engine.batch import TokenBatch
from fastrun_cpp.engine.model import LlamaModel
from fastrun_cpp.engine.errors import EngineError

POOLING = {
    "mean": llama.LLAMA_POOLING_TYPE_MEAN,
    "cls": llama.LLAMA_POOLING_TYPE_CLS,
    "last": llama.LLAMA_POOLING_TYPE_LAST,
}
_GGUF_POOLING = {1: "mean", 2: "cls", 3: "last"}  # llama.cpp's enum as GGUF metadata stores it


def model_pooling(model: LlamaModel, configured: str | None) -> str:
    """The pooling set for the model, else the one its GGUF names, else mean (generative
    models name none)."""
    if configured is not None:
        return configured
    architecture = model.metadata("general.architecture") or ""
    stored = model.metadata(f"{architecture}.pooling_type")
    if stored is not None and stored.isdigit() and int(stored) in _GGUF_POOLING:
        return _GGUF_POOLING[int(stored)]
    return "mean"


class Embedder:
    def __init__(self, model: LlamaModel, *, pooling: str, max_tokens: int, threads: int,
                 flash_attn: int, type_k: int, type_v: int, op_offload: bool = True) -> None:
        params = llama.llama_context_default_params()
        params.op_offload = op_offload
        params.embeddings = True
        params.pooling_type = POOLING[pooling]
        # Pooling reads every token of a sequence in one micro-batch.
        params.n_ctx = params.n_batch = params.n_ubatch = max_tokens
        params.n_seq_max = 1
        params.n_threads = params.n_threads_batch = threads
        params.flash_attn_type = flash_attn
        params.type_k = type_k
        params.type_v = type_v
        params.no_perf = True
        self._ctx = llama.llama_init_from_model(model.handle, params)
        if not self._ctx:
            raise EngineError("llama.cpp could not create an embeddings context (out of memory?)")
        self._memory = llama.llama_get_memory(self._ctx)
        self._batch = TokenBatch(max_tokens)
        self.max_tokens = max_tokens
        self.dimensions = model.n_embd

    def embed(self, tokens: list[int]) -> list[float]:
        """The unit-length (L2) pooled embedding of one input."""
        if not tokens or len(tokens) > self.max_tokens:
            raise ValueError(f"an input must have 1 to {self.max_tokens} tokens, not {len(tokens)}")
        llama.llama_memory_clear(self._memory, True)
        self._batch.clear()
        self._batch.add(0, tokens, 0, logits=True)
        status = llama.llama_decode(self._ctx, self._batch.as_llama_batch())
        if status != 0:
            raise EngineError(f"llama_decode failed for an embedding ({status})")
        pointer = llama.llama_get_embeddings_seq(self._ctx, 0)
        if not pointer:
            raise EngineError("llama.cpp returned no pooled embedding")
        vector = np.ctypeslib.as_array(pointer, shape=(self.dimensions,)).astype(np.float64)
        norm = np.linalg.norm(vector)
        if norm > 0:
            vector /= norm
        return vector.tolist()

    def close(self) -> None:
        if self._ctx:
            llama.llama_free(self._ctx)
            self._ctx = None
