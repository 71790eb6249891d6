"""The models this server serves, as its clients see them: GET /v1/models with each model's
status, leases for the requests that use one, and load, unload and pull (the life of a model
is runtime.lifecycle's; this is its HTTP face)."""

from __future__ import annotations

import asyncio
import json
import threading
import time
import weakref
from dataclasses import asdict
from typing import Any, AsyncIterator, Callable

from fastrun_cpp.entrypoints.openai.errors import APIError, bad_request, model_not_found
from fastrun_cpp.entrypoints.openai.protocol import ModelCard, ModelList, ModelMeta
from fastrun_cpp.entrypoints.openai.protocol_base import MAX_OUTPUT_TOKENS
from fastrun_cpp.entrypoints.openai.models.protocol import ModelPullRequest
from fastrun_cpp.entrypoints.request_context import current_record
from fastrun_cpp.hub import HubError, PullStopped, pull
from fastrun_cpp.keep_alive import FOREVER
from fastrun_cpp.registry import ModelConfig, hub_model_id
from fastrun_cpp.runtime import EngineClient
from fastrun_cpp.runtime.lifecycle import (
    LOADING_RETRY_AFTER_S,
    ModelInUse,
    ModelManager,
    ModelState,
    ModelUnavailable,
    ServedModel,
    UnknownModel,
)

__all__ = ["OpenAIServingModels", "ServedModel", "ModelState"]


MAX_PULLS = 2  # downloads at once: each holds a thread and a connection to the Hub
PROGRESS_EVERY_S = 0.25


