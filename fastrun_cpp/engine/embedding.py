"""Embeddings: a second llama.cpp context on the same weights, with pooled outputs.

Owned and run by the engine's scheduler thread, so embedding requests share the queue,
admission and capacity of generation. Each input is its own sequence, decoded alone, so an
input's vector never depends on what else is in the request (or in the engine).
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import llama_cpp.llama_cpp as llama
import numpy as np

from fastrun_cpp.engine.batch import TokenBatch
from fastrun_cpp.engine.errors import EngineError
from fastrun_cpp.engine.model import LlamaModel
from fastrun_cpp.engine.request import FinishReason, GenerationOutput, GenerationRequest

logger = logging.getLogger(__name__)

POOLING = {
    "mean": llama.LLAMA_POOLING_TYPE_MEAN,
    "cls": llama.LLAMA_POOLING_TYPE_CLS,
    "last": llama.LLAMA_POOLING_TYPE_LAST,
    "rank": llama.LLAMA_POOLING_TYPE_RANK,  # a reranker's classifier head: scores, not a vector
}
_GGUF_POOLING = {1: "mean", 2: "cls", 3: "last", 4: "rank"}  # llama.cpp's enum as GGUF metadata stores it


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


def declares_pooling(model: LlamaModel) -> bool:
    """Whether the GGUF names a pooling type: an embedding model, whose attention may look both
    ways, so its pooling needs every token of an input in one pass."""
    architecture = model.metadata("general.architecture") or ""
    return model.metadata(f"{architecture}.pooling_type") is not None


@dataclass(eq=False)
class PartialEmbedding:
    """One input on its way through the embeddings context: the tokens decoded so far, and
    what pooling has gathered of them."""

    tokens: list[int]
    decoded: int = 0
    pooled: np.ndarray | None = None  # mean: the sum so far (float64); cls and last: the vector

    @property
    def done(self) -> bool:
        return self.decoded == len(self.tokens)


class Embedder:
    """A generative model's inputs go through in chunks of `chunk_tokens`, their KV kept
    between chunks (attention is causal), and are pooled here from each token's hidden state,
    token by token in order: an input's vector is the same bit for bit however it was chunked,
    and a long input takes turns with the decode steps of running answers instead of stalling
    them. An embedding model's own pooling (its GGUF names one) runs in llama.cpp, on a whole
    input at once."""

    def __init__(self, model: LlamaModel, *, pooling: str, max_tokens: int, chunk_tokens: int, threads: int,
                 flash_attn: int, type_k: int, type_v: int, op_offload: bool = True) -> None:
        self.chunked = not declares_pooling(model)
        self.pooling = pooling
        params = llama.llama_context_default_params()
        params.op_offload = op_offload
        params.embeddings = True
        params.pooling_type = llama.LLAMA_POOLING_TYPE_NONE if self.chunked else POOLING[pooling]
        params.n_ctx = max_tokens
        # llama.cpp's pooling reads every token of a sequence in one micro-batch.
        params.n_batch = params.n_ubatch = min(chunk_tokens, max_tokens) if self.chunked else max_tokens
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
        self._chunk = params.n_batch
        self._batch = TokenBatch(params.n_batch)
        self.max_tokens = max_tokens
        # A reranker's outputs are its classifier's, one per label (llama.cpp softmaxes Qwen3's).
        self.dimensions = llama.llama_model_n_cls_out(model.handle) if pooling == "rank" else model.n_embd

    def start(self, tokens: list[int]) -> PartialEmbedding:
        """Begin an input (the context holds one at a time: the previous one is dropped)."""
        if not tokens or len(tokens) > self.max_tokens:
            raise ValueError(f"an input must have 1 to {self.max_tokens} tokens, not {len(tokens)}")
        llama.llama_memory_clear(self._memory, True)
        return PartialEmbedding(list(tokens))

    def advance(self, partial: PartialEmbedding, budget: int) -> int:
        """Decode the input's next tokens, at most `budget` of them (at least one chunk's worth
        when the budget is smaller; the whole input where pooling needs it whole). Returns how
        many were decoded."""
        start = partial.decoded
        count = len(partial.tokens) - start if not self.chunked else min(len(partial.tokens) - start,
                                                                         self._chunk, max(1, budget))
        chunk = partial.tokens[start:start + count]
        self._batch.clear()
        # Every token is an output: llama.cpp's embeddings context gives each its state anyway.
        self._batch.add(0, chunk, start, logits=True)
        status = llama.llama_decode(self._ctx, self._batch.as_llama_batch())
        if status != 0:
            raise EngineError(f"llama_decode failed for an embedding ({status})")
        partial.decoded += count
        if not self.chunked:
            pointer = llama.llama_get_embeddings_seq(self._ctx, 0)
            if not pointer:
                raise EngineError("llama.cpp returned no pooled embedding")
            partial.pooled = np.ctypeslib.as_array(pointer, shape=(self.dimensions,)).astype(np.float64)
        elif self.pooling == "mean":
            states = self._states(count)
            # A running sum, one token at a time in order (cumsum is sequential): the same
            # rounding whatever the chunks.
            running = partial.pooled if partial.pooled is not None else np.zeros(self.dimensions)
            partial.pooled = np.cumsum(np.vstack([running[None, :], states]), axis=0)[-1]
        else:  # cls: the first token's state; last: the last token's
            row = (0 if self.pooling == "cls" else len(partial.tokens) - 1) - start
            if 0 <= row < count:
                partial.pooled = self._states(count)[row]
        return count

    def _states(self, rows: int) -> np.ndarray:
        pointer = llama.llama_get_embeddings(self._ctx)
        if not pointer:
            raise EngineError("llama.cpp returned no hidden states")
        return np.ctypeslib.as_array(pointer, shape=(rows, self.dimensions)).astype(np.float64)

    def vector(self, partial: PartialEmbedding) -> list[float]:
        """The unit-length (L2) pooled embedding of a finished input; a reranker's scores as they are."""
        assert partial.done and partial.pooled is not None
        if self.pooling == "rank":
            return partial.pooled.tolist()
        vector = partial.pooled / len(partial.tokens) if self.chunked and self.pooling == "mean" else partial.pooled
        norm = np.linalg.norm(vector)
        if norm > 0:
            vector = vector / norm
        return vector.tolist()

    def embed(self, tokens: list[int]) -> list[float]:
        """One input's embedding, all at once."""
        partial = self.start(tokens)
        while not partial.done:
            self.advance(partial, len(tokens))
        return self.vector(partial)

    def set_threads(self, threads: int) -> None:
        llama.llama_set_n_threads(self._ctx, threads, threads)

    def close(self) -> None:
        if self._ctx:
            llama.llama_free(self._ctx)
            self._ctx = None


