"""GBNF grammars: what a request asks for (GrammarSpec), compiled once per vocabulary
(GrammarCompiler, off the event loop and bounded), and cloned into each slot's sampler.

A grammar may be lazy: it constrains nothing until the generated text reaches one of its
triggers (a tool call's opening tag, the end of the reasoning). Triggers are watched here, in
Python, and the grammar is armed only with text it accepts, token by token; llama.cpp's own lazy
grammars throw a C++ exception (which kills the process) when a trigger arrives inside a token
carrying text the grammar refuses.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import threading
import warnings
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection
from pathlib import Path

import llama_cpp.llama_cpp as llama
import llguidance
from llguidance.gbnf_to_lark import gbnf_to_lark
from llguidance.llamacpp import lltokenizer_from_vocab

from fastrun_cpp.engine.errors import GrammarError
from fastrun_cpp.lru import ByteLRU
from fastrun_cpp.engine.constraint import Constraint, GbnfConstraint, GuidanceConstraint
from fastrun_cpp.engine.faults import GRAMMAR_HANG_TEXT
from fastrun_cpp.fair_turns import FairTurns, Share
from fastrun_cpp.killable import WALL_TIME_FACTOR, KillablePool, WorkerDied, WorkerTimeout, serve
from fastrun_cpp.limits import Limits
from fastrun_cpp.engine.model import LlamaModel
from fastrun_cpp.engine.sampling import Candidates, grammar_clock
from fastrun_cpp.structured.spec import GrammarSpec, Trigger

logger = logging.getLogger(__name__)

LIMIT_VOCABULARY = 131072  # the grammar time limits are for a vocabulary of this many tokens


def vocabulary_scale(n_vocab: int) -> float:
    """How much longer than its limit a grammar may take with this vocabulary: masking it is
    work per token of the vocabulary."""
    return max(1.0, n_vocab / LIMIT_VOCABULARY)


# llguidance's lexer burns about this much fuel per millisecond (its documentation's figure).
LEXER_FUEL_PER_MS = 14_000


class CompiledGrammar:
    """A grammar ready for one vocabulary; `instantiate()` gives a request its own
    constraint.Constraint (nothing is parsed again).

    llguidance runs every grammar it accepts (the GBNF is converted to its Lark dialect);
    llama.cpp's grammar sampler runs the rest (`engine` says which).
    """

    def __init__(self, spec: GrammarSpec, *, matcher=None, sampler: llama.llama_sampler_p | None = None,
                 n_vocab: int, end_tokens: frozenset[int] = frozenset()) -> None:
        self.spec = spec
        self._end_tokens = end_tokens
        self._matcher = matcher  # llguidance.LLMatcher in its start state, copied per request
        self._prototype = sampler
        self._n_vocab = n_vocab
        # The parsed form takes a few times the text's size; a bound for the cache, not a measure.
        self.nbytes = 8 * len(spec.gbnf) + 4096

    @property
    def engine(self) -> str:
        return "llguidance" if self._matcher is not None else "llama.cpp"

    @property
    def triggers(self) -> tuple[Trigger, ...]:
        return self.spec.triggers

    def instantiate(self) -> Constraint:
        if self._matcher is not None:
            return GuidanceConstraint(self._matcher.deep_copy(), self._n_vocab, self._end_tokens)
        return GbnfConstraint(llama.llama_sampler_clone(self._prototype), self._n_vocab)

    def __del__(self) -> None:
        if getattr(self, "_prototype", None):
            llama.llama_sampler_free(self._prototype)
            self._prototype = None


def _try_compiles(connection: Connection, model_path: str, limits: Limits, hang_on_request: bool) -> None:
    """A trial process: compiles each grammar it is sent for the model's vocabulary, with the
    server's own checks, and answers None (it compiles) or why it cannot."""
    compiler = GrammarCompiler(LlamaModel(Path(model_path), vocab_only=True), limits)

    def handle(spec: GrammarSpec) -> str | None:
        if hang_on_request and GRAMMAR_HANG_TEXT in spec.gbnf:
            while True:  # a runaway: it burns a core until it is killed
                pass
        try:
            compiler.compile_now(spec)
        except GrammarError as exc:
            return str(exc)
        return None

    serve(connection, handle)


