"""What a grammar does for one sequence while it decodes: one interface, two implementations.

The engine asks a `Constraint` whether a token may come next, has it mask the logits of a
step, and tells it which token was accepted. llguidance's next-token masks are computed ahead,
beside the decode of the step that needs them (`MasksAhead`). `GuidanceConstraint` (llguidance: an Earley
parser over a lexer, masks in tens of microseconds even for a 262k vocabulary, its per-step
work capped by fuel) is the engine for every grammar it accepts; `GbnfConstraint` (llama.cpp's
grammar sampler) is the fallback for the rest.
"""

from __future__ import annotations

import ctypes
import math
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Protocol

import llama_cpp.llama_cpp as llama
import numpy as np

from fastrun_cpp.engine.errors import ConstraintError
from fastrun_cpp.engine.sampling import Candidates, grammar_clock, token_data_array


class Constraint(Protocol):
    engine: str  # "llguidance" or "llama.cpp", for metrics and logs

    def allows(self, token: int) -> bool:
        """Whether `token` may come next."""

    def mask(self, candidates: Candidates) -> None:
        """Set every refused token's logit to -inf in the freshly filled candidates (their
        positions are the token ids); raises ConstraintError."""

    def allowed(self) -> np.ndarray:
        """Which tokens may come next: a boolean per token id; raises ConstraintError."""

    def accept(self, token: int) -> None:
        """Advance past `token` (one it allows)."""

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many of `tokens`, in order, it would accept from here (drafts to verify)."""

    def free(self) -> None:
        ...


class GuidanceConstraint:
    engine = "llguidance"

    def __init__(self, matcher, n_vocab: int, end_tokens: frozenset[int]) -> None:
        self._matcher = matcher  # an llguidance.LLMatcher of its own
        self._n_vocab = n_vocab
        self._end_tokens = end_tokens
        self._next_mask: bytes | None = None  # the next token's mask, computed ahead (MasksAhead)

    def compute_next_mask(self) -> float:
        """Compute the next token's mask now, ahead of its step, on any thread (llguidance
        works without the GIL); returns the CPU seconds it took. Nothing else may use the
        constraint meanwhile."""
        started = grammar_clock()
        try:
            self._next_mask = self._matcher.compute_bitmask()
        except Exception:  # the step computes it again, and reports what went wrong
            self._next_mask = None
        return grammar_clock() - started

    def allows(self, token: int) -> bool:
        if token in self._end_tokens:  # validate_tokens() never takes an end token
            return self._matcher.is_accepting()
        if self._next_mask is not None:
            return bool(self._next_mask[token >> 3] >> (token & 7) & 1)
        return self._matcher.validate_tokens([token]) == 1

    def mask(self, candidates: Candidates) -> None:
        np.copyto(candidates.logits, -np.inf, where=~self.allowed())

    def allowed(self) -> np.ndarray:
        bits = self._next_mask if self._next_mask is not None else self._matcher.compute_bitmask()
        if self._matcher.is_error():
            raise ConstraintError(self._matcher.get_error())
        return np.unpackbits(np.frombuffer(bits, dtype=np.uint8), count=self._n_vocab, bitorder="little").view(bool)

    def accept(self, token: int) -> None:
        self._next_mask = None
        if token in self._end_tokens:
            return  # the answer ends here; nothing is asked of the grammar after it
        if not self._matcher.consume_token(token):
            raise ConstraintError(self._matcher.get_error())

    def valid_prefix(self, tokens: list[int]) -> int:
        return self._matcher.validate_tokens(tokens) if tokens else 0

    def free(self) -> None:
        self._matcher = None
        self._next_mask = None


class MasksAhead:
    """The next-token masks of the slots about to sample, computed on worker threads while
    llama_decode runs: a mask depends only on tokens already accepted, and llguidance and
    llama.cpp both work without the GIL, so the batch does not wait for masks, and several
    slots' masks are computed in parallel. Each is timed in its own thread's CPU (for the
    per-token grammar limit). `start` before the decode and `finish` after it: nothing else
    touches those constraints in between."""

    def __init__(self, workers: int) -> None:
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="fastrun-masks")
        self._running: list[tuple[int, Future]] = []

    def start(self, constraints: dict[int, GuidanceConstraint]) -> None:
        self._running = [(key, self._pool.submit(constraint.compute_next_mask))
                         for key, constraint in constraints.items()]

    def finish(self) -> dict[int, float]:
        """CPU seconds of each mask computed, by the key `start` was given."""
        done = {key: future.result() for key, future in self._running}
        self._running = []
        return done

    def close(self) -> None:
        self._pool.shutdown(wait=True)


class GbnfConstraint:
    engine = "llama.cpp"

    def __init__(self, sampler: llama.llama_sampler_p, n_vocab: int) -> None:
        self._sampler = sampler  # owned
        self._n_vocab = n_vocab
        self._one = np.zeros(1, dtype=Candidates.DTYPE)  # a one-token array for `allows`
        self._one_array = token_data_array(self._one)

    def allows(self, token: int) -> bool:
        self._one[0] = (token, 0.0, 0.0)
        self._one_array.size = 1
        self._one_array.selected = -1
        self._one_array.sorted = False
        llama.llama_sampler_apply(self._sampler, ctypes.byref(self._one_array))
        return math.isfinite(float(self._one["logit"][0]))

    def mask(self, candidates: Candidates) -> None:
        llama.llama_sampler_apply(self._sampler, candidates.array)

    def allowed(self) -> np.ndarray:
        candidates = Candidates(self._n_vocab)
        candidates.fill((ctypes.c_float * self._n_vocab)())
        self.mask(candidates)
        return np.isfinite(candidates.logits)

    def accept(self, token: int) -> None:
        llama.llama_sampler_accept(self._sampler, token)

    def valid_prefix(self, tokens: list[int]) -> int:
        # Checking past the first token would need a copy of the grammar's stacks for each
        # draft; drafts under this fallback are checked by verification alone.
        return len(tokens)

    def free(self) -> None:
        if self._sampler:
            llama.llama_sampler_free(self._sampler)
            self._sampler = None

