"""The models a server serves: a TOML registry (`--models-file`), or the one model given by
`--model` and friends. Weights are never part of it: sources are paths, the embedded default
model, or Hugging Face Hub files."""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from fastrun_cpp.default_model import DEFAULT_MODEL_ID, ModelNotFoundError, embedded_model_path
from fastrun_cpp.parsers import ReasoningParserName, ToolParserName

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10: the same parser as a package
    import tomli as tomllib

# The KV cache types llama.cpp's CPU attention reads (llama-server's -ctk / -ctv choices).
KVCacheType = Literal["f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1"]


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid")


class HubSource(StrictModel):
    repo: str
    file: str | None = None  # the repository's only GGUF when unset
    revision: str | None = None


class GpuOptions(StrictModel):
    """llama.cpp's offload settings; ignored on a build without a GPU backend."""

    n_gpu_layers: int = -1  # -1: all layers
    main_gpu: int = 0
    split_mode: Literal["none", "layer", "row"] = "layer"
    tensor_split: list[float] | None = None  # share of the model per GPU
    flash_attn: Literal["auto", "on", "off"] = "auto"
    # The KV cache types' old place (they apply on every device): ModelConfig's cache_type_k and
    # cache_type_v take them when they are unset.
    cache_type_k: KVCacheType | None = None
    cache_type_v: KVCacheType | None = None


class SamplingDefaults(StrictModel):
    """Per-model defaults for what a request leaves out (OpenAI's otherwise)."""

    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, ge=0, le=1)
    top_k: int | None = Field(None, ge=0, le=1000)
    min_p: float | None = Field(None, ge=0, le=1)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, ge=0, le=2)
    # Ollama's `PARAMETER stop`: where a model's answers end when its own end-of-turn token is
    # not enough (a small model that rambles on, a template whose turns end in text).
    stop: list[Annotated[str, Field(min_length=1)]] | None = Field(
        None, max_length=4, description="Stop sequences of a request that names none.")
    # OpenAI's default is the rest of the context, and some clients never send one (Codex CLI):
    # a small model may then talk on for thousands of tokens.
    max_tokens: int | None = Field(None, ge=1, description="The longest answer of a chat or Responses request "
                                   "that names no max_tokens.")


# How far a LoRA adapter's scale may go either way: past it a model's logits are noise or inf.
MAX_LORA_SCALE = 100.0
LORA_NAME = r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}"


def lora_file_problem(path: Path) -> str | None:
    """Why a file is not a LoRA adapter GGUF (its header, as llama.cpp reads it), or None."""
    import gguf

    try:
        fields = gguf.GGUFReader(str(path)).fields
    except FileNotFoundError:
        return "no such file"
    except Exception as exc:  # noqa: BLE001 - the reader's errors for a file that is not GGUF vary
        return f"not a GGUF file ({type(exc).__name__}: {exc})"
    kinds = {key: fields[key].contents() if key in fields else None for key in ("general.type", "adapter.type")}
    if kinds != {"general.type": "adapter", "adapter.type": "lora"}:
        return f"not a LoRA adapter (general.type {kinds['general.type']!r}, adapter.type {kinds['adapter.type']!r})"
    return None


class LoraAdapter(StrictModel):
    """A LoRA adapter of a model: served as `<model>:<name>`, or named in a request's `lora`."""

    name: Annotated[str, Field(pattern=f"^{LORA_NAME}$")]
    path: Path
    scale: Annotated[float, Field(ge=-MAX_LORA_SCALE, le=MAX_LORA_SCALE)] = 1.0

    @classmethod
    def parse(cls, spec: str) -> LoraAdapter:
        """`NAME=PATH[:SCALE]`, as --lora takes it."""
        name, _, rest = spec.partition("=")
        path, scale = rest, None
        head, _, tail = rest.rpartition(":")
        if head and re.fullmatch(r"[-+]?[0-9.]+(e[-+]?[0-9]+)?", tail):
            path, scale = head, float(tail)
        if not name or not path:
            raise ValueError(f"--lora {spec!r}: expected NAME=PATH[:SCALE]")
        return cls(name=name, path=Path(path).expanduser(), **({"scale": scale} if scale is not None else {}))


