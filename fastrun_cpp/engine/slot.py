"""A slot: one llama.cpp sequence in the shared context, serving one request at a time."""

from __future__ import annotations

from typing import TYPE_CHECKING

from fastrun_cpp.engine.logprobs import TokenLogprob
from fastrun_cpp.engine.request import GenerationOutput, GenerationRequest
from fastrun_cpp.engine.speculative import Acceptance
from fastrun_cpp.engine.text import IncrementalDetokenizer, StopMatcher

if TYPE_CHECKING:
    from fastrun_cpp.engine.sampling import SamplerChain


class Slot:
    """Keeps, between requests, the tokens whose KV its sequence holds, so a later request
    sharing a prefix evaluates only the rest."""

    def __init__(self, seq_id: int) -> None:
        self.seq_id = seq_id
        # KV of these tokens, positions 0.., is in the context (kv_cache.KVCacheManager keeps it so).
        self.cache_tokens: list[int] = []
        self.namespace = ""  # the cache namespace of the request that computed that KV
        self.last_used = 0
        self.request: GenerationRequest | None = None
        # Per-request state, valid while `request` is set.
        self.admitted_at = 0
        self.prompt_cursor = 0
        self.cached_tokens = 0
        self.max_tokens = 0
        self.n_generated = 0
        self.index = 0  # which of the request's choices
        self.pending_token: int | None = None  # sampled, not yet decoded
        self.draft: list[int] = []  # tokens guessed after the pending one, verified this step
        self.batch_indices: list[int] = []  # where this slot's logits are in the current step
        self.accepted_now = 0  # drafts accepted in this step (their KV is in the sequence)
        self.chunk: tuple[int, int] | None = None  # this step's prompt chunk: (position, batch index)
        self.followers: list[Slot] = []  # the request's other choices, waiting for the prompt's KV
        self.sampler: SamplerChain | None = None
        self.speculative = False  # may drafts be proposed for it
        self.owed = False  # it preempted another for its slot: its prompt runs in a step of its own
        self.drafted_at = 0  # step of its last draft: slots take turns when drafts are scarce
        self.drafted_total = 0
        self.accepted_total = 0
        self.acceptance = Acceptance()
        self.detokenizer: IncrementalDetokenizer | None = None
        self.stop_matcher: StopMatcher | None = None
        self.watched_text = ""  # generated text, kept while a lazy grammar watches for its trigger
        self.prompt_logprobs: list[TokenLogprob | None] = []  # echo with logprobs: per prompt token
        self.prompt_logprobs_sent = False

    @property
    def is_free(self) -> bool:
        return self.request is None

    @property
    def prompt_left(self) -> int:
        """Prompt tokens not evaluated yet."""
        return len(self.request.prompt_tokens) - self.prompt_cursor if self.request is not None else 0

    @property
    def is_prefilling(self) -> bool:
        return self.prompt_left > 0

    @property
    def is_decoding(self) -> bool:
        return self.pending_token is not None

    def start(
        self,
        request: GenerationRequest,
        *,
        index: int,
        leader: bool,
        reused: int,
        max_tokens: int,
        sampler: SamplerChain,
        token_bytes: list[bytes],
        admitted_at: int,
        speculative: bool = False,
        acceptance: float = 1.0,
    ) -> None:
        """Take a request's choice `index`; the first `reused` prompt tokens are in the KV
        already (a follower, which waits for its leader's prompt, counts all of them)."""
        assert not leader or len(self.cache_tokens) == reused
        self.request = request
        self.index = index
        self.admitted_at = admitted_at
        self.prompt_cursor = reused
        self.cached_tokens = reused if leader else 0
        self.max_tokens = max_tokens
        self.n_generated = 0
        self.pending_token = None
        self.draft = []
        self.batch_indices = []
        self.accepted_now = 0
        self.chunk = None
        self.followers = []
        self.sampler = sampler
        self.speculative = speculative
        self.owed = False
        self.drafted_total = self.accepted_total = 0
        self.acceptance = Acceptance(acceptance)
        self.detokenizer = IncrementalDetokenizer(token_bytes)
        self.stop_matcher = StopMatcher(request.stop)
        self.watched_text = ""
        self.prompt_logprobs = []
        self.prompt_logprobs_sent = False

    def output(self, **fields) -> GenerationOutput:
        assert self.request is not None
        if self.request.prompt_logprobs is not None and not self.prompt_logprobs_sent and self.n_generated:
            fields["prompt_logprobs"] = self.prompt_logprobs
            self.prompt_logprobs_sent = True
        return GenerationOutput(
            request_id=self.request.request_id,
            index=self.index,
            prompt_tokens=len(self.request.prompt_tokens),
            cached_tokens=self.cached_tokens,
            completion_tokens=self.n_generated,
            drafted_tokens=self.drafted_total,
            accepted_tokens=self.accepted_total,
            **fields,
        )

    def finish_text(self) -> tuple[str, bool]:
        """Flush held-back text at the end; returns (text, whether a stop string completed)."""
        assert self.detokenizer is not None and self.stop_matcher is not None
        text, stopped = self.stop_matcher.push(self.detokenizer.flush())
        if not stopped:
            text += self.stop_matcher.flush()
        return text, stopped

    # What `detach` takes along: everything of the running choice but the KV (kept apart).
    RUN_FIELDS = (
        "request", "admitted_at", "prompt_cursor", "cached_tokens", "max_tokens", "n_generated", "index",
        "pending_token", "draft", "batch_indices", "accepted_now", "chunk", "followers", "sampler", "speculative",
        "owed", "drafted_at", "drafted_total", "accepted_total", "acceptance", "detokenizer", "stop_matcher",
        "watched_text", "prompt_logprobs", "prompt_logprobs_sent",
    )

    def detach(self, clock: int) -> dict:
        """Take the running choice out of the slot (to resume it elsewhere) and free the slot."""
        run = {name: getattr(self, name) for name in self.RUN_FIELDS}
        self.sampler = None  # it goes with the run
        self.release(clock)
        return run

    def attach(self, run: dict) -> None:
        """Resume a detached choice here (its KV restored into this slot's sequence first)."""
        for name, value in run.items():
            setattr(self, name, value)

    def release(self, clock: int) -> None:
        if self.sampler is not None:
            self.sampler.free()
        self.request = None
        self.sampler = None
        self.detokenizer = None
        self.stop_matcher = None
        self.watched_text = ""
        self.prompt_logprobs = []
        self.pending_token = None
        self.draft = []
        self.batch_indices = []
        self.accepted_now = 0
        self.chunk = None
        self.followers = []
        self.last_used = clock
