"""Sampling parameters and the per-slot llama.cpp sampler chain built from them."""

from __future__ import annotations

import ctypes
import gc
import math
import secrets
import threading
import time
from typing import Iterable

import llama_cpp.llama_cpp as llama
import numpy as np

from fastrun_cpp.engine.logprobs import logits_view
from fastrun_cpp.engine.request import NO_TOKEN, SamplingParams

MIN_REPETITION_PENALTY = 1e-3
# Tokens whose probabilities Dist adds up at a time before it looks inside the block it needs.
DRAW_BLOCK = 1024
# About how many strided groups Candidates.fill_top splits the vocabulary into: their maxima give
# a logit that at least k tokens reach, cheaply (one elementwise maximum across the rows).
TOP_GROUPS = 1024


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


def seed32(seed: int | None) -> int:
    """The 32-bit seed of a request's draws: its own, modulo 2**32, or a random one where it gave
    none (llama.cpp's LLAMA_DEFAULT_SEED asks it for the same)."""
    return secrets.randbits(32) if seed is None else seed % 2**32


class Dist:
    """llama.cpp's dist sampler (`llama_sampler_init_dist`) in numpy: for a seed, the same
    Mersenne Twister stream (std::mt19937 and numpy's legacy RandomState seed it alike), the same
    uniform number from it (libstdc++'s generate_canonical over two 32-bit outputs), the same
    float32 probabilities, and the same pick: the first token at which the running sum of
    probabilities reaches that share of their total.

    llama.cpp walks the candidates in one scalar loop, an expf and a double add per token: 0.35 ms
    a draw over a 49k-token vocabulary and 2.2 ms over 262k (against 0.07 and 0.3 ms here), for
    each slot of every step, on the scheduler's thread. Here the exponentials are vectorised and the running sum is found a block
    of DRAW_BLOCK tokens at a time, so only the order of the double additions differs: the token
    drawn differs from llama.cpp's only when the draw lands within about 1e-12 of a boundary
    between two tokens. Over at most DRAW_BLOCK tokens the sum runs in llama.cpp's own order."""

    def __init__(self, seed: int | None) -> None:
        self._rng = np.random.RandomState(seed32(seed))
        self._raw: list[int] = []  # 32-bit outputs not used yet, next last

    def uniform(self) -> float:
        """std::uniform_real_distribution<double>(0, 1) on the stream, as libstdc++ computes it."""
        if len(self._raw) < 2:
            self._raw = self._rng.randint(0, 2**32, size=256, dtype=np.uint32).tolist()[::-1]
        low, high = self._raw.pop(), self._raw.pop()
        value = (float(low) + float(high) * 4294967296.0) / 18446744073709551616.0
        return value if value < 1.0 else math.nextafter(1.0, 0.0)

    def pick(self, logits: np.ndarray, scratch: np.ndarray, temperature: float | None = None) -> int | None:
        """The index drawn among `logits` (divided by `temperature` first, in float32 as
        llama.cpp's temperature sampler does, when given); None when none can be drawn (no
        logit, none above -inf, or one that is not a number). `scratch`: float32, at least
        len(logits) rounded up to DRAW_BLOCK."""
        size = logits.size
        if size == 0:
            return None
        draw = self.uniform()  # drawn for one candidate too, as llama.cpp keeps its stream aligned
        if size == 1:
            return 0 if math.isfinite(float(logits[0])) else None
        padded = -(-size // DRAW_BLOCK) * DRAW_BLOCK
        probs = scratch[:padded]
        head = probs[:size]
        if temperature is None:
            np.copyto(head, logits)
        else:
            np.divide(logits, np.float32(temperature), out=head)
        np.subtract(head, head.max(), out=head)
        np.exp(head, out=head)
        if size <= DRAW_BLOCK:
            # What a truncating chain (top_k, top_p) leaves: one running sum, llama.cpp's own.
            running = np.cumsum(head, dtype=np.float64)
            total = float(running[-1])
            if not (math.isfinite(total) and total > 0.0):
                return None
            index = min(int(np.searchsorted(running, total * draw)), size - 1)
            return self._possible(head, index)
        probs[size:] = 0.0
        running = np.cumsum(np.add.reduce(probs.reshape(-1, DRAW_BLOCK), axis=1, dtype=np.float64))
        return self._drawn(probs, running, size, draw)

    @staticmethod
    def pick_rows(dists: list[Dist], logits: np.ndarray, temperatures: np.ndarray,
                  scratch: np.ndarray) -> list[int | None]:
        """pick() for many slots at once: row r of `logits` (float32, one row per slot, more than
        DRAW_BLOCK wide) divided by temperatures[r] and drawn with dists[r]. The same float32
        and float64 operations as pick(), each elementwise or within one row, so each row draws
        the index pick() would draw alone; numpy is called a few times a step instead of a few
        times a slot (16 slots of a 49k vocabulary: about a fifth of a tiny model's step).
        `scratch`: float32, at least rows times the width rounded up to DRAW_BLOCK."""
        rows, size = logits.shape
        padded = -(-size // DRAW_BLOCK) * DRAW_BLOCK
        probs = scratch[: rows * padded].reshape(rows, padded)
        head = probs[:, :size]
        draws = [dist.uniform() for dist in dists]
        np.divide(logits, temperatures.astype(np.float32)[:, None], out=head)
        np.subtract(head, head.max(axis=1, keepdims=True), out=head)
        np.exp(head, out=head)
        probs[:, size:] = 0.0
        running = np.cumsum(np.add.reduce(probs.reshape(rows, -1, DRAW_BLOCK), axis=2, dtype=np.float64), axis=1)
        return [Dist._drawn(probs[row], running[row], size, draw) for row, draw in enumerate(draws)]

    @staticmethod
    def _drawn(probs: np.ndarray, running: np.ndarray, size: int, draw: float) -> int | None:
        """The index `draw` lands on among `size` probabilities (padded with zeros to whole
        blocks), given the running sums of their DRAW_BLOCK blocks: the block first, then the
        running sum within it; None when nothing can be drawn."""
        total = float(running[-1])
        if not (math.isfinite(total) and total > 0.0):
            return None
        target = total * draw
        block = min(int(np.searchsorted(running, target)), len(running) - 1)
        start = block * DRAW_BLOCK
        within = np.cumsum(probs[start:start + DRAW_BLOCK], dtype=np.float64)
        if block:
            within += running[block - 1]
        return Dist._possible(probs[:size], start + min(int(np.searchsorted(within, target)), DRAW_BLOCK - 1))

    @staticmethod
    def _possible(probs: np.ndarray, index: int) -> int:
        """`index`, unless rounding moved a boundary onto an impossible token (past the end, or
        of probability 0): then the nearest possible one before it, else after it."""
        if index < probs.size and probs[index] != 0.0:
            return index
        possible = np.flatnonzero(probs)
        before = possible[possible < index]
        return int(before[-1] if before.size else possible[0])


def _group_count(n_vocab: int) -> int:
    """How many strided groups Candidates.fill_top splits a vocabulary into: the divisor of
    n_vocab nearest TOP_GROUPS (real vocabularies have one: 49152, 151936, 262144...), at least
    half and at most four times it; 0 where there is none (fill_top then never applies)."""
    divisors = [d for d in range(TOP_GROUPS // 2, min(TOP_GROUPS * 4, n_vocab // 2) + 1) if n_vocab % d == 0]
    return min(divisors, key=lambda d: abs(d - TOP_GROUPS), default=0)


class Candidates:
    """Reusable llama_token_data arrays over the vocabulary, filled from logits with numpy, for
    llama.cpp's samplers and grammars (the scheduler thread owns one), and the scratch space of
    the draws made on that thread."""

    DTYPE = np.dtype([("id", np.int32), ("logit", np.float32), ("p", np.float32)])

    def __init__(self, n_vocab: int) -> None:
        self.n_vocab = n_vocab
        self._ids = np.arange(n_vocab, dtype=np.int32)
        self._all = np.zeros(n_vocab, dtype=self.DTYPE)
        self._all_array = token_data_array(self._all)
        self._scratch: np.ndarray | None = None
        self._top_groups = _group_count(n_vocab)
        # Token id of each group's member in each row (fill_top): group g holds g, g + groups, ...
        self._group_rows = np.arange(0, n_vocab, self._top_groups or n_vocab)[:, None]

    def fill(self, logits: ctypes.POINTER(ctypes.c_float)):
        """All tokens with these logits; samplers may reorder and shrink the array in place."""
        self._all["id"] = self._ids
        self._all["logit"] = logits_view(logits, self.n_vocab)
        self._all["p"] = 0.0
        self._hand_over(self.n_vocab)
        return self.array

    def fill_top(self, logits: np.ndarray, k: int) -> bool:
        """Only the tokens that can be among the `k` highest `logits`, for a chain that starts
        with top_k(k): llama.cpp's top_k keeps the same tokens from them, in the same order, as
        from the whole vocabulary, so the rest of the chain sees the same array, at a fraction
        of the cost of filling and sorting the vocabulary. False, with nothing filled, where
        that cannot be promised: two equal logits among the k highest or at their edge (which
        goes first then depends on where llama.cpp's sort meets them), a logit that is not a
        finite number, or a vocabulary that does not split into enough groups."""
        groups = self._top_groups
        if not 0 < k < groups:
            return False
        maxima = logits.reshape(-1, groups).max(axis=0)  # of each strided group of tokens
        # The k-th highest maximum, which at least k tokens (the k groups' maxima) reach, so the
        # k highest logits all do; and the highest, which is NaN if any logit is (NaN sorts last).
        ranked = np.partition(maxima, (groups - k, groups - 1))
        floor = ranked[groups - k]
        if not math.isfinite(float(ranked[-1]) - float(floor)):
            return False
        ids = (np.flatnonzero(maxima >= floor) + self._group_rows).ravel()
        values = logits[ids]
        reached = values >= floor
        ids, values = ids[reached], values[reached]
        highest = np.sort(values)[-(k + 1):]
        if (highest[1:] == highest[:-1]).any():
            return False
        kept = self._all[: ids.size]
        kept["id"] = ids
        kept["logit"] = values
        kept["p"] = 0.0
        self._hand_over(ids.size)
        return True

    def _hand_over(self, size: int) -> None:
        """The first `size` entries, as filled, are the array llama.cpp's samplers get next."""
        self._all_array.size = size
        self._all_array.selected = -1
        self._all_array.sorted = False

    @property
    def array(self):
        """The filled array, for llama.cpp's samplers."""
        return ctypes.byref(self._all_array)

    @property
    def logits(self) -> np.ndarray:
        """The logits column of the filled array (index = token id until a sampler reorders it)."""
        return self._all["logit"]

    @property
    def scratch(self) -> np.ndarray:
        """Dist.pick's scratch space, for this vocabulary."""
        if self._scratch is None:
            self._scratch = np.zeros(-(-self.n_vocab // DRAW_BLOCK) * DRAW_BLOCK, dtype=np.float32)
        return self._scratch

    def remaining_logits(self) -> np.ndarray:
        """The logits of the tokens the samplers left, in the order they left them."""
        # llama.cpp's samplers reorder and shrink the array in place; they never move it.
        assert ctypes.cast(self._all_array.data, ctypes.c_void_p).value == self._all.ctypes.data
        return np.ascontiguousarray(self._all["logit"][: self._all_array.size])

    def token_at(self, index: int) -> int:
        """The token at `index` of the array as the samplers left it."""
        return int(self._all["id"][index])

    def selected(self) -> int:
        return int(self._all["id"][self._all_array.selected])

    def selected_is_possible(self) -> bool:
        """Whether the selected token survived the masks (a grammar with no way forward masks
        every token, and a sampler then still selects one)."""
        return math.isfinite(float(self._all["logit"][self._all_array.selected]))


class SamplerChain:
    """A slot's sampler for the life of one request: llama.cpp's sampler chain, then a Dist.

    Order (llama.cpp's own): [grammar] -> logit bias -> penalties -> top_k -> top_p -> min_p ->
    temperature -> dist. Temperature 0 replaces the last four with greedy argmax. The chain
    changes the logits; the Dist draws from what it leaves (llama.cpp's dist, in the chain,
    where top_k leaves few). The grammar is a
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
        logits_as_computed = not params.logit_bias and not params.penalized
        # Greedy with nothing to change the logits first: the pick is the first highest logit,
        # which numpy finds in the logits where they lie, without the n_vocab-sized candidate
        # array llama.cpp's greedy sampler builds first (same token: its greedy keeps the first
        # maximum too).
        self._argmax = params.greedy and logits_as_computed
        # A chain that keeps at most DRAW_BLOCK tokens draws with llama.cpp's own dist sampler:
        # over so few, its scalar loop costs less than the calls into numpy. Its stream is the
        # Dist's for the same seed, but for the one seed it reads as "pick one at random".
        seed = seed32(params.seed)
        draws_in_chain = (not params.greedy and 0 < params.top_k <= DRAW_BLOCK
                          and seed != llama.LLAMA_DEFAULT_SEED)
        self._dist = None if params.greedy or draws_in_chain else Dist(seed)
        # Sampled with nothing but the temperature between the logits and the draw (OpenAI's
        # defaults): the Dist scales the logits where they lie, without the candidate array.
        self._temperature_only = (not params.greedy and logits_as_computed and params.top_k <= 0
                                  and params.top_p >= 1.0 and params.min_p <= 0.0)
        # Sampled with top_k first in the chain: the chain gets only the tokens that can make
        # the top k (Candidates.fill_top).
        self._top_k_first = not params.greedy and logits_as_computed and params.top_k > 0
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
        if draws_in_chain:
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
    def draws_from_temperature_alone(self) -> bool:
        """Whether its next pick is a draw from the logits as computed, scaled by the temperature
        alone (OpenAI's defaults, no grammar): what Dist.pick_rows draws for many slots at once."""
        return self._temperature_only and self._grammar is None and self._lazy is None

    @property
    def dist(self) -> Dist | None:
        """Its draw, where a Dist draws (sampled, and not in llama.cpp's chain)."""
        return self._dist

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
        """Let the penalties see the prompt, as they see generated tokens (an image's
        placeholders are no tokens: they are skipped)."""
        if self._penalties is not None:
            for token in tokens:
                if token >= 0:
                    llama.llama_sampler_accept(self._penalties, token)

    def valid_draft(self, draft: list[int]) -> list[int]:
        """The part of a draft the grammar accepts (a refused token is never verified)."""
        if self._grammar is None or not draft:
            return draft
        return draft[: self._grammar.valid_prefix(draft)]

    def sample(self, ctx: llama.llama_context_p, batch_index: int, candidates: Candidates) -> int:
        """Pick and accept the next token from the logits at `batch_index` of the last decode;
        NO_TOKEN when a grammar allows none (or no logit is a number). Raises
        constraint.ConstraintError when the grammar cannot go on."""
        logits = llama.llama_get_logits_ith(ctx, batch_index)
        if self._argmax:
            return self._sample_argmax(logits)
        if self._grammar is None:
            token = self._pick(logits, candidates)
            if self._penalties is not None and token != NO_TOKEN:
                llama.llama_sampler_accept(self._chain, token)
            return token
        # Most tokens the model picks unconstrained are allowed anyway. So: sample freely,
        # check that one token, and only if the grammar refuses it, mask everything (one
        # vectorised pass) and sample again, as llama.cpp's common sampler does.
        token = self._pick(logits, candidates)
        # The grammar's own CPU work (not the chain's, nor time spent waiting for a CPU).
        grammar_s = 0.0
        started = grammar_clock()
        if token == NO_TOKEN or not self._grammar.allows(token):
            candidates.fill(logits)
            self._grammar.mask(candidates)
            grammar_s = grammar_clock() - started
            token = self._pick_from(candidates)
            if token == NO_TOKEN:
                self.grammar_ms = grammar_s * 1000
                return NO_TOKEN  # accepting a refused token would throw inside llama.cpp
            started = grammar_clock()
        self._grammar.accept(token)
        self.grammar_ms = (grammar_s + grammar_clock() - started) * 1000
        llama.llama_sampler_accept(self._chain, token)
        return token

    def accept_forced(self, token: int) -> None:
        """A token the engine writes itself (a reasoning budget's closing): the grammar and
        the penalties see it as if it had been picked."""
        if self._grammar is not None and self._grammar.allows(token):
            self._grammar.accept(token)
        if self._penalties is not None:
            llama.llama_sampler_accept(self._chain, token)

    def _pick(self, logits_pointer, candidates: Candidates) -> int:
        """The token picked from these logits, unconstrained."""
        if self._temperature_only:
            logits = logits_view(logits_pointer, self._n_vocab)
            index = self._dist.pick(logits, candidates.scratch, self.params.temperature)
            return NO_TOKEN if index is None else index
        if not (self._top_k_first and candidates.fill_top(
                logits_view(logits_pointer, self._n_vocab), self.params.top_k)):
            candidates.fill(logits_pointer)
        return self._pick_from(candidates)

    def _pick_from(self, candidates: Candidates) -> int:
        """The chain over the filled (perhaps masked) candidates, then the pick: llama.cpp's
        greedy or dist sampler picks inside the chain, a Dist after it."""
        llama.llama_sampler_apply(self._chain, candidates.array)
        if self._dist is None:
            return candidates.selected() if candidates.selected_is_possible() else NO_TOKEN
        index = self._dist.pick(candidates.remaining_logits(), candidates.scratch)
        return NO_TOKEN if index is None else candidates.token_at(index)

    def _sample_argmax(self, logits_pointer) -> int:
        logits = logits_view(logits_pointer, self._n_vocab)
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
