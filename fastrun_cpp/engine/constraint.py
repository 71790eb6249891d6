"""What a grammar does for one sequence while it decodes: one interface, two implementations.

The engine asks a `Constraint` whether a token may come next, has it mask the logits of a
step, and tells it which token was accepted. `GuidanceConstraint` (llguidance: an Earley
parser over a lexer, masks in tens of microseconds even for a 262k vocabulary, its per-step
work capped by fuel) is the engine for every grammar it accepts; `GbnfConstraint` (llama.cpp's
grammar sampler) is the fallback for the rest.
"""

from __future__ import annotations

import ctypes
import math
from typing import Protocol

import llama_cpp.llama_cpp as llama
import numpy as np

from fastrun_cpp.engine.errors import ConstraintError
from fastrun_cpp.engine.sampling import Candidates, token_data_array


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

    def allows(self, token: int) -> bool:
        if token in self._end_tokens:  # validate_tokens() never takes an end token
            return self._matcher.is_accepting()
        return self._matcher.validate_tokens([token]) == 1

    def mask(self, candidates: Candidates) -> None:
        np.copyto(candidates.logits, -np.inf, where=~self.allowed())

    def allowed(self) -> np.ndarray:
        bits = self._matcher.compute_bitmask()  # releases the GIL while it works
        if self._matcher.is_error():
            raise ConstraintError(self._matcher.get_error())
        return np.unpackbits(np.frombuffer(bits, dtype=np.uint8), count=self._n_vocab, bitorder="little").view(bool)

    def accept(self, token: int) -> None:
        if token in self._end_tokens:
            return  # the answer ends here; nothing is asked of the grammar after it
        if not self._matcher.consume_token(token):
            raise ConstraintError(self._matcher.get_error())

    def valid_prefix(self, tokens: list[int]) -> int:
        return self._matcher.validate_tokens(tokens) if tokens else 0

    def free(self) -> None:
        self._matcher = None


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

