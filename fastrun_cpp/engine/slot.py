"""A slot: one llama.cpp sequence in the shared context, serving one request at a time."""

from __future__ import annotations

from fastrun_cpp.engine.request import GenerationOutput, GenerationRequest
from fastrun_cpp.engine.sampling import SamplerChain
from fastrun_cpp.engine.text import IncrementalDetokenizer, StopMatcher


class Slot:
    """Keeps, between requests, the tokens whose KV its sequence holds, so a later request
    sharing a prefix evaluates only the rest."""

    def __init__(self, seq_id: int) -> None:
        self.seq_id = seq_id
        self.cache_tokens: list[int] = []  # KV of these tokens, positions 0.., is in the context
        self.last_used = 0
        self.request: GenerationRequest | None = None
        # Per-request state, valid while `request` is set.
        self.admitted_at = 0
        self.prompt_cursor = 0
        self.cached_tokens = 0
        self.max_tokens = 0
        self.n_generated = 0
        self.pending_token: int | None = None  # sampled, not yet decoded
        self.batch_index = -1  # where this slot's logits are in the current step
        self.sampler: SamplerChain | None = None
        self.detokenizer: IncrementalDetokenizer | None = None
        self.stop_matcher: StopMatcher | None = None
        self.watched_text = ""  # generated text, kept while a lazy grammar watches for its trigger

    @property
    def is_free(self) -> bool:
        return self.request is None

    @property
    def is_prefilling(self) -> bool:
        return self.request is not None and self.prompt_cursor < len(self.request.prompt_tokens)

    @property
    def is_decoding(self) -> bool:
        return self.pending_token is not None

    def start(
        self,
        request: GenerationRequest,
        *,
        reused: int,
        max_tokens: int,
        sampler: SamplerChain,
        token_bytes: list[bytes],
        admitted_at: int,
    ) -> None:
        self.request = request
        self.admitted_at = admitted_at
        self.cache_tokens = request.prompt_tokens[:reused]
        self.prompt_cursor = reused
        self.cached_tokens = reused
        self.max_tokens = max_tokens
        self.n_generated = 0
        self.pending_token = None
        self.batch_index = -1
        self.sampler = sampler
        self.detokenizer = IncrementalDetokenizer(token_bytes)
        self.stop_matcher = StopMatcher(request.stop)
        self.watched_text = ""

    def output(self, **fields) -> GenerationOutput:
        assert self.request is not None
        return GenerationOutput(
            request_id=self.request.request_id,
            prompt_tokens=len(self.request.prompt_tokens),
            cached_tokens=self.cached_tokens,
            completion_tokens=self.n_generated,
            **fields,
        )

    def finish_text(self) -> tuple[str, bool]:
        """Flush held-back text at the end; returns (text, whether a stop string completed)."""
        assert self.detokenizer is not None and self.stop_matcher is not None
        text, stopped = self.stop_matcher.push(self.detokenizer.flush())
        if not stopped:
            text += self.stop_matcher.flush()
        return text, stopped

    def release(self, clock: int) -> None:
        if self.sampler is not None:
            self.sampler.free()
        self.request = None
        self.sampler = None
        self.detokenizer = None
        self.stop_matcher = None
        self.watched_text = ""
        self.pending_token = None
        self.batch_index = -1
        self.last_used = clock

    def forget_cache(self) -> None:
        self.cache_tokens = []

