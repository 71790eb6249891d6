"""Sampling parameters and the per-slot llama.cpp sampler chain built from them."""

from __future__ import annotations

import ctypes
import gc
import math
import threading
import time
from typing import Iterable

import llama_cpp.llama_cpp as llama
import numpy as np

from fastrun_cpp.engine.request import NO_TOKEN, SamplingParams

MIN_REPETITION_PENALTY = 1e-3
# A token whose logit lies this many temperatures below the best one has under e^-30 (1e-13) of
# the best one's probability: in Gemma 3's 262k-token vocabulary all such tokens together hold
# under 3e-8 of the mass. A sampled draw leaves them out, so llama.cpp's chain scales and
# exponentiates only the tokens that can come up (a third of Gemma 3's vocabulary at T=0.7:
# 1.8 -> 0.9 ms a draw, for each slot of every step, on the scheduler's thread).
NEGLIGIBLE_TEMPERATURES = 30.0


class _CollectorTime:
    """CPU seconds each thread has spent in Python's garbage collector. A collection can start
    at any allocation, inside a grammar's step too, and a gen-2 pass over a long-running
    server's objects takes tens of milliseconds: that pause is not the grammar's work, and
    charging it to the grammar's per-token limit failed legitimate requests."""

    def __init__(self) -> None:
        self._local = threading.local()
        gc.callbacks.append(self._on_collection)

    def _on_collection(self, phase: str, info: dict) -> None:
        local = self._local
        if phase == "start":
            local.started = time.thread_time()
        elif (started := getattr(local, "started", None)) is not None:
            local.seconds = getattr(local, "seconds", 0.0) + time.thread_time() - started
            local.started = None

    def seconds(self) -> float:
        return getattr(self._local, "seconds", 0.0)


_collector_time = _CollectorTime()


def grammar_clock() -> float:
    """This thread's CPU seconds, less those spent collecting garbage: what a grammar's step
    is measured by."""
    return time.thread_time() - _collector_time.seconds()


def token_data_array(data: np.ndarray) -> llama.llama_token_data_array:
    """A llama.cpp view of a numpy array of Candidates.DTYPE records (no copy)."""
    return llama.llama_token_data_array(
        data=data.ctypes.data_as(llama.llama_token_data_p), size=len(data), selected=-1, sorted=False
    )


class Candidates:
    """Reusable llama_token_data arrays over the vocabulary, filled from logits with numpy
    (used only when a grammar constrains sampling; the scheduler thread owns one)."""

    DTYPE = np.dtype([("id", np.int32), ("logit", np.float32), ("p", np.float32)])

    def __init__(self, n_vocab: int) -> None:
        self.n_vocab = n_vocab
        self._ids = np.arange(n_vocab, dtype=np.int32)
        self._all = np.zeros(n_vocab, dtype=self.DTYPE)
        self._all_array = token_data_array(self._all)

    def fill(self, logits: ctypes.POINTER(ctypes.c_float)):
        """All tokens with these logits; samplers may reorder and shrink the array in place."""
        self._all["id"] = self._ids
        self._all["logit"] = np.ctypeslib.as_array(logits, shape=(self.n_vocab,))
        self._all["p"] = 0.0
        self._all_array.size = self.n_vocab
        self._all_array.selected = -1
        self._all_array.sorted = False
        return self.array

    @property
    def array(self):
        """The filled array, for llama.cpp's samplers."""
        return ctypes.byref(self._all_array)

    @property
    def logits(self) -> np.ndarray:
        """The logits column of the filled array (index = token id until a sampler reorders it)."""
        return self._all["logit"]

    def selected(self) -> int:
        return int(self._all["id"][self._all_array.selected])

    def selected_is_possible(self) -> bool:
        """Whether the selected token survived the masks (a grammar with no way forward masks
        every token, and a sampler then still selects one)."""
        return math.isfinite(float(self._all["logit"][self._all_array.selected]))


