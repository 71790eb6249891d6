"""Grammars as requests carry them: plain data, so they cross threads and processes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple


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


@dataclass(frozen=True)
class ToolCallFormat:
    """How a model writes tool calls, as GBNF templates (plain data, so it crosses to the
    grammar builder's worker processes): `call` has holes for a function's name literal and
    its arguments rule, `calls` one for the rule of a single call."""

    NAME = "\x00name\x00"
    ARGUMENTS = "\x00arguments\x00"
    CALL = "\x00call\x00"

    call: str
    calls: str

    def call_rule(self, name_literal: str, arguments_rule: str) -> str:
        return self.call.replace(self.NAME, name_literal).replace(self.ARGUMENTS, arguments_rule)

    def calls_rule(self, call_rule: str) -> str:
        return self.calls.replace(self.CALL, call_rule)


class CallableFunction(NamedTuple):
    """A function a tool-call grammar lets the model call: its arguments follow `parameters`
    (all of it when `strict`, else what a grammar can enforce), or, for a custom tool, they
    are {"input": text} with the text in `text_grammar` (syntax, definition)."""

    name: str
    parameters: dict[str, Any]
    strict: bool = False
    text_grammar: tuple[str, str] | None = None
