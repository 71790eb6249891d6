"""The asyncio face of an Engine: submit a request, iterate its outputs, close to cancel."""

from __future__ import annotations

import asyncio
import logging

from fastrun_cpp.engine.engine import Engine, EngineConfig, EngineStats
from fastrun_cpp.engine.faults import Faults
from fastrun_cpp.engine.grammar import CompiledGrammar, GrammarCache
from fastrun_cpp.engine.model import LlamaModel
from fastrun_cpp.engine.request import EngineError, GenerationOutput, GenerationRequest

logger = logging.getLogger(__name__)


class _OutputCollector:
    """Holds a request's undelivered outputs merged into one, so a slow reader catches up
    in a single read instead of falling behind token by token."""

    __slots__ = ("_output", "_ready")

    def __init__(self) -> None:
        self._output: GenerationOutput | None = None
        self._ready = asyncio.Event()

    def put(self, output: GenerationOutput) -> None:
        if self._output is None:
            self._output = output
        else:
            self._output.merge(output)
        self._ready.set()

    async def get(self) -> GenerationOutput:
        await self._ready.wait()
        output, self._output = self._output, None
        self._ready.clear()
        assert output is not None
        return output


class RequestTimedOut(EngineError):
    pass


class RequestStream:
    """The outputs of one submitted request, as an async iterator.

    Ends after the output that finishes the request; raises EngineError if the engine failed
    it, RequestTimedOut past its deadline. `close()` aborts the request if it is still running
    (and is safe to call twice).
    """

    def __init__(self, engine: AsyncEngine, request_id: str, collector: _OutputCollector) -> None:
        self._engine = engine
        self.request_id = request_id
        self._collector = collector
        self._timer: asyncio.TimerHandle | None = None
        self._timed_out = False
        self.finished = False
        self.time_limit_s: float | None = None

    def set_deadline(self, seconds: float) -> None:
        """Abort the request, and end the stream with RequestTimedOut, after `seconds`."""
        self.time_limit_s = seconds
        self._timer = asyncio.get_running_loop().call_later(seconds, self._expire)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> GenerationOutput:
        if self._timed_out:
            raise RequestTimedOut("the request ran past its time limit")
        if self.finished:
            raise StopAsyncIteration
        output = await self._collector.get()
        if self._timed_out:
            raise RequestTimedOut("the request ran past its time limit")
        if output.finished:
            self._end()
        if output.error is not None:
            raise EngineError(output.error)
        return output

    def close(self) -> None:
        if not self.finished:
            self._end()
            self._engine.engine.abort_request(self.request_id)

    def _expire(self) -> None:
        if not self.finished:
            self._timed_out = True
            self._collector.put(GenerationOutput(self.request_id))  # wakes the reader
            self.close()

    def _end(self) -> None:
        self.finished = True
        if self._timer is not None:
            self._timer.cancel()
        self._engine._forget(self.request_id)


class AsyncEngine:
    """Runs an Engine's scheduler thread and bridges its outputs onto the event loop.

    Must be created inside the running event loop it serves.
    """

    def __init__(self, model: LlamaModel, config: EngineConfig, faults: Faults | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        self._collectors: dict[str, _OutputCollector] = {}
        self.model = model
        self.engine = Engine(model, config, self._on_outputs, faults)
        self.engine.start()
        self._grammars = GrammarCache(model)

    @property
    def max_context(self) -> int:
        return self.engine.max_context

    @property
    def slots(self) -> int:
        return self.engine.config.slots

    @property
    def stats(self) -> EngineStats:
        return self.engine.stats

    def load(self) -> tuple[int, int]:
        return self.engine.load()

    def check_prompt(self, n_prompt_tokens: int) -> None:
        self.engine.check_prompt(n_prompt_tokens)

    def compile_grammar(self, gbnf: str, lazy_patterns: tuple[str, ...] = ()) -> CompiledGrammar:
        """A parsed grammar for this model (cached by text); raises GrammarError. Thread-safe."""
        return self._grammars.compile(gbnf, lazy_patterns)

    def submit(self, request: GenerationRequest) -> RequestStream:
        """Queue a request now (raising CapacityError / PromptTooLongError at once) and return
        the stream of its outputs."""
        collector = _OutputCollector()
        self._collectors[request.request_id] = collector
        try:
            self.engine.add_request(request)
        except BaseException:
            del self._collectors[request.request_id]
            raise
        return RequestStream(self, request.request_id, collector)

    def shutdown(self) -> None:
        self.engine.shutdown()

    def _forget(self, request_id: str) -> None:
        self._collectors.pop(request_id, None)

    # Called on the scheduler thread, once per step.
    def _on_outputs(self, outputs: list[GenerationOutput]) -> None:
        try:
            self._loop.call_soon_threadsafe(self._dispatch, outputs)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass

    def _dispatch(self, outputs: list[GenerationOutput]) -> None:
        for output in outputs:
            collector = self._collectors.get(output.request_id)
            if collector is not None:
                collector.put(output)