class SamplerChain:
    """A llama.cpp sampler chain owned by one slot for the life of one request.

    Order (llama.cpp's own): [grammar] -> penalties -> top_k -> top_p -> min_p -> temperature
    -> dist. Temperature 0 replaces the last four with greedy argmax. The grammar is a
    constraint.Constraint; a lazy one joins once its trigger appears (`observe`).
    """

    def __init__(
        self,
        params: SamplingParams,
        *,
        n_vocab: int,
        penalty_window: int,
        grammar=None,
        lazy_grammar=None,
    ) -> None:
        self.params = params
        self._n_vocab = n_vocab
        # Greedy with nothing to change the logits first: the pick is the first highest logit,
        # which numpy finds in the logits where they lie, without the n_vocab-sized candidate
        # array llama.cpp's greedy sampler builds first (same token: its greedy keeps the first
        # maximum too).
        logits_as_computed = not params.logit_bias and not params.penalized
        self._argmax = params.greedy and logits_as_computed
        # Sampled with nothing that can raise a logit (a bias, a negative penalty): only the
        # tokens within NEGLIGIBLE_TEMPERATURES of the best logit go to the chain.
        self._within_reach = not params.greedy and logits_as_computed
        self._reach = NEGLIGIBLE_TEMPERATURES * params.temperature
        self._grammar = grammar  # a Constraint, owned here, kept out of the chain (see sample())
        self.grammar_ms = 0.0  # CPU time the grammar took in the last sample()
        self._lazy = lazy_grammar  # a grammar.LazyGrammar waiting for its trigger
        self._chain = llama.llama_sampler_chain_init(llama.llama_sampler_chain_default_params())
        if params.logit_bias:  # before every other sampler, as OpenAI applies it
            biases = (llama.llama_logit_bias * len(params.logit_bias))(
                *(llama.llama_logit_bias(token, bias) for token, bias in params.logit_bias))
            self._add(llama.llama_sampler_init_logit_bias(n_vocab, len(params.logit_bias), biases))
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

    @property
    def constrained(self) -> bool:
        """Whether a grammar applies now."""
        return self._grammar is not None

    def mask_ahead(self):
        """The constraint whose next mask may be computed ahead of the step (llguidance's;
        constraint.MasksAhead), if one applies now."""
        grammar = self._grammar
        return grammar if grammar is not None and grammar.engine == "llguidance" else None

    @property
    def watching(self) -> bool:
        """Whether a lazy grammar still waits for its trigger."""
        return self._lazy is not None and not self._lazy.done

    def observe(self, text: str) -> None:
        """All the text generated so far: arms a lazy grammar once its trigger appears."""
        armed = self._lazy.observe(text)
        if armed is not None:
            self._grammar = armed

    def accept_prompt(self, tokens: Iterable[int]) -> None:
        """Let the penalties see the prompt, as they see generated tokens."""
        if self._penalties is not None:
            for token in tokens:
                llama.llama_sampler_accept(self._penalties, token)

    def valid_draft(self, draft: list[int]) -> list[int]:
        """The part of a draft the grammar accepts (a refused token is never verified)."""
        if self._grammar is None or not draft:
            return draft
        return draft[: self._grammar.valid_prefix(draft)]

    def sample(self, ctx: llama.llama_context_p, batch_index: int, candidates: Candidates) -> int:
        """Pick and accept the next token from the logits at `batch_index` of the last decode;
        NO_TOKEN when a grammar allows none. Raises constraint.ConstraintError when the
        grammar cannot go on."""
        if self._argmax:
            return self._sample_argmax(llama.llama_get_logits_ith(ctx, batch_index))
        if self._grammar is None:
            if self._within_reach:
                token = self._sample_within_reach(llama.llama_get_logits_ith(ctx, batch_index))
                if token is not None:
                    return token
            return llama.llama_sampler_sample(self._chain, ctx, batch_index)
        # Most tokens the model picks unconstrained are allowed anyway. So: sample freely,
        # check that one token, and only if the grammar refuses it, mask everything (one
        # vectorised pass) and sample again, as llama.cpp's common sampler does.
        logits = llama.llama_get_logits_ith(ctx, batch_index)
        llama.llama_sampler_apply(self._chain, candidates.fill(logits))
        token = candidates.selected()
        # The grammar's own CPU work (not the chain's, nor time spent waiting for a CPU).
        grammar_s = 0.0
        started = grammar_clock()
        if not self._grammar.allows(token):
            candidates.fill(logits)
            self._grammar.mask(candidates)
            grammar_s = grammar_clock() - started
            llama.llama_sampler_apply(self._chain, candidates.array)
            if not candidates.selected_is_possible():
                self.grammar_ms = grammar_s * 1000
                return NO_TOKEN  # accepting a refused token would throw inside llama.cpp
            token = candidates.selected()
            started = grammar_clock()
        self._grammar.accept(token)
        self.grammar_ms = (grammar_s + grammar_clock() - started) * 1000
        llama.llama_sampler_accept(self._chain, token)
        return token

    def _sample_within_reach(self, logits_pointer) -> int | None:
        """The chain's draw over the tokens within reach of the best logit, in token order as
        llama.cpp lays out the whole vocabulary (so the same seed draws the same token); None,
        before anything is drawn, when no logit is a number."""
        logits = np.ctypeslib.as_array(logits_pointer, shape=(self._n_vocab,))
        ids = np.flatnonzero(logits >= logits.max() - self._reach)
        if not ids.size:
            return None
        data = np.empty(ids.size, dtype=Candidates.DTYPE)
        data["id"] = ids
        data["logit"] = logits[ids]
        data["p"] = 0.0
        array = token_data_array(data)
        llama.llama_sampler_apply(self._chain, ctypes.byref(array))
        token = int(array.data[array.selected].id)
        llama.llama_sampler_accept(self._chain, token)
        return token

    def _sample_argmax(self, logits_pointer) -> int:
        logits = np.ctypeslib.as_array(logits_pointer, shape=(self._n_vocab,))
        token = int(np.argmax(logits))
        if self._grammar is None:
            return token
        started = grammar_clock()
        if not self._grammar.allows(token):  # sample first, mask only when refused
            allowed = self._grammar.allowed()
            token = int(np.argmax(np.where(allowed, logits, -np.inf)))
            if not allowed[token]:
                self.grammar_ms = (grammar_clock() - started) * 1000
                return NO_TOKEN
        self._grammar.accept(token)
        self.grammar_ms = (grammar_clock() - started) * 1000
        return token

    def free(self) -> None:
        if self._chain:
            llama.llama_sampler_free(self._chain)
            self._chain = None
        if self._grammar is not None:
            self._grammar.free()
            self._grammar = None
