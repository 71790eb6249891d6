"""The kernels the deterministic mode admits (patches/llama.cpp: the batch-invariant tiled
attention kernel, f16 K and V; Q4_0, IQ4_NL and Q4_K weights repacked for the kernels whose
one-row path computes a row as the many-row path does; llamafile's tinyBLAS where a row comes out
the same in any batch; llama.cpp's tiled K-quant kernels from 8 rows, with a one-row kernel that
adds as they do) compute every row the same whatever the batch: a text's logits at every
position are bit for bit the same evaluated whole, one token at a time, in uneven chunks, or
after another sequence's cells and beside it in every batch. On SmolLM2 (Q4_1, full attention,
3 query heads per KV head), on Gemma 3 (Q4_K_M: Q4_K weights repacked, Q5_0 and Q8_0 on
tinyBLAS; a 512-token sliding window, 4 query heads per KV head; 700 tokens, so the window
slides), and on SmolLM2 requantized to Q4_0 and IQ4_NL (repacked), Q8_0 and Q5_0 (tinyBLAS from
two rows, vec_dot for one), F16 and BF16 (tinyBLAS for every row count), Q4_0 and IQ4_NL
again unpacked (tinyBLAS: from two rows, and for every row count), and Q4_K_M unpacked and
Q5_K_M (Q4_K, Q5_K and Q6_K on the tiled kernels); and on a random model 256 wide at Q2_K (Q2_K,
Q3_K and Q6_K on the tiled kernels)."""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys

from pathlib import Path

import llama_cpp.llama_cpp as llama
import pytest

from fastrun_cpp.engine.backend import system_info
from fastrun_cpp.runtime.model_runtime import (DETERMINISTIC_SWITCHES, deterministic_switches,
                                               llamafile_is_batch_invariant, repacked_weights_are_batch_invariant,
                                               tiled_attention_is_batch_invariant, tiled_matmul_is_batch_invariant)

ROOT = Path(__file__).resolve().parent.parent


def test_the_build_has_every_kernel_switch():
    """`make setup` builds llama.cpp with patches/llama.cpp: without them deterministic mode would
    take other kernels, and this module's checks would prove nothing."""
    assert tiled_attention_is_batch_invariant(), "no GGML_CPU_FA_BATCH_INVARIANT switch"
    assert repacked_weights_are_batch_invariant(), "no GGML_CPU_REPACK_BATCH_INVARIANT switch"
    assert llamafile_is_batch_invariant(), "llamafile's kernels without GGML_CPU_LLAMAFILE_BATCH_INVARIANT"
    assert tiled_matmul_is_batch_invariant(), "no GGML_CPU_TILED_BATCH_INVARIANT switch"