class ModelConfig(StrictModel):
    """One served model: where its weights come from and how its engines run. This is the one
    place engine defaults are written; `Settings` (flags, FASTRUN_*) only overrides them."""

    id: str
    path: Path | None = None  # a local GGUF
    hub: HubSource | None = None  # or a Hub file (pulled at startup into the HF cache)
    slots: int = Field(4, ge=1, le=256, description="Parallel sequences decoded together.")
    ctx_size: int = Field(4096, ge=64, description="Context window of each slot, in tokens (prompt plus answer).")
    batch_size: int = Field(512, ge=16, description="Most tokens in one decode step (long prompts go in chunks).")
    threads: int | None = Field(None, ge=1, description="CPU threads; the server's --threads when unset.")
    adapt_threads: bool = Field(
        True, description="Run fewer CPU threads while other processes keep the cores busy (never more than "
        "--threads): a thread waiting for a descheduled partner spins away its turn.")
    stream_interval_ms: float = Field(
        5.0, ge=0, le=100, description="A stream's tokens made faster than this go out together, each at most this "
        "much later (first and last tokens at once): a write per token would take the CPU the model runs on. 0: "
        "every token as it comes.")
    replicas: int = Field(1, ge=1, le=64, description="Engines serving the model (prefix-aware routing).")
    gpus: list[int] | None = None  # one replica per listed GPU (overrides `replicas`)
    gpu: GpuOptions = Field(default_factory=GpuOptions)
    cache_type_k: KVCacheType | None = Field(
        None, description="K cache data type, as llama-server's -ctk: f16, bf16, q8_0, q4_0, q4_1, iq4_nl, q5_0, q5_1 "
        "or f32 (unset: f16; bf16 in exact mode on a build without fastrun's attention patch). q8_0 holds a token's "
        "keys in about half of f16's memory; docs/caching-and-determinism.md says what each type does to exactness "
        "and speed.")
    cache_type_v: KVCacheType | None = Field(
        None, description="V cache data type, as llama-server's -ctv (unset: f16). A quantized V needs flash "
        "attention: on in exact mode, else --flash-attn auto or on.")
    prompt_cache_mib: int = Field(1024, ge=0, description="Host RAM (MiB) for KV prefixes saved from slots; 0: off.")
    prompt_cache_disk_gib: float = Field(
        4, ge=0, description="Disk (GiB) for KV prefixes under --prompt-cache-dir, kept across restarts; 0: off."
    )
    max_queue: int = Field(64, ge=0, description="Requests that may wait for a slot before the server answers 429.")
    queue_policy: Literal["fair", "fifo"] = Field(
        "fair", description="fair: lower priority values first, then fair shares of accounts by tokens served (by "
        "weight), preempting a running sequence to host RAM to keep both; fifo: first come, first served.")
    rope_scaling: Literal["auto", "gguf", "yarn", "linear"] = Field(
        "auto", description="How a context longer than the model was trained on reaches its far positions: auto: "
        "YaRN when ctx_size exceeds the trained context and the GGUF names no scaling of its own, else the GGUF's; "
        "gguf: the file's own (llama.cpp's default); yarn / linear: scaled from the trained context to ctx_size.")
    swa_full: bool = Field(
        True, description="Keep the full KV of sliding-window layers so their prefixes stay reusable."
    )
    deterministic: bool = Field(
        True,
        description="Batch-invariant CPU kernels: at temperature 0 an answer never depends on batching, prompt "
        "chunking or cache hits (costs about 30% of prompt-processing speed; off: llama.cpp's fastest kernels).",
    )
    spec_type: Literal["none", "ngram", "draft"] = Field(
        "ngram", description="Speculative decoding: n-gram lookup in the context, a draft model, or none."
    )
    spec_draft_max: int = Field(8, ge=1, le=64, description=(
        "Longest speculative draft for one slot in one step (8 suits CPUs; GPUs gain from 16-32)."))
    spec_draft_min: int = Field(2, ge=1, le=64, description="Shortest speculative draft worth verifying.")
    draft_model: str | None = Field(
        None, description="Draft model for --spec-type draft: a GGUF path or a Hub repo (owner/name[:file.gguf]) "
        "with the same vocabulary."
    )
    embeddings: bool = Field(False, description="Serve /v1/embeddings from this model too.")
    loras: list[LoraAdapter] = Field(default_factory=list, description=(
        "LoRA adapters of this model (GGUF): each is served as the model <id>:<name> and may be named in a "
        "request's lora list."))
    mmproj: Path | None = Field(None, description=(
        "A vision projector GGUF (mmproj) for this model, as llama-server's --mmproj: requests may then send "
        "images (capabilities vision)."))
    mmproj_auto: bool = Field(True, description=(
        "Pull and use the vision projector (mmproj*.gguf) a Hub model's repository holds, as llama-server's -hf "
        "does (--no-mmproj-auto, or llama-server's --no-mmproj: serve the model for text only)."))
    rerank: bool = Field(False, description="Serve /v1/rerank from this model: a reranker GGUF (rank pooling and "
                         "a classifier head, as Qwen3-Reranker or bge-reranker). On by itself for a GGUF that "
                         "declares rank pooling.")
    embedding_pooling: Literal["mean", "cls", "last"] | None = Field(
        None, description="How an input's token vectors become one embedding; unset: the GGUF's, else mean."
    )
    chat_template_file: Path | None = None
    tool_parser: ToolParserName | None = None
    reasoning_parser: ReasoningParserName | None = None
    defaults: SamplingDefaults = Field(default_factory=SamplingDefaults)
    preload: bool = Field(True, description="Load the model when the server starts (else when first asked for).")
    keep_alive: str | float | None = Field(
        None, description="How long the model stays loaded once idle, as Ollama's keep_alive: a duration (5m, 1h30m) "
        "or seconds; 0: unload it after each answer; negative: for good. Unset: the server's --keep-alive.")

    @model_validator(mode="after")
    def _keep_alive(self) -> ModelConfig:
        if self.keep_alive is not None:
            from fastrun_cpp.keep_alive import parse_keep_alive

            parse_keep_alive(self.keep_alive)  # a ValueError names the problem
        return self

    @model_validator(mode="after")
    def _one_source(self) -> ModelConfig:
        if self.path is not None and self.hub is not None:
            raise ValueError(f"model {self.id!r}: give either path or hub, not both")
        if self.path is None and self.hub is None and self.id != DEFAULT_MODEL_ID:
            raise ValueError(f"model {self.id!r} needs a path or a hub source")
        return self

    @model_validator(mode="after")
    def _quantized_v_needs_flash_attention(self) -> ModelConfig:
        # llama.cpp refuses the context (and the model would fail to load at its first request).
        v = self.cache_type_v or self.gpu.cache_type_v or "f16"
        if v not in ("f16", "bf16", "f32") and not self.deterministic and self.gpu.flash_attn == "off":
            raise ValueError(f"model {self.id!r}: a {v} V cache needs flash attention (flash_attn auto or on)")
        return self

    @model_validator(mode="after")
    def _loras_are_lora_ggufs(self) -> ModelConfig:
        # Checked before any load: llama.cpp would only fail the model's load, at its first request.
        names = [adapter.name for adapter in self.loras]
        if len(set(names)) != len(names):
            raise ValueError(f"model {self.id!r}: two LoRA adapters share a name ({', '.join(names)})")
        for adapter in self.loras:
            problem = lora_file_problem(adapter.path)
            if problem:
                raise ValueError(f"model {self.id!r}: LoRA adapter {adapter.name!r} ({adapter.path}): {problem}")
        return self

    @model_validator(mode="after")
    def _mmproj_is_a_file(self) -> ModelConfig:
        if self.mmproj is not None and not self.mmproj.expanduser().is_file():
            raise ValueError(f"model {self.id!r}: no mmproj file {self.mmproj}")
        return self

    @property
    def replica_count(self) -> int:
        return len(self.gpus) if self.gpus else self.replicas

    def resolve_path(self) -> Path:
        """The local GGUF, pulling it from the Hub first if needed (blocking)."""
        if self.path is not None:
            if not self.path.expanduser().is_file():
                raise ModelNotFoundError(f"model {self.id!r}: no file {self.path}")
            return self.path.expanduser().resolve()
        if self.hub is not None:
            from fastrun_cpp.hub import pull

            return pull(self.hub.repo, self.hub.file, revision=self.hub.revision)
        return embedded_model_path()


    def resolve_mmproj(self) -> Path | None:
        """The vision projector's GGUF: the one given, or the one the model's Hub repository
        holds (pulled first; blocking), or None."""
        if self.mmproj is not None:
            return self.mmproj.expanduser().resolve()
        if self.hub is None or not self.mmproj_auto:
            return None
        from fastrun_cpp.hub import pull_projector

        return pull_projector(self.hub.repo, revision=self.hub.revision)

    def resolve_draft_path(self) -> Path:
        """The draft model's GGUF (a path, or a Hub file pulled first; blocking)."""
        if self.draft_model is None:
            raise ModelNotFoundError(f"model {self.id!r}: --spec-type draft needs --draft-model")
        path = Path(self.draft_model).expanduser()
        if path.is_file():
            return path.resolve()
        if _looks_like_a_path(self.draft_model):
            raise ModelNotFoundError(f"draft model {self.draft_model!r} is not a GGUF file or a Hub repository")
        from fastrun_cpp.hub import pull

        repo, _, filename = self.draft_model.partition(":")
        return pull(repo, filename or None)