class GrammarCompiler:
    """Compiles grammars for one vocabulary in a bounded pool of its own (never the event loop's
    default one), caches them by text within a byte budget, and refuses grammars that are too
    big, too deeply nested, or whose first step already costs too much (a grammar whose
    per-token cost explodes would stall every request decoding beside it).

    `isolated` (the server's): a new grammar is compiled first in a trial process, which is
    killed if it passes the time limit, and only one that compiled there is compiled here, so a
    runaway compile never keeps a thread of the server busy."""

    def __init__(self, model: LlamaModel, limits: Limits | None = None, *, cache_bytes: int = 64 << 20,
                 workers: int = 2, isolated: bool = False, hang_on_request: bool = False) -> None:
        self._model = model
        self.limits = limits or Limits()
        self._cache: ByteLRU[GrammarSpec, CompiledGrammar] = ByteLRU(cache_bytes)
        self._workers = workers
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="fastrun-grammar")
        self._local = threading.local()
        # llguidance's view of the vocabulary takes ~1.5 s for 262k tokens: built once, now,
        # while the server starts.
        self._tokenizer = self._pool.submit(self._build_tokenizer)
        self._turns = FairTurns(workers)  # compiles take turns by account (fair_turns.py)
        self._trials: KillablePool | None = None
        if isolated:  # hang_on_request: --debug-faults grammar-hang (tests only)
            self._trials = KillablePool(_try_compiles, (str(model.path), self.limits, hang_on_request),
                                        workers=workers, name="grammar compile")
            # Not in the pool: close() waits for the pool (its work reads the vocabulary), and need
            # not wait for a trial process to start (seconds for a large vocabulary) only to kill it.
            threading.Thread(target=self._trials.warm, name="fastrun-grammar-warm", daemon=True).start()
        self.stuck = 0  # compilations abandoned past their time limit here (their threads are lost)

    @property
    def killed(self) -> int:
        """Trial compilations stopped at their time limit (their processes killed)."""
        return self._trials.killed if self._trials is not None else 0

    def _build_tokenizer(self):
        with warnings.catch_warnings():  # it calls a renamed llama.cpp function once per token
            warnings.simplefilter("ignore", DeprecationWarning)
            return lltokenizer_from_vocab(self._model.vocab, eos_token=sorted(self._model.eog_token_ids))

    def _parser_limits(self) -> llguidance.LLParserLimits:
        # A step's work is capped by fuel (llguidance stops and reports an error past it), so
        # one constrained request costs the batch at most about this much per token.
        fuel = int(LEXER_FUEL_PER_MS * self.limits.grammar_step_ms * vocabulary_scale(self._model.n_vocab))
        return llguidance.LLParserLimits(step_lexer_fuel=fuel, step_max_items=fuel // 4, verbose_errors=False)

    async def compile(self, spec: GrammarSpec, share: Share = Share()) -> CompiledGrammar:
        """The compiled grammar of `spec`; raises GrammarError. A new one waits for its
        account's turn (one compile per account in turn while they queue); a caller cancelled
        while it waits never compiles."""
        grammar = self._cache.get(spec)
        if grammar is not None:
            return grammar
        async with self._turns.turn(share):
            grammar = self._cache.get(spec)  # compiled meanwhile for another request
            return grammar if grammar is not None else await self._compile_new(spec)

    async def _compile_new(self, spec: GrammarSpec) -> CompiledGrammar:
        loop = asyncio.get_running_loop()
        # Checking a large grammar's text takes a while: off the event loop, too.
        await loop.run_in_executor(self._pool, self._check, spec)
        # What compiled in the trial compiles here in about the same CPU time: the limit is
        # now only a watchdog, in wall time, so far past it that only a runaway meets it on a
        # busy machine (without trials, the limit itself).
        watchdog_s = self.limits.grammar_timeout_s * (WALL_TIME_FACTOR if self._trials is not None else 1)
        future = loop.run_in_executor(self._pool, self._compile, spec)
        try:
            grammar = await asyncio.wait_for(asyncio.shield(future), watchdog_s)
        except asyncio.TimeoutError:
            # Its thread cannot be stopped; a fresh pool keeps it from holding up the next ones.
            self.stuck += 1
            self._pool.shutdown(wait=False)
            self._pool = ThreadPoolExecutor(self._workers, thread_name_prefix="fastrun-grammar")
            raise GrammarError(f"the grammar took over {self.limits.grammar_timeout_s:g} s to compile "
                               "(limit --limit-grammar-timeout-s)") from None
        self._cache.put(spec, grammar, grammar.nbytes)
        return grammar

    def _check(self, spec: GrammarSpec) -> None:
        """Refuse (GrammarError) what llama.cpp should never see, then, when isolated, what
        does not compile in a trial process within the time limit (the process is then
        killed)."""
        check_gbnf(spec.gbnf, self.limits)
        if self._trials is None:
            return
        timeout_s = self.limits.grammar_timeout_s
        try:
            verdict = self._trials.run(spec, timeout_s)
        except WorkerTimeout:
            raise GrammarError(f"the grammar took over {timeout_s:g} s to compile (limit "
                               "--limit-grammar-timeout-s)") from None
        except WorkerDied as exc:
            raise GrammarError(f"the grammar could not be compiled: {exc}") from None
        if verdict is not None:
            raise GrammarError(verdict)

    def compile_now(self, spec: GrammarSpec) -> CompiledGrammar:
        """The same, blocking (for the engine's own thread or tests)."""
        grammar = self._cache.get(spec)
        if grammar is None:
            check_gbnf(spec.gbnf, self.limits)
            grammar = self._compile(spec)
            self._cache.put(spec, grammar, grammar.nbytes)
        return grammar

    def _compile(self, spec: GrammarSpec) -> CompiledGrammar:
        matcher = self._guidance_matcher(spec)
        if matcher is not None:
            return CompiledGrammar(spec, matcher=matcher, n_vocab=self._model.n_vocab,
                                   end_tokens=frozenset(self._model.eog_token_ids))
        sampler = llama.llama_sampler_init_grammar(self._model.vocab, spec.gbnf.encode("utf-8"), b"root")
        if not sampler:
            raise GrammarError("the grammar could not be parsed by llama.cpp")
        grammar = CompiledGrammar(spec, sampler=sampler, n_vocab=self._model.n_vocab)
        self._probe(grammar)
        return grammar

    def _guidance_matcher(self, spec: GrammarSpec):
        """llguidance's matcher for the grammar, its first mask computed (a first step over the
        fuel fails here, not in the batch); None when llguidance cannot take it."""
        try:
            lark = gbnf_to_lark(spec.gbnf)
        except Exception as exc:  # noqa: BLE001 - the converter's errors are its own classes
            logger.info("llguidance's GBNF converter refused a grammar (%s); llama.cpp's grammar engine runs it",
                        type(exc).__name__)
            return None
        matcher = llguidance.LLMatcher(self._tokenizer.result(), lark, log_level=0, limits=self._parser_limits())
        if matcher.is_error():
            error = matcher.get_error()
            if "fuel" in error or "too many" in error.lower() or "limit" in error.lower():
                raise GrammarError(f"the grammar is too costly to run: {error.splitlines()[0]}")
            logger.info("llguidance refused a grammar (%s); llama.cpp's grammar engine runs it", error.splitlines()[0])
            return None
        first = matcher.deep_copy()
        first.compute_bitmask()
        if first.is_error():
            raise GrammarError(f"the grammar is too costly to run: {first.get_error().splitlines()[0]} "
                               "(limit --limit-grammar-step-ms)")
        return matcher

    def _candidates(self) -> Candidates:
        candidates = getattr(self._local, "candidates", None)
        if candidates is None:
            candidates = self._local.candidates = Candidates(self._model.n_vocab)
        return candidates

    def _probe(self, grammar: CompiledGrammar) -> None:
        candidates = self._candidates()
        constraint = grammar.instantiate()
        try:
            logits = (ctypes.c_float * self._model.n_vocab)()
            # CPU time of this thread: the work the grammar makes, not the time a busy machine
            # kept the thread waiting (nor a garbage collection that started meanwhile).
            started = grammar_clock()
            candidates.fill(logits)
            constraint.mask(candidates)
            elapsed_ms = (grammar_clock() - started) * 1000
        finally:
            constraint.free()
        limit_ms = self.limits.grammar_first_step_ms * vocabulary_scale(self._model.n_vocab)
        if elapsed_ms > limit_ms:
            raise GrammarError(
                f"the grammar is too costly to run: its first step took {elapsed_ms:.0f} ms of CPU, over "
                f"{limit_ms:g} ms for this model's vocabulary (limit --limit-grammar-first-step-ms); simplify "
                "its patterns or repetitions"
            )

    def close(self) -> None:
        """Stop compiling. Waits for the work that reads the model's vocabulary (the tokenizer
        view, a compile under way): the weights are freed next, and a model unloaded while
        its server runs must not leave a thread reading freed memory."""
        self._pool.shutdown(wait=True, cancel_futures=True)
        if self._trials is not None:
            self._trials.close()


def check_gbnf(gbnf: str, limits: Limits) -> None:
    """Refuse grammar text llama.cpp should never see: too large, nested deeper than its
    recursive parser survives, or with a repetition it expands into that many nested rules."""
    size = len(gbnf.encode("utf-8"))
    if size > limits.grammar_bytes:
        raise GrammarError(f"the grammar is {size} bytes, over {limits.grammar_bytes} (limit --limit-grammar-bytes)")
    depth = deepest = 0
    index, length = 0, len(gbnf)
    while index < length:
        char = gbnf[index]
        if char == '"':  # a literal: skip to its closing quote
            index += 1
            while index < length and gbnf[index] != '"':
                index += 2 if gbnf[index] == "\\" else 1
        elif char == "[":  # a character class
            index += 1
            while index < length and gbnf[index] != "]":
                index += 2 if gbnf[index] == "\\" else 1
        elif char == "#":  # a comment
            while index < length and gbnf[index] != "\n":
                index += 1
        elif char == "(":
            depth += 1
            deepest = max(deepest, depth)
        elif char == ")":
            depth -= 1
        elif char == "{":
            close = gbnf.find("}", index)
            counts = [part.strip() for part in gbnf[index + 1 : close].split(",")] if close > 0 else []
            if any(part.isdigit() and int(part) > limits.repetition for part in counts):
                raise GrammarError(f"the grammar repeats something {gbnf[index:close + 1]} times, over "
                                   f"{limits.repetition} (limit --limit-repetition)")
        index += 1
    if deepest > limits.grammar_nesting:
        raise GrammarError(f"the grammar nests {deepest} groups deep, over {limits.grammar_nesting} "
                           "(limit --limit-grammar-nesting)")


class LazyGrammar:
    """A slot's grammar while it waits for a trigger, then the armed sampler.

    `observe(text)` is given all generated text so far, after every token; once a trigger
    appears, the grammar is armed with the text from the trigger on, fed token by token only as
    far as the grammar accepts it. Text it refuses means the model did not start what the
    grammar describes: the grammar then stays off for good (the parsers treat the text as text).
    """

    def __init__(self, grammar: CompiledGrammar, model: LlamaModel) -> None:
        self._grammar = grammar
        self._model = model
        self._longest = max(len(t.text) for t in grammar.triggers)
        self._scanned = 0  # text before this index holds no trigger start
        self.done = False  # armed or given up: nothing more to watch

    def observe(self, text: str) -> Constraint | None:
        """The armed constraint when a trigger has just appeared in `text`, else None."""
        if self.done:
            return None
        found = self._find(text)
        if found is None:
            self._scanned = max(self._scanned, len(text) - self._longest + 1)
            return None
        self.done = True
        return self._arm(text[found:])

    def _find(self, text: str) -> int | None:
        """Where the grammar starts, if a trigger is in the text."""
        best: int | None = None
        blank = len(text) - len(text.lstrip())
        head = text[blank:]
        waiting = False  # whether some trigger may still come
        for trigger in self._grammar.triggers:
            if trigger.at_start:
                if not head.startswith(trigger.text):
                    waiting = waiting or trigger.text.startswith(head)
                    continue
                index = blank
            else:
                waiting = True
                index = text.find(trigger.text, max(0, self._scanned))
                if index < 0:
                    continue
            start = index + len(trigger.text) if trigger.after else index
            best = start if best is None else min(best, start)
        if best is None and not waiting:
            self.done = True
        return best

    def _arm(self, text: str) -> Constraint | None:
        constraint = self._grammar.instantiate()
        # llguidance matches text, never a control token; llama.cpp's grammar matches a
        # control token by its text.
        special = constraint.engine != "llguidance"
        for token in self._model.tokenize(text, add_special=False, parse_special=special) if text else ():
            if not constraint.allows(token):
                constraint.free()
                return None
            constraint.accept(token)
        return constraint
