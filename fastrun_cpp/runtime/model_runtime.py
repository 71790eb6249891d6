"""ModelRuntime: everything one served model needs, built from its ModelConfig alone."""

from __future__ import annotations

import asyncio
import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

import llama_cpp

from fastrun_cpp.chat import ChatTemplate
from fastrun_cpp.engine import AsyncEngine, EngineConfig, Faults, LlamaModel
from fastrun_cpp.engine.errors import check_prompt_length
from fastrun_cpp.engine.backend import system_info
from fastrun_cpp.engine.disk_cache import IDENTITIES_FILE, DiskPromptCache, file_identity, namespace_of
from fastrun_cpp.engine.embedding import model_pooling
from fastrun_cpp.engine.grammar import GrammarCompiler
from fastrun_cpp.engine.model import gpu_offload_available
from fastrun_cpp.engine.speculative import SpeculationConfig
from fastrun_cpp.engine.vision import Projector
from fastrun_cpp.limits import Limits
from fastrun_cpp.engine.pool import EnginePool
from fastrun_cpp.parsers import ReasoningParser, ToolParser, select_reasoning_parser, select_tool_parser
from fastrun_cpp.registry import ModelConfig
from fastrun_cpp.runtime.client import EngineClient

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelInfo:
    """What the serving layer may know of a model (read-only)."""

    id: str
    path: str
    description: str
    n_vocab: int
    n_ctx_train: int
    max_context: int  # tokens per request: prompt and answer
    slots: int  # over all replicas
    replicas: int
    deterministic: bool  # batch-invariant kernels are in use
    embedding_dimensions: int | None = None  # serves /v1/embeddings with vectors this long; None: does not
    # Serves /v1/rerank (None: does not), with its GGUF's prompt for a query and a document
    # ("": none; the pair is then joined with the vocabulary's separators, as llama-server does).
    rerank_template: str | None = None
    # Each LoRA adapter's identity as it was loaded (its file's SHA-256): KV computed with it is
    # keyed by it, so an adapter file replaced across a restart never meets the old one's KV.
    lora_identities: dict[str, str] = field(default_factory=dict)
    vision: bool = False  # takes images (a projector is loaded)


class ModelRuntime:
    """A served model: the vocabulary (tokenizer), its engines behind an EngineClient, the chat
    template, tool-call and reasoning parsers, and a grammar compiler for its vocabulary.
    `close()` frees every replica's engine and weights."""

    def __init__(
        self,
        *,
        config: ModelConfig,
        info: ModelInfo,
        tokenizer: LlamaModel,
        engine: EngineClient,
        chat_template: ChatTemplate,
        tool_parser: ToolParser,
        reasoning_parser: ReasoningParser | None,
        grammars: GrammarCompiler,
        weights: list[LlamaModel],
        projector: Projector | None = None,
    ) -> None:
        self.config = config
        self.info = info
        self.tokenizer = tokenizer
        self.engine = engine
        self.chat_template = chat_template
        self.tool_parser = tool_parser
        self.reasoning_parser = reasoning_parser
        self.grammars = grammars
        self.projector = projector  # turns a request's images into embeddings, if the model has one
        self._weights = weights

    def check_prompt(self, n_prompt_tokens: int) -> None:
        check_prompt_length(n_prompt_tokens, self.info.max_context)

    async def close(self) -> None:
        await self.engine.shutdown()
        self.grammars.close()
        if self.projector is not None:
            self.projector.close()
        for model in {id(m): m for m in self._weights}.values():  # each distinct copy once
            model.close()


def chat_setup(config: ModelConfig, model: LlamaModel) -> tuple[ChatTemplate, ToolParser, ReasoningParser | None]:
    """The model's chat template (or the configured one) and the parsers it points to."""
    source = model.chat_template
    if config.chat_template_file is not None:
        source = Path(config.chat_template_file).read_text(encoding="utf-8")
    if source is None:
        logger.warning("%s has no chat template; using ChatML", config.id)
    template = ChatTemplate(source, bos_token=model.bos_text, eos_token=model.eos_text)
    return template, select_tool_parser(source, config.tool_parser), select_reasoning_parser(source, config.reasoning_parser)


def uses_gpu(config: ModelConfig) -> bool:
    return config.gpu.n_gpu_layers != 0 and gpu_offload_available()