class Registry(StrictModel):
    models: list[ModelConfig] = Field(min_length=1)

    @model_validator(mode="after")
    def _unique_ids(self) -> Registry:
        ids = [model.id for model in self.models]
        duplicates = {i for i in ids if ids.count(i) > 1}
        if duplicates:
            raise ValueError(f"model ids must be unique: {', '.join(sorted(duplicates))}")
        return self


def load_registry(path: Path) -> Registry:
    with open(path, "rb") as file:
        data = tomllib.load(file)
    registry = Registry.model_validate(data)
    base = path.resolve().parent  # relative paths in the file are relative to it
    for model in registry.models:
        if model.path is not None and not model.path.expanduser().is_absolute():
            model.path = base / model.path
        if model.chat_template_file is not None and not model.chat_template_file.is_absolute():
            model.chat_template_file = base / model.chat_template_file
    return registry


def _looks_like_a_path(value: str) -> bool:
    repo = value.partition(":")[0]
    return value.startswith(("/", ".", "~")) or repo.endswith(".gguf") or repo.count("/") != 1


# Settings that override a ModelConfig field of the same name when given.
MODEL_OVERRIDES = ("slots", "adapt_threads", "stream_interval_ms", "ctx_size", "batch_size", "replicas", "prompt_cache_mib", "prompt_cache_disk_gib",
                   "cache_type_k", "cache_type_v",
                   "max_queue", "queue_policy", "rope_scaling", "swa_full", "deterministic", "spec_type", "spec_draft_max", "spec_draft_min",
                   "draft_model", "chat_template_file", "tool_parser", "reasoning_parser", "embeddings",
                   "embedding_pooling", "rerank", "mmproj", "mmproj_auto")