@dataclass(eq=False)
class _EmbedJob:
    request: GenerationRequest
    vectors: list[list[float]] = field(default_factory=list)
    current: PartialEmbedding | None = None  # the input in the embeddings context now


class EmbeddingJobs:
    """The embedding requests of an engine, run between its decode steps. The Embedder is made
    at the first request."""

    def __init__(self, make_embedder: Callable[[], Embedder]) -> None:
        self._make_embedder = make_embedder
        self._embedder: Embedder | None = None
        self._jobs: deque[_EmbedJob] = deque()

    def __bool__(self) -> bool:
        return bool(self._jobs)

    def add(self, request: GenerationRequest) -> None:
        self._jobs.append(_EmbedJob(request))

    def step(self, budget: int, rank: Callable[[GenerationRequest], tuple],
             charge: Callable[[GenerationRequest, int], None]) -> list[GenerationOutput]:
        """Embed up to `budget` tokens, so embeddings take turns with running answers in pieces
        no longer than a step's prompt chunk. The input in the embeddings context goes on first;
        at each input's end the next is taken from the job `rank`s first (the queue's policy:
        priorities and fair shares, as for slots), and its tokens are `charge`d to its account."""
        outputs: list[GenerationOutput] = []
        while budget > 0 and self._jobs:
            job = next((job for job in self._jobs if job.current is not None), None) or \
                min(self._jobs, key=lambda job: rank(job.request))
            request = job.request
            inputs = request.embed_inputs or []
            try:
                if self._embedder is None:
                    self._embedder = self._make_embedder()
                if job.current is None:
                    job.current = self._embedder.start(inputs[len(job.vectors)])
                used = self._embedder.advance(job.current, budget)
                budget -= used
                charge(request, used)
                if job.current.done:
                    job.vectors.append(self._embedder.vector(job.current))
                    job.current = None
            except Exception as exc:  # this request fails alone
                logger.exception("embedding request %s failed", request.request_id)
                self._jobs.remove(job)
                outputs.append(GenerationOutput(request.request_id, finish_reason=FinishReason.ERROR, error=str(exc)))
                continue
            if len(job.vectors) == len(inputs):
                self._jobs.remove(job)
                outputs.append(GenerationOutput(request.request_id, finish_reason=FinishReason.STOP,
                                                prompt_tokens=request.input_tokens, embeddings=job.vectors))
        return outputs

    def abort(self, request_ids: set[str]) -> list[GenerationOutput]:
        outputs = []
        for job in [job for job in self._jobs if job.request.request_id in request_ids]:
            self._jobs.remove(job)
            outputs.append(GenerationOutput(job.request.request_id, finish_reason=FinishReason.ABORTED))
        return outputs

    def fail_all(self, message: str) -> list[GenerationOutput]:
        outputs = [GenerationOutput(job.request.request_id, finish_reason=FinishReason.ERROR, error=message)
                   for job in self._jobs]
        self._jobs.clear()
        return outputs

    def set_threads(self, threads: int) -> None:
        if self._embedder is not None:
            self._embedder.set_threads(threads)

    def close(self) -> None:
        if self._embedder is not None:
            self._embedder.close()
