"""The asyncio face of an Engine: submit a request, iterate its outputs, cancel by leaving."""

from __future__ import annotations

import asyncio
import logging
from typing import AsyncIterator

from fastrun_cpp.engine.engine import Engine, EngineConfig
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


class AsyncEngine:
    """Runs an Engine's scheduler thread and bridges its outputs onto the event loop.

    Must be created inside the running event loop it serves.
    """

    def __init__(self, model: LlamaModel, config: EngineConfig) -> None:
        self._loop = asyncio.get_running_loop()
        self._collectors: dict[str, _OutputCollector] = {}
        self.model = model
        self.engine = Engine(model, config, self._on_outputs)
        self.engine.start()

    @property
    def max_context(self) -> int:
        return self.engine.max_context

    @property
    def slots(self) -> int:
        return self.engine.config.slots

    def load(self) -> tuple[int, int]:
        return self.engine.load()

    @property
    def stats(self):
        return self.engine.stats

    def check_prompt(self, n_prompt_tokens: int) -> None:
        self.engine.check_prompt(n_prompt_tokens)

    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationOutput]:
        """Yield merged outputs until the request finishes; closing the iterator early aborts it."""
        collector = _OutputCollector()
        self._collectors[request.request_id] = collector
        finished = False
        try:
            self.engine.add_request(request)
            while not finished:
                output = await collector.get()
                finished = output.finished
                if output.error is not None:
                    raise EngineError(output.error)
                yield output
        finally:
            del self._collectors[request.request_id]
            if not finished:
                self.engine.abort_request(request.request_id)

    def shutdown(self) -> None:
        self.engine.shutdown()

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
