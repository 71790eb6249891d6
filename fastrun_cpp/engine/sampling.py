"""Sampling parameters and the per-slot llama.cpp sampler chain built from them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import llama_cpp.llama_cpp as llama


@dataclass(frozen=True)
class SamplingParams:
    """How one request picks its tokens. Defaults follow OpenAI's API."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    @property
    def penalized(self) -> bool:
        return (
            self.frequency_penalty != 0.0
            or self.presence_penalty != 0.0
            or self.repetition_penalty != 1.0
        )


MIN_REPETITION_PENALTY = 1e-3


class SamplerChain:
    """A llama.cpp sampler chain owned by one slot for the life of one request.

    Order (llama.cpp's own): penalties -> top_k -> top_p -> min_p -> temperature -> dist.
    Temperature 0 replaces the last four with greedy argmax.
    """

    def __init__(self, params: SamplingParams, *, n_vocab: int, penalty_window: int) -> None:
        self.params = params
        self._chain = llama.llama_sampler_chain_init(llama.llama_sampler_chain_default_params())
        self._penalties = None
        if params.penalized:
            self._penalties = llama.llama_sampler_init_penalties(
                n_vocab,
                penalty_window,
                # llama.cpp divides by it; the spec's lower bound 0 means "as strong as it gets".
                max(params.repetition_penalty, MIN_REPETITION_PENALTY),
                params.frequency_penalty,
                params.presence_penalty,
            )
            self._add(self._penalties)
        if params.greedy:
            self._add(llama.llama_sampler_init_greedy())
            return
        if params.top_k > 0:
            self._add(llama.llama_sampler_init_top_k(params.top_k))
        if params.top_p < 1.0:
            self._add(llama.llama_sampler_init_top_p(params.top_p, 1))
        if params.min_p > 0.0:
            self._add(llama.llama_sampler_init_min_p(params.min_p, 1))
        self._add(llama.llama_sampler_init_temp(params.temperature))
        seed = params.seed if params.seed is not None else llama.LLAMA_DEFAULT_SEED
        self._add(llama.llama_sampler_init_dist(seed))

    def _add(self, sampler: llama.llama_sampler_p) -> None:
        llama.llama_sampler_chain_add(self._chain, sampler)  # the chain now owns it

    def accept_prompt(self, tokens: Iterable[int]) -> None:
        """Let the penalties see the prompt, as they see generated tokens."""
        if self._penalties is not None:
            for token in tokens:
                llama.llama_sampler_accept(self._penalties, token)

    def sample(self, ctx: llama.llama_context_p, batch_index: int) -> int:
        """Pick and accept the next token from the logits at `batch_index` of the last decode."""
        return llama.llama_sampler_sample(self._chain, ctx, batch_index)

    def free(self) -> None:
        if self._chain:
            llama.llama_sampler_free(self._chain)
            self._chain = None
