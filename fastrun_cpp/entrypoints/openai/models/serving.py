"""The models this server serves, their loading state, and GET /v1/models."""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass, field

from fastrun_cpp.registry import ModelConfig, SamplingDefaults
from fastrun_cpp.runtime import EngineClient, ModelRuntime
from fastrun_cpp.entrypoints.openai.errors import APIError, model_not_found
from fastrun_cpp.entrypoints.openai.protocol import ModelCard, ModelList, unix_time

# Retry-After while a model loads, and after it failed (an operator must act).
LOADING_RETRY_AFTER_S = 5
FAILED_RETRY_AFTER_S = 60


class ModelState(str, enum.Enum):
    LOADING = "loading"
    READY = "ready"
    FAILED = "failed"


@dataclass
class ServedModel:
    id: str
    config: ModelConfig | None = None
    state: ModelState = ModelState.LOADING
    runtime: ModelRuntime | None = None
    error: str | None = None
    created: int = field(default_factory=unix_time)

    @property
    def sampling_defaults(self) -> SamplingDefaults:
        return self.config.defaults if self.config is not None else SamplingDefaults()

    @property
    def engine(self) -> EngineClient | None:
        return self.runtime.engine if self.runtime is not None else None

    def ready(self, runtime: ModelRuntime) -> None:
        self.runtime = runtime
        self.state = ModelState.READY

    def failed(self, error: str) -> None:
        self.error = error
        self.state = ModelState.FAILED


class OpenAIServingModels:
    def __init__(self, models: list[ServedModel]) -> None:
        self._models = {model.id: model for model in models}

    def __iter__(self):
        return iter(self._models.values())

    def get(self, model_id: str) -> ServedModel:
        """A model ready to serve; 404 for an unknown id, 503 while loading or after a failure."""
        model = self._models.get(model_id)
        if model is None:
            raise model_not_found(model_id)
        if model.state is ModelState.LOADING:
            raise APIError(503, f"the model {model_id!r} is still loading", "unavailable",
                           retry_after=LOADING_RETRY_AFTER_S)
        if model.state is ModelState.FAILED:
            raise APIError(503, f"the model {model_id!r} failed to load: {model.error}", "unavailable",
                           retry_after=FAILED_RETRY_AFTER_S)
        return model

    @property
    def all_ready(self) -> bool:
        return all(model.state is ModelState.READY for model in self._models.values())

    def engines(self) -> list[tuple[str, EngineClient]]:
        return [(m.id, m.engine) for m in self._models.values() if m.engine is not None]

    def grammar_compiles_stuck(self) -> dict[str, int]:
        """Grammar compilations past their time limit, per model (their threads are lost)."""
        return {m.id: m.runtime.grammars.stuck for m in self._models.values() if m.runtime is not None}

    def status(self) -> dict[str, dict[str, object]]:
        status: dict[str, dict[str, object]] = {}
        for model in self._models.values():
            entry: dict[str, object] = {"state": model.state.value}
            if model.error:
                entry["error"] = model.error
            if model.engine is not None:
                busy, waiting = model.engine.load()
                entry.update(slots=model.engine.slots, busy_slots=busy, waiting=waiting,
                             stats=asdict(model.engine.stats))
                stats = model.engine.stats
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
            status[model.id] = entry
        return status

    def list_models(self) -> ModelList:
        return ModelList(
            data=[ModelCard(id=model.id, created=model.created) for model in self._models.values()]
        )
