"""A slot: one llama.cpp sequence in the shared context, and the request's choice it serves."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from fastrun_cpp.engine.logprobs import TokenLogprob
from fastrun_cpp.engine.reasoning_budget import ReasoningTracker
from fastrun_cpp.engine.request import GenerationOutput, GenerationRequest
from fastrun_cpp.engine.speculative import Acceptance
from fastrun_cpp.engine.text import IncrementalDetokenizer, StopMatcher

if TYPE_CHECKING:
    from fastrun_cpp.engine.sampling import SamplerChain


@dataclass(eq=False)
class RunningChoice:
    """One choice of a request, from its admission to its end: everything about it but its KV
    (the slot's sequence holds that), so a preemption moves it whole to the queue and back."""

    request: GenerationRequest
    index: int  # which of the request's choices
    admitted_at: int  # the engine's admission clock: orders prompts and preemption victims
    prompt_cursor: int  # prompt tokens whose KV the sequence holds
    cached_tokens: int  # of those, what a cache gave
    max_tokens: int  # the answer's length limit (the request's, within the context)
    sampler: SamplerChain | None
    detokenizer: IncrementalDetokenizer
    stop_matcher: StopMatcher
    speculative: bool = False  # may drafts be proposed for it
    acceptance: Acceptance = field(default_factory=Acceptance)
    n_generated: int = 0
    pending_token: int | None = None  # sampled, not yet decoded
    followers: list[Slot] = field(default_factory=list)  # the request's other choices, waiting for the prompt's KV
    owed: bool = False  # it preempted another for its slot: its prompt runs in a step of its own
    drafted_at: int = 0  # the drafting turn it last drafted in: slots take turns when drafts are scarce
    drafted_total: int = 0
    accepted_total: int = 0
    watched_text: str = ""  # generated text, kept while a lazy grammar watches for its trigger
    prompt_logprobs: list[TokenLogprob | None] = field(default_factory=list)  # echo with logprobs
    prompt_logprobs_sent: bool = False
    reasoning: ReasoningTracker | None = None  # its reasoning budget's count, when it has one

    @property
    def prompt_left(self) -> int:
        """Prompt tokens not evaluated yet."""
        return len(self.request.prompt_tokens) - self.prompt_cursor

    @property
    def is_prefilling(self) -> bool:
        return self.prompt_left > 0

    @property
    def is_decoding(self) -> bool:
        return self.pending_token is not None

    def output(self, **fields) -> GenerationOutput:
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
            reasoning_tokens=self.reasoning.thought if self.reasoning is not None else 0,
            **fields,
        )

    def finish_text(self) -> tuple[str, bool]:
        """Flush held-back text at the end; returns (text, whether a stop string completed)."""
        text, stopped = self.stop_matcher.push(self.detokenizer.flush())
        if not stopped:
            text += self.stop_matcher.flush()
        return text, stopped

    def free(self) -> None:
        """Free what the choice holds in llama.cpp (its sampler), when it will not run on."""
        if self.sampler is not None:
            self.sampler.free()
            self.sampler = None


class Slot:
    """Keeps, between requests, the tokens whose KV its sequence holds, so a later request
    sharing a prefix evaluates only the rest; `choice` is what it serves now."""

    def __init__(self, seq_id: int) -> None:
        self.seq_id = seq_id
        # KV of these tokens, positions 0.., is in the context (kv_cache.KVCacheManager keeps it so).
        self.cache_tokens: list[int] = []
        self.namespace = ""  # the cache namespace of the request that computed that KV
        self.last_used = 0
        self.choice: RunningChoice | None = None

    @property
    def request(self) -> GenerationRequest | None:
        return self.choice.request if self.choice is not None else None

    @property
    def is_free(self) -> bool:
        return self.choice is None

    @property
    def is_prefilling(self) -> bool:
        return self.choice is not None and self.choice.is_prefilling

    @property
    def is_decoding(self) -> bool:
        return self.choice is not None and self.choice.is_decoding

    def start(self, choice: RunningChoice, *, leader: bool) -> None:
        """Take a request's choice; a leader's sequence holds its first `prompt_cursor` prompt
        tokens already (a follower, which waits for its leader's prompt, counts all of them)."""
        assert not leader or len(self.cache_tokens) == choice.prompt_cursor
        self.choice = choice

    def detach(self, clock: int) -> RunningChoice:
        """Take the running choice out of the slot (to resume it elsewhere) and free the slot."""
        choice, self.choice = self.choice, None
        self.last_used = clock
        return choice

    def attach(self, choice: RunningChoice) -> None:
        """Resume a detached choice here (its KV restored into this slot's sequence first)."""
        self.choice = choice

    def release(self, clock: int) -> None:
        if self.choice is not None:
            self.choice.free()
        self.choice = None
        self.last_used = clock