class OpenAIServingModels:
    def __init__(self, manager: ModelManager, *, load_wait_s: float,
                 hub_config: Callable[[str, str, str, str | None], ModelConfig] | None = None,
                 pull_max_bytes: int | None = None, user_hub_models: bool = False,
                 user_keep_alive_max_s: float = 3600) -> None:
        self.manager = manager
        # What a user (not admin) key may do to the models every account shares: name Hub-cache
        # models no registry lists (and so load them), and lengthen a model's idle time this far.
        self.user_hub_models = user_hub_models
        self.user_keep_alive_max_s = user_keep_alive_max_s
        self.load_wait_s = load_wait_s  # how long a request waits for its model to load before a 503
        self.hub_config = hub_config  # (model id, repo, file, revision) -> its configuration
        self.pull_max_bytes = pull_max_bytes
        self.preload_done = False
        self._pull_places = _Places(MAX_PULLS)

    def __iter__(self):
        return iter(self.manager)

    def split_adapter(self, model_id: str) -> tuple[str, str | None]:
        """(the model, the LoRA adapter) an id names: `<model>:<adapter>` for a configured
        adapter of a known model, else the id itself and None (a Hub id's `:file.gguf` stays)."""
        if ":" in model_id and self.manager.get(model_id, discover=False) is None:
            base, name = model_id.rsplit(":", 1)
            model = self.manager.get(base, discover=False)
            if model is not None and any(adapter.name == name for adapter in model.config.loras):
                return base, name
        return model_id, None

    def knows(self, model_id: str) -> bool:
        """Whether the id names a model this server can serve the caller (loaded or not)."""
        return self.manager.get(model_id, discover=self._may_discover()) is not None

    def _may_discover(self) -> bool:
        """Whether the current request may bring in a Hub-cache model no registry lists: loading
        it takes memory from every account's models (and may evict them under a budget)."""
        record = current_record()
        return record is None or record.admin or self.user_hub_models

    def _keep_alive_for(self, model: ServedModel, asked_s: float | None) -> float | None:
        """The keep_alive a request leaves its model with. A user key's may lengthen the model's
        own idle time, up to --user-keep-alive-max, and never shorten it: keep_alive 0 from one
        account would unload the model under every other (None: the model's own)."""
        record = current_record()
        if asked_s is None or record is None or record.admin:
            return asked_s
        if asked_s <= model.default_keep_alive_s:
            return None
        return min(asked_s, max(self.user_keep_alive_max_s, model.default_keep_alive_s))

    async def acquire(self, model_id: str, keep_alive_s: float | None = None) -> ServedModel:
        """The model, loaded (waiting for its load), held until the current request ends; 404
        for an unknown id, 503 with Retry-After while it loads or when it cannot."""
        record = current_record()
        discover = self._may_discover()
        held = self.manager.get(model_id, discover=discover)
        if record is not None and held is not None and model_id in record.leases \
                and held.state is ModelState.READY:
            return held
        try:
            model = await self.manager.acquire(model_id, wait_s=self.load_wait_s, discover=discover)
        except UnknownModel:
            raise model_not_found(model_id) from None
        except ModelUnavailable as exc:
            raise APIError(503, str(exc), "unavailable", retry_after=exc.retry_after_s) from None
        keep_alive_s = self._keep_alive_for(model, keep_alive_s)
        release = lambda: self.manager.release(model, keep_alive_s)  # noqa: E731
        if record is None or not record.hold(model_id, release):
            self.manager.release(model)  # nothing ends it: it stays leased only by requests that end
        return model

    def card(self, model_id: str) -> ModelCard:
        base, adapter = self.split_adapter(model_id)
        card = model_card(self._known(base))
        return card.model_copy(update={"id": model_id}) if adapter is not None else card

    def held(self, model_id: str) -> ServedModel:
        """A model the current request acquired (and so is loaded)."""
        model = self.manager.get(model_id)
        if model is None or model.runtime is None:
            raise APIError(503, f"the model {model_id!r} is not loaded", "unavailable",
                           retry_after=LOADING_RETRY_AFTER_S)
        return model

    # ------------------------------------------------------------------ load, unload (admin)

    def _known(self, model_id: str) -> ServedModel:
        model = self.manager.get(model_id, discover=self._may_discover())
        if model is None:
            raise model_not_found(model_id)
        return model

    async def load(self, model_id: str) -> dict[str, Any]:
        model = self._known(model_id)
        try:
            await self.manager.load(model)
        except ModelUnavailable as exc:  # failed, or over the memory budget
            raise APIError(503, str(exc), "unavailable", retry_after=exc.retry_after_s) from None
        return {"success": True, "model": model_card(model).model_dump(mode="json", exclude_none=True)}

    async def unload(self, model_id: str) -> dict[str, Any]:
        model = self._known(model_id)
        try:
            unloaded = await self.manager.unload(model)
        except ModelInUse as exc:
            raise APIError(409, f"{exc}: it is unloaded once idle with keep_alive 0", "invalid_request_error") \
                from None
        return {"success": True, "unloaded": unloaded, "model": model_card(model).model_dump(mode="json",
                                                                                        exclude_none=True)}

    # ------------------------------------------------------------------ pull (admin)

    async def pull(self, request: ModelPullRequest) -> dict[str, Any] | AsyncIterator[str]:
        """Download a GGUF from the Hub into its cache and serve it from then on (unloaded until
        asked for), as Ollama's /api/pull: progress events (status, completed, total bytes and
        the rate), then {"status": "success"}."""
        if hub_model_id(request.model) is None or ":" in request.model:
            raise bad_request(f"model: {request.model[:100]!r} is not a Hub repository (owner/name)")
        # Taken here, with nothing awaited since the check: counted where the pull starts,
        # concurrent requests all passed the check before any of them began.
        give_back = self._pull_places.take()
        if give_back is None:
            raise APIError(429, f"{MAX_PULLS} pulls are running, the most at once", "rate_limit_error",
                           retry_after=30)
        model_id = request.model if request.file is None else f"{request.model}:{request.file}"
        events = self._pull_events(request, model_id, give_back)
        # Given back when the pull ends, or when its stream is dropped unread (a client gone
        # before its first event: the generator's own `finally` never runs then).
        weakref.finalize(events, give_back)
        if request.stream:
            return (json.dumps(event) async for event in events)
        last: dict[str, Any] = {}
        async for last in events:
            pass
        if "error" in last:
            raise APIError(last["status_code"], last["error"]["message"], last["error"]["type"])
        return last

    async def _pull_events(self, request: ModelPullRequest, model_id: str,
                           give_back: Callable[[], None]) -> AsyncIterator[dict[str, Any]]:
        loop = asyncio.get_running_loop()
        updates: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        stopped = threading.Event()
        started = time.monotonic()
        last_sent: dict[str, float] = {}

        def progress(filename: str, done: int, total: int | None) -> None:  # in the download's thread
            now = time.monotonic()
            if now - last_sent.get(filename, 0.0) < PROGRESS_EVERY_S and done != total:
                return
            last_sent[filename] = now
            event = {"status": f"downloading {filename}", "file": filename, "completed": done, "total": total,
                     "rate_bytes_per_s": int(done / max(now - started, 1e-3))}
            loop.call_soon_threadsafe(updates.put_nowait, event)

        download = asyncio.ensure_future(asyncio.to_thread(
            pull, request.model, request.file, revision=request.revision, progress=progress,
            max_bytes=self.pull_max_bytes, stop=stopped.is_set))
        try:
            yield {"status": "pulling manifest", "model": model_id}
            while not download.done() or not updates.empty():
                getter = asyncio.ensure_future(updates.get())
                await asyncio.wait({getter, download}, return_when=asyncio.FIRST_COMPLETED)
                if getter.done():
                    yield getter.result()
                else:
                    getter.cancel()
            try:
                path = download.result()
            except PullStopped as exc:
                yield _pull_error(400, str(exc), "invalid_request_error")
                return
            except HubError as exc:
                yield _pull_error(502, str(exc), "upstream_error")
                return
            except Exception as exc:  # what huggingface-hub raises past its own errors (a refused size, a bad file)
                yield _pull_error(502, f"the pull of {request.model} failed: {exc}", "upstream_error")
                return
            # The revision pulled is the one loaded: without it a load would fetch `main`'s file.
            served = self.manager.add(self.hub_config(model_id, request.model, path.name, request.revision))
            yield {"status": "success", "model": served.id, "path": str(path),
                   "seconds": round(time.monotonic() - started, 2)}
        finally:
            stopped.set()  # a client gone mid-download stops it at its next chunk
            give_back()

    # ------------------------------------------------------------------ what is served

    @property
    def all_ready(self) -> bool:
        """Startup has loaded what it loads, and none of it failed."""
        return self.preload_done and not any(m.state is ModelState.FAILED for m in self.manager)

    def engines(self) -> list[tuple[str, EngineClient]]:
        return [(m.id, m.engine) for m in self.manager if m.engine is not None]

    def grammar_compile_failures(self) -> dict[str, tuple[int, int]]:
        """Per model, grammar compilations past their time limit: (stuck in a thread of the
        server, killed in their trial process)."""
        return {m.id: (m.runtime.grammars.stuck, m.runtime.grammars.killed)
                for m in self.manager if m.runtime is not None}

    def status(self, *, counters: bool = True) -> dict[str, dict[str, object]]:
        """Each model's state and load (what a probe or a balancer needs), and with `counters`
        what it has served."""
        status: dict[str, dict[str, object]] = {}
        for model in self.manager:
            entry: dict[str, object] = {"state": model.state.value}
            if model.error:
                entry["error"] = model.error
            if model.engine is not None:
                busy, waiting = model.engine.load()
                entry.update(slots=model.engine.slots, busy_slots=busy, waiting=waiting)
            status[model.id] = entry
            if model.engine is None or not counters:
                continue
            entry.update(lifecycle(model))
            stats = model.engine.stats
            entry["stats"] = asdict(stats)
            entry["speculation"] = {
                "drafted_tokens": stats.drafted_tokens, "accepted_tokens": stats.accepted_tokens,
                "acceptance_rate": round(stats.accepted_tokens / stats.drafted_tokens, 4)
                if stats.drafted_tokens else None,
            }
            disk = model.engine.disk_stats
            if disk is not None:
                entry["disk_cache"] = vars(disk).copy()
            entry["replicas"] = model.engine.replica_status()
            entry["grammar_compiles_stuck"] = model.runtime.grammars.stuck
            entry["grammar_compiles_killed"] = model.runtime.grammars.killed
        return status

    def list_models(self) -> ModelList:
        """Every model it can serve the caller: the registry's, those pulled, and the GGUFs in
        the Hub cache (for a caller who may bring those in)."""
        if self._may_discover():
            self.manager.discover_all()
        cards = []
        for model in self.manager:
            card = model_card(model)
            # Each LoRA adapter is a model of its own to clients (vLLM's way): `<model>:<adapter>`.
            cards += [card, *(card.model_copy(update={"id": f"{model.id}:{adapter.name}"})
                              for adapter in model.config.loras)]
        return ModelList(data=cards, models=[codex_model_info(card) for card in cards if card.max_model_len])


