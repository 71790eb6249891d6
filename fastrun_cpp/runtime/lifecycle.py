"""Models that come and go while the server runs: loaded when first asked for (one load shared
by every request that waits for it), unloaded when idle past their keep-alive, and evicted,
least recently used first, when a load would not fit the memory budget. A model a request
holds is never unloaded.

The manager owns every model's life; requests hold a model by a lease (`acquire` ... `release`)
for as long as they use it. Nothing here knows about HTTP: refusals are exceptions the serving
layer words for its clients."""

from __future__ import annotations

import asyncio
import contextvars
import enum
import logging
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable

from fastrun_cpp.engine.backend import BufferReport
from fastrun_cpp.keep_alive import FOREVER
from fastrun_cpp.registry import ModelConfig, SamplingDefaults
from fastrun_cpp.runtime.client import EngineClient
from fastrun_cpp.runtime.memory import (
    MemoryNeed,
    ModelShape,
    estimate,
    give_back_freed_memory,
    larger,
    process_rss,
    read_shape,
    reported,
)
from fastrun_cpp.runtime.model_runtime import ModelRuntime, kv_cache_types, uses_gpu

logger = logging.getLogger(__name__)

FAILED_RETRY_S = 60.0  # a model that failed to load is tried again after this long
LOADING_RETRY_AFTER_S = 5


class ModelState(str, enum.Enum):
    UNLOADED = "unloaded"
    LOADING = "loading"
    READY = "ready"
    FAILED = "failed"


class UnknownModel(LookupError):
    pass


class ModelUnavailable(Exception):
    """The model cannot serve now; `retry_after_s` says when to ask again."""

    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class ModelInUse(Exception):
    pass


class MemoryBudgetExceeded(ModelUnavailable):
    """The model does not fit the budget, even with every idle model evicted."""


@dataclass
class MemoryBudget:
    """Bytes models may hold in RAM and on each GPU (None: no bound)."""

    ram: int | None = None
    gpu: int | None = None  # per GPU


@dataclass
class ServedModel:
    """A model the server can serve, loaded or not."""

    id: str
    config: ModelConfig
    default_keep_alive_s: float = FOREVER  # its registry entry's, else the server's --keep-alive
    keep_alive_s: float = FOREVER  # idle time before it is unloaded: the last request's keep_alive, else the default
    state: ModelState = ModelState.UNLOADED
    runtime: ModelRuntime | None = None
    error: str | None = None
    created: int = field(default_factory=lambda: int(time.time()))
    users: int = 0  # leases held by requests
    waiting: int = 0  # requests waiting for its load, to lease it then
    last_used: float = field(default_factory=time.monotonic)
    estimate: MemoryNeed | None = None  # before the load
    reported: MemoryNeed | None = None  # what llama.cpp said it allocated
    rss_growth: int | None = None  # the process's resident memory over the load
    load_s: float | None = None
    failed_at: float = 0.0
    loading: asyncio.Task | None = field(default=None, repr=False)

    @property
    def sampling_defaults(self) -> SamplingDefaults:
        return self.config.defaults

    @property
    def engine(self) -> EngineClient | None:
        return self.runtime.engine if self.runtime is not None else None

    @property
    def need(self) -> MemoryNeed | None:
        """What it holds (loaded) or is about to (loading): the larger of the estimate and llama.cpp's report."""
        if self.estimate is None or self.state not in (ModelState.LOADING, ModelState.READY):
            return None
        return larger(self.estimate, self.reported) if self.reported is not None else self.estimate

    @property
    def idle(self) -> bool:
        if self.users or self.waiting or self.state is not ModelState.READY:
            return False
        busy, waiting = self.engine.load()
        return busy == 0 and waiting == 0

    def keep_alive_left_s(self, now: float | None = None) -> float | None:
        """Seconds until an idle model is unloaded (None: loaded for good, or in use, or not loaded)."""
        if self.state is not ModelState.READY or self.users or self.keep_alive_s == FOREVER:
            return None
        return max(0.0, self.last_used + self.keep_alive_s - (now or time.monotonic()))