def is_deterministic(config: ModelConfig) -> bool:
    """Batch invariance holds for llama.cpp's CPU kernels chosen here, not for GPU kernels."""
    return config.deterministic and not uses_gpu(config)


# Deterministic mode's process-wide llama.cpp switches (read once per process; a build without
# patches/llama.cpp ignores them, and deterministic_switches() makes up for the first):
# - GGML_CPU_TILED_BATCH_INVARIANT=1: the tiled K-quant matrix kernels (taken for 8+ rows) only
#   where the one-row kernel adds as they do (Q2_K to Q6_K on x86 with AVX2 and FMA), and that
#   one-row kernel for fewer rows;
# - GGML_CPU_FA_BATCH_INVARIANT=1: the tiled attention kernel for every batch, one row as 512
#   (without the patch, kv_cache_types avoids the kernels that depend on the batch);
# - GGML_CPU_REPACK_BATCH_INVARIANT=1: repacked weights only where the one-row kernel computes a
#   row as the many-row one does (read as the weights load; without the patch repacks_weights()
#   asks for none);
# - GGML_CPU_LLAMAFILE_BATCH_INVARIANT=1: llamafile's tinyBLAS only where a row comes out the
#   same in any batch, one row included (Q8_0, Q4_0, Q5_0 from two rows; F32, F16, BF16, IQ4_NL
#   from one; on x86 with AVX2 and FMA).
DETERMINISTIC_SWITCHES = {"GGML_CPU_TILED_BATCH_INVARIANT": "1", "GGML_CPU_FA_BATCH_INVARIANT": "1",
                          "GGML_CPU_REPACK_BATCH_INVARIANT": "1", "GGML_CPU_LLAMAFILE_BATCH_INVARIANT": "1"}


def _llama_cpp_exports(symbol: str) -> bool:
    """Whether this llama.cpp build exports `symbol` (patches/llama.cpp add some, `make setup`
    applies them)."""
    # dlsym through libllama's handle, which finds its dependency libggml-cpu's symbols too.
    return hasattr(llama_cpp.llama_cpp._lib, symbol)


def tiled_attention_is_batch_invariant() -> bool:
    """Whether this build has the GGML_CPU_FA_BATCH_INVARIANT switch: every f16/f32-KV attention
    then takes the tiled kernel, which computes each row alone, whatever the batch."""
    return _llama_cpp_exports("ggml_cpu_fa_batch_invariant_supported")


def repacked_weights_are_batch_invariant() -> bool:
    """Whether this build has the GGML_CPU_REPACK_BATCH_INVARIANT switch: Q4_0, IQ4_NL and Q4_K
    weights are then repacked for the kernels llama-server uses (on AVX2), whose one-row and
    many-row paths compute a row alike, and no other weight is."""
    return _llama_cpp_exports("ggml_cpu_repack_batch_invariant_supported")


def tiled_matmul_is_batch_invariant() -> bool:
    """Whether this build has the GGML_CPU_TILED_BATCH_INVARIANT switch: the tiled K-quant kernels
    then serve only the types whose one-row kernel computes a row as they do."""
    return _llama_cpp_exports("ggml_cpu_tiled_batch_invariant_supported")


def deterministic_switches() -> dict[str, str]:
    """The switches deterministic mode sets: DETERMINISTIC_SWITCHES, and on a build without the
    tiled switch, no tiled K-quant kernels at all (GGML_CPU_TILED_MM=0)."""
    if tiled_matmul_is_batch_invariant():
        return DETERMINISTIC_SWITCHES
    return {**DETERMINISTIC_SWITCHES, "GGML_CPU_TILED_MM": "0"}


def llamafile_is_batch_invariant() -> bool:
    """Whether this build's matrix kernels keep deterministic mode's promise: built without
    llamafile, or with the GGML_CPU_LLAMAFILE_BATCH_INVARIANT switch."""
    return "LLAMAFILE = 1" not in system_info() or _llama_cpp_exports("ggml_cpu_llamafile_batch_invariant_supported")


def repacks_weights(config: ModelConfig) -> bool:
    """Whether the weights load into llama.cpp's repacked layouts: always on the fastest kernels;
    in deterministic mode only with the switch above, which limits them to the batch-invariant ones."""
    return not is_deterministic(config) or repacked_weights_are_batch_invariant()