class _Places:
    """At most `most` of a kind of work at once (on the event loop): take() a place, or None
    when all are taken; the function it returns gives the place back, once however often called."""

    def __init__(self, most: int) -> None:
        self.most = most
        self.taken = 0

    def take(self) -> Callable[[], None] | None:
        if self.taken >= self.most:
            return None
        self.taken += 1
        given_back = False

        def give_back() -> None:
            nonlocal given_back
            if not given_back:
                given_back = True
                self.taken -= 1

        return give_back


def _pull_error(status: int, message: str, error_type: str) -> dict[str, Any]:
    return {"status": "error", "status_code": status, "error": {"message": message, "type": error_type}}


def lifecycle(model: ServedModel) -> dict[str, Any]:
    """Where the model is in its life: its status, the memory it holds or would (estimated
    before the load, as llama.cpp reported it, and the process's resident growth over the load),
    and how long it stays loaded while idle."""
    status = {ModelState.READY: "loaded", ModelState.LOADING: "loading"}.get(model.state, "unloaded")
    out: dict[str, Any] = {"status": status}
    if model.state is ModelState.FAILED and model.error:
        out["error"] = model.error
    memory: dict[str, Any] = {}
    if model.estimate is not None:
        memory["estimate"] = model.estimate.as_dict()
    if model.reported is not None and model.state is ModelState.READY:
        memory["reported_by_llama_cpp"] = model.reported.as_dict()
    if model.rss_growth is not None and model.state is ModelState.READY:
        memory["rss_growth_bytes"] = model.rss_growth
    if memory:
        out["memory"] = memory
    out["keep_alive_s"] = -1 if model.keep_alive_s == FOREVER else model.keep_alive_s  # Ollama's -1: for good
    left = model.keep_alive_left_s()
    if left is not None:
        out["keep_alive_left_s"] = round(left, 1)
        out["expires_at"] = int(time.time() + left)
    if model.load_s is not None and model.state is ModelState.READY:
        out["load_s"] = round(model.load_s, 2)
    return out