def _overrides(settings) -> dict:
    """The engine settings given on the command line, for a model's configuration."""
    common = {name: getattr(settings, name) for name in MODEL_OVERRIDES if getattr(settings, name) is not None}
    if settings.n_gpu_layers is not None:
        common["gpu"] = GpuOptions(n_gpu_layers=settings.n_gpu_layers)
    if settings.default_max_tokens is not None:
        common["defaults"] = SamplingDefaults(max_tokens=settings.default_max_tokens)
    if settings.lora:
        common["loras"] = [LoraAdapter.parse(spec) for spec in settings.lora]
    return common


def model_from_settings(settings) -> ModelConfig:
    """The one model of a server started without --models-file: `--model` is the embedded
    default's id, a GGUF path, or a Hub repository (`owner/name` or `owner/name:file.gguf`)."""
    common = _overrides(settings)
    source = settings.model
    if source == DEFAULT_MODEL_ID:
        common.setdefault("embeddings", True)  # small enough to serve both out of the box
        return ModelConfig(id=settings.served_model_name or source, path=embedded_model_path(), **common)
    path = Path(source).expanduser()
    if path.is_file():
        return ModelConfig(id=settings.served_model_name or path.stem, path=path.resolve(), **common)
    if _looks_like_a_path(source):
        raise ModelNotFoundError(
            f"model {source!r} is not a GGUF file, the embedded model ({DEFAULT_MODEL_ID}), "
            "or a Hub repository (owner/name[:file.gguf])"
        )
    repo, _, filename = source.partition(":")
    return ModelConfig(id=settings.served_model_name or source, hub=HubSource(repo=repo, file=filename or None),
                       **common)


def registry_from_settings(settings) -> Registry:
    if settings.models_file is not None:
        return load_registry(settings.models_file)
    return Registry(models=[model_from_settings(settings)])


# A Hub model id: owner/name, or owner/name:file.gguf. Never a path: no leading dot or slash, no "..".
_HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,95}/[A-Za-z0-9][A-Za-z0-9_.-]{0,95}(:[A-Za-z0-9][A-Za-z0-9_.-]{0,250}\.gguf)?")


def hub_model_id(model_id: str) -> tuple[str, str | None] | None:
    """(repo, file) of a Hub model id, or None for anything else (a path, a bare name)."""
    if len(model_id) > 400 or not _HUB_ID.fullmatch(model_id) or ".." in model_id:
        return None
    repo, _, filename = model_id.partition(":")
    if "--" in repo:  # the Hub refuses it (its cache names repositories with "--" between the parts)
        return None
    return repo, filename or None


def cached_hub_model(settings, model_id: str) -> ModelConfig | None:
    """A model no registry lists that the local Hub cache holds, by its Hub id, configured by
    the server's flags. Only the cache is looked at: asking for a model never downloads one
    (POST /v1/models/pull does)."""
    parsed = hub_model_id(model_id)
    if parsed is None:
        return None
    from fastrun_cpp.hub import cached_gguf

    filename = cached_gguf(*parsed)
    if filename is None:
        return None
    return hub_model(settings, model_id, parsed[0], filename)


def hub_model(settings, model_id: str, repo: str, filename: str, *, revision: str | None = None) -> ModelConfig:
    """A Hub file (of `revision`, `main` by default) served as `model_id`, configured by the
    server's flags, loaded when asked for."""
    return ModelConfig(id=model_id, hub=HubSource(repo=repo, file=filename, revision=revision), preload=False,
                       **_overrides(settings))