Loader = Callable[[ModelConfig], Awaitable[ModelRuntime]]


class ModelManager:
    """Every model's life: load on demand, leases, keep-alive, the memory budget."""

    def __init__(self, models: list[ServedModel], loader: Loader, *, budget: MemoryBudget | None = None,
                 discover: Callable[[str], ModelConfig | None] | None = None,
                 discoverable: Callable[[], list[str]] | None = None, default_keep_alive_s: float = FOREVER,
                 max_models: int = 256) -> None:
        self._models = {model.id: model for model in models}
        self._loader = loader
        self.budget = budget or MemoryBudget()
        self._discover = discover  # a model the registry does not list, found by its id (the Hub cache)
        self._discoverable = discoverable  # the ids discovery would find
        self.default_keep_alive_s = default_keep_alive_s
        self.max_models = max_models
        self._room = asyncio.Lock()  # one load decides and makes room at a time
        self._changed = asyncio.Event()
        self._reaper: asyncio.Task | None = None

    def __iter__(self):
        return iter(list(self._models.values()))

    def get(self, model_id: str, *, discover: bool = True) -> ServedModel | None:
        """The model by id, found among those known (the registry's, those pulled or found
        before) or else, with `discover`, by discovery (None: unknown)."""
        model = self._models.get(model_id)
        if model is None and discover and self._discover is not None and len(self._models) < self.max_models:
            config = self._discover(model_id)
            if config is not None:
                model = self.add(config)
        return model

    def discover_all(self) -> None:
        """Take in every model discovery would find (to list them)."""
        for model_id in self._discoverable() if self._discoverable is not None else ():
            if len(self._models) >= self.max_models:
                break
            self.get(model_id)

    def add(self, config: ModelConfig, keep_alive_s: float | None = None) -> ServedModel:
        """A model the server may serve from now on (unloaded until asked for)."""
        if config.id in self._models:
            return self._models[config.id]
        keep_alive_s = self.default_keep_alive_s if keep_alive_s is None else keep_alive_s
        model = ServedModel(id=config.id, config=config, default_keep_alive_s=keep_alive_s, keep_alive_s=keep_alive_s)
        self._models[config.id] = model
        return model

    # ------------------------------------------------------------------ start and stop

    async def start(self, preload: list[str]) -> None:
        """Load `preload` in order (one that does not fit beside those before it stays unloaded:
        startup evicts nothing), then keep unloading idle models past their keep-alive."""
        self._reaper = asyncio.create_task(self._reap_forever(), name="fastrun-models")
        for model_id in preload:
            model = self._models[model_id]
            try:
                await self.load(model, evict=False)
            except ModelUnavailable as exc:
                logger.warning("%s not loaded at startup: %s", model_id, exc)

    async def stop(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
        for model in self:
            if model.loading is not None:
                model.loading.cancel()
        for model in self:
            if model.runtime is not None:
                await model.runtime.close()
                model.runtime, model.state = None, ModelState.UNLOADED

    # ------------------------------------------------------------------ leases

    async def acquire(self, model_id: str, *, wait_s: float, discover: bool = True) -> ServedModel:
        """The model, loaded, leased to the caller (`release` it); its load is started (or
        joined) and waited for up to `wait_s`, then ModelUnavailable says it is still loading."""
        model = self.get(model_id, discover=discover)
        if model is None:
            raise UnknownModel(model_id)
        model.waiting += 1  # not evicted between its load and this lease
        try:
            deadline = time.monotonic() + wait_s
            while model.state is not ModelState.READY:  # unloaded on request (unload) while it loaded: again
                task = self._start_load(model)
                try:
                    await asyncio.wait_for(asyncio.shield(task), max(0.0, deadline - time.monotonic()))
                except asyncio.TimeoutError:
                    raise ModelUnavailable(f"the model {model_id!r} is still loading", LOADING_RETRY_AFTER_S) \
                        from None
        finally:
            model.waiting -= 1
        model.users += 1
        model.last_used = time.monotonic()
        return model

    def release(self, model: ServedModel, keep_alive_s: float | None = None) -> None:
        """The end of a lease. As Ollama's, the idle time that counts is the last request's
        keep_alive (`keep_alive_s`), or the model's default for a request that names none."""
        model.users = max(0, model.users - 1)
        model.last_used = time.monotonic()
        model.keep_alive_s = model.default_keep_alive_s if keep_alive_s is None else keep_alive_s
        self._changed.set()

    # ------------------------------------------------------------------ load and unload

    async def load(self, model: ServedModel, *, evict: bool = True) -> ServedModel:
        """Load the model (or join its load) and wait for it, however long it takes."""
        if model.state is not ModelState.READY:
            await asyncio.shield(self._start_load(model, evict=evict))
        return model

    async def unload(self, model: ServedModel) -> bool:
        """Unload now; False if it was not loaded. ModelInUse while a request holds it."""
        async with self._room:
            if model.state is not ModelState.READY:
                return False
            if not model.idle:
                raise ModelInUse(f"the model {model.id!r} is serving {max(model.users, 1)} requests")
            await self._unload(model, "asked to")
            return True

    def _start_load(self, model: ServedModel, *, evict: bool = True) -> asyncio.Task:
        if model.loading is None or model.loading.done():
            if model.state is ModelState.FAILED and time.monotonic() - model.failed_at < FAILED_RETRY_S:
                raise ModelUnavailable(f"the model {model.id!r} failed to load: {model.error}",
                                       int(FAILED_RETRY_S - (time.monotonic() - model.failed_at)) + 1)
            # A context of its own: not the request's that started it, which it would keep alive
            # (and with it that request's streams and the engines they point to) as long as it is kept.
            # (Created inside an empty context, which the task copies: create_task's own
            # `context=` argument is Python 3.11's.)
            model.loading = contextvars.Context().run(asyncio.create_task, self._load(model, evict),
                                                      name=f"load {model.id}")
            model.loading.add_done_callback(lambda task: task.cancelled() or task.exception())  # retrieved
        return model.loading

    async def _load(self, model: ServedModel, evict: bool) -> None:
        config = model.config
        model.state, model.error = ModelState.LOADING, None
        try:
            path = await asyncio.to_thread(config.resolve_path)  # a Hub pull, not under the lock
            shape = await asyncio.to_thread(read_shape, path)
            draft = await asyncio.to_thread(lambda: read_shape(config.resolve_draft_path())) \
                if config.spec_type == "draft" else None
            need = _estimate(config, shape, draft)
            async with self._room:
                model.estimate, model.reported = need, None  # counted against the budget from now on
                await self._make_room(model, evict)
                started, rss_before = time.perf_counter(), process_rss()
                logger.info("loading %s (%s): about %s", model.id, path, _describe(model.estimate))
                with BufferReport() as report:
                    runtime = await self._loader(config)
                model.load_s = time.perf_counter() - started
                model.rss_growth = process_rss() - rss_before
                model.reported = reported(report, model.estimate) if report.bytes else None
                model.runtime, model.state, model.last_used = runtime, ModelState.READY, time.monotonic()
                model.keep_alive_s = model.default_keep_alive_s
            logger.info("loaded %s in %.1f s: llama.cpp allocated %s, resident memory grew %d MiB", model.id,
                        model.load_s, _describe(model.reported) if model.reported else "(no report)",
                        model.rss_growth // 2**20)
        except MemoryBudgetExceeded as exc:
            model.state, model.error, model.estimate = ModelState.UNLOADED, str(exc), None
            raise
        except asyncio.CancelledError:
            model.state = ModelState.UNLOADED
            raise
        except Exception as exc:  # a model that cannot load says why; the server goes on
            logger.exception("could not load %s", model.id)
            model.state, model.error, model.failed_at = ModelState.FAILED, str(exc) or type(exc).__name__, \
                time.monotonic()
            raise ModelUnavailable(f"the model {model.id!r} failed to load: {model.error}", int(FAILED_RETRY_S)) \
                from exc
        finally:
            self._changed.set()

    async def _make_room(self, loading: ServedModel, evict: bool) -> None:
        """Evict idle models, least recently used first, until `loading` fits (under `_room`)."""
        need = loading.estimate
        while (short := self._shortfall(loading, need)) is not None:
            idle = sorted((m for m in self._models.values() if m is not loading and m.idle and evict),
                          key=lambda m: m.last_used)
            if not idle:
                raise MemoryBudgetExceeded(self._refusal(loading, short), LOADING_RETRY_AFTER_S)
            await self._unload(idle[0], f"evicted for {loading.id} (memory budget)")

    def _shortfall(self, loading: ServedModel, need: MemoryNeed) -> str | None:
        """Which budget `need` would overrun beside what the other models hold (None: it fits)."""
        held = [m.need for m in self._models.values() if m is not loading and m.need is not None]
        if self.budget.ram is not None and sum(h.ram for h in held) + need.ram > self.budget.ram:
            return "ram"
        if self.budget.gpu is not None and need.on_gpu:
            for gpu in need.gpus:
                if sum(h.gpu for h in held if h.on_gpu and gpu in h.gpus) + need.gpu > self.budget.gpu:
                    return f"gpu{gpu}"
        return None

    def _refusal(self, loading: ServedModel, short: str) -> str:
        need = loading.estimate
        mib = 2**20
        if short == "ram":
            wanted, budget, part = need.ram, self.budget.ram, lambda n: n.ram
        else:
            wanted, budget, part = need.gpu, self.budget.gpu, lambda n: n.gpu
        holders = [(m, part(m.need)) for m in self._models.values() if m is not loading and m.need is not None]
        held = ", ".join(f"{m.id} {size // mib} MiB, {'idle' if m.idle else 'in use'}" for m, size in holders) \
            or "none"
        where = "RAM" if short == "ram" else f"memory on GPU {short[3:]}"
        if wanted > budget:
            return (f"the model {loading.id!r} needs about {wanted // mib} MiB of {where} ({_describe(need)}), more "
                    f"than the whole memory budget of {budget // mib} MiB")
        return (f"the model {loading.id!r} needs about {wanted // mib} MiB of {where} ({_describe(need)}); the memory "
                f"budget is {budget // mib} MiB and the other models hold {sum(s for _, s in holders) // mib} MiB "
                f"({held})")

    async def _unload(self, model: ServedModel, why: str) -> None:
        """Free the model (its slots' prefixes go to the disk tier first, so the next load starts warm)."""
        runtime, model.runtime, model.state = model.runtime, None, ModelState.UNLOADED
        started = time.perf_counter()
        await runtime.close()
        await asyncio.to_thread(give_back_freed_memory)
        logger.info("unloaded %s (%s) in %.1f s", model.id, why, time.perf_counter() - started)
        self._changed.set()

    async def _reap_forever(self) -> None:
        while True:
            now = time.monotonic()
            due = [m for m in self._models.values() if (left := m.keep_alive_left_s(now)) is not None and left <= 0]
            for model in due:
                async with self._room:
                    if model.idle and (left := model.keep_alive_left_s()) is not None and left <= 0:
                        await self._unload(model, f"idle past its keep-alive of {model.keep_alive_s:g} s")
            waits = [left for m in self._models.values() if (left := m.keep_alive_left_s()) is not None]
            self._changed.clear()
            try:
                # A model due but still busy (its engine finishing) is looked at again soon.
                await asyncio.wait_for(self._changed.wait(), max(0.5, min(waits, default=3600.0)))
            except asyncio.TimeoutError:
                pass


def _estimate(config: ModelConfig, shape: ModelShape, draft: ModelShape | None) -> MemoryNeed:
    cache_type_k, cache_type_v = kv_cache_types(config)
    return estimate(config, shape, cache_type_k=cache_type_k, cache_type_v=cache_type_v, on_gpu=uses_gpu(config),
                    draft=draft)


def _describe(need: MemoryNeed) -> str:
    mib = 2**20
    return (f"weights {need.weights // mib} MiB, KV {need.kv // mib} MiB, compute {need.compute // mib} MiB, "
            f"prompt cache up to {need.prompt_cache // mib} MiB")
