"""The models this server serves, their loading state, and GET /v1/models."""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass, field

from fastrun_cpp.registry import ModelConfig, SamplingDefaults
from fastrun_cpp.runtime import EngineClient, ModelRuntime
from fastrun_cpp.entrypoints.openai.errors import APIError, model_not_found
from fastrun_cpp.entrypoints.openai.protocol import ModelCard, ModelList, ModelMeta, unix_time
from fastrun_cpp.entrypoints.openai.protocol_base import MAX_OUTPUT_TOKENS

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

    def knows(self, model_id: str) -> bool:
        """Whether the id names a served model (ready or not)."""
        return model_id in self._models

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

    def grammar_compile_failures(self) -> dict[str, tuple[int, int]]:
        """Per model, grammar compilations past their time limit: (stuck in a thread of the
        server, killed in their trial process)."""
        return {m.id: (m.runtime.grammars.stuck, m.runtime.grammars.killed)
                for m in self._models.values() if m.runtime is not None}

    def status(self, *, counters: bool = True) -> dict[str, dict[str, object]]:
        """Each model's state and load (what a probe or a balancer needs), and with `counters`
        what it has served."""
        status: dict[str, dict[str, object]] = {}
        for model in self._models.values():
            entry: dict[str, object] = {"state": model.state.value}
            if model.error:
                entry["error"] = model.error
            if model.engine is not None:
                busy, waiting = model.engine.load()
                entry.update(slots=model.engine.slots, busy_slots=busy, waiting=waiting)
            status[model.id] = entry
            if model.engine is None or not counters:
                continue
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
        cards = [model_card(model) for model in self._models.values()]
        return ModelList(data=cards, models=[codex_model_info(card) for card in cards if card.max_model_len])


def model_card(model: ServedModel) -> ModelCard:
    """The model's card; a model still loading (or failed) has only its id."""
    if model.runtime is None:
        return ModelCard(id=model.id, created=model.created)
    runtime = model.runtime
    info = runtime.info
    capabilities = ["chat", "completions", "tools", "structured_outputs"]
    if runtime.reasoning_parser is not None:
        capabilities.append("reasoning")
    if info.embedding_dimensions is not None:
        capabilities.append("embeddings")
    return ModelCard(id=model.id, created=model.created, max_model_len=info.max_context,
                     max_output_tokens=min(info.max_context, MAX_OUTPUT_TOKENS), capabilities=capabilities,
                     meta=ModelMeta(n_vocab=info.n_vocab, n_ctx_train=info.n_ctx_train, n_ctx=info.max_context,
                                    slots=info.slots))


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
        "input_modalities": ["text"],
        "experimental_supported_tools": [],
        "model_messages": {"instructions_template": CODEX_INSTRUCTIONS},
    }