def kv_cache_types(config: ModelConfig) -> tuple[str, str]:
    """K and V cache types. Deterministic mode needs attention kernels whose rows do not depend
    on the batch: with fastrun's switch, the tiled kernel for equal f16/f32 types (as fast as
    llama.cpp gets); without it, the per-row kernel, which llama.cpp takes only for unequal
    types (with equal f16/f32 types it picks kernels by batch shape)."""
    asked_k = config.cache_type_k or config.gpu.cache_type_k
    cache_type_v = config.cache_type_v or config.gpu.cache_type_v or "f16"
    if not is_deterministic(config):
        return asked_k or "f16", cache_type_v
    if tiled_attention_is_batch_invariant():  # any other pair takes the per-row kernel
        return asked_k or cache_type_v, cache_type_v
    cache_type_k = asked_k or "bf16"
    if cache_type_k == cache_type_v and cache_type_k in ("f16", "f32"):
        logger.warning("%s: deterministic mode keeps K and V caches of different types with this llama.cpp build "
                       "(no batch-invariant tiled attention); K is bf16", config.id)
        cache_type_k = "bf16"
    return cache_type_k, cache_type_v


def rope_scaling(config: ModelConfig, model: LlamaModel) -> str | None:
    """The RoPE scaling an engine applies itself (None: the GGUF's own). A model read past the
    context it was trained on sees positions it never learnt, and answers with noise; YaRN
    stretches them over ctx_size instead."""
    if config.rope_scaling in ("yarn", "linear"):
        return config.rope_scaling
    if config.rope_scaling == "gguf" or config.ctx_size <= model.n_ctx_train:
        return None
    architecture = model.metadata("general.architecture")
    own = model.metadata(f"{architecture}.rope.scaling.type")
    return "yarn" if own in (None, "", "none") else None


def lora_identities(config: ModelConfig, directory: Path | None) -> dict[str, str]:
    """Each adapter's file identity (file_identity: hashed once per file version, remembered in
    the prompt cache's directory when there is one)."""
    known = directory / IDENTITIES_FILE if directory is not None else None
    return {adapter.name: str(file_identity(adapter.path, known=known)["sha256"]) for adapter in config.loras}


def reranks(config: ModelConfig, model: LlamaModel | None) -> bool:
    """Whether the model serves /v1/rerank: asked for, or a GGUF that declares rank pooling."""
    return config.rerank or (model is not None and model_pooling(model, None) == "rank")


def rerank_template(config: ModelConfig, model: LlamaModel) -> str | None:
    """A reranker's prompt for a (query, document) pair, the GGUF's own ("" where it has none:
    the pair is then joined as llama-server joins it); None for a model that does not rerank."""
    return (model.metadata("tokenizer.chat_template.rerank") or "") if reranks(config, model) else None


def engine_config(config: ModelConfig, *, threads: int, limits: Limits | None = None,
                  model: LlamaModel | None = None) -> EngineConfig:
    deterministic = is_deterministic(config)
    cache_type_k, cache_type_v = kv_cache_types(config)
    rank = reranks(config, model)
    return EngineConfig(
        slots=config.slots,
        ctx_size=config.ctx_size,
        rope_scaling=rope_scaling(config, model) if model is not None else None,
        trained_ctx=model.n_ctx_train if model is not None else 0,
        batch_size=max(config.batch_size, config.slots),
        threads=config.threads or threads,
        adapt_threads=config.adapt_threads,
        prompt_cache_mib=config.prompt_cache_mib,
        max_queue=config.max_queue,
        queue_policy=config.queue_policy,
        stream_interval_s=config.stream_interval_ms / 1000,
        swa_full=config.swa_full,
        flash_attn="on" if deterministic else config.gpu.flash_attn,
        cache_type_k=cache_type_k,
        cache_type_v=cache_type_v,
        op_offload=not deterministic,
        grammar_step_ms=(limits or Limits()).grammar_step_ms,
        embeddings=config.embeddings or rank,
        embedding_pooling="rank" if rank else config.embedding_pooling,
        loras=tuple((adapter.name, str(adapter.path)) for adapter in config.loras),
        speculation=SpeculationConfig(kind=config.spec_type, draft_max=config.spec_draft_max,
                                      draft_min=min(config.spec_draft_min, config.spec_draft_max)),
    )


