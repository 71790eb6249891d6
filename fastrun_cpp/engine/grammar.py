"""GBNF grammars compiled once per model and cloned into each slot's sampler chain."""

from __future__ import annotations

import ctypes
import threading
from collections import OrderedDict

import llama_cpp.llama_cpp as llama

from fastrun_cpp.engine.model import LlamaModel


class GrammarError(ValueError):
    """llama.cpp could not parse the grammar."""


class CompiledGrammar:
    """A parsed grammar for one vocabulary. `instantiate()` clones it for a request (cloning
    copies the parsed rules: nothing is parsed again).

    With `lazy_patterns` the grammar is lazy: it constrains nothing until the generated text
    matches one of the regexes, and then applies from the start of that match's first group
    (llama.cpp's trigger mechanism, used for tool calls in `auto` mode).
    """

    def __init__(self, model: LlamaModel, gbnf: str, lazy_patterns: tuple[str, ...] = ()) -> None:
        if lazy_patterns:
            patterns = (ctypes.c_char_p * len(lazy_patterns))(*(p.encode("utf-8") for p in lazy_patterns))
            self._prototype = llama.llama_sampler_init_grammar_lazy_patterns(
                model.vocab, gbnf.encode("utf-8"), b"root", patterns, len(lazy_patterns), None, 0
            )
        else:
            self._prototype = llama.llama_sampler_init_grammar(model.vocab, gbnf.encode("utf-8"), b"root")
        if not self._prototype:
            raise GrammarError("the grammar could not be parsed by llama.cpp")

    def instantiate(self) -> llama.llama_sampler_p:
        return llama.llama_sampler_clone(self._prototype)

    def __del__(self) -> None:
        if getattr(self, "_prototype", None):
            llama.llama_sampler_free(self._prototype)
            self._prototype = None


class GrammarCache:
    """Compiled grammars by their GBNF text, least recently used dropped past `capacity`.

    Requests hold their own reference, so an evicted grammar lives until they end.
    """

    def __init__(self, model: LlamaModel, capacity: int = 128) -> None:
        self._model = model
        self._capacity = capacity
        self._grammars: OrderedDict[tuple[str, tuple[str, ...]], CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()

    def compile(self, gbnf: str, lazy_patterns: tuple[str, ...] = ()) -> CompiledGrammar:
        key = (gbnf, lazy_patterns)
        with self._lock:
            grammar = self._grammars.get(key)
            if grammar is not None:
                self._grammars.move_to_end(key)
                return grammar
        grammar = CompiledGrammar(self._model, gbnf, lazy_patterns)
        with self._lock:
            self._grammars[key] = grammar
            while len(self._grammars) > self._capacity:
                self._grammars.popitem(last=False)
        return grammar
