"""llama.cpp runs a batch over per-sequence KV streams as micro-batches, each taking as many
tokens from each of a run of consecutive sequence ids; each is a pass over the weights.
`micro_batches` says which passes a batch takes, and the engine prices speculation and places
requests by it, so it must agree with llama.cpp: checked here against the passes llama.cpp
really makes (counted by its graph-evaluation callback), on a full-attention model and on
Gemma 3's sliding-window cache."""

from __future__ import annotations

import ctypes

import llama_cpp.llama_cpp as llama
import pytest

from fastrun_cpp.engine.batch import TokenBatch
from fastrun_cpp.engine.model import LlamaModel
from fastrun_cpp.engine.ubatch import micro_batches, neighbours

SHAPES = [  # (sequence, tokens) in batch order, as the engine lays a step out
    [(seq, 1) for seq in range(8)],  # 8 slots decoding side by side: one pass
    [(seq, 1) for seq in range(0, 16, 2)],  # every other slot: a pass each
    [(seq, 1) for seq in range(7, -1, -1)],  # consecutive ids, but in falling order
    [(0, 1), (1, 9), (2, 1), (3, 1)],  # one slot's draft beside plain decodes
    [(0, 5), (1, 5), (2, 5), (3, 1)],  # equally long drafts of adjacent slots share a pass
    [(0, 1), (1, 1), (5, 40)],  # a prompt chunk after two decodes
    [(0, 70)],  # over n_ubatch (64): split in two
    [(seq, 9) for seq in range(8)],  # 72 rows: the run is cut where n_ubatch ends
]


def test_micro_batches_of_typical_steps():
    assert micro_batches(SHAPES[0], 512) == [8]
    assert micro_batches(SHAPES[1], 512) == [1] * 8
    assert micro_batches(SHAPES[3], 512) == [4, 8]
    assert micro_batches(SHAPES[4], 512) == [4, 12]
    assert micro_batches([], 512) == []


def test_neighbours():
    assert neighbours(3, {2, 4}) == 2
    assert neighbours(3, {4, 9}) == 1
    assert neighbours(0, {5}) == 0


def passes_llama_cpp_makes(path, shapes: list[list[tuple[int, int]]]) -> list[int]:
    get_name = llama._lib.ggml_get_name  # dlsym through libllama finds its ggml dependency
    get_name.restype, get_name.argtypes = ctypes.c_char_p, [ctypes.c_void_p]
    passes = [0]

    @llama.ggml_backend_sched_eval_callback
    def count_graphs(tensor, ask, _user_data):
        if ask and get_name(tensor) == b"result_output":  # the logits: once per graph evaluated
            passes[0] += 1
        return False

    model = LlamaModel(path, n_gpu_layers=0, repack=False)
    params = llama.llama_context_default_params()
    params.n_ctx, params.n_seq_max = 256 * 16, 16
    params.n_batch, params.n_ubatch = 128, 64
    params.n_threads = params.n_threads_batch = 2
    params.kv_unified = False  # what the engine uses
    params.swa_full = True
    params.flash_attn_type = llama.LLAMA_FLASH_ATTN_TYPE_ENABLED
    params.cb_eval = count_graphs
    ctx = llama.llama_init_from_model(model.handle, params)
    assert ctx
    counts = []
    try:
        batch = TokenBatch(128)
        for shape in shapes:
            llama.llama_memory_clear(llama.llama_get_memory(ctx), True)
            batch.clear()
            for seq, count in shape:
                batch.add(seq, [100 + i for i in range(count)], 0, logits=True)
            passes[0] = 0
            assert llama.llama_decode(ctx, batch.as_llama_batch()) == 0
            counts.append(passes[0])
    finally:
        llama.llama_free(ctx)
    return counts


@pytest.mark.parametrize("model", ["tiny", "gemma3"])
def test_micro_batches_are_the_passes_llama_cpp_makes(model, tiny_model_path, gemma_path):
    path = tiny_model_path if model == "tiny" else gemma_path
    assert passes_llama_cpp_makes(path, SHAPES) == [len(micro_batches(shape, 64)) for shape in SHAPES]