def load_weights(config: ModelConfig, path: Path) -> list[LlamaModel]:
    """The weights each replica uses: one copy per GPU for GPU replicas, one shared copy
    otherwise (replicas on the CPU, or several replicas on one GPU)."""
    gpu = config.gpu
    repack = repacks_weights(config)
    if config.gpus and gpu_offload_available():
        return [LlamaModel(path, n_gpu_layers=gpu.n_gpu_layers, main_gpu=device, split_mode="none")
                for device in config.gpus]
    if config.gpus:
        logger.warning("%s asks for GPUs %s, but this llama.cpp build has no GPU backend: serving on the CPU",
                       config.id, config.gpus)
    model = LlamaModel(path, n_gpu_layers=gpu.n_gpu_layers, main_gpu=gpu.main_gpu, split_mode=gpu.split_mode,
                       tensor_split=gpu.tensor_split, repack=repack)
    return [model] * config.replica_count


# The CPU kernel set of this process, fixed by its first model: ggml reads its switches
# (DETERMINISTIC_SWITCHES) once per process, so they cannot differ between models.
_process_deterministic: bool | None = None


def mixed_kernels_error(modes: dict[str, bool]) -> str | None:
    """Why these models (id -> deterministic) cannot share one process, if they cannot."""
    if len(set(modes.values())) < 2:
        return None
    exact = sorted(model for model, deterministic in modes.items() if deterministic)
    fast = sorted(model for model, deterministic in modes.items() if not deterministic)
    return (f"deterministic models ({', '.join(exact)}) and models on the fastest kernels ({', '.join(fast)}) "
            f"cannot share one server process: llama.cpp's kernel switches ({', '.join(DETERMINISTIC_SWITCHES)}) "
            "are process-wide. "
            "Give them all the same `deterministic` setting, serve them from two servers, or use --backend ray "
            "(a process per replica)")


def check_kernel_modes(configs: list[ModelConfig]) -> None:
    """Refuse, before anything loads, a local server mixing deterministic and fastest-kernel
    models (a model on a GPU counts as fastest: its CPU work takes the tiled kernels)."""
    problem = mixed_kernels_error({config.id: is_deterministic(config) for config in configs})
    if problem:
        raise ValueError(problem)


def prepare_process(config: ModelConfig) -> None:
    """Process-wide llama.cpp switches a model needs, set before its first decode."""
    global _process_deterministic
    deterministic = is_deterministic(config)
    if _process_deterministic is not None and _process_deterministic != deterministic:
        raise ValueError(mixed_kernels_error({config.id: deterministic, "the models loaded before it":
                                              _process_deterministic}))
    _process_deterministic = deterministic
    if deterministic:
        os.environ.update(deterministic_switches())
        if not llamafile_is_batch_invariant():
            logger.warning("%s: this llama.cpp build has llamafile's kernels without fastrun's batch-invariant switch "
                           "(patches/llama.cpp): answers may depend on batching and caching; `make setup` builds it",
                           config.id)


def llama_cpp_build() -> dict[str, object] | None:
    """How the installed llama-cpp-python was built (scripts/build_llama_cpp_python.sh writes it
    beside the package: the patches' digest and the CMake options); None for a build of
    someone else's, which then shares no state with ours."""
    try:
        return json.loads(Path(llama_cpp.__file__).with_name("fastrun_build.json").read_text())
    except (OSError, ValueError):
        return None


def disk_cache_for(config: ModelConfig, settings: EngineConfig, model: LlamaModel, path: Path,
                   directory: Path | None, mmproj: Path | None = None) -> DiskPromptCache | None:
    """The disk tier of the model's prompt cache, in a namespace of everything a saved state
    depends on: the model file, the KV layout and the llama.cpp build."""
    if directory is None or config.prompt_cache_disk_gib <= 0:
        return None
    # A scaled RoPE writes other keys: such states live apart (and the unscaled ones where they were).
    scaled = {"rope": [settings.rope_scaling, settings.trained_ctx, settings.ctx_size]} if settings.rope_scaling else {}
    # An image's KV is keyed by its pixels; what they became is the projector's doing.
    projected = {"mmproj": file_identity(mmproj, known=directory / IDENTITIES_FILE)} if mmproj else {}
    namespace = namespace_of(
        model=file_identity(path, known=directory / IDENTITIES_FILE), n_swa=model.n_swa, swa_full=settings.swa_full,
        **scaled, **projected,
        type_k=settings.cache_type_k, type_v=settings.cache_type_v, flash_attn=settings.flash_attn,
        deterministic=is_deterministic(config), repacked=repacks_weights(config), llama_cpp=llama_cpp.__version__,
        build=system_info(), sources=llama_cpp_build(),
    )
    return DiskPromptCache(directory, namespace, int(config.prompt_cache_disk_gib * 2**30))


