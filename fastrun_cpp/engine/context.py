"""The llama.cpp context an engine decodes in, made from its configuration."""

from __future__ import annotations

from typing import TYPE_CHECKING

import llama_cpp.llama_cpp as llama

from fastrun_cpp.engine.errors import EngineError
from fastrun_cpp.engine.model import LlamaModel

if TYPE_CHECKING:
    from fastrun_cpp.engine.engine import EngineConfig

FLASH_ATTN = {
    "auto": llama.LLAMA_FLASH_ATTN_TYPE_AUTO,
    "on": llama.LLAMA_FLASH_ATTN_TYPE_ENABLED,
    "off": llama.LLAMA_FLASH_ATTN_TYPE_DISABLED,
}
CACHE_TYPES = {
    "f32": llama.GGML_TYPE_F32, "f16": llama.GGML_TYPE_F16, "bf16": 30,  # GGML_TYPE_BF16, not exported
    "q8_0": llama.GGML_TYPE_Q8_0,
    "q4_0": llama.GGML_TYPE_Q4_0, "q4_1": llama.GGML_TYPE_Q4_1, "q5_0": llama.GGML_TYPE_Q5_0,
    "q5_1": llama.GGML_TYPE_Q5_1, "iq4_nl": llama.GGML_TYPE_IQ4_NL,
}
_ROPE_SCALING = {"yarn": llama.LLAMA_ROPE_SCALING_TYPE_YARN, "linear": llama.LLAMA_ROPE_SCALING_TYPE_LINEAR}


def micro_batch_size(config: EngineConfig) -> int:
    """llama.cpp's n_ubatch: the most rows it computes in one pass."""
    return min(config.batch_size, 512)


def new_context(model: LlamaModel, config: EngineConfig):
    """A context of `config.slots` sequences of `config.ctx_size` tokens each."""
    params = llama.llama_context_default_params()
    params.n_ctx = config.slots * config.ctx_size
    params.n_batch = config.batch_size
    params.n_ubatch = micro_batch_size(config)
    params.n_seq_max = config.slots
    params.n_threads = config.threads
    params.n_threads_batch = config.threads
    # A KV stream of its own per slot: attention then never spans other slots' cells, so a
    # request's output does not depend on what else is in the batch (a unified cache
    # changes reduction order and flips greedy choices).
    params.kv_unified = False
    params.swa_full = config.swa_full
    params.flash_attn_type = FLASH_ATTN[config.flash_attn]
    params.type_k = CACHE_TYPES[config.cache_type_k]
    params.type_v = CACHE_TYPES[config.cache_type_v]
    params.op_offload = config.op_offload
    params.no_perf = True
    if config.rope_scaling is not None:
        params.rope_scaling_type = _ROPE_SCALING[config.rope_scaling]
        params.rope_freq_scale = config.trained_ctx / config.ctx_size
        params.yarn_orig_ctx = config.trained_ctx
    ctx = llama.llama_init_from_model(model.handle, params)
    if not ctx:
        raise EngineError("llama.cpp could not create a context (out of memory?)")
    return ctx
