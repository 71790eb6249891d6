"""Server settings: `FASTRUN_*` environment variables, overridden by command-line flags."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

from pydantic import Field, FilePath, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from fastrun_cpp.default_model import DEFAULT_MODEL_ID
from fastrun_cpp.limits import Limits
from fastrun_cpp.registry import KVCacheType, ModelConfig
from fastrun_cpp.parsers import ReasoningParserName, ToolParserName


def physical_cores() -> int:
    # llama.cpp runs fastest with one thread per physical core; hyperthreads only add contention.
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text(encoding="ascii", errors="ignore")
    except OSError:
        return max(1, usable)
    cores = set()
    for block in cpuinfo.split("\n\n"):
        fields = dict(
            (key.strip(), value.strip())
            for key, _, value in (line.partition(":") for line in block.splitlines())
        )
        if "core id" in fields:
            cores.add((fields.get("physical id"), fields["core id"]))
    return max(1, min(usable, len(cores) or usable))


def _model_field(name: str):
    """A setting that overrides the ModelConfig field `name` (same checks; unset: its default)."""
    field = ModelConfig.model_fields[name]
    return Field(None, description=f"{field.description} [default: {field.default}]", **_constraints(field))


def _constraints(field) -> dict:
    out = {}
    for item in field.metadata:
        for key in ("ge", "gt", "le", "lt"):
            if getattr(item, key, None) is not None:
                out[key] = getattr(item, key)
    return out


def _data_home() -> Path:
    return Path(os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share")


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="FASTRUN_", env_nested_delimiter="__", extra="ignore")

    host: str = Field("127.0.0.1", description="Address to listen on.")
    port: int = Field(8000, ge=0, le=65535, description="Port to listen on.")
    model: str = Field(
        DEFAULT_MODEL_ID,
        description="Model to serve: a GGUF path, the embedded default model's id, or a Hugging Face "
        "repository (owner/name or owner/name:file.gguf), pulled into the HF cache.",
    )
    models_file: FilePath | None = Field(
        None, description="A TOML registry of models to serve (see models/registry.example.toml); "
        "replaces --model and the per-model settings.",
    )
    served_model_name: str | None = Field(
        None, description="Model id clients send; defaults to the model's id or GGUF file name."
    )
    # Per-model engine settings: unset means the model's own default (registry.ModelConfig).
    replicas: int | None = _model_field("replicas")
    chat_template_file: FilePath | None = Field(
        None, description="A Jinja chat template file to use instead of the one in the GGUF."
    )
    tool_parser: ToolParserName | None = Field(
        None, description="Tool-call format of the model; chosen from its chat template when unset."
    )
    reasoning_parser: ReasoningParserName | None = Field(
        None, description="Reasoning format of the model; chosen from its chat template when unset."
    )
    slots: int | None = _model_field("slots")
    ctx_size: int | None = _model_field("ctx_size")
    batch_size: int | None = _model_field("batch_size")
    prompt_cache_mib: int | None = _model_field("prompt_cache_mib")
    prompt_cache_disk_gib: float | None = _model_field("prompt_cache_disk_gib")
    prompt_cache_dir: Path = Field(
        default_factory=lambda: _data_home() / "fastrun-cpp" / "prompt-cache",
        description="Directory of the disk prompt cache (shared safely by several servers).",
        json_schema_extra={"shown_default": "$XDG_DATA_HOME/fastrun-cpp/prompt-cache"},
    )
    swa_full: bool | None = _model_field("swa_full")
    cache_type_k: KVCacheType | None = _model_field("cache_type_k")
    cache_type_v: KVCacheType | None = _model_field("cache_type_v")
    rope_scaling: Literal["auto", "gguf", "yarn", "linear"] | None = _model_field("rope_scaling")
    embeddings: bool | None = _model_field("embeddings")
    embedding_pooling: Literal["mean", "cls", "last"] | None = _model_field("embedding_pooling")
    rerank: bool | None = _model_field("rerank")
    mmproj: Path | None = _model_field("mmproj")
    mmproj_auto: bool | None = _model_field("mmproj_auto")
    lora: list[str] | None = Field(None, description=(
        "A LoRA adapter of the model, NAME=PATH[:SCALE] (scale 1 unless given); repeat for several. Each is "
        "served as the model <id>:<NAME> and may be named in a request's lora list."))
    deterministic: bool | None = _model_field("deterministic")
    max_queue: int | None = _model_field("max_queue")
    queue_policy: Literal["fair", "fifo"] | None = _model_field("queue_policy")
    spec_type: Literal["none", "ngram", "draft"] | None = _model_field("spec_type")
    spec_draft_max: int | None = _model_field("spec_draft_max")
    spec_draft_min: int | None = _model_field("spec_draft_min")
    draft_model: str | None = _model_field("draft_model")
    default_max_tokens: int | None = Field(
        None, ge=1, description="The longest answer of a chat or Responses request that names no max_tokens "
        "(unset: the rest of the context, as OpenAI's; Codex CLI sends none). A registry sets it per model "
        "(defaults.max_tokens).",
    )
    threads: int = Field(default_factory=physical_cores, ge=1, description="CPU threads for decoding.",
                         json_schema_extra={"shown_default": "the physical cores"})
    adapt_threads: bool | None = _model_field("adapt_threads")
    stream_interval_ms: float | None = _model_field("stream_interval_ms")
    backend: Literal["local", "ray"] = Field(
        "local", description="Where the engines run: in this process, or as a Ray Serve deployment of "
        "--replicas replicas (pip install 'fastrun-cpp[ray]').",
    )
    ray_router: Literal["affinity", "pow2"] = Field(
        "affinity", description="Replica choice with --backend ray: prefix affinity, or power-of-two-choices by "
        "queue length as Ray Serve's default router does (for comparison).",
    )
    ray_replica_timeout_s: float = Field(
        60, gt=0, description="With --backend ray, how long a request waits for a replica to accept it (none up, or all "
        "still starting) before it fails with a 503, seconds.",
    )
    ray_address: str | None = Field(
        None, description="Ray cluster to join with --backend ray ('auto': the one `ray start` made on this "
        "machine); unset: start a local one.",
    )
    n_gpu_layers: int | None = Field(None, description="Layers to offload to a GPU (-1, the default: all; 0: none).")
    keep_alive: str = Field(
        "-1", description="How long a model stays loaded once idle, as Ollama's keep_alive: a duration (5m, 1h30m) "
        "or seconds; 0: unload it after each answer; negative: for good. A registry entry and a request's keep_alive "
        "set it per model.")
    memory_budget: str | None = Field(
        None, description="Memory the loaded models may hold: a size for RAM (16GiB), or ram=SIZE,gpu=SIZE (gpu: on "
        "each GPU). Loading past it unloads the least recently used idle model; unset: no bound.")
    load_wait_s: float = Field(
        120, gt=0, description="How long a request waits for its model to load before a 503 with Retry-After (the load "
        "goes on), seconds.")
    hub_models: bool = Field(
        True, description="Also serve the GGUF models in the local Hugging Face cache, by their Hub id (owner/name or "
        "owner/name:file.gguf), loaded when first asked for: by an admin key (or in open loopback mode), and by "
        "every key with --user-hub-models.")
    user_hub_models: bool = Field(
        False, description="Let user (not admin) keys name Hub-cache models no registry lists, and so load them: "
        "off, a user key is served the registry's models and those an admin loaded or pulled.")
    user_keep_alive_max: str = Field(
        "1h", description="The longest keep_alive a user (not admin) key may ask for, as Ollama's keep_alive. A user "
        "key may only lengthen a model's idle time (up to this); a shorter keep_alive than the model's own, which "
        "would unload it under every other account, takes an admin key.")
    pull_max_gib: float = Field(
        256, gt=0, description="Largest model POST /v1/models/pull may download (all shards), GiB.")
    request_timeout_s: float = Field(600, gt=0, description="Limit for a request without streaming, seconds.")
    stream_timeout_s: float = Field(3600, gt=0, description="Limit for a streamed request, seconds.")
    shutdown_grace_s: float = Field(
        30, ge=0, description="On SIGTERM, how long running requests may take to finish, seconds."
    )
    keys_db: Path = Field(
        default_factory=lambda: _data_home() / "fastrun-cpp" / "keys.sqlite3",
        description="SQLite database of API keys (see `fastrun-cpp keys`).",
        json_schema_extra={"shown_default": "$XDG_DATA_HOME/fastrun-cpp/keys.sqlite3"},
    )
    responses_db: Path | None = Field(
        None, description="SQLite database of stored Responses API responses; unset: beside --keys-db."
    )
    responses_max: int = Field(10000, ge=0, description="Stored responses kept over all accounts (the oldest go "
                               "first); 0: none.")
    responses_max_gib: float = Field(4, gt=0, description="Bytes of stored responses over all accounts, GiB.")
    responses_per_account: int = Field(1000, ge=0, description="Stored responses kept per account (its oldest go "
                                       "first).")
    responses_per_account_mib: float = Field(256, gt=0, description="Bytes of stored responses per account, MiB.")
    responses_retention_s: float = Field(
        30 * 86400, gt=0, description="How long a stored response is kept (and can be continued), seconds."
    )
    responses_max_mib: float = Field(8, gt=0, description="Largest stored response with its conversation, MiB.")
    batches_db: Path | None = Field(
        None, description="SQLite database of uploaded files and batches (/v1/files, /v1/batches); unset: beside "
        "--keys-db.")
    files_per_account: int = Field(100, ge=0, description="Files an account may keep uploaded (/v1/files).")
    files_per_account_mib: float = Field(1024, gt=0, description="Bytes of uploaded files per account, MiB.")
    files_max_gib: float = Field(16, gt=0, description="Bytes of uploaded files over all accounts, GiB.")
    batch_max_lines: int = Field(50000, ge=1, description="Lines (requests) one batch file may hold, as OpenAI's.")
    batches_per_account: int = Field(16, ge=1, description="Batches an account may have running at once, and "
                                     "background responses likewise.")
    batch_output_max_mib: float = Field(
        1024, gt=0, description="A batch's output file, at most, MiB: a line whose result would take it past this "
        "fails, with an error saying so in the error file.")
    job_lease_s: float = Field(
        30.0, ge=3, le=3600, description="Servers sharing a data directory run each batch and background response "
        "once: the server running one renews its lease on it every third of this; a job whose server died is taken "
        "over when its lease lapses (at once by a server on the same host).")
    batch_lines_in_flight: int | None = Field(
        None, ge=1, description="Runs of the server's own work in the engines at once: batch lines and "
        "background responses, one queue over both, taken in turn by account (at bulk priority, behind every "
        "interactive request); unset: one per slot of the served models.")
    keys_refresh_s: float = Field(2.0, gt=0, description="How often new and revoked keys are picked up, seconds.")
    auth: bool = Field(
        True,
        description="Check API keys; --no-auth serves without them, even on a public address (keys are ignored).",
    )
    metrics: bool = Field(True, description="Serve Prometheus metrics at /metrics.")
    ui: bool = Field(True, description="Serve the web page at / (chat with a model; the operator view for an admin "
                     "key). --no-ui turns it off; the API is the same either way.")
    cors_origins: list[str] = Field(
        default_factory=list, description="Origins allowed to call the API from browsers (CORS)."
    )
    allowed_media_domains: list[str] = Field(
        default_factory=list, description="Hosts image URLs (http, https) may be fetched from: example.com, or "
        "*.example.com for its subdomains; a name must resolve to public addresses only (name an address itself to "
        "allow a private one). Unset: none, and an image is sent as a data URI or base64.")
    log_level: str = Field("info", description="Log level: debug, info, warning, error.")
    log_prompts: bool = Field(False, description="Log prompt and answer text (off by default).")
    reasoning_format: Literal["reasoning", "reasoning_content", "both"] = Field(
        "reasoning", description="The field a chat answer's reasoning text is in: reasoning (the spec's; vLLM's and "
        "OpenRouter's), reasoning_content (DeepSeek's and llama-server's, what many chat front-ends read) or both. "
        "Requests may send either back.")
    reasoning_budget: int = Field(
        -1, ge=-1, le=1 << 24, description="Most tokens a chat answer may reason for, where the request names no "
        "budget (thinking_budget_tokens, reasoning_effort, Anthropic's thinking.budget_tokens): past it the server "
        "closes the reasoning and the answer follows. -1: unlimited; 0: no thinking.")
    reasoning_budget_message: str = Field(
        "", max_length=4096, description="Text written into the reasoning when its budget ends it, before the "
        "model's end-of-reasoning marker (for example \"Time is up; answering now.\").")
    limits: Limits = Field(default_factory=Limits, description="Bounds on the work one request can ask for.")
    @field_validator("keep_alive", "user_keep_alive_max")
    @classmethod
    def _keep_alive(cls, value: str) -> str:
        from fastrun_cpp.keep_alive import parse_keep_alive

        parse_keep_alive(value)
        return value

    @field_validator("memory_budget")
    @classmethod
    def _memory_budget(cls, value: str | None) -> str | None:
        if value is not None:
            parse_budget(value)
        return value

    def budget(self):
        """The memory budget (runtime.lifecycle.MemoryBudget)."""
        from fastrun_cpp.runtime.lifecycle import MemoryBudget

        ram, gpu = parse_budget(self.memory_budget) if self.memory_budget else (None, None)
        return MemoryBudget(ram=ram, gpu=gpu)

    debug_faults: str = Field(
        "",
        description="Fault injection for tests, e.g. 'load-delay=3,decode-fail=2' (never in production).",
    )


def parse_budget(text: str) -> tuple[int | None, int | None]:
    """'16GiB' (RAM) or 'ram=16GiB,gpu=22GiB' -> (RAM bytes, bytes per GPU)."""
    from fastrun_cpp.runtime.memory import parse_size

    if "=" not in text:
        return parse_size(text), None
    sizes: dict[str, int] = {}
    for part in text.split(","):
        name, _, size = part.partition("=")
        if name.strip() not in ("ram", "gpu") or name.strip() in sizes:
            raise ValueError(f"memory budget {text!r}: give ram=SIZE and/or gpu=SIZE")
        sizes[name.strip()] = parse_size(size)
    return sizes.get("ram"), sizes.get("gpu")