async def load_local_runtime(config: ModelConfig, *, threads: int, faults_spec: str = "",
                             prompt_cache_dir: Path | None = None, limits: Limits | None = None) -> ModelRuntime:
    """Pull (if from the Hub) and load the GGUF and start its engines in this process."""
    load_delay = Faults.parse(faults_spec).load_delay_s
    if load_delay:
        await asyncio.sleep(load_delay)
    prepare_process(config)
    path = await asyncio.to_thread(config.resolve_path)
    weights = await asyncio.to_thread(load_weights, config, path)
    model = weights[0]
    settings = engine_config(config, threads=threads, limits=limits, model=model)
    if settings.rope_scaling is not None:
        logger.info("%s: positions %s-scaled from the %d-token context it was trained on to %d", config.id,
                    settings.rope_scaling, model.n_ctx_train, settings.ctx_size)
    elif settings.ctx_size > model.n_ctx_train:
        logger.warning("ctx_size %d exceeds the %d tokens %s was trained on; answers may degrade past that",
                       settings.ctx_size, model.n_ctx_train, config.id)
    if is_deterministic(config) and model.n_swa > 0 and not settings.swa_full:
        logger.warning("%s: with --no-swa-full, sliding-window KV is a ring buffer whose cell order depends on "
                       "each slot's history: cache hits are not bit-exact (use --swa-full for that)", config.id)
    chat_template, tool_parser, reasoning_parser = chat_setup(config, model)
    grammars = GrammarCompiler(model, limits, isolated=True, hang_on_request=Faults.parse(faults_spec).grammar_hang)
    mmproj = await asyncio.to_thread(config.resolve_mmproj)
    disk = await asyncio.to_thread(disk_cache_for, config, settings, model, path, prompt_cache_dir, mmproj)
    draft = None
    if settings.speculation.kind == "draft":
        draft_path = await asyncio.to_thread(config.resolve_draft_path)
        draft = await asyncio.to_thread(LlamaModel, draft_path, n_gpu_layers=config.gpu.n_gpu_layers,
                                        repack=repacks_weights(config))
        weights.append(draft)  # freed with the rest
    pool = EnginePool([
        AsyncEngine(weights[i], settings, grammars, Faults.parse(faults_spec, replica=i), disk, draft,
                    name=f"local-{i}")
        for i in range(config.replica_count if not config.gpus else len(config.gpus))
    ], disk)
    deterministic = is_deterministic(config)
    template = rerank_template(config, model)
    projector = None
    if mmproj is not None:
        projector = await asyncio.to_thread(Projector, mmproj, model, threads=threads,
                                            use_gpu=uses_gpu(config))
    info = ModelInfo(
        id=config.id, path=str(path), description=model.description, n_vocab=model.n_vocab,
        n_ctx_train=model.n_ctx_train, max_context=settings.ctx_size, slots=pool.slots, replicas=pool.replicas,
        deterministic=deterministic,
        embedding_dimensions=model.n_embd if config.embeddings and template is None else None,
        rerank_template=template,
        lora_identities=await asyncio.to_thread(lora_identities, config, prompt_cache_dir),
        vision=projector is not None and projector.vision,
    )
    logger.info(
        "serving %s (%s): %d x %d slots x %d-token context, batch %d, %d threads, KV %s/%s, %s; "
        "tool calls: %s, reasoning: %s",
        config.id, path, pool.replicas, settings.slots, settings.ctx_size, settings.batch_size, settings.threads,
        settings.cache_type_k, settings.cache_type_v,
        "deterministic (batch-invariant kernels)" if deterministic else "fastest kernels (not batch-invariant)",
        tool_parser.name, reasoning_parser.name if reasoning_parser else "none",
    )
    return ModelRuntime(config=config, info=info, tokenizer=model, engine=pool, chat_template=chat_template,
                        tool_parser=tool_parser, reasoning_parser=reasoning_parser, grammars=grammars,
                        weights=weights, projector=projector)
