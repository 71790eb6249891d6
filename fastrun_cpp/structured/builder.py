"""Grammars from JSON schemas (response formats, tool parameters), built where a runaway cannot
pin the server.

Bounds are checked here first (structured.guard: a 400 naming the limit). The conversion
itself runs in worker processes: one that passes its time limit is killed and replaced, and
the request gets a 400. Results are cached by schema within a byte budget.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection
from typing import Any

from fastrun_cpp.fair_turns import FairTurns, Share
from fastrun_cpp.killable import KillablePool, WorkerDied, WorkerTimeout, serve
from fastrun_cpp.lru import ByteLRU
from fastrun_cpp.limits import Limits
from fastrun_cpp.structured.guard import PatternError, SchemaBoundsError, check_schema_bounds
from fastrun_cpp.structured.spec import CallableFunction, ToolCallFormat

logger = logging.getLogger(__name__)

# A schema with this title makes the worker hang, with --debug-faults schema-hang (tests only).
HANG_TITLE = "fastrun-debug-hang"


class BuildError(ValueError):
    """The schema cannot become a grammar (invalid, unenforceable, over a limit, or too slow);
    the message says why, for the client."""


# ---------------------------------------------------------------- the worker side

def _convert(kind: str, payload: dict[str, Any]) -> str:
    from fastrun_cpp.structured.json_schema import schema_to_gbnf, tool_calls_gbnf

    if kind == "schema":
        return schema_to_gbnf(payload["schema"], strict=payload["strict"])
    call_format = ToolCallFormat(**payload["format"])
    functions = [CallableFunction(**function) for function in payload["functions"]]
    return tool_calls_gbnf(functions, call_format.call_rule, call_format.calls_rule, relaxed=payload["relaxed"],
                           max_repetition=payload["max_repetition"])


def _serve(connection: Connection, hang_on_request: bool) -> None:
    """A worker process: converts what it is sent until the pipe closes."""
    from fastrun_cpp.structured.json_schema import SchemaError

    def handle(message: tuple[str, dict[str, Any]]) -> tuple[str, str]:
        kind, payload = message
        if hang_on_request and HANG_TITLE in json.dumps(payload):
            while True:  # a runaway: it burns a core until it is killed
                pass
        try:
            return "ok", _convert(kind, payload)
        except SchemaError as exc:
            return "schema_error", str(exc)
        except Exception as exc:  # noqa: BLE001 - whatever the converter does, the client learns why
            return "schema_error", f"the schema cannot be turned into a grammar: {type(exc).__name__}: {exc}"

    serve(connection, handle)


# ---------------------------------------------------------------- the server side

class GrammarBuilder:
    def __init__(self, limits: Limits, *, workers: int = 2, hang_on_request: bool = False) -> None:
        self.limits = limits
        self._workers = KillablePool(_serve, (hang_on_request,), workers=workers, name="schema conversion")
        self._threads = ThreadPoolExecutor(workers, thread_name_prefix="fastrun-schema")
        self._cache: ByteLRU[str, str] = ByteLRU(32 << 20)
        self._turns = FairTurns(workers)  # conversions take turns by account (fair_turns.py)

    @property
    def killed(self) -> int:
        """Conversions stopped at their time limit."""
        return self._workers.killed

    async def schema_grammar(self, schema: Any, *, strict: bool = True, share: Share = Share()) -> str:
        """GBNF for a response_format schema; raises BuildError."""
        self._check(schema, "the schema")
        return await self._build("schema", {"schema": schema, "strict": strict}, share)

    async def tool_grammar(self, functions: list[CallableFunction], call_format: ToolCallFormat, *,
                           relaxed: bool = False, share: Share = Share()) -> str:
        """GBNF for tool calls of these functions written in `call_format`; raises BuildError.

        `relaxed` (the model may choose not to call, `tool_choice: auto`): no schema fails the
        request. What breaks a bound or cannot be enforced is left out of the grammar (the
        caller checks the arguments after), and a function whose schema is too large, or
        cannot be converted at all, takes any JSON object as its arguments."""
        checked = []
        for name, parameters, strict, text_grammar in functions:
            where = f"function {name!r}: the parameters"
            try:
                parameters = self._check(parameters, where, relaxed=relaxed)
            except BuildError as exc:
                if not relaxed:
                    raise
                logger.info("%s: its arguments are not constrained (%s)", where, exc)
                parameters = {"type": "object"}
            checked.append(CallableFunction(name, parameters, strict and not relaxed, text_grammar)._asdict())
        payload = {"functions": checked, "format": dataclasses.asdict(call_format), "relaxed": relaxed,
                   "max_repetition": self.limits.repetition}
        return await self._build("tools", payload, share)

    def _check(self, schema: Any, where: str, *, relaxed: bool = False) -> Any:
        try:
            return check_schema_bounds(schema, self.limits, where, relaxed=relaxed)
        except (SchemaBoundsError, PatternError) as exc:
            raise BuildError(str(exc)) from exc

    async def _build(self, kind: str, payload: dict[str, Any], share: Share) -> str:
        try:
            key = kind + json.dumps(payload)  # keeps property order: part of the grammar
        except (TypeError, ValueError) as exc:
            raise BuildError(f"the schema is not JSON: {exc}") from exc
        cached = self._cache.get(key)
        if cached is not None:
            return cached
        async with self._turns.turn(share):  # one conversion per account in turn; a caller gone never runs
            cached = self._cache.get(key)
            if cached is not None:
                return cached
            status, result = await asyncio.get_running_loop().run_in_executor(self._threads, self._run,
                                                                              (kind, payload))
        if status != "ok":
            raise BuildError(result)
        self._cache.put(key, result, 2 * (len(key) + len(result)))
        return result

    def _run(self, message: tuple[str, dict[str, Any]]) -> tuple[str, str]:
        """In a thread of this builder's pool: one worker's turn."""
        try:
            return self._workers.run(message, self.limits.schema_timeout_s)
        except WorkerTimeout:
            return "timeout", (f"turning the schema into a grammar took over {self.limits.schema_timeout_s:g} s "
                               "(limit --limit-schema-timeout-s)")
        except WorkerDied as exc:
            return "error", str(exc)

    def close(self) -> None:
        self._threads.shutdown(wait=False, cancel_futures=True)
        self._workers.close()
