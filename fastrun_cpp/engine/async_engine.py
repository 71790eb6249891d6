"""The asyncio face of an Engine: submit a request, iterate its outputs, close to cancel."""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from concurrent.futures import ThreadPoolExecutor

from fastrun_cpp.engine.disk_cache import DiskPromptCache
from fastrun_cpp.engine.engine import Engine, EngineConfig
from fastrun_cpp.engine.kv_cache import MIN_SAVED_TOKENS
from fastrun_cpp.engine.stats import EngineStats
from fastrun_cpp.engine.faults import Faults
from fastrun_cpp.engine.grammar import GrammarCompiler
from fastrun_cpp.fair_turns import Share
from fastrun_cpp.engine.model import LlamaModel
from fastrun_cpp.engine.prompt_cache import CachedSequence
from fastrun_cpp.engine.errors import EngineError, RequestRejected
from fastrun_cpp.engine.request import GenerationOutput, GenerationRequest

logger = logging.getLogger(__name__)


class _OutputCollector:
    """Holds a request's undelivered outputs, merged per choice, so a slow reader catches up
    in a single read instead of falling behind token by token; or, `stepwise`, each step's
    output apart (bounded by the request's tokens), for a reader that may stop a choice at a
    step of its own choosing."""

    __slots__ = ("_outputs", "_steps", "_ready")

    def __init__(self, *, stepwise: bool = False) -> None:
        self._outputs: dict[int, GenerationOutput] = {}  # by choice index, in arrival order
        self._steps: deque[GenerationOutput] | None = deque() if stepwise else None
        self._ready = asyncio.Event()

    def put(self, output: GenerationOutput) -> None:
        if self._steps is not None:
            self._steps.append(output)
        elif (held := self._outputs.get(output.index)) is None:
            self._outputs[output.index] = output
        else:
            held.merge(output)
        self._ready.set()

    async def get(self) -> GenerationOutput:
        """The oldest news: one step's output, or the oldest choice's news merged."""
        await self._ready.wait()
        if self._steps is not None:
            output = self._steps.popleft()
            if not self._steps:
                self._ready.clear()
            return output
        index = next(iter(self._outputs))
        output = self._outputs.pop(index)
        if not self._outputs:
            self._ready.clear()
        return output


class RequestStream:
    """One engine's outputs for a submitted request, as an async iterator: each output is news
    of one choice (`output.index`). The serving layer reads it through a FailoverStream (which
    keeps the deadline).

    Ends after every choice has finished; raises EngineError if the engine failed it. `close()`
    aborts the request if it is still running, ends a pending read, and is safe to call twice.
    """

    def __init__(self, engine: AsyncEngine, request_id: str, collector: _OutputCollector, choices: int = 1) -> None:
        self._engine = engine
        self.request_id = request_id
        self._collector = collector
        self._unfinished = choices
        self.replica = engine.name  # which engine serves it
        self.finished = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> GenerationOutput:
        if self.finished:
            raise StopAsyncIteration
        output = await self._collector.get()
        if self.finished:  # closed while waiting
            raise StopAsyncIteration
        if output.finished:
            self._unfinished -= 1
        if output.error is not None:
            self.close()  # the request's other choices stop too
            raise (RequestRejected if output.rejected else EngineError)(output.error)
        if self._unfinished == 0:
            self._end()
        return output

    def close(self) -> None:
        if not self.finished:
            self._end()
            self._engine.engine.abort_request(self.request_id)
            self._collector.put(GenerationOutput(self.request_id))  # wakes a pending read

    def stop_choice(self, index: int) -> None:
        """End one choice of the request now (the engine reports it finished)."""
        if not self.finished:
            self._engine.engine.abort_request(self.request_id, index)

    def _end(self) -> None:
        self.finished = True
        self._engine._forget(self.request_id)


class AsyncEngine:
    """Runs an Engine's scheduler thread and bridges its outputs onto the event loop.

    Must be created inside the running event loop it serves.
    """

    def __init__(
        self,
        model: LlamaModel,
        config: EngineConfig,
        grammars: GrammarCompiler,
        faults: Faults | None = None,
        disk_cache: DiskPromptCache | None = None,
        draft_model: LlamaModel | None = None,
        name: str = "local-0",
    ) -> None:
        self._loop = asyncio.get_running_loop()
        self.name = name
        self._collectors: dict[str, _OutputCollector] = {}
        self.model = model
        self.engine = Engine(model, config, self._on_outputs, faults, disk_cache, draft_model)
        self.engine.start()
        self._grammars = grammars
        self._disk = disk_cache if disk_cache is not None and disk_cache.enabled else None
        self._disk_reader = ThreadPoolExecutor(1, thread_name_prefix="fastrun-kv-reader") if self._disk else None

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

    async def submit(self, request: GenerationRequest) -> RequestStream:
        """Queue a request (raising CapacityError / PromptTooLongError / GrammarError before it
        is queued) and return the stream of its outputs."""
        grammar = await self._grammars.compile(request.grammar, Share(request.account, request.weight)) if request.grammar is not None else None
        if self._disk is not None and request.kind == "generate":
            await self._load_from_disk(request.prompt_tokens, request.cache_namespace)
        collector = _OutputCollector(stepwise=request.stepwise_outputs)
        self._collectors[request.request_id] = collector
        try:
            self.engine.add_request(request, grammar)
        except BaseException:
            del self._collectors[request.request_id]
            raise
        return RequestStream(self, request.request_id, collector, request.n)

    async def _load_from_disk(self, prompt: list[int], namespace: str) -> None:
        """Bring the disk tier's longest prefix of `prompt` into the host cache before the
        request is queued, when it beats what the slots and the host cache hold. The lookup
        (now and then a directory rescan) and the read run in a thread of their own: neither
        the event loop nor the scheduler waits for the disk."""
        await self._loop.run_in_executor(self._disk_reader, self._adopt_from_disk, prompt, namespace)

    def _adopt_from_disk(self, prompt: list[int], namespace: str) -> None:
        entry, length = self._disk.longest_prefix(prompt, namespace)
        usable = min(length, len(prompt) - 1)
        kv_cache = self.engine.kv_cache
        if entry is not None and (len(entry.tokens) > self.engine.config.ctx_size  # saved with a larger context
                                  or not kv_cache.state_serves(len(entry.tokens), usable)):
            entry = None
        if entry is None or usable < MIN_SAVED_TOKENS or usable <= kv_cache.cached_prefix(prompt, namespace):
            self._disk.stats.misses += 1
            return
        state = self._disk.load(entry)
        if state is not None:
            kv_cache.adopt(CachedSequence(entry.tokens, state, source="disk", namespace=namespace))

    def shutdown(self) -> None:
        self.engine.shutdown()
        if self._disk_reader is not None:
            self._disk_reader.shutdown(wait=False)

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
