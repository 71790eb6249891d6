"""Grammars as requests carry them: plain data, so they cross threads and processes."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Trigger:
    """Where a lazy grammar takes over: at the first `text` in the answer (with `at_start`, only
    as the answer's first non-blank text). The grammar covers `text` itself, or, with `after`,
    starts right after it."""

    text: str
    at_start: bool = False
    after: bool = False


@dataclass(frozen=True)
class GrammarSpec:
    """GBNF text and, for a lazy grammar, its triggers (none: it constrains from the first token)."""

    gbnf: str
    triggers: tuple[Trigger, ...] = ()

    @property
    def lazy(self) -> bool:
        return bool(self.triggers)
