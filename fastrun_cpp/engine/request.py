"""What the engine takes in and hands out, independent of any API. Plain data: nothing here
loads llama.cpp, so the scheduler and its tests run without it."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from fastrun_cpp.engine.logprobs import TokenLogprob

if TYPE_CHECKING:
    from fastrun_cpp.engine.reasoning_budget import ReasoningBudget
    from fastrun_cpp.structured.spec import GrammarSpec


NO_TOKEN = -1  # what a sampler picks when the grammar allows no token at all


# The priority of batch lines and background work: behind every priority a client may ask for
# (the API takes -1e6 to 1e6), so any interactive request goes first and may preempt them.
BULK_PRIORITY = 1_000_001


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
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit; -inf bans)
    min_tokens: int = 0  # no end-of-generation token before this many (vLLM's field)
    ignore_eos: bool = False  # no end-of-generation token at all (vLLM's and llama-server's field)

    def may_end(self, generated: int) -> bool:
        """Whether the model may end the answer with its end-of-generation token once it has
        generated this many tokens (stop strings and max_tokens end it regardless)."""
        return not self.ignore_eos and generated >= self.min_tokens

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



class FinishReason(str, enum.Enum):
    STOP = "stop"  # end-of-generation token or a stop string
    LENGTH = "length"  # max_tokens or the context window
    ABORTED = "aborted"  # the caller went away
    ERROR = "error"  # the engine failed this request


@dataclass(frozen=True)
class RopeGrid:
    """Where an M-RoPE model's image (Qwen2-VL's) puts its rows: a grid of positions, not one a
    row. What follows the image starts `advance` positions after it (max(rows, columns))."""

    # int32, llama.cpp's four sections (time, height, width, unused), each one a row, for an
    # image starting at position 0; and by how much each moves with where the image starts.
    positions: bytes
    moves: bytes
    advance: int


@dataclass(frozen=True)
class MediaSpan:
    """An image's place in a prompt: `length` tokens from `start`, each a placeholder
    (media_placeholders) standing for one row of `embeddings`, which the engine decodes in
    place of token embeddings, the whole span in one pass."""

    start: int
    length: int
    embeddings: bytes  # float32, length x the model's input width, row-major
    non_causal: bool  # its rows attend to each other both ways (Gemma 3's images)
    grid: RopeGrid | None = None  # an M-RoPE model's image; None: one position a row

    @property
    def end(self) -> int:
        return self.start + self.length

    @property
    def positions_taken(self) -> int:
        return self.length if self.grid is None else self.grid.advance


def media_placeholders(digest: bytes, length: int) -> list[int]:
    """The tokens an image of `digest` (32 bytes) stands as in a prompt: negative, so never a
    vocabulary token, and carrying the digest's bits 30 at a time, so that prefix matching -
    by the slots, the host and the disk tiers alike - reuses an image's KV only for the same
    pixels. The disk tier stores tokens as int32: every placeholder fits."""
    value, mask = int.from_bytes(digest, "little"), (1 << 30) - 1
    # Position i's digest bits, mixed with i so that the tokens within an image differ.
    return [-2 - (((value >> (30 * (i % 8))) & mask) ^ ((i * 0x9E3779B1) & mask)) for i in range(length)]


@dataclass
class GenerationRequest:
    request_id: str
    prompt_tokens: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    max_tokens: int | None = None  # None: until the context window is full
    stop: tuple[str, ...] = ()
    logprobs: int | None = None  # None: off; N: the sampled token's logprob and the N most likely
    grammar: GrammarSpec | None = None  # constrains the answer (from its trigger, if lazy)
    render_special_tokens: bool = False  # spell out control tokens in the text (for parsers)
    n: int = 1  # choices: each gets its own slot, after one evaluation of the prompt
    prompt_logprobs: int | None = None  # None: off; N: each prompt token's logprob and the N most likely
    speculative: bool = True  # may speculative decoding draft for it (when the engine drafts)
    kind: Literal["generate", "embed"] = "generate"
    # Whose cached prompts it may reuse, and whose its own prompt becomes: a request never
    # reuses KV that another namespace computed ("": one namespace for all, as in open mode).
    cache_namespace: str = ""
    # Who sent it, for fair shares of the slots ("": open mode, one account for all) and the
    # account's weight in them; lower `priority` runs first and may preempt (as in vLLM).
    account: str = ""
    weight: float = 1.0
    priority: int = 0
    # A routing hint: the conversation this request continues (prompt_cache_key, an agent's
    # session id); its turns go to the replica that served the last one.
    session: str = ""
    embed_inputs: list[list[int]] | None = None  # kind "embed": the token lists to embed, in order
    # One output per engine step, never merged for a slow reader: the reader may end a choice
    # at any step (a repeated tool call), and where it ends must not depend on how fast it read.
    stepwise_outputs: bool = False
    reasoning_budget: ReasoningBudget | None = None  # at most so many tokens of reasoning
    # LoRA adapters to answer with, (name, scale) sorted by name: steps decode one adapter set
    # at a time, so it never shares a decode with a request that asks for another.
    adapters: tuple[tuple[str, float], ...] = ()
    # Images in the prompt, in order, never overlapping and never its last token (the answer's
    # first token is read from the prompt's last logits, and an image's rows give none).
    media: tuple[MediaSpan, ...] = ()

    def chunk_length(self, cursor: int, length: int) -> int:
        """How many prompt tokens from `cursor` a chunk of at most `length` may take without
        mixing text and an image's rows: a chunk in an image stays in it (one whose rows attend
        both ways takes the whole image: it is decoded in one pass; a causal one, as Qwen-VL's
        up to 4,096 rows, goes a chunk at a time as text does), and one before an image stops
        where the image starts."""
        for span in self.media:
            if span.start <= cursor < span.end:
                return span.length if span.non_causal else min(length, span.end - cursor)
            if cursor < span.start < cursor + length:
                return span.start - cursor
        return length

    def media_at(self, cursor: int) -> MediaSpan | None:
        """The image whose rows a chunk from `cursor` holds, if any."""
        return next((span for span in self.media if span.start <= cursor < span.end), None)

    def position_of(self, index: int) -> int:
        """llama.cpp's position of the prompt or answer token at `index`: the index, less what
        the images before it take in positions fewer than their tokens (an M-RoPE image takes
        max(rows, columns))."""
        position = index
        for span in self.media:
            if span.end > index:
                break
            position -= span.length - span.positions_taken
        return position

    def reusable_prefix(self, length: int) -> int:
        """The longest prefix of at most `length` tokens that ends outside every image (a
        cached prefix ending inside one is cut back to where it starts)."""
        for span in self.media:
            if span.start < length < span.end:
                return span.start
        return length

    @property
    def input_tokens(self) -> int:
        """The tokens it takes in: its prompt, or all its inputs to embed."""
        if self.kind == "embed":
            return sum(map(len, self.embed_inputs or []))
        return len(self.prompt_tokens)


@dataclass
class GenerationOutput:
    """A delta of one request's progress: the text and tokens produced since the last output."""

    request_id: str
    index: int = 0  # which choice of the request
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    stop_sequence: str | None = None  # the stop string that ended the answer, if one did
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0  # total so far, not a delta
    error: str | None = None
    rejected: bool = False  # the error is the request's own doing
    logprobs: list[TokenLogprob] | None = None  # one per entry of token_ids, when asked for
    prompt_logprobs: list[TokenLogprob | None] | None = None  # once, with the first token (echo)
    drafted_tokens: int = 0  # speculative drafts verified for this choice so far
    accepted_tokens: int = 0  # of which accepted
    reasoning_tokens: int = 0  # of the completion tokens so far, reasoning (counted under a budget)
    embeddings: list[list[float]] | None = None  # kind "embed": one vector per input, when finished

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def merge(self, later: GenerationOutput) -> None:
        """Fold a later delta into this one (a slow reader gets several steps at once)."""
        self.text += later.text
        self.token_ids.extend(later.token_ids)
        if later.logprobs is not None:
            self.logprobs = self.logprobs if self.logprobs is not None else []
            self.logprobs.extend(later.logprobs)
        self.finish_reason = later.finish_reason
        self.stop_sequence = later.stop_sequence
        self.prompt_tokens = later.prompt_tokens
        self.cached_tokens = later.cached_tokens
        self.completion_tokens = later.completion_tokens
        self.error = later.error
        self.rejected = later.rejected
        self.prompt_logprobs = self.prompt_logprobs or later.prompt_logprobs
        self.drafted_tokens = later.drafted_tokens
        self.accepted_tokens = later.accepted_tokens
        self.reasoning_tokens = later.reasoning_tokens
