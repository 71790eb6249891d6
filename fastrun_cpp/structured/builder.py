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
import multiprocessing
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection
from typing import Any

from fastrun_cpp.lru import ByteLRU
from fastrun_cpp.limits import Limits
from fastrun_cpp.structured.guard import PatternError, SchemaBoundsError, check_schema_bounds
from fastrun_cpp.structured.spec import CallableFunction, ToolCallFormat

logger = logging.getLogger(__name__)

# A schema with this title makes the worker hang, with --debug-faults schema-hang (tests only).
HANG_TITLE = "fastrun-debug-hang"


class ConversionTimeout(Exception):
    pass


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

    connection.send(("ready", None))
    while True:
        try:
            kind, payload = connection.recv()
        except EOFError:
            return
        if hang_on_request and HANG_TITLE in json.dumps(payload):
            time.sleep(3600)
        try:
            connection.send(("ok", _convert(kind, payload)))
        except SchemaError as exc:
            connection.send(("schema_error", str(exc)))
        except Exception as exc:  # noqa: BLE001 - whatever the converter does, the client learns why
            connection.send(("schema_error", f"the schema cannot be turned into a grammar: {type(exc).__name__}: {exc}"))


# ---------------------------------------------------------------- the server side

class _Worker:
    def __init__(self, context, hang_on_request: bool) -> None:
        self.connection, child = context.Pipe()
        self.process = context.Process(target=_serve, args=(child, hang_on_request), daemon=True,
                                       name="fastrun-grammar-builder")
        self.process.start()
        child.close()
        if not self.connection.poll(60) or self.connection.recv()[0] != "ready":
            self.kill()
            raise RuntimeError("a grammar worker process did not start")

    def call(self, message: tuple[str, dict[str, Any]], timeout_s: float) -> tuple[str, str]:
        self.connection.send(message)
        if not self.connection.poll(timeout_s):
            raise ConversionTimeout()
        return self.connection.recv()

    def kill(self) -> None:
        self.process.kill()
        self.process.join(5)
        self.connection.close()


class GrammarBuilder:
    def __init__(self, limits: Limits, *, workers: int = 2, hang_on_request: bool = False) -> None:
        self.limits = limits
        self._context = multiprocessing.get_context("spawn")
        self._hang_on_request = hang_on_request
        self._idle: queue.SimpleQueue[_Worker] = queue.SimpleQueue()
        self._slots = threading.BoundedSemaphore(workers)
        self._threads = ThreadPoolExecutor(workers, thread_name_prefix="fastrun-schema")
        self._cache: ByteLRU[str, str] = ByteLRU(32 << 20)
        self.killed = 0  # conversions stopped at their time limit

    async def schema_grammar(self, schema: Any, *, strict: bool = True) -> str:
        """GBNF for a response_format schema; raises BuildError."""
        self._check(schema, "the schema")
        return await self._build("schema", {"schema": schema, "strict": strict})

    async def tool_grammar(self, functions: list[CallableFunction], call_format: ToolCallFormat, *,
                           relaxed: bool = False) -> str:
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
        return await self._build("tools", payload)

    def _check(self, schema: Any, where: str, *, relaxed: bool = False) -> Any:
        try:
            return check_schema_bounds(schema, self.limits, where, relaxed=relaxed)
        except (SchemaBoundsError, PatternError) as exc:
            raise BuildError(str(exc)) from exc

    async def _build(self, kind: str, payload: dict[str, Any]) -> str:
        try:
            key = kind + json.dumps(payload)  # keeps property order: part of the grammar
        except (TypeError, ValueError) as exc:
            raise BuildError(f"the schema is not JSON: {exc}") from exc
        cached = self._cache.get(key)
        if cached is not None:
            return cached
        status, result = await asyncio.get_running_loop().run_in_executor(self._threads, self._run, (kind, payload))
        if status != "ok":
            raise BuildError(result)
        self._cache.put(key, result, 2 * (len(key) + len(result)))
        return result

    def _run(self, message: tuple[str, dict[str, Any]]) -> tuple[str, str]:
        """In a thread of this builder's pool: one worker's turn (started if none is idle)."""
        with self._slots:
            try:
                worker = self._idle.get_nowait()
            except queue.Empty:
                worker = _Worker(self._context, self._hang_on_request)
            try:
                result = worker.call(message, self.limits.schema_timeout_s)
            except ConversionTimeout:
                worker.kill()
                self.killed += 1
                logger.warning("a schema conversion passed its %g s limit; its worker process was killed",
                               self.limits.schema_timeout_s)
                return "timeout", (f"turning the schema into a grammar took over {self.limits.schema_timeout_s:g} s "
                                   "(limit --limit-schema-timeout-s)")
            except (EOFError, OSError) as exc:  # the worker died (killed from outside, out of memory)
                worker.kill()
                return "error", f"the grammar worker failed: {exc}"
            self._idle.put(worker)
            return result

    def close(self) -> None:
        self._threads.shutdown(wait=False, cancel_futures=True)
        while True:
            try:
                self._idle.get_nowait().kill()
            except queue.Empty:
                return
