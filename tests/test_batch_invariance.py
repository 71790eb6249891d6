"""The kernels the deterministic mode admits (patches/llama.cpp: the batch-invariant tiled
attention kernel, f16 K and V; Q4_0, IQ4_NL and Q4_K weights repacked for the kernels whose
one-row path computes a row as the many-row path does) compute every row the same whatever the
batch: a text's logits at every position are bit for bit the same evaluated whole, one token at
a time, in uneven chunks, or after another sequence's cells and beside it in every batch. On
SmolLM2 (Q4_1, full attention, 3 query heads per KV head), on Gemma 3 (Q4_K_M, its Q4_K weights
repacked; a 512-token sliding window, 4 query heads per KV head; 700 tokens, so the window
slides), and on SmolLM2 requantized to Q4_0 and IQ4_NL (repacked)."""

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
from fastrun_cpp.runtime.model_runtime import (DETERMINISTIC_SWITCHES, repacked_weights_are_batch_invariant,
                                               tiled_attention_is_batch_invariant)

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.skipif(not tiled_attention_is_batch_invariant(),
                                reason="llama.cpp built without patches/llama.cpp (make setup applies them)")


def probe(model_path, tokens: int) -> tuple[dict[str, list[int]], str]:
    """The positions whose logits differ, by way of evaluating, and llama.cpp's log."""
    env = {**os.environ, **DETERMINISTIC_SWITCHES}
    result = subprocess.run([sys.executable, "-m", "tests.batch_invariance_probe", str(model_path), str(tokens)],
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


# Tokens evaluated per model. Q4_1 and Q8_0 keep ggml's per-row kernels; Q4_K (Gemma's attention
# output and half its FFN down projections), Q4_0 and IQ4_NL take the repacked kernels.
MODELS = {"smollm2": 300, "gemma3": 700, "smollm2-q4_0": 300, "smollm2-iq4_nl": 300}
REQUANTIZED = {"smollm2-q4_0": llama.LLAMA_FTYPE_MOSTLY_Q4_0, "smollm2-iq4_nl": llama.LLAMA_FTYPE_MOSTLY_IQ4_NL}
REPACKED = {"gemma3", *REQUANTIZED}


@pytest.mark.parametrize("model", list(MODELS))
def test_rows_do_not_depend_on_the_batch(model, gemma_path, tmp_path):
    from fastrun_cpp.default_model import embedded_model_path

    if model == "gemma3":
        path = gemma_path
    elif model in REQUANTIZED:
        path = requantized(embedded_model_path(), tmp_path / f"{model}.gguf", REQUANTIZED[model])
    else:
        path = embedded_model_path()
    differing, log = probe(path, MODELS[model])
    assert len(differing) == 3
    assert differing == {way: [] for way in differing}, differing  # positions whose logits differ
    if model in REPACKED and repacked_weights_are_batch_invariant() and "AVX2 = 1" in system_info():
        # Its weights did take the repacked kernels (one-row and many-row) checked above.
        assert "CPU_REPACK model buffer size" in log, log[-2000:]