def probe(model_path, tokens: int, switches: dict[str, str] | None = None,
          repack: bool = True, cache_type: str = "f16") -> tuple[dict[str, list[int]], str]:
    """The positions whose logits differ, by way of evaluating, and llama.cpp's log; with
    deterministic mode's switches unless told others."""
    switches = deterministic_switches() if switches is None else switches
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("GGML_CPU_")}, **switches}
    command = [sys.executable, "-m", "tests.batch_invariance_probe", str(model_path), str(tokens)]
    command += ["--cache-type", cache_type] + ([] if repack else ["--no-repack"])
    result = subprocess.run(command,
                            capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    return json.loads(result.stdout.strip().splitlines()[-1]), result.stderr


def requantized(source: Path, target: Path, ftype: int) -> Path:
    """The model requantized by llama.cpp's quantizer (from Q4_1: the answers are worse, the
    kernels the same as a model published in that type)."""
    params = llama.llama_model_quantize_default_params()
    params.ftype, params.allow_requantize, params.nthread = ftype, True, 2
    assert llama.llama_model_quantize(str(source).encode(), str(target).encode(), ctypes.byref(params)) == 0
    return target


# Tokens evaluated per model. Q4_1 keeps ggml's per-row kernels; Q4_K (Gemma's attention output
# and half its FFN down projections), Q4_0 and IQ4_NL take the repacked kernels; Q8_0, Q5_0, F16
# and BF16 take llamafile's tinyBLAS (Gemma's other weights are Q5_0 and Q8_0).
# "…-unpacked": Q4_0 and IQ4_NL in ggml's layout, on tinyBLAS (as a weight whose rows do not
# divide by 8 is served), and Q4_K on the tiled kernels. The K-quant models' K-quant weights are
# the FFN down projections (Q4_K and Q6_K, Q5_K and Q6_K): the others' rows of 576 do not divide
# into 256-wide blocks, and the quantizer falls back to Q5_0 / Q8_0 for them.
MODELS = {"smollm2": 300, "gemma3": 700, "smollm2-q4_0": 300, "smollm2-iq4_nl": 300,
          "smollm2-q8_0": 200, "smollm2-q5_0": 200, "smollm2-f16": 200, "smollm2-bf16": 200,
          "smollm2-q4_0-unpacked": 200, "smollm2-iq4_nl-unpacked": 200,
          "smollm2-q4_k_m-unpacked": 200, "smollm2-q5_k_m": 200, "random-q2_k": 200}
REQUANTIZED = {"smollm2-q4_0": llama.LLAMA_FTYPE_MOSTLY_Q4_0, "smollm2-iq4_nl": llama.LLAMA_FTYPE_MOSTLY_IQ4_NL,
               "smollm2-q8_0": llama.LLAMA_FTYPE_MOSTLY_Q8_0, "smollm2-q5_0": llama.LLAMA_FTYPE_MOSTLY_Q5_0,
               "smollm2-f16": llama.LLAMA_FTYPE_MOSTLY_F16, "smollm2-bf16": llama.LLAMA_FTYPE_MOSTLY_BF16,
               "smollm2-q4_0-unpacked": llama.LLAMA_FTYPE_MOSTLY_Q4_0,
               "smollm2-iq4_nl-unpacked": llama.LLAMA_FTYPE_MOSTLY_IQ4_NL,
               "smollm2-q4_k_m-unpacked": llama.LLAMA_FTYPE_MOSTLY_Q4_K_M,
               "smollm2-q5_k_m": llama.LLAMA_FTYPE_MOSTLY_Q5_K_M}
# SmolLM2's rows of 576 keep Q2_K out of it: a random model 256 wide takes Q2_K for its attention
# and FFN up/gate, Q3_K for its FFN down and V, Q6_K for its (tied) output.
WIDE_RANDOM = {"block_count": 2, "embedding_length": 256, "feed_forward_length": 512, "head_count": 4,
               "head_count_kv": 4, "context_length": 8192}
REPACKED = {"gemma3", "smollm2-q4_0", "smollm2-iq4_nl"}


@pytest.mark.parametrize("model", list(MODELS))
def test_rows_do_not_depend_on_the_batch(model, gemma_path, tmp_path):
    from fastrun_cpp.default_model import embedded_model_path

    if model == "gemma3":
        path = gemma_path
    elif model == "random-q2_k":
        from fastrun_cpp.tiny_model import write_tiny_model

        source = write_tiny_model(tmp_path / "random-f32.gguf", embedded_model_path(), shape=WIDE_RANDOM)
        path = requantized(source, tmp_path / f"{model}.gguf", llama.LLAMA_FTYPE_MOSTLY_Q2_K)
    elif model in REQUANTIZED:
        path = requantized(embedded_model_path(), tmp_path / f"{model}.gguf", REQUANTIZED[model])
    else:
        path = embedded_model_path()
    differing, log = probe(path, MODELS[model], repack=not model.endswith("-unpacked"))
    assert len(differing) == 3
    assert differing == {way: [] for way in differing}, differing  # positions whose logits differ
    if model in REPACKED and repacked_weights_are_batch_invariant() and "AVX2 = 1" in system_info():
        # Its weights did take the repacked kernels (one-row and many-row) checked above.
        assert "CPU_REPACK model buffer size" in log, log[-2000:]
    if model.endswith("-unpacked"):
        assert "CPU_REPACK model buffer size" not in log, log[-2000:]


@pytest.mark.parametrize("model, cache_type", [("smollm2", "q8_0"), ("smollm2", "q4_0"), ("smollm2", "iq4_nl"),
                                               ("gemma3", "q8_0")])
def test_a_quantized_kv_cache_keeps_rows_independent_of_the_batch(model, cache_type, gemma_path):
    """--cache-type-k / -v (docs/caching-and-determinism.md): K and V of a quantized (or bf16)
    type take llama.cpp's one-row flash-attention kernel, whatever the batch, so exact mode's
    promise holds for every type it offers."""
    from fastrun_cpp.default_model import embedded_model_path

    path = gemma_path if model == "gemma3" else embedded_model_path()
    differing, _ = probe(path, MODELS[model], cache_type=cache_type)
    assert len(differing) == 3
    assert differing == {way: [] for way in differing}, differing


def test_an_f16_kv_cache_differs_without_the_attention_switch():
    """What the probe sees of the KV cache: with f16 K and V and no switches, llama.cpp's tiled
    attention kernels are picked by batch shape, and a row's logits change with its batch."""
    from fastrun_cpp.default_model import embedded_model_path

    differing, _ = probe(embedded_model_path(), 200, switches={}, cache_type="f16")
    assert any(differing.values()), differing


def test_one_row_f16_products_differ_without_the_llamafile_switch(tmp_path):
    """What the switch is for, and that the probe sees it: upstream sends a one-row F16 product
    to ggml's vec_dot, which adds in another order than tinyBLAS does for a prompt's rows."""
    from fastrun_cpp.default_model import embedded_model_path

    path = requantized(embedded_model_path(), tmp_path / "smollm2-f16.gguf", llama.LLAMA_FTYPE_MOSTLY_F16)
    switches = {k: v for k, v in DETERMINISTIC_SWITCHES.items() if k != "GGML_CPU_LLAMAFILE_BATCH_INVARIANT"}
    differing, _ = probe(path, 64, switches)
    assert any(differing.values()), differing


def test_one_row_k_quant_products_differ_without_the_tiled_switch(tmp_path):
    """What the tiled switch is for, and that the probe sees it: upstream's tiled K-quant kernels
    take batches of 8 rows or more, and ggml's vec_dot, which adds in another order, fewer."""
    from fastrun_cpp.default_model import embedded_model_path

    path = requantized(embedded_model_path(), tmp_path / "smollm2-q6_k.gguf", llama.LLAMA_FTYPE_MOSTLY_Q6_K)
    switches = {k: v for k, v in DETERMINISTIC_SWITCHES.items() if k != "GGML_CPU_TILED_BATCH_INVARIANT"}
    differing, _ = probe(path, 64, switches)
    assert any(differing.values()), differing