def model_card(model: ServedModel) -> ModelCard:
    """The model's card. One not loaded says what its configuration promises (its context);
    what only its weights tell (reasoning, the vocabulary) comes once it is loaded."""
    if model.runtime is None:
        context = model.config.ctx_size
        capabilities = ["chat", "completions", "tools", "structured_outputs"]
        if model.config.embeddings:
            capabilities.append("embeddings")
        if model.config.rerank:
            capabilities.append("rerank")
        return ModelCard(id=model.id, created=model.created, max_model_len=context,
                         max_output_tokens=min(context, MAX_OUTPUT_TOKENS), capabilities=capabilities,
                         **lifecycle(model))
    runtime = model.runtime
    info = runtime.info
    capabilities = ["chat", "completions", "tools", "structured_outputs"]
    if runtime.reasoning_parser is not None:
        capabilities.append("reasoning")
    if info.embedding_dimensions is not None:
        capabilities.append("embeddings")
    if info.vision:
        capabilities.append("vision")
    if info.rerank_template is not None:
        capabilities = ["rerank"]  # a reranker's head scores pairs; it writes no text
    return ModelCard(id=model.id, created=model.created, max_model_len=info.max_context,
                     max_output_tokens=min(info.max_context, MAX_OUTPUT_TOKENS), capabilities=capabilities,
                     meta=ModelMeta(n_vocab=info.n_vocab, n_ctx_train=info.n_ctx_train, n_ctx=info.max_context,
                                    slots=info.slots), **lifecycle(model))


# Codex's catalog entry must carry base instructions; a short one, as a small local model
# has little context to spare (Codex adds its own notes on sandbox, tools and the workspace).
CODEX_INSTRUCTIONS = """You are a coding agent running in the user's terminal, working in their workspace.
Use the tools you are given to read files, run commands and make changes; run one command at a time and read its output before the next.
Keep changes small and focused on the request, and do not undo changes you did not make.
When the work is done, answer briefly: what you did, and anything the user should check."""


def codex_model_info(card: ModelCard) -> dict[str, object]:
    """A model as Codex CLI's catalog describes one (its `ModelInfo`: the fields it requires,
    and the context window it compacts by), so Codex knows the model instead of falling back to
    defaults for an unknown one. No apply_patch tool type: Codex then edits through its shell
    tool, which any tool-calling model can drive."""
    reasoning = "reasoning" in (card.capabilities or ())
    return {
        "slug": card.id,
        "display_name": card.id,
        "description": f"{card.id}, served by fastrun-cpp",
        "context_window": card.max_model_len,
        "max_context_window": card.max_model_len,
        "supported_reasoning_levels": [{"effort": effort, "description": f"{effort} reasoning effort"}
                                       for effort in ("low", "medium", "high")] if reasoning else [],
        "default_reasoning_level": "medium" if reasoning else None,
        "supports_reasoning_summaries": False,
        "shell_type": "default",
        "visibility": "list",
        "supported_in_api": True,
        "priority": 1,
        "support_verbosity": False,
        "supports_parallel_tool_calls": True,
        "truncation_policy": {"mode": "tokens", "limit": 10000},
        # Codex attaches images (exec -i, its view_image tool) only for a model that takes them.
        "input_modalities": ["text", "image"] if "vision" in (card.capabilities or ()) else ["text"],
        "experimental_supported_tools": [],
        "model_messages": {"instructions_template": CODEX_INSTRUCTIONS},
    }
